"""The generation runner alone (serve/generations.py, no HTTP): generations run on the engine thread one pass per
call, whether or not anyone reads them, with other calls in between (draft batches first: the engine thread's
lanes) and several taking turns; the queue is bounded and times out."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from drafter_lib.serve.batching import EngineThread, Overloaded
from drafter_lib.serve.generations import GenerationRunner


class _Steps:
    """A fake generation: `n` steps, each logged with the thread it ran on (and, with a `name`, its start too)."""

    def __init__(self, n: int, log: list, delay: float = 0.0, name: str | None = None):
        self.n, self.log, self.delay, self.name, self.finish_reason = n, log, delay, name, None

    def __iter__(self):
        for i in range(self.n):
            if self.name:
                self.log.append((f"{self.name} starts", threading.get_ident()))
            time.sleep(self.delay)
            self.log.append((f"step {i}", threading.get_ident()))
            yield i
        self.finish_reason = "length"


def test_engine_thread_runs_queued_calls_before_queued_background_calls():
    worker, order, hold = EngineThread(), [], threading.Event()
    try:
        worker.submit(hold.wait)  # the thread busy: everything below queues
        futures = [worker.submit_background(order.append, "gen a"), worker.submit_background(order.append, "gen b"),
                   worker.submit(order.append, "draft 1"), worker.submit_background(order.append, "gen c"),
                   worker.submit(order.append, "draft 2")]
        hold.set()
        for f in futures:
            f.result(timeout=10)
        assert order == ["draft 1", "draft 2", "gen a", "gen b", "gen c"]  # each lane in order, drafts first
        worker.submit(hold.clear)
        last = worker.submit_background(order.append, "queued before the shutdown")
    finally:
        worker.shutdown()
    assert last.done() and order[-1] == "queued before the shutdown"
    with pytest.raises(RuntimeError):
        worker.submit_background(order.append, "late")


def test_generations_take_turns_and_a_draft_batch_waits_for_at_most_the_pass_running():
    """Three generations run at once (max_running=3), a fourth waits; their passes alternate on the engine thread,
    so a short one started last ends first; a draft batch (the first lane) submitted while they take turns runs
    before any pass that had not started yet."""
    async def main():
        worker, log, ended = EngineThread(), [], []
        loop = asyncio.get_running_loop()

        async def background(fn, *args):
            return await asyncio.wrap_future(worker.submit_background(fn, *args))

        runner = GenerationRunner(background, max_queue=4, request_timeout_s=10, max_running=3,
                                  on_finish=lambda gen, reason: ended.append(gen.name))
        try:
            streams = [(await runner.start(lambda n=n, name=name: _Steps(n, log, 0.01, name)))[1]
                       for n, name in ((40, "long a"), (40, "long b"), (4, "short"))]
            fourth = asyncio.create_task(runner.start(lambda: _Steps(2, log, 0.01, "fourth")))
            await asyncio.sleep(0.1)
            assert (runner.running, runner.waiting) == (3, 1)
            for _ in range(3):
                log.append(("draft submitted", None))
                at = len(log)
                await loop.run_in_executor(worker, lambda: log.append(("draft", threading.get_ident())))
                between = [what for what, _ in log[at:] if what.endswith("starts")]
                assert len(between) <= 1, log[at - 2:]  # (1: a pass taken off the queue just before)
                await asyncio.sleep(0.03)
            streams.append((await fourth)[1])
            for stream in streams:
                [d async for d in stream]
            assert ended.index("short") < ended.index("long a") and ended.index("fourth") < ended.index("long b")
            names = [what for what, _ in log if what.endswith("starts")]
            assert names[:names.index("short starts")].count("long a starts") < 10  # it did not wait for 40
            assert runner.idle and {t for _, t in log if t is not None} == {worker._thread.ident}
        finally:
            await runner.stop()
            worker.shutdown()

    asyncio.run(main())


def test_runner_runs_on_the_worker_without_waiting_for_the_reader_and_lets_others_in_between_steps():
    async def main():
        worker, log, ended = EngineThread(), [], []
        loop = asyncio.get_running_loop()

        async def call(fn, *args):
            return await loop.run_in_executor(worker, fn, *args)

        runner = GenerationRunner(call, max_queue=4, request_timeout_s=10,
                                  on_finish=lambda gen, reason: ended.append(reason))
        try:
            gen, stream = await runner.start(lambda: _Steps(5, log, delay=0.02))
            await asyncio.sleep(0.03)  # a /draft batch arrives during the generation's first steps
            await call(lambda: log.append(("draft", threading.get_ident())))
            while not runner.idle:  # nobody reads the stream: the generation runs to its end anyway
                await asyncio.sleep(0.01)
            assert [d async for d in stream] == [0, 1, 2, 3, 4] and ended == ["length"]
            names = [what for what, _ in log]
            assert 0 < names.index("draft") < names.index("step 4")  # between steps, not after the answer
            assert {thread for _, thread in log} == {worker._thread.ident}
            # a reader that goes away stops the generation after its current step
            def steps_run():
                return sum(what.startswith("step") for what, _ in log)

            gen, stream = await runner.start(lambda: _Steps(1000, log, delay=0.005))
            async for _ in stream:
                at_hang_up = steps_run()
                stream.abandon()
                break
            while not runner.idle:
                await asyncio.sleep(0.01)
            assert ended[-1] == "abandoned" and steps_run() - at_hang_up <= 1  # at most the step running then
        finally:
            await runner.stop()
            worker.shutdown()

    asyncio.run(main())


def test_runner_bounds_its_queue_and_times_out():
    async def main():
        worker, log = EngineThread(), []
        loop = asyncio.get_running_loop()

        async def call(fn, *args):
            return await loop.run_in_executor(worker, fn, *args)

        runner = GenerationRunner(call, max_queue=1, request_timeout_s=0.3)
        try:
            _, running = await runner.start(lambda: _Steps(40, log, delay=0.02))  # ~0.8 s
            waiting = asyncio.create_task(runner.start(lambda: _Steps(1, log)))
            await asyncio.sleep(0.05)
            assert (runner.running, runner.waiting) == (1, 1)
            with pytest.raises(Overloaded) as full:
                await runner.start(lambda: _Steps(1, log))
            assert full.value.reason == "queue_full" and full.value.retry_after_s >= 1
            with pytest.raises(Overloaded) as late:
                await waiting
            assert late.value.reason == "timeout" and runner.waiting == 0
            assert len([d async for d in running]) == 40
            def bad_prompt():
                raise ValueError("bad prompt")

            with pytest.raises(ValueError, match="bad prompt"):  # the request's own error, from its preparation
                await runner.start(bad_prompt)
            assert runner.idle
            # stopping answers the waiting ones at once, and a running one ends with the same error
            _, running = await runner.start(lambda: _Steps(40, log, delay=0.02))
            runner.request_timeout_s = 30
            waiting = asyncio.create_task(runner.start(lambda: _Steps(1, log)))
            await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await runner.stop()
            with pytest.raises(Overloaded) as stopped:
                await waiting
            assert stopped.value.reason == "shutting_down" and time.perf_counter() - t0 < 1.0
            with pytest.raises(Overloaded, match="stopped during the generation"):
                [d async for d in running]
        finally:
            await runner.stop()
            worker.shutdown()

    asyncio.run(main())

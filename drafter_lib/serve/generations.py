"""Text generations on the engine thread: a few at a time, one target pass per call, handed over through a queue.

The target and the drafter run on the worker thread that loaded the drafter (batching.EngineThread: one OpenMP team
per process). A generation advances one target pass per call to that thread (a step, or a chunk of a long prompt:
GENERATION_PREFILL_CHUNK), so the calls of /draft batches and of the other running generations come between its
passes instead of after its whole prompt or answer; the app hands the runner the thread's background lane, so a
draft batch waits for at most the one call running. Its text goes into an asyncio queue, so a slow client reading
a stream never holds the thread: the generation runs on, at the target's pace, and the client reads behind it.

At most `max_running` generations run at once (GENERATION_MAX_RUNNING, each on a KV cache of its own), taking
turns call by call; so a short answer is not held behind a long one. Waiting ones are bounded apart from /draft
requests (an answer takes seconds to minutes, a draft milliseconds): at most `max_queue` wait (GENERATION_MAX_QUEUE;
the next gets `Overloaded("queue_full")`, a 503), and one that has not started within `request_timeout_s`
(GENERATION_TIMEOUT_S) gets `Overloaded("timeout")`. Once started, a generation runs to its end (its `max_tokens`
bound it), unless its client goes away: then it stops after the current pass.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable

from drafter_lib.serve.batching import MAX_RETRY_AFTER_S, Overloaded

_END = object()


class GenerationStream:
    """The deltas of a running generation, in order: `async for delta in stream`. Raises what the generation
    raised. `abandon()` (the client went away) stops the generation after its current pass."""

    def __init__(self):
        self._queue: asyncio.Queue = asyncio.Queue()  # unbounded: at most max_tokens deltas
        self.abandoned = False

    def abandon(self) -> None:
        self.abandoned = True

    def put(self, item) -> None:
        """A delta, an exception to raise to the reader, or the end."""
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self._deltas()

    async def _deltas(self):
        while (item := await self._queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item


class GenerationRunner:
    """Runs generations (iterables of deltas whose `__next__` does one target pass) on the engine thread through
    `call_in_worker`, at most `max_running` at once. A request counts as waiting from its admission (its prompt's
    tokenization, on the engine thread too, included), so a full queue is refused at once however busy the thread
    is. `on_finish(generation, reason)` is told how each ended: its own finish reason, "abandoned" or "error"."""

    def __init__(self, call_in_worker: Callable[..., Awaitable], max_queue: int | None = None,
                 request_timeout_s: float | None = None, on_finish: Callable | None = None, max_running: int = 1):
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.call_in_worker = call_in_worker
        self.max_queue, self.request_timeout_s, self.max_running = max_queue, request_timeout_s, max_running
        self.on_finish = on_finish or (lambda generation, reason: None)
        self.waiting = 0  # admitted, waiting for a running one to end
        self.running = 0  # 0..max_running
        self.closed = False
        self._stopped = asyncio.Event()  # set by stop(): wakes the waiting requests
        self._slots = asyncio.Semaphore(max_running)
        self._tasks: set[asyncio.Task] = set()  # strong references: the loop keeps only weak ones
        self._mean_s = 0.0  # moving average of a generation's seconds (Retry-After)

    @property
    def idle(self) -> bool:
        return self.waiting == 0 and self.running == 0

    def retry_after_s(self) -> int:
        turns = self.waiting / self.max_running + 1  # generations that end before a slot is this one's
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(turns * self._mean_s))))

    async def start(self, prepare: Callable[[], Iterable]) -> tuple[Iterable, GenerationStream]:
        """Admit a generation (a full queue: `Overloaded` at once), make it with `prepare()` on the engine thread (it
        may raise: the request's own error), wait for a running one to end if `max_running` run (`Overloaded` once
        GENERATION_TIMEOUT_S has passed since admission), then run it in the background. Returns (generation, its
        stream)."""
        if self.closed:
            raise Overloaded("shutting_down", "server is shutting down", 1)
        if self.max_queue is not None and self.waiting >= self.max_queue:
            raise Overloaded("queue_full", f"server overloaded: {self.waiting} generations already queued "
                                           f"(GENERATION_MAX_QUEUE={self.max_queue})", self.retry_after_s())
        self.waiting += 1
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        try:
            generation = await self._before(deadline, self.call_in_worker(prepare))
            await self._before(deadline, self._slots.acquire())
        finally:
            self.waiting -= 1
        if self.closed:  # stopped while this one waited: it does not start
            self._slots.release()
            raise Overloaded("shutting_down", "server is shutting down", 1)
        self.running += 1
        stream = GenerationStream()
        task = asyncio.create_task(self._run(generation, stream), name="generation")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return generation, stream

    async def _before(self, deadline: float | None, awaitable):
        """`awaitable`'s result, unless the deadline passes first (`Overloaded("timeout")`) or the runner stops
        (`Overloaded("shutting_down")`: a waiting request is answered, not left to the server's exit)."""
        work = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(self._stopped.wait())
        try:
            await asyncio.wait({work, stopped}, timeout=None if deadline is None else max(
                0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not work.done():
                work.cancel()
        if work.done() and not work.cancelled():
            return work.result()
        if self._stopped.is_set():
            raise Overloaded("shutting_down", "server is shutting down", 1)
        raise Overloaded("timeout", f"generation not started within GENERATION_TIMEOUT_S="
                                    f"{self.request_timeout_s:g} s", self.retry_after_s())

    async def _run(self, generation: Iterable, stream: GenerationStream) -> None:
        t0, reason = time.perf_counter(), "error"
        try:
            steps = iter(generation)
            while not stream.abandoned:
                delta = await self.call_in_worker(next, steps, _END)
                if delta is _END:
                    break
                stream.put(delta)
            reason = "abandoned" if stream.abandoned else getattr(generation, "finish_reason", None) or "length"
        except asyncio.CancelledError:  # stop(): the server is going away
            stream.put(Overloaded("shutting_down", "server stopped during the generation"))
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader
            stream.put(e)
        finally:
            stream.put(_END)
            seconds = time.perf_counter() - t0
            self._mean_s = seconds if self._mean_s == 0 else 0.8 * self._mean_s + 0.2 * seconds
            self.running -= 1
            self._slots.release()
            self.on_finish(generation, reason)

    async def stop(self) -> None:
        """Refuse new generations, those waiting included, and stop the running ones after their current pass."""
        self.closed = True
        self._stopped.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

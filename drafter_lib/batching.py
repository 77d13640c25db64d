"""Micro-batching of draft requests for the HTTP server.

Requests that arrive while a batch is running, or shortly after, are gathered from an asyncio queue and drafted
with one `engine.draft_batch` call, so concurrent clients share forward passes. The engine is not thread-safe,
so exactly one worker thread ever touches it; the event loop only queues and waits.

When to start a batch: at once if it already holds as many requests as recently ran concurrently (a lone client
never waits); otherwise wait a little for the others - they are typically the clients of the batch that just
finished, whose next requests are a round trip away. Without that wait, 8 clients settle into two alternating
half-size cohorts and lose most of the batching gain. The wait is bounded by `window_s` and by a fraction of the
recent batch compute time, so it stays small next to the work it saves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

# run_batch(list_of_token_lists, k) -> list of drafts; called only from the single worker thread.
RunBatch = Callable[[Sequence[Sequence[int]], int], list]

WAIT_FRACTION = 0.1  # wait for stragglers at most this fraction of a typical batch's compute time
PEAK_MEMORY_S = 2.0  # how long a burst of concurrency is remembered when deciding whether to wait


@dataclass
class DraftResult:
    draft: list[int]
    batch_size: int  # requests that shared this forward pass (same k)
    queue_ms: float  # waiting in the queue before the batch started
    compute_ms: float  # wall time of the draft_batch call
    extra: dict = field(default_factory=dict)  # per-request engine stats, if the engine gives any


@dataclass
class _Pending:
    tokens: list[int]
    k: int
    future: asyncio.Future
    enqueued: float


class MicroBatcher:
    """Gathers concurrent `submit` calls into `run_batch` calls on one dedicated thread."""

    def __init__(self, run_batch: RunBatch, window_s: float = 0.02, max_batch: int = 32,
                 run_one: Callable[[Sequence[int], int], list] | None = None):
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.run_batch = run_batch
        # Fallback used when a whole batch fails: retry each request alone so one bad request cannot fail others.
        self.run_one = run_one or (lambda tokens, k: run_batch([tokens], k)[0])
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight = 0  # submitted and not yet answered
        self._peak, self._peak_at = 0, 0.0  # recent peak of _inflight
        self._compute_s = 0.0  # moving average of batch compute time
        self.stats = {"requests": 0, "batches": 0, "max_batch_seen": 0}

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        self._task = asyncio.create_task(self._loop(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._queue is not None:  # fail whatever is still waiting instead of leaving clients hanging
            while not self._queue.empty():
                p = self._queue.get_nowait()
                if not p.future.done():
                    p.future.set_exception(RuntimeError("server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def call_in_worker(self, fn, *args):
        """Run `fn` on the engine's thread (anything else that touches the engine, e.g. info())."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def submit(self, tokens: list[int], k: int) -> DraftResult:
        if self._queue is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        now = time.perf_counter()
        self._inflight += 1
        if self._inflight >= self._peak or now - self._peak_at > PEAK_MEMORY_S:
            self._peak, self._peak_at = self._inflight, now
        fut = asyncio.get_running_loop().create_future()
        try:
            await self._queue.put(_Pending(tokens, k, fut, now))
            return await fut
        finally:
            self._inflight -= 1

    def _expected(self) -> int:
        """How many requests a batch should hold before starting without waiting."""
        recent = self._peak if time.perf_counter() - self._peak_at <= PEAK_MEMORY_S else 1
        return max(1, min(recent, self.max_batch))

    async def _gather(self) -> list[_Pending]:
        batch = [await self._queue.get()]
        while not self._queue.empty() and len(batch) < self.max_batch:  # everything already waiting joins
            batch.append(self._queue.get_nowait())
        wait = min(self.window_s, WAIT_FRACTION * self._compute_s)
        deadline = time.perf_counter() + wait
        while len(batch) < self._expected():
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        while True:
            batch = await self._gather()
            batch = [p for p in batch if not p.future.done()]  # client went away while queued
            # draft_batch takes one k; requests with different k run as separate calls (a longer greedy draft
            # truncated is not guaranteed to equal a shorter one once a copy prior is involved).
            by_k: dict[int, list[_Pending]] = {}
            for p in batch:
                by_k.setdefault(p.k, []).append(p)
            for k, group in by_k.items():
                await self._run_group(k, group)

    async def _run_group(self, k: int, group: list[_Pending]) -> None:
        started = time.perf_counter()
        try:
            outs = await self.call_in_worker(self.run_batch, [p.tokens for p in group], k)
            if len(outs) != len(group):
                raise RuntimeError(f"draft_batch returned {len(outs)} drafts for {len(group)} requests")
            results = [(o, None) for o in outs]
        except Exception as batch_error:  # noqa: BLE001 - handed to the waiting request(s)
            if len(group) == 1:
                results = [(None, batch_error)]
            else:
                results = []
                for p in group:
                    try:
                        results.append((await self.call_in_worker(self.run_one, p.tokens, k), None))
                    except Exception as e:  # noqa: BLE001
                        results.append((None, e))
        compute_s = time.perf_counter() - started
        self._compute_s = compute_s if self.stats["batches"] == 0 else 0.8 * self._compute_s + 0.2 * compute_s
        self.stats["requests"] += len(group)
        self.stats["batches"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(group))
        for p, (out, err) in zip(group, results):
            if p.future.done():
                continue
            if err is not None:
                p.future.set_exception(err)
                continue
            draft, extra = _split(out)
            p.future.set_result(DraftResult(draft=draft, batch_size=len(group),
                                            queue_ms=(started - p.enqueued) * 1e3, compute_ms=compute_s * 1e3,
                                            extra=extra))


def _split(out) -> tuple[list[int], dict]:
    """Engines return a plain token list, or (tokens, stats dict) when they report per-request stats."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
        return [int(t) for t in out[0]], dict(out[1])
    return [int(t) for t in out], {}

"""Micro-batching of draft requests for the HTTP server.

Requests that arrive while a batch is running, or shortly after, are gathered from an asyncio queue and drafted
with one `engine.draft_batch` call, so concurrent clients share forward passes. The engine is not thread-safe,
so exactly one worker thread ever touches it; the event loop only queues and waits. That thread should also load
the engine (`EngineThread`): torch's OpenMP runtime (libgomp) gives every thread that runs a parallel op its own
team of threads, and once a process holds more of them than there are cores it cuts every wait's spin to 1,000
iterations, so each op of a step wakes a sleeping thread again (a warm 16-token draft of the shipped model on a
2-core AMD EPYC: 27 ms loaded and run on one thread, 101-121 ms run on another thread than the one that loaded it).

When to start a batch: at once if it already holds as many requests as recently ran concurrently (a lone client
never waits); otherwise wait a little for the others - they are typically the clients of the batch that just
finished, whose next requests are a round trip away. Without that wait, 8 clients settle into two alternating
half-size cohorts and lose most of the batching gain. The wait is bounded by `window_s` and by a fraction of the
recent batch compute time, so it stays small next to the work it saves.

Overload is bounded: at most `max_queue` requests wait for a batch (beyond that `submit` raises `Overloaded` at
once), and a request not answered within `request_timeout_s` raises `Overloaded` too (its work, if already
running, finishes and is dropped). The server turns both into 503 + Retry-After.

Per-request options (`min_confidence`, `return_probs`) do not split a batch: requests with different thresholds
share one `run_batch(tokens, k, min_confidence=[...], return_probs=[...])` call (the engine takes one value per
request). A batch whose requests all use the defaults calls `run_batch(tokens, k)` as before.

Draft trees (`submit_tree`) wait in the same queue, under the same MAX_QUEUE bound and timeout, and are gathered
with the other requests, but each runs alone (`run_tree(tokens, budget=, max_depth=, branch=)`, the engine's
`draft_tree_result`, a batch of one) on the same worker thread: a tree's levels are already one pass each.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

# run_batch(list_of_token_lists, k, **per_request_options) -> list of drafts; called only from the single worker
# thread. A draft is a token list; one with a `cached_prefix_len` attribute (engine.Draft) also reports its
# prefix-cache use, one with `probs` each token's probability under the drafter.
RunBatch = Callable[..., list]
OPTION_DEFAULTS = {"min_confidence": None, "return_probs": False}  # per-request options and their "not set"

WAIT_FRACTION = 0.1  # wait for stragglers at most this fraction of a typical batch's compute time
PEAK_MEMORY_S = 2.0  # how long a burst of concurrency is remembered when deciding whether to wait
MAX_RETRY_AFTER_S = 60


class Overloaded(Exception):
    """The request was not served: `reason` is "queue_full", "timeout" or "shutting_down"; retry after
    `retry_after_s` seconds."""

    def __init__(self, reason: str, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.reason, self.retry_after_s = reason, retry_after_s


@dataclass
class DraftResult:
    draft: list[int]
    batch_size: int  # requests that shared this forward pass (same k)
    queue_ms: float  # waiting in the queue before the batch started
    compute_ms: float  # wall time of the draft_batch call
    cached_prefix_len: int | None = None  # this request's context tokens served from the prefix cache
    batch_cached_tokens: int | None = None  # the same, summed over the batch
    probs: list | None = None  # the drafter's probability of each draft token (None: copied), when computed
    tree: object = None  # a tree request's DraftTree (`draft` then holds its first chain)


@dataclass(eq=False)  # hashed by identity: kept in a set
class _Pending:
    tokens: list[int]
    k: int
    future: asyncio.Future
    enqueued: float
    options: dict  # per-request options (OPTION_DEFAULTS keys); a tree request's: budget, max_depth, branch
    queued: bool = True  # counted in the queue depth until its batch starts (or it gives up)
    tree: bool = False  # a draft tree request (runs alone)


class EngineThread(Executor):
    """One daemon thread running the calls submitted to it: the thread that loads an engine and then runs every call
    on it (see the module doc). A daemon, so Ctrl-C during a load (the kernels timed: minutes) ends the process at
    once instead of waiting for the load, as a pool's worker would make it.

    Two lanes: `submit`'s calls (draft batches, the load, info) run in order, each before any queued call of
    `submit_background` (a generation's step or prompt chunk, in order among themselves). So a draft batch waits
    for at most the one call running, however many generations take turns behind it; and the generations do not
    starve, as the batcher has one call queued at a time and the thread takes a background call between two."""

    _FIRST, _BACKGROUND, _LAST = 0, 1, 2  # lanes; _LAST: the shutdown mark, after every call already queued

    def __init__(self, name: str = "draft-engine"):
        self._calls: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()  # FIFO within a lane
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self._put(self._FIRST, fn, args, kwargs)

    def submit_background(self, fn, /, *args, **kwargs) -> Future:
        """As `submit`, run once no `submit` call is queued."""
        return self._put(self._BACKGROUND, fn, args, kwargs)

    def _put(self, lane: int, fn, args, kwargs) -> Future:
        if self._closed:
            raise RuntimeError("the engine thread is shut down")
        future: Future = Future()
        self._calls.put((lane, next(self._order), (future, fn, args, kwargs)))
        return future

    def _work(self) -> None:
        while (call := self._calls.get()[2]) is not None:
            future, fn, args, kwargs = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                    future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._calls.put((self._LAST, next(self._order), None))  # after the calls already queued
        if wait and self._thread is not threading.current_thread():
            self._thread.join()


class MicroBatcher:
    """Gathers concurrent `submit` calls into `run_batch` calls on one dedicated thread: `executor` (an
    `EngineThread` that loaded the engine), else one of its own; either is shut down at `stop`."""

    def __init__(self, run_batch: RunBatch, window_s: float = 0.02, max_batch: int = 32,
                 run_one: Callable[..., list] | None = None, max_queue: int | None = None,
                 request_timeout_s: float | None = None, executor: Executor | None = None,
                 run_tree: Callable | None = None):
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if request_timeout_s is not None and request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        self.run_batch = run_batch
        self.run_tree = run_tree  # run_tree(tokens, budget=, max_depth=, branch=) -> tree_draft.TreeDraft
        # Fallback used when a whole batch fails: retry each request alone so one bad request cannot fail others.
        self.run_one = run_one or (lambda tokens, k, **opt: run_batch([tokens], k, **{
            name: [v] for name, v in opt.items()})[0])
        self.window_s = window_s
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None
        self._executor = executor  # taken over: shut down at stop
        self._inflight = 0  # submitted and not yet answered
        self._waiting = 0  # submitted and not yet started: the queue depth that max_queue bounds
        self._peak, self._peak_at = 0, 0.0  # recent peak of _inflight
        self._compute_s = 0.0  # moving average of batch compute time
        self._mean_batch = 1.0  # moving average of batch size
        self._closed = False
        self._live: set[_Pending] = set()  # submitted and not yet answered (queued, gathered or running)
        self.stats = {"requests": 0, "batches": 0, "max_batch_seen": 0, "rejected_queue_full": 0, "timeouts": 0,
                      "trees": 0}
        self.batch_sizes: Counter[int] = Counter()  # batch size -> batches of that size

    @property
    def queue_depth(self) -> int:
        return self._waiting

    @property
    def inflight(self) -> int:
        return self._inflight

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._executor = self._executor or EngineThread()
        self._task = asyncio.create_task(self._loop(), name="micro-batcher")

    async def stop(self, wait: bool = True) -> None:
        """Fail what still waits and stop the worker; wait=False leaves a busy worker (a daemon) to the process
        exit, e.g. a model still loading."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for p in list(self._live):  # fail whatever is still waiting instead of leaving clients hanging
            self._dequeue(p)
            if not p.future.done():
                p.future.set_exception(Overloaded("shutting_down", "server is shutting down"))
        if self._executor is not None:
            self._executor.shutdown(wait=wait)

    async def call_in_worker(self, fn, *args):
        """Run `fn` on the engine's thread (anything else that touches the engine, e.g. info())."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call_in_background(self, fn, *args):
        """Run `fn` on the engine's thread behind any draft batch queued (EngineThread's background lane; another
        executor: in order): a generation's steps, so that drafts wait for at most the one call running."""
        submit = getattr(self._executor, "submit_background", None)
        if submit is None:
            return await self.call_in_worker(fn, *args)
        return await asyncio.wrap_future(submit(fn, *args))

    def retry_after_s(self) -> int:
        """Seconds until the queue has likely drained: batches ahead x recent batch time (at least 1)."""
        batches_ahead = self._waiting / max(self._mean_batch, 1.0) + 1
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(batches_ahead * self._compute_s))))

    async def submit(self, tokens: list[int], k: int, **options) -> DraftResult:
        """Draft for one request; `options`: min_confidence (None = the engine's default), return_probs."""
        unknown = set(options) - set(OPTION_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown draft options {sorted(unknown)}")
        return await self._enqueue(tokens, k, {**OPTION_DEFAULTS, **options}, tree=False)

    async def submit_tree(self, tokens: list[int], budget: int, max_depth: int, branch: int) -> DraftResult:
        """A draft tree for one request, queued like `submit` (same bounds) and run alone; the result's `tree` is
        the DraftTree, its `draft` the tree's first chain and `probs` that chain's probabilities."""
        if self.run_tree is None:
            raise ValueError("this drafter does not draft trees")
        return await self._enqueue(tokens, 0, dict(budget=budget, max_depth=max_depth, branch=branch), tree=True)

    async def _enqueue(self, tokens: list[int], k: int, options: dict, tree: bool) -> DraftResult:
        if self._queue is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        if self._closed:
            raise Overloaded("shutting_down", "server is shutting down", self.retry_after_s())
        if self.max_queue is not None and self._waiting >= self.max_queue:
            self.stats["rejected_queue_full"] += 1
            raise Overloaded("queue_full", f"server overloaded: {self._waiting} requests already queued "
                                           f"(MAX_QUEUE={self.max_queue})", self.retry_after_s())
        now = time.perf_counter()
        self._inflight += 1
        if self._inflight >= self._peak or now - self._peak_at > PEAK_MEMORY_S:
            self._peak, self._peak_at = self._inflight, now
        p = _Pending(tokens, k, asyncio.get_running_loop().create_future(), now, options, tree=tree)
        self._waiting += 1
        self._live.add(p)
        try:
            self._queue.put_nowait(p)
            return await asyncio.wait_for(p.future, self.request_timeout_s)
        except asyncio.TimeoutError:
            self.stats["timeouts"] += 1
            raise Overloaded("timeout", f"request not served within REQUEST_TIMEOUT_S={self.request_timeout_s:g} s",
                             self.retry_after_s()) from None
        finally:
            self._dequeue(p)  # a request that gave up (timeout, client gone) leaves the queue depth here
            self._live.discard(p)
            self._inflight -= 1

    def _count(self, started: float, size: int) -> float:
        """Record a finished engine call of `size` requests that started at `started`; returns its seconds."""
        compute_s = time.perf_counter() - started
        first = self.stats["batches"] == 0
        self._compute_s = compute_s if first else 0.8 * self._compute_s + 0.2 * compute_s
        self._mean_batch = size if first else 0.8 * self._mean_batch + 0.2 * size
        self.stats["requests"] += size
        self.stats["batches"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], size)
        self.batch_sizes[size] += 1
        return compute_s

    async def _run_tree(self, p: _Pending) -> None:
        started = time.perf_counter()
        self._dequeue(p)
        try:
            out = await self.call_in_worker(functools.partial(self.run_tree, p.tokens, **p.options))
            err = None
        except Exception as e:  # noqa: BLE001 - handed to the waiting request
            out, err = None, e
        compute_s = self._count(started, 1)
        self.stats["trees"] += 1
        if p.future.done():
            return
        if err is not None:
            p.future.set_exception(err)
            return
        cached = getattr(out, "cached_prefix_len", None)
        p.future.set_result(DraftResult(draft=[int(t) for t in out.chain], batch_size=1,
                                        queue_ms=(started - p.enqueued) * 1e3, compute_ms=compute_s * 1e3,
                                        cached_prefix_len=cached, batch_cached_tokens=cached,
                                        probs=list(out.chain_probs), tree=out.tree))

    def _dequeue(self, p: _Pending) -> None:
        if p.queued:
            p.queued = False
            self._waiting -= 1

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
            batch = [p for p in batch if not p.future.done()]  # client went away / timed out while queued
            # draft_batch takes one k; requests with different k run as separate calls (a longer greedy draft
            # truncated is not guaranteed to equal a shorter one once a copy prior is involved). A tree runs alone.
            by_k: dict = {}
            for p in batch:
                by_k.setdefault(id(p) if p.tree else p.k, []).append(p)
            for group in by_k.values():
                group = [p for p in group if not p.future.done()]
                if group and group[0].tree:
                    await self._run_tree(group[0])
                elif group:
                    await self._run_group(group[0].k, group)

    async def _run_group(self, k: int, group: list[_Pending]) -> None:
        started = time.perf_counter()
        for p in group:
            self._dequeue(p)
        # options only when some request sets one: engines (and fakes) without them keep working
        custom = [name for name, d in OPTION_DEFAULTS.items() if any(p.options[name] != d for p in group)]
        opts = {name: [p.options[name] for p in group] for name in custom}
        try:
            call = functools.partial(self.run_batch, [p.tokens for p in group], k, **opts)
            outs = await self.call_in_worker(call)
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
                        one = {name: p.options[name] for name in custom}
                        one_call = functools.partial(self.run_one, p.tokens, k, **one)
                        results.append((await self.call_in_worker(one_call), None))
                    except Exception as e:  # noqa: BLE001
                        results.append((None, e))
        compute_s = self._count(started, len(group))
        cached = [getattr(out, "cached_prefix_len", None) for out, _ in results]
        batch_cached = None if None in cached else sum(cached)
        for p, (out, err), c in zip(group, results, cached):
            if p.future.done():
                continue
            if err is not None:
                p.future.set_exception(err)
                continue
            p.future.set_result(DraftResult(draft=[int(t) for t in out], batch_size=len(group),
                                            queue_ms=(started - p.enqueued) * 1e3, compute_ms=compute_s * 1e3,
                                            cached_prefix_len=c, batch_cached_tokens=batch_cached,
                                            probs=getattr(out, "probs", None)))

"""Server metrics with `prometheus_client`: GET /metrics and the `metrics` block of GET /info.

Names follow vLLM's style (`vllm:e2e_request_latency_seconds`, `vllm:num_requests_waiting`, ...) under the
`specdraft:` prefix: snake case, base units, `_seconds` / `_bytes` / `_total` suffixes.

Observed per request (app.py calls `observe` for every /draft answer and `observe_draft` for each 200):
  specdraft:requests_total{status, reason}      counter: /draft answers by HTTP status; `reason` for 503s
                                                (queue_full, timeout, draining, shutting_down), "" otherwise
  specdraft:request_latency_seconds             histogram: end-to-end /draft latency of answered (200) requests
  specdraft:request_queue_time_seconds          histogram: time an answered request waited for its batch
  specdraft:draft_tokens                        histogram: draft length of each answer
  specdraft:prefix_cache_hit_tokens             histogram: context tokens of each answer served from the prefix cache
  specdraft:tree_nodes                          histogram: nodes of each answered tree request (its _count: the tree
                                                requests answered; `draft_tokens` counts their first chains)

Observed per generation, when the server serves a target (openai_api.py calls `observe_openai` for every /v1
completions answer and `observe_generation` for each generation that ran):
  specdraft:openai_requests_total{status, reason}   counter: /v1/completions and /v1/chat/completions answers by
                                                HTTP status (a stream counts when it starts); `reason` for 503s
  specdraft:generations_total{finish_reason}    counter: generations that ran, by how they ended (stop, length;
                                                abandoned: the client went away; error)
  specdraft:prompt_tokens_total                 counter: prompt tokens of those generations
  specdraft:generation_tokens_total             counter: tokens they generated
  specdraft:generation_target_steps_total       counter: their target forward passes (tokens / steps = the mean
                                                acceptance length)
  specdraft:generation_prefill_passes_total     counter: their passes over a long prompt alone, before the first
                                                step (GENERATION_PREFILL_CHUNK tokens each)
  specdraft:generations_waiting / _running      gauges, read at scrape time from the runner `bind_generations` gave

Read at scrape time from what `bind` gave (the batcher's and the engine's counters are plain numbers, read on the
event loop without touching the engine's thread):
  specdraft:batch_size                          histogram: requests per engine forward batch (one observation per
                                                batch, from MicroBatcher.batch_sizes)
  specdraft:num_requests_waiting / _running     gauges: queued for a batch / in a running batch (in flight = sum)
  specdraft:draining                            gauge: 1 while shutting down (new requests get 503)
  specdraft:prefix_cache_{bytes,peak_bytes,max_bytes,entries}            gauges
  specdraft:prefix_cache_{lookups,hits,reused_tokens,evictions}_total,
  specdraft:computed_tokens_total                                        counters (the engine's own)
  process_resident_memory_bytes and the rest of prometheus_client's ProcessCollector (Linux)

Each `Metrics` owns its `CollectorRegistry` (never the global default one), so several apps in one process do not
share or collide.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "specdraft:"
# /draft answers take a few ms to a few tens of ms; the tail reaches REQUEST_TIMEOUT_S (30 s by default) under
# overload.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
QUEUE_BUCKETS = (0.0005,) + LATENCY_BUCKETS  # most waits are below BATCH_WINDOW_MS (20 ms)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # MAX_BATCH is 32 by default
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # num_draft_tokens is 1..64, default 16
CACHE_HIT_BUCKETS = (0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # 0: a miss
TREE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)  # a tree's budget is 1..64
REASONS = ("queue_full", "timeout", "draining", "shutting_down")  # the 503s (batching.Overloaded, app.py)
QUANTILES = (0.5, 0.9, 0.99)
# engine.cache_info() key -> (metric name, help), read at scrape time
CACHE_GAUGES = {
    "cached_bytes": ("prefix_cache_bytes", "Bytes of K/V held by the prefix cache."),
    "peak_cache_bytes": ("prefix_cache_peak_bytes", "Most bytes the prefix cache ever held."),
    "max_cache_bytes": ("prefix_cache_max_bytes", "The prefix cache's bound (MAX_CACHE_MB)."),
    "entries": ("prefix_cache_entries", "Cached prefixes."),
}
CACHE_COUNTERS = {  # exposed with a _total suffix
    "requests": ("prefix_cache_lookups", "Prefix-cache lookups (one per request the engine ran)."),
    "cache_hits": ("prefix_cache_hits", "Lookups that reused a cached prefix."),
    "reused_tokens": ("prefix_cache_reused_tokens", "Context tokens served from the prefix cache."),
    "evictions": ("prefix_cache_evictions", "Entries evicted to stay within the bound."),
    "computed_tokens": ("computed_tokens", "Tokens run through the model."),
}


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative `buckets` [(upper bound, count), ..., (inf, total)], interpolated linearly
    inside its bucket as Prometheus's histogram_quantile does (the upper bound of the last finite bucket when it
    falls in +Inf); None without observations."""
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def _families(metric) -> dict[str, list]:
    """The samples of a prometheus_client metric, by sample name."""
    out: dict[str, list] = {}
    for family in metric.collect():
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _histogram_stats(hist: Histogram, scale: float = 1.0, digits: int = 3) -> dict:
    """Percentiles, count and mean of an unlabelled histogram, its values times `scale`."""
    buckets, count, total = [], 0.0, 0.0
    for samples in _families(hist).values():
        for s in samples:
            if s.name.endswith("_bucket"):
                buckets.append((float(s.labels["le"]), s.value))
            elif s.name.endswith("_count"):
                count = s.value
            elif s.name.endswith("_sum"):
                total = s.value
    buckets.sort()

    def r(v):
        return None if v is None else round(v * scale, digits)

    return {f"p{round(q * 100)}": r(histogram_quantile(q, buckets)) for q in QUANTILES} | {
        "count": int(count), "mean": r(total / count) if count else None}


class _ServerState:
    """The collector of what is read at scrape time: the batcher's queue and batch sizes, draining, the
    generations waiting and running, and the engine's prefix-cache counters. Yields nothing until bound."""

    def __init__(self):
        self.bound = False
        self.batcher = None
        self.generations = None
        self.engine = None
        self.draining: Callable[[], bool] = lambda: False

    def current_engine(self):
        e = self.engine
        return e() if callable(e) and not hasattr(e, "cache_info") else e

    def collect(self):
        if not self.bound:
            return
        b = self.batcher
        if b is not None:
            waiting, inflight = int(b.queue_depth), int(b.inflight)
            yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting for a batch (bounded by "
                                    "MAX_QUEUE).", value=waiting)
            yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in a running engine batch "
                                    "(in flight = waiting + running).", value=max(0, inflight - waiting))
            sizes = dict(b.batch_sizes)
            cumulative = [(str(float(le)), sum(n for size, n in sizes.items() if size <= le)) for le in BATCH_BUCKETS]
            yield HistogramMetricFamily(PREFIX + "batch_size", "Requests per engine forward batch.",
                                        buckets=cumulative + [("+Inf", sum(sizes.values()))],
                                        sum_value=sum(size * n for size, n in sizes.items()))
        yield GaugeMetricFamily(PREFIX + "draining", "1 while shutting down (new requests get 503).",
                                value=int(bool(self.draining())))
        g = self.generations
        if g is not None:
            yield GaugeMetricFamily(PREFIX + "generations_waiting", "Generations waiting for a running one to "
                                    "end (bounded by GENERATION_MAX_QUEUE).", value=g.waiting)
            yield GaugeMetricFamily(PREFIX + "generations_running", "Generations running (at most "
                                    "GENERATION_MAX_RUNNING).", value=g.running)
        engine = self.current_engine()
        cache = engine.cache_info() if hasattr(engine, "cache_info") else {}
        for key, (name, doc) in CACHE_GAUGES.items():
            if cache.get(key) is not None:
                yield GaugeMetricFamily(PREFIX + name, doc, value=cache[key])
        for key, (name, doc) in CACHE_COUNTERS.items():
            if cache.get(key) is not None:
                yield CounterMetricFamily(PREFIX + name, doc, value=cache[key])


class Metrics:
    """One app's metrics: `observe` / `observe_draft` per request, `bind` once the batcher and engine exist, then
    `exposition()` for GET /metrics and `snapshot()` for GET /info."""

    def __init__(self):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(PREFIX + "requests", "POST /draft answers by HTTP status (reason: why a 503).",
                                ["status", "reason"], registry=reg)
        self.latency = Histogram(PREFIX + "request_latency_seconds", "End-to-end POST /draft latency of answered "
                                 "(200) requests.", buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Time an answered request waited for "
                                    "its batch.", buckets=QUEUE_BUCKETS, registry=reg)
        self.draft_tokens = Histogram(PREFIX + "draft_tokens", "Draft tokens per answered request.",
                                      buckets=DRAFT_BUCKETS, registry=reg)
        self.cache_hit_tokens = Histogram(PREFIX + "prefix_cache_hit_tokens", "Context tokens of an answered "
                                          "request served from the prefix cache.", buckets=CACHE_HIT_BUCKETS,
                                          registry=reg)
        self.tree_nodes = Histogram(PREFIX + "tree_nodes", "Nodes per answered draft-tree request.",
                                    buckets=TREE_BUCKETS, registry=reg)
        self.openai_requests = Counter(PREFIX + "openai_requests", "/v1/completions and /v1/chat/completions "
                                       "answers by HTTP status (reason: why a 503).", ["status", "reason"],
                                       registry=reg)
        self.generations = Counter(PREFIX + "generations", "Generations that ran, by how they ended (stop, length; "
                                   "abandoned: the client went away; error).", ["finish_reason"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the generations that ran.",
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=reg)
        self.generation_steps = Counter(PREFIX + "generation_target_steps", "Target forward passes of generations "
                                        "(generation_tokens / this = mean acceptance length).", registry=reg)
        self.prefill_passes = Counter(PREFIX + "generation_prefill_passes", "Target passes of generations over a "
                                      "long prompt alone, before their first step (GENERATION_PREFILL_CHUNK tokens "
                                      "each).", registry=reg)
        self.http_errors = Counter(PREFIX + "http_errors", "Answers of status 400 and above on any path and method, "
                                   "whoever sent them (a route, the key check, the body bound, an unexpected error); "
                                   "endpoint: the route's path, or 'other' for a path no route serves.",
                                   ["endpoint", "status"], registry=reg)
        self._endpoints: frozenset[str] = frozenset()
        for counter in (self.requests, self.openai_requests):  # known series start at 0, so rate() sees their first
            counter.labels(status="200", reason="")
            for reason in REASONS:
                counter.labels(status="503", reason=reason)
        self._state = _ServerState()
        reg.register(self._state)
        ProcessCollector(registry=reg)  # process_resident_memory_bytes etc. (Linux: it yields nothing without /proc)

    def bind(self, batcher, engine, draining: Callable[[], bool] | None = None) -> None:
        """What the scrape-time gauges read: the MicroBatcher; the engine (its `cache_info()`), or a function
        returning it (None while it loads: no cache metrics then); a function saying whether the server drains."""
        self._state.batcher, self._state.engine, self._state.bound = batcher, engine, True
        if draining is not None:
            self._state.draining = draining

    def bind_generations(self, runner) -> None:
        """The GenerationRunner whose queue the generation gauges read."""
        self._state.generations = runner

    def bind_endpoints(self, paths) -> None:
        """The paths the app routes: an error's `endpoint` label is one of them or 'other' (bounded labels)."""
        self._endpoints = frozenset(paths)

    def observe_http(self, path: str, status: int | None) -> None:
        """Every answer the server sent (logs.RequestIds): a failure (400 and above) is counted."""
        if status is not None and status >= 400:
            self.http_errors.labels(endpoint=path if path in self._endpoints else "other", status=str(status)).inc()

    def observe_openai(self, status: int, reason: str | None = None) -> None:
        """Every /v1 completions answer: its HTTP status, and for a 503 the reason."""
        self.openai_requests.labels(status=str(status), reason=reason or "").inc()

    def observe_generation(self, finish_reason: str, stats) -> None:
        """Each generation that ran: how it ended and its GenerationStats (tokens in and out, target passes)."""
        self.generations.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.generation_steps.inc(stats.target_steps)
        self.prefill_passes.inc(stats.prefill_passes)

    def observe(self, status: int, seconds: float, reason: str | None = None) -> None:
        """Every /draft answer: its HTTP status, the seconds it took, and for a 503 the reason."""
        self.requests.labels(status=str(status), reason=reason or "").inc()
        if status == 200:
            self.latency.observe(seconds)

    def observe_draft(self, queue_s: float, draft_len: int, cached_tokens: int | None) -> None:
        """Each 200 answer: seconds it waited for its batch, its draft length, and its context tokens served from
        the prefix cache (None: the engine does not say)."""
        self.queue_time.observe(max(0.0, queue_s))
        self.draft_tokens.observe(draft_len)
        if cached_tokens is not None:
            self.cache_hit_tokens.observe(cached_tokens)

    def observe_tree(self, nodes: int) -> None:
        """Each 200 answer to a tree request (after `observe_draft`): its tree's node count."""
        self.tree_nodes.observe(nodes)

    def exposition(self) -> tuple[bytes, str]:
        """GET /metrics: (body, content type) in the Prometheus text format."""
        return _generate_latest(self.registry), CONTENT_TYPE_LATEST

    def snapshot(self, batcher=None, engine=None, draining: bool | None = None) -> dict:
        """GET /info's `metrics` block, JSON-ready; arguments override what `bind` gave. Latency and queue-time
        percentiles are estimated from the histograms' buckets (cumulative since start, interpolated within a
        bucket as Prometheus's histogram_quantile does)."""
        batcher = batcher if batcher is not None else self._state.batcher
        engine = engine if engine is not None else self._state.current_engine()
        draining = bool(self._state.draining()) if draining is None else draining
        responses: dict[str, float] = {}
        rejected = dict.fromkeys(REASONS, 0)
        for s in _families(self.requests).get(PREFIX + "requests_total", []):
            status, reason = s.labels["status"], s.labels["reason"]
            responses[status] = responses.get(status, 0) + int(s.value)
            if reason:
                rejected[reason] = rejected.get(reason, 0) + int(s.value)
        cache = dict(engine.cache_info()) if hasattr(engine, "cache_info") else {}
        lookups = cache.get("requests", 0)
        queue = {} if batcher is None else {
            "queue_depth": batcher.queue_depth, "inflight": batcher.inflight, "max_queue": batcher.max_queue,
            "request_timeout_s": batcher.request_timeout_s}
        return {
            **queue, "draining": draining,
            "responses": {k: v for k, v in sorted(responses.items(), key=lambda kv: int(kv[0])) if v},
            "rejected": rejected,
            "batch_sizes": {} if batcher is None else {str(k): v for k, v in sorted(batcher.batch_sizes.items())},
            "latency_ms": _histogram_stats(self.latency, 1e3),
            "queue_ms": _histogram_stats(self.queue_time, 1e3),
            "draft_tokens": {k: v for k, v in _histogram_stats(self.draft_tokens, 1.0, 2).items()
                             if k in ("count", "mean")},  # whole numbers: interpolated percentiles would mislead
            "tree_nodes": {k: v for k, v in _histogram_stats(self.tree_nodes, 1.0, 2).items()
                           if k in ("count", "mean")},
            "cache": {**cache, "hit_rate": (cache.get("cache_hits", 0) / lookups) if lookups else None},
            "rss_bytes": rss_bytes(),
        }


__all__ = ["Metrics", "histogram_quantile", "rss_bytes", "LATENCY_BUCKETS", "QUEUE_BUCKETS", "BATCH_BUCKETS",
           "DRAFT_BUCKETS", "CACHE_HIT_BUCKETS", "TREE_BUCKETS", "REASONS"]

"""Server metrics: GET /metrics (Prometheus text format 0.0.4) and the `metrics` block of GET /info.

Queue depth, in-flight requests, answers by status code, rejections (queue full, timeout, draining), batch sizes
(histogram), /draft latency percentiles (over the last `window` answered requests), prefix-cache hit rate, bytes
and evictions, and the process's resident memory. Read on the event loop without touching the engine's thread:
the engine's `cache_info()` and the batcher's counters are plain numbers.
"""
from __future__ import annotations

import os
import time
from collections import Counter, deque

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
QUANTILES = (0.5, 0.9, 0.99)


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _quantile(sorted_xs: list[float], q: float) -> float | None:
    if not sorted_xs:
        return None
    return sorted_xs[min(len(sorted_xs) - 1, max(0, round(q * (len(sorted_xs) - 1))))]


class Metrics:
    def __init__(self, window: int = 2048):
        self.codes: Counter[int] = Counter()  # /draft answers by HTTP status
        self.rejected: Counter[str] = Counter()  # 503s by reason
        self.latencies: deque[float] = deque(maxlen=window)  # seconds, answered 200
        self.latency_sum = 0.0
        self.started = time.time()

    def observe(self, status: int, seconds: float, reason: str | None = None) -> None:
        self.codes[status] += 1
        if reason is not None:
            self.rejected[reason] += 1
        if status == 200:
            self.latencies.append(seconds)
            self.latency_sum += seconds

    def snapshot(self, batcher, engine, draining: bool = False) -> dict:
        lat = sorted(self.latencies)
        cache = engine.cache_info() if hasattr(engine, "cache_info") else {}
        lookups = cache.get("requests", 0)
        return {
            "queue_depth": batcher.queue_depth, "inflight": batcher.inflight, "draining": draining,
            "max_queue": batcher.max_queue, "request_timeout_s": batcher.request_timeout_s,
            "responses": {str(k): v for k, v in sorted(self.codes.items())},
            "rejected": {r: self.rejected.get(r, 0) for r in ("queue_full", "timeout", "draining", "shutting_down")},
            "batch_sizes": {str(k): v for k, v in sorted(batcher.batch_sizes.items())},
            "latency_ms": {f"p{round(q * 100)}": None if (v := _quantile(lat, q)) is None else round(v * 1e3, 3)
                           for q in QUANTILES} | {"window": len(lat)},
            "cache": {**cache, "hit_rate": (cache.get("cache_hits", 0) / lookups) if lookups else None},
            "rss_bytes": rss_bytes(),
        }

    def prometheus(self, batcher, engine, draining: bool = False) -> str:
        s = self.snapshot(batcher, engine, draining)
        out: list[str] = []

        def metric(name, kind, help_, samples, suffix=""):
            out.append(f"# HELP specdraft_{name} {help_}")
            out.append(f"# TYPE specdraft_{name} {kind}")
            for labels, value in samples:
                lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"specdraft_{name}{suffix}{lab} {value}")

        metric("queue_depth", "gauge", "Requests waiting for a batch (bounded by MAX_QUEUE).", [({}, s["queue_depth"])])
        metric("inflight_requests", "gauge", "Draft requests submitted and not yet answered.", [({}, s["inflight"])])
        metric("draining", "gauge", "1 while shutting down (new requests get 503).", [({}, int(draining))])
        metric("responses_total", "counter", "POST /draft answers by HTTP status code.",
               [({"code": c}, n) for c, n in s["responses"].items()])
        metric("rejected_total", "counter", "POST /draft answered 503, by reason.",
               [({"reason": r}, n) for r, n in s["rejected"].items()])
        sizes = batcher.batch_sizes
        buckets = [({"le": str(b)}, sum(n for size, n in sizes.items() if size <= b)) for b in BATCH_BUCKETS]
        buckets.append(({"le": "+Inf"}, sum(sizes.values())))
        metric("batch_size", "histogram", "Requests per engine forward batch.", buckets, suffix="_bucket")
        out.append(f"specdraft_batch_size_sum {sum(size * n for size, n in sizes.items())}")
        out.append(f"specdraft_batch_size_count {sum(sizes.values())}")
        lat = sorted(self.latencies)
        metric("request_latency_seconds", "summary", "POST /draft latency of answered requests (quantiles over the "
               f"last {self.latencies.maxlen}).",
               [({"quantile": str(q)}, "NaN" if (v := _quantile(lat, q)) is None else f"{v:.6f}") for q in QUANTILES])
        out.append(f"specdraft_request_latency_seconds_sum {self.latency_sum:.6f}")
        out.append(f"specdraft_request_latency_seconds_count {self.codes.get(200, 0)}")
        c = s["cache"]
        if c:
            metric("cache_lookups_total", "counter", "Prefix-cache lookups (one per request).", [({}, c["requests"])])
            metric("cache_hits_total", "counter", "Lookups that reused a cached prefix.", [({}, c["cache_hits"])])
            metric("cache_hit_ratio", "gauge", "cache_hits_total / cache_lookups_total.",
                   [({}, "NaN" if c["hit_rate"] is None else f"{c['hit_rate']:.6f}")])
            metric("cache_reused_tokens_total", "counter", "Context tokens served from the cache.",
                   [({}, c["reused_tokens"])])
            metric("computed_tokens_total", "counter", "Tokens run through the model.", [({}, c["computed_tokens"])])
            metric("cache_bytes", "gauge", "Bytes of K/V held by the prefix cache.", [({}, c["cached_bytes"])])
            metric("cache_peak_bytes", "gauge", "Most bytes the prefix cache ever held.",
                   [({}, c["peak_cache_bytes"])])
            metric("cache_max_bytes", "gauge", "The prefix cache's bound (MAX_CACHE_MB).", [({}, c["max_cache_bytes"])])
            metric("cache_entries", "gauge", "Cached prefixes.", [({}, c["entries"])])
            metric("cache_evictions_total", "counter", "Entries evicted to stay within the bound.",
                   [({}, c["evictions"])])
        if s["rss_bytes"] is not None:
            metric("resident_memory_bytes", "gauge", "Resident memory of the server process.", [({}, s["rss_bytes"])])
        return "\n".join(out) + "\n"

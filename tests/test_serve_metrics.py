"""drafter_lib.serve.metrics alone: real observations, a fake batcher and engine (plain attributes), the exposition
parsed back with prometheus_client's own parser."""

from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from drafter_lib.serve.metrics import LATENCY_BUCKETS, REASONS, Metrics, histogram_quantile  # noqa: E402

CACHE = dict(requests=10, computed_tokens=300, reused_tokens=120, cache_hits=4, evictions=3, peak_cache_bytes=9000,
             entries=2, cached_token_slots=40, cached_bytes=8192, max_cache_bytes=1 << 20)


def _batcher(**kw):
    d = dict(queue_depth=3, inflight=7, max_queue=128, request_timeout_s=30.0, batch_sizes=Counter({1: 4, 3: 2, 40: 1}),
             stats={"requests": 50, "batches": 7})
    return SimpleNamespace(**(d | kw))


def _engine(**kw):
    return SimpleNamespace(cache_info=lambda: dict(CACHE, **kw))


def _samples(m: Metrics) -> dict[tuple, float]:
    """(sample name, sorted label items) -> value, from the parsed exposition."""
    body, _ = m.exposition()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _types(m: Metrics) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(m.exposition()[0].decode())}


def _buckets(samples, name) -> dict[float, float]:
    return {float(dict(labels)["le"]): v for (n, labels), v in samples.items() if n == name + "_bucket"}


def _fed() -> Metrics:
    m = Metrics()
    m.bind(_batcher(), _engine(), lambda: False)
    for seconds in (0.0008, 0.004, 0.004, 0.012, 0.09, 3.0):  # 6 answered
        m.observe(200, seconds)
    m.observe(400, 0.0002)
    m.observe(422, 0.0003)
    m.observe(422, 0.0004)
    m.observe(503, 0.0001, "queue_full")
    m.observe(503, 0.0001, "queue_full")
    m.observe(503, 30.0, "timeout")
    m.observe(503, 0.0, "draining")
    for queue_s, draft_len, cached in ((0.0001, 16, 0), (0.003, 16, 100), (0.025, 5, None), (-1e-9, 0, 4000)):
        m.observe_draft(queue_s, draft_len, cached)
    return m


def test_latency_histogram_buckets_count_and_sum():
    s = _samples(_fed())
    b = _buckets(s, "specdraft:request_latency_seconds")
    assert sorted(k for k in b if math.isfinite(k)) == list(LATENCY_BUCKETS)
    assert (b[0.001], b[0.0025], b[0.005], b[0.01], b[0.015], b[0.1], b[2.5], b[5.0], b[math.inf]) == \
        (1, 1, 3, 3, 4, 5, 5, 6, 6)
    assert s[("specdraft:request_latency_seconds_count", ())] == 6  # 200s only: 4xx and 503 are not latency
    assert s[("specdraft:request_latency_seconds_sum", ())] == pytest.approx(0.0008 + 0.008 + 0.012 + 0.09 + 3.0)


def test_per_answer_histograms():
    s = _samples(_fed())
    q = _buckets(s, "specdraft:request_queue_time_seconds")
    assert (q[0.0005], q[0.0025], q[0.005], q[0.03], q[math.inf]) == (2, 2, 3, 4, 4)  # a negative wait counts as 0
    d = _buckets(s, "specdraft:draft_tokens")
    assert (d[0], d[4], d[6], d[16], d[64], d[math.inf]) == (1, 1, 2, 4, 4, 4)
    assert s[("specdraft:draft_tokens_sum", ())] == 37
    c = _buckets(s, "specdraft:prefix_cache_hit_tokens")  # None (engine does not say) is not observed
    assert (c[0], c[64], c[128], c[2048], c[4096], c[math.inf]) == (1, 1, 2, 2, 3, 3)
    assert s[("specdraft:prefix_cache_hit_tokens_sum", ())] == 4100


def test_requests_by_status_and_reason():
    s = _samples(_fed())

    def n(status, reason=""):
        return s[("specdraft:requests_total", (("reason", reason), ("status", status)))]

    assert (n("200"), n("400"), n("422")) == (6, 1, 2)
    assert (n("503", "queue_full"), n("503", "timeout"), n("503", "draining"), n("503", "shutting_down")) == \
        (2, 1, 1, 0)  # known series exist from the start at 0
    assert _types(_fed())["specdraft:requests"] == "counter"
    assert ("specdraft:requests_total", (("reason", ""), ("status", "503"))) not in s


def test_scrape_time_state_from_the_bound_batcher_and_engine():
    m = Metrics()
    assert not any(name.startswith(("specdraft:num_requests", "specdraft:prefix_cache_bytes", "specdraft:batch_size"))
                   for name, _ in _samples(m))  # unbound: no state yet, and no error
    draining = [False]
    batcher, cache = _batcher(), dict(CACHE)
    m.bind(batcher, SimpleNamespace(cache_info=lambda: dict(cache)), lambda: draining[0])
    s = _samples(m)
    assert s[("specdraft:num_requests_waiting", ())] == 3 and s[("specdraft:num_requests_running", ())] == 4
    assert s[("specdraft:draining", ())] == 0
    b = _buckets(s, "specdraft:batch_size")  # one observation per forward batch
    assert (b[1], b[2], b[4], b[32], b[64], b[math.inf]) == (4, 4, 6, 6, 7, 7)
    assert s[("specdraft:batch_size_count", ())] == 7 and s[("specdraft:batch_size_sum", ())] == 4 + 6 + 40
    assert (s[("specdraft:prefix_cache_bytes", ())], s[("specdraft:prefix_cache_peak_bytes", ())],
            s[("specdraft:prefix_cache_max_bytes", ())], s[("specdraft:prefix_cache_entries", ())]) == \
        (8192, 9000, 1 << 20, 2)
    assert (s[("specdraft:prefix_cache_lookups_total", ())], s[("specdraft:prefix_cache_hits_total", ())],
            s[("specdraft:prefix_cache_reused_tokens_total", ())], s[("specdraft:prefix_cache_evictions_total", ())],
            s[("specdraft:computed_tokens_total", ())]) == (10, 4, 120, 3, 300)
    types = _types(m)
    assert types["specdraft:prefix_cache_evictions"] == "counter" and types["specdraft:batch_size"] == "histogram"
    assert types["specdraft:num_requests_waiting"] == "gauge"
    # read at each scrape, not at bind
    batcher.queue_depth, batcher.inflight, draining[0] = 0, 0, True
    batcher.batch_sizes[2] += 5
    cache.update(evictions=9, cached_bytes=0)
    s = _samples(m)
    assert s[("specdraft:num_requests_waiting", ())] == 0 and s[("specdraft:num_requests_running", ())] == 0
    assert s[("specdraft:draining", ())] == 1
    assert s[("specdraft:prefix_cache_evictions_total", ())] == 9 and s[("specdraft:prefix_cache_bytes", ())] == 0
    assert _buckets(s, "specdraft:batch_size")[2] == 9


def test_engine_without_cache_info_and_resident_memory():
    m = Metrics()
    m.bind(_batcher(), SimpleNamespace(), None)
    s = _samples(m)
    assert not any(name.startswith("specdraft:prefix_cache_") and "hit_tokens" not in name for name, _ in s)
    assert s[("specdraft:draining", ())] == 0
    if open("/proc/self/stat").read():  # Linux: prometheus_client's ProcessCollector
        assert s[("process_resident_memory_bytes", ())] > 1 << 20


def test_engine_bound_as_a_function_read_at_scrape_time():
    holder = SimpleNamespace(engine=None)  # app.py: the engine loads on its thread after the app is built
    m = Metrics()
    m.bind(_batcher(), lambda: holder.engine, lambda: False)
    assert ("specdraft:prefix_cache_bytes", ()) not in _samples(m)
    assert m.snapshot()["cache"] == {"hit_rate": None}
    holder.engine = _engine()
    assert _samples(m)[("specdraft:prefix_cache_bytes", ())] == 8192
    assert m.snapshot()["cache"]["cached_bytes"] == 8192


def test_two_instances_share_nothing():
    a, b = _fed(), Metrics()
    assert a.registry is not b.registry
    b.bind(_batcher(queue_depth=0, inflight=0, batch_sizes=Counter()), _engine(evictions=0), lambda: True)
    b.observe(200, 0.5)
    sa, sb = _samples(a), _samples(b)
    assert sa[("specdraft:request_latency_seconds_count", ())] == 6
    assert sb[("specdraft:request_latency_seconds_count", ())] == 1
    assert sb[("specdraft:requests_total", (("reason", "queue_full"), ("status", "503")))] == 0
    assert (sa[("specdraft:draining", ())], sb[("specdraft:draining", ())]) == (0, 1)
    assert sb[("specdraft:prefix_cache_evictions_total", ())] == 0 and sb[("specdraft:batch_size_count", ())] == 0
    assert _samples(Metrics())[("specdraft:request_latency_seconds_count", ())] == 0  # a third, fresh one


def test_content_type_is_prometheus_text():
    from prometheus_client import CONTENT_TYPE_LATEST

    body, ctype = Metrics().exposition()
    assert isinstance(body, bytes) and body.startswith(b"# HELP ")
    assert ctype == CONTENT_TYPE_LATEST
    assert ctype.startswith("text/plain; version=") and "charset=utf-8" in ctype


def test_snapshot_for_info():
    m = _fed()
    snap = m.snapshot()
    assert snap["queue_depth"] == 3 and snap["inflight"] == 7 and snap["max_queue"] == 128
    assert snap["request_timeout_s"] == 30.0 and snap["draining"] is False
    assert snap["responses"] == {"200": 6, "400": 1, "422": 2, "503": 4}
    assert snap["rejected"] == {"queue_full": 2, "timeout": 1, "draining": 1, "shutting_down": 0}
    assert list(snap["rejected"]) == list(REASONS)
    assert snap["batch_sizes"] == {"1": 4, "3": 2, "40": 1}
    lat = snap["latency_ms"]
    assert lat["count"] == 6 and lat["p50"] == pytest.approx(2.5 + 2.5 * (3 - 1) / 2)  # rank 3 in (2.5, 5] ms
    assert lat["p99"] == pytest.approx(2500 + 2500 * (5.94 - 5))  # rank 5.94 in (2.5, 5] s
    assert lat["mean"] == pytest.approx(3110.8 / 6, abs=1e-3)
    assert snap["queue_ms"]["count"] == 4 and snap["draft_tokens"]["count"] == 4
    assert snap["cache"]["hit_rate"] == pytest.approx(0.4) and snap["cache"]["evictions"] == 3
    assert snap["rss_bytes"] is None or snap["rss_bytes"] > 0
    # arguments override what bind gave (GET /info may pass them)
    other = m.snapshot(_batcher(queue_depth=0), _engine(cache_hits=0), True)
    assert other["queue_depth"] == 0 and other["draining"] is True and other["cache"]["hit_rate"] == 0
    empty = Metrics().snapshot()
    assert empty["latency_ms"] == {"p50": None, "p90": None, "p99": None, "count": 0, "mean": None}
    assert empty["responses"] == {} and empty["cache"] == {"hit_rate": None}


def test_histogram_quantile_like_prometheus():
    b = [(0.01, 0.0), (0.02, 10.0), (0.05, 10.0), (math.inf, 12.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.016)  # rank 6 of 12: 6 of the 10 in (0.01, 0.02]
    assert histogram_quantile(0.99, b) == 0.05  # falls in +Inf: the last finite bound
    assert histogram_quantile(0.5, [(0.01, 0.0), (math.inf, 0.0)]) is None
    assert histogram_quantile(0.0, [(1.0, 0.0), (2.0, 4.0), (math.inf, 4.0)]) == 1.0

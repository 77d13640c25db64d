"""The row-exact attention kernel: torch's attention's values, and each query's bits whatever else runs."""
import pytest
import torch
import torch.nn.functional as F

from drafter_lib.model import row_attention

pytestmark = pytest.mark.skipif(row_attention.kernel_unavailable() is not None,
                                reason=f"kernel not built here: {row_attention.kernel_unavailable()}")


def _inputs(queries=24, sequences=3, slots=200, dim=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, dim, generator=g)
    k, v = (torch.randn(sequences, slots, dim, generator=g) for _ in range(2))
    return q, k, v, torch.randint(1, slots + 1, (queries,), generator=g)


@pytest.mark.parametrize("dim", [64, 128, 36])
def test_equals_torch_attention_over_each_querys_slots(dim):
    q, k, v, lengths = _inputs(dim=dim)
    y = row_attention.attend(q, k, v, lengths)
    group = q.shape[0] // k.shape[0]
    for i, n in enumerate(lengths.tolist()):
        s = i // group
        want = F.scaled_dot_product_attention(q[i][None, None].double(), k[s, :n][None].double(),
                                              v[s, :n][None].double())[0, 0]
        torch.testing.assert_close(y[i].double(), want, rtol=2e-5, atol=2e-6)


def test_a_querys_bits_alone_inside_any_batch_and_on_any_thread_count():
    q, k, v, lengths = _inputs()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))
        y = row_attention.attend(q, k, v, lengths)
        torch.set_num_threads(1)
        assert torch.equal(row_attention.attend(q, k, v, lengths), y)
    finally:
        torch.set_num_threads(threads)
    group = q.shape[0] // k.shape[0]
    for i in range(q.shape[0]):
        s = i // group
        alone = row_attention.attend(q[i:i + 1], k[s:s + 1], v[s:s + 1], lengths[i:i + 1])
        assert torch.equal(alone[0], y[i])
    # slots past a query's length are never read: other values there leave its bits
    k2, v2 = k.clone(), v.clone()
    k2[:, -1], v2[:, -1] = 1e6, -1e6
    short = lengths < k.shape[1]
    assert torch.equal(row_attention.attend(q, k2, v2, lengths)[short], y[short])


@pytest.mark.parametrize("sharp", [1.0, 40.0])  # 40: scores far below the maximum, whose exp is 0 (below -87)
def test_the_avx2_path_gives_the_portable_paths_bits(sharp):
    q, k, v, lengths = _inputs(queries=36, sequences=6, dim=64)
    q = q * sharp
    try:
        wide = row_attention.attend(q, k, v, lengths, "avx2")
    except RuntimeError:
        pytest.skip("this CPU has no AVX2")
    portable = row_attention.attend(q, k, v, lengths, "portable")
    assert torch.equal(wide, portable)
    if sharp > 1:  # the clamp was reached: some weights are exactly 0, and the rest still a convex mix of values
        scores = (k[:, None] @ q.view(6, 6, 64, 1)).squeeze(-1) / 8.0
        assert (scores.amax(-1) - scores.amin(-1)).max() > 87


def test_bad_inputs_are_refused():
    q, k, v, lengths = _inputs()
    with pytest.raises(RuntimeError, match="reads"):
        row_attention.attend(q, k, v, torch.full_like(lengths, k.shape[1] + 1))
    with pytest.raises(RuntimeError, match="reads"):
        row_attention.attend(q, k, v, torch.zeros_like(lengths))
    with pytest.raises(RuntimeError, match="evenly"):
        row_attention.attend(q[:5], k, v, lengths[:5])


def _cache_views(heads=12, dim=128, seed=1):
    """The keys and values the row-exact pass hands the kernel: views of a KVCache's [B, kv heads, capacity, D]
    buffers, one call per key block end (`_RowCall.keys`), and a whole single sequence's `k[0, :, :n]`; with each
    call's one-query heads and lengths."""
    from drafter_lib.model.kv_cache import KVCache
    from drafter_lib.model.transformer import RowGroups

    g = torch.Generator().manual_seed(seed)
    cache = KVCache(1, 3, 2, 256, dim)
    for buf in (cache.k[0], cache.v[0]):
        buf.copy_(torch.randn(buf.shape, generator=g))
    positions = torch.tensor([[150 + t for t in range(9)], [140 + t for t in range(9)], [30 + t for t in range(9)]])
    out = []
    for c in RowGroups.of(positions).calls:
        kg, vg = c.keys(cache.k[0], cache.v[0])
        lengths = c.lengths(heads)
        out.append((torch.randn(len(lengths), dim, generator=g), kg, vg, lengths))
    n = 192
    lengths = torch.tensor([n - 8 + t for t in range(9)]).repeat(heads)
    out.append((torch.randn(len(lengths), dim, generator=g), cache.k[0][0, :, :n], cache.v[0][0, :, :n], lengths))
    return out


def _paths():
    try:
        row_attention.attend(*_inputs(queries=2, sequences=1, slots=4, dim=8), path="avx2")
    except RuntimeError:  # no AVX2 here
        return ["portable", "auto"]
    return ["portable", "avx2", "auto"]


@pytest.mark.parametrize("path", _paths())
def test_a_kv_caches_strided_views_give_their_contiguous_copies_bits(path):
    views = _cache_views()
    assert all(not k.is_contiguous() and not v.is_contiguous() for _, k, v, _ in views)  # the cache's real layout
    for q, k, v, lengths in views:
        assert torch.equal(row_attention.attend(q, k, v, lengths, path),
                           row_attention.attend(q, k.contiguous(), v.contiguous(), lengths, path))
    # a head dimension that is not adjacent is copied first: the same bits again
    q, k, v, lengths = views[-1]
    k_t = k.transpose(1, 2).contiguous().transpose(1, 2)
    assert k_t.stride(2) != 1
    assert torch.equal(row_attention.attend(q, k_t, v, lengths, path), row_attention.attend(q, k, v, lengths, path))


def _kernel_copies(q, k, v, lengths) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        row_attention.attend(q, k, v, lengths)
    return {e.name for e in prof.events()} & {"aten::contiguous", "aten::clone", "aten::copy_"}


def test_a_kv_caches_views_are_read_in_place():
    for q, k, v, lengths in _cache_views():
        assert not _kernel_copies(q, k, v, lengths)
    q, k, v, lengths = _cache_views()[-1]  # the profiler does see the kernel's own copies
    assert _kernel_copies(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, lengths)

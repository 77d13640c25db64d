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


def test_the_avx2_path_gives_the_portable_paths_bits():
    q, k, v, lengths = _inputs(queries=36, sequences=6, dim=64)
    try:
        wide = row_attention.attend(q, k, v, lengths, "avx2")
    except RuntimeError:
        pytest.skip("this CPU has no AVX2")
    assert torch.equal(wide, row_attention.attend(q, k, v, lengths, "portable"))


def test_bad_inputs_are_refused():
    q, k, v, lengths = _inputs()
    with pytest.raises(RuntimeError, match="reads"):
        row_attention.attend(q, k, v, torch.full_like(lengths, k.shape[1] + 1))
    with pytest.raises(RuntimeError, match="reads"):
        row_attention.attend(q, k, v, torch.zeros_like(lengths))
    with pytest.raises(RuntimeError, match="evenly"):
        row_attention.attend(q[:5], k, v, lengths[:5])

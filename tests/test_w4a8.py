"""The W4A8 kernel (decoding/w4a8.py, csrc/q4_rows.cpp): 4-bit weights in groups x int8 rows is the exact integer
product of what it stores, and a row's output never depends on the rows beside it."""
import pytest
import torch

from drafter_lib.decoding import w4a8

pytestmark = pytest.mark.skipif(w4a8.kernel_unavailable() is not None,
                                reason=f"the W4A8 kernel does not run here: {w4a8.kernel_unavailable()}")


def _exact(x: torch.Tensor, q: w4a8.Q4Weight) -> torch.Tensor:
    xq, scale = w4a8.quantize_rows(x)
    return (xq.double() @ w4a8.dequantize(q).t()) * scale.double()


@pytest.mark.parametrize("n,k", [(48, 256), (37, 896), (16, 300), (5, 1536)])  # whole, padded, odd super-blocks
def test_kernel_is_the_exact_integer_product_of_the_stored_weight(n, k):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, :40] *= 30  # an outlier group beside ordinary ones in the same super-block
    q = w4a8.quantize_weight(w)
    for m in (1, 3, 4, 5, 17):
        x = torch.randn(m, k, generator=g) * 3
        want = _exact(x, q)
        torch.testing.assert_close(w4a8.q4_rows_mm(x, q).double(), want, rtol=1e-5,
                                   atol=1e-6 * float(want.abs().max()))


def test_stored_weight_is_within_half_a_step_of_the_float_one():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=g) * 0.02
    w[3, :32] *= 40  # one wide group: the narrow ones of its super-block keep steps near their own
    q = w4a8.quantize_weight(w)
    err = (w4a8.dequantize(q) - w.double()).abs().reshape(64, -1, 32).amax(-1)
    stored = q.d.double().repeat_interleave(8, 1) * q.sc.double()  # each group's step
    groups = w.double().reshape(64, -1, 32)
    own = (groups.amax(-1) - groups.amin(-1).clamp(max=0)) / 15  # the step the group alone would take
    d, dmin = (t.double().repeat_interleave(8, 1) for t in (q.d, q.dmin))
    assert (err <= 0.5 * stored * (1 + 1e-6) + 1e-9).all()  # nothing clipped
    assert (stored <= own + d + dmin / 15 + 1e-9).all()  # steps rounded by at most one 8-bit unit
    assert q.qs.dtype == torch.uint8 and q.qs.shape == (64, 256) and int(q.sc.max()) <= 255


def test_padding_columns_hold_zeros_and_all_zero_rows_stay_zero():
    q = w4a8.quantize_weight(torch.zeros(8, 100))
    assert torch.equal(w4a8.dequantize(q), torch.zeros(8, 100, dtype=torch.float64))
    assert torch.equal(w4a8.q4_rows_mm(torch.zeros(2, 100), q), torch.zeros(2, 8))


def test_a_rows_output_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(1)
    lin = w4a8.W4A8Linear(torch.randn(72, 640, generator=g) * 0.05, torch.randn(72, generator=g))
    rows = torch.randn(17, 640, generator=g)
    alone = torch.cat([lin(rows[i:i + 1]) for i in range(17)])
    assert torch.equal(lin(rows), alone)
    for m in (2, 5, 9):  # every tile split of the rows
        assert torch.equal(lin(rows[:m]), alone[:m])
    other = rows.clone()
    other[1:] = torch.randn(16, 640, generator=g) * 100
    assert torch.equal(lin(other)[0], alone[0])


def test_w4a8_linear_stands_for_its_float_product():
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(96, 512, generator=g) * 0.02, torch.randn(96, generator=g)
    x = torch.randn(2, 7, 512, generator=g)
    y = w4a8.W4A8Linear(w, b)(x)
    want = x @ w.t() + b
    assert y.shape == (2, 7, 96)
    assert (y - want).abs().max() < 0.1 * (x @ w.t()).abs().max()


def test_kernel_refuses_shapes_that_disagree():
    q = w4a8.quantize_weight(torch.randn(8, 256))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        w4a8.q4_rows_mm(torch.randn(2, 512), q)

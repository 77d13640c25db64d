"""What lets a W8A8 kernel into the runtime's measured choice (decoding/w8a8.py): it runs exactly here, and it gives
every row the same bits alone as beside other rows at the model's own shapes."""
import pytest
import torch

from drafter_lib.decoding import w8a8

USABLE = [k for k in w8a8.KERNELS if w8a8.kernel_unavailable(k) is None]


@pytest.mark.parametrize("kernel", USABLE)
def test_usable_kernels_prove_row_exact_at_model_shapes(kernel):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(96, 64, generator=g) * 0.05, torch.randn(64, 160, generator=g) * 0.05]
    assert w8a8.row_exactness_failure(kernel, weights) is None


def test_a_kernel_whose_rows_depend_on_their_neighbours_is_kept_out(monkeypatch):
    base = w8a8._KERNEL_CLASSES[USABLE[0]]

    class Leaky(base):  # a product that adds a trace of the row count: what a tiled float epilogue can do
        def __call__(self, xs):
            return super().__call__(xs) * (1 + 1e-7 * (xs.shape[0] > 4))

    monkeypatch.setitem(w8a8._KERNEL_CLASSES, USABLE[0], Leaky)
    why = w8a8.row_exactness_failure(USABLE[0], [torch.randn(32, 64) * 0.05])
    assert why is not None and "5 rows" in why


def test_int_mm_is_refused_without_vnni(monkeypatch):
    monkeypatch.setattr(w8a8, "has_vnni", lambda: False)
    assert "VNNI" in w8a8.kernel_unavailable("int_mm")


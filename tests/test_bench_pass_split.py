"""bench/pass_split.py: a pass against its products alone, on a tiny target (the structure; timings are not tested)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

from bench import pass_split  # noqa: E402
from drafter_lib.decoding import row_step  # noqa: E402

NUMERICS = ["w8a8"] + (["gguf"] if row_step.kernel_unavailable() is None else [])


@pytest.mark.parametrize("numerics", NUMERICS)
def test_each_pass_size_is_split_into_its_products_and_the_rest(generation_dirs, numerics):
    target, _ = generation_dirs
    out = pass_split.main(["--target", str(target), "--numerics", numerics, "--tokens", "1", "3", "--repeats", "3"])
    assert set(out) == {1, 3}
    for ms in out.values():
        assert ms["products"] == 2 * 4 + 1  # per layer: q/k/v, o, gate/up, down; and the head
        assert ms["cpp step"] is (numerics == "gguf")  # the layers in one C++ call run block products only
        assert min(ms["pass"], ms["python layers"], ms["python layers without products"], ms["products alone"]) > 0
        assert ms["pass / products"] == ms["pass"] / ms["products alone"]

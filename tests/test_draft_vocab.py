"""Reduced draft vocabulary: id selection, the reduced head's logits equal the full head's rows, the pack round trip
and its consistency checks."""
import json

import pytest
import torch
from test_model import tiny_hf

from drafter_lib.model import draft_vocab as DV
from drafter_lib.model.transformer import Transformer
from drafter_lib.packed.model_dir import ModelDirError, read_model_dir, write_model_dir
from drafter_lib.quantization import QuantConfig

V = 97


def test_select_ids_by_frequency_with_always_and_filler():
    counts = DV.token_counts([[5, 5, 5, 9, 9, 3], [9, 7, 7, 5]])  # 5:4, 9:3, 7:2, 3:1
    assert DV.select_ids(counts, 2, V).tolist() == [5, 9]
    assert DV.select_ids(counts, 3, V, always=[0]).tolist() == [0, 5, 9]
    six = DV.select_ids(counts, 6, V).tolist()
    assert six == sorted(six) and {3, 5, 7, 9} <= set(six) and len(set(six)) == 6  # topped up with unused ids
    ties = DV.token_counts([[4, 2]])
    assert DV.select_ids(ties, 1, V).tolist() == [2]  # equal counts: the lower id wins, every time
    assert DV.coverage(torch.tensor([5, 9]), counts) == pytest.approx(7 / 10)
    with pytest.raises(ValueError, match="draft vocab size"):
        DV.select_ids(counts, 0, V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        DV.select_ids(DV.token_counts([[V]]), 2, V)
    with pytest.raises(ValueError, match="more than the draft vocab size"):
        DV.select_ids(counts, 1, V, always=[1, 2])


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", True), ("qwen3", False)])
def test_reduced_head_logits_are_the_full_heads_rows(arch, tie):
    hf = tiny_hf(arch, vocab_size=V, tie_word_embeddings=tie)
    ids = torch.tensor([0, 3, 11, 40, 41, 96])
    cfg, sd = DV.reduce_head(hf.config.to_dict(), hf.state_dict(), ids)
    full = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    small = Transformer.from_hf(cfg, sd)
    assert small.lm_head.weight.shape == (6, hf.config.hidden_size)
    x = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, -1)
    with torch.no_grad():
        want, got = full(x, pos)[..., ids], small(x, pos)
    # the same dot products; only the GEMM's blocking may differ with the row count (it does with AVX2 MKL kernels)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert small.full_ids(got.argmax(-1)).tolist() == ids[want.argmax(-1)].tolist()
    assert full.full_ids(torch.tensor([7])).tolist() == [7]  # no draft vocab: indices are ids


def test_pack_round_trip_and_checks(tmp_path):
    hf = tiny_hf("llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    ids = DV.select_ids(DV.token_counts([[1, 2, 3, 50, 50]]), 32, V)
    cfg, sd = DV.reduce_head(hf.config.to_dict(), hf.state_dict(), ids)
    out = write_model_dir(tmp_path / "m", cfg, sd, QuantConfig.default_for(group_size=32))
    packed = read_model_dir(out)
    assert torch.equal(packed.state_dict[DV.IDS_TENSOR], ids)
    assert packed.config[DV.CONFIG_KEY] == {"size": 32, "tensor": DV.IDS_TENSOR, "full_vocab_size": V}
    assert packed.state_dict["lm_head.weight"].shape == (32, 64)
    assert json.loads((out / "quantization.json").read_text())["tensors"][DV.IDS_TENSOR]["quant"] is None
    engine_model = Transformer.from_hf(packed.config, packed.state_dict)
    assert torch.equal(engine_model.draft_vocab_ids, ids)

    bad_cfg = {**cfg, DV.CONFIG_KEY: {**cfg[DV.CONFIG_KEY], "size": 31}}
    with pytest.raises(ValueError, match="31"):
        write_model_dir(tmp_path / "bad", bad_cfg, sd, None)
    no_ids = {k: v for k, v in sd.items() if k != DV.IDS_TENSOR}
    with pytest.raises(ValueError, match="no draft_vocab_ids"):
        write_model_dir(tmp_path / "bad2", cfg, no_ids, None)
    dup = {**sd, DV.IDS_TENSOR: torch.cat([ids[:-1], ids[:1]])}
    with pytest.raises(ValueError, match="duplicate"):
        write_model_dir(tmp_path / "bad3", cfg, dup, None)
    # a pack edited after writing is caught by the reader (hash check off, so the vocab check itself is tested)
    (out / "config.json").write_text(json.dumps({**packed.config, DV.CONFIG_KEY: None, "tie_word_embeddings": False}))
    with pytest.raises(ModelDirError, match="no 'draft_vocab' entry"):
        read_model_dir(out, verify=False)


def test_hf_training_side_reduce_save_load_and_pack(tmp_path):
    from drafter_lib.study.pack import pack_checkpoint

    hf = tiny_hf("llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    x = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = hf(x).logits
    ids = torch.tensor([2, 5, 8, 13, 21, 34, 55, 89])
    DV.reduce_hf_model(hf, ids)
    with torch.no_grad():
        # GEMM blocking may differ with the row count
        torch.testing.assert_close(hf(x).logits, full[..., ids], rtol=0, atol=1e-6)
    # the reduced head trains on its own: the full embedding is no longer tied to it
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()

    targets = torch.tensor([[5, 6, -100, 89]])
    assert DV.head_targets(targets, ids, V).tolist() == [[1, -100, -100, 7]]  # 6 is outside the draft vocab

    hf.save_pretrained(tmp_path / "ckpt")
    back = DV.load_hf_drafter(tmp_path / "ckpt")
    assert torch.equal(back.draft_vocab_ids, ids)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, rtol=0, atol=0)

    out = pack_checkpoint(back, back.config, tmp_path / "model", None)
    engine_model = Transformer.from_hf(read_model_dir(out).config, read_model_dir(out).state_dict)
    with torch.no_grad():
        got = engine_model(x, torch.arange(7).expand(2, -1))
        torch.testing.assert_close(got, hf(x).logits, rtol=1e-5, atol=1e-5)
    assert engine_model.full_ids(got.argmax(-1)).tolist() == ids[hf(x).logits.argmax(-1)].tolist()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_engine_drafts_full_vocabulary_ids_from_a_reduced_head(tmp_path, dtype):
    from drafter_lib.engine.draft_engine import DraftEngine
    from drafter_lib.quantization import QuantSpec

    hf = tiny_hf("llama", vocab_size=V, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    with torch.no_grad():  # sharper weights: varied greedy continuations
        for n, p in hf.named_parameters():
            if p.ndim == 2 and "embed" not in n:
                p.mul_(4.0)
    ids = torch.arange(1, V, 2)
    DV.reduce_hf_model(hf, ids)
    qc = QuantConfig.default_for(group_size=32)
    assert qc.spec_for("lm_head.weight", hf.lm_head.weight) == QuantSpec(8, None, "float16")  # int8 rows
    out = write_model_dir(tmp_path / "m", hf.config.to_dict(), hf.state_dict(), qc)
    packed = read_model_dir(out)
    native = Transformer.from_hf(packed.config, packed.state_dict)
    engine = DraftEngine.from_dir(out, dtype=dtype, copy_policy={"enabled": False})
    for seed in (0, 1, 2):
        seq = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        draft = engine.draft(seq, 8)
        want, s = [], list(seq)
        with torch.no_grad():
            for _ in range(8):
                logits = native(torch.tensor([s]), torch.arange(len(s))[None])[0, -1]
                s.append(int(native.full_ids(logits.argmax())))
                want.append(s[-1])
        assert list(draft) == want and set(draft) <= set(ids.tolist())


def test_greedy_decoding_of_a_reduced_head_speaks_full_ids():
    """The speculative loop's targets map a reduced head to full-vocabulary ids (04_pack's reference drafts)."""
    from drafter_lib.decoding.speculative import greedy_decode

    hf = tiny_hf("llama", vocab_size=V, tie_word_embeddings=True)
    ids = torch.arange(2, V, 5)
    DV.reduce_hf_model(hf, ids)
    native = Transformer.from_hf(hf.config.to_dict(), hf.state_dict())
    prompt = [3, 9, 27, 81]
    want, seq = [], list(prompt)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(native.full_ids(native(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1].argmax())))
            want.append(seq[-1])
    assert greedy_decode(hf, prompt, 6) == want == greedy_decode(native, prompt, 6)
    assert set(want) <= set(ids.tolist())

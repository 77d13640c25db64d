"""Export of a packed drafter to a transformers checkpoint: its greedy drafts equal the engine's fp32 drafts, and
transformers' assisted generation with it as the assistant equals the target's plain greedy output."""
import pytest
import torch
from export_helpers import sharpen as _sharpen
from test_model import tiny_hf

from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.interop.hf_export import export_hf, main
from drafter_lib.quantization import QuantConfig
from drafter_lib.study.pack import pack_checkpoint

transformers = pytest.importorskip("transformers")
V = 97




@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def exported(request, tmp_path_factory):
    arch = request.param
    drafter = _sharpen(tiny_hf(arch, vocab_size=V, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    root = tmp_path_factory.mktemp(f"export_{arch}")
    packed = pack_checkpoint(drafter, drafter.config, root / "model", QuantConfig.default_for(group_size=32),
                             copy_policy={"enabled": False})
    model = export_hf(packed, root / "hf")
    return arch, packed, root / "hf", model


def _greedy(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def _prompt(n, seed):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_exported_drafts_equal_engine_fp32(exported):
    from drafter_lib.model.transformer import Transformer
    from drafter_lib.packed.model_dir import read_model_dir

    arch, packed, hf_dir, _ = exported
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    pack = read_model_dir(packed)
    assert reloaded.config.model_type == arch
    ids = torch.tensor([_prompt(30, 9)])
    with torch.no_grad():  # the same logits as the pack restored into the hand-written decoder (biases and all)
        ours = Transformer.from_hf(pack.config, pack.state_dict)(ids, torch.arange(30)[None])
        torch.testing.assert_close(reloaded(ids).logits, ours, rtol=0, atol=1e-4)
    engine = DraftEngine.from_dir(packed, dtype="float32", copy_policy={"enabled": False})
    drafts = []
    for seed, n in enumerate((3, 17, 40)):
        p = _prompt(n, seed)
        want = engine.draft(p, 12)
        assert _greedy(reloaded, p, 12) == want
        drafts.append(want)
    assert len({tuple(d) for d in drafts}) > 1  # the drafter is not degenerate: the check above can fail


def test_assisted_generation_equals_plain_greedy(exported):
    arch, _, _, assistant = exported
    torch.manual_seed(1)
    target = _sharpen(tiny_hf(arch, vocab_size=V, num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2))
    target.generation_config.eos_token_id = None
    for seed in (5, 6):
        p = _prompt(20, seed)
        assert _greedy(target, p, 24, assistant_model=assistant) == _greedy(target, p, 24)


def test_export_cli_and_bad_pack(exported, tmp_path):
    _, packed, _, _ = exported
    out = main(["--format", "hf", str(tmp_path / "cli"), "--model-dir", str(packed)])
    assert (out / "config.json").is_file()
    with pytest.raises(Exception, match="model dir not found"):
        export_hf(tmp_path / "nope", tmp_path / "x")


def test_reduced_draft_vocab_exports_as_full_head_with_suppressed_tokens(tmp_path):
    from drafter_lib.model import draft_vocab as DV
    from drafter_lib.model.transformer import Transformer
    from drafter_lib.packed.model_dir import read_model_dir

    drafter = _sharpen(tiny_hf("llama", vocab_size=V, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    ids = torch.arange(0, V, 3)  # a third of the vocabulary
    DV.reduce_hf_model(drafter, ids)
    packed = pack_checkpoint(drafter, drafter.config, tmp_path / "model", QuantConfig.default_for(group_size=32))
    exported = export_hf(packed, tmp_path / "hf")
    native = Transformer.from_hf(read_model_dir(packed).config, read_model_dir(packed).state_dict)
    for seed in (0, 1):
        seq = _prompt(15, seed)
        want = []
        with torch.no_grad():
            for _ in range(10):  # greedy on the hand-written model, head indices mapped to full ids
                logits = native(torch.tensor([seq]), torch.arange(len(seq))[None])[0, -1]
                seq = seq + [int(native.full_ids(logits.argmax()))]
                want.append(seq[-1])
        got = _greedy(exported, _prompt(15, seed), 10)
        assert got == want and set(got) <= set(ids.tolist())

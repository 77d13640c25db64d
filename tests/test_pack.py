import pytest
import torch

from drafter_lib.packed.model_dir import read_model_dir
from drafter_lib.quantization import QuantConfig, apply_fake_quant, remove_fake_quant
from drafter_lib.study.pack import (
    logit_agreement,
    pack_checkpoint,
    plot_logit_agreement,
    plot_weight_error,
    weight_error_table,
)

transformers = pytest.importorskip("transformers")

QC = QuantConfig.default_for(group_size=32)


def _load(packed_sd, config):
    m = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = m.load_state_dict(packed_sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return m


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_llama):
    model = tiny_llama()
    out = pack_checkpoint(model, model.config, tmp_path_factory.mktemp("p") / "model", QC,
                          copy_policy={"enabled": True}, extra_manifest={"training_run": "unit"})
    return model, read_model_dir(out)


def test_pack_checkpoint_from_hf_model(packed):
    model, pm = packed
    assert pm.config["model_type"] == "llama" and pm.config["tie_word_embeddings"] is True
    assert pm.manifest["training_run"] == "unit" and pm.copy_policy == {"enabled": True}
    assert set(pm.state_dict) == set(model.state_dict())


def test_packed_model_equals_fake_quant_model_exactly(packed):
    model, pm = packed
    ids = [torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    qmodel = _load(pm.state_dict, model.config)
    fp_vs_packed = logit_agreement(model, qmodel, ids)
    assert fp_vs_packed["num_positions"] == 72
    assert fp_vs_packed["kl_mean"] > 0 and 0 <= fp_vs_packed["top1_agreement"] <= 1

    apply_fake_quant(model, QC)  # QAT view of the same fp weights
    try:
        same = logit_agreement(model, qmodel, ids)
        with torch.no_grad():
            assert torch.equal(model(ids[0]).logits, qmodel(ids[0]).logits)
    finally:
        remove_fake_quant(model)
    assert same["top1_agreement"] == 1.0 and abs(same["kl_mean"]) < 1e-6
    self_ = logit_agreement(lambda x: model(x).logits, lambda x: model(x).logits, [ids[0].tolist()])
    assert self_["top1_agreement"] == 1.0 and self_["kl_mean"] == 0.0


def test_pack_checkpoint_of_fake_quantized_model_and_state_dict(tmp_path, tiny_llama):
    model = tiny_llama(seed=1)
    apply_fake_quant(model, QC)
    a = read_model_dir(pack_checkpoint(model, None, tmp_path / "a", QC))  # config taken from model.config
    remove_fake_quant(model)
    b = read_model_dir(pack_checkpoint(model.state_dict(), model.config.to_dict(), tmp_path / "b", QC))
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)
    with pytest.raises(ValueError, match="nn.Module or a state dict"):
        pack_checkpoint([1, 2], {}, tmp_path / "c", QC)


def test_weight_error_table(packed):
    model, pm = packed
    rows = weight_error_table(model.state_dict(), pm.state_dict)
    by_name = {r["name"]: r for r in rows}
    q = by_name["model.layers.1.self_attn.q_proj.weight"]
    assert q["layer"] == 1 and q["kind"] == "q_proj" and 0.01 < q["rel_error"] < 0.3
    emb = by_name["model.embed_tokens.weight"]
    assert emb["layer"] is None and emb["kind"] == "embed_tokens" and 0 < emb["rel_error"] < 0.02  # int8
    assert by_name["model.norm.weight"]["rel_error"] == 0.0
    assert by_name["model.layers.0.input_layernorm.weight"]["kind"] == "input_layernorm"
    with pytest.raises(ValueError, match="missing from packed"):
        weight_error_table(model.state_dict(), {k: v for k, v in pm.state_dict.items() if "norm" not in k})


def test_logit_agreement_rejects_bad_input():
    f = lambda x: torch.zeros(*x.shape, 5)  # noqa: E731
    with pytest.raises(ValueError, match="no token batches"):
        logit_agreement(f, f, [])
    with pytest.raises(ValueError, match="logit shapes differ"):
        logit_agreement(f, lambda x: torch.zeros(*x.shape, 6), [torch.zeros(1, 3, dtype=torch.long)])


def test_plots_write_png(packed, tmp_path):
    model, pm = packed
    rows = weight_error_table(model.state_dict(), pm.state_dict)
    p1 = plot_weight_error(rows, tmp_path / "plots" / "weight_error.png")
    p2 = plot_logit_agreement({"int4 g32": {"kl_mean": 0.01, "top1_agreement": 0.97},
                               "int4 g64": {"kl_mean": 0.02, "top1_agreement": 0.95}}, tmp_path / "agree.png")
    for p in (p1, p2):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_val_curves_plot_one_line_per_run(tmp_path, monkeypatch):
    from drafter_lib.common import plots

    drawn = []
    real = plots.save_figure
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, **kw: (drawn.append(fig), real(fig, path, **kw))[1])
    hist = {"lr a": [{"step": 0, "kind": "val", "phase": "distill", "loss": 9.0},
                     {"step": 5, "kind": "train", "phase": "distill", "loss": 4.0},
                     {"step": 10, "kind": "val", "phase": "distill", "loss": 3.0},
                     {"step": 12, "kind": "val", "phase": "qat", "loss": 3.2}],
            "lr b": [{"step": 0, "kind": "val", "phase": "distill", "loss": 9.0},
                     {"step": 10, "kind": "val", "phase": "distill", "loss": 2.5}]}
    p = plots.val_curves(hist, tmp_path / "curves.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = drawn[0].axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["lr a", "lr b"]
    assert list(lines[0].get_ydata()) == [3.0]  # validation points of the distillation after step 0 only
    # a whole base starts close to the teacher: its step-0 loss is the dashed mark training has to beat
    close = {k: [dict(h, loss=2.9) if h["step"] == 0 else h for h in v] for k, v in hist.items()}
    drawn.clear()
    plots.val_curves(close, tmp_path / "close.png")
    mark = drawn[0].axes[0].get_lines()[-1]
    assert mark.get_label() == "step 0 (the base): 2.900" and list(mark.get_ydata()) == [2.9, 2.9]


def test_compare_runs_reports_curves_and_acceptance(tmp_path):
    import json

    from drafter_lib.common.files import write_json
    from drafter_lib.study.run_compare import compare_runs, main

    for name, final, mal in (("a", 3.0, 1.4), ("b", 2.5, 1.6)):
        run = tmp_path / name
        write_json(run / "train" / "history.json", [
            {"step": 0, "kind": "val", "phase": "distill", "loss": 9.0},
            {"step": 10, "kind": "val", "phase": "distill", "loss": final},
            {"step": 12, "kind": "val", "phase": "qat", "loss": final + 0.1}])
        write_json(run / "metrics.json", {"baselines": {"packed": {"mean_acceptance_length": mal,
                                                                   "per_position_acceptance": [mal - 1, 0.1]}}})
    rep = compare_runs({"lr a": tmp_path / "a", "lr b": tmp_path / "b"}, tmp_path / "out")
    assert rep["lr b"]["val"] == [[0, 9.0], [10, 2.5]] and rep["lr b"]["val_after_qat"] == 2.6
    assert rep["lr a"]["mean_acceptance_length"] == {"packed": 1.4}
    assert rep["lr b"]["first_position_acceptance"] == {"packed": 0.6}
    assert json.loads((tmp_path / "out" / "runs.json").read_text()) == rep
    assert (tmp_path / "out" / "val_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "paired" not in rep["lr b"]  # metrics without per-prompt counts: no paired comparison
    # with per-prompt counts, on the prompts both runs evaluated: b accepts one more token per step on each
    for name, acc in (("a", 5), ("b", 15)):
        write_json(tmp_path / name / "metrics.json", {
            "primary": "packed", "item_ids": ["p1", "p2", "p3", name],
            "baselines": {"packed": {"mean_acceptance_length": 1.5, "per_position_acceptance": [0.5],
                                     "per_prompt": [[10, acc], [10, acc + 1], [10, acc + 2], [10, 0]]}}})
    paired = compare_runs({"lr a": tmp_path / "a", "lr b": tmp_path / "b"}, tmp_path / "out")["lr b"]["paired"]
    assert paired["against"] == "lr a" and paired["prompts"] == 3 and paired["resolved"]
    assert paired["difference"] == pytest.approx(1.0)
    with pytest.raises(FileNotFoundError, match="03_train_qat"):
        compare_runs({"none": tmp_path / "missing"}, tmp_path / "out2")
    with pytest.raises(SystemExit):
        main(["no-label-here", "--out", str(tmp_path / "out3")])


def test_qwen2_biases_pack_as_exact_float_tensors(tmp_path, tiny_random):
    """Biases are never quantized (nor fake-quantized in QAT): stored as fp32 under their HF names and restored bit for
    bit, so the restored Qwen2 gives the fake-quant model's logits exactly."""
    from safetensors import safe_open

    model, _ = tiny_random("qwen2", seed=2, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           tie_word_embeddings=False)
    biases = {k: v for k, v in model.state_dict().items() if k.endswith(".bias")}
    assert len(biases) == 6 and all(v.abs().min() > 0 for v in biases.values())  # q/k/v of 2 layers, random
    pm = read_model_dir(pack_checkpoint(model, model.config, tmp_path / "fp32", QC))
    with safe_open(str(tmp_path / "fp32" / "weights.safetensors"), "pt") as f:
        for k, v in biases.items():
            assert pm.quantization["tensors"][k]["quant"] is None and f.get_tensor(k).dtype == torch.float32
            assert torch.equal(f.get_tensor(k), v) and torch.equal(pm.state_dict[k], v)
    restored = transformers.Qwen2ForCausalLM(model.config).eval()
    restored.load_state_dict(pm.state_dict)
    assert not any(k.endswith(".bias") for k in apply_fake_quant(model, QC))
    try:
        ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model(ids).logits, restored(ids).logits)
    finally:
        remove_fake_quant(model)
    half = model.to(torch.bfloat16)  # a bf16 checkpoint's biases: widened to fp32, exactly
    pm16 = read_model_dir(pack_checkpoint(half, half.config, tmp_path / "bf16", QC))
    assert all(torch.equal(pm16.state_dict[k], half.state_dict()[k].float()) for k in biases)

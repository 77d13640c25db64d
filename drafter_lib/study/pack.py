"""Study-side packing helpers (04_pack): pack a checkpoint, check the pack is exactly what QAT trained, measure
what quantization cost, plot it, publish the pack."""
from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from drafter_lib import quantization
from drafter_lib.common.progress import progress_bar
from drafter_lib.packed.config_keys import with_engine_settings
from drafter_lib.packed.model_dir import read_model_dir, write_model_dir

__all__ = ["pack_checkpoint", "check_pack_matches_qat", "publish", "weight_error_table", "logit_agreement",
           "plot_weight_error", "plot_logit_agreement"]


def _config_dict(hf_config, model=None) -> dict:
    if hf_config is None and model is not None and hasattr(model, "config"):
        hf_config = model.config
    if hf_config is None:
        raise ValueError("pack_checkpoint needs hf_config (a dict or a transformers config)")
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_json_string"):  # transformers PretrainedConfig: JSON-safe full dict
        return json.loads(hf_config.to_json_string(use_diff=False))
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise ValueError(f"hf_config must be a dict or a transformers config, got {type(hf_config).__name__}")


def pack_checkpoint(hf_model_or_state_dict, hf_config, out_dir, qconfig, copy_policy=None,
                    extra_manifest=None, min_confidence: float | None = None, engine_dtype: str | None = None) -> Path:
    """Pack an HF model (fake-quant applied or not) or a state dict into a model dir; returns out_dir.
    `min_confidence`: the draft threshold the pack recommends, kept as config.json `draft_min_confidence`;
    `engine_dtype`: how the engine holds the weights unless told otherwise (config.json `draft_engine_dtype`)."""
    model = hf_model_or_state_dict if isinstance(hf_model_or_state_dict, nn.Module) else None
    if model is not None:
        state_dict = quantization.unparametrized_state_dict(model)
    elif isinstance(hf_model_or_state_dict, dict):
        state_dict = hf_model_or_state_dict
    else:
        raise ValueError(f"expected an nn.Module or a state dict, got {type(hf_model_or_state_dict).__name__}")
    config = with_engine_settings(_config_dict(hf_config, model), min_confidence, engine_dtype)
    return write_model_dir(out_dir, config, state_dict, qconfig, copy_policy, extra_manifest)


def _load_hf(path) -> nn.Module:
    from drafter_lib.model.draft_vocab import load_hf_drafter

    return load_hf_drafter(path).eval()


@torch.no_grad()
def check_pack_matches_qat(checkpoint_dir, model_dir, qconfig, rows: list[dict], distilled_dir=None,
                           logit_rows: int = 8, draft_rows: int = 4, draft_k: int = 8) -> dict:
    """Check a pack against the checkpoint it was packed from.

    - packed_equals_fake_quant: every quantized tensor restored from the pack equals, bit for bit, the fake-quant
      weight QAT trained with (the checkpoint with `qconfig`'s fake quantization applied);
    - engine_drafts_match_fake_quant: per row, the engine (which reads only the model dir) drafts `draft_k` tokens
      equal to the fake-quant model's greedy tokens for the row's prompt;
    - logit_agreement: KL / top-1 agreement of the latent fp checkpoint (and `distilled_dir`, if given) vs the
      fake-quant model on prompt + continuation of `rows` (teacher target rows).
    """
    from drafter_lib.decoding.speculative import greedy_decode
    from drafter_lib.engine.draft_engine import DraftEngine

    model, fq = _load_hf(checkpoint_dir), _load_hf(checkpoint_dir)
    quantization.apply_fake_quant(fq, qconfig)
    packed = read_model_dir(model_dir)
    exact = all(torch.equal(getattr(fq.get_submodule(n.rsplit(".", 1)[0]), n.rsplit(".", 1)[1]), t)
                for n, t in packed.state_dict.items() if qconfig.spec_for(n, t) is not None)
    batches = [torch.tensor([r["prompt_ids"] + r["continuation_ids"]]) for r in rows[:logit_rows]]
    packed_fwd = lambda x: fq(x).logits
    agree = {"QAT latent fp vs packed": logit_agreement(lambda x: model(x).logits, packed_fwd, batches)}
    if distilled_dir is not None:
        distilled = _load_hf(distilled_dir)
        agree["distilled fp vs packed"] = logit_agreement(lambda x: distilled(x).logits, packed_fwd, batches)
    # plain greedy with no stop tokens (the engine has none) and no dynamic length: always draft_k tokens
    engine = DraftEngine.from_dir(model_dir, dtype="float32", copy_policy={"enabled": False}, min_confidence=0)
    match = [engine.draft(r["prompt_ids"], draft_k) == greedy_decode(fq, r["prompt_ids"], draft_k)
             for r in rows[:draft_rows]]
    return {"packed_equals_fake_quant": exact, "engine_drafts_match_fake_quant": match, "logit_agreement": agree}


def publish(model_dir, dest) -> Path:
    """Copy a pack (e.g. a run's model/) to `dest` (e.g. the repository's model/, what serve.sh serves) and read
    the copy back, which checks the sha256 of every file. Returns dest."""
    src, dest = Path(model_dir), Path(dest)
    read_model_dir(src)
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        shutil.copy2(f, dest / f.name)
    read_model_dir(dest)
    return dest


_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def _layer_and_kind(name: str) -> tuple[int | None, str]:
    m = _LAYER_RE.search(name)
    parts = name.split(".")
    kind = parts[-2] if len(parts) >= 2 else parts[-1]
    if parts[-1] != "weight":  # e.g. a bias
        kind = f"{kind}.{parts[-1]}"
    return (int(m.group(1)) if m else None), kind


def weight_error_table(fp_state_dict: dict, packed_state_dict: dict) -> list[dict]:
    """Per tensor: {name, layer (int|None), kind (e.g. q_proj, embed_tokens), rel_error = |W_hat - W| / |W|}."""
    fp = {quantization.canonical_name(k): v for k, v in fp_state_dict.items()}
    packed = {quantization.canonical_name(k): v for k, v in packed_state_dict.items()}
    missing, extra = sorted(set(fp) - set(packed)), sorted(set(packed) - set(fp))
    if missing or extra:
        raise ValueError(f"state dicts differ: missing from packed {missing[:5]}, not in fp {extra[:5]}")
    rows = []
    for name in fp:
        a, b = fp[name].detach().float().cpu(), packed[name].detach().float().cpu()
        if a.shape != b.shape:
            raise ValueError(f"{name}: fp shape {list(a.shape)} vs packed shape {list(b.shape)}")
        if not a.is_floating_point():
            continue
        norm = a.norm().item()
        err = (a - b).norm().item()
        layer, kind = _layer_and_kind(name)
        rows.append({"name": name, "layer": layer, "kind": kind,
                     "rel_error": err / norm if norm > 0 else (0.0 if err == 0 else math.inf)})
    return rows


@torch.no_grad()
def logit_agreement(fp_forward: Callable, packed_forward: Callable, token_batches: Iterable) -> dict:
    """Compare next-token distributions of two models on the same tokens.

    fp_forward / packed_forward: input_ids LongTensor [B, T] -> logits [B, T, V] (or an object with .logits).
    -> {kl_mean: mean KL(fp || packed) per position, top1_agreement: share of positions with equal argmax,
        num_positions}.
    """
    kl_sum, agree, n = 0.0, 0, 0
    for batch in progress_bar(token_batches, desc="logit agreement", leave=False):
        ids = torch.as_tensor(batch, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.numel() == 0:
            raise ValueError(f"token batch must be a non-empty [B, T] tensor, got shape {list(ids.shape)}")
        lp = _logits(fp_forward(ids)).float().log_softmax(-1)
        lq = _logits(packed_forward(ids)).float().log_softmax(-1)
        if lp.shape != lq.shape:
            raise ValueError(f"logit shapes differ: fp {list(lp.shape)} vs packed {list(lq.shape)}")
        kl_sum += (lp.exp() * (lp - lq)).sum(-1).sum().item()
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        n += lp.shape[0] * lp.shape[1]
    if n == 0:
        raise ValueError("logit_agreement got no token batches")
    return {"kl_mean": kl_sum / n, "top1_agreement": agree / n, "num_positions": n}


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


# ---------------------------------------------------------------------------------------------------------------
# Plots (matplotlib Figure objects directly: no pyplot state, works headless and inside notebooks)


def plot_weight_error(rows: list[dict], path) -> Path:
    """Relative weight error per decoder layer, one line per kind; non-layer tensors as a bar group on the right."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    fig = Figure(figsize=(9, 4.5), layout="constrained")
    ax_l, ax_o = fig.subplots(1, 2, width_ratios=[3, 1])
    # Kinds with zero error everywhere (float norms) would only draw a flat line at 0.
    kinds = sorted({r["kind"] for r in rows if r["layer"] is not None and r["rel_error"] > 0})
    for kind in kinds:
        pts = sorted((r["layer"], r["rel_error"]) for r in rows if r["kind"] == kind and r["layer"] is not None)
        ax_l.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=kind)
    ax_l.set(xlabel="decoder layer", ylabel="relative error |W_hat - W| / |W|", title="per-layer weight error")
    ax_l.xaxis.set_major_locator(MaxNLocator(integer=True))
    if kinds:
        ax_l.legend(fontsize=7, ncol=2)
    other = [r for r in rows if r["layer"] is None]
    ax_o.bar(range(len(other)), [r["rel_error"] for r in other])
    ax_o.set_xticks(range(len(other)), [r["kind"] for r in other], rotation=45, ha="right", fontsize=8)
    ax_o.set(title="other tensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def plot_logit_agreement(results: dict[str, dict], path) -> Path:
    """Bar charts of top-1 agreement and mean KL for several packings, e.g. {"int4 g64": logit_agreement(...)}."""
    from matplotlib.figure import Figure

    if not results:
        raise ValueError("plot_logit_agreement needs at least one result")
    path = Path(path)
    labels = list(results)
    fig = Figure(figsize=(max(6, 1.2 * len(labels) + 3), 4), layout="constrained")
    ax_a, ax_k = fig.subplots(1, 2)
    x = range(len(labels))
    ax_a.bar(x, [results[k]["top1_agreement"] for k in labels], color="tab:green")
    ax_a.set_xticks(x, labels, rotation=30, ha="right")
    ax_a.set(ylim=(0, 1.0), ylabel="top-1 agreement with fp", title="greedy token agreement")
    ax_k.bar(x, [results[k]["kl_mean"] for k in labels], color="tab:red")
    ax_k.set_xticks(x, labels, rotation=30, ha="right")
    ax_k.set(ylabel="mean KL(fp || packed) [nats]", title="distribution shift")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path

"""Do the exports draft what the engine drafts? Greedy agreement of each export with the engine's fp32 drafts.

    python bench/export_agreement.py [--model-dir model] [--n 12] [--positions 64] [--prompts FILE] [--json OUT]

For each of --n held-out prompts (bench/workload.py) the engine (fp32, copy prior off) drafts --positions tokens
greedily; each export then reads prompt + those tokens in one pass (teacher-forced, so one disagreement does not
shift the positions after it) and its greedy token at every position is compared with the engine's:
- hf: the transformers export (interop/hf_export.py), without its generation config's suppress_tokens (as vLLM,
  SGLang or llama.cpp would run it) and with them (what transformers' generate applies);
- gguf: the GGUF export (interop/gguf_export.py) in llama-cpp-python, F32 (with an F32 and with llama.cpp's default
  F16 K/V cache), F16 and Q8_0 (default cache). Skipped when llama-cpp-python is not installed.
A reduced draft vocabulary (model/draft_vocab.py) is reported as well: the minimum over positions of the maximum
draft-vocabulary logit (zero rows outside it, logit 0, would win wherever that maximum is negative), the minimum
margin between that maximum and the mean draft logit (what the export's mean rows must stay below; they do by
construction), and the probability mass softmax gives the tokens outside under either filling.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import heldout_prompts
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.evaluation.evaluate import encode_records
from drafter_lib.interop.gguf_export import export_gguf
from drafter_lib.interop.hf_export import export_hf
from drafter_lib.model import draft_vocab, hf_models
from drafter_lib.packed.model_dir import read_model_dir


def _row(name, preds, refs, inside) -> dict:
    n = sum(len(r) for r in refs)
    diff = sum(a != b for p, r in zip(preds, refs) for a, b in zip(p, r))
    outside = sum(t not in inside for p in preds for t in p) if inside is not None else 0
    return {"export": name, "positions": n, "differ": diff, "differ_rate": diff / n, "outside_draft_vocab": outside}


def hf_rows(model_dir, out_dir, prompts, refs, ids, vocab) -> tuple[list[dict], dict]:
    from transformers import AutoModelForCausalLM

    export_hf(model_dir, out_dir)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    suppress = model.generation_config.suppress_tokens or []
    inside = None if ids is None else set(ids.tolist())
    plain, masked, stats = [], [], {"max_in_vocab": [], "margin": [], "mass_zero_rows": [], "mass_mean_rows": []}
    with torch.inference_mode():
        for p, r in zip(prompts, refs):
            seq = torch.tensor([list(p) + list(r[:-1])])
            logits = model(seq).logits[0, len(p) - 1:].float()
            plain.append(logits.argmax(-1).tolist())
            m = logits.clone()
            if suppress:
                m[:, suppress] = float("-inf")
            masked.append(m.argmax(-1).tolist())
            if ids is not None:
                d = logits[:, ids]  # the draft-vocabulary logits: exactly the engine's head
                stats["max_in_vocab"].append(d.max(-1).values)
                stats["margin"].append(d.max(-1).values - d.mean(-1))
                n_out = vocab - ids.numel()
                lse = torch.logsumexp(d, -1)
                stats["mass_zero_rows"].append(torch.sigmoid(np.log(n_out) - lse))
                stats["mass_mean_rows"].append(torch.sigmoid(np.log(n_out) + d.mean(-1) - lse))
    rows = [_row("hf, no suppress_tokens", plain, refs, inside), _row("hf, suppress_tokens", masked, refs, inside)]
    vocab_stats = {}
    if ids is not None:
        cat = {k: torch.cat(v) for k, v in stats.items()}
        vocab_stats = {"draft_vocab": int(ids.numel()), "vocab": vocab, "positions": int(cat["max_in_vocab"].numel()),
                       "min_max_in_vocab_logit": float(cat["max_in_vocab"].min()),
                       "positions_max_in_vocab_logit_below_0": int((cat["max_in_vocab"] < 0).sum()),
                       "min_margin_max_minus_mean": float(cat["margin"].min()),
                       "outside_mass_zero_rows_mean": float(cat["mass_zero_rows"].mean()),
                       "outside_mass_zero_rows_max": float(cat["mass_zero_rows"].max()),
                       "outside_mass_mean_rows_mean": float(cat["mass_mean_rows"].mean()),
                       "outside_mass_mean_rows_max": float(cat["mass_mean_rows"].max())}
    return rows, vocab_stats


def gguf_rows(model_dir, out_dir, prompts, refs, ids, threads) -> list[dict]:
    try:
        import llama_cpp
    except ImportError as e:
        print(f"gguf rows skipped: llama-cpp-python is not importable ({e})")
        return []
    inside = None if ids is None else set(ids.tolist())
    ctx = max(len(p) + len(r) for p, r in zip(prompts, refs)) + 8
    rows = []
    files = {}
    for kind in ("f32", "f16", "q8_0"):
        files[kind] = export_gguf(model_dir, Path(out_dir) / f"drafter-{kind}.gguf", gguf_type=kind)
    f32 = llama_cpp.GGML_TYPE_F32
    for name, kind, kv in (("gguf F32, F32 K/V", "f32", f32), ("gguf F32, F16 K/V", "f32", None),
                           ("gguf F16, F16 K/V", "f16", None), ("gguf Q8_0, F16 K/V", "q8_0", None)):
        kw = {} if kv is None else {"type_k": kv, "type_v": kv}
        llm = llama_cpp.Llama(str(files[kind]), n_ctx=ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              logits_all=True, verbose=False, **kw)
        try:
            preds = []
            for p, r in zip(prompts, refs):
                llm.reset()
                llm.eval(list(p) + list(r[:-1]))
                preds.append(np.asarray(llm.scores[: llm.n_tokens])[len(p) - 1:].argmax(-1).tolist())
        finally:
            llm.close()
        rows.append(_row(name, preds, refs, inside))
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--prompts", default=None, help="held-out prompts file (default: bench/workload.py's choice)")
    ap.add_argument("--n", type=int, default=12, help="prompts")
    ap.add_argument("--positions", type=int, default=64, help="greedy positions per prompt")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    t0 = time.time()
    packed = read_model_dir(args.model_dir)
    ids = packed.state_dict.get(draft_vocab.IDS_TENSOR)
    vocab = int(packed.config["vocab_size"])
    tok = hf_models.default_tokenizer()
    prompts = encode_records(tok, heldout_prompts(args.prompts, args.n))
    engine = DraftEngine.from_dir(args.model_dir, dtype="float32", copy_policy={"enabled": False})
    refs = [engine.draft(p, args.positions).tokens for p in prompts]
    with tempfile.TemporaryDirectory(prefix="export_agreement_") as d:
        rows, vocab_stats = hf_rows(args.model_dir, Path(d) / "hf", prompts, refs, ids, vocab)
        rows += gguf_rows(args.model_dir, d, prompts, refs, ids, args.threads)
    print(f"\n{len(prompts)} held-out prompts x {args.positions} positions, teacher-forced on the engine's fp32 "
          f"greedy drafts ({args.model_dir})\n")
    print("| export | positions | greedy token differs | rate | outside the draft vocabulary |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['export']} | {r['positions']} | {r['differ']} | {r['differ_rate']:.4f} | "
              f"{r['outside_draft_vocab']} |")
    if vocab_stats:
        s = vocab_stats
        print(f"\ndraft vocabulary {s['draft_vocab']} of {s['vocab']}, over {s['positions']} positions:")
        print(f"  min over positions of the max draft-vocabulary logit: {s['min_max_in_vocab_logit']:.3f} "
              f"(positions where it is below 0, so zero rows would win: "
              f"{s['positions_max_in_vocab_logit_below_0']})")
        print(f"  min margin max - mean draft logit (mean rows lose by this much): "
              f"{s['min_margin_max_minus_mean']:.3f}")
        print(f"  softmax mass outside the draft vocabulary, zero rows: mean {s['outside_mass_zero_rows_mean']:.2e}, "
              f"max {s['outside_mass_zero_rows_max']:.2e}; mean rows: mean {s['outside_mass_mean_rows_mean']:.2e}, "
              f"max {s['outside_mass_mean_rows_max']:.2e}")
    result = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
              "prompts": len(prompts), "positions": args.positions, "rows": rows, "draft_vocab": vocab_stats,
              "seconds": round(time.time() - t0, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{result['seconds']} s")
    return result


if __name__ == "__main__":
    main()

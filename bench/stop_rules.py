"""Which rule should end a dynamic draft? Greedy speculative decoding replayed offline, rule by rule.

    python bench/stop_rules.py [--model-dir model] [--prompts FILE] [--n 12] [--max-new-tokens 256] [--k 16]
                               [--trace runs/stop_rules_trace.json] [--json OUT]

Greedy verification is deterministic: at every position of the target's greedy output, the drafter's k-token
draft (its tokens and their probabilities, threshold 0) and the number of them the target accepts are fixed. So one
pass over the references (saved to --trace and reused: under other code paths only the costs are measured again)
replays any stopping rule exactly: fixed k, stop before the first token below p (the engine's `min_confidence`),
or stop once the product of the probabilities so far falls below p. Each step costs v(L) + c(L') one-token target
steps, with v and c from `speedup.measure_cost` on the machine at hand (L drafted tokens, L' = min(L + 1, k) the
tokens the drafter computed: a dynamic draft computes the one it rejects). The table gives each rule's mean
acceptance length and predicted speedup over plain greedy decoding; `bench/speculative.py` measures rows for real.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.workload import heldout_prompts
from drafter_lib.common.measured_choice import cpu_model
from drafter_lib.decoding.speculative import HFTarget, accepted_length, speculative_generate
from drafter_lib.engine.draft_engine import DraftEngine
from drafter_lib.evaluation.evaluate import encode_records
from drafter_lib.evaluation.speedup import measure_cost
from drafter_lib.model import hf_models
from drafter_lib.teacher import targets as teacher


def trace(engine, target, prompts, max_new: int, k: int, stop) -> list[dict]:
    """Per prompt: the target's greedy reference and, at each of its positions, the accepted length of the k-token
    draft and the draft's probabilities (1.0 for a token the copy prior proposed: no threshold applies to it)."""
    out = []
    for p in tqdm(prompts, desc="trace"):
        ref = speculative_generate(target, p, max_new, None, 1, stop).tokens
        acc, probs = [], []
        for i in range(len(ref)):
            d = engine.draft(p + ref[:i], k, min_confidence=0, return_probs=True)
            acc.append(accepted_length(d, ref[i:]))
            probs.append([1.0 if q is None else round(float(q), 5) for q in d.probs])
        out.append({"n": len(ref), "accepted": acc, "probs": probs})
    return out


def draft_length(rule: tuple[str, float], probs: list[float]) -> int:
    kind, p = rule
    if kind == "fixed":
        return min(int(p), len(probs))
    run = 1.0
    for j, q in enumerate(probs):
        run = run * q if kind == "cumulative" else q
        if run < p:
            return j
    return len(probs)


def replay(tr: list[dict], rule: tuple[str, float], v: dict, c: dict, k: int) -> dict:
    tokens = steps = 0
    cost = 0.0
    for t in tr:
        pos = 0
        while pos < t["n"]:
            cap = min(k, t["n"] - pos - 1)  # as speculative_generate: no drafting past the end
            n = min(draft_length(rule, t["probs"][pos]), cap)
            computed = n if rule[0] == "fixed" or n == cap else n + 1
            cost += (v[n] if n else 1.0) + (c[computed] * computed if computed else 0.0)
            step = min(t["accepted"][pos], n) + 1
            pos, tokens, steps = pos + step, tokens + step, steps + 1
    return {"rule": f"{rule[0]} {rule[1]:g}", "mal": tokens / steps, "speedup": tokens / cost}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(ROOT / "model"))
    ap.add_argument("--prompts", default=None, help="held-out prompt file (default: bench/speculative.py's workload)")
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--trace", default=None, help="read the trace from here if it exists, else write it there")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    hf, tok = hf_models.load_default_teacher()
    target = HFTarget(hf)
    engine = DraftEngine.from_dir(args.model_dir)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}; engine {engine.dtype}, copy prior {engine.copy_policy.enabled}")
    if args.trace and Path(args.trace).is_file():
        tr = json.loads(Path(args.trace).read_text())
    else:
        records = heldout_prompts(args.prompts, args.n)
        tr = trace(engine, target, encode_records(tok, records), args.max_new_tokens, args.k,
                   teacher.stop_token_ids(tok))
        if args.trace:
            Path(args.trace).write_text(json.dumps(tr))
    ks = range(1, args.k + 1)
    cost = measure_cost(engine, target, ks=ks)
    v = {k: cost["v_at_k"][str(k)] for k in ks}
    c = {k: cost["c_at_k"][str(k)] for k in ks}
    print("v_k (verify of k + 1 tokens, one-token steps): " + ", ".join(f"{k}: {v[k]:.2f}" for k in ks))
    print(f"c (a drafted token, one-token steps): k=1 {c[1]:.3f}, k={args.k} {c[args.k]:.3f}")
    rules = ([("fixed", k) for k in (1, 2, 3, 4, 6, 8, 16) if k <= args.k]
             + [("per-token", p) for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)]
             + [("cumulative", p) for p in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4)])
    rows = [replay(tr, r, v, c, args.k) for r in rules]
    print(f"{sum(t['n'] for t in tr)} reference tokens over {len(tr)} prompts, k <= {args.k}")
    print(f"{'rule':18} {'MAL':>6} {'predicted speedup':>18}")
    for r in rows:
        print(f"{r['rule']:18} {r['mal']:6.2f} {r['speedup']:17.2f}x")
    for kind in ("fixed", "per-token", "cumulative"):
        best = max((r for r in rows if r["rule"].startswith(kind)), key=lambda r: r["speedup"])
        print(f"best {kind}: {best['rule']} ({best['speedup']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cost": cost, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()

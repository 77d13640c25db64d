"""A packed drafter against an off-the-shelf peer on target references already written (a run's
`eval/references.jsonl`): acceptance at k for each, with 95 % bootstrap intervals, and the paired difference.

    python bench/peer_acceptance.py --model-dir runs/qwen-coder/model --references runs/qwen-coder/eval/references.jsonl
                                    [--peer qwen2.5-coder-0.5b-instruct] [--k 16] [--json OUT]

No target runs: the references hold each prompt's ids and the target's greedy continuation, so the simulation
(greedy verification, `evaluation.acceptance.simulate`) needs only the drafters. Both draft a fixed k (no threshold);
the pack without its copy prior (the baselines table's "packed" row) and with it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from drafter_lib.common.files import read_jsonl  # noqa: E402
from drafter_lib.evaluation import bootstrap  # noqa: E402
from drafter_lib.evaluation.acceptance import simulate  # noqa: E402
from drafter_lib.evaluation.drafters import engine_from_dir, peer_drafter  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--references", required=True, help="JSONL of {id, prompt_ids, reference_ids}")
    ap.add_argument("--peer", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    refs = read_jsonl(args.references)
    prompts, references = [r["prompt_ids"] for r in refs], [r["reference_ids"] for r in refs]
    drafters = {f"peer: {args.peer}": peer_drafter(args.peer),
                "packed": engine_from_dir(args.model_dir, copy_prior=False, min_confidence=0.0),
                "packed + copy prior": engine_from_dir(args.model_dir, copy_prior=True, min_confidence=0.0)}
    per_prompt = {}
    out = {"k": args.k, "prompts": len(refs), "reference_tokens": sum(map(len, references)),
           "ids": [r["id"] for r in refs], "rows": {}}
    for name, drafter in drafters.items():
        sim = simulate(drafter, prompts, references, k=args.k, grow=True, desc=name)
        per_prompt[name] = sim.per_prompt
        out["rows"][name] = {**bootstrap.mal_interval(sim.per_prompt), "per_prompt": sim.per_prompt}
        print(f"{name:40} MAL {bootstrap.fmt(out['rows'][name])}", flush=True)
    peer = next(iter(drafters))
    for name in list(drafters)[1:]:
        d = out["rows"][name]["minus_peer"] = bootstrap.paired_difference(per_prompt[name], per_prompt[peer])
        print(f"{name} minus the peer, same prompts: {d['difference']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

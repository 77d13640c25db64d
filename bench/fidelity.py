"""Fidelity to the fp32 model: how closely each target implementation's greedy output follows transformers fp32.

    python bench/fidelity.py [--target SPEC] [--n 24] [--max-new-tokens 128] [--targets native gguf w8a8 llama_cpp]
                             [--gguf-types Q4_1 Q8_0] [--json OUT]

Targets: one model (--target; the default teacher, SmolLM2-135M-Instruct, unless given) in the hand-written decoder
fp32, in this project's target runtime (its GGUF blocks, W8A8, W4A8: `decoding/runtime.py`), and as its GGUF in
llama.cpp (the default teacher's shipped Q4_1 and llama.cpp's Q8_0 of it; a parted model's Q4_K_M)
(bench/target_rows.py). The reference is the same model in transformers, fp32: its weights are the GGUF's, de-quantized,
so every row differs from it only by its own numerics. Prompts: the end-to-end benchmarks' held-out prompts
(bench/workload.py). Figures (evaluation/fidelity.py): share of identical answers, mean tokens to the first difference,
top-1 agreement under teacher forcing."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.target_rows import targets  # noqa: E402
from bench.workload import heldout_prompts  # noqa: E402
from drafter_lib.common.chat import stop_token_ids  # noqa: E402
from drafter_lib.common.measured_choice import cpu_model  # noqa: E402
from drafter_lib.decoding.speculative import HFTarget, greedy_decode  # noqa: E402
from drafter_lib.evaluation.evaluate import encode_records  # noqa: E402
from drafter_lib.evaluation.fidelity import fidelity  # noqa: E402
from drafter_lib.model import hf_models  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=hf_models.DEFAULT_TEACHER, help="the model spec (default: %(default)s)")
    ap.add_argument("--prompts", default=None, help="held-out prompt file (default: bench/workload.py's)")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--targets", nargs="+", default=["native", "w8a8", "llama_cpp"],
                    choices=["native", "gguf", "w8a8", "w4a8", "llama_cpp"])
    ap.add_argument("--gguf-types", nargs="+", default=["Q4_1", "Q8_0"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}  capability: {torch.backends.cpu.get_cpu_capability()}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}")
    print(f"target: {args.target}")
    hf, tok = hf_models.load_teacher(args.target, dtype=torch.float32)
    stop = stop_token_ids(tok)
    prompts = encode_records(tok, heldout_prompts(args.prompts, args.n))
    reference = HFTarget(hf, linears="stock")
    refs = [greedy_decode(reference, p, args.max_new_tokens, stop) for p in prompts]
    print(f"{len(prompts)} prompts, reference: transformers fp32, {sum(map(len, refs))} answer tokens")
    del reference, hf  # each row loads its own copy (a 1.5B model's fp32 copies are 6 GB each)
    print(f"{'target':22} {'identical':>9} {'tokens to 1st diff':>18} {'top-1 (teacher forced)':>22}")
    out = {}
    for label, target in targets(args.target, args.targets, args.gguf_types):
        f = out[label] = fidelity(target, prompts, refs, args.max_new_tokens, stop)
        print(f"{label:22} {f['identical']:9.2f} {f['tokens_to_first_difference']:18.1f} "
              f"{f['top1_agreement']:22.4f}", flush=True)
        if hasattr(target, "close"):
            target.close()
        del target
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

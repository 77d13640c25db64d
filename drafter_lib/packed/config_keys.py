"""The settings a packed model's config.json carries beyond the HF config, and the checks of their values.

Packing writes them, the engine reads them, export drops them, and the study's config checks and the server check
values against them; all of them read this module, so a key is spelled once and a value is checked one way.
- `draft_min_confidence`: the draft threshold the pack recommends (dynamic draft length). Only a recommendation: the
  engine and the server use it as their default only when asked to (`RECOMMENDED`), so a request without a
  threshold gets exactly the tokens it asked for.
- `draft_engine_dtype`: how the engine holds the weights unless told otherwise (`ENGINE_DTYPES`).
"""
from __future__ import annotations

import math

MIN_CONFIDENCE_KEY = "draft_min_confidence"
ENGINE_DTYPE_KEY = "draft_engine_dtype"
RECOMMENDED = "recommended"  # as a default threshold: the pack's MIN_CONFIDENCE_KEY
# how the engine can hold the weights: "auto*" chosen by measurement, else one format for all (engine/kernels.py)
ENGINE_DTYPES = ("auto", "auto-approx", "float32", "float16", "bfloat16", "int8", "int8w")
# keys the study adds that transformers does not know: they stay in the pack, an HF export drops them (with the
# draft vocabulary's own key, model/draft_vocab.CONFIG_KEY)
STUDY_KEYS = ("pruned_from", "_name_or_path", "_model_name_or_path", MIN_CONFIDENCE_KEY, ENGINE_DTYPE_KEY)


def check_engine_dtype(value, what: str = "dtype") -> str:
    """One of ENGINE_DTYPES."""
    if not isinstance(value, str) or value not in ENGINE_DTYPES:
        raise ValueError(f"{what} must be one of {list(ENGINE_DTYPES)}, got {value!r}")
    return value


def check_min_confidence(value, what: str = "min_confidence") -> float | None:
    """None, or a number in [0, 1] as a float (0 = off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not 0 <= value <= 1:
        raise ValueError(f"{what} must be a number in [0, 1] (or None), got {value!r}")
    return float(value)


def recommended_min_confidence(config: dict | None) -> float | None:
    """The threshold a pack's config.json recommends (None: none)."""
    return check_min_confidence((config or {}).get(MIN_CONFIDENCE_KEY), f"config.json {MIN_CONFIDENCE_KEY}")


def with_engine_settings(config: dict, min_confidence: float | None = None, engine_dtype: str | None = None) -> dict:
    """`config` plus the pack's recommended threshold and engine dtype (each checked; None: not recorded)."""
    out = dict(config)
    if min_confidence is not None:
        out[MIN_CONFIDENCE_KEY] = check_min_confidence(min_confidence)
    if engine_dtype is not None:
        out[ENGINE_DTYPE_KEY] = check_engine_dtype(engine_dtype, "engine_dtype")
    return out

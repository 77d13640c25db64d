"""The drafters of the baselines table: untrained pruned base, fp distilled, packed, n-gram lookup alone,
packed + copy prior; and the HF checkpoint reading they need."""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from pathlib import Path

from drafter_lib.packed.copy_policy import CopyPolicy
from drafter_lib.packed.model_dir import read_copy_policy


class CopyDrafter:
    """n-gram prompt lookup alone: proposals come only from the current context (CopyPolicy.propose)."""

    def __init__(self, policy: CopyPolicy):
        self.policy = policy

    def draft(self, tokens: list[int], k: int) -> list[int]:
        return list(self.policy.propose(list(tokens), k))[:k]


def hf_config_dict(config) -> dict:
    """A transformers config (or dict) as the plain dict `config.json` holds."""
    if isinstance(config, dict):
        return dict(config)
    return json.loads(config.to_json_string(use_diff=False))


def load_hf_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(hf_config dict, fp32 state dict) of a saved HF model dir (e.g. train's best_distill/)."""
    from drafter_lib.model.draft_vocab import load_hf_drafter

    m = load_hf_drafter(path)
    return hf_config_dict(m.config), {k: v.detach().clone() for k, v in m.state_dict().items()}


def engine_from_dir(model_dir: str | Path, copy_prior: bool | None = None, **kw):
    """DraftEngine over a packed model dir; copy_prior True/False forces its copy policy on/off, None keeps it."""
    from drafter_lib.engine.draft_engine import DraftEngine

    if copy_prior is None:
        return DraftEngine.from_dir(model_dir, **kw)
    policy = dataclasses.replace(read_copy_policy(model_dir), enabled=copy_prior)
    return DraftEngine.from_dir(model_dir, copy_policy=policy, **kw)


def engine_from_state_dict(hf_config, state_dict: dict, copy_policy: dict | CopyPolicy | None = None, **kw):
    """DraftEngine over an unpacked (fp) checkpoint."""
    from drafter_lib.engine.draft_engine import DraftEngine

    return DraftEngine.from_state_dict(hf_config_dict(hf_config), state_dict, copy_policy=copy_policy, **kw)


def ngram_drafter(copy_policy: dict | CopyPolicy | None = None) -> CopyDrafter:
    """Prompt lookup alone (n-gram matches in the current context), with `copy_policy`'s n-gram settings."""
    if not isinstance(copy_policy, CopyPolicy):
        copy_policy = CopyPolicy.from_dict(copy_policy)
    return CopyDrafter(dataclasses.replace(copy_policy, enabled=True))


def standard_baselines(model_dir: str | Path | None = None, base: tuple[dict, dict] | None = None,
                       fp: tuple[dict, dict] | None = None, ngram: bool = True, copy_prior: bool = True,
                       **engine_kw) -> dict:
    """The baselines table's drafters, in order: untrained pruned base, fp distilled, packed, n-gram lookup alone,
    packed + copy prior. `base` / `fp` are (hf_config, state_dict); each drafter is included when its input is.
    Engines draft a fixed k (min_confidence 0) unless told otherwise: acceptance at k is the table's statistic, and
    the pack's dynamic threshold would cut drafts short."""
    engine_kw.setdefault("min_confidence", 0.0)
    out: dict = OrderedDict()
    if base is not None:
        out["pruned base (untrained)"] = engine_from_state_dict(*base, copy_policy=None, **engine_kw)
    if fp is not None:
        out["distilled fp"] = engine_from_state_dict(*fp, copy_policy=None, **engine_kw)
    policy = None
    if model_dir is not None:
        out["packed"] = engine_from_dir(model_dir, copy_prior=False, **engine_kw)
        policy = read_copy_policy(model_dir)
    if ngram:
        out["n-gram lookup"] = ngram_drafter(policy)
    if model_dir is not None and copy_prior:
        out["packed + copy prior"] = engine_from_dir(model_dir, copy_prior=True, **engine_kw)
    return out

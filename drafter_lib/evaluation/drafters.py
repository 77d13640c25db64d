"""The drafters of the baselines table: untrained pruned base, fp distilled, packed, n-gram lookup alone,
packed + copy prior, and an off-the-shelf peer where one is named; the tree rows drafted by the same engines
("packed tree N": `tree_rows`); and the HF checkpoint reading they need."""
from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from drafter_lib.packed.copy_policy import CopyDrafter, CopyPolicy
from drafter_lib.packed.model_dir import read_copy_policy


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
    return CopyDrafter(copy_policy)


PRUNED_BASE = "pruned base (untrained)"  # the baselines row of the untrained drafter base


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
        out[PRUNED_BASE] = engine_from_state_dict(*base, copy_policy=None, **engine_kw)
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


def peer_drafter(spec: str, **engine_kw):
    """An off-the-shelf model to beat (a spec `hf_models.load_teacher` takes; it must share the target's tokenizer)
    as a drafter engine over its fp32 weights, drafting a fixed k like the other rows."""
    import torch

    from drafter_lib.model import hf_models

    engine_kw.setdefault("min_confidence", 0.0)
    model, _ = hf_models.load_teacher(spec, dtype=torch.float32)
    return engine_from_state_dict(hf_config_dict(model.config), model.state_dict(), copy_policy=None, **engine_kw)


# Tree rows: node budgets per target step (eval.tree_budgets, specdraft-eval --tree-budgets) and the chain rows whose
# engines draft them (eval.tree_sources, --tree-sources; TREE_SOURCES: the engine rows). By default the pack as
# shipped (copy prior on) only: a tree is drafted whole, a forward pass per level, so a tree row of the shipped pack
# cost 4-8x its chain row (grown drafts) on 12 MT-bench prompts; two such rows keep 05_eval near its ~8 min. "packed"
# (the model alone) isolates what the tree itself adds. 8: the budget fastest end to end on a CPU target (the
# engine's and the server's default, docs/studies/trees.md); 16: what a larger one still adds.
DEFAULT_TREE_BUDGETS = (8, 16)
TREE_SOURCES = (PRUNED_BASE, "distilled fp", "packed", "packed + copy prior")
DEFAULT_TREE_SOURCES = ("packed + copy prior",)


@dataclass(frozen=True)
class TreeRow:
    """One tree row of the evaluation: `drafter` drafts trees of at most `budget` nodes (`draft_tree`); `chain`
    names the chain row of the same drafter (the tree's gain is measured against it on the same prompts)."""

    drafter: object
    budget: int
    chain: str


def tree_row_name(chain: str, budget: int) -> str:
    return f"{chain} tree {budget}"


def check_tree_budgets(budgets: Iterable[int], what: str = "tree budgets") -> list[int]:
    """The budgets as a list of distinct ints >= 1 (ValueError naming `what` otherwise)."""
    out = list(budgets)
    for b in out:
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{what}: every budget must be an int >= 1, got {b!r}")
    dups = sorted({b for b in out if out.count(b) > 1})
    if dups:
        raise ValueError(f"{what}: listed twice: {dups}")
    return out


def check_tree_sources(sources: Iterable[str], what: str = "tree sources") -> list[str]:
    """The sources as a list of distinct names of TREE_SOURCES (ValueError naming `what` otherwise)."""
    out = list(sources)
    for s in out:
        if s not in TREE_SOURCES:
            raise ValueError(f"{what}: {s!r} is not a row whose engine drafts trees; choose from {list(TREE_SOURCES)}")
    dups = sorted({s for s in out if out.count(s) > 1})
    if dups:
        raise ValueError(f"{what}: listed twice: {dups}")
    return out


def tree_rows(drafters: dict, budgets: Sequence[int], sources: Sequence[str] = DEFAULT_TREE_SOURCES
              ) -> tuple[dict[str, TreeRow], list[str]]:
    """(name -> TreeRow, reasons rows were left out): for each chain row named in `sources` (that `drafters` has)
    and each budget, "<chain> tree <budget>" drafted by the same object (an engine's trees follow its copy policy as
    its chains do, so "packed + copy prior tree N" is that engine's). A source that cannot draft trees (no
    `draft_tree`: an engine from before trees) is left out, and so is a budget above what the engine drafts."""
    budgets, sources = check_tree_budgets(budgets), check_tree_sources(sources)
    rows: dict[str, TreeRow] = OrderedDict()
    skipped: list[str] = []
    if not budgets:
        return rows, skipped
    for name in sources:
        d = drafters.get(name)
        if d is None:
            continue
        if not callable(getattr(d, "draft_tree", None)):
            skipped.append(f"{name}: {type(d).__name__} has no draft_tree (trees need an engine that drafts them)")
            continue
        cap = max_tree_budget(d)
        for b in budgets:
            if cap is not None and b > cap:
                skipped.append(f"{tree_row_name(name, b)}: {type(d).__name__} drafts trees of at most {cap} nodes")
            else:
                rows[tree_row_name(name, b)] = TreeRow(d, b, name)
    return rows, skipped


def max_tree_budget(drafter) -> int | None:
    """The most nodes `drafter`'s trees may have: an engine's bound, or None (no known bound)."""
    from drafter_lib.engine.draft_engine import DraftEngine

    if not isinstance(drafter, DraftEngine):
        return None
    try:
        from drafter_lib.engine import tree_draft
    except ImportError:  # an engine without its own trees
        return None
    return getattr(tree_draft, "MAX_TREE_BUDGET", None)

"""The end-to-end benchmarks' prompts (`bench/speculative.py`, `bench/stop_rules.py`): one definition, so a stopping
rule replayed offline is scored on the same workload the end-to-end rows measure.

A given file, else the default run's held-out split when present, else held-out prompts (by the study's id-hash
split) of the embedded synthetic families and the corpora the default study reads (data.shared_data "auto": the
vendored copies in data/corpora/, the same on every machine, with or without ../shared/data; the default
mixture's corpora), spread over categories. Import after `drafter_lib` is on sys.path.
"""
from __future__ import annotations

from drafter_lib.common.layout import RunLayout, resolve_shared_data
from drafter_lib.data import corpora as data
from drafter_lib.evaluation.evaluate import load_eval_prompts, spread_over_categories
from drafter_lib.study.config_sections import DataConfig


def heldout_prompts(path: str | None, n: int) -> list[dict]:
    default_run = RunLayout.of("runs/default").heldout_prompts
    if path or default_run.is_file():
        return load_eval_prompts(path or default_run, n)
    cfg = DataConfig()  # the default study's corpora, on every machine ("auto" = the vendored copies)
    records = []
    for src in data.default_sources(resolve_shared_data(cfg.shared_data), synthetic_n=600, humaneval=False,
                                    corpora=data.corpora_for(cfg.source_weights)):
        recs, _ = data.load_source(src)
        records += data.split_heldout(recs, cfg.heldout_frac)[1]  # the default study's held-out side
    return spread_over_categories(records, n)

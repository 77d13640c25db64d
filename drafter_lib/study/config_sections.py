"""The sections of the study's configuration, one dataclass each, and the shape of the tree that holds them.

`config.StudyConfig` is that tree (with the presets, the overrides and the checks that run on building it); the
checks (`config_checks`) are written against `ConfigSections`, the tree's shape, so that they need not import the
module that calls them. Both modules import the sections from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from drafter_lib.evaluation.drafters import DEFAULT_TREE_BUDGETS, DEFAULT_TREE_SOURCES
from drafter_lib.packed.copy_policy import CopyPolicy
from drafter_lib.train.trainer import TrainConfig


@dataclass
class StudySection:
    teacher: str = "smollm2-135m-instruct"  # hf_models spec, local HF dir, or "tiny-random[:llama|:qwen2|:qwen3]"
    drafter_base: str | None = None  # None: the drafter starts as a copy of the teacher
    keep_layers: str | list[int] | None = "even:4"  # layers of the base the drafter keeps ("first:K", [0, 3], None)
    device: str = "cpu"
    num_threads: int | None = None  # torch CPU threads (None: torch's default); set 1 on shared cores
    seed: int = 0


# The default mixture: GSM8K answers are long (186 teacher tokens on average), so at equal weights math took 54 % of
# the teacher's tokens; the synthetic families (six, three of them open-ended chat requests) get more. A weight
# naming a corpus that is absent on this machine is dropped (stages.build_prompts).
DEFAULT_SOURCE_WEIGHTS = {"synthetic": 1.3, "t0_train_prompts": 1.0, "gsm8k_train_questions": 0.4,
                          "self_instruct_seed_tasks": 1.0}


@dataclass
class DataConfig:
    # File corpora: "auto" = the copies vendored in data/corpora/ (the same prompts on every machine); a folder (e.g.
    # "../shared/data") = the .jsonl files there; None = none. Loaded: t0, gsm8k, self-instruct, plus dolly_15k
    # only when source_weights names it (corpora.corpora_for).
    shared_data: str | None = "auto"
    synthetic_n: int = 2300
    self_prompts: int = 0  # user turns the teacher writes from its chat template's user header (0: none)
    total_prompts: int | None = 6000  # None: every prompt the sources give (weights only subsample)
    source_weights: dict[str, float] | None = field(default_factory=lambda: dict(DEFAULT_SOURCE_WEIGHTS))
    heldout_frac: float = 0.04
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 256
    humaneval: bool | str = "auto"  # held-out HumanEval prompts: True, False or "auto" (when installed)


@dataclass
class TeacherConfig:
    max_new_tokens: int = 256
    batch_size: int = 128  # decode rows per step: 4x 32's rows cost ~3x the time here (attention reads fp32 K/V)
    backend: str = "auto"  # auto | native | hf | vllm (GPU; docs/scale_out.md) | runtime (the target runtime, CPU)
    numerics: str | None = None  # runtime only: auto | gguf | w8a8 | w4a8 | fp32 (null: the runtime's default)
    tensor_parallel_size: int = 1  # vllm only: GPUs one vLLM engine spreads the teacher over
    soft_topk: int = 16  # also store the teacher's top-K log-probs per continuation token (0: off)
    soft_prompt: bool = True  # ... and at prompt positions (for train.loss_on_prompt)
    # "drafter writes, target scores": a packed model dir or training checkpoint folder (repository-relative) whose
    # greedy continuations of the prompts the teacher scores in one forward pass per batch, storing its greedy token
    # (the hard label) and top-K at every position; null: the teacher writes its own continuations
    writer: str | None = None
    score_batch_size: int = 16  # rows per scoring forward pass (its logits are rows x tokens x vocabulary floats)


@dataclass
class QuantSection:
    group_size: int = 64  # int4 group along the input dim: must divide the drafter's hidden and MLP sizes
    scale_dtype: str = "float16"
    embed_bits: int | None = 8  # embeddings / lm_head: int8 per row (None: float)
    embed_group_size: int | None = None

    def quant_config(self):
        from drafter_lib.quantization import QuantConfig

        return QuantConfig.default_for(self.group_size, self.scale_dtype, self.embed_bits, self.embed_group_size)


def _default_copy_policy() -> CopyPolicy:
    return CopyPolicy(enabled=True, max_ngram=3, min_ngram=2, max_copy=16, mode="prefix")


@dataclass
class PackConfig:
    copy_policy: CopyPolicy = field(default_factory=_default_copy_policy)  # copy_policy.json of the pack
    checkpoint: str = "best"  # best (QAT) | best_distill (fp, packed with the same quantizer)
    # the pack's default dynamic draft threshold (None: fixed-length drafts). 0.4 with k <= 16 is the one setting that
    # beat 1.5x plain decoding with AVX-512 and with AVX2 code paths (docs/benchmarks.md, bench/speculative.py)
    min_confidence: float | None = 0.4
    # how the engine holds the pack's weights unless told otherwise (None: the engine's exact "auto"). "int8w": int8
    # weight rows with fp32 activations, whose compiled steps read a quarter of fp32's bytes and, unlike the int8
    # activations of "auto-approx", keep drafts independent of the cache state (docs/engine.md)
    engine_dtype: str | None = "int8w"
    publish: bool = False  # copy the pack to publish_dir (what serve.sh serves)
    publish_dir: str | None = None  # None: the repository's model/


# Evaluated besides the run's own held-out split (heldout.py): committed benchmark files, generated RAG prompts.
DEFAULT_HELDOUT_FILES = ("data/heldout/mt_bench.jsonl", "data/heldout/spec_bench_summarization.jsonl", "rag:0")


@dataclass
class EvalConfig:
    # Sized for <= ~8 min on 2 cores (docs/evaluation.md): 2 prompts in each of the 18 groups.
    limit: int | None = 36  # prompts (chat turns) spread round-robin over the groups: two of each of the 18 (None: all)
    max_new_tokens: int = 96
    k: int = 16  # draft tokens per target step
    e2e_prompts: int = 4  # prompts for real speculative decoding (lossless check, wall clock)
    e2e_k: int | None = None  # None: k, with the pack's own threshold (pack.min_confidence): the shipped defaults
    group_by: str = "category"  # category | source
    # repo-relative prompt files (project format or question.jsonl) or "rag:SEED[:N]"
    heldout_files: list[str] = field(default_factory=lambda: list(DEFAULT_HELDOUT_FILES))
    # rows "<source> tree N": draft trees of N nodes (depth <= k) of the engine of each chain row in tree_sources, in
    # the same simulation ([]: none; left out while the engine drafts no trees). By default the pack as shipped only
    # (evaluation/drafters.py: a tree row costs several chain rows); add "packed" for the model's trees alone
    tree_budgets: list[int] = field(default_factory=lambda: list(DEFAULT_TREE_BUDGETS))
    tree_sources: list[str] = field(default_factory=lambda: list(DEFAULT_TREE_SOURCES))
    # an off-the-shelf drafter to beat, as a model spec (e.g. "qwen2.5-coder-0.5b-instruct"; it must have the teacher's
    # tokenizer): a row "peer: SPEC" on the run's own references, paired with the pack as specdraft-eval --peer does
    # (drafters.peer_drafter: its fp32 weights, a fixed k). None: no peer row
    peer: str | None = None


class ConfigSections(Protocol):
    """A study config as the checks read it: its seven sections (`config.StudyConfig` has exactly these fields,
    which a test pins)."""

    study: StudySection
    data: DataConfig
    teacher: TeacherConfig
    train: TrainConfig
    quant: QuantSection
    pack: PackConfig
    eval: EvalConfig

"""How many bytes the teacher stage writes, estimated from the config before any stage runs.

The teacher writes one JSONL row per training prompt (`teacher/targets.jsonl`, drafter_lib.teacher.targets):
    {"id": ..., "category": ..., "source": ..., "prompt_ids": [...], "continuation_ids": [...]}
where every token id is its decimal digits plus ", ", and with teacher.soft_topk = K its top-K log-probabilities in
safetensors parts (`teacher/targets.soft/`, drafter_lib.teacher.soft_labels): per stored position K int32 ids and K
float16 log-probs (6 K bytes), one position per answer token and, with teacher.soft_prompt, one per prompt token
after the first; per row two int64 (offsets, starts) and its id in the part's header.

`teacher_bytes` is that arithmetic on known counts: on the files of real smoke runs (byte-level and SmolLM2
tokenizers) it gives the soft labels within 0.5 % and the JSONL at 1.17-1.22x (ids counted at the width of the
largest one); on a few rows, where the parts' headers weigh, it stays within 10 % over. `estimate` applies it to the
config's bounds, every prompt at data.max_prompt_tokens and every answer at teacher.max_new_tokens, so it is an upper
bound: a smoke run's files are a third (byte tokenizer) to a sixth (SmolLM2 tokenizer) of it, and the default
study's (4,546 prompts, 695k answer tokens) about a third.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SOFT_BYTES_PER_K = 6  # an int32 id and a float16 log-probability per stored position and K
SOFT_ROW_BYTES = 64  # offsets and starts (2 x int64) and the row id (~33 characters, escaped) in the part's header
SOFT_PART_BYTES = 512  # a part's header without its row ids (~400 bytes); a part per flush of teacher.batch_size rows
JSONL_ROW_BYTES = 160  # the row's keys, id, category and source besides its token ids
UNKNOWN_VOCAB = 200_000  # when the teacher's vocabulary size cannot be read: 6-digit ids


def id_bytes(vocab_size: int | None) -> int:
    """JSONL bytes of one token id, at most: the digits of the largest id and the ", " after it."""
    return len(str(max(int(vocab_size or UNKNOWN_VOCAB), 1) - 1)) + 2


def teacher_bytes(rows: int, prompt_tokens: int, answer_tokens: int, vocab_size: int | None, soft_topk: int,
                  soft_prompt: bool, rows_per_part: int = 128, scored: bool = False) -> dict:
    """{"targets", "soft", "total"}: bytes of targets.jsonl and targets.soft/ for `rows` rows holding
    `prompt_tokens` prompt and `answer_tokens` answer tokens in all (soft-label parts of `rows_per_part` rows).
    scored (teacher.writer): "targets" also holds the writer's drafted.jsonl and the targets' hard labels."""
    targets = rows * JSONL_ROW_BYTES + (prompt_tokens + answer_tokens) * id_bytes(vocab_size)
    if scored:
        targets = 2 * targets + answer_tokens * id_bytes(vocab_size)
    soft = 0
    if soft_topk:
        positions = answer_tokens + (max(prompt_tokens - rows, 0) if soft_prompt else 0)
        parts = -(-rows // max(rows_per_part, 1))
        soft = positions * soft_topk * SOFT_BYTES_PER_K + rows * SOFT_ROW_BYTES + parts * SOFT_PART_BYTES
    return {"targets": targets, "soft": soft, "total": targets + soft}


def _lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def prompt_bound(cfg) -> tuple[int, str]:
    """(at most how many prompts the teacher answers, from which keys): data.total_prompts when set, else every
    prompt of the sources (data.synthetic_n + data.self_prompts + the rows of the shared corpora)."""
    d = cfg.data
    if d.total_prompts is not None:
        return d.total_prompts, "data.total_prompts"
    from drafter_lib.common.layout import resolve_shared_data
    from drafter_lib.data.corpora import default_sources

    n, keys = d.synthetic_n + d.self_prompts, ["data.synthetic_n", "data.self_prompts"]
    shared = resolve_shared_data(d.shared_data)
    if shared is not None and Path(shared).is_dir():
        files = [Path(s["path"]) for s in default_sources(shared, 0, humaneval=False) if s.get("kind") == "file"]
        n += sum(_lines(f) for f in files)
        keys.append("data.shared_data")
    return n, " + ".join(keys) + " (data.total_prompts is null)"


@dataclass
class TeacherEstimate:
    prompts: int
    prompts_from: str
    prompt_tokens: int  # per prompt, at most (data.max_prompt_tokens)
    answer_tokens: int  # per prompt, at most (teacher.max_new_tokens)
    vocab_size: int | None
    soft_topk: int
    soft_prompt: bool
    bytes: dict

    @property
    def total(self) -> int:
        return self.bytes["total"]

    def describe(self) -> str:
        parts = [f"answers {human_bytes(self.bytes['targets'])} of JSONL at <= {id_bytes(self.vocab_size)} B a "
                 "token id"]
        if self.soft_topk:
            where = "every prompt and answer position" if self.soft_prompt else "every answer position"
            parts.append(f"soft labels {human_bytes(self.bytes['soft'])}: top-{self.soft_topk} ids and log-probs, "
                         f"{self.soft_topk * SOFT_BYTES_PER_K} B at {where}")
        return (f"at most {human_bytes(self.total)} ({self.prompts} prompts [{self.prompts_from}] x "
                f"({self.prompt_tokens} prompt + {self.answer_tokens} answer tokens); " + "; ".join(parts) + ")")


def estimate(cfg, vocab_size: int | None) -> TeacherEstimate:
    """The teacher stage's bytes on disk, at most, for config `cfg` and a teacher vocabulary of `vocab_size`."""
    n, how = prompt_bound(cfg)
    p, a = cfg.data.max_prompt_tokens, cfg.teacher.max_new_tokens
    t = cfg.teacher
    return TeacherEstimate(n, how, p, a, vocab_size, t.soft_topk, t.soft_prompt,
                           teacher_bytes(n, n * p, n * a, vocab_size, t.soft_topk, t.soft_prompt,
                                         t.score_batch_size if t.writer else t.batch_size, scored=bool(t.writer)))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def written_bytes(targets_path: str | Path) -> int:
    """Bytes a run's teacher stage has written so far: targets.jsonl, its soft-label parts and, where a writer
    drafted the rows the teacher scored (teacher.writer), drafted.jsonl beside it."""
    from drafter_lib.teacher.soft_labels import list_parts, soft_dir_for

    p = Path(targets_path)
    files = [f for f in (p, p.with_name("drafted.jsonl")) if f.is_file()] + list_parts(soft_dir_for(p))
    return sum(f.stat().st_size for f in files)


# ---------------------------------------------------------------------------------------------- training

CKPT_BYTES_PER_PARAM = 12  # a resumable checkpoint: fp32 weights and AdamW's two fp32 moments
EXPORT_BYTES_PER_PARAM = 4  # best_distill/ and best/: fp32 safetensors


def drafter_params(sizes: dict, layers: int, draft_vocab: int | None) -> int:
    """At most how many parameters the drafter trains: `layers` decoder layers of the base's `sizes`
    (hf_models.model_sizes; k and v taken as wide as q), its embedding, and a head of `draft_vocab` rows (None: the
    whole vocabulary), untied."""
    h, i, width = sizes["hidden_size"], sizes["intermediate_size"], sizes["attention_width"]
    vocab = sizes.get("vocab_size") or UNKNOWN_VOCAB
    per_layer = 4 * h * width + 3 * h * i + 2 * h  # q, k, v, o; gate, up, down; two norms
    return layers * per_layer + vocab * h + (draft_vocab or vocab) * h + h


def train_bytes(params: int, keep_checkpoints: int) -> int:
    """Bytes training keeps at its peak: `keep_checkpoints` checkpoints and the one being written, best_distill/,
    best/ and the copy of one of them while it is replaced."""
    return params * (CKPT_BYTES_PER_PARAM * (keep_checkpoints + 1) + EXPORT_BYTES_PER_PARAM * 3)

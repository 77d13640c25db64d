"""Training data for the drafter: teacher target rows -> examples, the held-out split, padded batches with
continuation-only targets, and the deterministic micro-batch stream (a pure function of seed and data position,
which is what makes resume and multi-process runs reproduce a single-process run exactly).

With a soft-label directory (`drafter_lib.teacher.soft_labels`), each example also carries the teacher's top-K
log-probabilities, joined by row id, and batches carry them per position (`soft_ids`, `soft_logprobs`,
`soft_mask`) for the top-K losses and for loss at prompt positions.

A row the target scored rather than wrote (`drafter_lib.teacher.scoring`) holds another model's continuation; with
its "target_argmax_ids" (the target's greedy token at each continuation position) those are the hard targets
instead of the continuation's own next tokens, and its soft labels are the target's distributions there."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE = -100

__all__ = ["IGNORE", "Example", "load_examples", "split_val", "target_ids", "collate", "epoch_batches",
           "BatchStream", "soft_dir_of"]


@dataclass
class Example:
    id: str
    ids: list[int]       # prompt + continuation (truncated)
    prompt_len: int
    soft_start: int = -1                         # sequence position of soft_ids[0]; -1: no soft labels
    soft_ids: torch.Tensor | None = None         # [n, K] int32, entry j = distribution at soft_start + j
    soft_logprobs: torch.Tensor | None = None    # [n, K] float16
    labels: list[int] | None = None              # hard target per continuation token; None: the tokens themselves

    @property
    def continuation_targets(self) -> list[int]:
        """The hard targets of the continuation positions: its labels, or the continuation's own tokens."""
        return self.ids[self.prompt_len:] if self.labels is None else self.labels

    @property
    def prompt_soft(self) -> int:
        """Soft-labelled prompt positions (those predicting a prompt token)."""
        return max(0, self.prompt_len - 1 - self.soft_start) if self.soft_ids is not None else 0

    def loss_positions(self, loss_on_prompt: bool) -> int:
        """Positions that carry loss: every continuation token, plus soft-labelled prompt positions if asked."""
        return len(self.ids) - self.prompt_len + (self.prompt_soft if loss_on_prompt else 0)


def load_examples(path: str | os.PathLike, max_seq_len: int, soft_dir: str | os.PathLike | None = None
                  ) -> list[Example]:
    """Teacher target rows -> examples; rows with no continuation token left after truncation are dropped.
    soft_dir: attach each row's soft labels (truncated with the row); a row without them is an error."""
    from drafter_lib.common.files import read_rows

    out = []
    for row in read_rows(path):
        p, c = row["prompt_ids"], row["continuation_ids"]
        ids = (list(p) + list(c))[:max_seq_len]
        if len(ids) <= len(p):
            continue
        labels = row.get("target_argmax_ids")
        if labels is not None:
            if len(labels) != len(c):
                raise ValueError(f"{path}: row {row['id']!r} has {len(labels)} target_argmax_ids for {len(c)} "
                                 "continuation tokens")
            labels = list(labels[:len(ids) - len(p)])
        out.append(Example(str(row["id"]), ids, len(p), labels=labels))
    if not out:
        raise ValueError(f"{path}: no usable rows (empty file or every prompt longer than max_seq_len={max_seq_len})")
    if soft_dir is not None:
        from drafter_lib.teacher.soft_labels import load_soft_labels

        soft = load_soft_labels(soft_dir, [e.id for e in out])
        missing = [e.id for e in out if e.id not in soft]
        if missing:
            raise ValueError(f"{soft_dir}: no soft labels for {len(missing)} rows of {path}, e.g. {missing[:3]}")
        for e in out:
            s = soft[e.id]
            n = max(0, len(e.ids) - 1 - s.start)  # positions with a next token inside the truncated row
            e.soft_start, e.soft_ids, e.soft_logprobs = s.start, s.ids[:n], s.logprobs[:n]
    return out


def soft_dir_of(cfg, targets_path: str) -> str | None:
    """The soft-label dir a TrainConfig reads for a targets file: None when its objective needs none; its
    `soft_labels` (labels join rows by id, so one teacher dir serves train and val files cut from its targets);
    else the default dir beside the file (`soft_labels.soft_dir_for`)."""
    from drafter_lib.teacher.soft_labels import soft_dir_for

    if cfg.loss == "ce" and not cfg.loss_on_prompt:
        return None
    return cfg.soft_labels or str(soft_dir_for(targets_path))


def scored_without_hard_labels(path: str | os.PathLike) -> bool:
    """Whether the rows at `path` were scored by the target (teacher/scoring.py) without its greedy token at each
    position: their continuations are another model's, so a hard-label loss would teach the drafter its own tokens."""
    from drafter_lib.common.files import read_json
    from drafter_lib.teacher.row_file import meta_path

    meta = meta_path(path)
    if not meta.is_file():
        return False
    generation = read_json(meta).get("generation") or {}
    return generation.get("mode") == "score" and not generation.get("hard_labels")


def split_val(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Held-out split by stable id hash (same split on every machine and every run)."""
    from drafter_lib.teacher.shards import shard_of

    if fraction <= 0:
        return examples, []
    val = [e for e in examples if shard_of("val:" + e.id, 10_000) < fraction * 10_000]
    vids = {e.id for e in val}
    return [e for e in examples if e.id not in vids], val


def target_ids(ids: Sequence[int], prompt_len: int, labels: Sequence[int] | None = None) -> list[int]:
    """Next-token targets for each input position: ids[t+1] (or labels[t+1 - prompt_len] when given) where t+1 is a
    continuation token, else IGNORE."""
    nxt = ids[prompt_len:] if labels is None else labels
    return [nxt[t + 1 - prompt_len] if t + 1 >= prompt_len else IGNORE for t in range(len(ids) - 1)] + [IGNORE]


def collate(examples: Sequence[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, targets (IGNORE on prompt, last and pad positions).
    Examples with soft labels add soft_ids [B,T,K] (long), soft_logprobs [B,T,K] (float32) and soft_mask [B,T]
    (True where position t has the teacher's distribution over token t+1)."""
    T = max(len(e.ids) for e in examples)
    inp = torch.full((len(examples), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(examples), T), dtype=torch.long)
    tgt = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.ids)
        inp[i, :n] = torch.tensor(e.ids)
        att[i, :n] = 1
        tgt[i, :n] = torch.tensor(target_ids(e.ids, e.prompt_len, e.labels))
    batch = {"input_ids": inp, "attention_mask": att, "targets": tgt}
    with_soft = [e.soft_ids is not None for e in examples]
    if any(with_soft):
        if not all(with_soft):
            raise ValueError("a batch mixes examples with and without soft labels")
        K = examples[0].soft_ids.shape[1]
        sid = torch.zeros((len(examples), T, K), dtype=torch.long)
        slp = torch.zeros((len(examples), T, K), dtype=torch.float32)
        mask = torch.zeros((len(examples), T), dtype=torch.bool)
        for i, e in enumerate(examples):
            s, m = e.soft_start, e.soft_ids.shape[0]
            sid[i, s:s + m] = e.soft_ids.long()
            slp[i, s:s + m] = e.soft_logprobs.float()
            mask[i, s:s + m] = True
        batch.update(soft_ids=sid, soft_logprobs=slp, soft_mask=mask)
    return batch


def epoch_batches(lengths: Sequence[int], batch_size: int, bucket_batches: int, seed: int,
                  epoch: int) -> list[list[int]]:
    """One epoch's micro-batches (example indices): shuffle, sort by length inside windows of `bucket_batches`
    batches so a batch holds similar lengths, shuffle the batch order. Pure function of (seed, epoch)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    win = batch_size * bucket_batches
    batches = []
    for s in range(0, len(perm), win):
        chunk = sorted(perm[s:s + win], key=lambda i: lengths[i])
        batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in order]


class BatchStream:
    """Micro-batch number p (0, 1, 2, ... across epochs) -> example indices; the data position is just p.

    `cfg` is anything with batch_size, bucket_batches and seed (a TrainConfig)."""

    def __init__(self, examples: list[Example], cfg):
        self.lengths = [len(e.ids) for e in examples]
        self.cfg = cfg
        self._cache: dict[int, list[list[int]]] = {}

    def epoch(self, e: int) -> list[list[int]]:
        if e not in self._cache:
            self._cache = {e: epoch_batches(self.lengths, self.cfg.batch_size, self.cfg.bucket_batches,
                                            self.cfg.seed, e)}
        return self._cache[e]

    def __getitem__(self, p: int) -> list[int]:
        n = len(self.epoch(0))
        return self.epoch(p // n)[p % n]

"""The training objective and its optimiser: continuation-token CE (+ optional KL to the teacher), the top-K
soft-label losses, the per-phase learning-rate schedule and AdamW.

Losses (`LOSSES`), per loss position, summed:
  "ce"       hard cross-entropy on the teacher's greedy token (at prompt positions: the teacher's top-1);
  "kl_topk"  forward KL(teacher || student) over the teacher's top-K ids plus one tail bucket holding the rest
             of the vocabulary (teacher tail mass = 1 - sum of its top-K probabilities);
  "tv"       total-variation distance over the same K + 1 buckets.
Both soft losses are 0 exactly when the student gives every top-K id the teacher's probability (and so the
tail its mass), whatever it does inside the tail. With loss_on_prompt, soft-labelled prompt positions join the
continuation positions (weighted by prompt_weight)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from drafter_lib.train.examples import IGNORE

__all__ = ["LOSSES", "LossModule", "topk_divergence", "divergence_from_log_q", "teacher_target_logits", "lr_lambda",
           "make_optimizer"]

LOSSES = ("ce", "kl_topk", "tv")


def topk_divergence(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-row divergence [N] between the teacher's top-K (+ tail) distribution and the student's logits [N, V].
    ids [N, K]: teacher top-K ids (head rows); logprobs [N, K]: their teacher log-probs. kind: "kl_topk" or "tv".
    An id < 0 is a teacher token the (reduced) head cannot emit: its mass joins the tail bucket; a row whose
    top-K lies wholly outside the head carries no loss (as a masked hard target)."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return divergence_from_log_q(F.log_softmax(x, -1), ids, logprobs, kind)


def divergence_from_log_q(log_q: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """topk_divergence from the student's log-probabilities [N, V] (one log_softmax, shared with the CE)."""
    if kind not in ("kl_topk", "tv"):
        raise ValueError(f"unknown soft loss {kind!r}; expected 'kl_topk' or 'tv'")
    ids = ids.long()
    valid = ids >= 0
    any_valid = valid.any(-1)
    # stand-in for an id outside the head: the row's first valid id (a duplicate changes neither sum below)
    first = ids.gather(-1, valid.to(torch.int8).argmax(-1, keepdim=True))
    safe = torch.where(valid, ids, first).clamp_min(0)
    s_top = log_q.gather(-1, safe)                                          # student log q at the top-K ids
    s_tail = _log_tail_mass(log_q, safe)
    t_top = logprobs.to(log_q.dtype)
    p = t_top.exp() * valid
    p_tail = (1 - p.sum(-1)).clamp_min(0)  # fp16-stored log-probs can sum a hair over 1
    if kind == "kl_topk":
        per = (p * (t_top - s_top)).sum(-1) + torch.xlogy(p_tail, p_tail) - p_tail * s_tail
    else:
        per = 0.5 * ((p - s_top.exp() * valid).abs().sum(-1) + (p_tail - s_tail.exp()).abs())
    return torch.where(any_valid, per, torch.zeros_like(per))


def _log_tail_mass(log_q: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """log of the student's mass outside the ids `top` [N, K], per row. A sum of probabilities costs one exp
    pass over [N, V] (its backward reuses it), where a logsumexp costs one each way; the rare row whose tail
    underflows that sum is recomputed exactly."""
    tail = log_q.exp().scatter(-1, top, 0.0).sum(-1)
    tiny = torch.finfo(log_q.dtype).tiny
    out = tail.clamp_min(tiny).log()
    under = (tail < tiny).nonzero()[:, 0]
    if len(under):
        exact = torch.logsumexp(log_q[under].scatter(-1, top[under], float("-inf")), -1)
        out = out.index_put((under,), exact)
    return out


def _nll(log_q: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """-log q at `ids` [N], per row; 0 where the id is < 0 (IGNORE, or a token outside the draft vocab)."""
    return -log_q.gather(-1, ids.clamp_min(0)[:, None])[:, 0] * (ids >= 0)


class LossModule(nn.Module):
    """Wraps the HF causal LM so DDP sees one forward: hidden states -> lm_head only at loss positions
    (continuation positions, plus soft-labelled prompt positions with loss_on_prompt; the rest never pay for the
    vocab projection) -> summed objective and continuation CE (+ KL)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, targets, teacher_logits=None, kl_weight=0.0, temperature=1.0,
                soft_ids=None, soft_logprobs=None, soft_mask=None, loss="ce", loss_on_prompt=False,
                prompt_weight=1.0):
        """(objective, continuation CE) - both sums over positions; the CE is what validation compares."""
        # no K/V cache: training never reads it back (and gradient checkpointing refuses one)
        h = self.lm.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        cont = targets != IGNORE
        if loss == "ce" and not loss_on_prompt:
            logits = self.lm.lm_head(h[cont]).float()                   # [N, V]
            ce = F.cross_entropy(logits, targets[cont], reduction="sum")
            obj = ce
        else:
            if soft_ids is None:
                raise ValueError(f"loss={loss!r} / loss_on_prompt need soft labels in the batch")
            sel = (cont | soft_mask) if loss_on_prompt else cont
            logits = self.lm.lm_head(h[sel]).float()
            log_q = F.log_softmax(logits, -1)   # the one pass over [N, V] that CE and the loss share
            is_cont = cont[sel]
            tgt = targets[sel]  # IGNORE (< 0) at prompt positions
            ce = _nll(log_q.detach(), tgt).sum()
            if loss == "ce":  # prompt positions: the teacher's top-1 as the hard target
                per = _nll(log_q, torch.where(is_cont, tgt, soft_ids[sel][:, 0]))  # a top-1 outside the head: < 0
            else:
                if not bool(soft_mask[cont].all()):
                    raise ValueError("a continuation position has no soft label")
                per = divergence_from_log_q(log_q, soft_ids[sel], soft_logprobs[sel], loss)
            obj = (per * torch.where(is_cont, 1.0, float(prompt_weight))).sum()
            logits = logits[is_cont]  # the KL-to-teacher term below runs on continuation positions
        if teacher_logits is None or kl_weight == 0:
            return obj, ce.detach()
        t = temperature
        kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits.float() / t, -1),
                      log_target=True, reduction="sum") * t * t
        return obj + kl_weight * kl, ce.detach()


@torch.no_grad()
def teacher_target_logits(teacher, batch) -> torch.Tensor:
    h = teacher.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return teacher.lm_head(h[batch["targets"] != IGNORE])


def lr_lambda(step: int, total: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """LR multiplier at `step` (0-based, within a phase): linear warmup then cosine/linear decay to min_ratio."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return min_ratio + (1 - min_ratio) * decay


def make_optimizer(model: nn.Module, cfg, phase: str):
    """(AdamW, LambdaLR) for `phase` ("distill" or "qat") from a TrainConfig's lr/steps/warmup of that phase."""
    lr = cfg.lr if phase == "distill" else cfg.qat_lr
    total = cfg.steps if phase == "distill" else cfg.qat_steps
    warm = cfg.warmup_steps if phase == "distill" else cfg.qat_warmup_steps
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())  # tied weights once
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    # the fused kernel: one pass per tensor instead of one per op (on 2 CPU cores ~6x faster for this model's
    # 47M parameters, ~10 % of a training step); the same update up to float rounding
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=tuple(cfg.betas),
                            fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total, warm, cfg.schedule, cfg.min_lr_ratio))
    return opt, sched

"""The training objective and its optimiser: continuation-token CE (+ optional KL to the teacher), the per-phase
learning-rate schedule and AdamW."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .train_data import IGNORE

__all__ = ["LossModule", "teacher_target_logits", "lr_lambda", "make_optimizer"]


class LossModule(nn.Module):
    """Wraps the HF causal LM so DDP sees one forward: hidden states -> lm_head only at target positions
    (prompt/pad positions never pay for the vocab projection) -> summed CE (+ KL)."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, targets, teacher_logits=None, kl_weight=0.0, temperature=1.0):
        h = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        sel = targets != IGNORE
        logits = self.lm.lm_head(h[sel]).float()                     # [N, V]
        ce = F.cross_entropy(logits, targets[sel], reduction="sum")
        if teacher_logits is None or kl_weight == 0:
            return ce, ce.detach()
        t = temperature
        kl = F.kl_div(F.log_softmax(logits / t, -1), F.log_softmax(teacher_logits.float() / t, -1),
                      log_target=True, reduction="sum") * t * t
        return ce + kl_weight * kl, ce.detach()


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
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=tuple(cfg.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, total, warm, cfg.schedule, cfg.min_lr_ratio))
    return opt, sched

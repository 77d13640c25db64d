"""A target model ready to generate with: the hand-written decoder as a `Target`, its tokenizer and stop tokens.

`load_target_runtime(spec)` takes any target the study accepts (`smollm2-135m-instruct`, a local Hugging Face
folder, a pinned hub id) and returns a `TargetRuntime`. `numerics` picks how its linears multiply:
"w8a8" (int8 weights per output channel x int8 activations per row, int32 sums: `w8a8.py`; outlier channels
smoothed into the weights first: `smoothing.py`) or "fp32".
Both run the decoder's row-exact attention, so each row's logits never depend on the other rows of its pass and
speculative decoding equals this runtime's own plain greedy decoding bit for bit.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.decoding.smoothing import calibration_rows, smooth
from drafter_lib.decoding.speculative import NativeTarget
from drafter_lib.model.transformer import Transformer

NUMERICS = ("w8a8", "w4a8", "fp32")


@dataclass
class TargetRuntime:
    """What generation needs of a target: `target` (a speculative.Target), its `tokenizer` (with a chat template),
    the tokens that end an answer, a display `name` and the longest context it takes."""
    target: NativeTarget
    tokenizer: object
    stop_ids: tuple[int, ...]
    name: str
    context_length: int
    numerics: str

    @property
    def model(self) -> Transformer:
        return self.target.model


def runtime_target(model: Transformer, numerics: str = "w8a8", kernel: str | None = None,
                   calibration: Sequence[Sequence[int]] | None = None) -> NativeTarget:
    """`model` (fp32 weights, converted in place to `numerics`) as a Target with row-exact attention. W8A8 smooths
    the activations' outlier channels into the weights first where `calibration` token rows are given
    (smoothing.py; `calibration_rows(tokenizer)` are the usual ones)."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if numerics in ("w8a8", "w4a8"):
        from drafter_lib.decoding.w8a8 import quantize_linears, replace_linears

        if calibration:
            smooth(model, calibration)
        if numerics == "w8a8":
            quantize_linears(model, kernel)
        else:
            from drafter_lib.decoding.w4a8 import W4A8Linear

            replace_linears(model, W4A8Linear)
    model.row_exact = True
    return NativeTarget(model, linears="stock")


def runtime_from_model(model: Transformer, tokenizer, name: str, numerics: str = "w8a8") -> TargetRuntime:
    """A TargetRuntime around a hand-written decoder already in memory (fp32 weights), converted to `numerics`."""
    target = runtime_target(model, numerics, calibration=calibration_rows(tokenizer))
    return TargetRuntime(target=target, tokenizer=tokenizer, stop_ids=tuple(stop_token_ids(tokenizer)), name=name,
                         context_length=int(model.config.max_position_embeddings), numerics=numerics)


@torch.inference_mode()
def load_target_runtime(spec: str, numerics: str = "w8a8", revision: str | None = None) -> TargetRuntime:
    """Load `spec` (see hf_models.load_teacher) into the hand-written decoder with `numerics`."""
    from drafter_lib.model.hf_models import load_teacher

    hf_model, tokenizer = load_teacher(spec, revision=revision, dtype=torch.float32)
    model = Transformer.from_hf_model(hf_model)
    del hf_model
    return runtime_from_model(model, tokenizer, name=str(spec), numerics=numerics)

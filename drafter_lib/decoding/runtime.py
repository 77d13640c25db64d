"""A target model ready to generate with: the hand-written decoder as a `Target`, its tokenizer and stop tokens.

`load_target_runtime(spec)` takes any target the study accepts (`smollm2-135m-instruct`, a local Hugging Face
folder, a pinned hub id) and returns a `TargetRuntime`. `numerics` picks how its linears multiply:
- "gguf": the target's GGUF weights block for block as llama.cpp multiplies them (Q8_0, Q4_1, Q4_K, Q6_K; a target
  without a GGUF file is quantized once to Q8_0) x int8 activations with one scale per block of inputs, int32 sums
  (`block_rows.py`, `gguf_weights.py`);
- "w8a8": int8 weights per output channel x int8 activations per row, int32 sums (`w8a8.py`; outlier channels
  smoothed into the weights first: `smoothing.py`);
- "w4a8": 4-bit weights in groups x int8 activations per row (`w4a8.py`);
- "fp32": torch's float linears;
- "auto" (the default): "gguf" where its kernel builds and the model's shapes fit its blocks, else "w8a8"
  (`auto_numerics`). Of the numerics here only "gguf" follows the fp32 model as closely as llama.cpp's own file
  (bench/fidelity.py; docs/studies/target_runtime.md), so it is the one the speculative loop should run where it can.

The guarantee. With the integer numerics a row's logits never depend on the other rows of its pass: its integers
depend on the row alone, integer sums are exact, each (row, output)'s floats are added in one fixed order, and the
decoder's row-exact attention (`Transformer.row_exact`) gives each query row the same keys and one fixed arithmetic
per head (`model/row_attention.py`) alone or in a pass; with "gguf", a chain pass runs its layers in one C++ call
of the same operations (`row_step.py`: the Python layers' bits, checked at conversion). So a verify pass (a chain or
a tree) gives every row the bits of a one-token step, and speculative decoding equals this runtime's own plain
greedy decoding bit for bit (tests/test_w8a8.py, tests/test_block_rows.py, tests/test_row_step.py). "fp32" keeps
the row-exact attention but not the promise: torch's float products may sum a row differently with other rows
beside it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drafter_lib.common.chat import stop_token_ids
from drafter_lib.decoding.smoothing import calibration_rows, smooth
from drafter_lib.decoding.speculative import NativeTarget
from drafter_lib.model.transformer import Transformer

log = logging.getLogger("specdraft.runtime")
NUMERICS = ("auto", "gguf", "w8a8", "w4a8", "fp32")
EXACT_NUMERICS = ("gguf", "w8a8", "w4a8")  # those that keep the guarantee above


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

    def new_target(self) -> NativeTarget:
        """Another Target over the same weights with a KV cache of its own: one per sequence in progress (the
        server's concurrent generations); `target` is the one of a single sequence at a time."""
        return NativeTarget(self.model, chunk=self.target.chunk, linears="stock")


def runtime_target(model: Transformer, numerics: str = "w8a8", kernel: str | None = None,
                   calibration: Sequence[Sequence[int]] | None = None, blocks: dict | None = None) -> NativeTarget:
    """`model` (fp32 weights, converted in place to `numerics`) as a Target with row-exact attention. W8A8 and W4A8
    smooth the activations' outlier channels into the weights first where `calibration` token rows are given
    (smoothing.py; `calibration_rows(tokenizer)` are the usual ones). "gguf" takes its weights from `blocks`
    (gguf_weights.read_linears; None: the model's own weights in Q8_0), never smoothed: its activation scales are
    per block already."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    if numerics == "auto":
        numerics, why = auto_numerics(model, blocks)
        log.info("target numerics: %s (%s)", numerics, why)
    model.numerics = numerics
    if numerics == "gguf":
        from drafter_lib.decoding.block_rows import use_block_linears

        model.weight_formats = use_block_linears(model, blocks)
    elif numerics in ("w8a8", "w4a8"):
        from drafter_lib.decoding.linear_swap import from_float_weights, replace_linears
        from drafter_lib.decoding.w8a8 import quantize_linears

        if calibration:
            smooth(model, calibration)
        if numerics == "w8a8":
            quantize_linears(model, kernel)
        else:
            from drafter_lib.decoding.w4a8 import W4A8Linear

            replace_linears(model, from_float_weights(W4A8Linear))
    model.row_exact = True
    if numerics == "gguf":
        from drafter_lib.decoding.row_step import RowStep

        model.row_step = RowStep.of(model)  # checked against the Python layers first; None keeps them
    return NativeTarget(model, linears="stock")


def auto_numerics(model: Transformer, blocks: dict | None = None) -> tuple[str, str]:
    """("gguf" or "w8a8", why) for a target about to be converted: see the module doc."""
    from drafter_lib.decoding.block_rows import kernel_unavailable

    why = kernel_unavailable()
    if why:
        return "w8a8", f"the GGUF block kernel does not run here: {why}"
    c = model.config
    inputs = {c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size}
    if blocks is None and any(k % 32 for k in inputs):
        return "w8a8", f"its linears' inputs {sorted(inputs)} are not whole Q8_0 blocks of 32"
    return "gguf", "its GGUF blocks" if blocks is not None else "its weights in Q8_0 blocks"


def runtime_from_model(model: Transformer, tokenizer, name: str, numerics: str = "w8a8",
                       blocks: dict | None = None) -> TargetRuntime:
    """A TargetRuntime around a hand-written decoder already in memory (fp32 weights), converted to `numerics`."""
    target = runtime_target(model, numerics, calibration=calibration_rows(tokenizer), blocks=blocks)
    return TargetRuntime(target=target, tokenizer=tokenizer, stop_ids=tuple(stop_token_ids(tokenizer)), name=name,
                         context_length=int(model.config.max_position_embeddings), numerics=model.numerics)


@torch.inference_mode()
def load_target_runtime(spec: str, numerics: str = "auto", revision: str | None = None) -> TargetRuntime:
    """Load `spec` (see hf_models.load_teacher) into the hand-written decoder with `numerics`. With "gguf" and a
    target that has a GGUF file, its float linear weights are never read: the decoder takes its embedding, norms
    and biases from the converted folder and its products from the GGUF's blocks (cached)."""
    from drafter_lib.model.hf_models import load_teacher, model_folder

    blocks = gguf_blocks(spec) if numerics in ("gguf", "auto") and block_kernel_runs() else None
    if blocks is not None:
        from transformers import AutoTokenizer

        folder = model_folder(spec, revision)
        model, tokenizer = decoder_without_linears(folder), AutoTokenizer.from_pretrained(folder)
    else:
        hf_model, tokenizer = load_teacher(spec, revision=revision, dtype=torch.float32)
        model = Transformer.from_hf_model(hf_model)
        del hf_model
    return runtime_from_model(model, tokenizer, name=str(spec), numerics=numerics, blocks=blocks)


def decoder_without_linears(folder) -> Transformer:
    """The hand-written decoder of a Hugging Face folder with its embedding, norms and biases read from the folder's
    safetensors and its linear weights left unallocated (meta), for products that bring their own weights."""
    from pathlib import Path

    from safetensors import safe_open

    from drafter_lib.common.files import read_json
    from drafter_lib.model.transformer import ModelConfig, rope_inv_freq

    folder = Path(folder)
    cfg = ModelConfig.from_hf(read_json(folder / "config.json"))
    with torch.device("meta"):
        model = Transformer(cfg)
    linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    wanted = {name for name, _ in model.named_parameters(remove_duplicate=False)} - linears
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            state.update({k: f.get_tensor(k).float() for k in f.keys() if k in wanted})
    missing = wanted - set(state)
    if missing:
        raise ValueError(f"{folder} lacks {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.model.rotary_emb.inv_freq = rope_inv_freq(cfg)  # a buffer made at init, not in the file
    return model.eval()


def block_kernel_runs() -> bool:
    from drafter_lib.decoding.block_rows import kernel_unavailable

    return kernel_unavailable() is None


def gguf_blocks(spec: str) -> dict | None:
    """The linear weights of `spec`'s GGUF file as stored (gguf_weights.cached_linears), or None where the target
    comes without one (a Hugging Face folder or hub model: "gguf" numerics then quantize it to Q8_0)."""
    from drafter_lib.decoding.gguf_weights import cached_linears
    from drafter_lib.model.hf_models import model_gguf, parse_model_spec

    if parse_model_spec(spec)[0] not in ("default", "parted"):
        return None
    return cached_linears(model_gguf(spec))

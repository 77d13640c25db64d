"""A GGUF file's linear weights as the runtime's block weights (block_rows.BlockWeight), by the decoder's names.

Reading a GGUF parses its whole header (the tokenizer's vocabulary among it: ~6 s for SmolLM2's), so the fields are
kept once in the cache as safetensors (`cached_linears`), memory-mapped on later loads.

llama.cpp's converter stores a Llama model's q and k rows permuted for its interleaved rotation (each head's two
halves interleaved); the decoder here rotates halves (as transformers does), so those rows are put back in order:
a row's blocks are its own, so moving rows is exact. Qwen2 files rotate halves already and are read as they are.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from drafter_lib.decoding.block_rows import FORMATS, BlockWeight, from_float, from_gguf

# GGUF tensor name (after "blk.N.") -> the decoder's module under model.layers.N
LAYER_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _halves_in_order(raw: np.ndarray, heads: int) -> np.ndarray:
    """One projection's rows from llama.cpp's interleaved order back to halves: a head's row 2j + t -> t * hd/2 + j."""
    rows = raw.shape[0]
    return raw.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(raw.shape)


def read_linears(path: str | Path) -> dict[str, BlockWeight]:
    """{decoder module name ("model.layers.0.self_attn.q_proj", ..., "lm_head"): its weight} of the GGUF at `path`.
    Blocks of a format the kernel takes are kept as stored; any other type (F16, Q5_0, ...) is converted once to
    Q8_0 (a second rounding, named in `formats`)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    heads, kv_heads = _field(reader, f"{arch}.attention.head_count"), _field(reader, f"{arch}.attention.head_count_kv")
    kv_heads = kv_heads or heads
    tensors = {t.name: t for t in reader.tensors}
    out = {}

    def weight(t, permute_heads: int | None = None) -> BlockWeight:
        k = int(t.shape[0])
        fmt = t.tensor_type.name
        raw = np.asarray(t.data)
        if fmt not in FORMATS:
            import torch

            dense = dequantize(raw, t.tensor_type).reshape(-1, k)
            if permute_heads:
                dense = _halves_in_order(dense, permute_heads)
            return from_float(torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)))
        raw = raw.reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1)
        if permute_heads:
            raw = _halves_in_order(raw, permute_heads)
        return from_gguf(raw, fmt, k)

    for name, t in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and parts[-1] == "weight" and parts[2] in LAYER_LINEARS:
            permute = {"attn_q": heads, "attn_k": kv_heads}.get(parts[2]) if arch == "llama" else None
            out[f"model.layers.{parts[1]}.{LAYER_LINEARS[parts[2]]}"] = weight(t, permute)
    head = tensors.get("output.weight") or tensors["token_embd.weight"]  # no output tensor: tied to the embedding
    out["lm_head"] = weight(head)
    return out


FIELDS = ("q", "sc", "mn", "d", "dm")
LAYOUT = 2  # of the fields in the cache: 2 keeps Q6_K's bits packed as the file does


def cached_linears(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> dict[str, BlockWeight]:
    """`read_linears(path)`, from the cache after the first time (keyed by the file's name, size and mtime)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from drafter_lib.model.hf_models import cache_root

    path = Path(path)
    st = path.stat()
    out = cache_root(cache_dir) / "gguf_blocks" / f"{path.stem}-{st.st_size}-{st.st_mtime_ns}-v{LAYOUT}.safetensors"
    if out.is_file():
        with safe_open(out, "pt") as f:
            meta = json.loads(f.metadata()["linears"])
            return {name: BlockWeight(fmt, *(f.get_tensor(f"{name}.{k}") for k in FIELDS), k_in)
                    for name, (fmt, k_in) in meta.items()}
    linears = read_linears(path)
    tensors = {f"{name}.{k}": t.contiguous() for name, w in linears.items() for k, t in zip(FIELDS, w.tensors())}
    meta = {name: (w.format, w.in_features) for name, w in linears.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"linears": json.dumps(meta)})
    os.replace(tmp, out)  # a reader never sees half a file
    for stale in out.parent.glob(f"{path.stem}-{st.st_size}-{st.st_mtime_ns}*.safetensors"):
        if stale != out:  # the same file's blocks in an older layout
            stale.unlink(missing_ok=True)
    return linears


def formats(linears: dict[str, BlockWeight]) -> dict[str, int]:
    """How many weights of each block format."""
    counts: dict[str, int] = {}
    for w in linears.values():
        counts[w.format] = counts.get(w.format, 0) + 1
    return counts

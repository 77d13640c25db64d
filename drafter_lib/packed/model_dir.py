"""The packed model directory: what the study ships and the server loads.

    config.json          the HF config dict (architecture; tie_word_embeddings decides lm_head)
    quantization.json    scheme, int4 packing, and every stored tensor with its shape and spec (null = float)
    weights.safetensors  `W.packed` + `W.scale` for a quantized W, float tensors under their HF name
    copy_policy.json     the copy prior's settings
    manifest.json        format/version, sha256 + size of every file above, metadata (source checkpoint, run, ...)

Reading needs torch + safetensors only (no transformers): the server process imports this.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from drafter_lib import quantization
from drafter_lib.common.files import sha256_file, write_json
from drafter_lib.common.layout import portable_value
from drafter_lib.common.progress import progress_bar
from drafter_lib.model import draft_vocab
from drafter_lib.packed.copy_policy import CopyPolicy

__all__ = ["ModelDirError", "PackedModel", "write_model_dir", "read_model_dir", "read_copy_policy", "sha256_file",
           "MODEL_DIR_FORMAT", "MODEL_DIR_VERSION", "QUANT_FORMAT", "QUANT_VERSION"]

MODEL_DIR_FORMAT, MODEL_DIR_VERSION = "specdraft-model-dir", 1
QUANT_FORMAT, QUANT_VERSION = "specdraft-quant", 1
FILES = ("config.json", "quantization.json", "weights.safetensors", "copy_policy.json")
RESERVED_MANIFEST_KEYS = {"format", "version", "files"}
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


class ModelDirError(ValueError):
    """A model directory is missing, corrupt, or in a format this reader does not know."""


@dataclass
class PackedModel:
    config: dict
    quantization: dict
    copy_policy: dict
    manifest: dict
    state_dict: dict[str, torch.Tensor]  # HF names -> float32 (quantized weights restored)
    path: Path | None = None
    manifest_sha256: str = ""             # identifies this exact pack (the server reports it)




# Loader bookkeeping that transformers puts into a config: the directory the model was loaded from (a path of the
# machine that packed it). It describes no architecture, so a pack leaves it out and stays machine-independent.
MACHINE_CONFIG_KEYS = ("_name_or_path",)


def _portable_config(hf_config: dict) -> dict:
    """The config as stored in config.json: no machine paths, torch dtypes as their names."""
    return {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
            for k, v in hf_config.items() if k not in MACHINE_CONFIG_KEYS}


def _write_json(path: Path, obj) -> None:
    write_json(path, obj, sort_keys=True)  # sorted keys: the same dict always gives the same bytes (and sha256)


def _as_dict(obj, what: str) -> dict:
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise ValueError(f"{what} must be a dict (or have to_dict()), got {type(obj).__name__}")


def _tied(hf_config: dict) -> bool:
    return bool(hf_config.get("tie_word_embeddings", False))


def write_model_dir(out_dir, hf_config: dict, state_dict: dict, qconfig, copy_policy: dict | None = None,
                    extra_manifest: dict | None = None) -> Path:
    """Quantize `state_dict` with `qconfig` (QuantConfig, its dict, or None = all float) and write the model dir.

    Parametrized names (`x.parametrizations.weight.original`) are accepted and stored under `x.weight`.
    With tie_word_embeddings, lm_head.weight is not stored (the reader rebuilds it from the embedding).
    """
    out_dir = Path(out_dir)
    hf_config = _as_dict(hf_config, "hf_config")
    if qconfig is None:
        qconfig = quantization.QuantConfig(default=None)
    elif isinstance(qconfig, dict):
        qconfig = quantization.QuantConfig.from_dict(qconfig)
    copy_policy = _as_dict(copy_policy, "copy_policy") if copy_policy is not None else {"enabled": False}
    extra_manifest = portable_value(dict(extra_manifest or {}))
    clash = RESERVED_MANIFEST_KEYS & set(extra_manifest)
    if clash:
        raise ValueError(f"extra_manifest may not set reserved manifest keys {sorted(clash)}")

    sd = {quantization.canonical_name(k): v for k, v in state_dict.items()}
    draft_vocab.check_pack(hf_config, sd)
    tied = {}
    if _tied(hf_config):
        if EMBED not in sd:
            raise ValueError(f"config says tie_word_embeddings but the state dict has no {EMBED}")
        if LM_HEAD in sd:
            if sd[LM_HEAD].shape != sd[EMBED].shape or not torch.equal(sd[LM_HEAD], sd[EMBED]):
                raise ValueError(f"config says tie_word_embeddings but {LM_HEAD} differs from {EMBED}")
            del sd[LM_HEAD]
        tied[LM_HEAD] = EMBED

    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict] = {}
    num_params = 0
    for name in progress_bar(sorted(sd), desc="pack", leave=False, disable=len(sd) < 64):
        w = sd[name].detach().cpu()
        num_params += w.numel()
        spec = qconfig.spec_for(name, w)
        if spec is None:
            stored = w.float() if w.is_floating_point() else w
            tensors[name] = stored.contiguous().clone()
            entries[name] = {"shape": list(w.shape), "dtype": str(stored.dtype).removeprefix("torch."), "quant": None}
            continue
        for suffix in (".packed", ".scale"):
            if name + suffix in sd:
                raise ValueError(f"tensor name {name + suffix} clashes with the packed form of {name}")
        p = quantization.pack(w, spec, name)
        tensors[name + ".packed"], tensors[name + ".scale"] = p["packed"], p["scale"]
        entries[name] = {"shape": list(w.shape), "quant": spec.to_dict(),
                         "packed_shape": list(p["packed"].shape),
                         "packed_dtype": str(p["packed"].dtype).removeprefix("torch."),
                         "scale_shape": list(p["scale"].shape)}

    quant_doc = {
        "format": QUANT_FORMAT, "version": QUANT_VERSION,
        "scheme": "symmetric",
        "formula": "scale=fp32(to_scale_dtype(clamp(amax(|w_group|)/qmax, tiny, max))); "
                   "q=clamp(round_half_even(w/scale), -qmax, qmax); w_hat=q*scale (fp32); qmax=2**(bits-1)-1",
        "group_axis": "input (last) dim; group_size null = one scale per output row",
        "int4_packing": quantization.INT4_PACKING,
        "int8_storage": "int8, same shape as the weight",
        "scale_shape": "[out, in // group_size] ([out, 1] per row)",
        "qconfig": qconfig.to_dict(),
        "tied": tied,
        "tensors": entries,
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)  # a dir without a manifest reads as incomplete
    tmp = out_dir / "weights.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})  # one key: safetensors writes metadata in hash order
    os.replace(tmp, out_dir / "weights.safetensors")
    _write_json(out_dir / "config.json", _portable_config(hf_config))
    _write_json(out_dir / "quantization.json", quant_doc)
    _write_json(out_dir / "copy_policy.json", copy_policy)

    files = {f: {"sha256": sha256_file(out_dir / f), "bytes": (out_dir / f).stat().st_size} for f in FILES}
    manifest = {"format": MODEL_DIR_FORMAT, "version": MODEL_DIR_VERSION, "files": files,
                "num_parameters": num_params,
                "num_quantized_tensors": sum(e["quant"] is not None for e in entries.values()),
                **extra_manifest}
    _write_json(out_dir / "manifest.json", manifest)
    return out_dir


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelDirError(f"{path.parent}: missing {path.name}")
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ModelDirError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _check_format(doc: dict, fmt: str, version: int, where: str) -> None:
    if doc.get("format") != fmt:
        raise ModelDirError(f"{where}: unknown format {doc.get('format')!r} (this reader knows {fmt!r})")
    if doc.get("version") != version:
        raise ModelDirError(f"{where}: unsupported {fmt} version {doc.get('version')!r} (this reader knows {version})")


def read_model_dir(path, verify: bool = True) -> PackedModel:
    """Load a model dir; quantized weights are restored to float32 with `quantization.restore_weight`.

    verify=True checks every file's sha256 against manifest.json. Raises ModelDirError naming the problem.
    """
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"{path}: model dir not found (not a directory)")
    manifest = _read_json(path / "manifest.json")
    _check_format(manifest, MODEL_DIR_FORMAT, MODEL_DIR_VERSION, f"{path}/manifest.json")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ModelDirError(f"{path}/manifest.json: no 'files' table")
    for fname in FILES:
        if fname not in files:
            raise ModelDirError(f"{path}/manifest.json does not list {fname}")
        if not (path / fname).is_file():
            raise ModelDirError(f"{path}: missing {fname}")
    if verify:
        for fname, info in files.items():
            fpath = path / fname
            if not fpath.is_file():
                raise ModelDirError(f"{path}: missing {fname}")
            got = sha256_file(fpath)
            if got != info.get("sha256"):
                raise ModelDirError(f"{path}: sha256 mismatch for {fname}: manifest says {info.get('sha256')}, "
                                    f"file has {got}")

    config = _read_json(path / "config.json")
    quant_doc = _read_json(path / "quantization.json")
    copy_policy = _read_json(path / "copy_policy.json")
    _check_format(quant_doc, QUANT_FORMAT, QUANT_VERSION, f"{path}/quantization.json")
    if quant_doc.get("int4_packing") != quantization.INT4_PACKING:
        raise ModelDirError(f"{path}/quantization.json: unsupported int4 packing {quant_doc.get('int4_packing')!r}")
    entries = quant_doc.get("tensors")
    if not isinstance(entries, dict) or not entries:
        raise ModelDirError(f"{path}/quantization.json: no 'tensors' table")

    state_dict = _read_tensors(path / "weights.safetensors", entries)

    if _tied(config) and LM_HEAD not in state_dict:
        src = quant_doc.get("tied", {}).get(LM_HEAD, EMBED)
        if src not in state_dict:
            raise ModelDirError(f"{path}: config ties lm_head to {src}, which is not in weights.safetensors")
        state_dict[LM_HEAD] = state_dict[src]  # one tensor, as in the tied model
    try:
        draft_vocab.check_pack(config, state_dict)
    except ValueError as err:
        raise ModelDirError(f"{path}: {err}") from err
    return PackedModel(config=config, quantization=quant_doc, copy_policy=copy_policy, manifest=manifest,
                       state_dict=state_dict, path=path, manifest_sha256=sha256_file(path / "manifest.json"))


def read_copy_policy(path) -> CopyPolicy:
    """The copy prior's settings of a model dir (or of a `copy_policy.json` file), validated: unknown keys, wrong
    types and impossible values raise ModelDirError naming the key."""
    path = Path(path)
    f = path / "copy_policy.json" if path.is_dir() else path
    doc = _read_json(f)
    fields = CopyPolicy.__dataclass_fields__
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise ModelDirError(f"{f}: unknown copy policy key(s) {unknown}; expected some of {sorted(fields)}")
    for key, value in doc.items():
        want = type(fields[key].default)  # every field has a default, which tells its type
        if type(value) is not want:  # exact: a bool is not an int here, nor an int a bool
            raise ModelDirError(f"{f}: {key} must be {want.__name__}, got {value!r}")
    try:
        return CopyPolicy(**doc)
    except ValueError as e:
        raise ModelDirError(f"{f}: {e}") from e


def _read_tensors(weights: Path, entries: dict) -> dict[str, torch.Tensor]:
    where = f"{weights.parent}/{weights.name}"
    expected = set()
    for name, e in entries.items():
        expected |= {name + ".packed", name + ".scale"} if e.get("quant") else {name}
    try:
        f = safe_open(str(weights), framework="pt")
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise ModelDirError(f"{where}: cannot open ({e})") from e
    out = {}
    with f:
        keys = set(f.keys())
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        if missing:
            raise ModelDirError(f"{where}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if extra:
            raise ModelDirError(f"{where}: tensor(s) not listed in quantization.json: {extra[:5]}")
        for name, e in progress_bar(sorted(entries.items()), desc="restore", leave=False, disable=len(entries) < 64):
            shape = tuple(e.get("shape", ()))
            if not e.get("quant"):
                t = f.get_tensor(name)
                if tuple(t.shape) != shape:
                    raise ModelDirError(f"{where}: {name} has shape {list(t.shape)}, quantization.json says "
                                        f"{list(shape)}")
                out[name] = t.float() if t.is_floating_point() else t
                continue
            try:
                spec = quantization.QuantSpec.from_dict(e["quant"])
            except (ValueError, TypeError) as err:
                raise ModelDirError(f"{where}: unknown quantization for {name}: {err}") from err
            try:
                out[name] = quantization.restore_weight(f.get_tensor(name + ".packed"), f.get_tensor(name + ".scale"),
                                                        spec, shape, name)
            except ValueError as err:  # wrong packed/scale shape or dtype
                raise ModelDirError(f"{where}: {err}") from err
    return out

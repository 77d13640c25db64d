"""The prompt corpora vendored in data/corpora/: manifest and README against the files, the checks on every read,
the same records and provenance as the originals in ../shared/data, and what the default study resolves to."""
import json
import lzma
import shutil
from pathlib import Path

import pytest

from drafter_lib.common import layout
from drafter_lib.common.files import sha256_file
from drafter_lib.data import corpora as D
from drafter_lib.data import vendored as V

ROOT = Path(__file__).resolve().parents[1]
VENDORED = ROOT / "data" / "corpora"
SHARED = ROOT.parent / "shared" / "data" / "prompts"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/prompts is absent on this machine")
SMALL = "self_instruct_seed_tasks.jsonl.xz"


def manifest() -> dict:
    return json.loads((VENDORED / "manifest.json").read_text())


def test_manifest_matches_the_files_and_the_provenance():
    m = manifest()
    assert layout.VENDORED_CORPORA_DIR == VENDORED
    assert m["schema"] == V.SCHEMA
    assert set(m["files"]) == {f + ".xz" for f in V.SHARED_CORPORA} == {p.name for p in VENDORED.glob("*.xz")}
    for name, e in m["files"].items():
        path = VENDORED / name
        assert sha256_file(path) == e["sha256"] and path.stat().st_size == e["bytes"], name
        raw = lzma.decompress(path.read_bytes())
        assert V._sha256(raw) == e["decompressed_sha256"] and len(raw) == e["decompressed_bytes"], name
        assert sum(1 for line in raw.decode().split("\n") if line.strip()) == e["rows"], name
        fname = e["file"]
        assert name == fname + ".xz" and {k: e[k] for k in V.SHARED_CORPORA[fname]} == V.SHARED_CORPORA[fname]
        assert e["category"] == V.SHARED_CATEGORIES[fname]
        assert e["default"] == (V.corpus_name(fname) in V.DEFAULT_CORPORA)
        assert V.read_verified(path)[0] == raw
    assert m["files"]["dolly_15k.jsonl.xz"]["license"].startswith("CC BY-SA 3.0")
    assert m["files"]["dolly_15k.jsonl.xz"]["own_category_rows"] == {
        "brainstorming": 1757, "classification": 2132, "closed_qa": 1761, "creative_writing": 690, "general_qa": 2096,
        "information_extraction": 1499, "open_qa": 3687, "summarization": 1186}
    assert sum(e["bytes"] for e in m["files"].values()) < 4_000_000  # the repository stays small
    assert V.check_vendored() == m


def test_readme_table_matches_the_manifest():
    rows = {}
    for line in (VENDORED / "README.md").read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if cells[0].endswith(".jsonl.xz"):
            rows[cells[0]] = {"rows": int(cells[1]), "decompressed_sha256": cells[2], "license": cells[4],
                              "default": cells[5].startswith("yes")}
    m = manifest()["files"]
    assert rows == {n: {k: e[k] for k in ("rows", "decompressed_sha256", "license", "default")} for n, e in m.items()}


def _copy(tmp_path: Path, name: str = SMALL) -> Path:
    d = tmp_path / "corpora"
    d.mkdir()
    shutil.copy(VENDORED / "manifest.json", d / "manifest.json")
    shutil.copy(VENDORED / name, d / name)
    return d / name


def _load(path: Path):
    return D.load_source({"name": "self_instruct_seed_tasks", "kind": "file", "path": str(path)})


def test_a_corrupted_copy_raises_naming_the_file(tmp_path):
    path = _copy(tmp_path)
    assert _load(path)[1]["input_sha256"] == manifest()["files"][SMALL]["decompressed_sha256"]  # the intact copy
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(V.CorpusIntegrityError, match=rf"{SMALL}: sha256 .* compressed file differs"):
        _load(path)
    # a manifest that agrees with a broken file still fails: it does not decompress
    m = manifest()
    m["files"][SMALL]["sha256"] = sha256_file(path)
    (path.parent / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(V.CorpusIntegrityError, match=rf"{SMALL}: does not decompress"):
        _load(path)
    # a valid xz of other bytes: the decompressed hash catches it
    path.write_bytes(lzma.compress(b'{"id": "x", "messages": [{"role": "user", "content": "hi"}]}\n'))
    m["files"][SMALL]["sha256"] = sha256_file(path)
    (path.parent / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(V.CorpusIntegrityError, match=rf"{SMALL}: decompressed sha256 .* differs"):
        _load(path)
    # a file the manifest does not list, and a folder without a manifest
    other = path.with_name("other.jsonl.xz")
    shutil.copy(path, other)
    with pytest.raises(V.CorpusIntegrityError, match="other.jsonl.xz: not listed"):
        _load(other)
    (path.parent / "manifest.json").unlink()
    with pytest.raises(V.CorpusIntegrityError, match="no manifest"):
        _load(path)


@needs_shared
@pytest.mark.parametrize("fname", list(V.SHARED_CORPORA))
def test_vendored_and_shared_give_the_same_records_and_provenance(fname):
    src = {"name": V.corpus_name(fname), "kind": "file", "force_category": V.SHARED_CATEGORIES[fname]}
    shared_recs, shared_prov = D.load_source({**src, "path": str(SHARED / fname)})
    vend_recs, vend_prov = D.load_source({**src, "path": str(VENDORED / (fname + ".xz"))})
    assert vend_prov == shared_prov
    assert vend_prov["input_sha256"] == sha256_file(SHARED / fname) and vend_prov["source"] == f"file:{fname}"
    assert vend_recs == shared_recs and len(vend_recs) == manifest()["files"][fname + ".xz"]["rows"]


def test_default_sources_resolve_to_the_vendored_corpora_without_shared(monkeypatch, tmp_path):
    monkeypatch.setattr(layout, "SHARED_DATA_DEFAULT", tmp_path / "no" / "shared" / "data")  # a fresh machine
    assert layout.resolve_shared_data("auto") == VENDORED
    srcs = D.default_sources(layout.resolve_shared_data("auto"), humaneval=False)
    files = [s for s in srcs if s["kind"] == "file"]
    assert [s["name"] for s in files] == list(V.DEFAULT_CORPORA)  # dolly_15k is not among them
    assert all(Path(s["path"]) == VENDORED / f"{s['name']}.jsonl.xz" for s in files)
    assert [s["force_category"] for s in files] == ["t0_tasks", "math", "instructions"]
    assert layout.resolve_shared_data(None) is None  # the smoke preset: synthetic only
    assert [s["kind"] for s in D.default_sources(layout.resolve_shared_data(None), humaneval=False)] == ["synthetic"]
    with pytest.raises(FileNotFoundError):  # an explicit folder that is not there
        D.default_sources(layout.resolve_shared_data(str(tmp_path / "missing")), humaneval=False)
    if SHARED.is_dir():  # an explicit folder is read as it is
        paths = [s["path"] for s in D.default_sources(SHARED.parent, humaneval=False) if s["kind"] == "file"]
        assert paths == [str(SHARED / f"{n}.jsonl") for n in V.DEFAULT_CORPORA]


def test_dolly_enters_only_when_the_mixture_names_it():
    from drafter_lib.study.config import build_config
    from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS, DataConfig

    assert "dolly_15k" not in DEFAULT_SOURCE_WEIGHTS
    assert D.corpora_for(DEFAULT_SOURCE_WEIGHTS) == D.corpora_for(None) == list(V.DEFAULT_CORPORA)
    assert DataConfig().shared_data == "auto" and build_config("smoke").data.shared_data is None
    weights = {**DEFAULT_SOURCE_WEIGHTS, "dolly_15k": 0.5}
    srcs = D.default_sources(VENDORED, humaneval=False, corpora=D.corpora_for(weights))
    dolly = [s for s in srcs if s["name"] == "dolly_15k"]
    assert [s["name"] for s in srcs][-1] == "dolly_15k" and dolly[0]["force_category"] == "human_requests"
    with pytest.raises(ValueError, match="unknown corpora"):
        D.default_sources(VENDORED, humaneval=False, corpora=["nope"])


CODING = {"gpteacher_code_instruct": ("code_requests", 4535, "MIT"), "octopack_oasst": ("oasst", 1176, "MIT")}


def test_the_coding_corpora_enter_only_when_the_mixture_names_them():
    from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS

    files = manifest()["files"]
    for name, (category, rows, license_) in CODING.items():
        e = files[f"{name}.jsonl.xz"]
        assert (e["category"], e["rows"], e["default"]) == (category, rows, False)
        assert e["license"].startswith(license_) and e["own_categories"] == 1
        assert name not in V.DEFAULT_CORPORA and name not in DEFAULT_SOURCE_WEIGHTS
    weights = {**DEFAULT_SOURCE_WEIGHTS, "gpteacher_code_instruct": 2.0}
    assert D.corpora_for(weights) == [*V.DEFAULT_CORPORA, "gpteacher_code_instruct"]  # octopack_oasst: not named
    srcs = D.default_sources(VENDORED, humaneval=False, corpora=D.corpora_for({**weights, "octopack_oasst": 1.0}))
    coding = {s["name"]: s for s in srcs if s["name"] in CODING}
    assert {n: s["force_category"] for n, s in coding.items()} == {n: c[0] for n, c in CODING.items()}
    recs, prov = D.load_source(coding["octopack_oasst"])  # read through the checks; user turns only
    assert len(recs) == 1176 and {r["category"] for r in recs} == {"oasst"}
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in recs)
    assert prov["input_sha256"] == files["octopack_oasst.jsonl.xz"]["decompressed_sha256"]
    assert prov["source"] == "file:octopack_oasst.jsonl" and prov["commit"] == V.SHARED_CORPORA[
        "octopack_oasst.jsonl"]["commit"]


def _default_prompt_set(run_dir: Path, folder: Path) -> dict:
    """The default study's 01_data without the length filter (stages.build_prompts minus the tokenizer)."""
    from drafter_lib.study.config_sections import DEFAULT_SOURCE_WEIGHTS, DataConfig

    d = DataConfig()
    sources = D.default_sources(folder, synthetic_n=d.synthetic_n, seed=0, humaneval=False,
                                corpora=D.corpora_for(d.source_weights))
    weights = D.only_present(d.source_weights, sources) if d.source_weights == DEFAULT_SOURCE_WEIGHTS \
        else d.source_weights
    return D.build_prompt_set(run_dir, sources=sources, weights=weights, total=d.total_prompts,
                              heldout_frac=d.heldout_frac, seed=0, architecture_path=run_dir / "architecture.json")


@needs_shared
def test_default_prompt_set_is_byte_identical_from_vendored_and_shared(tmp_path):
    shared = _default_prompt_set(tmp_path / "shared", SHARED.parent)
    vend = _default_prompt_set(tmp_path / "vendored", layout.resolve_shared_data("auto"))
    for f in ("train.jsonl", "heldout.jsonl"):
        assert (tmp_path / "shared" / f).read_bytes() == (tmp_path / "vendored" / f).read_bytes()
    assert vend["corpora"] == shared["corpora"] and vend["by_source"] == shared["by_source"]
    arch = [json.loads((tmp_path / r / "architecture.json").read_text()) for r in ("shared", "vendored")]
    assert arch[0] == arch[1]
    assert {c["name"] for c in arch[1]["corpora"]} == {"synthetic", *V.DEFAULT_CORPORA}


def test_build_vendored_round_trip_and_cli(tmp_path, capsys):
    raw, _ = V.read_verified(VENDORED / SMALL)
    src = tmp_path / "src"
    src.mkdir()
    (src / "self_instruct_seed_tasks.jsonl").write_bytes(raw)
    m = V.build_vendored(src, tmp_path / "out", files=["self_instruct_seed_tasks.jsonl"])
    e, committed = m["files"][SMALL], manifest()["files"][SMALL]
    assert {k: v for k, v in e.items() if k not in ("sha256", "bytes")} == \
        {k: v for k, v in committed.items() if k not in ("sha256", "bytes")}
    assert V.read_verified(tmp_path / "out" / SMALL)[0] == raw
    assert V.main(["--check", "--out", str(tmp_path / "out")]) == 0 and SMALL in capsys.readouterr().out
    with pytest.raises(ValueError, match="no provenance"):
        V.build_vendored(src, tmp_path / "out", files=["unknown.jsonl"])

"""The prompt corpora that travel with the repository: `data/corpora/<file>.jsonl.xz`, checked on every read.

Byte-exact xz copies of the shared corpora (`SHARED_CORPORA`: upstream, commit, path, selection, license), so the
default study (`data.shared_data = "auto"`) reads the same prompts on every machine, with or without
../shared/data. `data/corpora/manifest.json` records per file the sha256 of the compressed file and of the
decompressed JSONL; the latter equals the original file's sha256, which is what architecture.json records as the
corpus's `input_sha256`, so a run's provenance reads the same from either copy. `read_verified` checks both
hashes and raises `CorpusIntegrityError` naming the file; `build_vendored` (re)makes the copies and the manifest:

    python -m drafter_lib.data.vendored --from ../shared/data   # (re)build data/corpora/ from that folder
    python -m drafter_lib.data.vendored --check                 # check the copies against the manifest

Only `DEFAULT_CORPORA` enter a study unnamed; another corpus (dolly_15k, gpteacher_code_instruct, octopack_oasst)
is loaded only when a mixture names it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
from collections import Counter
from pathlib import Path

from drafter_lib.common.files import read_json, write_json
from drafter_lib.common.layout import VENDORED_CORPORA_DIR, repo_relative
from drafter_lib.data.prompt_files import jsonl_rows, records_from_rows

SUFFIX = ".xz"
MANIFEST = "manifest.json"
SCHEMA = "specdraft-vendored-corpora/1"
XZ_PRESET = 9 | lzma.PRESET_EXTREME  # measured: 3.54 MB for all six (gzip -9: 6.09 MB)
COMPRESSION = "xz (Python lzma, FORMAT_XZ, CHECK_CRC64, preset 9 | PRESET_EXTREME)"

# Coarse categories for the shared corpora (their own categories are per template: ~270 in T0, 175 seed tasks;
# Dolly's 8 (open_qa, summarization, ...) would mix with the held-out sets' category names).
# GPTeacher's coding instructions and the OpenAssistant turns get their own (apart from the synthetic and HumanEval
# "code" and MT-bench's "coding", so a report tells them apart).
SHARED_CATEGORIES = {"t0_train_prompts.jsonl": "t0_tasks", "gsm8k_train_questions.jsonl": "math",
                     "self_instruct_seed_tasks.jsonl": "instructions", "dolly_15k.jsonl": "human_requests",
                     "gpteacher_code_instruct.jsonl": "code_requests", "octopack_oasst.jsonl": "oasst"}
# Provenance of the shared corpora (from ../shared/data/README.md): upstream repo, commit, path, license.
SHARED_CORPORA = {
    "t0_train_prompts.jsonl": {
        "upstream": "https://github.com/yizhongw/self-instruct", "commit": "0b26ccaa415992100fa32df62d41b994cf928e23",
        "upstream_path": "data/finetuning/t0_train_50k/data_per_template/*.jsonl",
        "selection": "train split of the T0 mixture; 40 prompts per template, seeded shuffle, prompt field only",
        "license": "repo Apache-2.0; underlying datasets their own"},
    "gsm8k_train_questions.jsonl": {
        "upstream": "https://github.com/openai/grade-school-math", "commit": "3101c7d5072418e28b9008a6636bde82a006892c",
        "upstream_path": "grade_school_math/data/train.jsonl", "selection": "train split, question field only",
        "license": "MIT"},
    "self_instruct_seed_tasks.jsonl": {
        "upstream": "https://github.com/yizhongw/self-instruct", "commit": "0b26ccaa415992100fa32df62d41b994cf928e23",
        "upstream_path": "data/seed_tasks.jsonl", "selection": "instruction + first instance input",
        "license": "Apache-2.0"},
    "dolly_15k.jsonl": {
        "upstream": "https://github.com/ZeenathulNizreen/FedAgg", "commit": "59cd0654e15fa1479782e33862bcc4a396147ed7",
        "upstream_path": "data/10/global_test.json + data/10/local_training_{0..9}.json",
        "selection": "databricks-dolly-15k (all 15,011 rows, written by people; one split) as re-split into 10 + 1 "
                     "shards by that repo; ids are positions in that order; prompt = instruction, blank line, "
                     "context where it has one; 203 duplicate prompts dropped",
        "license": "CC BY-SA 3.0 (Databricks; passages from Wikipedia, CC BY-SA)"},
    "gpteacher_code_instruct.jsonl": {
        "upstream": "https://github.com/teknium1/GPTeacher", "commit": "481075123c29854bddb82655badeef6a438f2436",
        "upstream_path": "Codegen/codegen-instruct.json",
        "selection": "coding instructions in many languages; prompt = instruction, blank line, input where it has "
                     "one; responses dropped",
        "license": "MIT (repo LICENSE)"},
    "octopack_oasst.jsonl": {
        "upstream": "https://github.com/bigcode-project/octopack", "commit": "e17a8f6470264286bc6a52eb8263582083bf3bf6",
        "upstream_path": "dataset/oasst/oasstcommitpackftmanual.jsonl",
        "selection": "OpenAssistant user turns written by people (many about code, some not in English) plus "
                     "commit-message edit requests; prompt field only; 2 duplicates dropped",
        "license": "MIT (repo LICENSE); OpenAssistant data Apache-2.0"},
}
# The corpora a study loads without naming them (the default mixture's); any other enters only by name.
DEFAULT_CORPORA = ("t0_train_prompts", "gsm8k_train_questions", "self_instruct_seed_tasks")


class CorpusIntegrityError(ValueError):
    """A vendored corpus does not match its manifest (or has none)."""


def corpus_name(file_name: str) -> str:
    """"t0_train_prompts.jsonl[.xz]" -> "t0_train_prompts": the corpus's name, the unit of mixture weights."""
    return Path(file_name).name.split(".")[0]


def corpus_names() -> list[str]:
    return [corpus_name(f) for f in SHARED_CORPORA]


def is_vendored(path) -> bool:
    return Path(path).name.endswith(".jsonl" + SUFFIX)


def original_name(path) -> str:
    """The file name the corpus had before compression (what architecture.json records)."""
    name = Path(path).name
    return name[:-len(SUFFIX)] if name.endswith(SUFFIX) else name


def read_manifest(folder=VENDORED_CORPORA_DIR) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise CorpusIntegrityError(f"{path}: no manifest for the vendored corpora in {folder}")
    return read_json(path)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_verified(path) -> tuple[bytes, dict]:
    """-> (the decompressed JSONL bytes, the manifest entry) of a vendored corpus, after checking the sha256 of the
    compressed file and of what it decompresses to against manifest.json next to it. CorpusIntegrityError (naming
    the file) on any mismatch, a missing entry or a file that does not decompress."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"vendored corpus {path} not found")
    fix = "restore it (git checkout) or rebuild: python -m drafter_lib.data.vendored --from ../shared/data"
    entry = read_manifest(path.parent).get("files", {}).get(path.name)
    if entry is None:
        raise CorpusIntegrityError(f"{path}: not listed in {path.parent / MANIFEST}")
    packed = path.read_bytes()
    if (actual := _sha256(packed)) != entry["sha256"]:
        raise CorpusIntegrityError(f"{path}: sha256 {actual} of the compressed file differs from the manifest's "
                                   f"{entry['sha256']}; {fix}")
    try:
        data = lzma.decompress(packed, format=lzma.FORMAT_XZ)
    except lzma.LZMAError as e:
        raise CorpusIntegrityError(f"{path}: does not decompress ({e}); {fix}") from None
    if (actual := _sha256(data)) != entry["decompressed_sha256"]:
        raise CorpusIntegrityError(f"{path}: decompressed sha256 {actual} differs from the manifest's "
                                   f"{entry['decompressed_sha256']} (the original {entry['file']}'s); {fix}")
    return data, entry


def load_vendored(path, source: str | None = None, category: str | None = None,
                  turns: str = "all") -> tuple[list[dict], str]:
    """-> (records, sha256 of the decompressed JSONL) of a vendored corpus, checked first (`read_verified`). The
    records are those `prompt_files.load_prompt_file` reads from the original .jsonl (same lines, same rules)."""
    path = Path(path)
    data, entry = read_verified(path)
    with io.TextIOWrapper(io.BytesIO(data), encoding="utf-8") as f:  # what open(.., "rt") does to the original
        out = records_from_rows(jsonl_rows(f, path), path, source or corpus_name(path.name), category, turns)
    return out, entry["decompressed_sha256"]


# ------------------------------------------------------------------------------------------------ (re)building

def _file_entry(fname: str, raw: bytes, packed: bytes) -> dict:
    rows = [json.loads(line) for line in raw.decode("utf-8").split("\n") if line.strip()]
    own = Counter(str(r.get("category")) for r in rows)
    entry = {"file": fname, "sha256": _sha256(packed), "bytes": len(packed), "decompressed_sha256": _sha256(raw),
             "decompressed_bytes": len(raw), "rows": len(rows), "category": SHARED_CATEGORIES[fname],
             "default": corpus_name(fname) in DEFAULT_CORPORA, "own_categories": len(own)}
    if len(own) <= 16:  # a few (Dolly's 8): listed; hundreds of per-template ones (T0, self-instruct): counted
        entry["own_category_rows"] = dict(sorted(own.items()))
    return {**entry, **SHARED_CORPORA[fname]}


def build_vendored(src_dir, out_dir=VENDORED_CORPORA_DIR, files=None) -> dict:
    """Compress each corpus of `files` (default: all of `SHARED_CORPORA`) from `src_dir` (or its prompts/) into
    `out_dir` as <file>.xz and write manifest.json there; -> the manifest. A copy whose bytes would not change is
    left alone; the round trip is checked before anything is written."""
    src, out = Path(src_dir), Path(out_dir)
    src = src / "prompts" if (src / "prompts").is_dir() else src
    out.mkdir(parents=True, exist_ok=True)
    entries = {}
    for fname in files or SHARED_CORPORA:
        if fname not in SHARED_CORPORA:
            raise ValueError(f"{fname}: no provenance in SHARED_CORPORA; add it there first")
        raw = (src / fname).read_bytes()
        packed = lzma.compress(raw, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)
        if lzma.decompress(packed) != raw:
            raise RuntimeError(f"{fname}: xz round trip changed the bytes")
        dest = out / (fname + SUFFIX)
        if not dest.is_file() or dest.read_bytes() != packed:
            tmp = dest.with_name(dest.name + ".tmp")
            tmp.write_bytes(packed)
            os.replace(tmp, dest)
        entries[dest.name] = _file_entry(fname, raw, packed)
    manifest = {"schema": SCHEMA, "compression": COMPRESSION, "made_from": repo_relative(src),
                "decompressed_sha256": "sha256 of the original .jsonl (= architecture.json's input_sha256)",
                "files": entries}
    write_json(out / MANIFEST, manifest, indent=1)
    return manifest


def check_vendored(folder=VENDORED_CORPORA_DIR) -> dict:
    """Check every file the manifest lists (CorpusIntegrityError on the first that does not match); -> manifest."""
    manifest = read_manifest(folder)
    for name in manifest["files"]:
        read_verified(Path(folder) / name)
    return manifest


def _table(manifest: dict) -> str:
    lines = [f"{'file':36} {'rows':>7} {'jsonl bytes':>12} {'xz bytes':>10}  default"]
    for name, e in manifest["files"].items():
        lines.append(f"{name:36} {e['rows']:7d} {e['decompressed_bytes']:12d} {e['bytes']:10d}  {e['default']}")
    tot = sum(e["bytes"] for e in manifest["files"].values())
    raw = sum(e["decompressed_bytes"] for e in manifest["files"].values())
    return "\n".join(lines + [f"{'total':36} {'':7} {raw:12d} {tot:10d}"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="(Re)build or check the vendored prompt corpora (data/corpora/).")
    ap.add_argument("--from", dest="src", help="folder holding the original .jsonl corpora (or their prompts/)")
    ap.add_argument("--out", default=str(VENDORED_CORPORA_DIR), help="where the .xz copies go (default %(default)s)")
    ap.add_argument("--check", action="store_true", help="only check the copies in --out against their manifest")
    args = ap.parse_args(argv)
    if not args.check and not args.src:
        ap.error("give --from FOLDER to build, or --check")
    manifest = check_vendored(args.out) if args.check else build_vendored(args.src, args.out)
    print(_table(manifest))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

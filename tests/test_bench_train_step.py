"""bench/train_step.py on a tiny random Qwen2: settings parsed from their names, several timed side by side on one
model with the trainer's freezing and checkpointing, the first the baseline of the ratios."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import Setting, main  # noqa: E402


def test_setting_names_round_trip():
    for name in ("fp32", "bf16", "fp32+freeze12", "bf16+freeze18+ckpt", "fp32+ckpt"):
        assert Setting.parse(name).name == name
    assert Setting.parse("bf16+freeze3") == Setting("bf16", 3, False)
    for bad in ("fp16", "bf16+freeze", "bf16+frozen3"):
        with pytest.raises(ValueError, match="setting"):
            Setting.parse(bad)


def test_settings_side_by_side(tmp_path):
    from drafter_lib.model.tiny_models import materialize

    base = materialize("tiny-random:qwen2", tmp_path / "base")  # 4 layers, untied head once reduced
    out = main(["--base", str(base), "--keep-layers", "all", "--draft-vocab", "32", "--batch-size", "2",
                "--seq-len", "16", "--steps", "2", "--compare", "fp32", "bf16+freeze2", "fp32+freeze4+ckpt"])
    rows = out["settings"]
    assert list(rows) == ["fp32", "bf16+freeze2", "fp32+freeze4+ckpt"] and rows["fp32"]["ratio"] == 1.0
    assert all(len(r["times"]) == 2 and r["seconds_per_step"] > 0 for r in rows.values())
    full, two, four = (rows[k]["trainable_parameters"] for k in rows)
    assert full == out["parameters"] > two > four > 0  # the embedding and 2, then 4 layers frozen

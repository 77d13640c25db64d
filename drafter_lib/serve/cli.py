"""The `specdraft-serve` command: the HTTP drafter over the packed model in MODEL_DIR, offline.

`./serve.sh` and `python server.py` run the same `main`. Settings come from the environment (drafter_lib/serve/app.py,
`Settings`). Model hubs are switched off (serving never touches the network), and idle OpenMP threads are told to
spin a bounded while before torch is imported (common/openmp_wait.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from drafter_lib.common.openmp_wait import bounded_spin

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def main() -> None:
    for var in OFFLINE:
        os.environ.setdefault(var, "1")
    bounded_spin()  # before torch is imported (the app module imports it)
    from drafter_lib.serve.app import Settings, create_app, serve

    settings = Settings.from_env()
    if not (Path(settings.model_dir) / "config.json").is_file():
        sys.exit(f"MODEL_DIR {settings.model_dir!r} holds no packed drafter (no config.json); set MODEL_DIR or "
                 f"publish a model with notebooks/04_pack")
    serve(create_app(settings), settings)

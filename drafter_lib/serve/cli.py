"""The `specdraft-serve` command: the HTTP drafter over the packed model in MODEL_DIR, offline.

`./serve.sh` and `python server.py` run the same `main`. Settings come from the environment (serve/settings.py);
a bad value stops the command before anything loads, with one line per variable. Model hubs are switched off
(serving never touches the network), and idle OpenMP threads are told to spin a bounded while before torch is
imported (common/openmp_wait.py).

`specdraft-serve --warm-up` loads MODEL_DIR once, as the server would, and exits: the weight formats are timed on
this machine and cached (the slow part of a first start), so a server started afterwards is ready in seconds.
setup.sh runs it for the shipped model/.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from pydantic import ValidationError

from drafter_lib.common.openmp_wait import bounded_spin
from drafter_lib.serve.settings import Settings, describe_errors

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="specdraft-serve", description="Serve the packed drafter in MODEL_DIR over "
                                 "HTTP (settings: environment variables, see the README).")
    ap.add_argument("--warm-up", action="store_true", help="load MODEL_DIR once, caching this machine's timed "
                    "weight formats, then exit (setup.sh runs it)")
    args = ap.parse_args(argv)
    for var in OFFLINE:
        os.environ.setdefault(var, "1")
    try:
        settings = Settings.from_env()
    except ValidationError as exc:
        sys.exit("specdraft-serve: bad settings, nothing started:\n  " + "\n  ".join(describe_errors(exc)))
    bounded_spin()  # before torch is imported (the app module imports it)
    from drafter_lib.serve.app import create_app, limits_of_dir, serve
    from drafter_lib.serve.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)  # before the load starts logging its steps
    try:
        limits_of_dir(settings.model_dir)
    except ValueError as exc:
        sys.exit(f"specdraft-serve: {exc}")
    if args.warm_up:
        from drafter_lib.serve.app import load_engine

        t0 = time.perf_counter()
        load_engine(settings)
        logging.getLogger("specdraft.serve").info("warm-up done in %.1f s: a server starts from the cache now",
                                                  time.perf_counter() - t0)
        return
    serve(create_app(settings), settings)

"""HTTP drafter service: POST /draft returns greedy draft tokens from the packed drafter in MODEL_DIR.

Run `./serve.sh`, `specdraft-serve` or `python server.py`; `uvicorn server:app` works too. Settings come from the
environment: HOST (127.0.0.1), PORT (8000), MODEL_DIR (model/), MAX_BODY_BYTES (2 MiB), BATCH_WINDOW_MS (20),
MAX_BATCH (32), ENGINE_DTYPE (the model dir's draft_engine_dtype, else "auto"), MAX_QUEUE (128), REQUEST_TIMEOUT_S (30),
MAX_CACHE_MB (256), MAX_BATCH_TOKENS (4096), SHUTDOWN_TIMEOUT_S (REQUEST_TIMEOUT_S + 5), LOG_LEVEL (info),
DEFAULT_MIN_CONFIDENCE (off: a request without min_confidence gets exactly num_draft_tokens tokens; a number in
[0, 1], or "recommended" for the model dir's draft_min_confidence).

The command lives in drafter_lib/serve/cli.py; the app, its schema, metrics and the draining server in
drafter_lib/serve/app.py.
"""

from __future__ import annotations

from drafter_lib.common.openmp_wait import bounded_spin

bounded_spin()  # before torch is imported (the app module imports it): idle threads spin a bounded while, then sleep

from drafter_lib.serve.cli import main  # noqa: E402


def __getattr__(name: str):
    # `server.app` (for `uvicorn server:app`) loads the model on first access, so importing this module stays cheap.
    if name == "app":
        from drafter_lib.serve.app import create_app

        app = globals()["app"] = create_app()
        return app
    raise AttributeError(name)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Serve the packed drafter over HTTP with no network access to any model hub.
# Settings: HOST (127.0.0.1), PORT (8000), MODEL_DIR (model/ next to this script); see server.py for the rest.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")" && pwd)"
# server.py lets idle OpenMP threads spin a bounded while, then sleep (drafter_lib/common/openmp_wait.py), unless
# OMP_WAIT_POLICY or GOMP_SPINCOUNT is set here.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
export HOST="${HOST:-127.0.0.1}" PORT="${PORT:-8000}" MODEL_DIR="${MODEL_DIR:-$ROOT/model}"
exec "${PYTHON:-python}" "$ROOT/server.py"

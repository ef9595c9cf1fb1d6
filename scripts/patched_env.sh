#!/usr/bin/env bash
# patched_deepspeed_env DIR VENV: a fresh virtual environment VENV, activated, with torch 2.13.0
# (CPU) first, then the DeepSpeed source at DIR (a patched source distribution or git tree)
# installed as DeepSpeed installs (pip install DIR, no ops prebuilt), and the test tools. Sourced by
# scripts/check_intree.sh and scripts/deepspeed_tests.sh --deepspeed-tree; needs ROOT and say.
patched_deepspeed_env() {
    local constraints="$ROOT/requirements/constraints-cpu.txt"
    say "environment: a fresh one in $2 with torch 2.13.0 (CPU) and the DeepSpeed of $1"
    python3 -m venv "$2"
    # shellcheck disable=SC1091
    source "$2/bin/activate"
    export PIP_DISABLE_PIP_VERSION_CHECK=1
    pip install -q -c "$constraints" torch==2.13.0
    pip install -q -c "$constraints" "$1"
    pip install -q -c "$constraints" -r "$ROOT/requirements/requirements-dev.txt" ninja
}

#!/usr/bin/env bash
# The main job, from a fresh machine: the bug report's training on 3 nodes x 2 processes (three
# torchrun agents on 127.0.0.1) with zero_quantized_gradients true, next to the same run with it
# false, and once more on this package's Triton quantizer op (in Triton's interpreter); prints the loss
# curves, the gradient collectives DeepSpeed's comms logger counted, the bytes handed to them per step,
# on and off, and whether the Triton op's run gave the CPU op's losses and weights bit for bit.
# QGZ_DEEPSPEED=0.17.6 runs it on that DeepSpeed release instead of 0.19.8, in an environment of its
# own beside the main one (scripts/release_env.sh).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
if [ -n "${QGZ_DEEPSPEED:-}" ]; then
    source "$ROOT/scripts/release_env.sh"
    release_deepspeed_env "$QGZ_DEEPSPEED" "$VENV-deepspeed-$QGZ_DEEPSPEED"
fi
cd "$(mktemp -d)"
python "$ROOT/scripts/qgz_3x2/run.py" --compare --triton "$@"

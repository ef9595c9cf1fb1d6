#!/usr/bin/env bash
# The test suite, from a fresh machine (what .ci/run runs): set up the environment, build the CPU
# quantizer op once, run DeepSpeed's linters, run pytest on the *installed* package (DeepSpeed
# 0.19.8 with the overlay) from a directory outside the source tree, then the in-tree route
# (scripts/check_intree.sh: the patch applied to DeepSpeed's source distribution, same suite).
# Extra arguments go to both pytest runs.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
say "op build and overlay state (the CPU quantizer op builds in about 40 s the first time)"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
(cd "$WORK" && python -m deepspeed_qgz status)
bash "$ROOT/scripts/lint.sh"
say "suite: DeepSpeed 0.19.8 with the overlay"
(cd "$WORK" && python -m pytest -p no:cacheprovider -q -rA --durations=10 "$ROOT/tests" "$@")
bash "$ROOT/scripts/check_intree.sh" "$@"
say "all checks passed"

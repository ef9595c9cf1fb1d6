#!/usr/bin/env bash
# The test suite, from a fresh machine: set up the environment, build the CPU quantizer op once,
# then run pytest on the *installed* package from a directory outside the source tree.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
python -m deepspeed_qgz status
python -m pytest -p no:cacheprovider -q -rA --durations=10 "$ROOT/tests" "$@"

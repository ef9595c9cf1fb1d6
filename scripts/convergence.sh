#!/usr/bin/env bash
# The convergence benchmark, from a fresh machine (about 55 minutes on a 2-core machine): a byte-level
# GPT trained with ZeRO-3 bf16 on 3 nodes x 2 processes, qgZ off vs qgZ's settings vs ZeRO++'s whole
# recipe vs DeepSpeed 0.19.8, then the gradient-fidelity tables. Results (JSON, Markdown, PNG) land
# in benchmarks/results/; extra arguments go to benchmarks/convergence.py (--runs NAME,... for a subset).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
cd "$(mktemp -d)"
python "$ROOT/benchmarks/convergence.py" --out "$ROOT/benchmarks/results" "$@"

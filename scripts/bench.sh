#!/usr/bin/env bash
# The benchmarks, from a fresh machine: CPU quantizer op throughput, the side-by-side collective
# benchmark (3 nodes x 2 by default; extra arguments go to it) and the coverage table. Results
# (JSON, Markdown, PNG) land in benchmarks/results/.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
OUT="$ROOT/benchmarks/results"
mkdir -p "$OUT"
cd "$(mktemp -d)"
python "$ROOT/benchmarks/quantizer_throughput.py" | tee "$OUT/quantizer_throughput.txt"
python "$ROOT/benchmarks/qgz_collectives.py" --out "$OUT" "$@"
python "$ROOT/benchmarks/qgz_coverage.py" | tee "$OUT/qgz_coverage.md"

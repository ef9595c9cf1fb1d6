#!/usr/bin/env bash
# The cost benchmarks, from a fresh machine (a few minutes): CPU quantizer op throughput, the
# side-by-side collective benchmark (3 nodes x 2 by default; extra arguments go to it), the Triton
# quantizer op's static roofline, and the coverage tables.
# Results (JSON, Markdown, PNG) land in benchmarks/results/. The convergence benchmark has its own
# command: scripts/convergence.sh.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
OUT="$ROOT/benchmarks/results"
mkdir -p "$OUT"
cd "$(mktemp -d)"
say "benchmark: CPU quantizer op throughput"
python "$ROOT/benchmarks/quantizer_throughput.py" | grep -v "^\[" | tee "$OUT/quantizer_throughput.txt"
say "benchmark: one reduce-scatter call per bucket, side by side"
python "$ROOT/benchmarks/qgz_collectives.py" --out "$OUT" "$@"
say "benchmark: the Triton quantizer op's static roofline (Triton's compiler for A100, H100, H200 and L40S)"
python "$ROOT/benchmarks/qgz_roofline.py" --out "$OUT" | tail -n 4
say "benchmark: share of gradient and weight elements quantized"
python "$ROOT/benchmarks/qgz_coverage.py" | grep -v "^\[" | tee "$OUT/qgz_coverage.md"

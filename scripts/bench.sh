#!/usr/bin/env bash
# The cost benchmarks, from a fresh machine (a few minutes): CPU quantizer op throughput, the
# side-by-side collective benchmark (3 nodes x 2 by default; extra arguments go to it), the fused
# kernels' static roofline, the modeled gradient synchronization of LLaMA-2-7B (counting one rank's
# work at 3x8 and 4x8, the fused stages priced at their roofline ceilings), and the coverage tables.
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
say "benchmark: the fused kernels' static roofline (Triton's compiler for A100, H100, H200 and L40S)"
python "$ROOT/benchmarks/qgz_roofline.py" --out "$OUT" | tail -n 4
say "benchmark: modeled gradient synchronization of LLaMA-2-7B"
python "$ROOT/benchmarks/qgz_sync_model.py" --out "$OUT"
say "benchmark: share of gradient and weight elements quantized"
python "$ROOT/benchmarks/qgz_coverage.py" | grep -v "^\[" | tee "$OUT/qgz_coverage.md"

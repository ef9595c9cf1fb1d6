# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A short run of benchmarks/convergence.py (qgZ off and 8/4, a few steps):
the benchmark's machinery works end to end. The benchmark itself measures training quality."""

import json
import math
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "convergence.py"


def test_convergence_benchmark_smoke(cpu_quantizer, tmp_path):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--steps", "6", "--out",
         str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = json.loads((tmp_path / "convergence.json").read_text())
    runs = {r["name"]: r for r in saved["runs"]}
    assert set(runs) == {"off", "qgz-8/4"}
    for run in runs.values():
        assert len(run["losses"]) == 6 and all(math.isfinite(v) for v in run["losses"])
        assert [step for step, _ in run["evals"]] == [0, 6]
    # the quantized run went through qgZ, on nearly every element, at qgZ's traffic
    summary = {r["name"]: r for r in saved["summary"]}
    assert summary["qgz-8/4"]["quantized_share"] > 0.99 and summary["off"]["quantized_share"] == 0
    assert runs["qgz-8/4"]["inter_bytes_per_step"] < 0.14 * runs["off"]["inter_bytes_per_step"]
    # int8 inside the node: every partition's slot to each local peer, about 1.55x the fp16 reduce-scatter's
    assert 1.4 < runs["qgz-8/4"]["intra_bytes_per_step"] / runs["off"]["intra_bytes_per_step"] < 1.6
    assert abs(summary["qgz-8/4"]["gap"]) < 0.02
    assert (tmp_path / "convergence.png").stat().st_size > 0 and (tmp_path / "convergence.md").exists()
    assert "run 2/2 qgz-8/4" in result.stdout  # progress, run by run

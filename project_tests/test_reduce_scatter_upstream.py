# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patched reduce_scatter_coalesced (what every ZeRO-3 run calls with qgZ off) against DeepSpeed
0.19.8's own file, bit for bit, on real gloo worlds (rs_upstream_worker.py)."""

import sys
from pathlib import Path

from qgz_harness import run_world

WORKER = Path(__file__).resolve().parent / "rs_upstream_worker.py"


def test_reduce_scatter_coalesced_matches_upstream(cpu_quantizer, code_under_test):
    for num_nodes, local_size in [(3, 1), (2, 2)]:
        reports = run_world([sys.executable, str(WORKER)], num_nodes, local_size)
        failures = [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]
        assert not failures, "\n".join(failures[:20])
        assert all(r["cases"] == 24 for r in reports)
        assert all(r["module"] == code_under_test[1] for r in reports)
        assert all(r["upstream_file"] != code_under_test[1] for r in reports)

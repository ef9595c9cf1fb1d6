# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""all_to_all_quant_reduce on real gloo worlds of simulated nodes (see qgz_worker.py for the cases:
odd 2-D, 3-D, tiny, world-sized, vocab-like shapes and mixed buckets in fp16/bf16/fp32, determinism,
non-finite propagation and bad input)."""

import pytest

from qgz_launch import run_world

TOPOLOGIES = [(3, 2), (2, 3), (3, 4), (5, 2), (2, 2), (7, 1)]


@pytest.mark.parametrize("num_nodes,local_size", TOPOLOGIES, ids=[f"{n}x{d}" for n, d in TOPOLOGIES])
def test_quant_reduce_topology(cpu_quantizer, num_nodes, local_size):
    reports = run_world(num_nodes, local_size, "topology")
    failures = [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]
    assert not failures, "\n".join(failures[:20])
    for report in reports:
        assert "deepspeed_qgz" in report["module"], f"tested {report['module']}, not the overlay"
        assert report["cases"] == 18
        totals = report["totals"]
        assert totals["quantized_tensors"] > 0 and totals["padding_elems"] >= 0
        # one exchange per stage (none for a group of one) plus one reduce-scatter for 1-D tensors
        assert totals["collective_calls"] <= 3 * totals["calls"]


def test_reduce_scatter_coalesced_matches_upstream(cpu_quantizer):
    for num_nodes, local_size in [(3, 1), (2, 2)]:
        reports = run_world(num_nodes, local_size, "differential")
        failures = [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]
        assert not failures, "\n".join(failures[:20])
        assert all(r["cases"] == 24 for r in reports)
        assert all("deepspeed_qgz" not in r["upstream_file"] for r in reports)

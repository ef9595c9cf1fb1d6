# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""all_to_all_quant_reduce on real gloo worlds of simulated nodes, each process with LOCAL_SIZE
devices (see qgz_worker.py for the cases: odd 2-D, 3-D, tiny, world-sized, vocab-like shapes and
mixed buckets in fp16/bf16/fp32, tensors 10^6 apart in one bucket, group sizes, determinism,
non-finite propagation, bad input, DeepSpeed's NPUQuantizer as the quantizer)."""

import sys
from pathlib import Path

import pytest

from deepspeed_qgz.harness import run_world

WORKER = Path(__file__).resolve().parent / "qgz_worker.py"
TOPOLOGIES = [(3, 2), (2, 3), (3, 4), (5, 2), (2, 2), (7, 1), (1, 3)]
# per intra-node precision: 6 shape sets x 3 dtypes, 3 mixed-magnitude buckets, 2 group sizes
CASES = 2 * (18 + 3 + 2)
NPU_CASES = 2 * 2


def failures(reports):
    return [f"rank {r['rank']}: {f}" for r in reports for f in r["failures"]]


def assert_code_under_test(reports, code_under_test):
    mode, origin = code_under_test
    for report in reports:
        assert report["module"] == origin, f"rank {report['rank']} ran {report['module']}, expected {origin}"
    if mode == "overlay":
        assert "deepspeed_qgz" in origin
    else:
        from deepspeed.runtime.comm import coalesced_collectives
        assert "deepspeed_qgz" not in origin and hasattr(coalesced_collectives, "quantize_partitions"), origin


@pytest.mark.parametrize("num_nodes,local_size", TOPOLOGIES, ids=[f"{n}x{d}" for n, d in TOPOLOGIES])
def test_quant_reduce_topology(cpu_quantizer, code_under_test, num_nodes, local_size):
    suites = "topology,npu" if (num_nodes, local_size) == (3, 2) else "topology"
    reports = run_world([sys.executable, str(WORKER), suites], num_nodes, local_size)
    assert not failures(reports), "\n".join(failures(reports)[:20])
    assert_code_under_test(reports, code_under_test)
    for report in reports:
        assert report["cases"] == CASES + (NPU_CASES if "npu" in suites else 0)
        totals = report["totals"]
        assert totals["quantized_tensors"] > 0 and totals["padding_elems"] >= 0
        # one exchange per stage (none for a group of one) plus one reduce-scatter for 1-D tensors
        assert totals["collective_calls"] <= 3 * totals["calls"]


def test_reduce_scatter_coalesced_matches_upstream(cpu_quantizer, code_under_test):
    for num_nodes, local_size in [(3, 1), (2, 2)]:
        reports = run_world([sys.executable, str(WORKER), "differential"], num_nodes, local_size)
        assert not failures(reports), "\n".join(failures(reports)[:20])
        assert all(r["cases"] == 24 for r in reports)
        assert all(r["upstream_file"] != code_under_test[1] for r in reports)

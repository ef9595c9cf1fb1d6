# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The Triton kernels as a GPU gets them, without a GPU: every distinct variant the launchers make,
recorded for the fused kernels (quantized_fused.py) over topologies from 1x2 and 2x1 to 7x1, 2x16 and
16x2, fp16, bf16 and fp32, both intra-node precisions, group sizes from 136 to 40960 and buckets up
to DeepSpeed's default and the largest tensor the plan allows, and for the Triton quantizer op
(triton_quantizer.py) over the calls the series' all_to_all_quant_reduce makes at the same
topologies and group sizes, up to its largest exchange, and qwZ's, compiled by Triton's compiler for sm_80, sm_89 and sm_90 (in a
process without TRITON_INTERPRET: unit/qgz_compile.py). A compile error, a grid beyond CUDA's
limits, a register spill, or an approximate division, an FMA or a flush-to-zero instruction in the
PTX fails it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from unit import qgz_compile  # noqa: E402

TESTS = Path(__file__).resolve().parents[3]  # the directory that holds unit/


def test_every_variant_compiles_for_every_target(tmp_path):
    report_path = tmp_path / "report.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "unit.qgz_compile", "--out",
                    str(report_path)],
                   cwd=TESTS,
                   env=env,
                   check=True,
                   timeout=1200)
    report = json.loads(report_path.read_text())
    assert not report["problems"], "\n".join(report["problems"])
    compiled = {(entry["variant"].split()[0], entry["variant"].split()[1]) for entry in report["compiled"]}
    kernels = {
        "_quantize_partitions_kernel", "_reduce_within_node_kernel", "_average_across_nodes_kernel",
        "_quantize_kernel", "_quantized_reduction_kernel", "_dequantize_kernel"
    }
    assert compiled == {(kernel, f"sm_{arch}") for kernel in kernels for arch in qgz_compile.ARCHES}
    from deepspeed_qgz.qgz.quantized_fused import GRID_LIMITS
    assert 0 < report["largest_grid"] <= GRID_LIMITS[0]


@pytest.mark.parametrize("ptx, problem", [
    ("div.full.f32 %f3, %f1, %f2;", "an approximate division"),
    ("rcp.approx.ftz.f32 %f2, %f1;", "an approximate division"),
    ("fma.rn.f32 %f4, %f1, %f2, %f3;", "an FMA"),
    ("cvt.rmi.ftz.f32.f32 %f2, %f1;", "a flush-to-zero instruction"),
])
def test_the_ptx_check_names_each_problem(ptx, problem):
    assert any(problem in found for found in qgz_compile.ptx_problems(ptx))
    assert not qgz_compile.ptx_problems("div.rn.f32 %f3, %f1, %f2;\nmul.rn.f32 %f4, %f1, %f2;")


def test_a_grid_beyond_cudas_limits_is_refused():
    from deepspeed_qgz.qgz import quantized_fused
    if quantized_fused.triton is None:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match=r"grid \(2147483648,\) is beyond CUDA's limits"):
        quantized_fused._launch(quantized_fused._average_across_nodes_kernel, (2**31, ), (), {})

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""scripts/gpu_check.sh refuses at once where there is no CUDA (its GPU checks need a GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run the script itself")
def test_gpu_check_refuses_without_cuda(tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)],
                            env=dict(os.environ, PYTHON=sys.executable),
                            capture_output=True,
                            text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "CUDA is needed" in result.stderr
    assert not any(tmp_path.iterdir())


def test_gpu_check_script_logic_on_cpu(cpu_quantizer, tmp_path):
    """Every section the script can run without CUDA, with the CPU op and CPU tensors (proves
    nothing about the GPU; it keeps the GPU run from failing on the script)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT.with_suffix(".py")), "--dry-run-on-cpu", "--out",
         str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    rows = [line.split(" | ")[:3] for line in table.splitlines()[2:] if line.strip()]
    sections = {}
    for section, _, status in rows:
        sections.setdefault(section.strip("| "), []).append(status)
    # environment: versions, build, overlay; kernels: 3 kernels at 4 bits and 2 at 8 bits x 8 group
    # sizes (40960 only on a GPU), and the weights' quantize for the 6 of them the contract allows; the probe at 4 and 8 bits; glue: 3 dtypes x 2 precisions x (reference, kernels);
    # ranks: the collective in 3 dtypes x 2 precisions, training bf16 x
    # on/off; speed: 4 group sizes, one bucket in 2 dtypes x 2 precisions; fused: whether it can
    # run, 3 dtypes x 2 precisions x (against the reference, against the op), a call without a host
    # synchronization, GB/s at 2 precisions, one call in 2 dtypes; fused choice: "auto" in 3 dtypes
    # x 2 precisions
    assert {
        k: len(v)
        for k, v in sections.items()
    } == {
        "environment": 3,
        "kernels": 46,
        "sub-warp probe": 2,
        "glue": 12,
        "ranks": 8,
        "speed": 8,
        "fused": 18,
        "fused choice": 6
    }, table
    assert all(status in ("PASS", "INFO") for statuses in sections.values() for status in statuses), table
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["data"]["kernels"]["swizzle_quant/136"]["code_real"] == 0
    assert data["data"]["fused"]["bf16/8"]["counts"]["reference"]["stage 0"] == 0
    # each fused kernel's measured GB/s beside its roofline ceiling (a dry run models an H100)
    assert "% of H100's HBM" in data["data"]["fused"]["speed/8"]["roofline"]["stage 1"]
    # the self-check passes in the interpreter; which path "auto" takes there depends on times
    assert "the self-check gave the reference's bits" in data["data"]["fused choice"]["bf16/8"]["reason"]
    assert (tmp_path / "build.log").exists()

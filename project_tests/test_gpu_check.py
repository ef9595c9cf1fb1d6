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
    # sizes (40960 only on a GPU), and the weights' quantize for the 6 of them the contract allows;
    # the probe at 4 and 8 bits; triton: the same rows on the Triton op; ranks: the collective in 3
    # dtypes x 2 precisions x (DeepSpeed's op, the Triton op), training bf16 x on/off; speed: 4 group
    # sizes
    assert {
        k: len(v)
        for k, v in sections.items()
    } == {
        "environment": 3,
        "kernels": 46,
        "sub-warp probe": 2,
        "triton": 46,
        "ranks": 14,
        "speed": 4
    }, table
    assert all(status in ("PASS", "INFO") for statuses in sections.values() for status in statuses), table
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["data"]["kernels"]["swizzle_quant/136"]["code_real"] == 0
    # the Triton op rounds as the reference: not a last bit apart anywhere
    assert all(
        counts.get(key, 0) == 0 for name, counts in data["data"]["triton"].items() if name != "seconds"
        for key in ("scale_last_bit", "scale_real", "tie_flips", "code_real"))
    # each kernel's measured GB/s beside the Triton op's roofline ceiling (a dry run models an H100)
    assert "% of H100's HBM" in data["data"]["speed"]["kernels/136"]["Triton roofline"]["swizzle_quant"]
    assert (tmp_path / "build.log").exists()

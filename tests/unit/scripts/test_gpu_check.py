# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""scripts/gpu_check.sh refuses at once where there is no CUDA (its GPU checks need a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu_check.sh"


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
    """The script's own logic, with the CPU op standing in for the CUDA kernels (proves nothing
    about the GPU; it keeps the GPU run from failing on the script)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT.with_suffix(".py")), "--dry-run-on-cpu", "--out",
         str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    rows = [line for line in table.splitlines()[2:] if line.strip()]
    # build, overlay, 3 ops x 4 topologies x 2 shapes, the sequence in 3 dtypes, timing
    assert len(rows) == 2 + 3 * 4 * 2 + 3 + 1
    assert all("| PASS |" in row for row in rows), table

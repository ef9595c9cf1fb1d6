# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The bug report's reproduction: its train.py and ds config (bf16 for fp16) on three torchrun
agents x two processes on 127.0.0.1, with zero_quantized_gradients true and false."""

import importlib.util
import math
from pathlib import Path

RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "qgz_3x2" / "run.py"


def load_runner():
    spec = importlib.util.spec_from_file_location("qgz_3x2_run", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_training_3_nodes_x_2(cpu_quantizer):
    runner = load_runner()
    steps = 10
    qgz_losses, qgz, output = runner.run(runner.HERE / "ds_config_qgz.json", steps)
    exact_losses, exact, _ = runner.run(runner.HERE / "ds_config_exact.json", steps)

    assert "must match the size of tensor" not in output
    assert sorted(qgz_losses) == list(range(6))
    assert all(len(losses) == steps for losses in qgz_losses.values())
    assert all(math.isfinite(loss) for losses in qgz_losses.values() for loss in losses)
    # every gradient went through qgZ: no fallback, nothing left to the exact path
    on, off = qgz["qgz"], exact["qgz"]
    assert on["calls"] == steps and on["quantized_tensors"] == steps and on["exact_tensors"] == 0
    assert off["calls"] == 0 and off["reduce_scatter_calls"] == steps and off["exact_tensors"] == steps
    # int4 across nodes; this 32 x 32 model pays for padding (171 values per rank in 2 groups of 136)
    assert 0 < on["inter_node_bytes"] < 0.5 * off["inter_node_bytes"]
    for rank, losses in qgz_losses.items():
        for step, (loss, ref) in enumerate(zip(losses, exact_losses[rank])):
            assert abs(loss - ref) <= 0.02 * abs(ref), (rank, step, loss, ref)
    # zero_quantized_gradients_fused's default, "auto", decided once, on this CPU without
    # Triton's interpreter DeepSpeed's kernels, saying why; qgZ off decides nothing
    assert qgz["fused_choices"] == [
        'qgZ zero_quantized_gradients_fused "auto" (bfloat16, 4/4 bits, groups of 136, 3 x 2 ranks, on cpu): '
        "DeepSpeed's kernels (the fused kernels cannot run here: on CPU tensors the fused kernels run only in "
        "Triton's interpreter, for tests: TRITON_INTERPRET=1 must be set before "
        "deepspeed.runtime.comm.quantized_fused is first imported)"
    ]
    assert exact["fused_choices"] == []
    # quantization changed the gradients, a little
    assert 0 < runner.relative_difference(qgz["weights"], exact["weights"]) < 0.05

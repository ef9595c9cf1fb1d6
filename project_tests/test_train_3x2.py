# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The bug report's reproduction: its train.py and ds config (bf16 for fp16) on three torchrun
agents x two processes on 127.0.0.1, with zero_quantized_gradients true and then false in one job.
The main job's run on the Triton op (run.py --triton) is not repeated here: the same training on that
op, bit for bit against the CPU op's, is TestZeroPlusPlusRecipe's (package_tests/), and the seam's
choice of it by DS_QGZ_QUANTIZER=triton is test_qgz_quantizer_seam.py's."""

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
    configs = [runner.HERE / "ds_config_qgz.json", runner.HERE / "ds_config_exact.json"]
    [(qgz_losses, qgz), (exact_losses, exact)], output = runner.run(configs, steps)

    assert "must match the size of tensor" not in output
    assert sorted(qgz_losses) == list(range(6))
    assert all(len(losses) == steps for losses in qgz_losses.values())
    assert all(math.isfinite(loss) for losses in qgz_losses.values() for loss in losses)
    # every gradient went through qgZ's all-to-alls, none through the reduce-scatter (DeepSpeed's comms
    # logger, enabled in both configs): no fallback
    on, off = qgz["collectives"], exact["collectives"]
    assert on["all_to_all"]["calls"] > 0 and on["reduce_scatter"]["calls"] == 0
    assert off["reduce_scatter"]["calls"] == steps and off["all_to_all"]["calls"] == 0
    # int4 codes and their scales take fewer bytes than the bf16 reduce-scatter's, padding to whole
    # groups included
    assert 0 < on["all_to_all"]["bytes"] < off["reduce_scatter"]["bytes"]
    assert runner.within_tolerance(qgz_losses, exact_losses), (qgz_losses, exact_losses)
    assert runner.FALLBACK_WARNING not in output
    # quantization changed the gradients, a little
    assert 0 < runner.relative_difference(qgz["weights"], exact["weights"]) < 0.05
    assert qgz["quantizer"] == "quantizer_cpu"

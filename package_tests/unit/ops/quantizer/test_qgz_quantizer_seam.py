# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""This package's quantizer ops reach DeepSpeed's code through one seam, the quantizer op DeepSpeed
caches on first use (qgZ's coalesced_collectives.quantizer_module, qwZ's
CUDAQuantizer.quantizer_cuda_module): on the CPU accelerator its CPU op, with DS_QGZ_QUANTIZER=triton
its Triton op, each loaded when first used; DeepSpeed's own op registry is left as it is."""

import os
import subprocess
import sys
import tempfile

import pytest

from deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.skipif(get_accelerator().device_name() != "cpu", reason="the CPU accelerator's seam")

PROBE = """
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder import OpBuilder
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
qgz, qwz = coalesced_collectives.quantizer_module, CUDAQuantizer.quantizer_cuda_module
print("same", qgz is qwz)
print("loaded before use", sorted(name for name in OpBuilder._loaded_ops if name.startswith("quantizer")))
print("Symmetric", qgz.Symmetric == qwz.Symmetric)
print("loaded after use", sorted(name for name in OpBuilder._loaded_ops if name.startswith("quantizer")))
print("registry", type(get_accelerator().create_op_builder("QuantizerBuilder")).__name__)
"""


def run(code, quantizer=None, check=True):
    env = {key: value for key, value in os.environ.items() if key != "DS_QGZ_QUANTIZER"}
    if quantizer is not None:
        env["DS_QGZ_QUANTIZER"] = quantizer
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", code],
                                cwd=cwd,
                                env=env,
                                capture_output=True,
                                text=True,
                                timeout=600)
    if not check:
        return result
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout.splitlines()


@pytest.mark.parametrize("quantizer", [None, "deepspeed", " DeepSpeed "])
def test_qgz_and_qwz_take_the_cpu_op_on_first_use(quantizer):
    # a fresh interpreter: the caches are set when DeepSpeed's modules are first imported
    lines = run(PROBE, quantizer)
    assert "same True" in lines
    assert "loaded before use []" in lines
    assert "Symmetric True" in lines
    assert "loaded after use ['quantizer_cpu']" in lines
    assert "registry NotImplementedBuilder" in lines


TRITON_PROBE = """
from deepspeed.ops.op_builder import OpBuilder
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
qgz, qwz = coalesced_collectives.quantizer_module, CUDAQuantizer.quantizer_cuda_module
print("same", qgz is qwz)
print("Symmetric", qgz.Symmetric)
print("swizzle_quant from", qgz.swizzle_quant.__module__)
print("quantize from", qwz.quantize.__module__)
print("loaded ops", sorted(name for name in OpBuilder._loaded_ops if name.startswith("quantizer")))
"""


def test_ds_qgz_quantizer_triton_plugs_in_the_triton_op():
    lines = [line for line in run(TRITON_PROBE, "triton") if not line.startswith("[")]  # DeepSpeed's log lines
    assert lines == [
        "same True", "Symmetric 0", "swizzle_quant from deepspeed_qgz.triton_quantizer",
        "quantize from deepspeed_qgz.triton_quantizer", "loaded ops []"
    ]


def test_any_other_choice_is_refused_naming_it():
    result = run("import deepspeed.runtime.comm.coalesced_collectives", "trition", check=False)
    assert result.returncode != 0
    assert "DS_QGZ_QUANTIZER must be 'triton' or 'deepspeed' (or unset), got 'trition'" in result.stderr


def test_a_quantizer_set_before_first_use_is_kept():
    """A caller's quantizer (DeepSpeed's tests set NPUQuantizer) replaces the package's op, as it
    replaces DeepSpeed's."""
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
    from deepspeed_qgz._finder import plug_in_quantizer
    from unit.qgz_util import quantizer_caches
    with quantizer_caches(NPUQuantizer):
        plug_in_quantizer(coalesced_collectives, "quantizer_module")
        assert coalesced_collectives.quantizer_module is NPUQuantizer


def test_cpu_and_cuda_ops_never_share_a_cache_entry():
    """OpBuilder caches loaded ops by name across builder classes: the CPU op's own name keeps a
    process that loads both builders from mixing them."""
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.quantizer import QuantizerBuilder as CUDAQuantizerBuilder
    from deepspeed_qgz.cpu_quantizer import QuantizerBuilder, load
    assert CUDAQuantizerBuilder.NAME == "quantizer" != QuantizerBuilder.NAME
    first, second = QuantizerBuilder().load(), load()
    assert first is second is OpBuilder._loaded_ops["quantizer_cpu"]
    assert "quantizer" not in OpBuilder._loaded_ops

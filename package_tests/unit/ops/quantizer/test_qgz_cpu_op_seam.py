# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CPU quantizer op reaches DeepSpeed's code through one seam, the quantizer op DeepSpeed caches
on first use: on the CPU accelerator, qgZ's coalesced_collectives.quantizer_module and qwZ's
CUDAQuantizer.quantizer_cuda_module are this package's op, loaded when first used; DeepSpeed's own
op registry is left as it is."""

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


def run(code):
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout.splitlines()


def test_qgz_and_qwz_take_the_cpu_op_on_first_use():
    # a fresh interpreter: the caches are set when DeepSpeed's modules are first imported
    lines = run(PROBE)
    assert "same True" in lines
    assert "loaded before use []" in lines
    assert "Symmetric True" in lines
    assert "loaded after use ['quantizer_cpu']" in lines
    assert "registry NotImplementedBuilder" in lines


def test_a_quantizer_set_before_first_use_is_kept():
    """A caller's quantizer (DeepSpeed's tests set NPUQuantizer) replaces the package's op, as it
    replaces DeepSpeed's."""
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
    saved, coalesced_collectives.quantizer_module = coalesced_collectives.quantizer_module, NPUQuantizer
    try:
        from deepspeed_qgz._finder import plug_in_cpu_quantizer
        plug_in_cpu_quantizer(coalesced_collectives, "quantizer_module")
        assert coalesced_collectives.quantizer_module is NPUQuantizer
    finally:
        coalesced_collectives.quantizer_module = saved


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

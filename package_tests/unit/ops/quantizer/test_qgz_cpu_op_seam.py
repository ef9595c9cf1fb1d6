# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CPU quantizer is a first-class DeepSpeed op on the CPU accelerator: the registry hands it
out, __compatible_ops__ and ds_report list it."""

import importlib
import subprocess
import sys
import tempfile

import pytest

from deepspeed.accelerator import get_accelerator

pytestmark = pytest.mark.skipif(get_accelerator().device_name() != "cpu", reason="the CPU accelerator's registry")


def op_builder(module):
    """A module of the op builder package the accelerator uses: deepspeed.ops.op_builder where
    DeepSpeed is installed, the checkout's op_builder where DeepSpeed's conftest.py puts the checkout
    first on sys.path (the same files, imported under a second name)."""
    package = get_accelerator().op_builder_dir().rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.{module}")


def run(args):
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout


def test_registry_hands_out_the_cpu_quantizer():
    CPUQuantizerBuilder = op_builder("cpu.quantizer").QuantizerBuilder
    builder = get_accelerator().create_op_builder("QuantizerBuilder")
    assert type(builder) is CPUQuantizerBuilder and builder.name == "quantizer_cpu"
    from deepspeed.ops.op_builder import QuantizerBuilder
    assert QuantizerBuilder is CPUQuantizerBuilder


def test_compatible_ops_and_ds_report_list_it():
    # fresh interpreters: __compatible_ops__ is computed once per process
    out = run([
        sys.executable, "-c", "import deepspeed; from deepspeed.ops.op_builder import QuantizerBuilder; "
        "print(QuantizerBuilder.NAME, deepspeed.ops.__compatible_ops__[QuantizerBuilder.NAME])"
    ])
    assert out.strip().splitlines()[-1] == "quantizer_cpu True"
    report = run(["ds_report"])
    line = next(line for line in report.splitlines() if line.startswith("quantizer_cpu"))
    assert "OKAY" in line


def test_cpu_and_cuda_ops_never_share_a_cache_entry():
    """OpBuilder caches loaded ops by name across builder classes: the CPU op's own name keeps a
    process that loads both builders from mixing them."""
    OpBuilder, CUDAQuantizerBuilder = op_builder("builder").OpBuilder, op_builder("quantizer").QuantizerBuilder
    CPUQuantizerBuilder = op_builder("cpu.quantizer").QuantizerBuilder
    assert CUDAQuantizerBuilder.NAME == "quantizer" != CPUQuantizerBuilder.NAME
    first, second = CPUQuantizerBuilder().load(), get_accelerator().create_op_builder("QuantizerBuilder").load()
    assert first is second is OpBuilder._loaded_ops["quantizer_cpu"]
    assert "quantizer" not in OpBuilder._loaded_ops

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""This package's quantizer op for DeepSpeed's CPU accelerator, which has no QuantizerBuilder of its
own. It reaches DeepSpeed's code through one seam (_finder.plug_in_quantizer): the quantizer op
DeepSpeed caches on first use (qgZ's ``coalesced_collectives.quantizer_module``, qwZ's
``CUDAQuantizer.quantizer_cuda_module``), set on the CPU accelerator to this op, loaded (JIT-built the
first time, about 40 s) on first use. DeepSpeed's own tests plug a quantizer into qgZ the same way
(``coalesced_collectives.quantizer_module = NPUQuantizer``)."""

import platform
from pathlib import Path

from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

SOURCE = Path(__file__).resolve().parent / "csrc" / "quantizer.cpp"


class QuantizerBuilder(CPUOpBuilder):
    """The quantizer ops (quantize, swizzle_quant, quantized_reduction, dequantize, dequantize_fp32)
    for the CPU accelerator, numerically identical to the CUDA QuantizerBuilder's (which
    deepspeed_qgz/qgz/qgz_reference.py states in PyTorch). ZeRO-3's qgZ and qwZ call them as they
    call the CUDA op; the op itself checks its own bounds and the warp rule (this package's tests and
    benchmarks call it through deepspeed_qgz/qgz/qgz_contract.py's ContractCheckedQuantizer)."""
    BUILD_VAR = "DS_BUILD_QUANTIZER"
    # Distinct from the CUDA op's name: OpBuilder caches loaded ops by name across builder classes.
    NAME = "quantizer_cpu"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f'deepspeed_qgz.{self.NAME}_op'

    def sources(self):
        return [str(SOURCE)]

    def include_paths(self):
        return []

    def cxx_args(self):
        # This op's own flags, not CPUOpBuilder's: no debug information (half the build's time), no
        # SIMD define (the source tests the compiler's __AVX2__), and no CPU probe (CPUOpBuilder runs
        # py-cpuinfo twice, 2.4 s in every process that loads the op). The same on every DeepSpeed
        # release, so that one build serves every release's environment (scripts/release_env.sh):
        # DeepSpeed's loader adds -UC10_USE_GLOG to every op's flags from 0.17.2 on.
        from deepspeed import __version__
        from packaging.version import Version
        arch = "-mcpu=native" if platform.machine().startswith("ppc") else "-march=native"  # gcc on POWER
        args = ["-O3", "-Wno-reorder", arch, "-fopenmp"]
        return args if Version(__version__) >= Version("0.17.2") else args + ["-UC10_USE_GLOG"]


def builder():
    """The quantizer op's builder for this process's accelerator: this package's on the CPU
    accelerator, DeepSpeed's QuantizerBuilder elsewhere."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu":
        return QuantizerBuilder()
    return get_accelerator().create_op_builder("QuantizerBuilder")


def load():
    """The quantizer op of this process's accelerator (``builder()``'s), loaded."""
    return builder().load()

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team

import os
from pathlib import Path

from .builder import CPUOpBuilder


class QuantizerBuilder(CPUOpBuilder):
    """The qgZ quantizer ops (swizzle_quant, quantized_reduction, dequantize, dequantize_fp32) for
    the CPU accelerator, numerically identical to the CUDA QuantizerBuilder's (which
    deepspeed_qgz/qgz/qgz_reference.py states in PyTorch). ZeRO-3's qgZ and qwZ call them as
    they call the CUDA op; the op itself checks its own bounds and the warp rule (this package's
    pipeline calls it through deepspeed_qgz/qgz/qgz_contract.py's ContractCheckedQuantizer)."""
    BUILD_VAR = "DS_BUILD_QUANTIZER"
    # Distinct from the CUDA op's name: OpBuilder caches loaded ops by name across builder classes.
    NAME = "quantizer_cpu"

    def __init__(self, name=None):
        name = self.NAME if name is None else name
        super().__init__(name=name)

    def absolute_name(self):
        return f'deepspeed.ops.quantizer.{self.NAME}_op'

    def sources(self):
        return ['csrc/cpu/quantization/quantizer.cpp']

    def include_paths(self):
        return []

    def deepspeed_src_path(self, code_path):
        # csrc/ sits two levels above this file both in DeepSpeed's source tree (op_builder/cpu/)
        # and in an installed package (deepspeed/ops/op_builder/cpu/).
        if os.path.isabs(code_path):
            return code_path
        return os.path.join(Path(__file__).resolve().parents[2], code_path)

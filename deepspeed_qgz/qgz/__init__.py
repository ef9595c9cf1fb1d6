# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""This package's own quantized gradient reduce-scatter, which does not go upstream and which
training does not run: the fused Triton kernels (quantized_fused.py) and their specification, the
glue stages around DeepSpeed's quantizer kernels (quantized_pipeline.py, quantized_layout.py); the
start-up self-check that chooses between them (quantized_fused_choice.py); a simulated cluster that
runs them in one process (quantized_simulation.py); the quantizer kernels' contract
(qgz_contract.py) and a PyTorch statement of them (qgz_reference.py), the oracle of the CPU op's
tests. Training runs the pull-request series' all_to_all_quant_reduce (upstream/); the fused kernels
plug into it once they take the quantizer op's interface (swizzle_quant, quantized_reduction,
dequantize), the one seam the series' code has for a quantizer."""

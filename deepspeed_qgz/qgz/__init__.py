# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The quantizer kernels' contract (qgz_contract.py: their launch geometry, swizzle order and the
calls they define) and a pure-PyTorch statement of what they compute (qgz_reference.py), the oracle
of this package's CPU op and Triton op, of their tests, and of the Triton op's self-check."""

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Padding and grouping for ZeRO++'s quantized weights (qwZ: ``zero_quantized_weights``,
``zero_quantized_nontrainable_weights``): the int8 all-gather of ZeRO-3's parameter partitions.

ZeRO-3 keeps ``C = ceil(numel / world)`` elements of each parameter on every rank. The quantized
all-gather quantizes a rank's partitions of a bucket of parameters with one ``quantize``,
all-gathers the codes and their scales, and dequantizes the gathered bucket with one
``dequantize``. Those kernels want equal groups of a size their launch handles
(deepspeed/ops/quantizer/qgz_contract.py, ``quantize_violations``): a multiple of 8 values, at
most 16384, and above 128 values large enough for a whole warp of threads. A partition size
rarely meets that on 3, 5 or 7 nodes. So:

* One group size, ``WEIGHT_GROUP_SIZE``, for every partition of every parameter: partitions
  quantized when a parameter is partitioned (``zero_quantized_nontrainable_weights``) are gathered
  together with others, and one dequantize takes the whole gathered bucket.
* Each parameter's partition is padded with zeros to whole groups (``QuantizedWeightLayout``). No
  group holds two parameters' values, so each keeps its own scale (a norm's weights beside a
  linear layer's would otherwise set its step), and the padding exists only in the quantized
  codes: what ZeRO-3 keeps and hands on (partition sizes, gradients, checkpoints) is unchanged.
  A gathered bucket is ``world`` padded partitions, one per rank; ``gathered_partition`` narrows
  a parameter's rank partition out of it.
* The kernels read fp16: values are brought into fp16 range per group by a power of two (exact)
  and the factor is folded into the group's fp32 scale, so bf16 and fp32 weights keep their
  magnitude. Clamp-free: the kernel maps a group's largest magnitude to code 128 if it is positive
  and clamps it to 127 (the largest weight of the group would lose 1/128), but to -128 exactly if
  it is negative, so a group whose largest magnitude is positive is negated for the kernel and its
  scale negated back. A group's scale is 0 if it holds only zeros, NaN if it holds an inf or NaN.
"""

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Sequence, Tuple

import torch
from torch import Tensor

from deepspeed.ops.quantizer.qgz_contract import QUANTIZE_MAX_THREADS, VECTOR_ELEMS
from deepspeed.runtime.comm.quantized_pipeline import binary_exponent

WEIGHT_BITS = 8
# 2048 values: a block of 128 threads (4 warps) in one step of 16 values each.
WEIGHT_GROUP_SIZE = QUANTIZE_MAX_THREADS * VECTOR_ELEMS


@dataclass(frozen=True)
class QuantizedWeightLayout:
    """Where each parameter's partition sits in a rank's padded partition (see the module docstring)."""
    numels: Tuple[int, ...]  # each parameter's partition on a rank, in values
    group_elems: int = WEIGHT_GROUP_SIZE

    @cached_property
    def offsets(self) -> Tuple[int, ...]:
        offsets, offset = [], 0
        for numel in self.numels:
            offsets.append(offset)
            offset += -(-numel // self.group_elems) * self.group_elems
        return tuple(offsets)

    @property
    def num_groups(self) -> int:
        return sum(-(-numel // self.group_elems) for numel in self.numels)

    @property
    def padded_partition(self) -> int:
        return self.num_groups * self.group_elems

    def gathered_partition(self, gathered: Tensor, index: int, rank: int, length: int) -> Tensor:
        """Parameter `index`'s first `length` values of `rank`'s partition in `gathered`, every
        rank's padded partition one after the other (a 1-D view)."""
        if not (0 <= length <= self.numels[index]) or gathered.numel() < (rank + 1) * self.padded_partition:
            raise ValueError(f"gathered_partition: {length} values of parameter {index} (partition "
                             f"{self.numels[index]}) of rank {rank} do not lie in a gathered buffer of "
                             f"{gathered.numel()} values ({self.padded_partition} per rank)")
        return gathered.view(-1).narrow(0, rank * self.padded_partition + self.offsets[index], length)


@lru_cache(maxsize=1024)
def quantized_weight_layout(numels: Tuple[int, ...]) -> QuantizedWeightLayout:
    """The padded layout of a rank's partitions of `numels` values. Pure, and cached.

    Raises:
        ValueError: no partitions, or a negative size.
    """
    if not numels or any(n < 0 for n in numels):
        raise ValueError(f"quantized_weight_layout: expected partition sizes >= 0, got {numels}")
    return QuantizedWeightLayout(tuple(numels))


def quantize_weights(quantizer, partitions: Sequence[Tensor], layout: QuantizedWeightLayout) -> Tuple[Tensor, Tensor]:
    """This rank's `partitions` (one per parameter, any float dtypes, one device) as one padded
    partition of int8 codes ([padded_partition]) and its fp32 scales ([num_groups]), with one
    quantize kernel."""
    if tuple(p.numel() for p in partitions) != layout.numels:
        raise ValueError(f"quantize_weights: partitions of {[p.numel() for p in partitions]} values for a layout of "
                         f"{list(layout.numels)}")
    # new_* constructors: under zero.Init, torch.empty and torch.zeros return the model's dtype
    zeros = partitions[0].new_zeros(layout.group_elems, dtype=torch.float32)
    pieces = []
    for partition, offset, end in zip(partitions, layout.offsets, layout.offsets[1:] + (layout.padded_partition, )):
        pieces.append(partition.reshape(-1).float())
        if end - offset > partition.numel():
            pieces.append(zeros[:end - offset - partition.numel()])
    values = torch.cat(pieces).view(layout.num_groups, layout.group_elems)
    smallest, largest = torch.aminmax(values, dim=-1)
    absmax = torch.maximum(largest, -smallest)  # NaN if a group holds one
    sign = torch.where(largest > -smallest, -1.0, 1.0)
    exponent = binary_exponent(absmax)
    fp16 = values.new_empty(values.shape, dtype=torch.float16)
    torch.mul(values, (torch.pow(0.5, exponent) * sign).unsqueeze(-1), out=fp16)
    codes, scales = quantizer.quantize(fp16.view(-1), layout.num_groups, WEIGHT_BITS, quantizer.Symmetric)
    fold = torch.where(absmax < math.inf, (absmax > 0) * torch.pow(2.0, exponent) * sign, math.nan)
    return codes, (scales.view(-1) * fold)


def dequantize_weights(quantizer, codes: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """int8 `codes` of whole groups of WEIGHT_GROUP_SIZE and their fp32 `scales` (e.g. a gathered
    bucket) as values of `dtype`, with one dequantize kernel: each scale is split into a power of
    two and a mantissa, the kernel's fp16 output stays in range, and the power of two is applied
    in `dtype`."""
    num_groups = scales.numel()
    mantissa, exponent = torch.frexp(scales.reshape(-1).float())
    values = quantizer.dequantize(codes.reshape(-1), mantissa.view(-1, 1), num_groups, WEIGHT_BITS,
                                  quantizer.Symmetric)
    out = codes.new_empty(codes.numel(), dtype=dtype)  # not torch.empty: see quantize_weights
    torch.mul(values.view(num_groups, -1), torch.pow(2.0, exponent).unsqueeze(-1), out=out.view(num_groups, -1))
    return out

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
The stages of the quantized gradient reduce-scatter (ZeRO++ qgZ) for one rank.

``all_to_all_quant_reduce`` (coalesced_collectives.py) runs them around its two all-to-alls; a
simulated cluster (quantized_simulation.py) runs them for every rank in one process. Each stage
takes the call's layout (quantized_layout.py) and the quantizer op and runs one kernel per step for
all tensors of the call:

====================  ==============================  ===========================================
stage                 intra_node_bits = 4             intra_node_bits = 8
====================  ==============================  ===========================================
quantize_partitions   swizzle_quant, 4 bits           swizzle_quant, 8 bits
(intra-node all-to-all)
reduce_within_node    quantized_reduction, 4 bits     dequantize (8 bits), an exact sum, then
                                                      swizzle_quant, 4 bits
(inter-node all-to-all)
average_across_nodes  dequantize, 4 bits              dequantize, 4 bits
====================  ==============================  ===========================================

Numerics the stages share:

* The kernels read fp16. fp16 gradients go to them as they are; bf16 and fp32 groups are scaled
  by a power of two into fp16 range (exact), and the factor is folded into their fp32 scales.
  Scales are renormalized the same way wherever a kernel sums dequantized values in fp16.
* Every sum across ranks outside the kernels is exact (fp16 values summed in fp64), so a rank's
  result does not depend on the order a backend reduces in.
* A group's scale is 0 when it holds only zeros (the kernels store 1 there), so a rank or node
  without a contribution to a group does not weigh in the renormalizations; it is NaN when the
  group holds an inf or NaN, which the kernels would lose (a NaN quantizes to 0), so a
  non-finite gradient reaches its owner's partition.
* Quantization is clamp-free wherever the glue quantizes (stage 0, and the int4 requantization of
  the node sums with int8 inside the node): the kernels map a group's largest magnitude to the
  largest code plus one for a positive value (+8 at int4) and clamp it (to 7), but a negative one
  to the smallest code (-8) exactly, so a group whose largest magnitude is positive is negated for
  the kernel and its scale negated back. quantized_reduction requantizes with the kernel's formula.
"""

import math
from functools import lru_cache
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from deepspeed.ops.quantizer import qgz_contract as contract
from deepspeed.ops.quantizer.qgz_contract import to_slot_order
from deepspeed.runtime.comm.quantized_layout import (QuantizedReduceLayout, SlotFormat, quantized_reduce_layout)

# Powers of two are applied as fp32 factors, which must stay normal numbers.
_MAX_EXPONENT = 126


def chunk_cat(pieces: Sequence[Tensor], out: Tensor) -> None:
    """Copy-in for a reduce-scatter: row r of `out` ([world, row]) gets, for each 1-D piece in
    order, its elements [r * c, (r + 1) * c), c = ceil(numel / world), zero-padded to c. One
    torch._chunk_cat where torch has it (2.3 and newer); a copy per piece otherwise."""
    world = out.shape[0]
    if hasattr(torch, "_chunk_cat"):
        torch._chunk_cat(pieces, 0, world, out=out)
        return
    offset = 0
    for piece in pieces:
        chunk = math.ceil(piece.numel() / world)
        padded = torch.zeros(world * chunk, dtype=out.dtype, device=out.device)
        padded[:piece.numel()].copy_(piece)
        out[:, offset:offset + chunk].copy_(padded.view(world, chunk))
        offset += chunk


def binary_exponent(magnitude: Tensor) -> Tensor:
    """e with magnitude = m * 2**e, 0.5 <= m < 1 (e clamped to +-126), for non-negative
    magnitudes; 0 for zero, inf and NaN. Taken in fp32 whatever the magnitude's dtype (CUDA has
    no bf16 frexp before torch 2.5)."""
    finite = torch.nan_to_num(magnitude.float(), nan=0.0, posinf=0.0)
    return torch.frexp(finite).exponent.clamp_(-_MAX_EXPONENT, _MAX_EXPONENT)


def _summing_exponent(magnitudes: Tensor) -> Tensor:
    """For the scale magnitudes of `magnitudes.shape[0]` copies of each group: the exponent e that
    brings each scaled copy below 2**-h, 2**h >= 2 * copies, so any sum over the copies of values
    |code| * scale * 2**-e stays below half the largest code."""
    copies = magnitudes.shape[0]
    return binary_exponent(magnitudes.amax(dim=0)) + (2 * copies - 1).bit_length()


def _quantize_slots(values: Tensor,
                    fmt: SlotFormat,
                    num_nodes: int,
                    local_world_size: int,
                    quantizer,
                    exponent: Optional[Tensor] = None,
                    clamp_free: bool = False) -> Tensor:
    """One swizzle_quant of `values` ([P, slot_elems], P = num_nodes * local_world_size padded
    partitions in rank order, each followed by zeros for its scale groups) into [P, slot_bytes]
    int8 slots in the swizzle order, with each slot's scales written into its scale groups.

    Args:
        values: fp16 values go to the kernel as they are (scaled in place if clamp_free); bf16 is
            rewritten as fp16 in place; other dtypes are copied into an fp16 buffer.
        exponent: [P, groups_per_partition] powers of two the values were divided by (folded
            into the scales), or None.
        clamp_free: negate each group whose largest magnitude is positive for the kernel.
    """
    dtype = values.dtype
    smallest, largest = torch.aminmax(fmt.data_groups(values), dim=-1)
    absmax = torch.maximum(largest, -smallest)  # NaN if a group holds one
    factors, scale_exponent = None, exponent
    if dtype != torch.float16:
        own = binary_exponent(absmax)
        factors = torch.pow(0.5, own)
        scale_exponent = own if exponent is None else own + exponent
    sign = None
    if clamp_free:
        sign = torch.where(largest > -smallest, -1.0, 1.0)
        factors = sign if factors is None else factors * sign
    if factors is not None:
        # powers of two and signs, exact in the values' dtype (so the product is computed there)
        factors = torch.nn.functional.pad(factors, (0, fmt.scale_groups), value=1.0).to(dtype).unsqueeze(-1)
        if dtype == torch.float16:
            fp16 = values
        elif dtype == torch.bfloat16:
            fp16 = values.view(torch.float16)  # same width: rewritten element by element
        else:
            fp16 = torch.empty(values.shape, dtype=torch.float16, device=values.device)
        torch.mul(fmt.grouped(values), factors, out=fmt.grouped(fp16))
        values = fp16
    data, scales = quantizer.swizzle_quant(values.view(-1), values.shape[0] * fmt.slot_groups, fmt.bits,
                                           quantizer.Symmetric, 1, num_nodes, local_world_size)
    data = data.view(values.shape[0], fmt.slot_bytes)
    scales = scales.view(local_world_size, num_nodes, fmt.slot_groups)[..., :fmt.groups_per_partition]

    # per group: 0 for only zeros (the kernel stores 1), the folded powers of two and sign, NaN if non-finite
    fold = (absmax > 0).float()
    if scale_exponent is not None:
        fold = fold * torch.pow(2.0, scale_exponent)
    if sign is not None:
        fold = fold * sign
    fold = torch.where(absmax < math.inf, fold, math.nan)
    torch.mul(scales,
              to_slot_order(fold, num_nodes, local_world_size),
              out=fmt.scales(data).view(local_world_size, num_nodes, -1))
    return data


def quantize_partitions(tensors: List[Tensor], layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 0: quantize this rank's gradients for the intra-node exchange.

    Copies every tensor's partitions, and zeros for the padding and the scale groups, into one
    [world, slot_elems] buffer (one chunk_cat) and quantizes all of it, clamp-free, with one
    swizzle_quant at the layout's intra-node precision.

    Args:
        tensors: this rank's gradients (one dtype, one device), as laid out by `layout`.
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.

    Returns:
        [world, intra slot_bytes] int8 slots, in the kernels' swizzle order (qgz_contract.swizzle_slot).
    """
    fmt, world = layout.intra, layout.world_size
    dtype, device = tensors[0].dtype, tensors[0].device
    scale_elems = fmt.scale_groups * fmt.group_elems
    zeros = torch.zeros(world * max([scale_elems] + [layout.padding(i) for i in range(len(tensors))]),
                        dtype=dtype,
                        device=device)
    pieces = []
    for i, tensor in enumerate(tensors):
        pieces.append(tensor.reshape(-1))
        if layout.padding(i):
            pieces.append(zeros[:world * layout.padding(i)])
    pieces.append(zeros[:world * scale_elems])
    values = torch.empty(world, fmt.slot_elems, dtype=dtype, device=device)
    chunk_cat(pieces, values)
    del zeros, pieces
    return _quantize_slots(values, fmt, layout.num_nodes, layout.local_world_size, quantizer, clamp_free=True)


def reduce_within_node(received: Tensor, layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 1: sum the node's copies of this rank's partitions and quantize the sums to int4.

    The copies' scales are first brought below 2**-h (2**h >= 2 x local_world_size) by a power of
    two per (node, group), folded back into the output scales, so no sum of dequantized values
    overflows fp16. At 4 bits one quantized_reduction sums in fp16 and requantizes; its sums then
    stay below half the largest code, so the scale it stores is below 1 except for an all-zero
    group (1): that one is written as 0. At 8 bits one dequantize, an exact sum and one
    swizzle_quant (clamp-free) do the same with an int8 intra-node exchange. A group with a NaN or
    inf scale from any local rank gets a NaN scale.

    Args:
        received: [local_world_size * num_nodes, intra slot_bytes] int8, the intra-node
            exchange's result (from each local rank, in rank order, the slots of this rank's
            partition on every node).
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.

    Returns:
        [num_nodes, inter slot_bytes] int8 slots: the node sums of this rank's partitions, one per node.
    """
    num_nodes, local_world_size = layout.num_nodes, layout.local_world_size
    intra, inter = layout.intra, layout.inter
    slots = received.view(local_world_size, num_nodes, intra.slot_bytes)
    scales = intra.scales(slots)  # [D, N, groups per partition]
    exponent = _summing_exponent(scales.abs())  # [N, groups per partition]
    normalized = scales * torch.pow(0.5, exponent)
    if intra.bits == 8:
        values = quantizer.dequantize(slots.view(-1), intra.kernel_params(normalized),
                                      local_world_size * num_nodes * intra.slot_groups, intra.bits,
                                      quantizer.Symmetric)
        # each buffer is released as soon as the next one holds what is needed of it
        sums = intra.data_groups(values.view(local_world_size, num_nodes, -1)).sum(dim=0, dtype=torch.float64)
        del values
        node_sums = torch.zeros(num_nodes, inter.slot_elems, dtype=torch.float32, device=received.device)
        inter.data_groups(node_sums).copy_(sums)
        del sums
        return _quantize_slots(node_sums, inter, num_nodes, 1, quantizer, exponent=exponent, clamp_free=True)

    finite = (scales.abs() < math.inf).all(dim=0)
    out_groups = num_nodes * intra.slot_groups
    data, out_scales = quantizer.quantized_reduction(slots.view(-1),
                                                     intra.kernel_params(torch.where(finite, normalized, 0.0)),
                                                     local_world_size * out_groups, out_groups, intra.bits,
                                                     quantizer.Symmetric, local_world_size)
    data = data.view(num_nodes, inter.slot_bytes)
    out_scales = out_scales.view(num_nodes, inter.slot_groups)[:, :inter.groups_per_partition]
    fold = torch.where(out_scales < 1, torch.pow(2.0, exponent), 0.0)
    torch.mul(out_scales, torch.where(finite, fold, math.nan), out=inter.scales(data))
    return data


def average_across_nodes(received: Tensor, layout: QuantizedReduceLayout, quantizer, dtype: torch.dtype) -> Tensor:
    """Stage 2: dequantize the node sums of this rank's padded partition (one dequantize), add
    them (exactly) and divide by the world size.

    fp16: the scales are divided by the world size before dequantizing, so the kernel's fp16
    output is each node's share of the average and the sum of the shares is the result (an fp16
    average of fp16 gradients cannot overflow). bf16 and fp32, whose averages can leave fp16's
    range: the scales are brought near 1 by a common power of two per group, and the factor (over
    the world size) is applied to the node sum, straight into the result's dtype.

    Args:
        received: [num_nodes, inter slot_bytes] int8, the inter-node exchange's result (one node
            sum of this rank's padded partition from each node).
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.
        dtype: the gradients' dtype, the result's.

    Returns:
        [padded_partition] in `dtype`: this rank's padded partition of the average.
    """
    num_nodes, world, fmt = layout.num_nodes, layout.world_size, layout.inter
    slots = received.view(num_nodes, fmt.slot_bytes)
    scales = fmt.scales(slots)  # [N, groups per partition]
    if dtype == torch.float16:
        values = quantizer.dequantize(slots.view(-1), fmt.kernel_params(scales / world), num_nodes * fmt.slot_groups,
                                      fmt.bits, quantizer.Symmetric)
        shares = fmt.data_groups(values.view(num_nodes, -1)).sum(dim=0, dtype=torch.float64)
        return shares.view(-1).to(dtype)
    exponent = binary_exponent(torch.nan_to_num(scales.abs(), nan=0.0, posinf=0.0).amax(dim=0))  # of the finite scales
    values = quantizer.dequantize(slots.view(-1), fmt.kernel_params(scales * torch.pow(0.5, exponent)),
                                  num_nodes * fmt.slot_groups, fmt.bits, quantizer.Symmetric)
    node_sum = fmt.data_groups(values.view(num_nodes, -1)).sum(dim=0, dtype=torch.float64)  # [groups, group_elems]
    average = torch.empty(layout.padded_partition, dtype=dtype, device=received.device)
    torch.mul(node_sum, (torch.pow(2.0, exponent) / world).unsqueeze(-1), out=average.view(node_sum.shape))
    return average


def quantized_reduce_scatter(tensors: List[Tensor], layout: QuantizedReduceLayout, quantizer,
                             intra_node_exchange: Callable[[Tensor], Tensor],
                             inter_node_exchange: Callable[[Tensor], Tensor], rank: int) -> List[Tensor]:
    """The qgZ pipeline for one rank: stage 0, intra-node exchange, stage 1, inter-node exchange,
    stage 2. The exchanges are passed in (all-to-alls over the node's and the local rank's groups,
    or a simulated cluster's permutations).

    Returns:
        rank `rank`'s partition of each tensor's average, views of one buffer in the input dtype.
    """
    # no stage keeps the buffers of the stages before it
    received = intra_node_exchange(quantize_partitions(tensors, layout, quantizer))
    received = inter_node_exchange(reduce_within_node(received, layout, quantizer))
    average = average_across_nodes(received, layout, quantizer, tensors[0].dtype)
    return layout.partitions(average, rank)


def planned_kernel_calls(layout: QuantizedReduceLayout) -> List[Tuple[str, tuple]]:
    """(kernel, its size arguments as qgz_contract.call_violations takes them) for each quantizer
    kernel call the pipeline makes for `layout`, in order."""
    num_nodes, local_world_size, world = layout.num_nodes, layout.local_world_size, layout.world_size
    intra, inter, symmetric = layout.intra, layout.inter, contract.SYMMETRIC
    calls = [("swizzle_quant", (world * intra.slot_elems, world * intra.slot_groups, intra.bits, 1, num_nodes,
                                local_world_size))]
    if intra.bits == 8:
        calls += [("dequantize", (world * intra.slot_bytes, world * intra.slot_groups, world * intra.slot_groups,
                                  intra.bits, symmetric, 2)),
                  ("swizzle_quant", (num_nodes * inter.slot_elems, num_nodes * inter.slot_groups, inter.bits, 1,
                                     num_nodes, 1))]
    else:
        calls.append(
            ("quantized_reduction", (world * intra.slot_bytes, world * intra.slot_groups, world * intra.slot_groups,
                                     num_nodes * intra.slot_groups, intra.bits, symmetric, local_world_size)))
    calls.append(("dequantize", (num_nodes * inter.slot_bytes, num_nodes * inter.slot_groups,
                                 num_nodes * inter.slot_groups, inter.bits, symmetric, 2)))
    return calls


def _within_kernel_limits(layout: QuantizedReduceLayout) -> bool:
    return not any(contract.call_violations(kernel, args) for kernel, args in planned_kernel_calls(layout))


@lru_cache(maxsize=1024)
def quantized_reduce_plan(numels: Tuple[int, ...], num_nodes: int, local_world_size: int, group_size: int,
                          intra_node_bits: int) -> Tuple[Tuple[int, QuantizedReduceLayout], ...]:
    """The pipeline runs of one call: ((index of the first tensor, layout), ...), one run for all
    tensors unless its kernel calls would leave the kernels' int32 indexing; then runs of
    consecutive tensors, each as large as fits.

    Raises:
        ValueError: a single tensor is too large for the kernels' indexing at this world size, or
            an argument quantized_reduce_layout refuses.
    """

    def layout(start, stop):
        return quantized_reduce_layout(numels[start:stop], num_nodes, local_world_size, group_size, intra_node_bits)

    runs, start = [], 0
    while start < len(numels):
        if not _within_kernel_limits(layout(start, start + 1)):
            problems = [
                p for kernel, args in planned_kernel_calls(layout(start, start + 1))
                for p in contract.call_violations(kernel, args)
            ]
            raise ValueError(f"all_to_all_quant_reduce: a tensor of {numels[start]} elements is too large for the "
                             f"quantizer kernels on {num_nodes} x {local_world_size} ranks: " + "; ".join(problems))
        low, high = start + 1, len(numels)  # the longest run from `start` that fits
        while low < high:
            middle = (low + high + 1) // 2
            if _within_kernel_limits(layout(start, middle)):
                low = middle
            else:
                high = middle - 1
        runs.append((start, layout(start, low)))
        start = low
    return tuple(runs)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
The stages of this package's quantized gradient reduce-scatter (ZeRO++ qgZ) for one rank: the
specification of the fused kernels (quantized_fused.py). A simulated cluster
(quantized_simulation.py) runs them for every rank in one process; training does not (it runs the
pull-request series' ``all_to_all_quant_reduce`` on DeepSpeed's kernels). Each stage
takes the call's layout (quantized_layout.py) and the quantizer op and runs one kernel per step for
all tensors of the call (a dequantize per chunk where a large call is summed in chunks); each has a
fused twin (quantized_fused.py, ``fused=True``): one Triton launch doing the stage's kernels and
glue, with the same bits:

====================  ============================  ==========================================  ==========
stage                 intra_node_bits = 4           intra_node_bits = 8                         fused
====================  ============================  ==========================================  ==========
quantize_partitions   swizzle_quant, 4 bits         swizzle_quant, 8 bits                       one launch
(intra-node all-to-all)
reduce_within_node    quantized_reduction, 4 bits   dequantize (8 bits), an exact sum, then     one launch
                                                    swizzle_quant, 4 bits
(inter-node all-to-all)
average_across_nodes  dequantize, 4 bits            dequantize, 4 bits                          one launch
====================  ============================  ==========================================  ==========

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

The range contract: finite gradients never give NaN, and a result is finite wherever the exact
average is (it saturates at the dtype's largest value instead of rounding to inf). Every power of
two folded into a scale is applied to it in fp64 and the product rounded once to fp32, so a fold
beyond fp32's range cannot overflow on its own; the node sums' scales travel shifted
(``QuantizedReduceLayout.inter_scale_shift``) so they stay within fp32; the last conversion into
the result's dtype saturates.

Memory: wherever the glue dequantizes several copies of a group to sum them (stage 1 with int8
inside the node, stage 2), it works through the slots' groups in chunks (``sum_chunks``), so its
fp16 and fp64 temporaries stay a bounded share of the call; stage 1 writes each chunk's node sums
straight into the fp16 buffer its int4 quantization reads; values are rescaled in place and
converted to fp16 in place; each buffer is freed as soon as the next holds its data.
"""

import math
from functools import lru_cache, partial
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from deepspeed_qgz.qgz import qgz_contract as contract
from deepspeed_qgz.qgz.qgz_contract import to_slot_order
from deepspeed_qgz.qgz.quantized_layout import (QuantizedReduceLayout, SlotFormat, quantized_reduce_layout)

# Powers of two are applied as fp32 factors, which must stay normal numbers.
_MAX_EXPONENT = 126

# A stage that sums dequantized copies of groups (stage 1 with int8 inside the node, stage 2) works
# through them in chunks whose temporaries (sum_chunk_temporaries) stay below CHUNK_BUDGET bytes per
# gradient element of the call; a chunk holds at least CHUNK_VALUES values, so a small call is one.
CHUNK_BUDGET = 1.5
CHUNK_VALUES = 1 << 20


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


def power_of_two(exponent: Tensor) -> Tensor:
    """2**exponent as fp64, built from its bits (exact), for integer exponents in [-1022, 1023]."""
    return ((exponent.to(torch.int64) + 1023) << 52).view(torch.float64)


def saturate(values: Tensor) -> Tensor:
    """`values` (a result in its dtype) with every +-inf replaced by the dtype's largest finite
    value, in place; NaN stays NaN. The pipeline's results are computed in fp64 and rounded to the
    dtype, and only a finite value beyond its range rounds to inf: non-finite gradients travel as
    NaN scales, never as inf."""
    largest = torch.finfo(values.dtype).max
    return values.clamp_(-largest, largest)


def summing_bits(copies: int) -> int:
    """h, the smallest with 2**h >= 2 * copies (see _summing_exponent)."""
    return (2 * copies - 1).bit_length()


def _summing_exponent(magnitudes: Tensor) -> Tensor:
    """For the scale magnitudes of `magnitudes.shape[0]` copies of each group: the exponent e that
    brings each scaled copy below 2**-h (summing_bits), so any sum over the copies of values
    |code| * scale * 2**-e stays below half the largest code."""
    return binary_exponent(magnitudes.amax(dim=0)) + summing_bits(magnitudes.shape[0])


def _prepare_groups(groups: Tensor, out: Tensor, clamp_free: bool = False):
    """Writes `groups` ([..., group_elems] values) into `out` (the same shape in fp16) as the
    kernels are to quantize them. Returns each group's (absmax (fp32, NaN if it holds a NaN),
    binary exponent (None for fp16 values), sign (+-1.0, None unless clamp_free)), for _fold.

    fp16 values are taken as they are; bf16, fp32 and fp64 groups are divided by the power of two
    that brings their largest magnitude into [0.5, 1) (exact). With `clamp_free` a group whose
    largest magnitude is positive is negated.

    fp16, bf16 and fp32 groups are rescaled in place and then converted into `out`, which may be
    the same memory (written element by element), so no temporary of their size is made. fp64
    groups (stage 1's exact sums) stand for their fp32 roundings: the statistics are the rounded
    values', and rounding the rescaled value through fp32, as the conversion to fp16 does, gives
    the same as rounding first (a power of two commutes with rounding).
    """
    smallest, largest = torch.aminmax(groups, dim=-1)
    if groups.dtype == torch.float64:
        smallest, largest = smallest.float(), largest.float()
    negated = -smallest
    absmax = torch.maximum(largest, negated)  # NaN if a group holds one
    own = factors = sign = None
    if groups.dtype != torch.float16:
        own = binary_exponent(absmax)
        factors = torch.pow(0.5, own)
    if clamp_free:
        sign = torch.where(largest > negated, -1.0, 1.0)
        factors = sign if factors is None else factors * sign
    if factors is not None and groups.dtype == torch.float64:
        torch.mul(groups, factors.unsqueeze(-1), out=out)
    else:
        if factors is not None:
            # powers of two and signs: exact in the values' dtype (a product leaving its normal
            # range is rounded as it would be when computed in that dtype)
            groups.mul_(factors.to(groups.dtype).unsqueeze(-1))
        if out.data_ptr() != groups.data_ptr() or out.dtype != groups.dtype:
            out.copy_(groups)
    return absmax, own, sign


def _fold(absmax: Tensor, exponent: Optional[Tensor], sign: Optional[Tensor]) -> Tensor:
    """Each group's fold (fp64): what its kernel parameter is multiplied by to give its scale,
    2**exponent x sign (the powers of two and the sign its values were multiplied by, undone); 0
    for a group of zeros, NaN for a group holding an inf or NaN (absmax inf or NaN)."""
    fold = torch.ones_like(absmax, dtype=torch.float64) if sign is None else sign.double()
    if exponent is not None:
        fold = fold * power_of_two(exponent)
    return torch.where(absmax < math.inf, torch.where(absmax > 0, fold, 0.0), math.nan)


def _store_scales(data: Tensor, params: Tensor, fold: Tensor, fmt: SlotFormat, num_nodes: int,
                  local_world_size: int) -> None:
    """Writes each slot's scales into its scale groups: the kernel's parameters ([P * slot_groups,
    1] in slot order, from a swizzle_quant of P = num_nodes * local_world_size padded partitions)
    times the folds ([P, groups_per_partition] in partition order), rounded once to fp32."""
    params = params.view(local_world_size, num_nodes, fmt.slot_groups)[..., :fmt.groups_per_partition]
    torch.mul(params,
              to_slot_order(fold, num_nodes, local_world_size),
              out=fmt.scales(data).view(local_world_size, num_nodes, -1))


def quantize_partitions(tensors: List[Tensor], layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 0: quantize this rank's gradients for the intra-node exchange.

    Copies every tensor's partitions, and zeros for the padding and the scale groups, into one
    [world, slot_elems] buffer (one chunk_cat) and quantizes all of it, clamp-free, with one
    swizzle_quant at the layout's intra-node precision. fp16 is quantized in that buffer, bf16
    rewritten there as fp16 in place, fp32 copied into an fp16 buffer.

    Args:
        tensors: this rank's gradients (one dtype, one device), as laid out by `layout`.
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.

    Returns:
        [world, intra slot_bytes] int8 slots, in the kernels' swizzle order (qgz_contract.swizzle_slot).
    """
    fmt, world = layout.intra, layout.world_size
    num_nodes, local_world_size = layout.num_nodes, layout.local_world_size
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
    if dtype == torch.float16:
        fp16 = values
    elif dtype == torch.bfloat16:
        fp16 = values.view(torch.float16)  # same width: rewritten element by element
    else:
        fp16 = torch.empty(values.shape, dtype=torch.float16, device=device)
        fmt.grouped(fp16)[..., fmt.groups_per_partition:, :].zero_()  # the scale groups
    absmax, own, sign = _prepare_groups(fmt.data_groups(values), fmt.data_groups(fp16), clamp_free=True)
    fold = _fold(absmax, own, sign)
    del values
    data, params = quantizer.swizzle_quant(fp16.view(-1), world * fmt.slot_groups, fmt.bits, quantizer.Symmetric, 1,
                                           num_nodes, local_world_size)
    del fp16
    data = data.view(world, fmt.slot_bytes)
    _store_scales(data, params, fold, fmt, num_nodes, local_world_size)
    return data


def sum_chunk_temporaries(fmt: SlotFormat, summed: int) -> float:
    """Bytes of temporaries per value of a chunk of `fmt` slots whose copies are summed `summed` at a
    time: the codes copied out of the received buffer, their fp16 values, the fp64 copy of those the
    sum makes, and per sum the fp64 sum and the fp64 product the result is computed in."""
    return fmt.bits / 8 + 2 + 8 + 16 / summed


def sum_chunks(fmt: SlotFormat, copies: int, summed: int, elements: int) -> Tuple[Tuple[int, int], ...]:
    """The ranges [first, stop) of a slot's groups that a stage dequantizes and sums at once from
    `copies` slots of `fmt`, `summed` at a time, in a call of `elements` gradient elements per rank.
    One chunk when the temporaries of the whole stay within CHUNK_BUDGET bytes per element or the
    copies hold at most CHUNK_VALUES values: every group of the slot, scale groups included (their
    parameters are 0, so they dequantize to zeros), which is the whole received buffer, read as it
    is. Otherwise the groups of the padded partition in as few chunks as keep within the budget,
    each of at least CHUNK_VALUES values and copied out of the received buffer first."""
    values, per_value = copies * fmt.slot_elems, sum_chunk_temporaries(fmt, summed)
    if values <= CHUNK_VALUES or values * per_value <= CHUNK_BUDGET * elements:
        return ((0, fmt.slot_groups), )
    per_group = copies * fmt.group_elems  # values of one group of every copy
    per_chunk = max(int(CHUNK_BUDGET * elements // (per_group * per_value)), -(-CHUNK_VALUES // per_group))
    groups = fmt.groups_per_partition
    return tuple((first, min(first + per_chunk, groups)) for first in range(0, groups, per_chunk))


def layout_sum_chunks(layout: QuantizedReduceLayout, stage: int) -> Tuple[Tuple[int, int], ...]:
    """sum_chunks of stage 1 (the node's copies, int8 inside the node) or stage 2 (the nodes' sums)."""
    elements = layout.world_size * layout.padded_partition
    if stage == 1:
        return sum_chunks(layout.intra, layout.world_size, layout.local_world_size, elements)
    return sum_chunks(layout.inter, layout.num_nodes, layout.num_nodes, elements)


def _summed_chunks(slots: Tensor, params: Tensor, fmt: SlotFormat, chunks, quantizer):
    """For each of `chunks` (layout_sum_chunks): (first, stop, the exact fp64 sums over the copies
    of the chunk's data groups, [..., stop - first, group_elems]). `slots` is [copies, ...,
    slot_bytes] int8 and `params` its kernel parameters, [copies, ..., slot_groups]; one dequantize
    per chunk."""
    copies = slots.shape[:-1].numel()
    for first, stop in chunks:
        # flat, as every quantizer takes its data (qgz_contract): the whole buffer as it is for one
        # chunk, a copy of the chunk's groups for several
        values = quantizer.dequantize(slots[..., first * fmt.group_bytes:stop * fmt.group_bytes].reshape(-1),
                                      params[..., first:stop].reshape(-1, 1), copies * (stop - first), fmt.bits,
                                      quantizer.Symmetric)
        data_stop = min(stop, fmt.groups_per_partition)  # the scale groups' zeros are not summed
        values = values.view(*slots.shape[:-1], stop - first, fmt.group_elems)[..., :data_stop - first, :]
        sums = values.sum(dim=0, dtype=torch.float64)  # exact
        del values
        yield first, data_stop, sums


def reduce_within_node(received: Tensor, layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 1: sum the node's copies of this rank's partitions and quantize the sums to int4.

    The copies' scales are first brought below 2**-h (2**h >= 2 x local_world_size) by a power of
    two per (node, group), folded back into the output scales, so no sum of dequantized values
    overflows fp16. At 4 bits one quantized_reduction sums in fp16 and requantizes; its sums then
    stay below half the largest code, so the scale it stores is below 1 except for an all-zero
    group (1): that one is written as 0. At 8 bits a dequantize and an exact sum per chunk of groups
    (sum_chunks), each chunk's sums rescaled straight into one fp16 buffer, and one swizzle_quant of
    it (clamp-free) do the same with an int8 intra-node exchange. A group with a NaN or inf scale
    from any local rank gets a NaN scale. The output scales are shifted by the layout's
    inter_scale_shift.

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
    shifted = exponent - layout.inter_scale_shift
    if intra.bits == 8:
        params = intra.kernel_params(normalized).view(local_world_size, num_nodes, intra.slot_groups)
        node_values = torch.empty(num_nodes, inter.slot_elems, dtype=torch.float16, device=received.device)
        inter.grouped(node_values)[:, inter.groups_per_partition:, :].zero_()  # the scale groups
        statistics = torch.empty(3, num_nodes, inter.groups_per_partition, device=received.device)
        for first, stop, sums in _summed_chunks(slots, params, intra, layout_sum_chunks(layout, 1), quantizer):
            absmax, own, sign = _prepare_groups(sums, inter.grouped(node_values)[:, first:stop], clamp_free=True)
            sign = torch.ones_like(absmax) if sign is None else sign  # (a study of the kernels' clamp passes None)
            torch.stack((absmax, own, sign), out=statistics[:, :, first:stop])
            del sums
        absmax, own, sign = statistics
        fold = _fold(absmax, own.int() + shifted, sign)
        data, out_params = quantizer.swizzle_quant(node_values.view(-1), num_nodes * inter.slot_groups, inter.bits,
                                                   quantizer.Symmetric, 1, num_nodes, 1)
        del node_values
        data = data.view(num_nodes, inter.slot_bytes)
        _store_scales(data, out_params, fold, inter, num_nodes, 1)
        return data

    finite = (scales.abs() < math.inf).all(dim=0)
    out_groups = num_nodes * intra.slot_groups
    data, out_params = quantizer.quantized_reduction(slots.view(-1),
                                                     intra.kernel_params(torch.where(finite, normalized, 0.0)),
                                                     local_world_size * out_groups, out_groups, intra.bits,
                                                     quantizer.Symmetric, local_world_size)
    data = data.view(num_nodes, inter.slot_bytes)
    out_params = out_params.view(num_nodes, inter.slot_groups)[:, :inter.groups_per_partition]
    fold = torch.where(out_params < 1, power_of_two(shifted), 0.0)
    torch.mul(out_params, torch.where(finite, fold, math.nan), out=inter.scales(data))
    return data


def average_across_nodes(received: Tensor, layout: QuantizedReduceLayout, quantizer, dtype: torch.dtype) -> Tensor:
    """Stage 2: dequantize the node sums of this rank's padded partition, add them (exactly) and
    divide by the world size; a dequantize and an exact sum per chunk of groups (sum_chunks).

    fp16: the scales are divided by the world size before dequantizing, so the kernel's fp16
    output is each node's share of the average and the sum of the shares is the result (an fp16
    average of fp16 gradients cannot overflow). bf16 and fp32, whose averages can leave fp16's
    range: the scales are brought near 1 by a common power of two per group, and the factor (over
    the world size) is applied to the node sum, straight into the result's dtype. Either way the
    result saturates at the dtype's largest value.

    Args:
        received: [num_nodes, inter slot_bytes] int8, the inter-node exchange's result (one node
            sum of this rank's padded partition from each node).
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.
        dtype: the gradients' dtype, the result's.

    Returns:
        [padded_partition] in `dtype`: this rank's padded partition of the average.
    """
    num_nodes, world, fmt, shift = layout.num_nodes, layout.world_size, layout.inter, layout.inter_scale_shift
    slots = received.view(num_nodes, fmt.slot_bytes)
    scales = fmt.scales(slots)  # [N, groups per partition]
    average = torch.empty(fmt.groups_per_partition, fmt.group_elems, dtype=dtype, device=received.device)
    if dtype == torch.float16:
        shares = scales / world
        if shift:
            shares *= 2**shift
        params = fmt.kernel_params(shares).view(num_nodes, fmt.slot_groups)
        for first, stop, sums in _summed_chunks(slots, params, fmt, layout_sum_chunks(layout, 2), quantizer):
            average[first:stop].copy_(sums)
            del sums
        return saturate(average.view(-1))
    exponent = binary_exponent(torch.nan_to_num(scales.abs(), nan=0.0, posinf=0.0).amax(dim=0))  # of the finite scales
    params = fmt.kernel_params(scales * torch.pow(0.5, exponent)).view(num_nodes, fmt.slot_groups)
    factor = torch.pow(2.0, exponent) / world
    if shift:
        factor = factor.double() * 2**shift
    factor = factor.unsqueeze(-1)
    for first, stop, sums in _summed_chunks(slots, params, fmt, layout_sum_chunks(layout, 2), quantizer):
        torch.mul(sums, factor[first:stop], out=average[first:stop])
        del sums
    return saturate(average.view(-1))


class QuantizedStages(NamedTuple):
    """The three stages as callables: quantize_partitions(tensors, layout) -> intra slots,
    reduce_within_node(received, layout) -> inter slots, average_across_nodes(received, layout,
    dtype=...) -> the padded partition of the average."""
    quantize_partitions: Callable
    reduce_within_node: Callable
    average_across_nodes: Callable


def pipeline_stages(quantizer, fused: bool = False) -> QuantizedStages:
    """The stages on `quantizer` (the quantizer op module) with the glue of this module, or with
    `fused` True the fused Triton kernels of quantized_fused.py (same bits; `quantizer` is not used)."""
    if fused is True:
        from deepspeed_qgz.qgz import quantized_fused
        return QuantizedStages(quantized_fused.quantize_partitions, quantized_fused.reduce_within_node,
                               quantized_fused.average_across_nodes)
    return QuantizedStages(partial(quantize_partitions, quantizer=quantizer),
                           partial(reduce_within_node, quantizer=quantizer),
                           partial(average_across_nodes, quantizer=quantizer))


def quantized_reduce_scatter(tensors: List[Tensor], layout: QuantizedReduceLayout, stages: QuantizedStages,
                             intra_node_exchange: Callable[[Tensor], Tensor],
                             inter_node_exchange: Callable[[Tensor], Tensor], rank: int) -> List[Tensor]:
    """The qgZ pipeline for one rank: stage 0, intra-node exchange, stage 1, inter-node exchange,
    stage 2. The stages (pipeline_stages) and the exchanges (all-to-alls over the node's and the
    local rank's groups, or a simulated cluster's permutations) are passed in.

    Returns:
        rank `rank`'s partition of each tensor's average, views of one buffer in the input dtype.
    """
    # no stage keeps the buffers of the stages before it
    received = intra_node_exchange(stages.quantize_partitions(tensors, layout))
    received = inter_node_exchange(stages.reduce_within_node(received, layout))
    average = stages.average_across_nodes(received, layout, dtype=tensors[0].dtype)
    return layout.partitions(average, rank)


def planned_kernel_calls(layout: QuantizedReduceLayout) -> List[Tuple[str, tuple]]:
    """(kernel, its size arguments as qgz_contract.call_violations takes them) for each quantizer
    kernel call the pipeline makes for `layout`, in order."""
    num_nodes, local_world_size, world = layout.num_nodes, layout.local_world_size, layout.world_size
    intra, inter, symmetric = layout.intra, layout.inter, contract.SYMMETRIC
    calls = [("swizzle_quant", (world * intra.slot_elems, world * intra.slot_groups, intra.bits, 1, num_nodes,
                                local_world_size))]
    if intra.bits == 8:
        for first, stop in layout_sum_chunks(layout, 1):
            groups = world * (stop - first)
            calls.append(("dequantize", (groups * intra.group_bytes, groups, groups, intra.bits, symmetric, 2)))
        calls.append(("swizzle_quant", (num_nodes * inter.slot_elems, num_nodes * inter.slot_groups, inter.bits, 1,
                                        num_nodes, 1)))
    else:
        calls.append(
            ("quantized_reduction", (world * intra.slot_bytes, world * intra.slot_groups, world * intra.slot_groups,
                                     num_nodes * intra.slot_groups, intra.bits, symmetric, local_world_size)))
    for first, stop in layout_sum_chunks(layout, 2):
        groups = num_nodes * (stop - first)
        calls.append(("dequantize", (groups * inter.group_bytes, groups, groups, inter.bits, symmetric, 2)))
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

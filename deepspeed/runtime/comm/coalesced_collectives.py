# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
batched collective operations for overhead amortization and better
bandwidth utilization
"""

import logging
import math
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor
from deepspeed import comm as dist
from deepspeed.comm import ProcessGroup, all_to_all_single
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import instrument_w_nvtx
from deepspeed.ops import op_builder
from deepspeed.ops.quantizer.qgz_contract import ContractCheckedQuantizer, to_slot_order
from deepspeed.utils import logger
from deepspeed.runtime.comm.quantized_layout import (QUANT_BITS, QuantizedReduceLayout, quantized_reduce_layout,
                                                     resolve_group_size)


def _torch_reduce_scatter_fn(input_tensor: Tensor, output_tensor: Tensor, group=None, async_op=False, prof=False):
    return instrument_w_nvtx(dist.reduce_scatter_fn)(output_tensor, input_tensor, group=group, async_op=False)


# The loaded quantizer op, cached on first use. A caller may set it (DeepSpeed's own tests set the
# pure-PyTorch NPUQuantizer); whatever is set here is what all_to_all_quant_reduce uses.
quantizer_module = None

# The kernels read fp16. Gradients in these dtypes are brought into fp16 range group by group
# (by powers of two, which are exact), so bf16 and fp32 magnitudes survive the conversion.
QUANTIZABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _get_quantizer_module():
    """DeepSpeed's QuantizerBuilder op for this accelerator (CUDA, or the CPU op on the CPU
    accelerator) behind the kernel-contract checks, loaded once."""
    global quantizer_module
    if quantizer_module is None:
        quantizer_module = ContractCheckedQuantizer(op_builder.QuantizerBuilder().load())
    return quantizer_module


@dataclass
class QuantizedReduceStats:
    """What all_to_all_quant_reduce did: per call in ``last_call``, summed over calls in ``totals``."""
    calls: int = 0
    quantized_tensors: int = 0
    quantized_elems: int = 0
    padding_elems: int = 0
    exact_tensors: int = 0
    exact_elems: int = 0
    collective_calls: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0

    def add(self, other: "QuantizedReduceStats") -> None:
        for field in fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


class _QuantizedReduceAccounting:

    def __init__(self):
        self.last_call = QuantizedReduceStats()
        self.totals = QuantizedReduceStats()

    def reset(self):
        self.__init__()


qgz_accounting = _QuantizedReduceAccounting()


def _check_tensors(tensors: List[Tensor], op: str) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{op}: all tensors must share a dtype, got {sorted(map(str, dtypes))}")


def _chunk_cat(pieces: Sequence[Tensor], out: Tensor) -> None:
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


# ---------------------------------------------------------------------------------------------
# qgZ: the three stages of all_to_all_quant_reduce. Each takes the quantizer op and the call's
# layout, runs one quantizer kernel for the whole call, and returns what the next exchange sends.
# ---------------------------------------------------------------------------------------------

# Powers of two are applied as fp32 factors, which must stay normal numbers.
_MAX_EXPONENT = 126


def _exponent(magnitude: Tensor) -> Tensor:
    """e with magnitude = m * 2**e, 0.5 <= m < 1 (e clamped to +-126), for non-negative
    magnitudes; 0 for zero, inf and NaN."""
    finite = torch.nan_to_num(magnitude, nan=0.0, posinf=0.0)
    return torch.frexp(finite).exponent.clamp_(-_MAX_EXPONENT, _MAX_EXPONENT)


def _kernel_params(scales: Tensor, layout: QuantizedReduceLayout) -> Tensor:
    """Per-group kernel parameters for whole slots: `scales` ([..., groups_per_partition]) then 0
    for each scale group, so the scale groups dequantize to zeros. Contiguous, [-1, 1]."""
    return torch.nn.functional.pad(scales, (0, layout.scale_groups)).view(-1, 1)


def quantize_partitions(tensors: List[Tensor], layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 0: quantize this rank's gradients for the intra-node exchange.

    Copies every tensor's partitions, and zeros for the scale groups, into one [world, slot_elems]
    buffer (one _chunk_cat), quantizes all of it with one swizzle_quant and writes each slot's
    scales into its scale groups. fp16 goes to the kernel as it is; bf16 and fp32 groups are first
    scaled by a power of two into fp16 range (the factor is folded back into their fp32 scales). A
    group holding an inf or NaN gets a NaN scale: the kernels would quantize a NaN to 0 and lose it.

    Args:
        tensors: this rank's gradients (one dtype, one device), as laid out by `layout`.
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.

    Returns:
        [world, slot_bytes] int8 slots, in the kernels' swizzle order (qgz_contract.swizzle_slot).
    """
    num_nodes, local_world_size, world = layout.num_nodes, layout.local_world_size, layout.world_size
    dtype, device = tensors[0].dtype, tensors[0].device
    scale_elems = layout.scale_groups * layout.group_elems
    zeros = torch.zeros(world * max([scale_elems] + [layout.padding(i) for i in range(len(tensors))]),
                        dtype=dtype,
                        device=device)
    pieces = []
    for i, tensor in enumerate(tensors):
        pieces.append(tensor.reshape(-1))
        if layout.padding(i):
            pieces.append(zeros[:world * layout.padding(i)])
    pieces.append(zeros[:world * scale_elems])
    slots = torch.empty(world, layout.slot_elems, dtype=dtype, device=device)
    _chunk_cat(pieces, slots)
    del zeros, pieces

    absmax = torch.linalg.vector_norm(layout.data_groups(slots), math.inf, dim=-1)  # NaN if a group holds one
    exponent = None
    if dtype != torch.float16:
        exponent = _exponent(absmax)
        # powers of two, exact in the gradients' dtype (so the product is computed in that dtype)
        factors = torch.nn.functional.pad(torch.pow(0.5, exponent), (0, layout.scale_groups), value=1.0).to(dtype)
        # bf16 is rewritten as fp16 in place (same width, element by element); fp32 needs a buffer
        fp16 = (slots.view(torch.float16)
                if slots.element_size() == 2 else torch.empty(slots.shape, dtype=torch.float16, device=device))
        torch.mul(layout.grouped(slots), factors.unsqueeze(-1), out=layout.grouped(fp16))
        slots = fp16
    data, scales = quantizer.swizzle_quant(slots.view(-1), world * layout.slot_groups, QUANT_BITS, quantizer.Symmetric,
                                           1, num_nodes, local_world_size)
    del slots

    data = data.view(world, layout.slot_bytes)
    scales = scales.view(local_world_size, num_nodes, layout.slot_groups)[..., :layout.groups_per_partition]
    if exponent is not None:
        scales = scales * torch.pow(2.0, to_slot_order(exponent, num_nodes, local_world_size))
    finite = to_slot_order(absmax < math.inf, num_nodes, local_world_size)
    layout.slot_scales(data).view(local_world_size, num_nodes, -1).copy_(torch.where(finite, scales, math.nan))
    return data


def reduce_within_node(received: Tensor, layout: QuantizedReduceLayout, quantizer) -> Tensor:
    """Stage 1: sum the node's copies of this rank's partitions with one quantized_reduction.

    quantized_reduction sums the local ranks' dequantized values in fp16, so each (node, group)'s
    scale magnitudes are first brought to a sum in [0.5, 1) by a power of two (exact), which no sum
    of local_world_size dequantized int4 values can overflow; the factor is folded back into the
    output scales. A group with a NaN scale from any local rank stays NaN. (Scales are taken by
    magnitude throughout: a group may travel negated, with a negative scale.)

    Args:
        received: [local_world_size * num_nodes, slot_bytes] int8, the intra-node exchange's result
            (from each local rank, in rank order, the slots of this rank's partition on every node).
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.

    Returns:
        [num_nodes, slot_bytes] int8 slots: the node sums of this rank's partitions, one per node.
    """
    num_nodes, local_world_size = layout.num_nodes, layout.local_world_size
    slots = received.view(local_world_size, num_nodes, layout.slot_bytes)
    scales = layout.slot_scales(slots)  # [D, N, groups per partition]
    finite = (scales.abs() < math.inf).all(dim=0)
    exponent = _exponent(scales.abs().sum(dim=0))
    normalized = torch.where(finite, scales * torch.pow(0.5, exponent), 1.0)
    out_groups = num_nodes * layout.slot_groups
    data, out_scales = quantizer.quantized_reduction(slots.view(-1), _kernel_params(normalized, layout),
                                                     local_world_size * out_groups, out_groups, QUANT_BITS,
                                                     quantizer.Symmetric, local_world_size)
    data = data.view(num_nodes, layout.slot_bytes)
    out_scales = out_scales.view(num_nodes, layout.slot_groups)[:, :layout.groups_per_partition]
    layout.slot_scales(data).copy_(torch.where(finite, out_scales * torch.pow(2.0, exponent), math.nan))
    return data


def average_across_nodes(received: Tensor, layout: QuantizedReduceLayout, quantizer, dtype: torch.dtype) -> Tensor:
    """Stage 2: dequantize the node sums of this rank's padded partition (one dequantize), add
    them and divide by the world size.

    fp16: the scales are divided by the world size before dequantizing, so the kernel's fp16
    output is each node's share of the average and one sum gives the result (an fp16 average of
    fp16 gradients cannot overflow). bf16 and fp32, whose averages can leave fp16's range: the
    scales are brought near 1 by a common power of two per group, and the factor (over the world
    size) is applied to the node sum, straight into the result's dtype.

    Args:
        received: [num_nodes, slot_bytes] int8, the inter-node exchange's result (one node sum
            of this rank's padded partition from each node).
        layout: the call's quantized_reduce_layout.
        quantizer: the quantizer op module.
        dtype: the gradients' dtype, the result's.

    Returns:
        [padded_partition] in `dtype`: this rank's padded partition of the average.
    """
    num_nodes, world = layout.num_nodes, layout.world_size
    slots = received.view(num_nodes, layout.slot_bytes)
    scales = layout.slot_scales(slots)  # [N, groups per partition]
    if dtype == torch.float16:
        values = quantizer.dequantize(slots.view(-1), _kernel_params(scales / world, layout),
                                      num_nodes * layout.slot_groups, QUANT_BITS, quantizer.Symmetric)
        return values.view(num_nodes, -1)[:, :layout.padded_partition].sum(dim=0)
    exponent = _exponent(torch.nan_to_num(scales.abs(), nan=0.0, posinf=0.0).amax(dim=0))  # of the finite scales
    values = quantizer.dequantize(slots.view(-1), _kernel_params(scales * torch.pow(0.5, exponent), layout),
                                  num_nodes * layout.slot_groups, QUANT_BITS, quantizer.Symmetric)
    node_sum = layout.data_groups(values.view(num_nodes, -1)).sum(dim=0)  # [groups, group_elems] fp16
    average = torch.empty(layout.padded_partition, dtype=dtype, device=received.device)
    torch.mul(node_sum, (torch.pow(2.0, exponent) / world).unsqueeze(-1), out=average.view(node_sum.shape))
    return average


def _all_to_all(buffer: Tensor, group: Optional[ProcessGroup], size: int) -> Tensor:
    """All-to-all of `size` equal row blocks of `buffer` over `group`; a group of one is the identity."""
    if size == 1:
        return buffer
    received = torch.empty_like(buffer)
    all_to_all_single(received, buffer, group=group)
    return received


def quantized_reduce_scatter(tensors: List[Tensor], layout: QuantizedReduceLayout, quantizer,
                             intra_node_exchange: Callable[[Tensor], Tensor],
                             inter_node_exchange: Callable[[Tensor], Tensor], rank: int) -> List[Tensor]:
    """The qgZ pipeline for one rank: stage 0, intra-node exchange, stage 1, inter-node exchange,
    stage 2. The exchanges are passed in (all-to-alls over the node's and the local rank's groups,
    or a simulated cluster's permutations).

    Returns:
        rank `rank`'s partition of each tensor's average, views of one buffer in the input dtype.
    """
    slots = quantize_partitions(tensors, layout, quantizer)
    node_sums = reduce_within_node(intra_node_exchange(slots), layout, quantizer)
    average = average_across_nodes(inter_node_exchange(node_sums), layout, quantizer, tensors[0].dtype)
    return layout.partitions(average, rank)


def _quantized_topology(groups: Dict[str, ProcessGroup]):
    """(num_nodes, local_world_size, this node's group, this local rank's cross-node group), as
    deepspeed.utils.groups._get_local_all_to_all_group builds them. On a single node the node's
    group is the whole world, so `groups` may leave it out there."""
    local_world_size = get_accelerator().device_count()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"all_to_all_quant_reduce: world size {world_size} is not a multiple of the "
                         f"accelerator's device count {local_world_size}")
    num_nodes = world_size // local_world_size
    node, local_rank = divmod(rank, local_world_size)
    wanted = {f"local_{node}": local_world_size}
    if num_nodes > 1:
        wanted[f"global_{local_rank}"] = num_nodes
    for key, size in wanted.items():
        if key not in groups:
            if num_nodes == 1:
                continue  # the world itself
            raise ValueError(f"all_to_all_quant_reduce: groups has no '{key}' for rank {rank} "
                             f"({num_nodes} nodes x {local_world_size} devices); keys: {sorted(groups)}")
        if dist.get_world_size(groups[key]) != size:
            raise ValueError(f"all_to_all_quant_reduce: group '{key}' has {dist.get_world_size(groups[key])} "
                             f"ranks, expected {size} ({num_nodes} nodes x {local_world_size} devices)")
    return num_nodes, local_world_size, groups.get(f"local_{node}"), groups.get(f"global_{local_rank}")


@instrument_w_nvtx
@torch.no_grad()
def all_to_all_quant_reduce(tensors: List[Tensor],
                            groups: Dict[str, ProcessGroup],
                            group_size: Optional[int] = None) -> List[Tensor]:
    """Quantized (ZeRO++ qgZ) drop-in for ``reduce_scatter_coalesced(tensors)`` over the world.

    Tensors of two or more dimensions go through one hierarchical exchange for the whole call
    (int4 within each node, then int4 across nodes, any node count), one quantizer kernel per
    stage; 1-D tensors, which hold little of a model's gradient, take one exact
    reduce_scatter_coalesced together.

    Args:
        tensors: this rank's gradients, one dtype (fp16, bf16 or fp32) and one device.
        groups: deepspeed.utils.groups._get_local_all_to_all_group()'s dict ('local_{node}' and
            'global_{local rank}'). Only the groups an exchange needs must be there: none for a call
            of 1-D tensors only, and on a single node the whole world serves as 'local_0'.
        group_size: the largest quantization group, in values (see quantized_layout.resolve_group_size).

    Returns:
        For each tensor, rank r's elements [r * C, min((r + 1) * C, numel)) of the average over
        all ranks of the flattened tensor, C = ceil(numel / world_size), in the tensor's dtype:
        the partitions of reduce_scatter_coalesced, with the int4 error of two quantization stages.
        A non-finite value in any rank's input makes (at least) its group of the owner's partition
        non-finite.

    Raises:
        ValueError: before any collective, for mixed dtypes or devices, an unsupported dtype, a
            world size that is not a multiple of the accelerator's device count, a missing or
            mis-sized group, or an invalid group size; each names the values.
    """
    if not tensors:
        return []
    _check_tensors(tensors, "all_to_all_quant_reduce")
    if tensors[0].dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"all_to_all_quant_reduce: unsupported dtype {tensors[0].dtype}; "
                         f"expected one of {QUANTIZABLE_DTYPES}")
    quantized = [i for i, t in enumerate(tensors) if t.dim() > 1 and t.numel() > 0]
    exact = [i for i, t in enumerate(tensors) if t.dim() <= 1 and t.numel() > 0]
    if quantized:
        num_nodes, local_world_size, local_group, global_group = _quantized_topology(groups)
        layout = quantized_reduce_layout(tuple(tensors[i].numel() for i in quantized), num_nodes, local_world_size,
                                         resolve_group_size(group_size))
        quantizer = _get_quantizer_module()

    outputs: List[Tensor] = [t.new_empty(0) if t.numel() == 0 else None for t in tensors]
    stats = QuantizedReduceStats(calls=1)
    if exact:
        for i, output in zip(exact, reduce_scatter_coalesced([tensors[i] for i in exact])):
            outputs[i] = output
        world_size = dist.get_world_size()
        local_world_size = get_accelerator().device_count()
        stats.exact_tensors = len(exact)
        stats.exact_elems = sum(tensors[i].numel() for i in exact)
        stats.collective_calls += 1
        # one partition-sized share to each other rank
        share = sum(math.ceil(tensors[i].numel() / world_size) for i in exact) * tensors[0].element_size()
        stats.intra_node_bytes += (min(local_world_size, world_size) - 1) * share
        stats.inter_node_bytes += max(0, world_size - local_world_size) * share
    if quantized:
        results = quantized_reduce_scatter([tensors[i] for i in quantized], layout, quantizer,
                                           lambda slots: _all_to_all(slots, local_group, local_world_size),
                                           lambda slots: _all_to_all(slots, global_group, num_nodes), dist.get_rank())
        for i, output in zip(quantized, results):
            outputs[i] = output
        stats.quantized_tensors = len(quantized)
        stats.quantized_elems = sum(t.numel for t in layout.tensors)
        stats.padding_elems = layout.padding_elems
        stats.collective_calls += (local_world_size > 1) + (num_nodes > 1)
        stats.intra_node_bytes += layout.intra_node_bytes
        stats.inter_node_bytes += layout.inter_node_bytes

    qgz_accounting.last_call = stats
    qgz_accounting.totals.add(stats)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(f"all_to_all_quant_reduce: {stats}")
    return outputs


@instrument_w_nvtx
@torch.no_grad()
def reduce_scatter_coalesced(
    tensors: List[Tensor],
    group: ProcessGroup = None,
) -> List[Tensor]:
    """Reduce-scatter a list of tensors in one collective.

    Args:
        tensors: tensors of one dtype on one device; never written to.
        group: the process group (the world if None).

    Returns:
        For each tensor, rank r's elements [r * C, min((r + 1) * C, numel)) of the average over the
        group, C = ceil(numel / world_size), as 1-D views into one shared buffer.
    """
    if not tensors:
        return []
    _check_tensors(tensors, "reduce_scatter_coalesced")
    this_rank = dist.get_rank(group)
    world_sz = dist.get_world_size(group)

    partitions = [math.ceil(t.numel() / world_sz) for t in tensors]
    offsets = [0]
    for partition in partitions:
        offsets.append(offsets[-1] + partition)

    # Row r holds every tensor's rank-r partition (zero-padded to C), so one reduce-scatter of the
    # flat buffer leaves all of this rank's partitions in its own row.
    buffer = torch.empty(world_sz, offsets[-1], dtype=tensors[0].dtype, device=tensors[0].device)
    nonempty = [t.reshape(-1) for t in tensors if t.numel()]
    if nonempty:
        _chunk_cat(nonempty, buffer)
    buffer.div_(world_sz)  # pre-divide: the sum of the shares is the average

    rank_row = buffer[this_rank]
    _torch_reduce_scatter_fn(buffer.view(-1), rank_row, group=group)

    return [
        rank_row.narrow(0, offset, max(0, min(partition,
                                              tensor.numel() - this_rank * partition)))
        for tensor, partition, offset in zip(tensors, partitions, offsets)
    ]

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
from typing import Dict, List, Tuple

import torch
from torch import Tensor
from deepspeed import comm as dist
from deepspeed.comm import ProcessGroup, all_to_all_single
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import instrument_w_nvtx
from deepspeed.ops import op_builder
from deepspeed.utils import logger
from deepspeed.runtime.comm.quantized_layout import (QUANT_BITS, SCALE_BYTES, QuantizedReduceLayout, TensorLayout,
                                                     quantized_reduce_layout)


def _torch_reduce_scatter_fn(input_tensor: Tensor, output_tensor: Tensor, group=None, async_op=False, prof=False):
    return instrument_w_nvtx(dist.reduce_scatter_fn)(output_tensor, input_tensor, group=group, async_op=False)


quantizer_module = None

# The kernels read fp16. Gradients in these dtypes are brought into fp16 range group by group
# (by powers of two, which are exact), so bf16 and fp32 magnitudes survive the conversion.
QUANTIZABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _get_quantizer_module():
    global quantizer_module
    if quantizer_module is None:
        if get_accelerator().device_name() == 'cpu':
            from deepspeed.ops.op_builder.cpu.quantizer import QuantizerBuilder
            quantizer_module = QuantizerBuilder().load()
        else:
            quantizer_module = op_builder.QuantizerBuilder().load()
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


def _copy_in_partitions(flat: Tensor, partition: int, rows: Tensor) -> None:
    """Write rank r's reduce-scatter partition of `flat` (elements [r * partition, (r + 1) *
    partition)) to the start of rows[r] and zeros everywhere else in `rows`, so `rows` may come from
    torch.empty: only the padding is written twice."""
    full_rows = flat.numel() // partition if partition else rows.shape[0]
    tail = flat.numel() - full_rows * partition
    rows[:full_rows, :partition].copy_(flat[:full_rows * partition].view(full_rows, partition))
    rows[:full_rows, partition:].zero_()
    if full_rows < rows.shape[0]:
        rows[full_rows, :tail].copy_(flat[full_rows * partition:])
        rows[full_rows, tail:].zero_()
        rows[full_rows + 1:].zero_()


def _check_tensors(tensors: List[Tensor], op: str) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{op}: all tensors must share a dtype, got {sorted(map(str, dtypes))}")


def _quantized_topology(groups: Dict[str, ProcessGroup]) -> Tuple[int, int, ProcessGroup, ProcessGroup]:
    """(num_nodes, local_world_size, this node's group, this local rank's cross-node group), as
    deepspeed.utils.groups._get_local_all_to_all_group built them."""
    local_world_size = get_accelerator().device_count()
    world_size = dist.get_world_size()
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"all_to_all_quant_reduce: world size {world_size} is not a multiple of the "
                         f"accelerator's device count {local_world_size}")
    num_nodes = world_size // local_world_size
    node, local_rank = divmod(dist.get_rank(), local_world_size)
    wanted = {f"local_{node}": local_world_size}
    if num_nodes > 1:
        wanted[f"global_{local_rank}"] = num_nodes
    for key, size in wanted.items():
        if key not in groups:
            raise ValueError(f"all_to_all_quant_reduce: groups has no '{key}' for rank {dist.get_rank()} "
                             f"({num_nodes} nodes x {local_world_size} devices); keys: {sorted(groups)}")
        if dist.get_world_size(groups[key]) != size:
            raise ValueError(f"all_to_all_quant_reduce: group '{key}' has {dist.get_world_size(groups[key])} "
                             f"ranks, expected {size} ({num_nodes} nodes x {local_world_size} devices)")
    return num_nodes, local_world_size, groups[f"local_{node}"], groups.get(f"global_{local_rank}")


def _exchange(buffer: Tensor, group: ProcessGroup, size: int) -> Tuple[Tensor, int]:
    """All-to-all of equal row blocks of `buffer` over `group`; a group of one is the identity."""
    if size == 1:
        return buffer, 0
    received = torch.empty_like(buffer)
    all_to_all_single(received, buffer, group=group)
    return received, 1


def _scales(slots: Tensor, tensor: TensorLayout) -> Tensor:
    """The fp32 scales of `tensor` in every slot of `slots` ([..., slot_bytes] int8), as a view."""
    return slots[..., tensor.scale_offset:tensor.scale_offset + tensor.scale_bytes].view(torch.float32)


def _all_scales(slots: Tensor, layout: QuantizedReduceLayout) -> Tensor:
    """The fp32 scales of every tensor in every slot of `slots`, as a view; the slot layout puts them
    all first, so tensor t's are _all_scales(...)[..., _group_range(t)]."""
    return slots[..., :layout.scale_bytes].view(torch.float32)


def _group_range(tensor: TensorLayout) -> slice:
    first = tensor.scale_offset // SCALE_BYTES
    return slice(first, first + tensor.groups)


def _data(slots: Tensor, tensor: TensorLayout) -> Tensor:
    return slots[..., tensor.data_offset:tensor.data_offset + tensor.data_bytes]


# torch.ldexp multiplies by an fp32 power of two, which must stay a normal number.
_MAX_EXPONENT = 126


def _power_of_two_exponent(magnitude: Tensor) -> Tensor:
    """e with magnitude = m * 2**e, 0.5 <= m < 1 (e clamped to +-126); 0 for zero and non-finite
    magnitudes."""
    exponent = torch.frexp(magnitude.float()).exponent.clamp_(-_MAX_EXPONENT, _MAX_EXPONENT)
    return torch.where(torch.isfinite(magnitude), exponent, torch.zeros_like(exponent))


def _quantize_into_slots(tensor: Tensor, layout: TensorLayout, slots: Tensor, num_nodes: int,
                         local_world_size: int) -> None:
    """Stage 0: pad each rank's partition of `tensor`, quantize it and write the swizzled int4 data
    and true-magnitude scales into `slots` ([world, slot_bytes] int8, slot d * N + n holding
    partition n * D + d)."""
    quantizer = _get_quantizer_module()
    world = num_nodes * local_world_size
    padded = torch.empty(world, layout.padded_partition, dtype=torch.float32, device=tensor.device)
    _copy_in_partitions(tensor.reshape(-1), layout.partition, padded)
    grouped = padded.view(world * layout.groups, layout.group_elems)

    # Each group is scaled by a power of two (exact) to an absmax in [0.5, 1) so that any bf16/fp32
    # magnitude fits fp16; the factor is folded back into its fp32 scale below. A group whose absmax
    # is inf or NaN poisons its scale: the kernels would quantize a NaN to 0 and lose it.
    absmax = grouped.abs().amax(dim=1)
    exponent = _power_of_two_exponent(absmax)
    normalized = torch.empty(grouped.shape, dtype=torch.float16, device=tensor.device)
    torch.mul(grouped, torch.ldexp(torch.ones_like(absmax), -exponent).unsqueeze(1), out=normalized)

    data, scales = quantizer.swizzle_quant(normalized.view(-1), world * layout.groups, QUANT_BITS, quantizer.Symmetric,
                                           1, num_nodes, local_world_size)

    def to_slot_order(per_group: Tensor) -> Tensor:
        return per_group.view(num_nodes, local_world_size, layout.groups).transpose(0, 1)

    scales = torch.ldexp(scales.view(local_world_size, num_nodes, layout.groups), to_slot_order(exponent))
    scales = torch.where(to_slot_order(torch.isfinite(absmax)), scales, torch.full_like(scales, math.nan))
    _scales(slots, layout).copy_(scales.reshape(world, layout.groups))
    _data(slots, layout).copy_(data.view(world, layout.data_bytes))


def _reduce_node_slots(received: Tensor, layout: QuantizedReduceLayout, out_slots: Tensor) -> None:
    """Stage 1: sum the `local_world_size` received copies of this rank's N slots (one per node)
    with quantized_reduction, writing requantized data and true-magnitude scales to `out_slots`
    ([N, slot_bytes]). The scale arithmetic runs once for the whole bucket."""
    quantizer = _get_quantizer_module()
    num_nodes, local_world_size = layout.num_nodes, layout.local_world_size
    received = received.view(local_world_size, num_nodes, -1)
    scales = _all_scales(received, layout)  # [D, N, groups of all tensors]
    finite = torch.isfinite(scales).all(dim=0)
    # quantized_reduction sums in fp16: bring each group's summed scale to [0.5, 1) so no sum of D
    # dequantized values can overflow, and fold the factor back into the output scale.
    exponent = _power_of_two_exponent(torch.where(finite, scales, torch.zeros_like(scales)).sum(dim=0))
    normalized = torch.where(finite, torch.ldexp(scales, -exponent), torch.ones_like(scales))

    out_scales = _all_scales(out_slots, layout)  # [N, groups of all tensors]
    for tensor in layout.tensors:
        groups = num_nodes * tensor.groups
        tensor_scales = normalized[..., _group_range(tensor)].contiguous().view(-1, 1)
        data, tensor_scales = quantizer.quantized_reduction(
            _data(received, tensor).contiguous().view(-1), tensor_scales, local_world_size * groups, groups,
            QUANT_BITS, quantizer.Symmetric, local_world_size)
        out_scales[:, _group_range(tensor)] = tensor_scales.view(num_nodes, tensor.groups)
        _data(out_slots, tensor).copy_(data.view(num_nodes, tensor.data_bytes))
    out_scales.copy_(torch.where(finite, torch.ldexp(out_scales, exponent), torch.full_like(out_scales, math.nan)))


def _dequantize_average(received: Tensor, layout: QuantizedReduceLayout, rank: int,
                        dtypes: List[torch.dtype]) -> List[Tensor]:
    """Stage 2: dequantize the N node sums of this rank's partitions, add them and divide by the
    world size; return each partition's real elements in its tensor's dtype."""
    quantizer = _get_quantizer_module()
    num_nodes = layout.num_nodes
    scales = _all_scales(received, layout)  # [N, groups of all tensors]
    # Dequantize with scales brought near 1, so the fp16 output cannot overflow; the power of two
    # is applied in fp32.
    exponent = _power_of_two_exponent(scales)
    mantissa = torch.ldexp(scales, -exponent)
    outputs = []
    for tensor, dtype in zip(layout.tensors, dtypes):
        values = quantizer.dequantize(
            _data(received, tensor).contiguous().view(-1), mantissa[:, _group_range(tensor)].contiguous().view(-1, 1),
            num_nodes * tensor.groups, QUANT_BITS, quantizer.Symmetric)
        values = torch.ldexp(
            values.view(num_nodes, tensor.groups, tensor.group_elems).float(),
            exponent[:, _group_range(tensor)].unsqueeze(-1))
        average = values.sum(dim=0).view(-1).div_(layout.world_size)
        outputs.append(average.narrow(0, 0, tensor.partition_numel(rank)).to(dtype))
    return outputs


def _quantized_reduce_scatter(tensors: List[Tensor], layout: QuantizedReduceLayout, local_group: ProcessGroup,
                              global_group: ProcessGroup) -> Tuple[List[Tensor], int]:
    num_nodes, local_world_size = layout.num_nodes, layout.local_world_size
    device = tensors[0].device
    slots = torch.empty(layout.world_size, layout.slot_bytes, dtype=torch.int8, device=device)
    for tensor, tensor_layout in zip(tensors, layout.tensors):
        _quantize_into_slots(tensor, tensor_layout, slots, num_nodes, local_world_size)
    received, calls = _exchange(slots, local_group, local_world_size)

    node_slots = torch.empty(num_nodes, layout.slot_bytes, dtype=torch.int8, device=device)
    _reduce_node_slots(received, layout, node_slots)
    received, inter_calls = _exchange(node_slots, global_group, num_nodes)

    return _dequantize_average(received, layout, dist.get_rank(), [t.dtype for t in tensors]), calls + inter_calls


@instrument_w_nvtx
@torch.no_grad()
def all_to_all_quant_reduce(tensors: List[Tensor], groups: {}) -> List[Tensor]:
    """Quantized (ZeRO++ qgZ) drop-in for ``reduce_scatter_coalesced(tensors)`` over the world.

    Rank r gets, for each tensor, the elements [r * C, min((r + 1) * C, numel)) of the average over
    all ranks of the flattened tensor, C = ceil(numel / world_size), in the tensor's dtype: the
    partitions of reduce_scatter_coalesced, with the int4 error of two quantization stages. Tensors
    of two or more dimensions go through one hierarchical exchange for the whole call (int4 within
    each node, then int4 across nodes, any node count); 1-D tensors, which hold little of a model's
    gradient, take one exact reduce_scatter_coalesced together. A non-finite value in any rank's
    input makes (at least) its group of the owner's partition non-finite.

    ``groups`` is deepspeed.utils.groups._get_local_all_to_all_group()'s dict.
    """
    if not tensors:
        return []
    _check_tensors(tensors, "all_to_all_quant_reduce")
    if tensors[0].dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"all_to_all_quant_reduce: unsupported dtype {tensors[0].dtype}; "
                         f"expected one of {QUANTIZABLE_DTYPES}")
    num_nodes, local_world_size, local_group, global_group = _quantized_topology(groups)

    outputs: List[Tensor] = [None] * len(tensors)
    quantized = [i for i, t in enumerate(tensors) if t.dim() > 1 and t.numel() > 0]
    exact = [i for i, t in enumerate(tensors) if t.dim() <= 1 and t.numel() > 0]
    for i, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            outputs[i] = tensor.new_empty(0)

    stats = QuantizedReduceStats(calls=1)
    if exact:
        for i, output in zip(exact, reduce_scatter_coalesced([tensors[i] for i in exact])):
            outputs[i] = output
        stats.exact_tensors = len(exact)
        stats.exact_elems = sum(tensors[i].numel() for i in exact)
        stats.collective_calls += 1
        # one partition-sized share to each other rank
        share = sum(math.ceil(tensors[i].numel() / dist.get_world_size()) for i in exact) * tensors[0].element_size()
        stats.intra_node_bytes += (local_world_size - 1) * share
        stats.inter_node_bytes += (num_nodes - 1) * local_world_size * share
    if quantized:
        layout = quantized_reduce_layout(tuple(tensors[i].numel() for i in quantized), num_nodes, local_world_size)
        results, calls = _quantized_reduce_scatter([tensors[i] for i in quantized], layout, local_group, global_group)
        for i, output in zip(quantized, results):
            outputs[i] = output
        stats.quantized_tensors = len(quantized)
        stats.quantized_elems = sum(t.numel for t in layout.tensors)
        stats.padding_elems = layout.padding_elems
        stats.collective_calls += calls
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
    """Reduce-scatter a list of tensors in one collective: rank r gets, for each tensor, the
    elements [r * C, min((r + 1) * C, numel)) of the average over the group, C = ceil(numel /
    world_size), as a 1-D view into one shared buffer.
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
    for tensor, partition, offset in zip(tensors, partitions, offsets):
        _copy_in_partitions(tensor.reshape(-1), partition, buffer[:, offset:offset + partition])
    buffer.div_(world_sz)  # pre-divide: the sum of the shares is the average

    rank_row = buffer[this_rank]
    _torch_reduce_scatter_fn(buffer.view(-1), rank_row, group=group)

    return [
        rank_row.narrow(0, offset, max(0, min(partition,
                                              tensor.numel() - this_rank * partition)))
        for tensor, partition, offset in zip(tensors, partitions, offsets)
    ]

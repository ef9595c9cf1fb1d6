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
from typing import Dict, List, Optional

import torch
from torch import Tensor
from deepspeed import comm as dist
from deepspeed.comm import ProcessGroup, all_to_all_single
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import instrument_w_nvtx
from deepspeed.ops import op_builder
from deepspeed.ops.quantizer.qgz_contract import checked
from deepspeed.utils import logger
from deepspeed.runtime.comm.quantized_fused_choice import choose_fused, resolve_fused
from deepspeed.runtime.comm.quantized_layout import resolve_group_size, resolve_intra_node_bits
from deepspeed.runtime.comm.quantized_pipeline import (chunk_cat, pipeline_stages, quantized_reduce_plan,
                                                       quantized_reduce_scatter)


def _torch_reduce_scatter_fn(input_tensor: Tensor, output_tensor: Tensor, group=None, async_op=False, prof=False):
    return instrument_w_nvtx(dist.reduce_scatter_fn)(output_tensor, input_tensor, group=group, async_op=False)


# The loaded quantizer op, cached on first use. A caller may set it (DeepSpeed's own tests set the
# pure-PyTorch NPUQuantizer); whatever is set here is what all_to_all_quant_reduce uses, behind the
# contract checks. It holds the op itself, as upstream's does, for the other users of this global
# (LoCo's all_to_all_loco_quant_reduce, in trees that have it, calls its LoCo kernels).
quantizer_module = None

# The kernels read fp16; gradients in the other dtypes are brought into fp16 range group by group
# (quantized_pipeline.py).
QUANTIZABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _get_quantizer_module():
    """DeepSpeed's QuantizerBuilder op for this accelerator (CUDA, or the CPU op on the CPU
    accelerator), loaded once, or the op a caller set, behind the kernel-contract checks."""
    global quantizer_module
    if quantizer_module is None:
        quantizer_module = op_builder.QuantizerBuilder().load()
    return checked(quantizer_module)


@dataclass
class QuantizedReduceStats:
    """What the gradient reduce-scatters of this module did: all_to_all_quant_reduce's calls
    (``calls``; their 1-D tensors go through the exact path) and reduce_scatter_coalesced's own
    calls (``reduce_scatter_calls``), with the bytes each rank sent to the other ranks of its node
    and to other nodes. Per call in ``qgz_accounting.last_call``, summed in ``qgz_accounting.totals``."""
    calls: int = 0
    reduce_scatter_calls: int = 0
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

    def record(self, stats: QuantizedReduceStats) -> None:
        self.last_call = stats
        self.totals.add(stats)


qgz_accounting = _QuantizedReduceAccounting()


def _check_tensors(tensors: List[Tensor], op: str) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: all tensors must be on one device, got {sorted(map(str, devices))}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise ValueError(f"{op}: all tensors must share a dtype, got {sorted(map(str, dtypes))}")


def _all_to_all(buffer: Tensor, group: Optional[ProcessGroup], size: int) -> Tensor:
    """All-to-all of `size` equal row blocks of `buffer` over `group`; a group of one is the identity."""
    if size == 1:
        return buffer
    received = torch.empty_like(buffer)
    all_to_all_single(received, buffer, group=group)
    return received


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
                            group_size: Optional[int] = None,
                            intra_node_bits: Optional[int] = None,
                            fused=False) -> List[Tensor]:
    """Quantized (ZeRO++ qgZ) drop-in for ``reduce_scatter_coalesced(tensors)`` over the world.

    Tensors of two or more dimensions go through one hierarchical exchange for the whole call
    (int4 or int8 within each node, then int4 across nodes, any node count), one quantizer kernel
    per step (quantized_pipeline.py); 1-D tensors, which hold little of a model's gradient, take one
    exact reduce_scatter_coalesced together. A call whose kernels would leave their int32 indexing
    runs the exchange once per run of tensors that fits.

    Args:
        tensors: this rank's gradients, one dtype (fp16, bf16 or fp32) and one device.
        groups: deepspeed.utils.groups._get_local_all_to_all_group()'s dict ('local_{node}' and
            'global_{local rank}'). Only the groups an exchange needs must be there: none for a call
            of 1-D tensors only, and on a single node the whole world serves as 'local_0'.
        group_size: the largest quantization group, in values (quantized_layout.resolve_group_size).
        intra_node_bits: 4 or 8, the precision of the intra-node exchange
            (quantized_layout.resolve_intra_node_bits).
        fused: False, True or "auto" (quantized_fused_choice.py): whether the three stages run as
            fused Triton kernels (quantized_fused.py: one launch each, the same results bit for bit,
            on CUDA tensors, and on CPU tensors under TRITON_INTERPRET=1); "auto" where the rank's
            device checks their bits and they are faster, with every rank's agreement.

    Returns:
        For each tensor, rank r's elements [r * C, min((r + 1) * C, numel)) of the average over
        all ranks of the flattened tensor, C = ceil(numel / world_size), in the tensor's dtype:
        the partitions of reduce_scatter_coalesced, with the error of two quantization stages.
        A non-finite value in any rank's input makes (at least) its group of the owner's partition
        non-finite.

    Raises:
        ValueError: before any collective, for mixed dtypes or devices, an unsupported dtype, a
            world size that is not a multiple of the accelerator's device count, a missing or
            mis-sized group, an invalid group size or precision, a tensor too large for the
            kernels, or a `fused` setting that is not one of the three; with `fused` True, fused
            kernels that cannot run here or whose self-check fails; each names the values.
    """
    if not tensors:
        return []
    _check_tensors(tensors, "all_to_all_quant_reduce")
    if tensors[0].dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"all_to_all_quant_reduce: unsupported dtype {tensors[0].dtype}; "
                         f"expected one of {QUANTIZABLE_DTYPES}")
    group_size = resolve_group_size(group_size)
    intra_node_bits = resolve_intra_node_bits(intra_node_bits)
    fused = resolve_fused(fused)
    quantized = [i for i, t in enumerate(tensors) if t.dim() > 1 and t.numel() > 0]
    exact = [i for i, t in enumerate(tensors) if t.dim() <= 1 and t.numel() > 0]
    if quantized:
        num_nodes, local_world_size, local_group, global_group = _quantized_topology(groups)
        plan = quantized_reduce_plan(tuple(tensors[i].numel() for i in quantized), num_nodes, local_world_size,
                                     group_size, intra_node_bits)
        # DeepSpeed's kernels: the default path's, and "auto"'s timing of it; `true` never loads them
        quantizer = None if fused is True else _get_quantizer_module()
        run_stages = []  # every run's kernels decided (self-checked at a key's first call) before any launch
        for start, layout in plan:
            run_tensors = [tensors[i] for i in quantized[start:start + len(layout.tensors)]]
            run_stages.append(pipeline_stages(quantizer, choose_fused(fused, run_tensors, layout, quantizer)))

    outputs: List[Tensor] = [t.new_empty(0) if t.numel() == 0 else None for t in tensors]
    stats = QuantizedReduceStats(calls=1)
    if exact:
        exact_tensors = [tensors[i] for i in exact]
        for i, output in zip(exact, _reduce_scatter_coalesced(exact_tensors)):
            outputs[i] = output
        stats.add(_reduce_scatter_stats(exact_tensors, None))
    if quantized:
        for (start, layout), stages in zip(plan, run_stages):
            run = quantized[start:start + len(layout.tensors)]
            results = quantized_reduce_scatter([tensors[i] for i in run], layout, stages,
                                               lambda slots: _all_to_all(slots, local_group, local_world_size),
                                               lambda slots: _all_to_all(slots, global_group, num_nodes),
                                               dist.get_rank())
            for i, output in zip(run, results):
                outputs[i] = output
            stats.quantized_tensors += len(run)
            stats.quantized_elems += sum(t.numel for t in layout.tensors)
            stats.padding_elems += layout.padding_elems
            stats.collective_calls += (local_world_size > 1) + (num_nodes > 1)
            stats.intra_node_bytes += layout.intra_node_bytes
            stats.inter_node_bytes += layout.inter_node_bytes

    qgz_accounting.record(stats)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(f"all_to_all_quant_reduce: {stats}")
    return outputs


def _reduce_scatter_stats(tensors: List[Tensor], group: Optional[ProcessGroup]) -> QuantizedReduceStats:
    """The exact reduce-scatter of `tensors` over `group`: one collective in which each rank sends
    a partition-sized share to every other rank of the group, inside its node or across."""
    ranks = torch.distributed.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
    local_world_size, rank = get_accelerator().device_count(), dist.get_rank()
    same_node = sum(1 for other in ranks if other // local_world_size == rank // local_world_size)
    share = sum(math.ceil(t.numel() / len(ranks)) for t in tensors) * tensors[0].element_size()
    return QuantizedReduceStats(exact_tensors=len(tensors),
                                exact_elems=sum(t.numel() for t in tensors),
                                collective_calls=1,
                                intra_node_bytes=(same_node - 1) * share,
                                inter_node_bytes=(len(ranks) - same_node) * share)


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
    outputs = _reduce_scatter_coalesced(tensors, group)
    stats = _reduce_scatter_stats(tensors, group)
    stats.reduce_scatter_calls = 1
    qgz_accounting.record(stats)
    return outputs


def _reduce_scatter_coalesced(tensors: List[Tensor], group: Optional[ProcessGroup] = None) -> List[Tensor]:
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
        chunk_cat(nonempty, buffer)
    buffer.div_(world_sz)  # pre-divide: the sum of the shares is the average

    rank_row = buffer[this_rank]
    _torch_reduce_scatter_fn(buffer.view(-1), rank_row, group=group)

    return [
        rank_row.narrow(0, offset, max(0, min(partition,
                                              tensor.numel() - this_rank * partition)))
        for tensor, partition, offset in zip(tensors, partitions, offsets)
    ]

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Whether a quantized gradient reduce-scatter runs the fused Triton kernels (quantized_fused.py) or
DeepSpeed's quantizer kernels with the glue (quantized_pipeline.py): the setting
``zero_quantized_gradients_fused`` (``fused=`` of all_to_all_quant_reduce), and for ``"auto"`` and
``true`` the decision the rank's own GPU makes.

====================  ======================================================================
setting               what a call does
====================  ======================================================================
``false``             DeepSpeed's kernels; the fused kernels never run
``"auto"`` (default)  the fused kernels where they give the reference's bits on this device
                      and one call of them is faster than one of DeepSpeed's kernels on the
                      call's own bucket; DeepSpeed's kernels otherwise, and wherever the fused
                      kernels cannot run (no Triton, deepspeed.HAS_TRITON False, ROCm, a CPU
                      without TRITON_INTERPRET=1), never an error
``true``              the fused kernels, after the same check of their bits; a mismatch (or
                      kernels that cannot run) is an error naming it
====================  ======================================================================

The self-check runs once per process for each (device, dtype, intra-node precision, group size,
topology), at the first call that needs it (ChoiceKey): a small synthetic bucket in that dtype and
layout, node 0's local ranks' tensors (check_inputs: zeros, subnormals, the dtype's largest and
smallest values, exact rounding ties, inf and NaN), goes through each fused stage and the same stage
on the PyTorch reference quantizer (qgz_reference.py) on the same device, compared bit for bit (NaN
equal to NaN; the codes of a group whose scale is NaN, which nothing reads, left out). For
``"auto"`` one call of each path then runs on the call's own bucket, the exchanges left out, and is
timed after a warm-up call. Every rank of the world takes the same decision: each rank's verdict
(faster, slower, a mismatch, cannot run) meets the others' in one all-reduce of a world-sized int32
tensor, and the fused kernels run only where every rank's is "faster" (with ``true``: passed the
check), so a rank whose check failed keeps every rank off them, and with ``true`` every rank raises.
Rank 0 logs the choice, its check's result (on a mismatch: the stage, how many values, the first
differing one's index and both bit patterns), both times and the ranks that held the world back,
once, through DeepSpeed's logger; a rank whose own check found a mismatch logs it as a warning.
Nothing runs per call after. A simulation (quantized_simulation.py) decides on its process's verdict
alone, apart from the world's decisions.
"""

import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from deepspeed.runtime.comm.quantized_layout import (QuantizedReduceLayout, SlotFormat, TensorLayout,
                                                     quantized_reduce_layout, resolve_group_size,
                                                     resolve_intra_node_bits)

AUTO = "auto"
FUSED_SETTINGS = (False, True, AUTO)
DEFAULT_FUSED = AUTO


def resolve_fused(value, name: str = "fused"):
    """The fused setting `value`: False, True or "auto".

    Raises:
        ValueError: any other value (named `name` in the message).
    """
    if value is True or value is False or value == AUTO:
        return value
    raise ValueError(f"{name} {value!r} must be one of true, false or \"auto\"")


@dataclass(frozen=True)
class FusedChoice:
    """What a setting decided for one key: whether the fused kernels run, and why (the INFO line)."""
    fused: bool
    reason: str


class ChoiceKey(NamedTuple):
    """What one decision holds for: a process decides once per key."""
    device_type: str
    dtype: torch.dtype
    intra_node_bits: int
    group_elems: int
    num_nodes: int
    local_world_size: int
    world: bool  # the world's decision (a collective's calls), or a simulation's in one process
    setting: object


_CHOICES: Dict[ChoiceKey, FusedChoice] = {}


def choices() -> Dict[ChoiceKey, FusedChoice]:
    """The decisions this process has taken so far."""
    return dict(_CHOICES)


# --------------------------------------------------------------------------------------------------
# comparison, bit for bit
# --------------------------------------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def value_difference(got: torch.Tensor, expected: torch.Tensor) -> Optional[Tuple[int, int, str, str]]:
    """(how many values differ, the first one's index, its bits in `got`, in `expected`) of two
    tensors of one dtype, NaN equal to NaN; None where they agree."""
    got, expected = got.reshape(-1), expected.reshape(-1)
    differ = _bits(got) != _bits(expected)
    if got.is_floating_point():
        differ &= ~(torch.isnan(got) & torch.isnan(expected))
    count = int(differ.sum())
    if not count:
        return None
    first = int(differ.nonzero()[0])
    width = 2 * got.element_size()
    mask = (1 << (8 * got.element_size())) - 1
    return (count, first, f"{int(_bits(got)[first]) & mask:#0{width + 2}x}",
            f"{int(_bits(expected)[first]) & mask:#0{width + 2}x}")


def slot_differences(got: torch.Tensor, expected: torch.Tensor, fmt: SlotFormat) -> List[tuple]:
    """(where, then value_difference's four) for each part of two stacks of slots of `fmt` (int8,
    [..., slot_bytes]) that differs: the scales read as fp32, the codes (those of groups whose
    scale is NaN in `expected`, which nothing reads, left out), the scale groups' tails."""
    nan = torch.isnan(fmt.scales(expected))
    data = fmt.groups_per_partition * fmt.group_bytes
    codes = [s[..., :data].reshape(*s.shape[:-1], fmt.groups_per_partition, fmt.group_bytes) for s in (got, expected)]
    codes = [torch.where(nan.unsqueeze(-1), 0, c) for c in codes]
    tail = data + 4 * fmt.groups_per_partition
    parts = {
        "scales": (fmt.scales(got), fmt.scales(expected)),
        "codes": codes,
        "the scale groups' tails": (got[..., tail:], expected[..., tail:]),
    }
    found = ((where, value_difference(*pair)) for where, pair in parts.items())
    return [(where, ) + difference for where, difference in found if difference is not None]


def slot_difference(got: torch.Tensor, expected: torch.Tensor, fmt: SlotFormat):
    """The first of slot_differences, or None where the slots agree."""
    return next(iter(slot_differences(got, expected, fmt)), None)


# --------------------------------------------------------------------------------------------------
# the self-check
# --------------------------------------------------------------------------------------------------


def check_inputs(num_nodes: int, local_world_size: int, group_elems: int, dtype: torch.dtype,
                 device) -> List[List[torch.Tensor]]:
    """The tensors of node 0's local ranks in the synthetic bucket: two tensors of whole groups per
    partition, holding a group of zeros, subnormals next to normal values, the dtype's largest and
    smallest normal values and exact rounding ties of both intra-node precisions in the partition
    local rank 0 owns, an inf in the one of the last node's local rank 0, and a NaN from the last
    local rank. Only node 0 is built: its local rank 0 receives what it sums from these ranks alone,
    and its node's sums are a valid input of stage 2 (one slot per node), so the bucket is
    5 * local_world_size * world * group_elems values, not the world's."""
    world = num_nodes * local_world_size
    gen = torch.Generator().manual_seed(1234)
    info = torch.finfo(dtype)
    shapes = [(world * 3, group_elems), (world, 2 * group_elems)]
    inputs = []
    for rank in range(local_world_size):
        tensors = []
        for shape in shapes:
            values = torch.randn(shape, generator=gen, dtype=torch.float64)
            flat = values.view(-1)
            flat[:group_elems] = 0.0
            flat[group_elems:2 * group_elems] *= info.tiny
            flat[group_elems + 1] = info.tiny * info.eps
            flat[2 * group_elems] = info.max * (-1)**rank
            flat[3 * group_elems] = info.tiny
            # ties: the group's largest magnitude 8 makes the scale 16 (8 bits) or 1 (4 bits)
            ties = 3 * group_elems + group_elems // 2
            flat[ties] = 8.0
            flat[ties + 1:ties + 9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.03125, 0.09375, -0.15625])
            tensors.append(values.to(dtype))
        inputs.append(tensors)
    inputs[local_world_size - 1][1].view(-1)[5] = float("nan")
    inputs[0][0].view(-1)[(3 * (num_nodes - 1) * local_world_size + 1) * group_elems + 3] = float("inf")
    return [[t.to(device) for t in tensors] for tensors in inputs]


def exact_layout(numels: Sequence[int], num_nodes: int, local_world_size: int, group_elems: int,
                 intra_node_bits: int) -> QuantizedReduceLayout:
    """The layout of tensors of `numels` elements as quantized_reduce_layout makes it (each rank's
    partition of each tensor padded to whole groups, one after the other), with groups of exactly
    `group_elems` values, where quantized_reduce_layout takes the group size sending the fewest bytes
    up to its argument (for the check's small bucket, often a smaller one: another tile class).

    Raises:
        ValueError: a topology size below 1, a tensor without elements, or a group size or
            precision the layout refuses (resolve_group_size, resolve_intra_node_bits).
    """
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError(f"every tensor needs at least one element, got numels {tuple(numels)}")
    group_elems = resolve_group_size(group_elems, "group_elems")
    world = num_nodes * local_world_size
    tensors, offset = [], 0
    for numel in numels:
        partition = -(-numel // world)
        num_groups = -(-partition // group_elems)
        tensors.append(TensorLayout(numel, partition, num_groups, offset))
        offset += num_groups * group_elems
    return QuantizedReduceLayout(num_nodes, local_world_size, group_elems, resolve_intra_node_bits(intra_node_bits),
                                 tuple(tensors))


def self_check(num_nodes: int, local_world_size: int, group_elems: int, intra_node_bits: int, dtype: torch.dtype,
               device) -> Optional[str]:
    """The fused stages (pipeline_stages(None, fused=True)) against the same stages
    on the PyTorch reference quantizer, on `device`, bit for bit (see the module docstring): stage 0
    on each of node 0's local ranks (check_inputs), stage 1 on what its local rank 0 receives, stage 2
    on that node's sums. None if every stage agrees; else the first mismatch."""
    from deepspeed.ops.quantizer import qgz_reference
    from deepspeed.runtime.comm.quantized_pipeline import pipeline_stages
    inputs = check_inputs(num_nodes, local_world_size, group_elems, dtype, device)
    layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_world_size, group_elems,
                                     intra_node_bits)
    reference, fused = pipeline_stages(qgz_reference), pipeline_stages(None, fused=True)
    slots = [reference.quantize_partitions(tensors, layout) for tensors in inputs]
    for rank, tensors in enumerate(inputs):
        found = slot_difference(fused.quantize_partitions(tensors, layout), slots[rank], layout.intra)
        if found is not None:
            return _mismatch(0, f"local rank {rank}'s intra slots", found)
    received = torch.cat([s.view(local_world_size, num_nodes, -1)[0] for s in slots])
    sums = reference.reduce_within_node(received, layout)
    found = slot_difference(fused.reduce_within_node(received, layout), sums, layout.inter)
    if found is not None:
        return _mismatch(1, "the node's inter slots", found)
    found = value_difference(fused.average_across_nodes(sums, layout, dtype=dtype),
                             reference.average_across_nodes(sums, layout, dtype=dtype))
    return None if found is None else _mismatch(2, "the average", ("values", ) + found)


def _mismatch(stage, where, found):
    what, count, index, got, expected = found
    return (f"stage {stage} ({where}): {count} {what} differ, the first at index {index}: fused {got}, "
            f"reference {expected}")


def time_paths(tensors, layout: QuantizedReduceLayout, quantizer) -> Tuple[float, float]:
    """(seconds of one fused call, of one call on `quantizer`, DeepSpeed's kernels) on the call's own
    `tensors`, the exchanges left out (a rank receives what it sends in shape), after a run each."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.comm.quantized_pipeline import pipeline_stages, quantized_reduce_scatter
    accelerator = get_accelerator()
    seconds = []
    for stages in (pipeline_stages(None, fused=True), pipeline_stages(quantizer)):

        def call():
            return quantized_reduce_scatter(tensors, layout, stages, lambda x: x, lambda x: x, 0)

        call()
        accelerator.synchronize()
        start = time.perf_counter()
        call()
        accelerator.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1]


# --------------------------------------------------------------------------------------------------
# the decision
# --------------------------------------------------------------------------------------------------

# a rank's verdict: the fused kernels can run, gave the reference's bits and were faster (or were
# asked for); and the ways it can fall short, in the order the rank found them
FASTER, SLOWER, MISMATCH, UNAVAILABLE = 0, 1, 2, 3
_SHORT = {SLOWER: "the fused kernels slower", MISMATCH: "a mismatch", UNAVAILABLE: "the fused kernels unavailable"}


def _verdicts(verdict: int, device) -> List[int]:
    """Every rank's verdict, in rank order (one all-reduce of a world-sized int32 tensor), where
    there is a world; else this rank's alone."""
    import deepspeed.comm as dist
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [verdict]
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = verdict
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    return flags.tolist()


def _held_back(verdicts: List[int]) -> str:
    """The ranks whose verdicts keep the world off the fused kernels, by reason."""
    parts = []
    for verdict, what in _SHORT.items():
        ranks = [r for r, v in enumerate(verdicts) if v == verdict]
        if ranks:
            shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
            parts.append(f"{what} on {len(ranks)} of {len(verdicts)} ranks ({shown})")
    return "; ".join(parts)


def _log(choice: FusedChoice, verdict: int) -> None:
    """Rank 0's INFO line; a rank whose own check found a mismatch also logs it, as a warning."""
    import deepspeed.comm as dist
    from deepspeed.utils import logger
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(choice.reason)
    elif verdict == MISMATCH:
        logger.warning(f"rank {dist.get_rank()}: {choice.reason}")


def choose_fused(setting, tensors, layout: QuantizedReduceLayout, quantizer, world: bool = True) -> bool:
    """Whether this call (its `tensors`, its first run's `layout`) runs the fused kernels under
    `setting` (resolve_fused's), deciding once per key (see the module docstring); `quantizer` is
    the default path's op. With `world` (a collective's call), collective where the world has
    several ranks: every rank's first call of a key must reach it, as every rank's reduce-scatter
    does; without (a simulation in one process), this process's verdict alone, kept apart.

    Raises:
        ValueError: with `setting` True, the fused kernels cannot run here or some rank's check
            found a mismatch; the message names it.
    """
    setting = resolve_fused(setting)
    if setting is False:
        return False
    from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason
    device, dtype = tensors[0].device, tensors[0].dtype
    key = ChoiceKey(device.type, dtype, layout.intra_node_bits, layout.group_elems, layout.num_nodes,
                    layout.local_world_size, world, setting)
    if key in _CHOICES:
        return _CHOICES[key].fused
    what = (f"{str(dtype)[6:]}, {layout.intra_node_bits}/4 bits, groups of {layout.group_elems}, "
            f"{layout.num_nodes} x {layout.local_world_size} ranks, on {device}")
    spelled = "true" if setting is True else f'"{AUTO}"'  # as the config file spells it
    label = f"qgZ zero_quantized_gradients_fused {spelled} ({what})"
    unavailable = fused_unavailable_reason(device.type)
    mismatch = times = None
    if unavailable is None:
        try:  # a failure here is this rank's verdict: raising before the agreement would hang the others
            mismatch = self_check(layout.num_nodes, layout.local_world_size, layout.group_elems,
                                  layout.intra_node_bits, dtype, device)
            if mismatch is None and setting == AUTO:
                times = time_paths(tensors, layout, quantizer)
        except Exception as exc:  # noqa: BLE001 - reported as the check's result
            mismatch = f"the fused kernels failed: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:300]}"
    if unavailable is not None:
        verdict, why = UNAVAILABLE, f"the fused kernels cannot run here: {unavailable}"
    elif mismatch is not None:
        verdict, why = MISMATCH, f"the self-check found a mismatch: {mismatch}"
    else:
        why = "the self-check gave the reference's bits"
        verdict = FASTER
        if times is not None:
            verdict = FASTER if times[0] < times[1] else SLOWER
            why += (f"; one call of the fused kernels {times[0] * 1e3:.2f} ms, of DeepSpeed's kernels "
                    f"{times[1] * 1e3:.2f} ms")
    verdicts = _verdicts(verdict, device) if world else [verdict]
    fused = all(v == FASTER for v in verdicts)
    if not fused and any(v != verdict for v in verdicts):  # some rank holds the world back for its own reason
        why += f"; every rank takes DeepSpeed's kernels: {_held_back(verdicts)}"
    if setting is True and not fused:
        raise ValueError(f"{label}: the fused kernels were asked for, but {why}")
    path = "the fused kernels" if fused else "DeepSpeed's kernels"
    choice = FusedChoice(fused, f"{label}: {path} ({why})")
    _CHOICES[key] = choice
    _log(choice, verdict)
    return fused

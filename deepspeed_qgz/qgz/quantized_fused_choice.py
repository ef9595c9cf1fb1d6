# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Whether this package's quantized gradient reduce-scatter (not run by training) runs the fused
Triton kernels (quantized_fused.py) or DeepSpeed's quantizer kernels with the glue
(quantized_pipeline.py): the setting ``fused=`` of simulate_all_to_all_quant_reduce and
choose_fused (until 0.3.0 the ZeRO config key ``zero_quantized_gradients_fused``, whose name the
INFO line keeps), and for ``"auto"`` and ``true`` the decision the rank's own GPU makes.

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
topology) (ChoiceKey), the group size being the one the call's layout takes (each run of a call's plan
has its own layout: quantized_reduce_plan). A call decides every key of its plan's runs before its
first launch, in the order of the runs, each key at the first call that has it; a key decided before is
looked up. A small synthetic bucket in that dtype, with groups of exactly that size on that topology
(check_layout: every compiled variant the call launches, its tile class and its sum width, is the one
the check runs), node 0's local ranks' tensors (check_inputs: zeros, subnormals, the dtype's largest
and smallest values, the largest with one sign in every partition, so that every node's sum of it
reaches stage 2 alike, exact rounding ties, inf and NaN), goes through each fused stage and the same
stage on the PyTorch reference quantizer (qgz_reference.py) on the same device, compared bit for bit
(NaN equal to NaN; the codes of a group whose scale is NaN, which nothing reads, left out). For
``"auto"`` one call of each path then runs on the run's own tensors, the exchanges left out, and is
timed after a warm-up call. Every rank of the world takes the same decision: each rank's verdict
(faster, slower, a mismatch, an exception, cannot run) meets the others' in one
all-reduce of a world-sized int32 tensor over the default process group, and the fused kernels run
only where every rank's is "faster" (with ``true``: passed the check), so a rank whose check failed
keeps every rank off them. Every rank reaches the same all-reduces at the same call: the plan and its
layouts are functions of the tensors' shapes, which a reduce-scatter's ranks share.

So a process runs at most one check (and one all-reduce) per key, one per distinct group size its
buckets' layouts take: one at the default group size of 136 (whose only group size is 136), at most
one per multiple of 8 from 136 up to a larger configured size. Where the reduce buckets repeat every step (ZeRO-3's do, for a fixed model and backward order)
every check runs in the first step that reduces gradients; a bucket of new tensor shapes at a later
step can bring a new group size, and its check and all-reduce come at that call.

Rank 0 logs the choice, its check's result (on a mismatch: the stage, how many values, the first
differing one's index and both bit patterns), both times and the ranks that held the world back,
once, through DeepSpeed's logger; a rank whose own check found a mismatch logs it as a warning, and a
rank whose check or timing raised an exception (a compile error, an out-of-memory) logs its type,
message and traceback as a warning: that is not a mismatch, and the world falls back to DeepSpeed's
kernels (with ``true``, that rank raises it again after the agreement, and every other rank raises a
ValueError naming the ranks). Nothing runs per call after. A simulation (quantized_simulation.py) decides on its
process's verdict alone, apart from the world's decisions.
"""

import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from deepspeed_qgz.qgz.quantized_layout import (QuantizedReduceLayout, SlotFormat, TensorLayout, resolve_group_size,
                                                resolve_intra_node_bits)

AUTO = "auto"


def resolve_fused(value):
    """The fused setting `value`: False, True or "auto".

    Raises:
        ValueError: any other value.
    """
    if value is True or value is False or value == AUTO:
        return value
    raise ValueError(f"fused {value!r} must be one of true, false or \"auto\"")


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
    group_elems: int  # the run's layout's group size (which fixes the kernels' tile class)
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


def _check_shapes(world: int, group_elems: int) -> List[Tuple[int, int]]:
    """The synthetic bucket's tensor shapes: 3 groups per partition each (the first 6 in a world of one)."""
    return [(max(world, 2) * 3, group_elems), (world, 3 * group_elems)]


def check_inputs(num_nodes: int, local_world_size: int, group_elems: int, dtype: torch.dtype,
                 device) -> List[List[torch.Tensor]]:
    """The tensors of node 0's local ranks in the synthetic bucket: two tensors of 3 whole groups per
    partition each. The first holds a group of zeros, subnormals next to normal values, the dtype's
    largest value with the local rank's sign (node sums that cancel) and its smallest normal value,
    and exact rounding ties of both intra-node precisions in the partition local rank 0 owns, and an
    inf in the partition of the last node's local rank 0; the second, in every partition, the dtype's
    largest value, positive in one group and negative in the next, on every local rank (node sums at
    the dtype's largest times the ranks per node, one sign, reaching stage 2 from every node), and a
    NaN from the last local rank. Only node 0 is built: its local rank 0 receives what it sums from
    these ranks alone, and its node's sums are a valid input of stage 2 (one slot per node), so the
    bucket is 6 * local_world_size * world * group_elems values, not the world's (9 * group_elems in
    a world of one rank, whose partition takes the first tensor's 6 groups)."""
    gen = torch.Generator().manual_seed(1234)
    info = torch.finfo(dtype)
    shapes = _check_shapes(num_nodes * local_world_size, group_elems)
    inputs = []
    for rank in range(local_world_size):
        tensors = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
        flat = tensors[0].view(-1)
        flat[:group_elems] = 0.0
        flat[group_elems:2 * group_elems] *= info.tiny
        flat[group_elems + 1] = info.tiny * info.eps
        flat[2 * group_elems] = info.max * (-1)**rank
        flat[3 * group_elems] = info.tiny
        # ties: the group's largest magnitude 8 makes the scale 16 (8 bits) or 1 (4 bits)
        ties = 3 * group_elems + group_elems // 2
        flat[ties] = 8.0
        flat[ties + 1:ties + 9] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.03125, 0.09375, -0.15625])
        # one sign at the dtype's largest in every partition (rows of the second tensor)
        tensors[1][:, group_elems] = info.max
        tensors[1][:, 2 * group_elems] = -info.max
        inputs.append([t.to(dtype) for t in tensors])
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


def check_layout(num_nodes: int, local_world_size: int, group_elems: int,
                 intra_node_bits: int) -> QuantizedReduceLayout:
    """The synthetic bucket's layout (check_inputs'), with groups of exactly `group_elems` values
    (exact_layout): the call's group size, so the tile class of every launch, and the call's topology,
    so stage 2's sum width."""
    numels = tuple(rows * columns for rows, columns in _check_shapes(num_nodes * local_world_size, group_elems))
    return exact_layout(numels, num_nodes, local_world_size, group_elems, intra_node_bits)


def self_check(num_nodes: int, local_world_size: int, group_elems: int, intra_node_bits: int, dtype: torch.dtype,
               device) -> Optional[str]:
    """The fused stages (pipeline_stages(None, fused=True)) against the same stages
    on the PyTorch reference quantizer, on `device`, bit for bit (see the module docstring): stage 0
    on each of node 0's local ranks (check_inputs), stage 1 on what its local rank 0 receives, stage 2
    on that node's sums; on check_layout, groups of exactly `group_elems` values. None if every stage
    agrees; else the first mismatch. An exception of a stage propagates."""
    from deepspeed_qgz.qgz import qgz_reference
    from deepspeed_qgz.qgz.quantized_pipeline import pipeline_stages
    inputs = check_inputs(num_nodes, local_world_size, group_elems, dtype, device)
    layout = check_layout(num_nodes, local_world_size, group_elems, intra_node_bits)
    assert tuple(t.numel for t in layout.tensors) == tuple(t.numel() for t in inputs[0])
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
    from deepspeed_qgz.qgz.quantized_pipeline import pipeline_stages, quantized_reduce_scatter
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
FASTER, SLOWER, MISMATCH, UNAVAILABLE, RAISED = 0, 1, 2, 3, 4
_SHORT = {
    SLOWER: "the fused kernels slower",
    MISMATCH: "a mismatch",
    UNAVAILABLE: "the fused kernels unavailable",
    RAISED: "an exception",
}


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


def _rank() -> Optional[int]:
    import deepspeed.comm as dist
    return dist.get_rank() if dist.is_initialized() else None


def _log(choice: FusedChoice, verdict: int) -> None:
    """Rank 0's INFO line; a rank whose own check found a mismatch also logs it, as a warning."""
    from deepspeed.utils import logger
    rank = _rank()
    if not rank:
        logger.info(choice.reason)
    elif verdict == MISMATCH:
        logger.warning(f"rank {rank}: {choice.reason}")


def _describe(exc: BaseException) -> str:
    """An exception's type and message, for a log line: the message's lines joined."""
    message = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def choose_fused(setting, tensors, layout: QuantizedReduceLayout, quantizer, world: bool = True) -> bool:
    """Whether one run of a call (its `tensors` and `layout`, one of quantized_reduce_plan's) runs
    the fused kernels under `setting` (resolve_fused's), deciding once per key (see the module
    docstring); `quantizer` is the default path's op. A call decides each of its runs before its
    first launch. With `world` (a collective's call), collective where the world has several ranks:
    every rank's first call of a key must reach it, as every rank's reduce-scatter does; without (a
    simulation in one process), this process's verdict alone, kept apart.

    Raises:
        ValueError: with `setting` True, the fused kernels cannot run here, or some rank's check
            found a mismatch or raised an exception; the message names it.
        Exception: with `setting` True, on a rank whose own check raised it, that exception (after
            the agreement, so that no rank is left waiting).
    """
    setting = resolve_fused(setting)
    if setting is False:
        return False
    from deepspeed_qgz.qgz.quantized_fused import fused_unavailable_reason
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
    mismatch = times = raised = None
    if unavailable is None:
        step = "the self-check"
        try:  # an exception here is this rank's verdict: raising before the agreement would hang the others
            mismatch = self_check(layout.num_nodes, layout.local_world_size, layout.group_elems,
                                  layout.intra_node_bits, dtype, device)
            if mismatch is None and setting == AUTO:
                step = "the timing of the two paths"
                times = time_paths(tensors, layout, quantizer)
        except Exception as exc:  # noqa: BLE001 - reported as what it is, below
            raised = exc
    if unavailable is not None:
        verdict, why = UNAVAILABLE, f"the fused kernels cannot run here: {unavailable}"
    elif raised is not None:
        verdict, why = RAISED, f"{step} raised {_describe(raised)}"
        from deepspeed.utils import logger
        rank = _rank()
        logger.warning(f"{'' if rank is None else f'rank {rank}: '}{label}: {why}",
                       exc_info=(type(raised), raised, raised.__traceback__))
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
        if raised is not None:
            if hasattr(raised, "add_note"):  # Python 3.11 and later
                raised.add_note(f"{label}: the fused kernels were asked for, but {step} raised this")
            raise raised
        raise ValueError(f"{label}: the fused kernels were asked for, but {why}")
    path = "the fused kernels" if fused else "DeepSpeed's kernels"
    choice = FusedChoice(fused, f"{label}: {path} ({why})")
    _CHOICES[key] = choice
    _log(choice, verdict)
    return fused

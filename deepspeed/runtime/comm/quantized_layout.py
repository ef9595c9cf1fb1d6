# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Padding and grouping for the quantized gradient reduce-scatter (ZeRO++ qgZ).

``all_to_all_quant_reduce`` must return what ``reduce_scatter_coalesced`` returns: rank r gets the
elements ``[r * C, min((r + 1) * C, numel))`` of each averaged gradient, ``C = ceil(numel / world)``.
The quantizer kernels instead want every rank's share cut into equal groups whose size suits their
16-byte vectors and unroll tables (deepspeed/ops/quantizer/qgz_contract.py). Padding reconciles the
two, and every padding rule lives here, in one pure cached function, ``quantized_reduce_layout``:

* Partition first. Each tensor's rank-r partition keeps the reduce-scatter boundaries and is padded
  with zeros at its end from ``C`` to a whole number of groups. Padding the whole tensor instead
  would shift every boundary after the first and hand ranks each other's elements.
* One group size per call. A call quantizes all its tensors with one kernel per stage, and a kernel
  call takes one group size, so every tensor of the call is grouped by the same ``group_elems``.
  A rank's *padded partition* is its partitions of all the call's tensors, each padded to whole
  groups, one after the other: no quantization group holds elements of two tensors, so each tensor
  keeps its own scales and precision whatever its neighbours' magnitudes.
* ``group_elems`` is a multiple of ``VECTOR_ELEMS`` (8): a vector never straddles two groups, and an
  int4 group is a whole number of the 4-byte loads quantized_reduction makes. It is at most the
  configured group size (``group_size``; ``DEFAULT_GROUP_SIZE`` unless set, see
  ``resolve_group_size``). Within that bound the layout sends the fewest bytes (``slot_bytes``,
  below): a group costs a 4-byte fp32 scale next to its ``group_elems / 2`` bytes of int4 data, and
  each tensor's last group per partition carries its padding, so the choice weighs scales against
  padding over the whole call. On a tie the smaller group wins: the same bytes (and the same kernel
  work) then carry more scales and less padding.
* Padding bound: a tensor's partition of ``C`` elements takes ``ceil(C / group_elems)`` groups, so
  it gains at most ``group_elems - 1 < group_size`` zeros per rank: under 1% once a partition holds
  100 groups (12.8K elements at groups of 128), a few percent for small partitions on many ranks
  (a 78K-element tensor on 5 x 8 ranks: 4.4%), the fewest bytes either way. The upstream rule
  ``max(shape[0], shape[1], world)`` groups per tensor made accuracy depend on the shape and could
  produce groups the kernels mishandle (GPT-2's 50257 x 768 embedding gives 50257 groups).

What travels is a *slot*: one padded partition, quantized, followed by its scales, in one int4
buffer the kernels read and write as it is. The kernels keep a group's fp32 scale apart from its
int4 data, and a collective moves one contiguous block per peer, so each slot ends in
``scale_groups`` extra groups (*scale groups*) whose bytes hold the slot's ``groups_per_partition``
fp32 scales: ``slot_groups = groups_per_partition + scale_groups`` groups, ``slot_bytes =
slot_groups x group_elems / 2``. The kernels treat the scale groups as data: they enter stage 0 as
zeros and every kernel gets a parameter of 0 for them, so they dequantize to zeros and cost nothing
but their bytes (``4 x groups_per_partition`` rounded up to a group, under 7% of the slot at
groups of 128). The scales are written into them after each kernel. So the kernels' outputs are the
collectives' buffers: nothing is packed before an exchange or gathered after it. The intra-node
all-to-all carries ``world`` slots per rank (every partition, in the kernels' swizzle order), the
inter-node all-to-all ``num_nodes`` node-summed slots.
"""

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from deepspeed.ops.quantizer.qgz_contract import SWIZZLE_MAX_GROUP_ELEMS, VECTOR_ELEMS

QUANT_BITS = 4
SCALE_BYTES = 4

# The largest quantization group, in values, unless the caller or DS_QGZ_GROUP_SIZE says otherwise.
# Chosen from training data: benchmarks/convergence.py, README "Choosing the group size".
DEFAULT_GROUP_SIZE = 128
GROUP_SIZE_ENV = "DS_QGZ_GROUP_SIZE"


def resolve_group_size(group_size: Optional[int] = None) -> int:
    """The largest quantization group for a call: `group_size` if given, else the environment
    variable DS_QGZ_GROUP_SIZE if set, else DEFAULT_GROUP_SIZE.

    Raises:
        ValueError: the value is not a multiple of 8 between 8 and 40960 (the kernels' vector width
            and swizzle_quant's largest launch), or the environment variable is not an integer.
    """
    source = "group_size"
    if group_size is None:
        text = os.environ.get(GROUP_SIZE_ENV)
        if text is None:
            return DEFAULT_GROUP_SIZE
        source = GROUP_SIZE_ENV
        try:
            group_size = int(text)
        except ValueError:
            raise ValueError(f"{GROUP_SIZE_ENV}={text!r} is not an integer") from None
    if not (VECTOR_ELEMS <= group_size <= SWIZZLE_MAX_GROUP_ELEMS and group_size % VECTOR_ELEMS == 0):
        raise ValueError(f"{source} {group_size} must be a multiple of {VECTOR_ELEMS} between {VECTOR_ELEMS} and "
                         f"{SWIZZLE_MAX_GROUP_ELEMS} (the kernels' vector width and largest group)")
    return group_size


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor's partitions sit in the padded partition."""
    numel: int
    partition: int  # C: elements of each rank's reduce-scatter partition (the last ones may be short)
    num_groups: int  # quantization groups of each padded partition of this tensor
    offset: int  # first element of this tensor's groups in the padded partition

    def partition_numel(self, rank: int) -> int:
        """Elements of `rank`'s partition that exist in the tensor (reduce_scatter_coalesced's)."""
        return max(0, min(self.partition, self.numel - rank * self.partition))


@dataclass(frozen=True)
class QuantizedReduceLayout:
    """The padded, grouped layout of one quantized reduce-scatter call (see the module docstring).
    Sizes derived from the fields are properties; buffers are cut only through the accessors below,
    which check the buffer's size against the layout."""
    num_nodes: int
    local_world_size: int
    group_elems: int
    tensors: Tuple[TensorLayout, ...]

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size

    @property
    def groups_per_partition(self) -> int:
        return sum(t.num_groups for t in self.tensors)

    @property
    def padded_partition(self) -> int:
        """Elements of a rank's padded partition: every tensor's partition padded to whole groups."""
        return self.groups_per_partition * self.group_elems

    def padding(self, index: int) -> int:
        """Zeros after tensor `index`'s partition in every padded partition."""
        tensor = self.tensors[index]
        return tensor.num_groups * self.group_elems - tensor.partition

    @property
    def scale_groups(self) -> int:
        """Groups at the end of each slot that carry its scales (see the module docstring)."""
        return _scale_groups(self.groups_per_partition, self.group_elems)

    @property
    def slot_groups(self) -> int:
        return self.groups_per_partition + self.scale_groups

    @property
    def slot_elems(self) -> int:
        """Values the kernels process per slot: the padded partition and its scale groups."""
        return self.slot_groups * self.group_elems

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: int4 data, then the fp32 scales (in the scale groups)."""
        return self.slot_elems * QUANT_BITS // 8

    @property
    def padding_elems(self) -> int:
        """Zeros added across all ranks' padded partitions."""
        return self.world_size * self.padded_partition - sum(t.numel for t in self.tensors)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes each rank sends to the other ranks of its node."""
        return (self.local_world_size - 1) * self.num_nodes * self.slot_bytes

    @property
    def inter_node_bytes(self) -> int:
        """Bytes each rank sends to ranks on other nodes."""
        return (self.num_nodes - 1) * self.slot_bytes

    # -- accessors -------------------------------------------------------------------------------

    def _check(self, buffer: torch.Tensor, last: int, what: str) -> None:
        if buffer.shape[-1] != last:
            raise ValueError(f"{what}: expected a last dimension of {last} for this layout "
                             f"({self.num_nodes} nodes x {self.local_world_size}, {len(self.tensors)} tensors, "
                             f"{self.group_elems} per group), got shape {tuple(buffer.shape)}")

    def slot_scales(self, slots: torch.Tensor) -> torch.Tensor:
        """The fp32 scales of every slot in `slots` ([..., slot_bytes] int8), held in its scale
        groups, as a [..., groups_per_partition] view."""
        self._check(slots, self.slot_bytes, "slot_scales")
        start = self.padded_partition * QUANT_BITS // 8
        return slots[..., start:start + self.groups_per_partition * SCALE_BYTES].view(torch.float32)

    def grouped(self, slots: torch.Tensor) -> torch.Tensor:
        """[..., slot_elems] values (a padded partition and its scale groups) as a
        [..., slot_groups, group_elems] view."""
        self._check(slots, self.slot_elems, "grouped")
        return slots.view(*slots.shape[:-1], self.slot_groups, self.group_elems)

    def data_groups(self, slots: torch.Tensor) -> torch.Tensor:
        """The padded partition's groups of [..., slot_elems] values: a [..., groups_per_partition,
        group_elems] view without the scale groups."""
        return self.grouped(slots)[..., :self.groups_per_partition, :]

    def partition(self, padded_partition: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """Tensor `index`'s real elements in `rank`'s padded partition ([padded_partition]; a 1-D view)."""
        self._check(padded_partition, self.padded_partition, "partition")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"partition: rank {rank} outside the world of {self.world_size}")
        tensor = self.tensors[index]
        return padded_partition.narrow(-1, tensor.offset, tensor.partition_numel(rank))

    def partitions(self, padded_partition: torch.Tensor, rank: int) -> List[torch.Tensor]:
        """Every tensor's real elements in `rank`'s padded partition, in order (1-D views)."""
        return [self.partition(padded_partition, i, rank) for i in range(len(self.tensors))]


def _scale_groups(groups_per_partition: int, group_elems: int) -> int:
    return -(-groups_per_partition * SCALE_BYTES * 8 // (group_elems * QUANT_BITS))


def _slot_bytes(partitions: Tuple[int, ...], group_elems: int) -> int:
    groups = sum(-(-c // group_elems) for c in partitions)
    return (groups + _scale_groups(groups, group_elems)) * group_elems * QUANT_BITS // 8


@lru_cache(maxsize=1024)
def quantized_reduce_layout(numels: Tuple[int, ...], num_nodes: int, local_world_size: int,
                            group_size: int) -> QuantizedReduceLayout:
    """The layout of one quantized reduce-scatter of tensors of `numels` elements over `num_nodes`
    x `local_world_size` ranks, with groups of at most `group_size` values. Pure, and cached:
    ZeRO-3 repeats the same buckets.

    Raises:
        ValueError: a topology size below 1, a tensor without elements, or a group size outside
            resolve_group_size's range.
    """
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError(f"every tensor needs at least one element, got numels {numels}")
    group_size = resolve_group_size(group_size)
    world = num_nodes * local_world_size
    partitions = tuple(math.ceil(n / world) for n in numels)
    # fewest bytes on the wire; on a tie the smaller group
    group_elems = min(range(VECTOR_ELEMS, group_size + 1, VECTOR_ELEMS),
                      key=lambda elems: (_slot_bytes(partitions, elems), elems))
    tensors, offset = [], 0
    for numel, partition in zip(numels, partitions):
        num_groups = -(-partition // group_elems)
        tensors.append(TensorLayout(numel, partition, num_groups, offset))
        offset += num_groups * group_elems
    return QuantizedReduceLayout(num_nodes, local_world_size, group_elems, tuple(tensors))

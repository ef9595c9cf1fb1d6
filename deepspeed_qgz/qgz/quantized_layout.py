# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Padding and grouping for the quantized gradient reduce-scatter (ZeRO++ qgZ).

``all_to_all_quant_reduce`` must return what ``reduce_scatter_coalesced`` returns: rank r gets the
elements ``[r * C, min((r + 1) * C, numel))`` of each averaged gradient, ``C = ceil(numel / world)``.
The quantizer kernels instead want every rank's share cut into equal groups whose size suits their
launch geometry (deepspeed_qgz/qgz/qgz_contract.py). Padding reconciles the two, and every
padding rule lives here, in one pure cached function, ``quantized_reduce_layout``:

* Partition first. Each tensor's rank-r partition keeps the reduce-scatter boundaries and is padded
  with zeros at its end from ``C`` to a whole number of groups. Padding the whole tensor instead
  would shift every boundary after the first and hand ranks each other's elements.
* One group size per call. A call quantizes all its tensors with one kernel per stage, and a kernel
  call takes one group size, so every tensor of the call is grouped by the same ``group_elems``.
  A rank's *padded partition* is its partitions of all the call's tensors, each padded to whole
  groups, one after the other: no quantization group holds elements of two tensors, so each tensor
  keeps its own scales and precision whatever its neighbours' magnitudes.
* ``group_elems`` is a multiple of ``VECTOR_ELEMS`` (8): a vector never straddles two groups, and a
  group is a whole number of the loads quantized_reduction makes.
* ``group_elems`` is at least ``MIN_GROUP_SIZE`` (136). quantized_reduction launches one thread per
  8 values of an output group, with no minimum, and reduces the group's absmax with shuffles over
  a whole warp, which CUDA leaves undefined in a block of fewer than 32 threads. 136 values is the
  smallest group that launches a whole warp (``qgz_contract.reduce_min_out_group_elems``).
* ``group_elems`` is at most the configured group size (``group_size``; ``DEFAULT_GROUP_SIZE``
  unless set, see ``resolve_group_size``). Within those bounds the layout sends the fewest bytes
  across nodes: a group costs a 4-byte fp32 scale next to its ``group_elems / 2`` bytes of int4
  codes, and each tensor's last group per partition carries its padding, so the choice weighs
  scales against padding over the whole call. On a tie the smaller group wins: the same bytes then
  carry more scales and less padding.
* Padding bound: a tensor's partition of ``C`` elements takes ``ceil(C / group_elems)`` groups, so
  it gains fewer than ``group_elems`` zeros per rank.

What travels is a *slot*: one padded partition, quantized, followed by its scales, in one buffer
the kernels read and write as it is. The kernels keep a group's fp32 scale apart from its codes,
and a collective moves one contiguous block per peer, so each slot ends in ``scale_groups`` extra
groups (*scale groups*) whose bytes hold the slot's ``groups_per_partition`` fp32 scales. The
kernels treat the scale groups as data: they enter quantization as zeros and every kernel gets a
parameter of 0 for them, so they dequantize to zeros and cost nothing but their bytes. The scales
are written into them after each kernel. So the kernels' outputs are the collectives' buffers:
nothing is packed before an exchange or gathered after it.

A call has two slot formats (``SlotFormat``): ``intra``, the codes of ``intra_node_bits`` (4 or 8)
that the intra-node all-to-all carries (``world`` slots per rank, every partition, in the kernels'
swizzle order), and ``inter``, the int4 codes of the node sums that the inter-node all-to-all
carries (``num_nodes`` slots per rank). At 8 bits a group's scale takes half as many code bytes'
worth of a group, so the two formats have different numbers of scale groups.

A scale is fp32 whatever the gradients' dtype, and a node sum can reach ``local_world_size`` times
the dtype's largest value: for bf16 and fp32 gradients more than an fp32 scale holds once a node has
more than 4 ranks. So the ``inter`` slots carry each node sum's scale divided by
``2**inter_scale_shift`` (0 up to 4 ranks per node, then 1 up to 8, 2 up to 16, ...), which keeps
every node sum of finite gradients representable; the receiving side multiplies it back. The
shift is a power of two, exact wherever the shifted scale stays a normal fp32 number, so it costs
nothing above 2**-120 or so.
"""

import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import List, Optional, Tuple

import torch

from deepspeed_qgz.qgz.qgz_contract import SWIZZLE_MAX_GROUP_ELEMS, VECTOR_ELEMS, reduce_min_out_group_elems

# The inter-node exchange always carries int4 codes; the intra-node exchange int4 or int8.
INTER_NODE_BITS = 4
INTRA_NODE_BITS = (4, 8)
# int4 inside the node by default: DeepSpeed's wire format, which the series' option (0011) keeps
DEFAULT_INTRA_NODE_BITS = 4
SCALE_BYTES = 4

# The smallest group quantized_reduction reduces with a whole warp (see the module docstring).
MIN_GROUP_SIZE = reduce_min_out_group_elems(INTER_NODE_BITS)
# The largest quantization group, in values, and the intra-node precision, unless the caller says
# otherwise.
DEFAULT_GROUP_SIZE = MIN_GROUP_SIZE


def resolve_group_size(group_size: Optional[int] = None, name: str = "group_size") -> int:
    """The largest quantization group for a call: `group_size`, or DEFAULT_GROUP_SIZE if None.

    Raises:
        ValueError: the value (named `name` in the message) is not a multiple of 8 between
            MIN_GROUP_SIZE and 40960: the kernels' vector width, a warp of quantized_reduction
            threads, swizzle_quant's largest launch.
    """
    if group_size is None:
        return DEFAULT_GROUP_SIZE
    if not (isinstance(group_size, int) and MIN_GROUP_SIZE <= group_size <= SWIZZLE_MAX_GROUP_ELEMS
            and group_size % VECTOR_ELEMS == 0):
        raise ValueError(f"{name} {group_size!r} must be a multiple of {VECTOR_ELEMS} between {MIN_GROUP_SIZE} and "
                         f"{SWIZZLE_MAX_GROUP_ELEMS} (the kernels' vector width, the smallest group "
                         f"quantized_reduction reduces with a whole warp, swizzle_quant's largest group)")
    return group_size


def resolve_intra_node_bits(intra_node_bits: Optional[int] = None) -> int:
    """The precision of the intra-node exchange: `intra_node_bits`, or DEFAULT_INTRA_NODE_BITS if None.

    Raises:
        ValueError: the value is not one of INTRA_NODE_BITS.
    """
    if intra_node_bits is None:
        return DEFAULT_INTRA_NODE_BITS
    if intra_node_bits not in INTRA_NODE_BITS or not isinstance(intra_node_bits, int):
        raise ValueError(f"intra_node_bits {intra_node_bits!r} must be one of {INTRA_NODE_BITS}")
    return intra_node_bits


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


def _check_last_dim(buffer: torch.Tensor, last: int, what: str, context: str) -> None:
    if buffer.shape[-1] != last:
        raise ValueError(f"{what}: expected a last dimension of {last} for {context}, got shape {tuple(buffer.shape)}")


@dataclass(frozen=True)
class SlotFormat:
    """One padded partition quantized to `bits` bits: its groups' codes, then the scale groups
    that hold its fp32 scales (see the module docstring). Buffers are cut only through the
    accessors, which check the buffer's size against the format."""
    bits: int
    group_elems: int
    groups_per_partition: int

    @property
    def group_bytes(self) -> int:
        return self.group_elems * self.bits // 8

    @property
    def scale_groups(self) -> int:
        """Groups at the end of each slot whose bytes hold its scales."""
        return -(-self.groups_per_partition * SCALE_BYTES // self.group_bytes)

    @property
    def slot_groups(self) -> int:
        return self.groups_per_partition + self.scale_groups

    @property
    def slot_elems(self) -> int:
        """Values the kernels process per slot: the padded partition and its scale groups."""
        return self.slot_groups * self.group_elems

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot: the codes, then the fp32 scales (in the scale groups)."""
        return self.slot_groups * self.group_bytes

    def _context(self) -> str:
        return (f"{self.bits}-bit slots of {self.groups_per_partition} groups of {self.group_elems} "
                f"(+{self.scale_groups} scale groups)")

    def scales(self, slots: torch.Tensor) -> torch.Tensor:
        """The fp32 scales of every slot in `slots` ([..., slot_bytes] int8), held in its scale
        groups, as a [..., groups_per_partition] view."""
        _check_last_dim(slots, self.slot_bytes, "scales", self._context())
        start = self.groups_per_partition * self.group_bytes
        return slots[..., start:start + self.groups_per_partition * SCALE_BYTES].view(torch.float32)

    def grouped(self, values: torch.Tensor) -> torch.Tensor:
        """[..., slot_elems] values (a padded partition and its scale groups) as a
        [..., slot_groups, group_elems] view."""
        _check_last_dim(values, self.slot_elems, "grouped", self._context())
        return values.view(*values.shape[:-1], self.slot_groups, self.group_elems)

    def data_groups(self, values: torch.Tensor) -> torch.Tensor:
        """The padded partition's groups of [..., slot_elems] values: a [..., groups_per_partition,
        group_elems] view without the scale groups."""
        return self.grouped(values)[..., :self.groups_per_partition, :]

    def kernel_params(self, scales: torch.Tensor) -> torch.Tensor:
        """Per-group kernel parameters for whole slots from [..., groups_per_partition] scales: each
        slot's scales, then 0 for each of its scale groups (which then dequantize to zeros), as a
        contiguous [-1, 1] fp32 tensor."""
        _check_last_dim(scales, self.groups_per_partition, "kernel_params", self._context())
        return torch.nn.functional.pad(scales, (0, self.scale_groups)).view(-1, 1)


@dataclass(frozen=True)
class QuantizedReduceLayout:
    """The padded, grouped layout of one quantized reduce-scatter call (see the module docstring).
    Sizes derived from the fields are properties; buffers are cut only through the accessors, here
    and in the slot formats, which check the buffer's size against the layout."""
    num_nodes: int
    local_world_size: int
    group_elems: int
    intra_node_bits: int
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
    def padding_elems(self) -> int:
        """Zeros added across all ranks' padded partitions."""
        return self.world_size * self.padded_partition - sum(t.numel for t in self.tensors)

    @cached_property
    def intra(self) -> SlotFormat:
        """The slots of the intra-node exchange (intra_node_bits)."""
        return SlotFormat(self.intra_node_bits, self.group_elems, self.groups_per_partition)

    @cached_property
    def inter(self) -> SlotFormat:
        """The slots of the inter-node exchange (int4 node sums)."""
        return SlotFormat(INTER_NODE_BITS, self.group_elems, self.groups_per_partition)

    @property
    def inter_scale_shift(self) -> int:
        """The ``inter`` slots' scales are the node sums' divided by 2**inter_scale_shift (see the
        module docstring): the smallest shift with local_world_size / 2**shift <= 4."""
        return max(0, (self.local_world_size - 1).bit_length() - 2)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes each rank sends to the other ranks of its node."""
        return (self.local_world_size - 1) * self.num_nodes * self.intra.slot_bytes

    @property
    def inter_node_bytes(self) -> int:
        """Bytes each rank sends to ranks on other nodes."""
        return (self.num_nodes - 1) * self.inter.slot_bytes

    def partition(self, padded_partition: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """Tensor `index`'s real elements in `rank`'s padded partition ([padded_partition]; a 1-D view)."""
        _check_last_dim(padded_partition, self.padded_partition, "partition",
                        f"{self.num_nodes} x {self.local_world_size} ranks, {len(self.tensors)} tensors")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"partition: rank {rank} outside the world of {self.world_size}")
        tensor = self.tensors[index]
        return padded_partition.narrow(-1, tensor.offset, tensor.partition_numel(rank))

    def partitions(self, padded_partition: torch.Tensor, rank: int) -> List[torch.Tensor]:
        """Every tensor's real elements in `rank`'s padded partition, in order (1-D views)."""
        return [self.partition(padded_partition, i, rank) for i in range(len(self.tensors))]


@lru_cache(maxsize=1024)
def quantized_reduce_layout(numels: Tuple[int, ...],
                            num_nodes: int,
                            local_world_size: int,
                            group_size: int,
                            intra_node_bits: int = DEFAULT_INTRA_NODE_BITS) -> QuantizedReduceLayout:
    """The layout of one quantized reduce-scatter of tensors of `numels` elements over `num_nodes`
    x `local_world_size` ranks, with groups of at most `group_size` values and `intra_node_bits`
    codes inside each node. Pure, and cached: ZeRO-3 repeats the same buckets.

    Raises:
        ValueError: a topology size below 1, a tensor without elements, a group size outside
            resolve_group_size's range, or intra_node_bits outside INTRA_NODE_BITS.
    """
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError(f"every tensor needs at least one element, got numels {numels}")
    group_size = resolve_group_size(group_size)
    intra_node_bits = resolve_intra_node_bits(intra_node_bits)
    world = num_nodes * local_world_size
    partitions = tuple(math.ceil(n / world) for n in numels)

    def inter_slot_bytes(elems):
        return SlotFormat(INTER_NODE_BITS, elems, sum(-(-c // elems) for c in partitions)).slot_bytes

    # fewest bytes across nodes; on a tie the smaller group
    group_elems = min(range(MIN_GROUP_SIZE, group_size + 1, VECTOR_ELEMS),
                      key=lambda elems: (inter_slot_bytes(elems), elems))
    tensors, offset = [], 0
    for numel, partition in zip(numels, partitions):
        num_groups = -(-partition // group_elems)
        tensors.append(TensorLayout(numel, partition, num_groups, offset))
        offset += num_groups * group_elems
    return QuantizedReduceLayout(num_nodes, local_world_size, group_elems, intra_node_bits, tuple(tensors))

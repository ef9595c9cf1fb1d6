# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
Padding and grouping for the quantized gradient reduce-scatter (ZeRO++ qgZ).

``all_to_all_quant_reduce`` must return what ``reduce_scatter_coalesced`` returns: rank r gets the
elements ``[r * C, min((r + 1) * C, numel))`` of the averaged gradient, ``C = ceil(numel / world)``.
The quantizer kernels instead want every rank's share cut into equal groups whose size suits their
16-byte vectors and unroll tables (deepspeed/ops/quantizer/qgz_contract.py). Padding reconciles the
two, and every padding rule lives here:

* Partition first. Each rank's partition keeps the reduce-scatter boundaries and is padded with
  zeros at its end from ``C`` to ``P = groups * group_elems``. Padding the whole tensor instead
  would shift every boundary after the first and hand ranks each other's elements.
* ``group_elems`` is a multiple of ``VECTOR_ELEMS`` (8): a vector never straddles two groups, and
  an int4 group is a whole number of the 4-byte loads quantized_reduction makes.
* Groups hold at most ``TARGET_GROUP_ELEMS`` (1024) values, whatever the tensor's shape. Upstream's
  ``max(shape[0], shape[1], world)`` groups per tensor made accuracy depend on the shape and could
  produce groups the kernels mishandle (GPT-2's 50257 x 768 embedding gives 50257 groups). A group
  costs a 4-byte fp32 scale next to its ``group_elems / 2`` bytes of int4 data: 1024 keeps scales
  under 1% of the traffic.
* Among group counts from the fewest possible up to twice that, the layout sending the fewest bytes
  (data plus scales) is taken. The fewest-groups layout alone bounds the padding: with
  ``g = ceil(C / 1024)`` groups, ``P - C <= 8 * g - 1`` (rounding ``ceil(C / g)`` up to the vector
  width adds at most 7 per group); choosing a layout with no more bytes keeps that bound.
* All tensors of one call share one exchange. A rank's *slot* (what it sends to one peer in each
  all-to-all) holds, for every tensor, the fp32 scales of the peer's partition first and then its
  int4 data. Scale and data sizes are multiples of 4 bytes, so every offset stays fp32-aligned and
  the scales travel in the same collective as the data.

The same slot layout serves both stages: in the intra-node stage a rank sends each local peer the
slots of the partitions that peer owns on every node; in the inter-node stage it sends each node the
node-reduced slot of its counterpart.
"""

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Tuple

from deepspeed.ops.quantizer.qgz_contract import VECTOR_ELEMS

TARGET_GROUP_ELEMS = 1024
QUANT_BITS = 4
SCALE_BYTES = 4


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor's partitions sit in the quantized exchange."""
    numel: int
    partition: int  # C: elements of each rank's reduce-scatter partition (the last ones may be short)
    groups: int  # quantization groups per partition
    group_elems: int  # elements per quantization group
    scale_offset: int  # byte offset of this tensor's scales within a slot
    data_offset: int  # byte offset of this tensor's int4 data within a slot

    @property
    def padded_partition(self) -> int:
        return self.groups * self.group_elems

    @property
    def data_bytes(self) -> int:
        return self.padded_partition * QUANT_BITS // 8

    @property
    def scale_bytes(self) -> int:
        return self.groups * SCALE_BYTES

    def partition_numel(self, rank: int) -> int:
        """Elements of `rank`'s partition that exist in the tensor (reduce_scatter_coalesced's)."""
        return max(0, min(self.partition, self.numel - rank * self.partition))


@dataclass(frozen=True)
class QuantizedReduceLayout:
    num_nodes: int
    local_world_size: int
    tensors: Tuple[TensorLayout, ...]
    slot_bytes: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size

    @property
    def scale_bytes(self) -> int:
        """Bytes of fp32 scales at the start of each slot (every tensor's, in order)."""
        return sum(t.scale_bytes for t in self.tensors)

    @property
    def padding_elems(self) -> int:
        """Zeros added across all ranks' partitions."""
        return sum(self.world_size * t.padded_partition - t.numel for t in self.tensors)

    @property
    def intra_node_bytes(self) -> int:
        """Bytes each rank sends to the other ranks of its node."""
        return (self.local_world_size - 1) * self.num_nodes * self.slot_bytes

    @property
    def inter_node_bytes(self) -> int:
        """Bytes each rank sends to ranks on other nodes."""
        return (self.num_nodes - 1) * self.slot_bytes


def _partition_groups(partition: int) -> Tuple[int, int]:
    """(groups, group_elems) for one partition of `partition` elements: the fewest bytes on the
    wire among 1x to 2x the minimum group count (see the module docstring)."""
    fewest = max(1, math.ceil(partition / TARGET_GROUP_ELEMS))
    best = None
    for groups in range(fewest, 2 * fewest + 1):
        group_elems = VECTOR_ELEMS * math.ceil(math.ceil(partition / groups) / VECTOR_ELEMS)
        wire_bytes = groups * group_elems * QUANT_BITS // 8 + groups * SCALE_BYTES
        if best is None or wire_bytes < best[0]:
            best = (wire_bytes, groups, group_elems)
    return best[1], best[2]


@lru_cache(maxsize=256)
def quantized_reduce_layout(numels: Tuple[int, ...], num_nodes: int, local_world_size: int) -> QuantizedReduceLayout:
    """The padded, grouped layout of one quantized reduce-scatter of tensors of `numels` elements
    over `num_nodes` x `local_world_size` ranks. Pure, and cached: ZeRO-3 repeats the same buckets."""
    if num_nodes < 1 or local_world_size < 1:
        raise ValueError(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be >= 1")
    if any(n < 1 for n in numels):
        raise ValueError(f"every tensor needs at least one element, got numels {numels}")
    world = num_nodes * local_world_size
    scale_offset = 0
    shapes = []
    for numel in numels:
        partition = math.ceil(numel / world)
        groups, group_elems = _partition_groups(partition)
        shapes.append((numel, partition, groups, group_elems, scale_offset))
        scale_offset += groups * SCALE_BYTES
    data_offset = scale_offset
    tensors = []
    for numel, partition, groups, group_elems, scale_off in shapes:
        tensors.append(TensorLayout(numel, partition, groups, group_elems, scale_off, data_offset))
        data_offset += groups * group_elems * QUANT_BITS // 8
    return QuantizedReduceLayout(num_nodes, local_world_size, tuple(tensors), data_offset)

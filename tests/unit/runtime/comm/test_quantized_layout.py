# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The qgZ layout is pure: these tests need no processes."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from deepspeed.ops.quantizer import qgz_contract as contract
from deepspeed.runtime.comm.quantized_layout import (QUANT_BITS, TARGET_GROUP_ELEMS, quantized_reduce_layout)

numels = st.lists(st.integers(min_value=1, max_value=5_000_000), min_size=1, max_size=6)
topology = st.tuples(st.integers(min_value=1, max_value=16), st.integers(min_value=1, max_value=16))


def kernel_calls(layout):
    """The three kernel calls all_to_all_quant_reduce makes per tensor, as contract checks."""
    n, d, w = layout.num_nodes, layout.local_world_size, layout.world_size
    for t in layout.tensors:
        yield contract.swizzle_quant_violations(w * t.padded_partition, w * t.groups, QUANT_BITS, 1, n, d)
        yield contract.quantized_reduction_violations(d * n * t.data_bytes, d * n * t.groups, d * n * t.groups,
                                                      n * t.groups, QUANT_BITS, 1, d)
        yield contract.dequantize_violations(n * t.data_bytes, n * t.groups, n * t.groups, QUANT_BITS, 1)


@settings(max_examples=400, deadline=None)
@given(numels, topology)
def test_layout_meets_kernel_contract(numels, topology):
    num_nodes, local_size = topology
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size)
    for problems in kernel_calls(layout):
        assert problems == []


@settings(max_examples=400, deadline=None)
@given(numels, topology)
def test_layout_keeps_partitions_and_bounds_padding(numels, topology):
    num_nodes, local_size = topology
    world = num_nodes * local_size
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size)
    for numel, t in zip(numels, layout.tensors):
        assert t.partition == math.ceil(numel / world)
        assert sum(t.partition_numel(r) for r in range(world)) == numel
        assert t.padded_partition >= t.partition
        assert t.group_elems % contract.VECTOR_ELEMS == 0 and t.group_elems <= TARGET_GROUP_ELEMS
        fewest_groups = math.ceil(t.partition / TARGET_GROUP_ELEMS)
        assert t.padded_partition - t.partition <= 8 * fewest_groups - 1
    # slot: all scales, then all data, fp32-aligned and non-overlapping
    offset = 0
    for t in layout.tensors:
        assert t.scale_offset == offset
        offset += t.scale_bytes
    for t in layout.tensors:
        assert t.data_offset == offset and t.data_offset % 4 == 0
        offset += t.data_bytes
    assert layout.slot_bytes == offset


@pytest.mark.parametrize("numel", [65536, 50257 * 768, 4096 * 11008, 151936 * 3584])
@pytest.mark.parametrize("num_nodes,local_size", [(3, 2), (2, 8), (3, 8), (5, 8)])
def test_padding_under_one_percent_for_large_tensors(numel, num_nodes, local_size):
    layout = quantized_reduce_layout((numel, ), num_nodes, local_size)
    assert layout.padding_elems <= 0.01 * numel


def test_gpt2_embedding_layout():
    # upstream: max(50257, 768, world) = 50257 groups, not divisible by any even world size
    layout = quantized_reduce_layout((50257 * 768, ), 3, 2)
    (t, ) = layout.tensors
    assert t.group_elems <= TARGET_GROUP_ELEMS and t.padded_partition >= math.ceil(50257 * 768 / 6)


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="num_nodes"):
        quantized_reduce_layout((10, ), 0, 2)
    with pytest.raises(ValueError, match="at least one element"):
        quantized_reduce_layout((0, ), 3, 2)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The qgZ layout is pure: these tests need no processes."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed.ops.quantizer import qgz_contract as contract
from deepspeed.runtime.comm.quantized_layout import (DEFAULT_GROUP_SIZE, GROUP_SIZE_ENV, QUANT_BITS, SCALE_BYTES,
                                                     quantized_reduce_layout, resolve_group_size)

numels = st.lists(st.integers(min_value=1, max_value=5_000_000), min_size=1, max_size=6)
topology = st.tuples(st.integers(min_value=1, max_value=16), st.integers(min_value=1, max_value=16))
group_sizes = st.one_of(st.sampled_from([8, 128, 256, 1024, contract.SWIZZLE_MAX_GROUP_ELEMS]),
                        st.integers(1, contract.SWIZZLE_MAX_GROUP_ELEMS // 8).map(lambda k: 8 * k))


def kernel_calls(layout):
    """The three kernel calls all_to_all_quant_reduce makes per call, as contract checks."""
    n, d, w = layout.num_nodes, layout.local_world_size, layout.world_size
    groups = layout.slot_groups
    yield contract.swizzle_quant_violations(w * layout.slot_elems, w * groups, QUANT_BITS, 1, n, d)
    yield contract.quantized_reduction_violations(d * n * layout.slot_bytes, d * n * groups, d * n * groups,
                                                  n * groups, QUANT_BITS, contract.SYMMETRIC, d)
    yield contract.dequantize_violations(n * layout.slot_bytes, n * groups, n * groups, QUANT_BITS, contract.SYMMETRIC)


@settings(max_examples=300, deadline=None)
@given(numels, topology, group_sizes)
def test_layout_meets_kernel_contract(numels, topology, group_size):
    num_nodes, local_size = topology
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size)
    for problems in kernel_calls(layout):
        assert problems == []


@settings(max_examples=300, deadline=None)
@given(numels, topology, group_sizes)
def test_layout_keeps_partitions_and_bounds_padding(numels, topology, group_size):
    num_nodes, local_size = topology
    world = num_nodes * local_size
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size)
    assert layout.group_elems % contract.VECTOR_ELEMS == 0 and layout.group_elems <= group_size
    offset = 0
    for i, (numel, t) in enumerate(zip(numels, layout.tensors)):
        assert t.partition == math.ceil(numel / world)
        assert sum(t.partition_numel(r) for r in range(world)) == numel
        # whole groups, no group shared with the next tensor, fewer than a group of padding
        assert t.offset == offset and t.offset % layout.group_elems == 0
        assert 0 <= layout.padding(i) < layout.group_elems
        offset += t.num_groups * layout.group_elems
    assert layout.padded_partition == offset
    # the scale groups hold every scale, fp32-aligned, and no more groups than that takes
    scale_bytes = layout.groups_per_partition * SCALE_BYTES
    group_bytes = layout.group_elems * QUANT_BITS // 8
    assert (layout.padded_partition * QUANT_BITS // 8) % 4 == 0
    assert layout.scale_groups * group_bytes >= scale_bytes > (layout.scale_groups - 1) * group_bytes
    assert layout.slot_bytes == layout.slot_groups * group_bytes


def wire_bytes(numels, world, group_elems):
    """Bytes of a slot: the groups' int4 data and their fp32 scales, rounded up to whole groups."""
    groups = sum(math.ceil(math.ceil(n / world) / group_elems) for n in numels)
    group_bytes = group_elems * QUANT_BITS // 8
    return math.ceil((groups * group_bytes + groups * SCALE_BYTES) / group_bytes) * group_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=5), topology, st.sampled_from([64, 128, 256, 1024]))
def test_layout_sends_the_fewest_bytes_within_the_group_size(numels, topology, group_size):
    num_nodes, local_size = topology
    world = num_nodes * local_size
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size)
    chosen = wire_bytes(numels, world, layout.group_elems)
    assert layout.slot_bytes == chosen
    assert all(chosen <= wire_bytes(numels, world, g) for g in range(8, group_size + 1, 8))


@pytest.mark.parametrize("numel", [50257 * 768, 4096 * 11008, 151936 * 3584])
@pytest.mark.parametrize("num_nodes,local_size", [(3, 2), (2, 8), (3, 8), (5, 8)])
@pytest.mark.parametrize("group_size", [128, 1024])
def test_padding_under_one_percent_for_large_tensors(numel, num_nodes, local_size, group_size):
    layout = quantized_reduce_layout((numel, ), num_nodes, local_size, group_size)
    assert layout.padding_elems <= 0.01 * numel


def test_gpt2_embedding_layout():
    # upstream: max(50257, 768, world) = 50257 groups, not divisible by any even world size
    layout = quantized_reduce_layout((50257 * 768, ), 3, 2, DEFAULT_GROUP_SIZE)
    assert layout.group_elems <= DEFAULT_GROUP_SIZE and layout.padded_partition >= math.ceil(50257 * 768 / 6)


def test_accessors_refuse_buffers_of_another_layout():
    layout = quantized_reduce_layout((100, 37), 3, 2, 128)
    slots = torch.zeros(6, layout.slot_bytes, dtype=torch.int8)
    layout.slot_scales(slots).fill_(1.0)
    # the scales sit right after the padded partition's int4 data, in the scale groups
    data_bytes = layout.padded_partition * QUANT_BITS // 8
    assert slots[:, :data_bytes].eq(0).all() and slots[:, data_bytes:].ne(0).any()
    assert layout.slot_scales(slots).shape == (6, layout.groups_per_partition)
    with pytest.raises(ValueError, match=f"expected a last dimension of {layout.slot_bytes}"):
        layout.slot_scales(torch.zeros(6, layout.slot_bytes + 4, dtype=torch.int8))
    values = torch.zeros(2, layout.slot_elems)
    assert layout.data_groups(values).shape == (2, layout.groups_per_partition, layout.group_elems)
    padded = torch.arange(layout.padded_partition, dtype=torch.float32)
    assert layout.partitions(padded, 5)[1].numel() == 37 - 5 * math.ceil(37 / 6)
    with pytest.raises(ValueError, match="rank 6 outside the world of 6"):
        layout.partition(padded, 0, 6)


def test_group_size_setting(monkeypatch):
    monkeypatch.delenv(GROUP_SIZE_ENV, raising=False)
    assert resolve_group_size() == DEFAULT_GROUP_SIZE and resolve_group_size(256) == 256
    monkeypatch.setenv(GROUP_SIZE_ENV, "512")
    assert resolve_group_size() == 512 and resolve_group_size(64) == 64
    monkeypatch.setenv(GROUP_SIZE_ENV, "big")
    with pytest.raises(ValueError, match="DS_QGZ_GROUP_SIZE='big' is not an integer"):
        resolve_group_size()
    for bad in (0, 100, 40968):
        with pytest.raises(ValueError, match=f"group_size {bad} must be a multiple of 8"):
            resolve_group_size(bad)


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="num_nodes"):
        quantized_reduce_layout((10, ), 0, 2, 128)
    with pytest.raises(ValueError, match="at least one element"):
        quantized_reduce_layout((0, ), 3, 2, 128)

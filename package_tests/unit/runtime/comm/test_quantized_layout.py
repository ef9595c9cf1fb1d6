# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The qgZ layout is pure: these tests need no processes."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_qgz.qgz import qgz_contract as contract
from deepspeed_qgz.qgz.quantized_layout import (DEFAULT_GROUP_SIZE, INTER_NODE_BITS, MIN_GROUP_SIZE, SCALE_BYTES,
                                                quantized_reduce_layout, resolve_group_size, resolve_intra_node_bits)
from deepspeed_qgz.qgz.quantized_pipeline import (CHUNK_BUDGET, CHUNK_VALUES, layout_sum_chunks, planned_kernel_calls,
                                                  quantized_reduce_plan, sum_chunk_temporaries)

numels = st.lists(st.integers(min_value=1, max_value=5_000_000), min_size=1, max_size=6)
topology = st.tuples(st.integers(min_value=1, max_value=16), st.integers(min_value=1, max_value=16))
group_sizes = st.one_of(st.sampled_from([MIN_GROUP_SIZE, 256, 1024, contract.SWIZZLE_MAX_GROUP_ELEMS]),
                        st.integers(MIN_GROUP_SIZE // 8, contract.SWIZZLE_MAX_GROUP_ELEMS // 8).map(lambda k: 8 * k))
intra_bits = st.sampled_from([4, 8])


def test_smallest_group_launches_a_whole_warp():
    """quantized_reduction's launcher sets no thread minimum: 136 values is the smallest output
    group (a multiple of the vector width) whose block is a whole warp, at 4 and at 8 bits."""
    for bits in contract.SUPPORTED_BITS:
        smallest = contract.reduce_min_out_group_elems(bits)
        assert smallest == 136 == MIN_GROUP_SIZE
        per_byte = contract.values_per_byte(bits)
        assert contract.reduce_launch(smallest // per_byte, bits)[0] == contract.WARP_SIZE
        assert contract.reduce_launch((smallest - 8) // per_byte, bits)[0] == contract.WARP_SIZE // 2
    assert contract.swizzle_launch(8)[0] == contract.SWIZZLE_MIN_THREADS >= contract.WARP_SIZE


@settings(max_examples=300, deadline=None)
@given(numels, topology, group_sizes, intra_bits)
def test_layout_meets_kernel_contract(numels, topology, group_size, bits):
    """Every kernel call the pipeline plans for the layout is inside the contract, the warp rule
    included, on every topology up to 16 x 16 and for every allowed group size."""
    num_nodes, local_size = topology
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size, bits)
    calls = planned_kernel_calls(layout)
    node_chunks = len(layout_sum_chunks(layout, 2))
    stage1 = ["dequantize"] * len(layout_sum_chunks(layout, 1)) + ["swizzle_quant"]
    assert [kernel for kernel, _ in calls] == (["swizzle_quant"] + (stage1 if bits == 8 else ["quantized_reduction"]) +
                                               ["dequantize"] * node_chunks)
    for kernel, sizes in calls:
        assert contract.call_violations(kernel, sizes) == [], (kernel, sizes)


@settings(max_examples=300, deadline=None)
@given(numels, topology, group_sizes, intra_bits)
def test_layout_keeps_partitions_and_bounds_padding(numels, topology, group_size, bits):
    num_nodes, local_size = topology
    world = num_nodes * local_size
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size, bits)
    assert layout.group_elems % contract.VECTOR_ELEMS == 0 and MIN_GROUP_SIZE <= layout.group_elems <= group_size
    offset = 0
    for i, (numel, t) in enumerate(zip(numels, layout.tensors)):
        assert t.partition == math.ceil(numel / world)
        assert sum(t.partition_numel(r) for r in range(world)) == numel
        # whole groups, no group shared with the next tensor, fewer than a group of padding
        assert t.offset == offset and t.offset % layout.group_elems == 0
        assert 0 <= layout.padding(i) < layout.group_elems
        offset += t.num_groups * layout.group_elems
    assert layout.padded_partition == offset
    # each slot format: the scale groups hold every scale, fp32-aligned, and no more groups than that takes
    assert (layout.intra.bits, layout.inter.bits) == (bits, INTER_NODE_BITS)
    for fmt in (layout.intra, layout.inter):
        scale_bytes = layout.groups_per_partition * SCALE_BYTES
        group_bytes = layout.group_elems * fmt.bits // 8
        assert (layout.padded_partition * fmt.bits // 8) % 4 == 0
        assert fmt.scale_groups * group_bytes >= scale_bytes > (fmt.scale_groups - 1) * group_bytes
        assert fmt.slot_bytes == fmt.slot_groups * group_bytes and fmt.slot_elems == fmt.slot_groups * layout.group_elems
    assert layout.intra_node_bytes == (local_size - 1) * num_nodes * layout.intra.slot_bytes
    assert layout.inter_node_bytes == (num_nodes - 1) * layout.inter.slot_bytes


def wire_bytes(numels, world, group_elems):
    """Bytes of an inter-node slot: the groups' int4 codes and their fp32 scales, rounded up to
    whole groups."""
    groups = sum(math.ceil(math.ceil(n / world) / group_elems) for n in numels)
    group_bytes = group_elems * INTER_NODE_BITS // 8
    return math.ceil((groups * group_bytes + groups * SCALE_BYTES) / group_bytes) * group_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=5), topology,
       st.sampled_from([MIN_GROUP_SIZE, 256, 1024]), intra_bits)
def test_layout_sends_the_fewest_bytes_within_the_group_size(numels, topology, group_size, bits):
    num_nodes, local_size = topology
    world = num_nodes * local_size
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size, bits)
    chosen = wire_bytes(numels, world, layout.group_elems)
    assert layout.inter.slot_bytes == chosen
    assert all(chosen <= wire_bytes(numels, world, g) for g in range(MIN_GROUP_SIZE, group_size + 1, 8))


@pytest.mark.parametrize("numel", [50257 * 768, 4096 * 11008, 151936 * 3584])
@pytest.mark.parametrize("num_nodes,local_size", [(3, 2), (2, 8), (3, 8), (5, 8)])
@pytest.mark.parametrize("group_size", [MIN_GROUP_SIZE, 1024])
def test_padding_under_one_percent_for_large_tensors(numel, num_nodes, local_size, group_size):
    layout = quantized_reduce_layout((numel, ), num_nodes, local_size, group_size)
    assert layout.padding_elems <= 0.01 * numel


def test_gpt2_embedding_layout():
    # max(50257, 768, world) = 50257 groups would not divide by any even world size
    layout = quantized_reduce_layout((50257 * 768, ), 3, 2, DEFAULT_GROUP_SIZE)
    assert layout.group_elems <= DEFAULT_GROUP_SIZE and layout.padded_partition >= math.ceil(50257 * 768 / 6)


@pytest.mark.parametrize("bits", [4, 8])
def test_accessors_refuse_buffers_of_another_layout(bits):
    layout = quantized_reduce_layout((1000, 3700), 3, 2, MIN_GROUP_SIZE, bits)
    fmt = layout.intra
    slots = torch.zeros(6, fmt.slot_bytes, dtype=torch.int8)
    fmt.scales(slots).fill_(1.0)
    # the scales sit right after the padded partition's codes, in the scale groups
    data_bytes = layout.padded_partition * bits // 8
    assert slots[:, :data_bytes].eq(0).all() and slots[:, data_bytes:].ne(0).any()
    assert fmt.scales(slots).shape == (6, layout.groups_per_partition)
    with pytest.raises(ValueError, match=f"expected a last dimension of {fmt.slot_bytes}"):
        fmt.scales(torch.zeros(6, fmt.slot_bytes + 4, dtype=torch.int8))
    values = torch.zeros(2, fmt.slot_elems)
    assert fmt.data_groups(values).shape == (2, layout.groups_per_partition, layout.group_elems)
    with pytest.raises(ValueError, match=f"expected a last dimension of {fmt.slot_elems}"):
        fmt.grouped(torch.zeros(2, fmt.slot_elems - 8))
    params = fmt.kernel_params(torch.ones(2, layout.groups_per_partition))
    assert params.shape == (2 * fmt.slot_groups, 1) and params.view(2, -1)[:, layout.groups_per_partition:].eq(0).all()
    padded = torch.arange(layout.padded_partition, dtype=torch.float32)
    assert layout.partitions(padded, 5)[1].numel() == 3700 - 5 * math.ceil(3700 / 6)
    with pytest.raises(ValueError, match="rank 6 outside the world of 6"):
        layout.partition(padded, 0, 6)


def test_group_size_setting():
    assert resolve_group_size() == DEFAULT_GROUP_SIZE == MIN_GROUP_SIZE and resolve_group_size(256) == 256
    # 128 and below: quantized_reduction would reduce them with fewer threads than a warp
    for bad in (0, 100, 128, 40968, 136.0):
        with pytest.raises(ValueError, match=f"group_size {bad} must be a multiple of 8 between 136 and 40960"):
            resolve_group_size(bad)
    with pytest.raises(ValueError, match="my_key 7 must be"):
        resolve_group_size(7, "my_key")


def test_intra_node_bits_setting():
    assert resolve_intra_node_bits() in (4, 8) and resolve_intra_node_bits(8) == 8
    for bad in (2, 16, "8"):
        with pytest.raises(ValueError, match="must be one of"):
            resolve_intra_node_bits(bad)


@settings(max_examples=300, deadline=None)
@given(numels, topology, group_sizes, intra_bits)
def test_sum_chunks_cover_every_group_once_within_bounds(numels, topology, group_size, bits):
    """The chunks a stage dequantizes and sums at once: the whole slots in one chunk, or every group
    of the padded partition exactly once, in order, each chunk of at least CHUNK_VALUES values (the
    last may be smaller) and with temporaries within CHUNK_BUDGET bytes per gradient element (unless
    a chunk of CHUNK_VALUES values is more)."""
    num_nodes, local_size = topology
    layout = quantized_reduce_layout(tuple(numels), num_nodes, local_size, group_size, bits)
    elements = layout.world_size * layout.padded_partition
    for stage, fmt, copies, summed in ((1, layout.intra, layout.world_size, local_size), (2, layout.inter, num_nodes,
                                                                                          num_nodes)):
        chunks = layout_sum_chunks(layout, stage)
        if chunks == ((0, fmt.slot_groups), ):
            continue
        assert [first for first, _ in chunks] == [0] + [stop for _, stop in chunks[:-1]]
        assert chunks[-1][1] == fmt.groups_per_partition
        sizes = [copies * (stop - first) * fmt.group_elems for first, stop in chunks]
        assert all(size >= CHUNK_VALUES for size in sizes[:-1])
        largest = max(sizes) * sum_chunk_temporaries(fmt, summed)
        assert largest <= max(CHUNK_BUDGET * elements,
                              (CHUNK_VALUES + copies * fmt.group_elems) * sum_chunk_temporaries(fmt, summed))


def test_calls_beyond_the_kernels_int32_indexing_are_split_or_refused():
    """Pure planning, no tensors: a bucket whose kernels would index past int32 runs in several
    exchanges of consecutive tensors; a single tensor beyond it is refused with its size."""
    for bits in (4, 8):
        one = quantized_reduce_plan((600_000_000, ), 3, 2, MIN_GROUP_SIZE, bits)
        assert len(one) == 1
        runs = quantized_reduce_plan((600_000_000, ) * 5, 3, 2, MIN_GROUP_SIZE, bits)
        assert [start for start, _ in runs] == [0, 3] and [len(layout.tensors) for _, layout in runs] == [3, 2]
        for _, layout in runs:
            assert all(contract.call_violations(k, sizes) == [] for k, sizes in planned_kernel_calls(layout))
        with pytest.raises(ValueError, match="a tensor of 2100000000 elements is too large"):
            quantized_reduce_plan((1000, 2_100_000_000), 3, 2, MIN_GROUP_SIZE, bits)


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="num_nodes"):
        quantized_reduce_layout((10, ), 0, 2, MIN_GROUP_SIZE)
    with pytest.raises(ValueError, match="at least one element"):
        quantized_reduce_layout((0, ), 3, 2, MIN_GROUP_SIZE)

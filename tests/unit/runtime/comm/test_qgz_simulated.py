# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Property tests in the spirit of the bug report's test_swizzle_quant, over the whole collective:
random node counts, local sizes, shapes, dtypes and group sizes, every rank of the cluster simulated
in this process (deepspeed.runtime.comm.quantized_simulation) with the CPU quantizer op."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed.ops.quantizer import qgz_reference
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce
from deepspeed_qgz.harness import WorkCounter, same_bits

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
shapes = st.lists(st.lists(st.integers(min_value=1, max_value=70), min_size=2, max_size=3).map(tuple),
                  min_size=1,
                  max_size=4)


def cluster_inputs(shapes, world, dtype, seed, magnitudes=None):
    """Every rank's tensors: a shared signal plus rank-specific noise."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = magnitudes or [1.0] * len(shapes)
    signals = [torch.randn(shape, generator=gen, dtype=torch.float64) * m for shape, m in zip(shapes, magnitudes)]
    return [[(s + 0.25 * torch.randn(s.shape, generator=gen, dtype=torch.float64) * m).to(dtype)
             for s, m in zip(signals, magnitudes)] for _ in range(world)]


def assert_close_to_average(inputs, outputs):
    """Each rank's partition of each tensor: reduce_scatter_coalesced's shape and dtype, and within
    int4's error of the exact average, in that tensor's own magnitude."""
    world = len(inputs)
    for i, tensor in enumerate(inputs[0]):
        numel = tensor.numel()
        chunk = math.ceil(numel / world)
        for rank in range(world):
            lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
            out = outputs[rank][i]
            assert out.dtype == tensor.dtype and out.shape == (hi - lo, )
            if hi == lo:
                continue
            parts = [inputs[r][i].reshape(-1)[lo:hi].double() for r in range(world)]
            exact = torch.stack(parts).mean(0)
            absmax_mean = sum(p.abs().max() for p in parts) / world
            err = (out.double() - exact).abs()
            assert (err <= 0.3 * absmax_mean + exact.abs() * 2**-7).all(), (rank, i, float(err.max()))


@settings(max_examples=40, deadline=None)
@given(num_nodes=st.integers(1, 7),
       local_size=st.integers(1, 4),
       shapes=shapes,
       dtype=st.sampled_from(DTYPES),
       group_size=st.sampled_from([8, 64, 128, 1024]),
       seed=st.integers(0, 2**16))
def test_whole_collective_any_topology(cpu_quantizer, num_nodes, local_size, shapes, dtype, group_size, seed):
    inputs = cluster_inputs(shapes, num_nodes * local_size, dtype, seed)
    outputs, layout = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, cpu_quantizer, group_size)
    assert layout.group_elems <= group_size
    assert_close_to_average(inputs, outputs)


def test_tensors_keep_their_own_precision_in_a_mixed_bucket(cpu_quantizer):
    """Magnitudes 10^6 apart in one call, one group size: each tensor's error stays within its own
    magnitude's bound (a group holding elements of two tensors would give the small one the large
    one's step)."""
    for dtype in (torch.bfloat16, torch.float32):
        inputs = cluster_inputs([(33, 17), (64, 48), (9, 9)], 6, dtype, 11, magnitudes=[1e-3, 1e3, 1e-3])
        outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
        assert_close_to_average(inputs, outputs)


def test_all_zero_input_is_exactly_zero(cpu_quantizer):
    inputs = [[torch.zeros(9, 11, dtype=torch.bfloat16)] for _ in range(6)]
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    assert all(torch.equal(out[0], torch.zeros_like(out[0])) for out in outputs)


def test_fp16_node_sum_beyond_fp16_range(cpu_quantizer):
    # Each rank holds 60000: the node sum (120000) overflows fp16, the average (60000) does not.
    inputs = [[torch.full((4, 8), 60000.0, dtype=torch.float16)] for _ in range(6)]
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    for out in outputs:
        assert torch.isfinite(out[0]).all()
        # A group's positive absmax maps to code 8, which the kernels clamp to 7: a constant group
        # comes back as 7/8 of itself at each of the two stages.
        assert ((out[0].float() - 60000 * (7 / 8)**2).abs() <= 32).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_on_cpu_op_equals_sequence_on_reference(cpu_quantizer, dtype):
    """The collective's whole kernel sequence gives the same bits on the CPU op as on the
    reference statement of the CUDA kernels (scripts/gpu_check.py runs the same on the GPU)."""
    inputs = cluster_inputs([(1031, 7), (5, 3, 11), (2, 2)], 6, dtype, 3)
    on_op, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    on_reference, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, qgz_reference)
    for rank_op, rank_ref in zip(on_op, on_reference):
        assert all(same_bits(a, b) for a, b in zip(rank_op, rank_ref))


def test_copy_in_without_chunk_cat_gives_the_same_bits(cpu_quantizer, monkeypatch):
    """torch before 2.3 has no torch._chunk_cat: the per-tensor copy-in must agree with it."""
    inputs = cluster_inputs([(33, 17), (7, 5), (64, 48)], 6, torch.bfloat16, 4)
    with_chunk_cat, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    monkeypatch.delattr(torch, "_chunk_cat")
    without, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    for rank_a, rank_b in zip(with_chunk_cat, without):
        assert all(same_bits(a, b) for a, b in zip(rank_a, rank_b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_work_per_call_does_not_grow_with_the_number_of_tensors(cpu_quantizer, dtype):
    """One quantizer kernel per stage per call, and the dispatched ops of a rank's three stages do
    not grow with the bucket's tensor count (the per-tensor work is views only)."""
    stage_ops = {}
    for count in (1, 8, 48):
        inputs = cluster_inputs([(96, 64)] * count, 6, dtype, count)
        counter = WorkCounter()
        quantizer = counter.counting_quantizer(cpu_quantizer)
        layout = coalesced_collectives.quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), 3, 2, 128)
        with counter:
            slots = coalesced_collectives.quantize_partitions(inputs[0], layout, quantizer)
            received = slots.view(2, 3, -1)[0].clone()  # a stand-in for the exchange: any rank's share
            node_sums = coalesced_collectives.reduce_within_node(received.repeat(2, 1), layout, quantizer)
            coalesced_collectives.average_across_nodes(node_sums, layout, quantizer, dtype)
        assert counter.kernel_calls == 3
        stage_ops[count] = counter.ops
    assert stage_ops[1] == stage_ops[8] == stage_ops[48], stage_ops

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Property test in the spirit of the bug report's test_swizzle_quant, over the whole collective:
random node counts, local sizes, shapes and dtypes, every rank of the cluster simulated in this
process (qgz_simulate.py) with the CPU quantizer op."""

import math

import torch
from hypothesis import given, settings, strategies as st

from deepspeed.ops.quantizer import qgz_reference
from deepspeed.runtime.comm import coalesced_collectives
from qgz_simulate import simulate_quant_reduce

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
shapes = st.lists(st.lists(st.integers(min_value=1, max_value=70), min_size=2, max_size=3).map(tuple),
                  min_size=1,
                  max_size=4)


@settings(max_examples=40, deadline=None)
@given(num_nodes=st.integers(1, 7),
       local_size=st.integers(1, 4),
       shapes=shapes,
       dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_whole_collective_any_topology(cpu_quantizer, num_nodes, local_size, shapes, dtype, seed):
    world = num_nodes * local_size
    gen = torch.Generator().manual_seed(seed)
    signals = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    inputs = [[(s + 0.25 * torch.randn(s.shape, generator=gen, dtype=torch.float64)).to(dtype) for s in signals]
              for _ in range(world)]
    outputs, layout = simulate_quant_reduce(inputs, num_nodes, local_size)
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        chunk = math.ceil(numel / world)
        for rank in range(world):
            lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
            out = outputs[rank][i]
            assert out.dtype == dtype and out.shape == (hi - lo, )
            if hi == lo:
                continue
            parts = [inputs[r][i].reshape(-1)[lo:hi].double() for r in range(world)]
            exact = torch.stack(parts).mean(0)
            absmax_mean = sum(p.abs().max() for p in parts) / world
            err = (out.double() - exact).abs()
            assert (err <= 0.3 * absmax_mean + exact.abs() * 2**-7).all(), (rank, i, float(err.max()))


def test_all_zero_input_is_exactly_zero(cpu_quantizer):
    inputs = [[torch.zeros(9, 11, dtype=torch.bfloat16)] for _ in range(6)]
    outputs, _ = simulate_quant_reduce(inputs, 3, 2)
    assert all(torch.equal(out[0], torch.zeros_like(out[0])) for out in outputs)


def test_fp16_node_sum_beyond_fp16_range(cpu_quantizer):
    # Each rank holds 60000: the node sum (120000) overflows fp16, the average (60000) does not.
    inputs = [[torch.full((4, 8), 60000.0, dtype=torch.float16)] for _ in range(6)]
    outputs, _ = simulate_quant_reduce(inputs, 3, 2)
    for out in outputs:
        assert torch.isfinite(out[0]).all()
        # A group's positive absmax maps to code 8, which the kernels clamp to 7: a constant group
        # comes back as 7/8 of itself at each of the two stages.
        assert ((out[0].float() - 60000 * (7 / 8)**2).abs() <= 32).all()


def test_sequence_on_cpu_op_equals_sequence_on_reference(cpu_quantizer, monkeypatch):
    """The collective's whole kernel sequence gives the same bits on the CPU op as on the
    reference statement of the CUDA kernels (scripts/gpu_check.py runs the same on the GPU)."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(1031, 7), (5, 3, 11), (2, 2)]
    for dtype in DTYPES:
        inputs = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(6)]
        monkeypatch.setattr(coalesced_collectives, "quantizer_module", cpu_quantizer)
        on_op, _ = simulate_quant_reduce(inputs, 3, 2)
        monkeypatch.setattr(coalesced_collectives, "quantizer_module", qgz_reference)
        on_reference, _ = simulate_quant_reduce(inputs, 3, 2)
        for rank_op, rank_ref in zip(on_op, on_reference):
            for a, b in zip(rank_op, rank_ref):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))

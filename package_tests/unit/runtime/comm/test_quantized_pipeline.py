# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The quantized gradient reduce-scatter's stages (quantized_pipeline.py) for whole clusters
simulated in one process (quantized_simulation.py), with the accelerator's quantizer op: random
node counts, local sizes, shapes, dtypes, group sizes and intra-node precisions against the exact
average; the kernel calls it plans and makes; the work per call."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from deepspeed.accelerator import get_accelerator
from deepspeed_qgz.qgz import qgz_reference
from deepspeed_qgz.qgz import quantized_pipeline
from deepspeed_qgz.qgz.quantized_layout import MIN_GROUP_SIZE, quantized_reduce_layout
from deepspeed_qgz.qgz.quantized_simulation import simulate_all_to_all_quant_reduce

from unit import qgz_util
from unit.qgz_util import device, quantizer, same_bits

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
BITS = [4, 8]
shapes = st.lists(st.lists(st.integers(min_value=1, max_value=70), min_size=2, max_size=3).map(tuple),
                  min_size=1,
                  max_size=4)


def cluster_inputs(shapes, world, dtype, seed, magnitudes=None):
    """Every rank's tensors, on the accelerator: a shared signal plus rank-specific noise."""
    return [[t.to(device()) for t in ranks]
            for ranks in qgz_util.cluster_inputs(shapes, world, dtype, seed, magnitudes)]


@pytest.fixture(scope="module")
def cpu_quantizer():
    """The accelerator's quantizer op (the CPU op on the CPU accelerator)."""
    return quantizer()


def assert_close_to_average(inputs, outputs, rms_bound=None):
    """Every rank's results against reduce_scatter_coalesced's partitions and dtype, within the
    quantization error of the exact average (and, with `rms_bound`, a relative RMS error below it)."""
    problems = [
        f"rank {rank}{problem}" for rank in range(len(inputs))
        for problem in qgz_util.check_against_average(inputs, outputs[rank], rank, rms_bound=rms_bound)
    ]
    assert not problems, "\n".join(problems[:10])


@settings(max_examples=40, deadline=None)
@given(num_nodes=st.integers(1, 7),
       local_size=st.integers(1, 4),
       shapes=shapes,
       dtype=st.sampled_from(DTYPES),
       group_size=st.sampled_from([MIN_GROUP_SIZE, 256, 1024]),
       bits=st.sampled_from(BITS),
       seed=st.integers(0, 2**16))
def test_whole_collective_any_topology(cpu_quantizer, num_nodes, local_size, shapes, dtype, group_size, bits, seed):
    inputs = cluster_inputs(shapes, num_nodes * local_size, dtype, seed)
    outputs, layouts = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, cpu_quantizer, group_size, bits)
    assert len(layouts) == 1 and layouts[0].group_elems <= group_size and layouts[0].intra_node_bits == bits
    assert_close_to_average(inputs, outputs)


@pytest.mark.parametrize("bits", BITS)
def test_tensors_keep_their_own_precision_in_a_mixed_bucket(cpu_quantizer, bits):
    """Magnitudes 10^6 apart in one call, one group size: each tensor's error stays within its own
    magnitude's bound (a group holding elements of two tensors would give the small one the large
    one's step)."""
    for dtype in (torch.bfloat16, torch.float32):
        inputs = cluster_inputs([(33, 17), (64, 48), (9, 9)], 6, dtype, 11, magnitudes=[1e-3, 1e3, 1e-3])
        outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
        assert_close_to_average(inputs, outputs)


@pytest.mark.parametrize("bits", BITS)
def test_ranks_without_a_contribution_do_not_cost_the_others_precision(cpu_quantizer, bits):
    """An embedding row's gradient is zero on ranks whose batches lack the token. The kernels store
    a scale of 1 for an all-zero group; counted in the renormalizations, it would push the other
    ranks' tiny values into fp16's subnormals. Zero groups carry a scale of 0 instead."""
    for dtype in (torch.bfloat16, torch.float32):
        inputs = cluster_inputs([(96, 64)], 6, dtype, 5, magnitudes=[1e-9])
        for rank in (1, 2, 3):  # zeros on a local rank of every node, and on a whole node
            inputs[rank][0].zero_()
        outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
        assert_close_to_average(inputs, outputs, rms_bound=0.2)


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_input_is_exactly_zero(cpu_quantizer, bits):
    inputs = [[torch.zeros(9, 11, dtype=torch.bfloat16)] for _ in range(6)]
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    assert all(torch.equal(out[0], torch.zeros_like(out[0])) for out in outputs)


@pytest.mark.parametrize("bits,expected", [(4, 60000 * 7 / 8), (8, 60000)])
def test_fp16_node_sum_beyond_fp16_range(cpu_quantizer, bits, expected):
    """Each rank holds 60000: the node sum (120000) overflows fp16, the average (60000) does not.
    A group's positive absmax maps to the largest code plus one, which the kernels clamp. The
    glue's quantizations are clamp-free and quantized_reduction's requantization (int4 inside the
    node) keeps the kernels' formula, so a constant group comes back as 7/8 of itself with int4
    inside the node and exactly with int8."""
    inputs = [[torch.full((4, 8), 60000.0, dtype=torch.float16)] for _ in range(6)]
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    for out in outputs:
        assert torch.isfinite(out[0]).all()
        assert ((out[0].float() - expected).abs() <= 32).all()


@pytest.mark.skipif(get_accelerator().device_name() != "cpu",
                    reason="the CPU op is bit-exact; CUDA may differ in "
                    "the last bit of a scale (--use_fast_math)")
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sequence_on_cpu_op_equals_sequence_on_reference(cpu_quantizer, dtype, bits):
    """The collective's whole kernel sequence gives the same bits on the CPU op as on the
    reference statement of the CUDA kernels."""
    inputs = cluster_inputs([(1031, 7), (5, 3, 11), (2, 2)], 6, dtype, 3)
    on_op, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    on_reference, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, qgz_reference, intra_node_bits=bits)
    for rank_op, rank_ref in zip(on_op, on_reference):
        assert all(same_bits(a, b) for a, b in zip(rank_op, rank_ref))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sums_in_chunks_give_the_same_bits(cpu_quantizer, monkeypatch, dtype, bits):
    """Stages 1 and 2 dequantize and sum a large call's groups in chunks (sum_chunks): the same bits
    as one chunk for the whole call."""
    inputs = cluster_inputs([(1031, 7), (5, 3, 11), (64, 48)], 6, dtype, 12)
    whole, layouts = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    monkeypatch.setattr(quantized_pipeline, "CHUNK_VALUES", 1000)
    monkeypatch.setattr(quantized_pipeline, "CHUNK_BUDGET", 0.01)
    assert len(quantized_pipeline.layout_sum_chunks(layouts[0], 1)) > 2
    assert len(quantized_pipeline.layout_sum_chunks(layouts[0], 2)) > 2
    chunked, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    for rank_a, rank_b in zip(whole, chunked):
        assert all(same_bits(a, b) for a, b in zip(rank_a, rank_b))


def test_copy_in_without_chunk_cat_gives_the_same_bits(cpu_quantizer, monkeypatch):
    """torch before 2.3 has no torch._chunk_cat: the per-tensor copy-in must agree with it."""
    inputs = cluster_inputs([(33, 17), (7, 5), (64, 48)], 6, torch.bfloat16, 4)
    with_chunk_cat, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    monkeypatch.delattr(torch, "_chunk_cat")
    without, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer)
    for rank_a, rank_b in zip(with_chunk_cat, without):
        assert all(same_bits(a, b) for a, b in zip(rank_a, rank_b))


@pytest.mark.parametrize("bits", BITS)
def test_bf16_exponents_without_a_bf16_frexp(cpu_quantizer, monkeypatch, bits):
    """CUDA's torch.frexp has no bf16 kernel before torch 2.5: the bf16 path takes exponents in fp32."""
    inputs = cluster_inputs([(33, 17), (64, 48)], 6, torch.bfloat16, 6)
    expected, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    real_frexp = torch.frexp

    def frexp_without_bf16(x, *args, **kwargs):
        if x.dtype == torch.bfloat16:
            raise RuntimeError('"frexp_cuda" not implemented for \'BFloat16\'')
        return real_frexp(x, *args, **kwargs)

    monkeypatch.setattr(torch, "frexp", frexp_without_bf16)
    with pytest.raises(RuntimeError, match="not implemented"):
        torch.frexp(torch.ones(2, dtype=torch.bfloat16))
    got, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, cpu_quantizer, intra_node_bits=bits)
    for rank_a, rank_b in zip(expected, got):
        assert all(same_bits(a, b) for a, b in zip(rank_a, rank_b))


class RecordingQuantizer:
    """A quantizer that records each kernel call's size arguments as qgz_contract states them."""

    def __init__(self, quantizer):
        self.quantizer, self.calls = quantizer, []
        self.Symmetric = quantizer.Symmetric

    def swizzle_quant(self, x, num_groups, num_bits, quant_type, pipeline, num_nodes, local_world_size):
        self.calls.append(("swizzle_quant", (x.numel(), num_groups, num_bits, pipeline, num_nodes, local_world_size)))
        return self.quantizer.swizzle_quant(x, num_groups, num_bits, quant_type, pipeline, num_nodes, local_world_size)

    def quantized_reduction(self, data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size):
        self.calls.append(("quantized_reduction", (data.numel(), scales.numel(), in_groups, out_groups, num_bits,
                                                   int(quant_type), local_world_size)))
        return self.quantizer.quantized_reduction(data, scales, in_groups, out_groups, num_bits, quant_type,
                                                  local_world_size)

    def dequantize(self, data, params, num_groups, num_bits, quant_type):
        self.calls.append(("dequantize", (data.numel(), params.numel(), num_groups, num_bits, int(quant_type), 2)))
        return self.quantizer.dequantize(data, params, num_groups, num_bits, quant_type)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("num_nodes,local_size", [(3, 2), (2, 3), (5, 1), (1, 4)])
def test_planned_kernel_calls_are_the_calls_made(cpu_quantizer, bits, num_nodes, local_size):
    """quantized_pipeline.planned_kernel_calls (what the layout's property test checks against the
    contract, and what decides a split) states exactly the calls one rank's pipeline makes."""
    inputs = cluster_inputs([(1031, 7), (5, 3, 11)], num_nodes * local_size, torch.bfloat16, 8)
    recorder = RecordingQuantizer(cpu_quantizer)
    _, layouts = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, recorder, intra_node_bits=bits)
    planned = quantized_pipeline.planned_kernel_calls(layouts[0])
    assert sorted(recorder.calls) == sorted(planned * (num_nodes * local_size))


class OpCounter(TorchDispatchMode):
    """Counts the dispatched ATen ops that write something: views and bare allocations excluded."""
    ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket.__name__ not in self.ALLOCATIONS:
            self.ops += 1
        return out


@pytest.mark.parametrize("bits,kernels", [(4, 3), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_work_per_call_does_not_grow_with_the_number_of_tensors(cpu_quantizer, dtype, bits, kernels):
    """One quantizer kernel per step per call, and the dispatched ops of a rank's three stages do
    not grow with the bucket's tensor count (the per-tensor work is views only)."""
    stage_ops = {}
    for count in (1, 8, 48):
        inputs = cluster_inputs([(96, 64)] * count, 6, dtype, count)
        recorder = RecordingQuantizer(cpu_quantizer)
        layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), 3, 2, MIN_GROUP_SIZE, bits)
        with OpCounter() as counter:
            slots = quantized_pipeline.quantize_partitions(inputs[0], layout, recorder)
            received = slots.view(2, 3, -1)[0].clone()  # a stand-in for the exchange: any rank's share
            node_sums = quantized_pipeline.reduce_within_node(received.repeat(2, 1), layout, recorder)
            quantized_pipeline.average_across_nodes(node_sums, layout, recorder, dtype)
        assert len(recorder.calls) == kernels
        stage_ops[count] = counter.ops
    assert stage_ops[1] == stage_ops[8] == stage_ops[48], stage_ops

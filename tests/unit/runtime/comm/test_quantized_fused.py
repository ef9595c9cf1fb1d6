# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The fused Triton stages (quantized_fused.py) against the stages they replace (quantized_pipeline.py
on the accelerator's quantizer op), bit for bit: each stage on the same inputs (hypothesis, over
topologies, dtypes, group sizes, both intra-node precisions, zeros, subnormals, the dtype's range,
inf and NaN), whole simulated clusters, and the range contract. On the CPU accelerator the kernels
run in Triton's interpreter (TRITON_INTERPRET=1 in the environment); without Triton, or where the
kernels cannot run, these tests are skipped with the reason. A conversion in a kernel that overflows
fails them."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deepspeed.runtime.comm import quantized_pipeline
from deepspeed.runtime.comm.quantized_layout import MIN_GROUP_SIZE, quantized_reduce_layout
from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce

from unit import qgz_util
from unit.qgz_util import device, same_values


def _unavailable():
    from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason
    return fused_unavailable_reason(torch.device(device()).type)


pytestmark = [
    pytest.mark.skipif(_unavailable() is not None, reason=f"fused kernels: {_unavailable()}"),
    # In Triton's interpreter a conversion that overflows (or a NaN converted to an integer) warns.
    # LLVM leaves a float-to-integer conversion out of range undefined, and no kernel here should
    # depend on how a compiler treats an overflowing narrowing conversion: here either fails.
    pytest.mark.filterwarnings("error::RuntimeWarning"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SPECIALS = ("none", "zero groups", "subnormals", "non-finite") + qgz_util.RANGE_PATTERNS


@pytest.fixture(scope="module")
def stages():
    return quantized_pipeline.pipeline_stages(qgz_util.quantizer()), quantized_pipeline.pipeline_stages(None,
                                                                                                        fused=True)


def special_inputs(shapes, world, dtype, seed, special):
    """Every rank's tensors (on the accelerator) with `special` values: shared-signal inputs with
    zero groups, subnormals or infs and NaNs, or qgz_util.range_inputs' patterns."""
    if special in qgz_util.RANGE_PATTERNS:
        inputs = qgz_util.range_inputs(shapes, world, dtype, seed, special)
    else:
        inputs = qgz_util.cluster_inputs(shapes, world, dtype, seed)
        gen = torch.Generator().manual_seed(seed)
        for rank in range(world):
            for tensor in inputs[rank]:
                flat = tensor.view(-1)
                spots = torch.randint(0, flat.numel(), (3, ), generator=gen)
                if special == "zero groups":
                    flat[:flat.numel() // 2].zero_()
                elif special == "subnormals":  # groups of subnormals and small normal values
                    flat.mul_(4 * torch.finfo(dtype).tiny)
                    flat[spots] = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
                elif special == "non-finite" and rank % 3 == 0:
                    flat[spots] = torch.tensor([float("nan"), float("inf"), float("-inf")], dtype=dtype)
    return [[t.to(device()) for t in ranks] for ranks in inputs]


def assert_same_slots(fused, default, fmt, what):
    """The same bytes, except the codes of groups whose scale is NaN (the glue leaves the kernels'
    codes there, the fused kernels zeros: no result ever reads them) and NaN payloads."""
    assert fused.shape == default.shape, what
    assert same_values(fmt.scales(fused), fmt.scales(default)).all(), f"{what}: scales differ"
    data = fmt.groups_per_partition * fmt.group_bytes
    codes = [slots[..., :data].view(*slots.shape[:-1], -1, fmt.group_bytes) for slots in (fused, default)]
    differ = (codes[0] != codes[1]) & torch.isfinite(fmt.scales(default)).unsqueeze(-1)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {differ.numel()} code bytes differ"
    tail = data + fmt.groups_per_partition * 4
    assert torch.equal(fused[..., tail:], default[..., tail:]), f"{what}: the scale groups' tails differ"


def check_each_stage(stages, topology, shapes, dtype, bits, group_size, special, seed):
    """Rank 0's three stages, fused and not, on the same inputs: the same slots and results."""
    default, fused = stages
    num_nodes, local_size = topology
    world = num_nodes * local_size
    inputs = special_inputs(shapes, world, dtype, seed, special)
    layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_size, group_size, bits)

    slots = [
        default.quantize_partitions(inputs[rank], layout).view(local_size, num_nodes, -1) for rank in range(world)
    ]
    assert_same_slots(fused.quantize_partitions(inputs[0], layout), slots[0].view(world, -1), layout.intra, "stage 0")

    def received(node):  # what local rank 0 of `node` receives inside its node
        return torch.cat([slots[node * local_size + peer][0] for peer in range(local_size)])

    node_sums = [default.reduce_within_node(received(node), layout) for node in range(num_nodes)]
    assert_same_slots(fused.reduce_within_node(received(0), layout), node_sums[0], layout.inter, "stage 1")

    across = torch.stack([node_sums[node][0] for node in range(num_nodes)])  # what rank 0 receives across nodes
    expected = default.average_across_nodes(across, layout, dtype=dtype)
    got = fused.average_across_nodes(across, layout, dtype=dtype)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert same_values(got, expected).all(), f"stage 2: {int((~same_values(got, expected)).sum())} values differ"


@pytest.mark.parametrize("special", SPECIALS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_stage_equals_the_default_on_special_values(stages, dtype, special):
    """Every dtype with every kind of special value, at both precisions, on 3 nodes x 2."""
    for bits in (4, 8):
        check_each_stage(stages, (3, 2), [(40, 30), (33, 17)], dtype, bits, MIN_GROUP_SIZE, special, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from([(3, 2), (2, 3), (5, 1), (1, 4), (2, 8), (4, 2), (7, 1)]),
       shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=3),
       large=st.booleans(),
       dtype=st.sampled_from(DTYPES),
       bits=st.sampled_from([4, 8]),
       group_size=st.sampled_from([MIN_GROUP_SIZE, 256, 1024, 4096]),
       special=st.sampled_from(SPECIALS),
       seed=st.integers(0, 2**16))
def test_each_stage_equals_the_default(stages, topology, shapes, large, dtype, bits, group_size, special, seed):
    """Random topologies, shapes, group sizes, dtypes, precisions and special values. A `large`
    tensor makes groups of more than a kernel step (2048 values) with large group sizes."""
    shapes = shapes + ([(700 * topology[0] * topology[1], 3)] if large else [])
    check_each_stage(stages, topology, shapes, dtype, bits, group_size, special, seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_whole_collective_equals_the_default(dtype, bits):
    """A simulated 3 x 2 cluster, fused and not: every rank's results, bit for bit (NaN payloads aside)."""
    inputs = special_inputs([(33, 17), (64, 48), (5, 5, 5), (1, 9)], 6, dtype, 5, "non-finite")
    expected, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, qgz_util.quantizer(), intra_node_bits=bits)
    got, _ = simulate_all_to_all_quant_reduce(inputs, 3, 2, intra_node_bits=bits, fused=True)
    for rank, (rank_got, rank_expected) in enumerate(zip(got, expected)):
        for a, b in zip(rank_got, rank_expected):
            assert a.dtype == b.dtype and a.shape == b.shape and same_values(a, b).all(), rank


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from([(3, 2), (2, 3), (1, 4), (4, 1)]),
       shapes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 9)), min_size=1, max_size=2),
       dtype=st.sampled_from(DTYPES),
       bits=st.sampled_from([4, 8]),
       pattern=st.sampled_from(qgz_util.RANGE_PATTERNS),
       seed=st.integers(0, 2**16))
def test_range_contract(topology, shapes, dtype, bits, pattern, seed):
    """test_quantized_range.py's range contract on the fused path: finite inputs anywhere in the
    dtype's range give finite results within the error bound of the exact average."""
    num_nodes, local_size = topology
    inputs = special_inputs(shapes, num_nodes * local_size, dtype, seed, pattern)
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, intra_node_bits=bits, fused=True)
    problems = [
        f"rank {rank}{problem}" for rank in range(len(inputs))
        for problem in qgz_util.check_against_average(inputs, outputs[rank], rank)
    ]
    assert not problems, "\n".join(problems[:10])


def test_refusals_name_the_reason(monkeypatch):
    from deepspeed.runtime.comm import quantized_fused
    assert "not on xpu" in quantized_fused.fused_unavailable_reason("xpu")
    monkeypatch.setattr(quantized_fused, "triton", None)
    inputs = special_inputs([(6, 8)], 2, torch.float32, 0, qgz_util.RANGE_PATTERNS[0])
    with pytest.raises(ValueError,
                       match=r"fused true .*: the fused kernels were asked for, but the fused kernels "
                       r"cannot run here: Triton is not installed"):
        simulate_all_to_all_quant_reduce(inputs, 1, 2, fused=True)

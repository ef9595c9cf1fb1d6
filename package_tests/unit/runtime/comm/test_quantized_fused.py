# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The fused Triton stages (quantized_fused.py) against the stages they replace (quantized_pipeline.py
on the accelerator's quantizer op), bit for bit: each stage on the same inputs (hypothesis, over
topologies, dtypes, group sizes, both intra-node precisions, zeros, subnormals, the dtype's range,
inf and NaN), every output byte written (the launchers' outputs filled with a pattern before the
launch) with groups on both sides of a kernel step, stage 2's exact sums at the node counts and
scales where a narrower sum would wrap, whole simulated clusters, and the range contract. On the
CPU accelerator the kernels run in Triton's interpreter (TRITON_INTERPRET=1 in the environment);
without Triton, or where the kernels cannot run, these tests are skipped with the reason. A
conversion in a kernel that overflows fails them."""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from deepspeed_qgz.qgz import quantized_pipeline
from deepspeed_qgz.qgz.quantized_fused_choice import exact_layout
from deepspeed_qgz.qgz.quantized_layout import MIN_GROUP_SIZE, quantized_reduce_layout
from deepspeed_qgz.qgz.quantized_simulation import simulate_all_to_all_quant_reduce

from unit import qgz_util
from unit.qgz_util import device, same_values


def _unavailable():
    from deepspeed_qgz.qgz.quantized_fused import fused_unavailable_reason
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
# Every value near the dtype's largest, with one sign per tensor (the first positive, the next
# negative, ...) on every rank: node sums at the largest times the ranks per node, reaching stage 2
# from every node with one sign.
ONE_SIGN_LARGEST = "one sign at the largest"


@pytest.fixture(scope="module")
def stages():
    return quantized_pipeline.pipeline_stages(qgz_util.quantizer()), quantized_pipeline.pipeline_stages(None,
                                                                                                        fused=True)


def special_inputs(shapes, world, dtype, seed, special):
    """Every rank's tensors (on the accelerator) with `special` values: shared-signal inputs with
    zero groups, subnormals or infs and NaNs, qgz_util.range_inputs' patterns, or ONE_SIGN_LARGEST."""
    if special == ONE_SIGN_LARGEST:
        gen = torch.Generator().manual_seed(seed)
        largest = torch.finfo(dtype).max
        inputs = [[(-1)**i * largest * (1 - torch.rand(shape, generator=gen, dtype=torch.float64) / 64)
                   for i, shape in enumerate(shapes)] for _ in range(world)]
        for tensors in inputs:  # the largest itself in each tensor's first values
            for tensor in tensors:
                tensor.view(-1)[:9] = tensor.view(-1)[:9].sign() * largest
        inputs = [[t.to(dtype) for t in tensors] for tensors in inputs]
    elif special in qgz_util.RANGE_PATTERNS:
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


def check_each_stage(stages, topology, shapes, dtype, bits, group_size, special, seed, fused_stages=(0, 1, 2)):
    """Rank 0's three stages, fused and not, on the same inputs: the same slots and results (the
    stages in `fused_stages` run fused; the others' inputs come from the default stages). Returns
    (the inputs, rank 0's results)."""
    default, fused = stages
    num_nodes, local_size = topology
    world = num_nodes * local_size
    inputs = special_inputs(shapes, world, dtype, seed, special)
    layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_size, group_size, bits)

    slots = [
        default.quantize_partitions(inputs[rank], layout).view(local_size, num_nodes, -1) for rank in range(world)
    ]
    if 0 in fused_stages:
        assert_same_slots(fused.quantize_partitions(inputs[0], layout), slots[0].view(world, -1), layout.intra,
                          "stage 0")

    def received(node):  # what local rank 0 of `node` receives inside its node
        return torch.cat([slots[node * local_size + peer][0] for peer in range(local_size)])

    node_sums = [default.reduce_within_node(received(node), layout) for node in range(num_nodes)]
    if 1 in fused_stages:
        assert_same_slots(fused.reduce_within_node(received(0), layout), node_sums[0], layout.inter, "stage 1")

    across = torch.stack([node_sums[node][0] for node in range(num_nodes)])  # what rank 0 receives across nodes
    expected = default.average_across_nodes(across, layout, dtype=dtype)
    if 2 in fused_stages:
        got = fused.average_across_nodes(across, layout, dtype=dtype)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert same_values(got, expected).all(), f"stage 2: {int((~same_values(got, expected)).sum())} values differ"
    return inputs, layout.partitions(expected, 0)


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
    tensor (2100 values per partition) makes groups of up to 2104 values with large group sizes;
    groups longer than a kernel step (4096 values) are test_every_output_byte_is_written's."""
    shapes = shapes + ([(700 * topology[0] * topology[1], 3)] if large else [])
    check_each_stage(stages, topology, shapes, dtype, bits, group_size, special, seed)


@contextlib.contextmanager
def poisoned_outputs(pattern):
    """Inside: every buffer the fused launchers allocate (torch.empty in quantized_fused) is filled
    with the byte `pattern` before their launch, so a byte no program writes keeps it. Yields the
    list of the buffers allocated."""
    from deepspeed_qgz.qgz import quantized_fused
    allocated = []

    class PoisonedTorch:

        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def empty(*args, **kwargs):
            out = torch.empty(*args, **kwargs)
            out.view(torch.uint8).fill_(pattern)
            allocated.append(out)
            return out

    with mock.patch.object(quantized_fused, "torch", PoisonedTorch()):
        yield allocated


def poisoned_twice(stage, *args, **kwargs):
    """`stage`'s output, run with its outputs filled with 0x55 and then with 0xAA before the launch:
    asserts one allocation each and the same bytes both times (every byte written), returns it."""
    outputs = []
    for pattern in (0x55, 0xAA):
        with poisoned_outputs(pattern) as allocated:
            outputs.append(stage(*args, **kwargs))
        assert len(allocated) == 1 and allocated[0].data_ptr() == outputs[-1].data_ptr(), stage.__name__
    first, second = (out.contiguous().view(torch.uint8).view(-1).cpu() for out in outputs)
    unwritten = (first != second).nonzero().view(-1)
    assert not unwritten.numel(), (f"{stage.__name__}: {unwritten.numel()} of {first.numel()} output bytes keep what "
                                   f"the buffer held before the launch, the first at byte {int(unwritten[0])}")
    return outputs[0]


# Groups on both sides of a kernel step (TILE_VECTORS * 8 = 4096 values: one program holds them
# whole up to it, loops over steps past it), a group of exactly two steps and one above 15000
# (DeepSpeed's 5e8 bucket at 2 x 8 with group size 40960 takes groups of 15944); with a padded
# last group, a short last partition, and each dtype, precision and kind of special value in turn.
WRITTEN_CASES = [
    (136, torch.float16, 8, "non-finite"),
    (4096, torch.bfloat16, 4, "none"),
    (4104, torch.float32, 8, "zero groups"),
    (4104, torch.bfloat16, 4, "non-finite"),
    (8192, torch.float16, 4, "subnormals"),
    (15944, torch.bfloat16, 8, "mixed"),
]


@pytest.mark.parametrize("group_elems, dtype, bits, special", WRITTEN_CASES, ids=lambda v: str(v).split(".")[-1])
def test_every_output_byte_is_written(stages, group_elems, dtype, bits, special):
    """Each fused stage on 2 nodes x 1 rank, groups of exactly `group_elems` values (a partition of
    a whole group and a padded one, the last rank's short by 3 values), its output buffer filled with
    a byte pattern before the launch (two patterns): the same bytes both times, and the default
    stage's."""
    default, fused = stages
    num_nodes, local_size, world = 2, 1, 2
    shapes = [(world * (group_elems + group_elems // 2 + 8) - 3, 1)]
    inputs = special_inputs(shapes, world, dtype, 3, special)
    layout = exact_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_size, group_elems, bits)
    assert layout.group_elems == group_elems and layout.groups_per_partition == 2
    slots = [
        default.quantize_partitions(inputs[rank], layout).view(local_size, num_nodes, -1) for rank in range(world)
    ]
    assert_same_slots(poisoned_twice(fused.quantize_partitions, inputs[0], layout), slots[0].view(world, -1),
                      layout.intra, "stage 0")
    received = [torch.cat([slots[node * local_size + peer][0] for peer in range(local_size)]) for node in (0, 1)]
    node_sums = [default.reduce_within_node(received[node], layout) for node in (0, 1)]
    assert_same_slots(poisoned_twice(fused.reduce_within_node, received[0], layout), node_sums[0], layout.inter,
                      "stage 1")
    across = torch.stack([node_sums[node][0] for node in (0, 1)])
    got = poisoned_twice(fused.average_across_nodes, across, layout, dtype=dtype)
    expected = default.average_across_nodes(across, layout, dtype=dtype)
    assert same_values(got, expected).all(), f"stage 2: {int((~same_values(got, expected)).sum())} values differ"


@pytest.mark.parametrize("topology, dtype, bits", [
    ((8, 4), torch.float32, 8),
    ((9, 4), torch.float32, 8),
    ((9, 4), torch.bfloat16, 4),
    ((9, 4), torch.float16, 8),
    ((15, 4), torch.bfloat16, 8),
    ((15, 4), torch.float32, 4),
    ((15, 4), torch.float16, 4),
    ((16, 4), torch.float32, 8),
    ((16, 4), torch.bfloat16, 4),
    ((16, 4), torch.float16, 8),
],
                         ids=str)
def test_one_sign_at_the_largest_on_many_nodes_equals_the_default(stages, topology, dtype, bits):
    """Every value near the dtype's largest, one sign per tensor, at 8, 9, 15 and 16 nodes of 4
    ranks (node sums whose scales reach 2**126 and more, where stage 2's table entries reach 16 units
    of 2**24 per node: 8 nodes of positive ones or 9 of negative ones leave int32): rank 0's fused
    stage 2 (whose work grows with the node count) gives the default's bits on the default's node
    sums, and those results are within the range contract of the exact average."""
    num_nodes, local_size = topology
    shapes = [(num_nodes * local_size, 5), (3, 7)]
    inputs, results = check_each_stage(stages, topology, shapes, dtype, bits, MIN_GROUP_SIZE, ONE_SIGN_LARGEST, 11,
                                       (2, ))
    problems = qgz_util.check_against_average(inputs, results, 0)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_stage_2_sums_cannot_wrap_for_any_finite_scales(stages, dtype):
    """Stage 2 on inter slots whose every code is -8 or 7 beside scales of +-fp32's largest value
    (table entries of 32 and 28 units of 2**24 per node, beyond what stage 1 writes): the default's
    bits at NARROW_SUM_NODES nodes, the most that sum in int32, and one node more."""
    from deepspeed_qgz.qgz.quantized_fused import NARROW_SUM_NODES
    default, fused = stages
    largest = torch.finfo(torch.float32).max
    for num_nodes in (NARROW_SUM_NODES, NARROW_SUM_NODES + 1):
        layout = exact_layout((num_nodes * 2 * 4 * MIN_GROUP_SIZE, ), num_nodes, 2, MIN_GROUP_SIZE, 8)
        fmt = layout.inter
        received = torch.zeros(num_nodes, fmt.slot_bytes, dtype=torch.int8)
        codes = received[:, :fmt.groups_per_partition * fmt.group_bytes].view(num_nodes, -1, fmt.group_bytes)
        codes[:, 0::2] = -0x78  # 0x88: two codes of -8 (int4, two's complement)
        codes[:, 1::2] = 0x77  # two codes of 7
        scales = fmt.scales(received)
        scales[:, 0::2] = -largest
        scales[:, 1::2] = largest
        received = received.to(device())
        got = fused.average_across_nodes(received, layout, dtype=dtype)
        expected = default.average_across_nodes(received, layout, dtype=dtype)
        assert same_values(got,
                           expected).all(), f"{num_nodes} nodes: {int((~same_values(got, expected)).sum())} differ"


def test_stages_refuse_received_slots_they_cannot_read():
    """A received buffer of another size, dtype or layout in memory, or a view that does not start on
    a 16-byte boundary: a ValueError naming it, before any launch."""
    from deepspeed_qgz.qgz import quantized_fused
    layout = quantized_reduce_layout((6 * 40, ), 3, 2, MIN_GROUP_SIZE, 8)
    intra, inter = layout.intra.slot_bytes, layout.inter.slot_bytes
    buffer = torch.zeros(6 * intra + 16, dtype=torch.int8, device=device())
    with pytest.raises(ValueError,
                       match=r"reduce_within_node: received must be a contiguous int8 tensor of 6 x "
                       rf"{intra} bytes starting on a 16-byte boundary, got torch.int8 of shape \({6 * intra},\), "
                       r"strides \(1,\), at an address 4 bytes past one"):
        quantized_fused.reduce_within_node(buffer[4:4 + 6 * intra], layout)
    with pytest.raises(ValueError, match=r"average_across_nodes: .* of 3 x .*, got torch.int8 of shape \(4, "):
        quantized_fused.average_across_nodes(buffer[:4 * inter].view(4, inter), layout, torch.float32)
    with pytest.raises(ValueError, match=r"got torch.uint8"):
        quantized_fused.average_across_nodes(buffer[:3 * inter].view(torch.uint8), layout, torch.float32)
    with pytest.raises(ValueError, match=r"strides \(1, 3\)"):
        quantized_fused.average_across_nodes(buffer[:3 * inter].view(inter, 3).t(), layout, torch.float32)


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
    from deepspeed_qgz.qgz import quantized_fused
    assert "not on xpu" in quantized_fused.fused_unavailable_reason("xpu")
    monkeypatch.setattr(quantized_fused, "triton", None)
    inputs = special_inputs([(6, 8)], 2, torch.float32, 0, qgz_util.RANGE_PATTERNS[0])
    with pytest.raises(ValueError,
                       match=r"fused true .*: the fused kernels were asked for, but the fused kernels "
                       r"cannot run here: Triton is not installed"):
        simulate_all_to_all_quant_reduce(inputs, 1, 2, fused=True)

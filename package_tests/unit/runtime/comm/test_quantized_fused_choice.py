# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""zero_quantized_gradients_fused "auto" and true (quantized_fused_choice.py): the self-check of the
fused kernels' bits against the reference quantizer, on the compiled variants the call launches, the
decision it takes with the two paths' times, one decision per run of a call's plan, an exception in
the check reported as one, and the INFO line that says why. The times are injected (no test here depends on how fast anything runs); a stage made to differ in one value
stands for a kernel a GPU compiles differently. The fused kernels run in Triton's interpreter on the
CPU accelerator (TRITON_INTERPRET=1 in the environment)."""

import contextlib
import functools
import re
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed_qgz.qgz import qgz_reference
from deepspeed_qgz.qgz import quantized_fused, quantized_fused_choice, quantized_simulation
from deepspeed_qgz.qgz.quantized_layout import MIN_GROUP_SIZE, quantized_reduce_layout
from deepspeed_qgz.qgz.quantized_pipeline import pipeline_stages
from deepspeed_qgz.qgz.quantized_simulation import simulate_all_to_all_quant_reduce
from deepspeed.utils import logger

from unit.qgz_util import DTYPES, INTRA_NODE_BITS, cluster_inputs, device, same_values


def _unavailable():
    return quantized_fused.fused_unavailable_reason(torch.device(device()).type)


pytestmark = [
    pytest.mark.skipif(_unavailable() is not None, reason=f"fused kernels: {_unavailable()}"),
    # as in test_quantized_fused.py: an overflowing conversion in the interpreter fails the test
    pytest.mark.filterwarnings("error::RuntimeWarning"),
]

SHAPES = [(33, 17), (40, 30)]
STAGES = ("quantize_partitions", "reduce_within_node", "average_across_nodes")


def differing(stage):
    """quantized_fused's `stage` with the lowest bit of its output's first byte flipped: one code of
    a group of zeros (stages 0 and 1, whose first group check_inputs makes zeros) or one value."""
    real = getattr(quantized_fused, stage)

    def stage_with_one_difference(*args, **kwargs):
        out = real(*args, **kwargs)
        out.view(torch.uint8).view(-1)[0] ^= 1
        return out

    return mock.patch.object(quantized_fused, stage, stage_with_one_difference)


@contextlib.contextmanager
def decision(times=None, stage=None):
    """Inside: no decision taken yet; `times` (fused, default seconds) for the timing of "auto";
    `stage` made to differ in one value. Yields the INFO lines logged and a count of the fused
    stage-2 launches (one in the self-check, one per rank's run on the fused path)."""
    lines, launches = [], []
    real_average = quantized_fused.average_across_nodes

    def counted(*args, **kwargs):
        launches.append(1)
        return real_average(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(quantized_fused_choice._CHOICES, clear=True))
        real_info = logger.info

        def info(line, *args, **kwargs):
            if str(line).startswith("qgZ zero_quantized_gradients_fused"):
                lines.append(line)
            else:
                real_info(line, *args, **kwargs)

        stack.enter_context(mock.patch.object(logger, "info", info))
        stack.enter_context(mock.patch.object(quantized_fused, "average_across_nodes", counted))
        if times is not None:
            stack.enter_context(mock.patch.object(quantized_fused_choice, "time_paths", lambda *args: times))
        if stage is not None:
            stack.enter_context(differing(stage))
        yield lines, launches


def simulated(fused, bits=8, dtype=torch.bfloat16, nodes=3, local_size=2):
    inputs = cluster_inputs(SHAPES, nodes * local_size, dtype, 7)
    outputs, _ = simulate_all_to_all_quant_reduce([[t.to(device()) for t in r] for r in inputs],
                                                  nodes,
                                                  local_size,
                                                  intra_node_bits=bits,
                                                  fused=fused)
    return outputs


def assert_same(outputs, expected):
    for rank, (got, want) in enumerate(zip(outputs, expected)):
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape and same_values(a, b).all(), f"rank {rank} tensor {i}"


@pytest.fixture(scope="module")
def default_outputs():
    return simulated(False)


@pytest.mark.parametrize("bits", INTRA_NODE_BITS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_the_fused_kernels_pass_the_self_check(dtype, bits):
    assert quantized_fused_choice.self_check(3, 2, 136, bits, dtype, torch.device(device())) is None


def test_the_self_check_covers_the_wide_sums_and_large_groups():
    """More than NARROW_SUM_NODES nodes (stage 2's int64 sums), and groups longer than a program's
    4096 values (a kernel step and a vector more: the loops' last, partial step)."""
    nodes = quantized_fused.NARROW_SUM_NODES + 1
    assert quantized_fused_choice.self_check(nodes, 1, 136, 8, torch.bfloat16, torch.device(device())) is None
    assert quantized_fused_choice.self_check(1, 1, 4104, 4, torch.float32, torch.device(device())) is None


def test_the_check_bucket_holds_the_cases_of_the_gpu_check():
    """Zeros, subnormals, the largest and smallest normal values, ties, inf and NaN, in node 0's
    local ranks only (6 * local_world_size * world * group_elems values); the largest with one sign
    in every partition of every local rank, positive and negative."""
    inputs = quantized_fused_choice.check_inputs(3, 2, 136, torch.float16, device())
    assert len(inputs) == 2 and sum(t.numel() for r in inputs for t in r) == 6 * 2 * 6 * 136
    values = torch.cat([t.float().view(-1) for r in inputs for t in r]).cpu()
    info = torch.finfo(torch.float16)
    assert (values[:136] == 0).all()
    assert ((values.abs() < info.tiny) & (values != 0)).any()
    for special in (info.max, -info.max, info.tiny, 2.5, 0.5):
        assert (values == special).any(), special
    assert torch.isinf(values).sum() == 1 and torch.isnan(values).sum() == 1
    layout = quantized_fused_choice.check_layout(3, 2, 136, 8)
    for tensors in inputs:
        assert tuple(t.numel() for t in tensors) == tuple(t.numel for t in layout.tensors)
        partitions = tensors[1].view(6, 3, 136).float().cpu()  # every partition's 3 groups
        assert (partitions[:, 1].amax(dim=1) == info.max).all() and (partitions[:, 2].amin(dim=1) == -info.max).all()


def test_the_self_check_brings_every_nodes_largest_sum_to_stage_2():
    """At 9 nodes x 4 ranks in fp32 (node sums' scales past 2**126, stage 2's table entries of 16
    units of 2**24 per node), the check's bucket finds int32 sums for 9 nodes (the sums of before)
    to be a mismatch of stage 2, and the kernels as they are to pass. Stages 0 and 1 run on the
    reference here (the interpreter's time), so stage 2 is the fused one checked."""
    reference = pipeline_stages(qgz_reference)
    check = functools.partial(quantized_fused_choice.self_check, 9, 4, 136, 8, torch.float32, torch.device(device()))
    with mock.patch.object(quantized_fused, "quantize_partitions", reference.quantize_partitions), \
            mock.patch.object(quantized_fused, "reduce_within_node", reference.reduce_within_node):
        assert check() is None
        with mock.patch.object(quantized_fused, "NARROW_SUM_NODES", 15):
            found = check()
    assert found is not None and found.startswith("stage 2 (the average): "), found


def test_the_self_checks_groups_are_the_calls_for_every_group_size():
    """For every group size a key can hold (each multiple of 8 from 136 to 40960): the check's
    layout has groups of exactly that size, so the tile class (ROWS, VPG_PAD, ONE_STEP) of its every
    launch is the call's; and its bucket is what check_inputs builds."""
    shape = quantized_fused.tile_shape
    for group_elems in range(MIN_GROUP_SIZE, 40960 + 1, 8):
        layout = quantized_fused_choice.check_layout(2, 2, group_elems, 8)
        assert layout.group_elems == group_elems and shape(layout.group_elems) == shape(group_elems)
        assert tuple(t.numel for t in layout.tensors) == (12 * group_elems, 12 * group_elems)
        assert layout.groups_per_partition == 6 and layout.padding_elems == 0


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(1, 10**7), min_size=1, max_size=4),
       topology=st.sampled_from([(1, 1), (1, 2), (3, 2), (2, 8), (9, 4), (16, 2)]),
       group_size=st.sampled_from([MIN_GROUP_SIZE, 1024, 4104, 40960]),
       bits=st.sampled_from([4, 8]))
def test_exact_layout_is_the_layouts_own_at_its_group_size(numels, topology, group_size, bits):
    """exact_layout at the group size quantized_reduce_layout takes is quantized_reduce_layout's layout."""
    layout = quantized_reduce_layout(tuple(numels), *topology, group_size, bits)
    assert quantized_fused_choice.exact_layout(numels, *topology, layout.group_elems, bits) == layout


def recorded_launches(run):
    """{(kernel, its meta-parameters)} of the fused launches `run()` makes, none of them run."""
    launches = set()

    def record(kernel, grid, args, meta, reads=()):
        launches.add((kernel.fn.__name__, tuple(sorted(meta.items()))))

    with mock.patch.object(quantized_fused, "_launch", record):
        run()
    return launches


@pytest.mark.parametrize("topology, group_elems, bits, dtype", [
    ((1, 2), 136, 8, torch.float16),
    ((1, 2), 1024, 4, torch.bfloat16),
    ((1, 2), 4104, 8, torch.float32),
    ((1, 2), 15944, 4, torch.bfloat16),
    ((1, 2), 40960, 8, torch.float16),
    ((4, 1), 1024, 8, torch.float32),
],
                         ids=str)
def test_the_self_check_launches_the_calls_compiled_variants(topology, group_elems, bits, dtype):
    """The launches of a call whose layout takes groups of `group_elems` (a bucket on which
    quantized_reduce_layout takes exactly that size; meta tensors) and those of the self-check for
    its key: the same kernels with the same meta-parameters (the compiled variants). Before, the
    check took the cheapest group up to the key's for its own small bucket (1024: 256, 4104: 456,
    15944: 840, 40960: 1280)."""
    num_nodes, local_size = topology
    world = num_nodes * local_size
    partition = group_elems * group_elems // 8  # groups' scales fill one scale group: no other size sends fewer bytes
    layout = quantized_reduce_layout((world * partition, ), num_nodes, local_size, group_elems, bits)
    assert layout.group_elems == group_elems

    def call():
        fused = pipeline_stages(None, fused=True)
        fused.quantize_partitions([torch.empty(world * partition, dtype=dtype, device="meta")], layout)
        fused.reduce_within_node(torch.empty(world, layout.intra.slot_bytes, dtype=torch.int8, device="meta"), layout)
        fused.average_across_nodes(torch.empty(num_nodes, layout.inter.slot_bytes, dtype=torch.int8, device="meta"),
                                   layout,
                                   dtype=dtype)

    def check():
        with mock.patch.object(quantized_fused_choice, "slot_difference", lambda *args: None), \
                mock.patch.object(quantized_fused_choice, "value_difference", lambda *args: None):
            assert quantized_fused_choice.self_check(num_nodes, local_size, group_elems, bits, dtype,
                                                     torch.device(device())) is None

    launched = recorded_launches(call)
    assert len(launched) == 3 and recorded_launches(check) == launched


def test_auto_takes_the_fused_kernels_where_their_bits_match_and_they_are_faster(default_outputs):
    with decision(times=(0.001, 0.002)) as (lines, launches):
        assert_same(simulated("auto"), default_outputs)
    assert len(launches) == 1 + 6, "the self-check's launch and one per rank: the fused path ran"
    assert len(lines) == 1 and lines[0].startswith('qgZ zero_quantized_gradients_fused "auto" (bfloat16, 8/4 bits, '
                                                   "groups of 136, 3 x 2 ranks, on cpu): the fused kernels (")
    assert "the self-check gave the reference's bits; one call of the fused kernels 1.00 ms, of DeepSpeed's kernels " \
           "2.00 ms" in lines[0]


def test_auto_takes_deepspeeds_kernels_where_the_fused_are_slower(default_outputs):
    with decision(times=(0.002, 0.001)) as (lines, launches):
        assert_same(simulated("auto"), default_outputs)
    assert len(launches) == 1, "only the self-check ran the fused kernels"
    assert len(lines) == 1 and ": DeepSpeed's kernels (the self-check gave the reference's bits; one call of the " \
        "fused kernels 2.00 ms, of DeepSpeed's kernels 1.00 ms)" in lines[0]


@pytest.mark.parametrize("stage", STAGES)
def test_auto_takes_deepspeeds_kernels_where_a_stage_differs_in_one_value(stage, default_outputs):
    with decision(times=(0.001, 0.002), stage=stage) as (lines, launches):
        assert_same(simulated("auto"), default_outputs)
    assert len(launches) <= 1
    number = STAGES.index(stage)
    what = "values" if number == 2 else "codes"
    assert len(lines) == 1 and ": DeepSpeed's kernels (the self-check found a mismatch: " in lines[0]
    found = re.search(
        rf"stage {number} \([^)]*\): 1 {what} differ, the first at index 0: fused (0x[0-9a-f]+), "
        r"reference (0x[0-9a-f]+)", lines[0])
    assert found and int(found.group(1), 16) ^ int(found.group(2), 16) == 1, lines[0]


def test_true_with_a_mismatch_raises_naming_it():
    with decision(stage="reduce_within_node"), pytest.raises(ValueError) as raised:
        simulated(True, bits=4)
    assert re.search(
        r"fused true \(bfloat16, 4/4 bits, .*\): the fused kernels were asked for, but the self-check found a "
        r"mismatch: stage 1 \(the node's inter slots\): 1 codes differ", str(raised.value))


def test_true_runs_the_fused_kernels_after_the_check_without_timing(default_outputs):

    def no_timing(*args):
        raise AssertionError("true does not time the paths")

    with decision() as (lines, launches), mock.patch.object(quantized_fused_choice, "time_paths", no_timing):
        assert_same(simulated(True), default_outputs)
    assert len(launches) == 1 + 6 and "fused true" in lines[0] and ": the fused kernels (" in lines[0]


def test_false_never_runs_the_fused_kernels(default_outputs):
    with decision(times=(0.001, 0.002)) as (lines, launches):
        assert_same(simulated(False), default_outputs)
    assert not launches and not lines


def test_each_key_is_decided_once_per_process(default_outputs):
    with decision(times=(0.001, 0.002)) as (lines, launches):
        simulated("auto")
        simulated("auto")
        simulated("auto", bits=4)
        assert len(launches) == 2 * (1 + 6) + 6 and len(lines) == 2
        assert sorted(key.intra_node_bits for key in quantized_fused_choice.choices()) == [4, 8]


def test_auto_where_the_kernels_cannot_run_is_the_default_path_without_an_error(default_outputs):
    with decision(times=(0.001, 0.002)) as (lines, launches), mock.patch.object(quantized_fused, "triton", None):
        assert_same(simulated("auto"), default_outputs)
    assert not launches
    assert len(lines) == 1 and ": DeepSpeed's kernels (the fused kernels cannot run here: Triton is not " \
        "installed" in lines[0]


def split_plan(group_sizes):
    """A stand-in for quantized_reduce_plan: one run per tensor, run i with groups of exactly
    group_sizes[i] values (a call split into runs whose layouts take different group sizes)."""

    def plan(numels, num_nodes, local_world_size, group_size, intra_node_bits):
        return tuple(
            (i, quantized_fused_choice.exact_layout((numel, ), num_nodes, local_world_size, size, intra_node_bits))
            for i, (numel, size) in enumerate(zip(numels, group_sizes)))

    return plan


def test_each_run_of_a_split_call_is_checked_before_its_first_launch():
    """A call whose plan has two runs with groups of 136 and of 264: a decision (and a self-check)
    for each run's key, both before the call's first launch, and every run on the fused kernels."""
    inputs = [[t.to(device()) for t in r] for r in cluster_inputs(SHAPES, 2, torch.float32, 7)]
    order, checking = [], []  # the checks and the call's own stage 0 launches, in order
    real_check, real_stage = quantized_fused_choice.self_check, quantized_fused.quantize_partitions

    def check(num_nodes, local_size, group_elems, *args):
        order.append(("check", group_elems))
        checking.append(True)
        try:
            return real_check(num_nodes, local_size, group_elems, *args)
        finally:
            checking.pop()

    def stage(tensors, layout):
        if not checking:
            order.append(("launch", layout.group_elems))
        return real_stage(tensors, layout)

    with mock.patch.object(quantized_simulation, "quantized_reduce_plan", split_plan((136, 264))):
        expected, _ = simulate_all_to_all_quant_reduce(inputs, 2, 1, intra_node_bits=4)
        with decision(times=(0.001, 0.002)) as (lines, _), \
                mock.patch.object(quantized_fused_choice, "self_check", check), \
                mock.patch.object(quantized_fused, "quantize_partitions", stage):
            got, layouts = simulate_all_to_all_quant_reduce(inputs, 2, 1, intra_node_bits=4, fused="auto")
            decided = quantized_fused_choice.choices()
    assert [layout.group_elems for layout in layouts] == [136, 264]
    assert sorted(key.group_elems for key in decided) == [136, 264] and all(c.fused for c in decided.values())
    assert len(lines) == 2 and "groups of 136" in lines[0] and "groups of 264" in lines[1]
    # both checks, then each rank's launch of each run
    assert order == [("check", 136), ("check", 264)] + [("launch", 136)] * 2 + [("launch", 264)] * 2, order
    assert_same(got, expected)


@contextlib.contextmanager
def warnings_logged():
    """Inside: DeepSpeed's logger's warnings collected (the message and the exception logged with it)."""
    lines = []

    def warning(line, *args, exc_info=None, **kwargs):
        lines.append((str(line), exc_info))

    with mock.patch.object(logger, "warning", warning):
        yield lines


def test_auto_where_the_check_raises_reports_the_exception_and_takes_deepspeeds_kernels(default_outputs):
    """A self-check that raises (a compile error, say), or a timing that runs out of memory: the
    verdict names the exception's type and message, not a mismatch; the warning carries the
    exception; DeepSpeed's kernels run."""
    failures = {
        "self_check": ("the self-check", RuntimeError("PTXASError: ptxas fatal\nline two")),
        "time_paths":
        ("the timing of the two paths", torch.OutOfMemoryError("out of memory: tried to allocate 2 GiB")),
    }
    for where, (step, exc) in failures.items():

        def fail(*args, exc=exc):
            raise exc

        with decision() as (lines, launches), warnings_logged() as warned, \
                mock.patch.object(quantized_fused_choice, where, fail):
            assert_same(simulated("auto"), default_outputs)
        described = f"{type(exc).__name__}: {' | '.join(str(exc).splitlines())}"
        assert len(lines) == 1 and f": DeepSpeed's kernels ({step} raised {described})" in lines[0], lines
        assert "mismatch" not in lines[0]
        assert len(warned) == 1 and f"{step} raised {described}" in warned[0][0]
        assert warned[0][1][1] is exc
        if where == "self_check":
            assert not launches


def test_true_where_the_check_raises_raises_that_exception():
    """With true, the exception itself (after the agreement), with a note naming the setting and key."""
    exc = RuntimeError("PTXASError: ptxas fatal")

    def fail(*args):
        raise exc

    with decision(), warnings_logged(), mock.patch.object(quantized_fused_choice, "self_check", fail), \
            pytest.raises(RuntimeError) as raised:
        simulated(True)
    assert raised.value is exc
    if hasattr(exc, "add_note"):  # Python 3.11 and later
        assert any("fused true (bfloat16, 8/4 bits" in note for note in exc.__notes__), exc.__notes__


@pytest.mark.parametrize("value", ["yes", 1, None, "AUTO"])
def test_a_bad_setting_names_the_value_and_what_is_allowed(value):
    with pytest.raises(ValueError, match=re.escape(f"fused {value!r} must be one of true, false or \"auto\"")):
        simulated(value)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""zero_quantized_gradients_fused "auto" and true (quantized_fused_choice.py): the self-check of the
fused kernels' bits against the reference quantizer, the decision it takes with the two paths' times,
the same decision on every rank, and the INFO line that says why. The times are injected (no test
here depends on how fast anything runs); a stage made to differ in one value stands for a kernel a
GPU compiles differently. The fused kernels run in Triton's interpreter on the CPU accelerator
(TRITON_INTERPRET=1 in the environment)."""

import contextlib
import re
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.comm import quantized_fused, quantized_fused_choice
from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce
from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce
from deepspeed.utils import logger

from unit.common import DistributedTest
from unit.qgz_util import DTYPES, INTRA_NODE_BITS, cluster_inputs, device, same_values, simulated_nodes


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
    """More than NARROW_SUM_NODES nodes (stage 2's int64 sums), and a group of several tiles' rows."""
    nodes = quantized_fused.NARROW_SUM_NODES + 2
    assert quantized_fused_choice.self_check(nodes, 1, 136, 8, torch.bfloat16, torch.device(device())) is None
    assert quantized_fused_choice.self_check(1, 3, 4160, 4, torch.float32, torch.device(device())) is None


def test_the_check_bucket_holds_the_cases_of_the_gpu_check():
    """Zeros, subnormals, the largest and smallest normal values, ties, inf and NaN, in node 0's
    local ranks only (5 * local_world_size * world * group_elems values)."""
    inputs = quantized_fused_choice.check_inputs(3, 2, 136, torch.float16, device())
    assert len(inputs) == 2 and sum(t.numel() for r in inputs for t in r) == 5 * 2 * 6 * 136
    values = torch.cat([t.float().view(-1) for r in inputs for t in r]).cpu()
    info = torch.finfo(torch.float16)
    assert (values[:136] == 0).all()
    assert ((values.abs() < info.tiny) & (values != 0)).any()
    for special in (info.max, -info.max, info.tiny, 2.5, 0.5):
        assert (values == special).any(), special
    assert torch.isinf(values).sum() == 1 and torch.isnan(values).sum() == 1


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


@pytest.mark.parametrize("value", ["yes", 1, None, "AUTO"])
def test_a_bad_setting_names_the_value_and_what_is_allowed(value):
    with pytest.raises(ValueError, match=re.escape(f"fused {value!r} must be one of true, false or \"auto\"")):
        simulated(value)


class TestFusedChoiceIsTheWorlds(DistributedTest):
    """At 3 nodes x 2 ranks in a real world: every rank takes the same decision, even where one
    rank's check or time differs from the others', and with true every rank raises."""
    world_size = 6
    reuse_dist_env = True

    def call(self, fused, times, differ_on=None, stage="reduce_within_node"):
        """This rank's outputs and choice of one all_to_all_quant_reduce call under `fused`, with the
        injected `times` (per rank: a function of the rank) and `stage` differing on rank `differ_on`."""
        rank = dist.get_rank()
        with simulated_nodes(2) as groups, decision(times(rank), stage if rank == differ_on else None) as (lines, _):
            inputs = cluster_inputs(SHAPES, 6, torch.bfloat16, 3)
            outputs = all_to_all_quant_reduce([t.to(device()) for t in inputs[rank]], groups, fused=fused)
            choices = list(quantized_fused_choice.choices().values())
        assert len(choices) == 1
        return outputs, choices[0], lines

    def default(self):
        with simulated_nodes(2) as groups:
            inputs = cluster_inputs(SHAPES, 6, torch.bfloat16, 3)
            return all_to_all_quant_reduce([t.to(device()) for t in inputs[dist.get_rank()]], groups, fused=False)

    def test_every_rank_faster_takes_the_fused_kernels(self):
        outputs, choice, lines = self.call("auto", lambda rank: (0.001, 0.002))
        assert choice.fused
        assert all(same_values(a, b).all() for a, b in zip(outputs, self.default()))
        assert len(lines) == (1 if dist.get_rank() == 0 else 0)

    def test_one_ranks_mismatch_keeps_every_rank_on_deepspeeds_kernels(self):
        outputs, choice, lines = self.call("auto", lambda rank: (0.001, 0.002), differ_on=3)
        assert not choice.fused
        assert all(same_values(a, b).all() for a, b in zip(outputs, self.default()))
        assert "every rank takes DeepSpeed's kernels: a mismatch on 1 of 6 ranks (3)" in choice.reason
        if dist.get_rank() == 0:
            assert len(lines) == 1 and lines[0] == choice.reason

    def test_one_ranks_time_keeps_every_rank_on_deepspeeds_kernels(self):
        outputs, choice, _ = self.call("auto", lambda rank: (0.002, 0.001) if rank == 4 else (0.001, 0.002))
        assert not choice.fused
        assert "every rank takes DeepSpeed's kernels: the fused kernels slower on 1 of 6 ranks (4)" in choice.reason

    def test_true_with_one_ranks_mismatch_raises_on_every_rank(self):
        with pytest.raises(ValueError) as raised:
            self.call(True, lambda rank: None, differ_on=5, stage="average_across_nodes")
        assert "the fused kernels were asked for" in str(raised.value)
        assert "a mismatch on 1 of 6 ranks (5)" in str(raised.value)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
unit tests for coalesced collectives
"""

import importlib.util
import re
from unittest import mock

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.comm import coalesced_collectives
from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce
from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce

from unit.common import DistributedTest
from unit.qgz_util import (DTYPES, INTRA_NODE_BITS, RANGE_PATTERNS, RMS_BOUND, check_against_average, cluster_inputs,
                           device, partition_bounds, range_inputs, same_bits, same_values, simulated_nodes)


class CollectiveLog:
    """Counts all_to_all_quant_reduce's collectives and the bytes each sends to other ranks."""

    def __init__(self):
        self.calls, self.bytes = 0, 0

    def __enter__(self):
        self._all_to_all = coalesced_collectives.all_to_all_single
        self._reduce_scatter = dist.reduce_scatter_fn

        def all_to_all(output, tensor, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size() * (size - 1) // size
            return self._all_to_all(output, tensor, group=group, **kwargs)

        def reduce_scatter(output, tensor, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size() * (size - 1) // size
            return self._reduce_scatter(output, tensor, group=group, **kwargs)

        coalesced_collectives.all_to_all_single = all_to_all
        dist.reduce_scatter_fn = reduce_scatter
        return self

    def __exit__(self, *exc):
        coalesced_collectives.all_to_all_single = self._all_to_all
        dist.reduce_scatter_fn = self._reduce_scatter
        return False


def quantized_call(name,
                   shapes,
                   dtype,
                   seed,
                   groups,
                   local_size,
                   magnitudes=None,
                   inputs=None,
                   rms_bound=RMS_BOUND,
                   compare_simulated=True,
                   **kwargs):
    """One all_to_all_quant_reduce call on every rank; returns this rank's problems: against
    reduce_scatter_coalesced's contract and the exact average, against the same call simulated
    for the whole cluster in this process (bit for bit), the caller's tensors left untouched, and
    the accounting against the collectives seen. `inputs` (every rank's tensors) replaces the
    shared-signal inputs of `shapes`, `dtype`, `seed` and `magnitudes`; `rms_bound` None leaves the
    relative RMS error unchecked (inputs without a shared signal); `compare_simulated` False leaves
    out the comparison with the simulated cluster."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if inputs is None:
        inputs = cluster_inputs(shapes, world, dtype, seed, magnitudes)
    mine = [t.to(device()) for t in inputs[rank]]
    originals = [t.clone() for t in mine]
    with CollectiveLog() as log:
        outputs = all_to_all_quant_reduce(mine, groups, **kwargs)
    stats = coalesced_collectives.qgz_accounting.last_call
    quantized = [i for i, t in enumerate(mine) if t.dim() > 1 and t.numel() > 0]
    exact = [i for i, t in enumerate(mine) if t.dim() <= 1 and t.numel() > 0]
    problems = check_against_average(inputs, outputs, rank, exact_indices=exact, rms_bound=rms_bound)
    if not all(same_bits(a, b) for a, b in zip(mine, originals)):
        problems.append("the caller's tensors were written to")
    if (stats.quantized_tensors, stats.exact_tensors) != (len(quantized), len(exact)):
        problems.append(f"{stats.quantized_tensors} quantized and {stats.exact_tensors} exact tensors reported, "
                        f"expected {len(quantized)} and {len(exact)}")
    if (stats.collective_calls, stats.intra_node_bytes + stats.inter_node_bytes) != (log.calls, log.bytes):
        problems.append(f"accounting: {stats.collective_calls} collectives and "
                        f"{stats.intra_node_bytes + stats.inter_node_bytes} bytes reported, "
                        f"{log.calls} and {log.bytes} seen")
    if quantized and compare_simulated:
        simulated, _ = simulate_all_to_all_quant_reduce([[[t.to(device()) for t in r][i] for i in quantized]
                                                         for r in inputs], world // local_size, local_size, **kwargs)
        if not all(same_bits(outputs[i], sim) for i, sim in zip(quantized, simulated[rank])):
            problems.append("differs from the simulated cluster")
    return [f"{name}: {p}" for p in problems]


def assert_no_problems(problems):
    assert not problems, f"rank {dist.get_rank()}:\n" + "\n".join(problems[:20])


class QuantizedReduceScatterTests:
    """all_to_all_quant_reduce on a world of `world_size` processes that form nodes of
    `local_size` ranks: reduce_scatter_coalesced's partitions, the average within the
    quantization error, on any node count."""
    local_size = None
    reuse_dist_env = True

    def shape_sets(self):
        return {
            "odd 2-D": [(7, 5)],
            "3-D": [(3, 5, 7)],
            "tiny": [(1, 3)],
            "world-sized": [(self.world_size, 1)],
            "vocab-like": [(3141, 48)],
            "mixed 2-D/1-D bucket": [(33, 17), (64, ), (5, 5, 5), (0, 4), (1, 2), (128, 96), (11, ), (2, 1, 1)],
        }

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_shapes_and_dtypes(self, intra_node_bits):
        problems, seed = [], 0
        with simulated_nodes(self.local_size) as groups:
            for name, shapes in self.shape_sets().items():
                for dtype_name, dtype in DTYPES.items():
                    seed += 1
                    problems += quantized_call(f"{name}/{dtype_name}",
                                               shapes,
                                               dtype,
                                               seed,
                                               groups,
                                               self.local_size,
                                               intra_node_bits=intra_node_bits)
        assert_no_problems(problems)

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_tensors_10e6_apart_and_group_sizes(self, intra_node_bits):
        """No quantization group holds elements of two tensors, so a tensor 10^6 times smaller than
        its neighbours keeps its own precision; the largest allowed groups work too."""
        problems = []
        with simulated_nodes(self.local_size) as groups:
            for seed, (dtype_name, magnitudes) in enumerate(
                (("fp32", [1e-3, 1e3, 1.0, 1e-3]), ("bf16", [1e-3, 1e3, 1.0, 1e-3]), ("fp16", [1e-2, 1e4, 1.0,
                                                                                               1e-2]))):
                problems += quantized_call(f"magnitudes/{dtype_name}", [(33, 17), (64, 48), (5, 5, 5), (1, 9)],
                                           DTYPES[dtype_name],
                                           100 + seed,
                                           groups,
                                           self.local_size,
                                           magnitudes,
                                           intra_node_bits=intra_node_bits)
            for group_size in (136, 1024, 40960):
                problems += quantized_call(f"group size {group_size}", [(33, 17), (300, 7)],
                                           torch.bfloat16,
                                           200 + group_size,
                                           groups,
                                           self.local_size,
                                           group_size=group_size,
                                           intra_node_bits=intra_node_bits)
        assert_no_problems(problems)

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_non_finite_values_reach_only_their_owners(self, intra_node_bits):
        """A NaN in the last rank's input inside rank 0's partition, and an inf in rank 0's input
        inside the last rank's partition: those two partitions are non-finite, no other."""
        world, rank = dist.get_world_size(), dist.get_rank()
        shape = (world * 5, 7)
        problems = []
        with simulated_nodes(self.local_size) as groups:
            for dtype_name, dtype in DTYPES.items():
                mine = cluster_inputs([shape], world, dtype, 7)[rank][0]
                flat = mine.view(-1)
                if rank == world - 1:
                    flat[partition_bounds(flat.numel(), world, 0)[0] + 3] = float("nan")
                if rank == 0:
                    flat[partition_bounds(flat.numel(), world, world - 1)[0] + 1] = float("inf")
                out = all_to_all_quant_reduce([mine.to(device())], groups, intra_node_bits=intra_node_bits)[0]
                poisoned = rank in (0, world - 1)
                if poisoned == bool(torch.isfinite(out).all()):
                    problems.append(f"{dtype_name}: rank {rank}'s partition is {'finite' if poisoned else 'not'}")
        assert_no_problems(problems)

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_deterministic(self, intra_node_bits):
        world, rank = dist.get_world_size(), dist.get_rank()
        with simulated_nodes(self.local_size) as groups:
            mine = [t.to(device()) for t in cluster_inputs([(45, 33), (17, )], world, torch.bfloat16, 99)[rank]]
            first = all_to_all_quant_reduce(mine, groups, intra_node_bits=intra_node_bits)
            second = all_to_all_quant_reduce([t.clone() for t in mine], groups, intra_node_bits=intra_node_bits)
        assert all(same_bits(a, b) for a, b in zip(first, second))

    def test_bad_input_is_refused_before_any_collective(self):
        """Each refusal is a ValueError naming the values, raised on every rank before any
        collective, so no rank hangs."""
        world, rank = dist.get_world_size(), dist.get_rank()
        num_nodes = world // self.local_size
        ones = torch.ones(4, 4, device=device())
        with simulated_nodes(self.local_size) as groups:
            node, local_rank = divmod(rank, self.local_size)
            cases = {
                "int32": (lambda: all_to_all_quant_reduce([ones.int()], groups), "unsupported dtype torch.int32"),
                "mixed dtypes": (lambda: all_to_all_quant_reduce([ones, ones.half()], groups), "must share a dtype"),
                "group size": (lambda: all_to_all_quant_reduce([ones], groups, group_size=128),
                               "group_size 128 must be a multiple of 8 between 136 and 40960"),
                "precision": (lambda: all_to_all_quant_reduce([ones], groups, intra_node_bits=2),
                              "intra_node_bits 2 must be one of (4, 8)"),
                "missing group": (lambda: all_to_all_quant_reduce([ones], {}), f"groups has no 'local_{node}'"),
            }
            if num_nodes != self.local_size:
                swapped = dict(groups, **{f"local_{node}": groups[f"global_{local_rank}"]})
                cases["mis-sized group"] = (lambda: all_to_all_quant_reduce([ones], swapped),
                                            f"group 'local_{node}' has {num_nodes} ranks, expected {self.local_size}")
            with CollectiveLog() as log:
                for name, (call, message) in cases.items():
                    with pytest.raises(ValueError, match=re.escape(message)):
                        call()
            assert log.calls == 0
            assert all_to_all_quant_reduce([], groups) == []

    def test_one_dimensional_tensors_need_no_groups(self):
        """A call of 1-D tensors only (biases, norms) exchanges nothing quantized: DeepSpeed's own
        tests call it with an empty groups dict."""
        world, rank = dist.get_world_size(), dist.get_rank()
        with simulated_nodes(self.local_size):
            inputs = cluster_inputs([(10, ), (3, )], world, torch.bfloat16, 5)
            outputs = all_to_all_quant_reduce([t.to(device()) for t in inputs[rank]], {})
        assert_no_problems(check_against_average(inputs, outputs, rank, exact_indices=(0, 1)))


class FusedKernelTests:
    """all_to_all_quant_reduce(fused=True) in a real world: the same results as the default path,
    bit for bit (NaN payloads aside), and the same accounting, in `fused_dtypes`."""
    fused_dtypes = DTYPES

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_fused_equals_the_default(self, intra_node_bits):
        from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason
        reason = fused_unavailable_reason(torch.device(device()).type)
        if reason is not None:
            pytest.skip(f"fused kernels: {reason}")
        world, rank = dist.get_world_size(), dist.get_rank()
        problems = []
        with simulated_nodes(self.local_size) as groups:
            for seed, (dtype_name, dtype) in enumerate(self.fused_dtypes.items()):
                for name, shapes in (("mixed", [(33, 17), (64, ), (5, 5, 5), (1, 2),
                                                (40, 30)]), ("non-finite", [(33, 17), (40, 30)])):
                    inputs = cluster_inputs(shapes, world, dtype, seed)
                    if name == "non-finite":
                        inputs[world - 1][0].view(-1)[7] = float("nan")
                        inputs[0][1].view(-1)[-1] = float("inf")
                    mine = [t.to(device()) for t in inputs[rank]]
                    results = {}
                    for fused in (False, True):
                        results[fused] = all_to_all_quant_reduce(mine,
                                                                 groups,
                                                                 intra_node_bits=intra_node_bits,
                                                                 fused=fused)
                        results[fused, "stats"] = coalesced_collectives.qgz_accounting.last_call
                    for i, (got, expected) in enumerate(zip(results[True], results[False])):
                        if got.dtype != expected.dtype or got.shape != expected.shape or not same_values(
                                got, expected).all():
                            problems.append(f"{name}/{dtype_name}: tensor {i} differs from the default path")
                    if results[True, "stats"] != results[False, "stats"]:
                        problems.append(f"{name}/{dtype_name}: accounting {results[True, 'stats']} != "
                                        f"{results[False, 'stats']}")
                    if name == "mixed":
                        exact = [i for i, t in enumerate(mine) if t.dim() == 1]
                        problems += [
                            f"{name}/{dtype_name}: {p}"
                            for p in check_against_average(inputs, results[True], rank, exact, rms_bound=RMS_BOUND)
                        ]
        assert_no_problems(problems)

    def test_fused_true_loads_no_quantizer_op(self):
        """fused=True runs none of DeepSpeed's kernels, so it never loads (on CUDA: builds) their op."""
        from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason
        reason = fused_unavailable_reason(torch.device(device()).type)
        if reason is not None:
            pytest.skip(f"fused kernels: {reason}")
        world, rank = dist.get_world_size(), dist.get_rank()
        inputs = cluster_inputs([(33, 17), (40, 30)], world, torch.bfloat16, 11)
        unloadable = AssertionError("fused=True asked for DeepSpeed's quantizer op")
        with simulated_nodes(self.local_size) as groups, mock.patch.object(coalesced_collectives,
                                                                           "_get_quantizer_module",
                                                                           side_effect=unloadable):
            outputs = all_to_all_quant_reduce([t.to(device()) for t in inputs[rank]], groups, fused=True)
        assert_no_problems(check_against_average(inputs, outputs, rank))


class NPUQuantizerTests:
    """all_to_all_quant_reduce on DeepSpeed's pure-PyTorch NPUQuantizer, set as the quantizer module
    as DeepSpeed's own tests set it: the simulated cluster on the same quantizer, bit for bit, and
    the exact average within the error bound (NPUQuantizer truncates where the CUDA kernels round, so
    no RMS bound), in every dtype at both intra-node precisions."""

    @pytest.mark.parametrize("intra_node_bits", INTRA_NODE_BITS)
    def test_npu_quantizer(self, intra_node_bits):
        if importlib.util.find_spec("deepspeed.ops.op_builder.npu.quantizer") is None:
            pytest.skip("this DeepSpeed has no NPUQuantizer (deepspeed/ops/op_builder/npu/quantizer.py)")
        from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
        saved, coalesced_collectives.quantizer_module = coalesced_collectives.quantizer_module, NPUQuantizer
        problems = []
        try:
            with simulated_nodes(self.local_size) as groups:
                for seed, (dtype_name, dtype) in enumerate(DTYPES.items()):
                    problems += quantized_call(f"NPUQuantizer/{dtype_name}", [(33, 17), (64, ), (5, 5, 5), (40, 30)],
                                               dtype,
                                               seed,
                                               groups,
                                               self.local_size,
                                               rms_bound=None,
                                               intra_node_bits=intra_node_bits)
        finally:
            coalesced_collectives.quantizer_module = saved
        assert_no_problems(problems)


class TestQuantizedReduceScatter3Nodes2Ranks(NPUQuantizerTests, FusedKernelTests, QuantizedReduceScatterTests,
                                             DistributedTest):
    world_size = 6
    local_size = 2

    def test_range_contract(self):
        """Finite gradients anywhere in each dtype's range (qgz_util.range_inputs: mixed magnitudes
        across ranks, one rank far larger, constant tensors, the largest value, the smallest normal):
        every result finite and within the error bound (the simulated cluster's bits are compared by
        the other tests of this class, and the range on simulated clusters by test_quantized_range.py)."""
        problems, world = [], dist.get_world_size()
        with simulated_nodes(self.local_size) as groups:
            for bits in INTRA_NODE_BITS:
                for dtype_name, dtype in DTYPES.items():
                    for seed, pattern in enumerate(RANGE_PATTERNS):
                        inputs = range_inputs([(7, 5), (3 * world, 9)], world, dtype, seed, pattern)
                        problems += quantized_call(f"range {pattern}/{dtype_name}/{bits}",
                                                   None,
                                                   dtype,
                                                   seed,
                                                   groups,
                                                   self.local_size,
                                                   inputs=inputs,
                                                   rms_bound=None,
                                                   compare_simulated=False,
                                                   intra_node_bits=bits)
        assert_no_problems(problems)


class TestQuantizedReduceScatter2Nodes3Ranks(QuantizedReduceScatterTests, DistributedTest):
    world_size = 6
    local_size = 3


class TestQuantizedReduceScatter5Nodes2Ranks(FusedKernelTests, QuantizedReduceScatterTests, DistributedTest):
    world_size = 10
    local_size = 2
    fused_dtypes = {"bf16": DTYPES["bf16"]}  # every dtype at 3x2; ten ranks share two cores here


class TestQuantizedReduceScatter2Nodes2Ranks(NPUQuantizerTests, QuantizedReduceScatterTests, DistributedTest):
    world_size = 4
    local_size = 2

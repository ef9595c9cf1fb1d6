# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
unit tests for coalesced collectives
"""

import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced, all_to_all_quant_reduce
from deepspeed.accelerator import get_accelerator
import pytest

from unit.common import DistributedTest


class TestReduceScatterCoalesced(DistributedTest):
    world_size = 2

    def test_single_input(self):
        input = torch.full((6, ), dist.get_rank(), dtype=torch.half, device=get_accelerator().current_device_name())

        (output, ) = reduce_scatter_coalesced([input], dist.get_world_group())

        assert output.shape == (3, )
        assert torch.allclose(output, torch.full_like(output, 0.5))

    def test_two_inputs(self):
        tensor_kwargs = {"device": get_accelerator().current_device_name(), "dtype": torch.half}
        inputs = [
            dist.get_rank() * torch.arange(0, 6, **tensor_kwargs),
            dist.get_rank() * torch.arange(6, 9, **tensor_kwargs),
        ]

        output1, output2 = reduce_scatter_coalesced(inputs, dist.get_world_group())

        if dist.get_rank() == 0:
            assert output1.shape == (3, )
            assert torch.allclose(output1, torch.arange(0, 3, **tensor_kwargs) / 2)
            assert output2.shape == (2, )
            assert torch.allclose(output2, torch.arange(6, 8, **tensor_kwargs) / 2)
        elif dist.get_rank() == 1:
            assert output1.shape == (3, )
            assert torch.allclose(output1, torch.arange(3, 6, **tensor_kwargs) / 2)
            assert output2.shape == (1, )
            assert torch.allclose(output2, torch.arange(8, 9, **tensor_kwargs) / 2)


class TestReduceScatterCoalescedTensorSmallerThanWorldSize(DistributedTest):
    world_size = 2

    def test(self):
        input = torch.zeros((1, ), dtype=torch.half, device=get_accelerator().current_device_name())

        (output, ) = reduce_scatter_coalesced([input], dist.get_world_group())

        if dist.get_rank() == 0:
            assert output.shape == (1, )
            assert torch.allclose(output, torch.zeros_like(output))
        elif dist.get_rank() == 1:
            assert output.shape == (0, )


# Currently we cannot test all_to_all_quant_reduce in non-fallback cases because we don't support multinodes tests.
class TestAllToAllQuantReduceFallback(DistributedTest):
    world_size = 2

    def test_1d_tensor(self):
        # case 1: 1D tensor
        input = torch.zeros((10, ), dtype=torch.half, device=get_accelerator().current_device_name())
        from deepspeed.ops.op_builder import QuantizerBuilder
        if not deepspeed.ops.__compatible_ops__[QuantizerBuilder.NAME]:
            pytest.skip("QuantizerBuilder is not implemented")
        output = all_to_all_quant_reduce([input], {})[0]

        if dist.get_rank() == 0:
            assert output.shape == (5, )
            assert torch.allclose(output, torch.zeros_like(output))
        elif dist.get_rank() == 1:
            assert output.shape == (5, )
            assert torch.allclose(output, torch.zeros_like(output))

    def test_non_divisible(self):
        # case 2: tensor size not divisible by global_world_size
        input = torch.zeros((7, 7), dtype=torch.half, device=get_accelerator().current_device_name())
        from deepspeed.ops.op_builder import QuantizerBuilder
        if not deepspeed.ops.__compatible_ops__[QuantizerBuilder.NAME]:
            pytest.skip("QuantizerBuilder is not implemented")
        output = all_to_all_quant_reduce([input], {})[0]

        if dist.get_rank() == 0:
            assert output.shape == (25, )
            assert torch.allclose(output, torch.zeros_like(output))
        elif dist.get_rank() == 1:
            assert output.shape == (24, )
            assert torch.allclose(output, torch.zeros_like(output))


class TestAllToAllQuantReduceAverage(DistributedTest):
    world_size = 4

    def test_matches_reduce_scatter_average(self):
        # Run the two-stage qgZ path as 2 nodes x 2 devices with the pure-torch quantizer.
        # Rank r holds -(r + 1) everywhere, which int4 represents exactly at every stage,
        # so the result must be the plain average -2.5, the same as the 1D fallback.
        from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
        from deepspeed.runtime.comm import coalesced_collectives
        from deepspeed.utils import groups

        accelerator = get_accelerator()
        saved_device_count, saved_module = accelerator.device_count, coalesced_collectives.quantizer_module
        accelerator.device_count = lambda: 2
        coalesced_collectives.quantizer_module = NPUQuantizer
        try:
            device = accelerator.current_device_name()
            value = -(dist.get_rank() + 1.0)
            weight = torch.full((8, 16), value, dtype=torch.half, device=device)
            bias = torch.full((16, ), value, dtype=torch.half, device=device)
            outputs = all_to_all_quant_reduce([weight, bias], groups._get_local_all_to_all_group())
        finally:
            accelerator.device_count = saved_device_count
            coalesced_collectives.quantizer_module = saved_module

        for output in outputs:
            assert torch.equal(output.float(), torch.full_like(output.float(), -2.5))


def _master_quant_reduce(tensor, quantizer, all_to_all_groups, devices_per_node):
    # the two-stage exchange on the tensor itself, unstaged: a layout the kernels take as it is (fp16,
    # max(shape[0], shape[1], world) groups of whole 16-byte vectors, a multiple of the world)
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // devices_per_node
    groups = max(tensor.shape[0], tensor.shape[1], world)
    codes, scales = quantizer.swizzle_quant(tensor, groups, 4, quantizer.Symmetric, 1, nodes, devices_per_node)
    for stage, name in enumerate((f"local_{rank // devices_per_node}", f"global_{rank % devices_per_node}")):
        received = torch.empty_like(codes), torch.empty_like(scales)
        dist.all_to_all_single(received[0], codes, group=all_to_all_groups[name])
        dist.all_to_all_single(received[1], scales, group=all_to_all_groups[name])
        if stage == 0:
            codes, scales = quantizer.quantized_reduction(*received, groups, groups // devices_per_node, 4,
                                                          quantizer.Symmetric, devices_per_node)
    values = quantizer.dequantize(*received, received[1].numel(), 4, quantizer.Symmetric)
    return sum(values.chunk(nodes)) / world


def _check_quant_reduce_partitions(devices_per_node, dtype, intra_node_bits):
    # qgZ on 2 nodes x 2 devices, 3 x 2 (#5054), 2 x 3 and 3 x 1, in one call: sizes that are not a
    # multiple of 2 x world (the report's (32, 32), (33, 33)), a group count max(shape[0], shape[1], world)
    # that is not a multiple of the world ((3141, 48): the kernels dropped groups), groups of 136, 152
    # and up to 40960 values, more than two dimensions, ranks with empty partitions, 1-D and 0-d.
    from deepspeed.ops.op_builder import QuantizerBuilder
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.utils import groups

    compiled = deepspeed.ops.__compatible_ops__[QuantizerBuilder.NAME]
    quantizer = QuantizerBuilder().load() if compiled else NPUQuantizer
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes = [(3141, 48), (32, 32), (33, 33), (150, 150), (2, 2, 60000), (4, 3, 5, 7), (7, 7), (2, 2), (171, ), ()]
    # Every rank draws every rank's inputs, takes its own and averages them all. In the exact case
    # each rank holds -(rank + 1) x world or 0, at the same positions on every rank: every
    # quantization group holds 0 and its largest magnitude only, which int4 represents exactly at
    # both stages, and the reduce-scatter's division by the world is exact.
    torch.manual_seed(0)
    exact, noisy = [], []
    for shape in shapes:
        pattern = torch.randint(0, 2, shape).double()
        exact.append([-(r + 1.0) * world * pattern for r in range(world)])
        noisy.append([torch.randn(shape, dtype=torch.double) for _ in range(world)])
    # The exact case near the dtype's largest and smallest normal values in turn, in one call (powers
    # of two keep it exact); for bf16 and fp32, every rank at the same negative value where it quantizes
    # (int4 holds -8, not 8): the dtype's lowest, and one whose sum overflows fp16 unless scaled for the
    # world (fp16's own range is the loss scaler's); NaN and inf on one rank each
    finfo = torch.finfo(dtype)
    top = int(finfo.max).bit_length() - 1
    extremes = [2.0**(top - 6), finfo.tiny]
    scaled = [[x * extremes[i % 2] for x in inputs] for i, inputs in enumerate(exact)]
    lows = [finfo.min, -1.75 * 2.0**top]
    patterns = [(inputs[0] != 0).double() for inputs in exact if inputs[0].dim() >= 2 and dtype != torch.half]
    peak = [[pattern * lows[i % 2]] * world for i, pattern in enumerate(patterns)]
    poisoned = [[x.clone() for x in inputs] for inputs in noisy]
    poisoned[0][1].view(-1)[0] = float("nan")
    poisoned[1][0].view(-1)[-1] = float("inf")

    class NaNDroppingKernels:
        # the CUDA kernels' max reductions skip NaN (fmaxf) and their float-to-int conversion makes it
        # 0: a NaN in a group of other values quantizes to 0, and a sum holding NaN requantizes finite
        Symmetric = quantizer.Symmetric
        dequantize = staticmethod(quantizer.dequantize)

        @staticmethod
        def swizzle_quant(values, *args):
            return quantizer.swizzle_quant(values.masked_fill(values.isnan(), 0), *args)

        @staticmethod
        def quantized_reduction(values, scales, *args):
            return quantizer.quantized_reduction(values, scales.nan_to_num(0, 0, 0), *args)

    class Recorded:
        # the quantizer, keeping where the tensors swizzle_quant reads are
        Symmetric = quantizer.Symmetric
        quantized_reduction = staticmethod(quantizer.quantized_reduction)
        dequantize = staticmethod(quantizer.dequantize)
        read = []

        @staticmethod
        def swizzle_quant(values, *args):
            Recorded.read.append(values.data_ptr())
            return quantizer.swizzle_quant(values, *args)

    accelerator = get_accelerator()
    saved_device_count, saved_module = accelerator.device_count, coalesced_collectives.quantizer_module
    accelerator.device_count = lambda: devices_per_node
    coalesced_collectives.quantizer_module = quantizer
    saved_logging = dist.comms_logger.enabled, dist.comms_logger.prof_all, dist.comms_logger.comms_dict
    saved_exchange_values = coalesced_collectives.quant_reduce_exchange_values
    try:
        all_to_all_groups = groups._get_local_all_to_all_group()
        device = accelerator.current_device_name()
        results = [
            all_to_all_quant_reduce([inputs[rank].to(device, dtype)
                                     for inputs in case], all_to_all_groups, intra_node_bits)
            for case in (exact, noisy, scaled, peak)
        ]
        small_groups = []
        if intra_node_bits == 4:
            # groups of at most 136 values ((2, 2, 60000)'s are 40000 by its shape at 6 ranks, 40960 at 3)
            small_groups = [
                all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in case],
                                        all_to_all_groups,
                                        max_group_size=136) for case in (exact, noisy)
            ]
            for size in (128, 140, 40968):
                with pytest.raises(ValueError, match=f"a multiple of 8 from 136 to 40960, got {size}"):
                    all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in noisy],
                                            all_to_all_groups,
                                            max_group_size=size)
        if intra_node_bits == 8:
            # the same gradients with int4 inside the node, for the comparison below
            noisy4 = all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in noisy], all_to_all_groups)
            with pytest.raises(ValueError, match="intra_node_bits must be 4 or 8, got 6"):
                all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in noisy], all_to_all_groups, 6)
        coalesced_collectives.quantizer_module = NaNDroppingKernels
        results.append(
            all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in poisoned], all_to_all_groups,
                                    intra_node_bits))
        coalesced_collectives.quantizer_module = quantizer
        if dtype == torch.half:
            # fp16 of whole groups in whole partitions, (288, 144) and (2, 144, 288) at every world here
            whole = [(rank + 1) * torch.randn(shape, device=device, dtype=dtype)
                     for shape in ((288, 144), (2, 144, 288))]
            coalesced_collectives.quantizer_module = Recorded
            in_place = all_to_all_quant_reduce(whole, all_to_all_groups)
            coalesced_collectives.quantizer_module = quantizer
            # the kernels read the gradients themselves, not copies
            assert Recorded.read == [tensor.data_ptr() for tensor in whole]
            before = [_master_quant_reduce(tensor, quantizer, all_to_all_groups, devices_per_node) for tensor in whole]
        # ZeRO-3 hands over a bucket of gradients per call: four times as many must not take more
        # collectives (DeepSpeed's comms logger counts them), but for the 4 all-to-alls of each gradient
        # the kernels read in place, alone
        dist.comms_logger.comms_dict = {}
        dist.configure(enabled=True, prof_all=True)
        coalesced_collectives.quantizer_module = Recorded
        collectives = []
        for bucket in (noisy, noisy * 4):
            gradients = [inputs[rank].to(device, dtype) for inputs in bucket]
            Recorded.read.clear()
            logged = dist.comms_logger.get_total_operations()
            all_to_all_quant_reduce(gradients, all_to_all_groups, intra_node_bits)
            read_in_place = set(Recorded.read) & {gradient.data_ptr() for gradient in gradients}
            collectives.append(dist.comms_logger.get_total_operations() - logged - 4 * len(read_in_place))
        coalesced_collectives.quantizer_module = quantizer
        # the gradients split into exchanges of at most 4096 staged values, and larger ones alone
        coalesced_collectives.quant_reduce_exchange_values = 4096
        results.append(
            all_to_all_quant_reduce([inputs[rank].to(device, dtype) for inputs in exact], all_to_all_groups,
                                    intra_node_bits))
    finally:
        dist.configure(enabled=saved_logging[0], prof_all=saved_logging[1])
        dist.comms_logger.comms_dict = saved_logging[2]
        coalesced_collectives.quant_reduce_exchange_values = saved_exchange_values
        accelerator.device_count = saved_device_count
        coalesced_collectives.quantizer_module = saved_module

    if dtype == torch.half:
        # and the results are the same, bit for bit
        for output, expected in zip(in_place, before):
            assert output.dtype == dtype and torch.equal(output, expected)
    assert 0 < collectives[0] == collectives[1], f"collectives for a bucket and 4 times as much: {collectives}"
    for case, outputs in zip((exact, noisy, scaled, peak, poisoned, exact, exact, noisy), results + small_groups):
        for i, (inputs, output) in enumerate(zip(case, outputs)):
            # reduce_scatter_coalesced's partition of the average: ceil(numel / world) values per rank
            average = (sum(inputs) / world).view(-1)
            size = (average.numel() + world - 1) // world
            expected = average[rank * size:(rank + 1) * size]
            assert output.dtype == dtype
            assert output.shape == expected.shape
            if case is poisoned and i < 2:
                # NaN or inf on one rank comes back NaN (or inf) where it was, for the overflow check
                assert not output.cpu()[~expected.isfinite()].isfinite().any()
                continue
            if case is not noisy and case is not poisoned:
                assert torch.equal(output.cpu(), expected.to(dtype))
                continue
            # int4 at both stages: each rank's values and each node's sum err by at most an eighth of
            # the largest magnitude in them, so the average by a quarter, and the dtypes round; int8
            # inside the node errs by at most 1/128 of it, within the 1/64 left for the roundings
            largest = max(x.abs().max() for x in inputs)
            error = max((output.cpu().double() - expected).abs().tolist(), default=0.0)
            assert error <= largest * ((1 / 4 if intra_node_bits == 4 else 1 / 8) + 1 / 64)
            if inputs[0].dim() >= 2 and inputs[0].numel() >= 1024:
                assert error > largest / 64, "quantized, not reduce-scattered"
            if case is noisy and intra_node_bits == 8 and devices_per_node > 1 and inputs[0].numel() >= 1024:
                # int8 inside a node errs less than int4 where the node sums several copies (a node of
                # one device sums none: there int8 is no closer)
                error4 = (noisy4[i].cpu().double() - expected).abs().mean()
                assert (output.cpu().double() - expected).abs().mean() < error4
    if small_groups:
        # groups of 136 values follow (2, 2, 60000) more closely than its own of 40000 or 40960
        average = (sum(noisy[4]) / world).view(-1)
        size = (average.numel() + world - 1) // world
        expected = average[rank * size:(rank + 1) * size]
        errors = [(outputs[4].cpu().double() - expected).abs().mean() for outputs in (results[1], small_groups[1])]
        assert errors[1] < errors[0], errors


class TestAllToAllQuantReduceAnyShape(DistributedTest):
    reuse_dist_env = True

    @pytest.mark.parametrize("intra_node_bits", [4, 8])
    @pytest.mark.parametrize("dtype", [torch.half, torch.bfloat16, torch.float])
    @pytest.mark.parametrize("world_size, devices_per_node", [(4, 2), (6, 2), (6, 3)])
    def test_matches_reduce_scatter_partitions(self, world_size, devices_per_node, dtype, intra_node_bits):
        _check_quant_reduce_partitions(devices_per_node, dtype, intra_node_bits)


class TestAllToAllQuantReduceThreeNodes(DistributedTest):
    world_size = 3

    @pytest.mark.parametrize("intra_node_bits", [4, 8])
    def test_matches_reduce_scatter_partitions(self, intra_node_bits):
        _check_quant_reduce_partitions(1, torch.half, intra_node_bits)

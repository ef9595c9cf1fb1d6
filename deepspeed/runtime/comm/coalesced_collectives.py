# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
batched collective operations for overhead amortization and better
bandwidth utilization
"""

import math
from typing import List
import torch
from torch import Tensor
from deepspeed import comm as dist
from deepspeed.comm import ProcessGroup, all_to_all_single
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import instrument_w_nvtx
from deepspeed.ops import op_builder


def _torch_reduce_scatter_fn(input_tensor: Tensor, output_tensor: Tensor, group=None, async_op=False, prof=False):
    return instrument_w_nvtx(dist.reduce_scatter_fn)(output_tensor, input_tensor, group=group, async_op=False)


quantizer_module = None
# The values an exchange of all_to_all_quant_reduce stages, padding included, unless one tensor has more:
# its buffers take about 3.5 bytes per value (with int8 inside the node, 4 + 6 / devices per node), and
# the kernels count them in ints.
quant_reduce_exchange_values = 2**27


@instrument_w_nvtx
@torch.no_grad()
def all_to_all_quant_reduce(tensors: List[Tensor],
                            groups: {},
                            intra_node_bits: int = 4,
                            max_group_size: int = 40960) -> List[Tensor]:
    global quantizer_module
    if intra_node_bits not in (4, 8):
        raise ValueError(f"all_to_all_quant_reduce: intra_node_bits must be 4 or 8, got {intra_node_bits}")
    if max_group_size % 8 or not 136 <= max_group_size <= 40960:
        raise ValueError(f"all_to_all_quant_reduce: max_group_size must be a multiple of 8 from 136 to 40960, "
                         f"got {max_group_size}")
    if quantizer_module is None:
        quantizer_module = op_builder.QuantizerBuilder().load()
    local_world_size = get_accelerator().device_count()
    global_world_size = dist.get_world_size()
    num_nodes = global_world_size // local_world_size
    this_rank = dist.get_rank()
    intra_idx = int(this_rank / local_world_size)
    inter_idx = this_rank % local_world_size
    output_lst: List[Tensor] = [None] * len(tensors)
    unquantized, exchanges, exchange_values, open_exchanges = [], [], [], {}
    for idx, tensor in enumerate(tensors):
        # The two-stage exchange needs more than one node, the group rule below two dimensions, and
        # the padding below a partition to pad.
        if tensor.dim() < 2 or tensor.numel() == 0 or num_nodes <= 1:
            unquantized.append(idx)
        else:
            # Groups keep the size max(shape[0], shape[1], world) groups have, where the kernels take
            # it: whole 16-byte vectors of 8 fp16 values, at least 136 values (quantized_reduction
            # reduces a group across a whole warp, which smaller groups do not fill) and at most
            # 40960 (swizzle_quant's largest unroll), or max_group_size.
            group_count = max(tensor.shape[0], tensor.shape[1], global_world_size)
            group_size = 8 * math.ceil(tensor.numel() / group_count / 8)
            group_size = min(max(group_size, 136), max_group_size)
            # The kernels take groups of one size per call, so tensors whose groups have the same size
            # share one exchange (3 kernels and 4 all-to-alls instead of that many per tensor), each in
            # the groups it has alone, up to quant_reduce_exchange_values staged values.
            staged = global_world_size * group_size * math.ceil(tensor.numel() / global_world_size / group_size)
            # except an fp16 gradient of whole groups in whole partitions, which the kernels read in place,
            # alone: sharing an exchange would copy it
            in_place = tensor.dtype == torch.half and tensor.is_contiguous() and staged == tensor.numel()
            key = (group_size, idx if in_place else None)
            exchange = open_exchanges.get(key)
            if exchange is None or exchange_values[exchange] + staged > quant_reduce_exchange_values:
                exchange = open_exchanges[key] = len(exchanges)
                exchanges.append((group_size, [], in_place))
                exchange_values.append(0)
            exchanges[exchange][1].append(idx)
            exchange_values[exchange] += staged
    if unquantized:
        # one reduce-scatter for all of them
        for idx, output in zip(unquantized, reduce_scatter_coalesced([tensors[idx] for idx in unquantized])):
            output_lst[idx] = output
    # The kernels compute in fp16, so each bf16 or fp32 gradient goes in scaled by the power of two that puts
    # its largest magnitude on any rank below 2**15 / world: the sum of the world stays in fp16's range, and
    # small gradients stay above its subnormals. fp16 gradients are the kernels' own: their range is the
    # loss scaler's, which sees a sum beyond it come back inf or NaN.
    rescaled = [idx for _, indices, _ in exchanges for idx in indices if tensors[idx].dtype != torch.half]
    scales, unscales = {}, {}
    if rescaled:
        norms = [torch.linalg.vector_norm(tensors[idx], math.inf) for idx in rescaled]
        largest = torch.stack(norms).float()
        # A gradient holding NaN or inf on any rank has no scale (and the MAX below may drop NaN): it comes
        # back NaN in every partition.
        largest.nan_to_num_(nan=math.inf, posinf=math.inf)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        # largest < 2**exponents, from its fp32 exponent field (0 and the subnormals give -126), and
        # the powers of two made from their fields: exact on every accelerator, and both finite and
        # normal in fp32 for exponents within +-126
        world_bits = math.ceil(math.log2(global_world_size))
        exponents = (largest.view(torch.int32) >> 23) - 126
        exponents = (exponents + world_bits - 15).clamp(-126, 126)
        down = ((127 - exponents) << 23).view(torch.float32)
        up = ((127 + exponents) << 23).view(torch.float32)
        up = torch.where(largest.isfinite(), up, math.nan)
        scales = dict(zip(rescaled, down.split(1)))
        unscales = dict(zip(rescaled, up.split(1)))
    for group_size, indices, in_place in exchanges:
        # The kernels cut their input into world-size partitions of whole quantization groups and
        # drop what does not divide evenly (#5054), so give them each tensor's reduce_scatter_coalesced
        # partitions, each padded with zeros to whole groups: rank r's side by side in row r.
        partition_sizes = [math.ceil(tensors[idx].numel() / global_world_size) for idx in indices]
        padded_sizes = [group_size * math.ceil(size / group_size) for size in partition_sizes]
        if in_place:
            padded = tensors[indices[0]]
        else:
            # the kernels read fp16 whatever the gradients' dtype: bf16 and fp32 ones go in scaled
            # into its range (above)
            padded = torch.zeros(global_world_size,
                                 sum(padded_sizes),
                                 dtype=torch.half,
                                 device=tensors[indices[0]].device)
            offset = 0
            for idx, partition_size, padded_size in zip(indices, partition_sizes, padded_sizes):
                tensor = tensors[idx]
                flat = tensor.reshape(-1)
                # scaled, the full partitions in one multiply, then the short one that remains unless the
                # world divides the tensor
                full_partitions = tensor.numel() // partition_size
                last_start = full_partitions * partition_size
                last_size = tensor.numel() - last_start
                torch.mul(flat[:last_start].view(full_partitions, partition_size),
                          scales.get(idx, 1),
                          out=padded[:full_partitions, offset:offset + partition_size])
                if last_size:
                    torch.mul(flat[last_start:],
                              scales.get(idx, 1),
                              out=padded[full_partitions, offset:offset + last_size])
                offset += padded_size
        intra_quant_group = padded.numel() // group_size

        inter_quant_group = intra_quant_group // local_world_size
        intra_quant_int4, intra_q_scales = quantizer_module.swizzle_quant(padded, intra_quant_group, intra_node_bits,
                                                                          quantizer_module.Symmetric, 1, num_nodes,
                                                                          local_world_size)
        # The kernels' max reductions skip NaN and their conversion to int makes it 0, so a group holding NaN
        # or inf goes with a NaN scale, which travels with its codes: it comes back NaN, for the overflow
        # check. Its largest magnitude times 0 is 0, or NaN there; swizzle_quant puts partition
        # node * devices + device in slot device * nodes + node.
        marks = torch.linalg.vector_norm(padded.view(-1, group_size), math.inf, dim=1).mul_(0)
        marks = marks.view(num_nodes, local_world_size, -1).transpose(0, 1)
        intra_q_scales.view(local_world_size, num_nodes, -1).add_(marks)
        local_output = torch.empty_like(intra_quant_int4)
        scale_output = torch.empty_like(intra_q_scales)
        all_to_all_single(local_output, intra_quant_int4, group=groups[f'local_{intra_idx}'])
        all_to_all_single(scale_output, intra_q_scales, group=groups[f'local_{intra_idx}'])
        if intra_node_bits == 4:
            global_input_tensor, global_scales = quantizer_module.quantized_reduction(
                local_output, scale_output, intra_quant_group, inter_quant_group, 4, quantizer_module.Symmetric,
                local_world_size)
        else:
            # quantized_reduction requantizes in the bits it reads, and across nodes the gradients go in
            # int4, so sum the node's copies here and quantize the sums in the same groups and order (one
            # partition: swizzle_quant keeps the order). One copy is dequantized at a time, to fp16 (half
            # dequantize_fp32's memory), and the sum is kept in fp32, so that it rounds once, to fp16.
            node_sums = torch.zeros(local_output.numel() // local_world_size,
                                    dtype=torch.float32,
                                    device=local_output.device)
            for copy, copy_scales in zip(local_output.chunk(local_world_size), scale_output.chunk(local_world_size)):
                node_sums += quantizer_module.dequantize(copy, copy_scales, inter_quant_group, intra_node_bits,
                                                         quantizer_module.Symmetric).view(-1)
            global_input_tensor, global_scales = quantizer_module.swizzle_quant(node_sums.half(), inter_quant_group, 4,
                                                                                quantizer_module.Symmetric, 1, 1, 1)
            del node_sums
        # a group marked on any device of the node marks their sum
        global_scales.view(-1).add_(scale_output.view(local_world_size, -1).sum(0).mul_(0))
        global_output = torch.empty_like(global_input_tensor)
        global_scale_output = torch.empty_like(global_scales)
        all_to_all_single(global_output, global_input_tensor, group=groups[f'global_{inter_idx}'])
        all_to_all_single(global_scale_output, global_scales, group=groups[f'global_{inter_idx}'])
        final_output = quantizer_module.dequantize(global_output, global_scale_output, global_scale_output.numel(), 4,
                                                   quantizer_module.Symmetric)
        assert final_output.numel(
        ) % num_nodes == 0, f"final_output.numel()={final_output.numel()} is not divisible by num_nodes={num_nodes}"
        # quantized_reduction summed the local ranks and this sums the nodes, so divide by
        # every rank to return the average, as the reduce_scatter branch above does.
        average = sum(list(final_output.chunk(num_nodes))) / global_world_size
        offset = 0
        for idx, partition_size, padded_size in zip(indices, partition_sizes, padded_sizes):
            tensor = tensors[idx]
            # this rank's partition in the gradients' dtype, as reduce_scatter_coalesced returns it:
            # the last ranks' are shorter or empty
            partition_start = min(this_rank * partition_size, tensor.numel())
            partition_end = min(partition_start + partition_size, tensor.numel())
            output = average.narrow(0, offset, partition_end - partition_start).to(tensor.dtype)
            if idx in unscales:
                # multiplied back (in fp32, the scales' dtype) and kept within the dtype's range: fp16's
                # rounding takes a gradient at fp32's largest value past it
                output.mul_(unscales[idx])
                finfo = torch.finfo(tensor.dtype)
                output.clamp_(-finfo.max, finfo.max)
            output_lst[idx] = output
            offset += padded_size
        # free this exchange's buffers before the next one stages its own
        del padded, intra_quant_int4, local_output, global_input_tensor, global_output, final_output
    return output_lst


@instrument_w_nvtx
@torch.no_grad()
def reduce_scatter_coalesced(
    tensors: List[Tensor],
    group: ProcessGroup = None,
) -> List[Tensor]:
    """simultaneously reduce-scatter a list of tensors - this can be done more
    efficiently than individual reduce scatter calls
    TODO. see if PyTorch team wants a c++ version of this for ProcessGroupNCCL
    """
    this_rank = dist.get_rank(group)
    world_sz = dist.get_world_size(group)

    partition_lst_for_each_tensor = [None] * len(tensors)
    for tensor_idx, tensor in enumerate(tensors):
        flattened_tensor = tensor.view(-1)
        chunk_sz = math.ceil(tensor.numel() / world_sz)
        partition_lst_for_each_tensor[tensor_idx] = [
            flattened_tensor[rank * chunk_sz:rank * chunk_sz + chunk_sz] for rank in range(0, world_sz)
        ]

    padded_partition_sz_for_each_tensor = tuple(math.ceil(t.numel() / world_sz) for t in tensors)

    if len(tensors) == 1 and tensors[0].numel() % world_sz == 0:
        # if there's only one tensor being reduced and we don't need to pad
        # we have an opportunity to avoid a memory allocation
        tensor_partition_flat_buffer = tensors[0].view(-1)
    else:
        # interleave tensor partitions such that the correct reduced partitions of each tensor
        # end up at each rank
        tensor_partitions_lst_with_padding = []
        for rank in range(world_sz):
            for tensor_idx in range(len(tensors)):
                # add tensor content
                tensor_chunk = partition_lst_for_each_tensor[tensor_idx][rank]
                tensor_partitions_lst_with_padding.append(tensor_chunk)

                # add padding if necessary
                padding_sz = padded_partition_sz_for_each_tensor[tensor_idx] - tensor_chunk.numel()
                if padding_sz > 0:
                    tensor_partitions_lst_with_padding.append(
                        torch.empty(padding_sz, dtype=tensor_chunk.dtype, device=tensor_chunk.device))

        tensor_partition_flat_buffer = instrument_w_nvtx(torch.cat)(tensor_partitions_lst_with_padding)

    tensor_partition_flat_buffer.div_(world_sz)  # pre-divide
    tensor_partition_buffer_for_each_rank: List[Tensor] = torch.chunk(tensor_partition_flat_buffer, world_sz)

    # batched reduce-scatter call
    _torch_reduce_scatter_fn(tensor_partition_flat_buffer,
                             tensor_partition_buffer_for_each_rank[this_rank],
                             group=group)

    # reverse procedure of the interleaving done previously, done on the
    # result of the batched reduce-scatter
    output_lst: List[Tensor] = [None] * len(tensors)
    offset = 0
    for tensor_idx in range(len(tensors)):
        output_lst[tensor_idx] = tensor_partition_buffer_for_each_rank[this_rank].narrow(
            0, offset, partition_lst_for_each_tensor[tensor_idx][this_rank].numel())

        offset += padded_partition_sz_for_each_tensor[tensor_idx]
    return output_lst

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
The layout contract of the ZeRO++ quantizer kernels: swizzle_quant, quantized_reduction and
dequantize (qgZ, the gradients), quantize and dequantize (qwZ, the weights).

The CUDA kernels (csrc/quantization/swizzled_quantize.cu, quant_reduce.cu, quantize.cu, dequantize.cu) and
their bindings (csrc/quantization/pt_binding.cpp) check none of their assumptions. A call outside
them does not fail: groups that do not divide evenly are dropped, 16-byte vectors that straddle a
group read and overwrite the neighbour, a group larger than the unroll tables launches no kernel,
a block of fewer threads than a warp reduces its group statistics over lanes that do not exist,
index arithmetic in ``int`` wraps, and the bindings reinterpret whatever memory they are handed
(``data_ptr`` cast to the type they expect, whatever the tensor's dtype or device).

This module is the one place those assumptions, the kernels' launch geometry and their swizzle
order are written down. ``ContractCheckedQuantizer`` refuses any call that breaks them before the op
runs, and so do the pure-PyTorch reference and this package's Triton op. The CPU op checks only
what keeps its own memory accesses in bounds, and the warp rule (its copy of the launch geometry is
tested against this module for every group size the contract allows).

The CUDA binding names the topology arguments ``nodes`` and ``devices_per_node``; here, as in the
rest of qgZ, they are ``num_nodes`` and ``local_world_size``.

The calling convention, which every quantizer DeepSpeed ships accepts (the CUDA bindings read
``data_ptr`` as one flat buffer, the CPU op likewise; ``NPUQuantizer``, pure PyTorch, slices
quantized_reduction's inputs along their first dimension and asserts that dequantize's int4 data is
a flat packed byte tensor): every tensor a kernel reads is contiguous, the codes dequantize,
dequantize_fp32 and quantized_reduction read are moreover flat (1-D), and parameter tensors
(``scales``, ``params``) hold their groups' parameters in order in any shape
(``layout_violations``). A kernel's outputs are taken as flat buffers, whatever shape a quantizer
gives them.

Every ``*_violations`` function returns a list of human-readable violations (empty when the call is
valid), each naming the condition and the values involved.
"""

import math
from typing import List

# Each CUDA thread moves one 16-byte vector: 8 fp16 values.
VECTOR_ELEMS = 8

# swizzled_quant_kernel: threads = clamp(next_pow2(ceil(elems / 16)), 32, 512); at 512 threads the
# unroll table stops at 10 chunks of 512 x 8 values, so larger groups launch nothing.
SWIZZLE_MAX_THREADS = 512
SWIZZLE_MIN_THREADS = 32
SWIZZLE_MAX_UNROLL = 10
SWIZZLE_MAX_GROUP_ELEMS = SWIZZLE_MAX_THREADS * SWIZZLE_MAX_UNROLL * VECTOR_ELEMS  # 40960

# dequant_reduce: one block of at most 1024 threads per output group, each thread loading
# `load_bytes` (4 bytes = 8 int4 values, or 8 bytes = 8 int8 values) per chunk, at most 12 chunks.
# The launcher sets no minimum: an output group of 8 values gets a single thread.
REDUCE_MAX_THREADS = 1024
REDUCE_MAX_UNROLL = 12

# The group statistics of swizzle_quant and dequant_reduce are reduced with warp shuffles over all
# WARP_SIZE lanes (GroupStats::get_params -> reduce::partitioned_block -> _block<float, 32>,
# csrc/includes/reduction_utils.h), in the warp stage and again in the block stage. In a block of
# fewer threads the upper lanes do not exist, and CUDA leaves a shuffle that reads an inactive
# lane undefined: a stale value could become the group's absmax. So every launch of a kernel that
# reduces across threads must have at least WARP_SIZE threads. swizzle_quant's launcher never goes
# below SWIZZLE_MIN_THREADS (= WARP_SIZE); quantized_reduction's output groups must be large
# enough (reduce_min_out_group_elems). dequantize reduces nothing across threads.
WARP_SIZE = 32

# dequantize launches blocks of 512 threads x 8 chunks of one 16-byte store each, so a block
# covers 32768 fp16 or 16384 fp32 outputs, and the last block computes int indices up to the next
# multiple of that, past the tensor's end (csrc/includes/dequantization_utils.h).
DEQUANT_THREADS = 512
DEQUANT_UNROLL = 8
VECTOR_BYTES = 16

# quantize (quantize.cu, the weights' quantizer): groups of at most QUANTIZE_SUBBLOCK_MAX_ELEMS
# values share blocks of QUANTIZE_MAX_THREADS threads, next_pow2(ceil(elems / 8)) threads each;
# larger groups get a block each, of min(next_pow2(ceil(elems / 16)), 256) threads, whose
# statistics are reduced as a whole block (warp shuffles over all lanes), over at most
# QUANTIZE_MAX_UNROLL steps of 16 values per thread.
QUANTIZE_MAX_THREADS = 256
QUANTIZE_SUBBLOCK_MAX_ELEMS = 128
QUANTIZE_MAX_UNROLL = 4

SUPPORTED_BITS = (4, 8)
INT32_MAX = 2**31 - 1

# Quantization types, as the bindings' QuantizationType enum numbers them.
SYMMETRIC = 0
ASYMMETRIC = 1


def param_width(quant_type) -> int:
    """fp32 parameters stored per group: [1 / scale] (symmetric) or [1 / scale, offset]."""
    return 2 if int(quant_type) == ASYMMETRIC else 1


def swizzle_slot(partition: int, num_nodes: int, local_world_size: int) -> int:
    """The swizzle order: swizzle_quant writes partition ``p = n * D + d`` (node n, local rank d,
    D = local_world_size) to slot ``d * N + n`` (N = num_nodes). Slots for one local rank are then
    contiguous, so one intra-node all-to-all of equal blocks hands local rank d the slots of the
    partitions it owns on every node, in node order."""
    node, local_rank = divmod(partition, local_world_size)
    return local_rank * num_nodes + node


def to_slot_order(per_partition, num_nodes: int, local_world_size: int):
    """A tensor whose leading dimension runs over partitions (``num_nodes * local_world_size``
    rows in partition order) as a ``[local_world_size, num_nodes, ...]`` view in slot order
    (see swizzle_slot)."""
    rest = tuple(per_partition.shape[1:])
    return per_partition.view(num_nodes, local_world_size, *rest).transpose(0, 1)


def next_pow2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def values_per_byte(num_bits: int) -> int:
    return 8 // num_bits


def reduce_load_bytes(num_bits: int) -> int:
    """Bytes one dequant_reduce thread loads per chunk (8 values either way)."""
    return 4 if num_bits == 4 else 8


def reduce_max_group_elems(num_bits: int) -> int:
    return REDUCE_MAX_THREADS * REDUCE_MAX_UNROLL * reduce_load_bytes(num_bits) * values_per_byte(num_bits)


def reduce_min_out_group_elems(num_bits: int) -> int:
    """The smallest output group (in values, a multiple of the vector width) for which
    quantized_reduction launches a whole warp: 136 values at 4 and at 8 bits."""
    per_byte = values_per_byte(num_bits)
    elems = VECTOR_ELEMS
    while reduce_launch(elems // per_byte, num_bits)[0] < WARP_SIZE:
        elems += VECTOR_ELEMS
    return elems


def dequantize_block_elems(out_element_size: int) -> int:
    """Outputs one dequantize block covers (32768 fp16 or 16384 fp32 values)."""
    return DEQUANT_THREADS * DEQUANT_UNROLL * (VECTOR_BYTES // out_element_size)


def swizzle_launch(elems_per_group: int):
    """(threads, chunks per thread) of swizzled_quant_kernel for a group size; chunks is None if
    the launcher has no kernel for it."""
    threads = next_pow2(-(-elems_per_group // (2 * VECTOR_ELEMS)))
    threads = min(max(threads, SWIZZLE_MIN_THREADS), SWIZZLE_MAX_THREADS)
    if threads < SWIZZLE_MAX_THREADS:
        return threads, 2
    chunks = 2 * -(-elems_per_group // (threads * 2 * VECTOR_ELEMS))
    return threads, (chunks if chunks <= SWIZZLE_MAX_UNROLL else None)


def reduce_launch(bytes_per_out_group: int, num_bits: int):
    """(threads, chunks per thread) of dequant_reduce for an output group; chunks is None if the
    launcher has no kernel for it."""
    load = reduce_load_bytes(num_bits)
    threads = min(next_pow2(-(-bytes_per_out_group // load)), REDUCE_MAX_THREADS)
    chunks = -(-bytes_per_out_group // (threads * load))
    if chunks >= 4:
        chunks += chunks % 2
    return threads, (chunks if chunks <= REDUCE_MAX_UNROLL else None)


def quantize_launch(elems_per_group: int):
    """(threads per group, groups per block, chunks of 8 values per thread) of quantize for a
    group size; chunks is None if the launcher has no kernel for it."""
    if elems_per_group <= QUANTIZE_SUBBLOCK_MAX_ELEMS:
        threads = next_pow2(-(-elems_per_group // VECTOR_ELEMS))
        return threads, -(-QUANTIZE_MAX_THREADS // threads), 1
    threads = min(next_pow2(-(-elems_per_group // (2 * VECTOR_ELEMS))), QUANTIZE_MAX_THREADS)
    steps = -(-elems_per_group // (threads * 2 * VECTOR_ELEMS))
    return threads, 1, (2 * steps if steps <= QUANTIZE_MAX_UNROLL else None)


def quantize_stat_slots(elems_per_group: int) -> int:
    """Like swizzle_stat_slots, for quantize."""
    threads, _, chunks = quantize_launch(elems_per_group)
    return threads * chunks * VECTOR_ELEMS


def swizzle_stat_slots(elems_per_group: int) -> int:
    """Values a swizzle_quant block folds into its group statistics: lanes past the group load
    zeros, so when this exceeds the group size a zero takes part in the absmax (or min/max)."""
    threads, chunks = swizzle_launch(elems_per_group)
    return threads * chunks * VECTOR_ELEMS


def reduce_stat_slots(bytes_per_out_group: int, num_bits: int) -> int:
    """Like swizzle_stat_slots, for quantized_reduction's output groups."""
    threads, chunks = reduce_launch(bytes_per_out_group, num_bits)
    return threads * chunks * VECTOR_ELEMS


def _common(num_bits) -> List[str]:
    problems = []
    if num_bits not in SUPPORTED_BITS:
        problems.append(f"num_bits must be one of {SUPPORTED_BITS}, got {num_bits}")
    return problems


def swizzle_quant_violations(numel: int, num_groups: int, num_bits: int, pipeline_size: int, num_nodes: int,
                             local_world_size: int) -> List[str]:
    problems = _common(num_bits)
    partitions = num_nodes * local_world_size
    if num_nodes < 1 or local_world_size < 1:
        problems.append(f"num_nodes ({num_nodes}) and local_world_size ({local_world_size}) must be >= 1")
        return problems
    if num_groups < 1:
        problems.append(f"num_groups must be >= 1, got {num_groups}")
        return problems
    if numel > INT32_MAX:
        problems.append(f"numel {numel} exceeds the kernels' int32 indexing ({INT32_MAX})")
    if numel % num_groups:
        problems.append(f"numel {numel} is not divisible by num_groups {num_groups}: the trailing "
                        f"{numel % num_groups} elements would be dropped")
    if num_groups % partitions:
        problems.append(f"num_groups {num_groups} is not divisible by num_nodes x local_world_size = {num_nodes} x "
                        f"{local_world_size} = {partitions}")
    elif pipeline_size < 1 or (num_groups // partitions) % pipeline_size:
        problems.append(f"groups per partition {num_groups // partitions} is not divisible by "
                        f"pipeline_size {pipeline_size}")
    elems_per_group = numel // num_groups
    if elems_per_group == 0 or elems_per_group % VECTOR_ELEMS:
        problems.append(f"elements per group {elems_per_group} (numel {numel} / num_groups {num_groups}) is not a "
                        f"positive multiple of the {VECTOR_ELEMS}-value vector width")
    elif swizzle_launch(elems_per_group)[1] is None:
        problems.append(f"elements per group {elems_per_group} exceeds swizzle_quant's largest launch "
                        f"({SWIZZLE_MAX_GROUP_ELEMS})")
    return problems


def quantize_violations(numel: int, num_groups: int, num_bits: int) -> List[str]:
    problems = _common(num_bits)
    if num_groups < 1:
        return problems + [f"num_groups must be >= 1, got {num_groups}"]
    if numel > INT32_MAX:
        problems.append(f"numel {numel} exceeds the kernels' int32 indexing ({INT32_MAX})")
    if numel % num_groups:
        problems.append(f"numel {numel} is not divisible by num_groups {num_groups}: the trailing "
                        f"{numel % num_groups} elements would be dropped")
        return problems
    elems = numel // num_groups
    if elems == 0 or elems % VECTOR_ELEMS:
        problems.append(f"elements per group {elems} (numel {numel} / num_groups {num_groups}) is not a positive "
                        f"multiple of the {VECTOR_ELEMS}-value vector width")
        return problems
    threads, per_block, chunks = quantize_launch(elems)
    if chunks is None:
        problems.append(f"elements per group {elems} exceed quantize's largest launch "
                        f"({QUANTIZE_MAX_THREADS * QUANTIZE_MAX_UNROLL * 2 * VECTOR_ELEMS})")
    elif elems > QUANTIZE_SUBBLOCK_MAX_ELEMS and threads < WARP_SIZE:
        problems.append(
            f"elements per group {elems} launch {threads} threads, fewer than a warp ({WARP_SIZE}), "
            f"whose shuffles would read lanes that do not exist; groups of "
            f"{QUANTIZE_SUBBLOCK_MAX_ELEMS + VECTOR_ELEMS} to {WARP_SIZE // 2 * 2 * VECTOR_ELEMS} values are affected")
    elif num_groups % per_block:
        problems.append(f"num_groups {num_groups} is not a multiple of the {per_block} groups of {elems} values "
                        f"quantize runs per block: the last block would read past the input")
    return problems


def quantized_reduction_violations(numel: int, scales_numel: int, in_groups: int, out_groups: int, num_bits: int,
                                   quant_type, local_world_size: int) -> List[str]:
    """`numel` is the int8 input's numel (bytes), holding `local_world_size` equal tensors."""
    problems = _common(num_bits)
    if local_world_size < 1 or in_groups < 1 or out_groups < 1:
        problems.append(f"local_world_size ({local_world_size}), in_groups ({in_groups}) and out_groups "
                        f"({out_groups}) must be >= 1")
        return problems
    if problems:
        return problems
    if numel > INT32_MAX:
        problems.append(f"input bytes {numel} exceed the kernels' int32 indexing ({INT32_MAX})")
    if numel % local_world_size:
        problems.append(f"input bytes {numel} are not divisible by local_world_size {local_world_size}")
        return problems
    if in_groups % local_world_size:
        problems.append(f"in_groups {in_groups} is not divisible by local_world_size {local_world_size}")
        return problems
    width = param_width(quant_type)
    if scales_numel != in_groups * width:
        problems.append(f"input scales hold {scales_numel} values, expected in_groups x {width} = "
                        f"{in_groups * width}")
    bytes_per_tensor = numel // local_world_size
    groups_per_tensor = in_groups // local_world_size
    load = reduce_load_bytes(num_bits)
    if bytes_per_tensor % groups_per_tensor:
        problems.append(f"bytes per device {bytes_per_tensor} are not divisible by in-groups per device "
                        f"{groups_per_tensor}")
    elif (bytes_per_tensor // groups_per_tensor) % load:
        problems.append(f"bytes per in-group {bytes_per_tensor // groups_per_tensor} are not a multiple of the "
                        f"{load}-byte load")
    if bytes_per_tensor % out_groups:
        problems.append(f"bytes per device {bytes_per_tensor} are not divisible by out_groups {out_groups}")
    else:
        bytes_per_out_group = bytes_per_tensor // out_groups
        if bytes_per_out_group == 0 or bytes_per_out_group % load:
            problems.append(f"bytes per out-group {bytes_per_out_group} are not a positive multiple of the "
                            f"{load}-byte load")
        elif reduce_launch(bytes_per_out_group, num_bits)[1] is None:
            problems.append(f"elements per out-group {bytes_per_out_group * values_per_byte(num_bits)} exceed "
                            f"quantized_reduction's largest launch ({reduce_max_group_elems(num_bits)})")
        elif reduce_launch(bytes_per_out_group, num_bits)[0] < WARP_SIZE:
            problems.append(f"elements per out-group {bytes_per_out_group * values_per_byte(num_bits)} launch "
                            f"{reduce_launch(bytes_per_out_group, num_bits)[0]} threads, fewer than a warp "
                            f"({WARP_SIZE}), whose shuffles would read lanes that do not exist; out-groups need at "
                            f"least {reduce_min_out_group_elems(num_bits)} elements")
    return problems


def dequantize_violations(numel: int,
                          params_numel: int,
                          num_groups: int,
                          num_bits: int,
                          quant_type,
                          out_element_size: int = 2) -> List[str]:
    """`numel` is the int8 input's numel (bytes); `out_element_size` 2 for dequantize (fp16), 4 for
    dequantize_fp32."""
    problems = _common(num_bits)
    if problems:
        return problems
    if num_groups < 1:
        return [f"num_groups must be >= 1, got {num_groups}"]
    total = numel * values_per_byte(num_bits)
    block = dequantize_block_elems(out_element_size)
    if -(-total // block) * block > INT32_MAX:
        problems.append(f"output elements {total} exceed the kernels' int32 indexing: their count and dequantize's "
                        f"last block, which indexes up to the next multiple of {block}, must stay within {INT32_MAX}")
    if total % num_groups:
        problems.append(f"output elements {total} are not divisible by num_groups {num_groups}: the last group "
                        f"would read parameters past the end")
    elif (total // num_groups) % VECTOR_ELEMS or total == 0:
        problems.append(f"elements per group {total // num_groups} is not a positive multiple of the "
                        f"{VECTOR_ELEMS}-value vector width")
    width = param_width(quant_type)
    if params_numel != num_groups * width:
        problems.append(f"params hold {params_numel} values, expected num_groups x {width} = {num_groups * width}")
    return problems


def output_sizes(op: str, in_shape, num_bits: int, local_world_size: int = 1):
    """(shape, divisor) of the codes or values `op` returns for an input of `in_shape`: the shape
    DeepSpeed's binding gives them, the input's with its last dimension divided by the values a byte
    packs for quantize, by the node's devices for quantized_reduction, multiplied by the values a byte
    packs for dequantize and dequantize_fp32 (swizzle_quant's flat), and that divisor (1 where
    nothing is divided). Its kernel writes the input's whole length in the same ratio, whatever the
    input's shape."""
    if op == "swizzle_quant":
        return [math.prod(in_shape) // values_per_byte(num_bits)], 1
    shape = list(in_shape)
    if op == "quantize":
        divisor = values_per_byte(num_bits)
    elif op == "quantized_reduction":
        divisor = local_world_size
    else:
        shape[-1] *= values_per_byte(num_bits)
        return shape, 1
    shape[-1] //= divisor
    return shape, divisor


def output_violations(op: str, in_shape, num_bits: int, local_world_size: int = 1) -> List[str]:
    """The binding's output must hold exactly what the kernel writes, or the kernel writes past its
    end: the input's last dimension a multiple of the divisor output_sizes divides it by."""
    if not in_shape or num_bits not in SUPPORTED_BITS or local_world_size < 1:
        return []  # every op's other rules refuse these (a 0-d input holds one value)
    shape, divisor = output_sizes(op, in_shape, num_bits, local_world_size)
    if in_shape[-1] % divisor == 0:
        return []
    return [
        f"the input's last dimension {in_shape[-1]} (shape {list(in_shape)}) is not a multiple of {divisor}: the "
        f"output, shaped {shape} as DeepSpeed's op shapes it, holds {math.prod(shape)} elements and the kernel "
        f"writes {math.prod(in_shape) // divisor}"
    ]


def require(problems: List[str], op: str) -> None:
    if problems:
        raise ValueError(f"{op}: call outside the quantizer kernels' contract: " + "; ".join(problems))


def layout_violations(flat=(), contiguous=()) -> List[str]:
    """The calling convention (see the module docstring): the (name, tensor) pairs of `flat` flat
    and contiguous, those of `contiguous` contiguous."""
    problems = []
    for name, tensor in flat:
        if tensor.dim() != 1 or not tensor.is_contiguous():
            problems.append(f"{name} must be a flat contiguous tensor (every DeepSpeed quantizer reads it so), got "
                            f"shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}")
    for name, tensor in contiguous:
        if not tensor.is_contiguous():
            problems.append(f"{name} must be contiguous, got shape {tuple(tensor.shape)}, strides "
                            f"{tuple(tensor.stride())}")
    return problems


def tensor_violations(**tensors) -> List[str]:
    """What the CUDA bindings would misread: each named tensor must have its expected dtype
    (``(tensor, "torch.int8")`` pairs) and all must share one device; on CUDA that device must
    be the current one, where the bindings allocate their outputs."""
    problems = []
    for name, (tensor, dtype) in tensors.items():
        if str(tensor.dtype) != dtype:
            problems.append(f"{name} must be {dtype} (the kernel reads it as such), got {tensor.dtype}")
    devices = {str(tensor.device) for tensor, _ in tensors.values()}
    if len(devices) > 1:
        problems.append(f"{', '.join(tensors)} must be on one device, got {sorted(devices)}")
    else:
        device = next(iter(tensors.values()))[0].device
        if device.type == "cuda":
            from deepspeed.accelerator import get_accelerator
            current = get_accelerator().current_device()
            if device.index is not None and device.index != current:
                problems.append(f"the tensors are on {device} but the current device is cuda:"
                                f"{current}, where the kernel allocates its outputs")
    return problems


class ContractCheckedQuantizer:
    """A quantizer op module (the CUDA or the CPU build, NPUQuantizer) whose calls are checked
    against this contract and the calling convention first, so a call the kernels would mishandle
    is refused with the condition and the values instead of silently giving wrong results."""

    def __init__(self, ops):
        self.ops = ops
        self.QuantizationType = getattr(ops, "QuantizationType", None)  # NPUQuantizer has none
        self.Symmetric = ops.Symmetric
        self.Asymmetric = getattr(ops, "Asymmetric", None)  # qgZ is symmetric

    def quantize(self, x, num_groups, num_bits, quant_type):
        require(
            tensor_violations(input=(x, "torch.float16")) + layout_violations(contiguous=[("input", x)]) +
            quantize_violations(x.numel(), num_groups, num_bits) + output_violations("quantize", x.shape, num_bits),
            "quantize")
        return self.ops.quantize(x, num_groups, num_bits, quant_type)

    def swizzle_quant(self, x, num_groups, num_bits, quant_type, pipeline_size, num_nodes, local_world_size):
        require(
            tensor_violations(input=(x, "torch.float16")) + layout_violations(contiguous=[("input", x)]) +
            swizzle_quant_violations(x.numel(), num_groups, num_bits, pipeline_size, num_nodes, local_world_size),
            "swizzle_quant")
        return self.ops.swizzle_quant(x, num_groups, num_bits, quant_type, pipeline_size, num_nodes, local_world_size)

    def quantized_reduction(self, data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size):
        require(
            tensor_violations(data=(data, "torch.int8"), scales=(scales, "torch.float32")) +
            layout_violations(flat=[("data", data)], contiguous=[("scales", scales)]) + quantized_reduction_violations(
                data.numel(), scales.numel(), in_groups, out_groups, num_bits, quant_type, local_world_size) +
            output_violations("quantized_reduction", data.shape, num_bits, local_world_size), "quantized_reduction")
        return self.ops.quantized_reduction(data, scales, in_groups, out_groups, num_bits, quant_type,
                                            local_world_size)

    def _dequantize(self, name, out_element_size, data, params, num_groups, num_bits, quant_type):
        require(
            tensor_violations(data=(data, "torch.int8"), params=(params, "torch.float32")) +
            layout_violations(flat=[("data", data)], contiguous=[("params", params)]) +
            dequantize_violations(data.numel(), params.numel(), num_groups, num_bits, quant_type, out_element_size),
            name)
        return getattr(self.ops, name)(data, params, num_groups, num_bits, quant_type)

    def dequantize(self, data, params, num_groups, num_bits, quant_type):
        return self._dequantize("dequantize", 2, data, params, num_groups, num_bits, quant_type)

    def dequantize_fp32(self, data, params, num_groups, num_bits, quant_type):
        return self._dequantize("dequantize_fp32", 4, data, params, num_groups, num_bits, quant_type)

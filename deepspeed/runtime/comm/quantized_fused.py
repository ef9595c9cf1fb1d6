# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
The three stages of the quantized gradient reduce-scatter (quantized_pipeline.py) as fused Triton
kernels: one launch per stage per call, whatever the number of tensors, on the same layout and wire
format (quantized_layout.py), giving the same bits as the stages they replace, which run DeepSpeed's
quantizer kernels (as the CPU op and qgz_reference state them) with the glue around them:

=====================  =========================================================================
stage                  one launch
=====================  =========================================================================
quantize_partitions    reads every gradient where it lies (a table of their addresses), takes
                       each group's statistics, rescales and quantizes it, writes the slots the
                       intra-node all-to-all sends, scales beside the codes
reduce_within_node     reads the node's copies of each group, dequantizes, sums and requantizes
                       them in registers (8 bits: the exact sum and the clamp-free int4
                       quantization; 4 bits: quantized_reduction's fp16 sum and formula), writes
                       the slots the inter-node all-to-all sends
average_across_nodes   reads the nodes' sums of each group, dequantizes, sums, averages and
                       writes the rank's padded partition in the gradients' dtype
=====================  =========================================================================

Each launcher sits under its kernel. The pipeline selects them (``fused=True``); the glue stages
are their specification, and the tests compare the two bit for bit.

How the kernels get the reference's bits on a GPU as in Triton's interpreter, where the two round
differently unless told otherwise:

* Every product and quotient of the reference is computed in fp64 and rounded once to fp32 (a
  product of two fp32 numbers is exact in fp64; a quotient rounded twice through 53 bits is the
  correctly rounded fp32 quotient). So no division goes through fp32 ``/``, which compiles to an
  approximate division on NVIDIA GPUs, or through libdevice, which Triton links with
  flush-to-zero on (``enable_reflect_ftz``); and no fp32 subnormal enters fp32 arithmetic, where a
  GPU could flush it. (fp32 to fp64 and back keep subnormals unless compiled to flush them; the
  GPU check's subnormal inputs would show it.)
* Magnitudes, maxima, signs and binary exponents are taken on the fp32 bit patterns as integers,
  and bf16 gradients are widened to fp32 on their bits (Triton 3.9's interpreter converts bf16
  subnormals wrongly).
* Rounding to an integer is written out (floor, then half to even); nothing casts a float to an
  int before it is integral.
* Every launch passes ``enable_fp_fusion=False``: a GPU would otherwise contract ``x * s + c``
  into one rounding.
* fp32 to bf16 is rounded to nearest even on the bits (the interpreter truncates) and stored
  through an int16 view; fp32 to fp16 rounds to nearest even on both.
* Offsets into slots and gradients are int64.

Where the results are not bit for bit the glue's: a group holding an inf or NaN gets codes 0 with
its NaN scale (the glue leaves whatever the kernels make of it there); its results are NaN either
way, and NaN payloads are not part of the contract.

On CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` when this
module is first imported), which is how the tests run them.
"""

from functools import lru_cache
from typing import List, Optional

import torch
from torch import Tensor

from deepspeed.runtime.comm.quantized_layout import QuantizedReduceLayout

try:
    import triton
    import triton.language as tl
except ImportError:  # fused_unavailable_reason says so
    triton = None

# Codes for the gradients' dtype inside the kernels.
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
# Values per program: ROWS groups x BLOCK values, at most MAX_BLOCK values of a group at a time.
PROGRAM_VALUES = 2048
MAX_BLOCK = 2048
NUM_WARPS = 4


def fused_unavailable_reason(device_type: str) -> Optional[str]:
    """Why the fused kernels cannot run on `device_type` tensors in this process, or None if they can."""
    if triton is None:
        return "Triton is not installed (CUDA builds of torch ship it; otherwise pip install triton)"
    interpreted = _quantize_partitions_kernel.__class__.__name__ == "InterpretedFunction"
    if device_type == "cpu":
        if not interpreted:
            return ("on CPU tensors the fused kernels run only in Triton's interpreter, for tests: TRITON_INTERPRET=1 "
                    "must be set before deepspeed.runtime.comm.quantized_fused is first imported")
        return None
    if device_type != "cuda":
        return f"the fused kernels run on CUDA devices (and on CPU under TRITON_INTERPRET=1), not on {device_type}"
    if interpreted:
        return "TRITON_INTERPRET=1 runs the fused kernels on the CPU: unset it for CUDA tensors"
    import deepspeed
    if not deepspeed.HAS_TRITON:
        return "deepspeed.HAS_TRITON is False (no Triton backend is active for this GPU, or ROCm)"
    return None


def require_fused(device: torch.device) -> None:
    """Raises ValueError naming why, if the fused kernels cannot run on `device`."""
    reason = fused_unavailable_reason(device.type)
    if reason is not None:
        raise ValueError(f"all_to_all_quant_reduce(fused=True): {reason}")


def _launch(kernel, grid, args, meta, reads=()):
    """One kernel launch. `reads`: the tensors the kernel reads through a table of addresses rather
    than as arguments (the accounting counts them)."""
    kernel[grid](*args, num_warps=NUM_WARPS, enable_fp_fusion=False, **meta)


def _block(group_elems: int):
    """(ROWS, BLOCK, ONE_STEP): groups per program, values of a group per step, whether a group
    fits in one step."""
    block = min(triton.next_power_of_2(group_elems), MAX_BLOCK)
    return max(1, PROGRAM_VALUES // block), block, group_elems <= block


if triton is not None:

    # ------------------------------------------------------------------------------------------
    # the arithmetic the stages share
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _binary_exponent(magnitude):
        """binary_exponent (quantized_pipeline.py) on the bits of a finite non-negative fp32
        (int32): e with value = m * 2**e, 0.5 <= m < 1, clamped to +-126; 0 for zero."""
        field = magnitude >> 23
        exponent = tl.minimum(tl.maximum(field - 126, -126), 126)
        exponent = tl.where(field == 0, -126, exponent)
        return tl.where(magnitude == 0, 0, exponent)

    @triton.jit
    def _power_of_two(exponent):
        """2**exponent as fp64, from its bits (int32 exponents in fp64's normal range)."""
        return ((exponent.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)

    @triton.jit
    def _fp32_product(a, b):
        """a * b rounded once to fp32, computed in fp64."""
        return (a.to(tl.float64) * b.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _dequantized(codes, scale):
        """What the dequantize kernel gives: codes * scale rounded to fp32, then to fp16 (as fp32)."""
        return _fp32_product(codes, scale[:, None]).to(tl.float16).to(tl.float32)

    @triton.jit
    def _magnitudes(values, mask):
        """Per row of fp32 `values` ([ROWS, BLOCK], masked lanes left out), on the bits: (the largest
        magnitude of a positive value, of a negative value (int32 bits), whether one is inf or NaN)."""
        bits = values.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        positive = tl.max(tl.where(mask & (bits > 0), magnitude, 0), axis=1)
        negative = tl.max(tl.where(mask & (bits < 0), magnitude, 0), axis=1)
        nonfinite = tl.max(tl.where(mask & (magnitude >= 0x7F800000), 1, 0), axis=1)
        return positive, negative, nonfinite

    @triton.jit
    def _clamp_free(positive, negative, rescale: tl.constexpr):
        """_prepare_groups's (absmax bits, binary exponent, sign, fp64 factor the values are multiplied
        by) from _magnitudes: with `rescale` the power of two bringing the absmax into [0.5, 1) (fp16
        gradients are not rescaled); the sign negates a group whose largest magnitude is positive."""
        absmax = tl.maximum(positive, negative)
        sign = tl.where(positive > negative, -1.0, 1.0)
        if rescale:
            own = _binary_exponent(absmax)
        else:
            own = tl.zeros_like(absmax)
        return absmax, own, sign, _power_of_two(-own) * sign

    @triton.jit
    def _kernel_scale(absmax, BITS: tl.constexpr):
        """The quantizer kernels' symmetric scale 2**bits / (2 * absmax), 1 for absmax 0."""
        quotient = (2.0**BITS) / tl.where(absmax == 0.0, 2.0**BITS, 2.0 * absmax.to(tl.float64))
        return quotient.to(tl.float32)

    @triton.jit
    def _kernel_codes(values, scale, finite, BITS: tl.constexpr):
        """The quantizer kernels' codes of fp16 `values` (as fp32) at `scale`, clamp(rint(values *
        scale)), rounding half to even; 0 in a group holding an inf or NaN (not `finite`)."""
        scaled = tl.where(finite[:, None], values, 0.0) * scale[:, None]
        low = tl.floor(scaled)
        fraction = scaled - low
        odd = (low.to(tl.int32) & 1) == 1
        rounded = tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), low + 1.0, low)
        return tl.minimum(tl.maximum(rounded, -(2.0**(BITS - 1))), 2.0**(BITS - 1) - 1.0).to(tl.int32)

    @triton.jit
    def _kernel_param(scale):
        """The parameter the kernels store: 1 / scale."""
        return (1.0 / scale.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _store_codes(out, start, codes, mask, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Stores a step of a group's codes ([ROWS, BLOCK], `mask` the lanes to store) from byte
        `start` of each row; at 4 bits two per byte, the first in the high nibble."""
        if BITS == 8:
            tl.store(out + start[:, None] + tl.arange(0, BLOCK)[None, :], codes.to(tl.int8), mask=mask)
        else:
            first, second = tl.split(tl.reshape(codes, [ROWS, BLOCK // 2, 2]))
            pairs = tl.arange(0, BLOCK // 2)[None, :]
            keep = tl.max(tl.reshape(mask.to(tl.int32), [ROWS, BLOCK // 2, 2]), axis=2) > 0
            tl.store(out + start[:, None] + pairs, (((first & 15) << 4) | (second & 15)).to(tl.int8), mask=keep)

    @triton.jit
    def _load_codes(data, start, mask, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """A step of a group's codes ([ROWS, BLOCK] fp32) from byte `start` of each row."""
        if BITS == 8:
            codes = tl.load(data + start[:, None] + tl.arange(0, BLOCK)[None, :], mask=mask, other=0).to(tl.int32)
        else:
            pairs = tl.arange(0, BLOCK // 2)[None, :]
            keep = tl.max(tl.reshape(mask.to(tl.int32), [ROWS, BLOCK // 2, 2]), axis=2) > 0
            packed = tl.load(data + start[:, None] + pairs, mask=keep, other=0).to(tl.int32)
            codes = tl.reshape(tl.join(packed >> 4, ((packed & 15) ^ 8) - 8), [ROWS, BLOCK])
        return codes.to(tl.float32)

    @triton.jit
    def _store_scales(out, start, rows, values, live):
        """Stores fp32 `values` ([ROWS]) at byte `start` + 4 x row of `out`."""
        tl.store((out + start + 4 * rows.to(tl.int64)).to(tl.pointer_type(tl.float32)), values, mask=live)

    @triton.jit
    def _zero_tail(out, start, stop, BLOCK: tl.constexpr):
        """Zeros bytes [start, stop) of `out`: a slot's scale groups past its scales."""
        for offset in range(start, stop, BLOCK):
            lanes = offset + tl.arange(0, BLOCK)
            tl.store(out + lanes, tl.zeros([BLOCK], dtype=tl.int8), mask=lanes < stop)

    # ------------------------------------------------------------------------------------------
    # stage 0
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _load_values(base, start, count, in_group, DTYPE: tl.constexpr):
        """A step of a group's values (fp32, [ROWS, BLOCK]) from its gradient: elements start +
        lane while the lane is below `count`, zeros after. bf16 is read as its bits and widened on
        them (the interpreter's bf16 conversion gets subnormals wrong; the bits are exact anywhere)."""
        lanes = tl.arange(0, in_group.shape[1])[None, :]
        values = tl.load(base[:, None] + start[:, None] + lanes, mask=in_group & (lanes < count[:, None]), other=0)
        if DTYPE == 1:
            return (values.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return values.to(tl.float32)

    @triton.jit
    def _quantize_partitions_kernel(pointers, tensor_table, group_tensor, slots, groups, group_elems, slot_bytes,
                                    num_nodes, local_world_size, DTYPE: tl.constexpr, BITS: tl.constexpr,
                                    ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_STEP: tl.constexpr):
        """Program (partition, block of ROWS groups): those groups of the partition's intra slot."""
        partition = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        live = rows < groups
        tensor = tl.load(group_tensor + rows, mask=live, other=0).to(tl.int64)
        numel = tl.load(tensor_table + 3 * tensor, mask=live, other=0)
        chunk = tl.load(tensor_table + 3 * tensor + 1, mask=live, other=0)
        first_group = tl.load(tensor_table + 3 * tensor + 2, mask=live, other=0)
        address = tl.load(pointers + tensor, mask=live, other=0)
        if DTYPE == 0:
            base = address.to(tl.pointer_type(tl.float16))
        elif DTYPE == 1:
            base = address.to(tl.pointer_type(tl.int16))  # bf16 bits: see _load_values
        else:
            base = address.to(tl.pointer_type(tl.float32))
        # the group's values: elements [start, start + count) of its tensor's partition, then zeros
        within = (rows.to(tl.int64) - first_group) * group_elems
        start = partition.to(tl.int64) * chunk + within
        count = tl.minimum(chunk - within, numel - start)
        lanes = tl.arange(0, BLOCK)

        if ONE_STEP:
            in_group = live[:, None] & (lanes[None, :] < group_elems)
            values = _load_values(base, start, count, in_group, DTYPE)
            positive, negative, nonfinite = _magnitudes(values, in_group)
        else:
            positive = tl.zeros([ROWS], dtype=tl.int32)
            negative = tl.zeros([ROWS], dtype=tl.int32)
            nonfinite = tl.zeros([ROWS], dtype=tl.int32)
            for step in range(0, group_elems, BLOCK):
                in_group = live[:, None] & (step + lanes[None, :] < group_elems)
                values = _load_values(base, start + step, count - step, in_group, DTYPE)
                step_positive, step_negative, step_nonfinite = _magnitudes(values, in_group)
                positive = tl.maximum(positive, step_positive)
                negative = tl.maximum(negative, step_negative)
                nonfinite = tl.maximum(nonfinite, step_nonfinite)
        finite = nonfinite == 0
        absmax, own, sign, factor = _clamp_free(tl.where(finite, positive, 0), tl.where(finite, negative, 0), DTYPE
                                                != 0)
        # the kernel's scale from the largest fp16 value it would read (rounding is monotonic)
        largest = _fp32_product(absmax.to(tl.float32, bitcast=True), tl.abs(factor)).to(tl.float16)
        scale = _kernel_scale(largest.to(tl.float32), BITS)

        node = partition // local_world_size
        slot = (partition % local_world_size) * num_nodes + node
        slot_start = slot.to(tl.int64) * slot_bytes
        group_bytes = group_elems * BITS // 8
        code_start = slot_start + rows.to(tl.int64) * group_bytes
        if ONE_STEP:
            fp16 = _fp32_product(values, factor[:, None]).to(tl.float16).to(tl.float32)
            _store_codes(slots, code_start, _kernel_codes(fp16, scale, finite, BITS), in_group, BITS, ROWS, BLOCK)
        else:
            for step in range(0, group_elems, BLOCK):
                in_group = live[:, None] & (step + lanes[None, :] < group_elems)
                values = _load_values(base, start + step, count - step, in_group, DTYPE)
                fp16 = _fp32_product(values, factor[:, None]).to(tl.float16).to(tl.float32)
                _store_codes(slots, code_start + step * BITS // 8, _kernel_codes(fp16, scale, finite, BITS), in_group,
                             BITS, ROWS, BLOCK)
        fold = tl.where(absmax > 0, _power_of_two(own), 0.0) * sign
        _store_scales(slots, slot_start + groups * group_bytes, rows,
                      tl.where(finite, _fp32_product(_kernel_param(scale), fold), float("nan")), live)
        if tl.program_id(1) == 0:
            _zero_tail(slots + slot_start, groups * (group_bytes + 4), slot_bytes, 1024)

    # ------------------------------------------------------------------------------------------
    # stage 1
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _scale_magnitudes(received, scale_start, stride, count, live, ROWS: tl.constexpr):
        """Of `count` copies of ROWS groups' fp32 scales, `stride` bytes apart: the largest finite
        magnitude (its bits, int32) and whether all of them are finite."""
        largest = tl.zeros([ROWS], dtype=tl.int32)
        nonfinite = tl.zeros([ROWS], dtype=tl.int32)
        for copy in range(count):
            scale = tl.load((received + scale_start + copy * stride).to(tl.pointer_type(tl.float32)),
                            mask=live,
                            other=0.0)
            magnitude = scale.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            largest = tl.maximum(largest, tl.where(magnitude < 0x7F800000, magnitude, 0))
            nonfinite = tl.maximum(nonfinite, tl.where(magnitude >= 0x7F800000, 1, 0))
        return largest, nonfinite == 0

    @triton.jit
    def _node_sums(received, code_start, scale_start, copy_stride, exponent, finite, live, in_group, copies,
                   IN_BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """A step of the node's sums of a group's copies ([ROWS, BLOCK]): at 8 bits the exact sums in
        fp64 of the dequantized fp16 values; at 4 bits quantized_reduction's fp16 sums in copy order
        from +0 (as fp32), the copies of a group holding an inf or NaN read as zeros."""
        if IN_BITS == 8:
            sums = tl.zeros([ROWS, BLOCK], dtype=tl.float64)
        else:
            sums = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        down = _power_of_two(-exponent)
        for copy in range(copies):
            offset = copy * copy_stride
            scale = tl.load((received + scale_start + offset).to(tl.pointer_type(tl.float32)), mask=live, other=0.0)
            normalized = _fp32_product(scale, down)
            if IN_BITS == 4:
                normalized = tl.where(finite, normalized, 0.0)
            values = _dequantized(_load_codes(received + offset, code_start, in_group, IN_BITS, ROWS, BLOCK),
                                  normalized)
            if IN_BITS == 8:
                sums += values.to(tl.float64)
            else:
                sums = (sums + values).to(tl.float16).to(tl.float32)
        return sums

    @triton.jit
    def _reduce_within_node_kernel(received, out, groups, group_elems, in_slot_bytes, out_slot_bytes, copy_stride,
                                   copies, summing_bits, shift, IN_BITS: tl.constexpr, ROWS: tl.constexpr,
                                   BLOCK: tl.constexpr, ONE_STEP: tl.constexpr):
        """Program (node, block of ROWS groups): the node's sums of those groups of this rank's
        partition, as int4 in the node's inter slot."""
        node = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        live = rows < groups
        in_group_bytes = group_elems * IN_BITS // 8
        slot_start = node.to(tl.int64) * in_slot_bytes
        code_start = slot_start + rows.to(tl.int64) * in_group_bytes
        scale_start = slot_start + groups * in_group_bytes + 4 * rows.to(tl.int64)

        # the summing exponent: every copy's scale below 2**-summing_bits after it
        largest, finite = _scale_magnitudes(received, scale_start, copy_stride, copies, live, ROWS)
        exponent = tl.where(finite, _binary_exponent(largest), 0) + summing_bits

        lanes = tl.arange(0, BLOCK)
        if ONE_STEP:
            in_group = live[:, None] & (lanes[None, :] < group_elems)
            sums = _node_sums(received, code_start, scale_start, copy_stride, exponent, finite, live, in_group, copies,
                              IN_BITS, ROWS, BLOCK)
            positive, negative, _ = _magnitudes(sums.to(tl.float32), in_group)
        else:
            positive = tl.zeros([ROWS], dtype=tl.int32)
            negative = tl.zeros([ROWS], dtype=tl.int32)
            for step in range(0, group_elems, BLOCK):
                in_group = live[:, None] & (step + lanes[None, :] < group_elems)
                sums = _node_sums(received, code_start + step * IN_BITS // 8, scale_start, copy_stride, exponent,
                                  finite, live, in_group, copies, IN_BITS, ROWS, BLOCK)
                step_positive, step_negative, _ = _magnitudes(sums.to(tl.float32), in_group)
                positive, negative = tl.maximum(positive, step_positive), tl.maximum(negative, step_negative)
        positive, negative = tl.where(finite, positive, 0), tl.where(finite, negative, 0)
        if IN_BITS == 8:
            # the glue's clamp-free int4 quantization of the fp32 node sums
            absmax, own, sign, factor = _clamp_free(positive, negative, True)
            largest_value = _fp32_product(absmax.to(tl.float32, bitcast=True), tl.abs(factor)).to(tl.float16)
            scale = _kernel_scale(largest_value.to(tl.float32), 4)
        else:
            # quantized_reduction's requantization of its fp16 sums
            factor = tl.zeros([ROWS], dtype=tl.float64)
            scale = _kernel_scale(tl.maximum(positive, negative).to(tl.float32, bitcast=True), 4)

        out_group_bytes = group_elems // 2
        out_start = node.to(tl.int64) * out_slot_bytes
        out_codes = out_start + rows.to(tl.int64) * out_group_bytes
        if ONE_STEP:
            if IN_BITS == 8:
                sums = _fp32_product(sums, factor[:, None]).to(tl.float16).to(tl.float32)
            _store_codes(out, out_codes, _kernel_codes(sums, scale, finite, 4), in_group, 4, ROWS, BLOCK)
        else:
            for step in range(0, group_elems, BLOCK):
                in_group = live[:, None] & (step + lanes[None, :] < group_elems)
                sums = _node_sums(received, code_start + step * IN_BITS // 8, scale_start, copy_stride, exponent,
                                  finite, live, in_group, copies, IN_BITS, ROWS, BLOCK)
                if IN_BITS == 8:
                    sums = _fp32_product(sums, factor[:, None]).to(tl.float16).to(tl.float32)
                _store_codes(out, out_codes + step // 2, _kernel_codes(sums, scale, finite, 4), in_group, 4, ROWS,
                             BLOCK)
        param = _kernel_param(scale)
        if IN_BITS == 8:
            fold = tl.where(absmax > 0, _power_of_two(own + exponent - shift), 0.0) * sign
        else:
            fold = tl.where(param < 1.0, _power_of_two(exponent - shift), 0.0)
        _store_scales(out, out_start + groups * out_group_bytes, rows,
                      tl.where(finite, _fp32_product(param, fold), float("nan")), live)
        if tl.program_id(1) == 0:
            _zero_tail(out + out_start, groups * (out_group_bytes + 4), out_slot_bytes, 1024)

    # ------------------------------------------------------------------------------------------
    # stage 2
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _within(x, largest):
        """x limited to [-largest, largest] before a narrowing conversion, so that none overflows
        (infinities included); NaN kept (where, not min/max, which ignore NaN on a GPU)."""
        return tl.where(x > largest, largest, tl.where(x < -largest, -largest, x))

    @triton.jit
    def _result(sums, factor, DTYPE: tl.constexpr):
        """The result in the gradients' dtype from the fp64 sums, saturated at its largest value
        (what saturating the default path's converted result gives: values past the largest, which
        round to infinity, and infinities become it; NaN kept): fp16 values, bf16 bits (int32,
        rounded to nearest even), fp32 values."""
        if DTYPE == 0:
            return _within(sums.to(tl.float32), 65504.0).to(tl.float16).to(tl.float32)
        value = _within(sums * factor[:, None], 3.4028234663852886e38).to(tl.float32)
        if DTYPE == 2:
            return value
        bits = value.to(tl.int32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
        # FLT_MAX and the values just below it round up to bf16's infinity: its largest value instead
        rounded = tl.where(rounded == 0x7F80, 0x7F7F, tl.where(rounded == 0xFF80, 0xFF7F, rounded))
        return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded)

    @triton.jit
    def _average_across_nodes_kernel(received, out, groups, group_elems, slot_bytes, num_nodes, world, shift,
                                     DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (block of ROWS groups): those groups of this rank's padded partition of the average."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = rows < groups
        group_bytes = group_elems // 2
        code_start = rows.to(tl.int64) * group_bytes
        scale_start = groups * group_bytes + 4 * rows.to(tl.int64)
        if DTYPE == 0:
            factor = tl.zeros([ROWS], dtype=tl.float64)  # the scales become shares of the average
            down = tl.zeros([ROWS], dtype=tl.float64)
        else:
            # the nodes' scales brought near 1 by a power of two; the factor it leaves, over the world
            largest, _ = _scale_magnitudes(received, scale_start, slot_bytes, num_nodes, live, ROWS)
            exponent = _binary_exponent(largest)
            down = _power_of_two(-exponent)
            factor = (_power_of_two(exponent) / world).to(tl.float32).to(
                tl.float64) * _power_of_two(shift + tl.zeros_like(exponent))
        lanes = tl.arange(0, BLOCK)
        for step in range(0, group_elems, BLOCK):
            in_group = live[:, None] & (step + lanes[None, :] < group_elems)
            sums = tl.zeros([ROWS, BLOCK], dtype=tl.float64)
            for node in range(num_nodes):
                offset = node * slot_bytes
                scale = tl.load((received + scale_start + offset).to(tl.pointer_type(tl.float32)),
                                mask=live,
                                other=0.0)
                if DTYPE == 0:
                    share = (scale.to(tl.float64) / world).to(tl.float32)
                    param = _fp32_product(share, _power_of_two(shift + tl.zeros_like(rows)))
                else:
                    param = _fp32_product(scale, down)
                codes = _load_codes(received + offset, code_start + step // 2, in_group, 4, ROWS, BLOCK)
                sums += _dequantized(codes, param).to(tl.float64)
            address = out + rows.to(tl.int64)[:, None] * group_elems + step + lanes[None, :]
            if DTYPE == 1:
                tl.store(address, _result(sums, factor, DTYPE).to(tl.int16), mask=in_group)
            else:
                tl.store(address, _result(sums, factor, DTYPE), mask=in_group)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _tensor_tables(layout: QuantizedReduceLayout, device: str):
    """(per tensor [numel, partition, first group] int64, per group of a padded partition its
    tensor int32), on `device`; cached per layout."""
    table = [[t.numel, t.partition, t.offset // layout.group_elems] for t in layout.tensors]
    owners = [i for i, t in enumerate(layout.tensors) for _ in range(t.num_groups)]
    return (torch.tensor(table, dtype=torch.int64,
                         device=device), torch.tensor(owners, dtype=torch.int32, device=device))


def quantize_partitions(tensors: List[Tensor], layout: QuantizedReduceLayout) -> Tensor:
    """Stage 0 in one launch: quantized_pipeline.quantize_partitions's slots, read from the
    gradients where they lie."""
    fmt, world = layout.intra, layout.world_size
    device, dtype = tensors[0].device, tensors[0].dtype
    tensors = [t.contiguous() for t in tensors]
    table, owners = _tensor_tables(layout, str(device))
    # the gradients' addresses: one asynchronous host-to-device copy from pinned memory per call, no
    # host synchronization (a copy on CPU too, so the accounting counts the same op)
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=device.type == "cuda")
    pointers = addresses.to(device, non_blocking=True, copy=True)
    slots = torch.empty(world, fmt.slot_bytes, dtype=torch.int8, device=device)
    rows, block, one_step = _block(layout.group_elems)
    _launch(_quantize_partitions_kernel, (world, triton.cdiv(fmt.groups_per_partition, rows)),
            (pointers, table, owners, slots, fmt.groups_per_partition, layout.group_elems, fmt.slot_bytes,
             layout.num_nodes, layout.local_world_size),
            dict(DTYPE=DTYPE_CODES[dtype], BITS=fmt.bits, ROWS=rows, BLOCK=block, ONE_STEP=one_step),
            reads=tensors)
    return slots


def reduce_within_node(received: Tensor, layout: QuantizedReduceLayout) -> Tensor:
    """Stage 1 in one launch: quantized_pipeline.reduce_within_node's slots."""
    intra, inter = layout.intra, layout.inter
    out = torch.empty(layout.num_nodes, inter.slot_bytes, dtype=torch.int8, device=received.device)
    rows, block, one_step = _block(layout.group_elems)
    _launch(_reduce_within_node_kernel, (layout.num_nodes, triton.cdiv(intra.groups_per_partition, rows)),
            (received, out, intra.groups_per_partition, layout.group_elems, intra.slot_bytes, inter.slot_bytes,
             layout.num_nodes * intra.slot_bytes, layout.local_world_size,
             (2 * layout.local_world_size - 1).bit_length(), layout.inter_scale_shift),
            dict(IN_BITS=intra.bits, ROWS=rows, BLOCK=block, ONE_STEP=one_step))
    return out


def average_across_nodes(received: Tensor, layout: QuantizedReduceLayout, dtype: torch.dtype) -> Tensor:
    """Stage 2 in one launch: quantized_pipeline.average_across_nodes's padded partition."""
    fmt = layout.inter
    average = torch.empty(layout.padded_partition, dtype=dtype, device=received.device)
    rows, block, _ = _block(layout.group_elems)
    _launch(_average_across_nodes_kernel, (triton.cdiv(fmt.groups_per_partition, rows), ),
            (received, average.view(torch.int16) if dtype == torch.bfloat16 else average, fmt.groups_per_partition,
             layout.group_elems, fmt.slot_bytes, layout.num_nodes, layout.world_size, layout.inter_scale_shift),
            dict(DTYPE=DTYPE_CODES[dtype], ROWS=rows, BLOCK=block))
    return average

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

Launch geometry (``tile_shape``). Every launch puts its programs on grid axis 0 (CUDA allows 2**31 - 1
there, 65535 on the others; ``GRID_LIMITS``). A program holds ``TILE_VECTORS`` vectors of 8 values
(``VECTOR_ELEMS``) and as many whole groups as fit (30 groups of 136 values, 4 of 1024): the groups lie
one after the other in its lanes, so no lane idles for want of a power-of-two group size. A group's
statistics are reduced once: each vector's in registers, then the vectors of each group, gathered
into one row per group; what a group's values need of them is gathered back to its vectors. Groups
longer than a program (more than 4096 values) take one program each and loop over it in steps.

How the kernels get the reference's bits on a GPU as in Triton's interpreter, where the two round
differently unless told otherwise, and stay inside what the hardware and LLVM define:

* Every product and quotient of the reference is one IEEE operation rounded once to fp32: fp32
  ``mul.rn`` and ``tl.math.div_rn`` (``div.rn.f32``), never fp32 ``/``, which compiles to an
  approximate division; multiplications by a power of two too large for one fp32 factor take two,
  of which only the last can round (``_times_power_of_two``). The one fp64 operation is stage 2's
  product of the exact node sum by the average's factor (bf16 and fp32 gradients), which the
  reference computes in fp64 and rounds twice.
* Exact sums of values on fp16's grid are exact here too: stage 1 (8 bits) keeps two fp32
  accumulators, one for each value rounded to 2**-16 and one for the rest, each exact for its range;
  stage 2 adds integers in units of 2**-24, looked up per node in a table of the 16 values a group's
  int4 codes dequantize to, int32 only where no sum of any finite scales can leave it (up to
  NARROW_SUM_NODES nodes of bf16 or fp32 gradients), int64 elsewhere; stage 1 (4 bits) sums in fp16
  as quantized_reduction does.
* Magnitudes, maxima, signs and binary exponents are taken on the fp32 bit patterns as integers;
  bf16 gradients are widened to fp32 on their bits (Triton 3.9's interpreter converts bf16
  subnormals wrongly) and results rounded to bf16 on their bits (the interpreter truncates).
* Rounding to an integer adds 1.5 * 2**23 (the sum's last bit is then the rounded value, half to
  even) and reads the integer off the bits: no float-to-int conversion of a value that is not yet
  integral, none out of range, none of a NaN. Codes are clamped to the kernels' range, or to 0 in a
  group holding an inf or NaN.
* Every launch passes ``enable_fp_fusion=False``: a GPU would otherwise contract ``x * s + c``
  into one rounding; no ``.ftz`` instruction is used (fp32 to fp16 and fp16 arithmetic keep
  subnormals).
* Offsets into slots and gradients are int64; narrowing conversions never overflow.

Where the results are not bit for bit the glue's: a group holding an inf or NaN gets codes 0 with
its NaN scale (the glue leaves whatever the kernels make of it there); its results are NaN either
way, and NaN payloads are not part of the contract. An inf scale, which no stage writes, is read as
a NaN one.

On CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` when this
module is first imported), which is how the tests run them.
"""

from functools import lru_cache
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from deepspeed_qgz.qgz.qgz_contract import VECTOR_ELEMS, next_pow2, swizzle_slot
from deepspeed_qgz.qgz.quantized_layout import QuantizedReduceLayout
from deepspeed_qgz.qgz.quantized_pipeline import summing_bits

try:
    import triton
    import triton.language as tl
except ImportError:  # fused_unavailable_reason says so
    triton = None

# Codes for the gradients' dtype inside the kernels.
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
NUM_WARPS = 4
# Vectors of VECTOR_ELEMS values a program holds at once (4096 values).
TILE_VECTORS = 512
# The most programs a launch may put on each grid axis (CUDA C++ Programming Guide, "Features and
# Technical Specifications": maximum x-dimension of a grid of thread blocks 2**31 - 1, y- and
# z-dimension 65535). The launchers use axis 0 only.
GRID_LIMITS = (2**31 - 1, 65535, 65535)
# A program's rows: (v * row_magic) >> ROW_SHIFT is v // vectors for every vector v of a program.
ROW_SHIFT = 20


class TileShape(NamedTuple):
    """How a launch covers a layout's groups (see the module docstring)."""
    groups: int  # groups a program holds (1 when a group takes several steps)
    rows: int  # ROWS: a power of two at least `groups`, the same for every group size of a class
    vectors_pad: int  # VPG_PAD: the power of two at least the vectors of a group (the class), one step
    one_step: bool  # whether a program holds its groups whole
    row_magic: int  # see ROW_SHIFT


@lru_cache(maxsize=None)
def tile_shape(group_elems: int) -> TileShape:
    """The tile of every launch for groups of `group_elems` values (a multiple of VECTOR_ELEMS).
    The compiled variants depend only on the class, next_pow2(vectors per group): at most
    TILE_VECTORS // (pad / 2 + 1) groups fit, fewer than 2 * TILE_VECTORS // pad rows."""
    vectors = group_elems // VECTOR_ELEMS
    if vectors > TILE_VECTORS:
        return TileShape(1, 1, TILE_VECTORS, False, 0)
    pad = next_pow2(vectors)
    magic = -(-(1 << ROW_SHIFT) // vectors)
    # exact for every vector of a program: TILE_VECTORS * (magic * vectors - 2**ROW_SHIFT) < 2**ROW_SHIFT
    assert TILE_VECTORS * (magic * vectors - (1 << ROW_SHIFT)) < (1 << ROW_SHIFT)
    return TileShape(TILE_VECTORS // vectors, max(1, 2 * TILE_VECTORS // pad), pad, True, magic)


def fused_unavailable_reason(device_type: str) -> Optional[str]:
    """Why the fused kernels cannot run on `device_type` tensors in this process, or None if they can."""
    if triton is None:
        return "Triton is not installed (CUDA builds of torch ship it; otherwise pip install triton)"
    interpreted = _quantize_partitions_kernel.__class__.__name__ == "InterpretedFunction"
    if device_type == "cpu":
        if not interpreted:
            return ("on CPU tensors the fused kernels run only in Triton's interpreter, for tests: TRITON_INTERPRET=1 "
                    "must be set before deepspeed_qgz.qgz.quantized_fused is first imported")
        return None
    if device_type != "cuda":
        return f"the fused kernels run on CUDA devices (and on CPU under TRITON_INTERPRET=1), not on {device_type}"
    if interpreted:
        return "TRITON_INTERPRET=1 runs the fused kernels on the CPU: unset it for CUDA tensors"
    import deepspeed
    if not deepspeed.HAS_TRITON:
        return "deepspeed.HAS_TRITON is False (no Triton backend is active for this GPU, or ROCm)"
    return None


def _launch(kernel, grid, args, meta, reads=()):
    """One kernel launch over `grid` (programs per axis). `reads`: the tensors the kernel reads
    through a table of addresses rather than as arguments (the accounting counts them).

    Raises:
        ValueError: the grid is beyond CUDA's limits (GRID_LIMITS).
    """
    if any(size > limit for size, limit in zip(grid, GRID_LIMITS)):
        raise ValueError(f"{kernel.fn.__name__}: grid {tuple(grid)} is beyond CUDA's limits {GRID_LIMITS}")
    kernel[grid](*args, num_warps=NUM_WARPS, enable_fp_fusion=False, **meta)


if triton is not None:

    # ------------------------------------------------------------------------------------------
    # the arithmetic the stages share (straight-line: the kernels hold every loop). A program's
    # values are [8, VECS] tensors, one vector per column, so that each thread holds whole vectors
    # and what a vector shares (its group's statistics, its addresses) is held once per vector.
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _wide(x):
        """x as int64, whether an int32 tensor or a launch argument specialized to a constant."""
        return x + tl.full([], 0, tl.int64)

    @triton.jit
    def _lanes():
        """Each value's place in its vector, [8, 1]."""
        return tl.arange(0, 8)[:, None]

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
        """2**exponent as fp32, from its bits, for int32 exponents in [-149, 127] (subnormal below -126)."""
        normal = ((tl.maximum(exponent, -126) + 127) << 23).to(tl.float32, bitcast=True)
        tiny = (1 << tl.minimum(tl.maximum(exponent + 149, 0), 22)).to(tl.float32, bitcast=True)
        return tl.where(exponent >= -126, normal, tiny)

    @triton.jit
    def _times_power_of_two(x, exponent):
        """x * 2**exponent rounded once to fp32, for x zero or normal of magnitude in [2**-32, 2**14], any
        int32 exponent: x * 2**a is exact and normal for a in [-94, 112], and the second factor,
        2**(exponent - a) limited to fp32's powers, rounds once (overflowing, or flushing to zero,
        exactly where the exact product does)."""
        first = tl.minimum(tl.maximum(exponent, -94), 112)
        second = tl.minimum(tl.maximum(exponent - first, -149), 127)
        return (x * _power_of_two(first)) * _power_of_two(second)

    # x + ROUNDING for |x| < 2**22 is 1.5 * 2**23 plus x rounded to an integer (half to even): its
    # bits are ROUNDING_BITS plus that integer, whose low bits (a code's two's complement) they hold.
    ROUNDING = tl.constexpr(12582912.0)
    ROUNDING_BITS = tl.constexpr(0x4B400000)

    @triton.jit
    def _vector_extrema(values):
        """Per vector of fp32 `values` ([8, V]): the largest bit pattern as a signed and as an
        unsigned integer (the largest magnitude of a positive, of a negative value; zeros neutral)."""
        bits = values.to(tl.int32, bitcast=True)
        return tl.max(bits, axis=0), tl.max(bits.to(tl.uint32, bitcast=True), axis=0)

    @triton.jit
    def _signed_magnitudes(signed_max, unsigned_max):
        """From _vector_extrema's maxima: (the largest magnitude of a positive value, of a negative
        value), as int32 bits; 0 where there is none."""
        negative = (unsigned_max & 0x7FFFFFFF).to(tl.int32, bitcast=True)
        return tl.maximum(signed_max, 0), tl.where((unsigned_max >> 31) == 1, negative, 0)

    @triton.jit
    def _group_index(vectors, groups_here, ROWS: tl.constexpr, VPG_PAD: tl.constexpr):
        """For _group_max: row r of a program's groups (ROWS rows, the first `groups_here` real),
        column c: one of the group's `vectors` vectors (c, or c - vectors past them: VPG_PAD, the
        next power of two, is below twice the vectors, and a maximum takes repeats). Rows past the
        real ones repeat the last (never stored)."""
        rows = tl.minimum(tl.arange(0, ROWS), groups_here - 1)[:, None]
        columns = tl.arange(0, VPG_PAD)[None, :]
        columns = tl.where(columns < vectors, columns, columns - vectors)
        return tl.reshape(rows * vectors + columns, [ROWS * VPG_PAD])

    @triton.jit
    def _group_max(per_vector, index, ROWS: tl.constexpr, VPG_PAD: tl.constexpr):
        """Per group of a program: the largest of its vectors' values in `per_vector` ([VECS])."""
        return tl.max(tl.reshape(tl.gather(per_vector, index, 0), [ROWS, VPG_PAD]), axis=1)

    @triton.jit
    def _quantization(positive, negative, finite, RESCALE: tl.constexpr, BITS: tl.constexpr, fold_exponent):
        """A group's clamp-free quantization from its magnitudes (_signed_magnitudes): with
        `RESCALE` its values are multiplied by `factor`, the power of two bringing the largest
        into [0.5, 1), and rounded to fp16 (fp16 values are taken as they are; a group holding an
        inf or NaN is multiplied by 2**-126, so that no finite value of it overflows fp16); the
        kernels' scale 2**(BITS - 1) / largest (1 for a group of zeros) is negated where the
        largest magnitude is positive (its value then takes the smallest code exactly); `bound`
        clamps its codes to [-bound, bound - 1] (0 for a group holding an inf or NaN). Returns
        (signed scale, factor, bound, the scale the slot carries: the kernels' parameter 1 / scale
        times the fold 2**(own + fold_exponent), signed, 0 for zeros, NaN if not finite)."""
        positive = tl.where(finite, positive, 0)
        negative = tl.where(finite, negative, 0)
        absmax = tl.maximum(positive, negative)
        negate = positive > negative
        if RESCALE:
            own = _binary_exponent(absmax)
        else:
            own = tl.zeros_like(absmax)
        factor = _power_of_two(-own)
        largest = (absmax.to(tl.float32, bitcast=True) * factor).to(tl.float16).to(tl.float32)
        factor = tl.where(finite, factor, 2.0**-126)
        scale = tl.math.div_rn(tl.full(largest.shape, 2.0**(BITS - 1), tl.float32),
                               tl.where(largest == 0.0, 2.0**(BITS - 1), largest))
        param = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        fold = tl.where(absmax > 0, _times_power_of_two(param, own + fold_exponent), 0.0)
        carried = tl.where(finite, tl.where(negate, -fold, fold), float("nan"))
        bound = tl.where(finite, 2**(BITS - 1), 0)
        return tl.where(negate, -scale, scale), factor, bound, carried

    @triton.jit
    def _codes(values, factor, scale, bound, RESCALE: tl.constexpr):
        """The kernels' codes of fp32 `values` (broadcast with the per-group `factor`, `scale` and
        `bound`): with RESCALE the values times `factor`, rounded to fp16; times the scale, rounded
        half to even, clamped to [-bound, bound - 1]. Returned in the low bits of int32s
        (ROUNDING_BITS plus the code): an inf or NaN, only in a group whose bound is 0, is clamped
        like any other bit pattern."""
        if RESCALE:
            values = (values * factor).to(tl.float16).to(tl.float32)
        bits = (values * scale + ROUNDING).to(tl.int32, bitcast=True)
        return tl.maximum(tl.minimum(bits, ROUNDING_BITS + bound - 1), ROUNDING_BITS - bound)

    @triton.jit
    def _store_codes(out, start, codes, live, BITS: tl.constexpr, VECS: tl.constexpr):
        """Stores each vector's codes ([8, VECS], each in the low bits of an int32) from byte `start`
        ([VECS] int64, a multiple of BITS) of `out`: at 8 bits two words of four bytes, at 4 bits one
        word of eight nibbles, the first code in the high nibble of the first byte."""
        if BITS == 8:
            fields = tl.reshape(codes & 0xFF, [2, 4, VECS]) << (8 * tl.arange(0, 4)[None, :, None])
            words = (out + tl.multiple_of(start, 8)).to(tl.pointer_type(tl.int32))[None, :] + tl.arange(0, 2)[:, None]
            tl.store(words, tl.sum(fields, axis=1), mask=live[None, :])
        else:
            fields = (codes & 15) << (8 * (_lanes() // 2) + 4 - 4 * (_lanes() % 2))
            words = (out + tl.multiple_of(start, 4)).to(tl.pointer_type(tl.int32))
            tl.store(words, tl.sum(fields, axis=0), mask=live)

    @triton.jit
    def _nibbles(data, start, live):
        """Each vector's 8 int4 codes as their raw 4-bit patterns ([8, VECS] int32, the first code
        the high nibble of the first byte), from the word at byte `start` ([VECS] int64, a multiple
        of 4) of `data`; 0 where not live."""
        word = tl.load((data + tl.multiple_of(start, 4)).to(tl.pointer_type(tl.int32)), mask=live, other=0)
        return (word[None, :] >> (8 * (_lanes() // 2) + 4 - 4 * (_lanes() % 2))) & 15

    @triton.jit
    def _load_codes(data, start, live, BITS: tl.constexpr):
        """Each vector's 8 codes as fp32 values ([8, VECS]), from byte `start` ([VECS] int64) of
        `data`: the code plus an offset made positive, under 2**23's exponent, minus both."""
        if BITS == 8:
            words = (data + tl.multiple_of(start, 8)).to(tl.pointer_type(tl.int32))[None, :] + tl.arange(0, 2)[:, None]
            words = tl.load(words, mask=live[None, :], other=0)  # [2, VECS]
            biased = ((words[:, None, :] >> (8 * tl.arange(0, 4)[None, :, None])) & 0xFF) ^ 0x80
            return (tl.reshape(biased, [8, biased.shape[2]]) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        else:
            return ((_nibbles(data, start, live) ^ 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0

    @triton.jit
    def _fold_scales(largest, finite, scales, live_rows):
        """`largest` (the int32 bits of the largest finite magnitude so far) and `finite` (every
        scale so far finite) with the rows' fp32 scales at `scales` folded in: one step of the scan
        over the copies of each row's scale (the node's copies in stage 1, the nodes' sums in stage 2)."""
        magnitude = tl.load(scales.to(tl.pointer_type(tl.int32)), mask=live_rows, other=0) & 0x7FFFFFFF
        ok = magnitude < 0x7F800000
        return tl.maximum(largest, tl.where(ok, magnitude, 0)), finite & ok

    @triton.jit
    def _zero_bytes(out, start, stop, BLOCK: tl.constexpr):
        """Zeros bytes [start, stop) of `out`, at most BLOCK of them."""
        lanes = start + tl.arange(0, BLOCK)
        tl.store(out + lanes, tl.zeros([BLOCK], dtype=tl.int8), mask=lanes < stop)

    @triton.jit
    def _program_rows(v, row_magic, vectors, first, per_program, groups, ONE_STEP: tl.constexpr):
        """Each vector's group in the program and place in its group, and whether it is live."""
        if ONE_STEP:
            row = (v * row_magic) >> 20
            column = v - row * vectors
        else:
            row = v * 0
            column = v
        return row, column, (row < per_program) & (first + row < groups)

    # ------------------------------------------------------------------------------------------
    # stage 0
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _group_source(pointers, tensor_table, group_tensor, partition, group, live, group_elems,
                      ELEM_BYTES: tl.constexpr):
        """Where a group of a partition lies in its gradient: (the address of its first element,
        int64; how many of its values exist there, the rest being padding)."""
        tensor = _wide(tl.load(group_tensor + group, mask=live, other=0))
        numel = tl.load(tensor_table + 3 * tensor, mask=live, other=0)
        chunk = tl.load(tensor_table + 3 * tensor + 1, mask=live, other=0)
        first_group = tl.load(tensor_table + 3 * tensor + 2, mask=live, other=0)
        base = tl.load(pointers + tensor, mask=live, other=0)
        within = (_wide(group) - first_group) * group_elems
        start = _wide(partition) * chunk + within
        count = tl.minimum(tl.minimum(chunk - within, numel - start), group_elems)
        return base + start * ELEM_BYTES, tl.maximum(count, 0).to(tl.int32)

    @triton.jit
    def _load_values(address, count, live, DTYPE: tl.constexpr):
        """Each vector's 8 values as fp32 ([8, VECS]) from byte `address` ([VECS] int64) of its
        gradient, the first `count` ([VECS]) of them, zeros after. A gradient's partitions start
        anywhere, so the loads are of single values (declared so: Triton would otherwise spread a
        vector's values over threads); bf16 is read as its bits and widened on them."""
        mask = live[None, :] & (_lanes() < count[None, :])
        if DTYPE == 0:
            pointer = address.to(tl.pointer_type(tl.float16))[None, :] + _lanes()
            pointer = tl.max_contiguous(tl.multiple_of(pointer, [1, 1]), [1, 1])
            return tl.load(pointer, mask=mask, other=0.0).to(tl.float32)
        elif DTYPE == 1:
            pointer = address.to(tl.pointer_type(tl.int16))[None, :] + _lanes()
            pointer = tl.max_contiguous(tl.multiple_of(pointer, [1, 1]), [1, 1])
            return (tl.load(pointer, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            pointer = address.to(tl.pointer_type(tl.float32))[None, :] + _lanes()
            pointer = tl.max_contiguous(tl.multiple_of(pointer, [1, 1]), [1, 1])
            return tl.load(pointer, mask=mask, other=0.0)

    @triton.jit(do_not_specialize=[
        "groups", "group_elems", "slot_bytes", "tiles", "tiles_magic", "tiles_shift", "per_program", "row_magic"
    ])
    def _quantize_partitions_kernel(pointers, tensor_table, group_tensor, slot_of, slots, groups, group_elems,
                                    slot_bytes, tiles, tiles_magic, tiles_shift, per_program, row_magic,
                                    DTYPE: tl.constexpr, ELEM_BYTES: tl.constexpr, BITS: tl.constexpr,
                                    ROWS: tl.constexpr, VPG_PAD: tl.constexpr, VECS: tl.constexpr,
                                    ONE_STEP: tl.constexpr):
        """Program (partition, tile of `per_program` groups): those groups of the partition's
        intra slot, and the slot's scales; the partition's last tile zeros the slot's tail."""
        pid = tl.program_id(0)
        partition = ((_wide(pid) * tiles_magic) >> tiles_shift).to(tl.int32)  # pid // tiles
        tile = pid - partition * tiles
        first = tile * per_program
        slot_start = _wide(tl.load(slot_of + partition)) * slot_bytes
        group_bytes = group_elems * BITS // 8
        scales = slot_start + _wide(groups) * group_bytes
        vectors = group_elems // 8
        rows = tl.arange(0, ROWS)
        live_rows = (rows < per_program) & (first + rows < groups)
        address, count = _group_source(pointers, tensor_table, group_tensor, partition, first + rows, live_rows,
                                       group_elems, ELEM_BYTES)
        v = tl.arange(0, VECS)
        row, column, live = _program_rows(v, row_magic, vectors, first, per_program, groups, ONE_STEP)
        vector_address = tl.gather(address, row, 0)
        vector_count = tl.gather(count, row, 0)
        if ONE_STEP:
            values = _load_values(vector_address + _wide(column) * 8 * ELEM_BYTES, vector_count - column * 8, live,
                                  DTYPE)
            signed_max, unsigned_max = _vector_extrema(values)
            index = _group_index(vectors, per_program, ROWS, VPG_PAD)
            positive, negative = _signed_magnitudes(_group_max(signed_max, index, ROWS, VPG_PAD),
                                                    _group_max(unsigned_max, index, ROWS, VPG_PAD))
        else:
            signed_max = tl.zeros([VECS], dtype=tl.int32)
            unsigned_max = tl.zeros([VECS], dtype=tl.uint32)
            for step in tl.range(0, vectors, VECS, loop_unroll_factor=1):  # trips: -(-group_elems // (8 * VECS))
                vector = step + column
                values = _load_values(vector_address + _wide(vector) * 8 * ELEM_BYTES, vector_count - vector * 8,
                                      live & (vector < vectors), DTYPE)
                step_signed, step_unsigned = _vector_extrema(values)
                signed_max = tl.maximum(signed_max, step_signed)
                unsigned_max = tl.maximum(unsigned_max, step_unsigned)
            positive, negative = _signed_magnitudes(tl.max(signed_max, 0, keep_dims=True),
                                                    tl.max(unsigned_max, 0, keep_dims=True))
        finite = tl.maximum(positive, negative) < 0x7F800000
        scale, factor, bound, carried = _quantization(positive, negative, finite, DTYPE != 0, BITS, 0)
        tl.store((slots + scales + 4 * _wide(first + rows)).to(tl.pointer_type(tl.float32)), carried, mask=live_rows)
        vector_factor = tl.gather(factor, row, 0)[None, :]
        vector_scale = tl.gather(scale, row, 0)[None, :]
        vector_bound = tl.gather(bound, row, 0)[None, :]
        code_start = slot_start + _wide(first + row) * group_bytes
        if ONE_STEP:
            codes = _codes(values, vector_factor, vector_scale, vector_bound, DTYPE != 0)
            _store_codes(slots, code_start + column * BITS, codes, live, BITS, VECS)
        else:
            for step in tl.range(0, vectors, VECS, loop_unroll_factor=1):  # trips: -(-group_elems // (8 * VECS))
                vector = step + column
                inside = live & (vector < vectors)
                values = _load_values(vector_address + _wide(vector) * 8 * ELEM_BYTES, vector_count - vector * 8,
                                      inside, DTYPE)
                codes = _codes(values, vector_factor, vector_scale, vector_bound, DTYPE != 0)
                _store_codes(slots, code_start + vector * BITS, codes, inside, BITS, VECS)
        if tile == tiles - 1:
            tail = scales + 4 * _wide(groups)
            # trips: (slot_bytes - groups * (group_elems * BITS // 8 + 4)) / 4096 / tiles
            for start in tl.range(tail, slot_start + slot_bytes, 4096, loop_unroll_factor=1):
                _zero_bytes(slots, start, slot_start + slot_bytes, 4096)

    # ------------------------------------------------------------------------------------------
    # stage 1
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _node_values(codes, normalized, acc_hi, acc_lo, IN_BITS: tl.constexpr):
        """Adds one copy's values fp16(codes * normalized) to the node's sums: at 8 bits exactly,
        into two fp32 accumulators (each value below 64 split at 2**-16: the parts' sums over any
        number of copies below 2**17 stay on 24 bits); at 4 bits as quantized_reduction does, an
        fp16 sum in copy order (acc_hi; acc_lo unused)."""
        values = (codes * normalized).to(tl.float16)
        if IN_BITS == 8:
            values = values.to(tl.float32)
            high = (values + 192.0) - 192.0
            return acc_hi + high, acc_lo + (values - high)
        else:
            return acc_hi + values, acc_lo

    @triton.jit
    def _requantization(positive, negative, finite, fold_exponent, IN_BITS: tl.constexpr):
        """The node sums' int4 quantization from their magnitudes: at 8 bits the glue's clamp-free
        one (_quantization); at 4 bits quantized_reduction's formula (scale 8 / largest, no
        negation, the fold 2**fold_exponent, 0 for a group of zeros). Returns (signed scale,
        factor, bound, carried scale)."""
        if IN_BITS == 8:
            return _quantization(positive, negative, finite, True, 4, fold_exponent)
        else:
            absmax = tl.where(finite, tl.maximum(positive, negative), 0).to(tl.float32, bitcast=True)
            scale = tl.math.div_rn(tl.full(absmax.shape, 8.0, tl.float32), tl.where(absmax == 0.0, 8.0, absmax))
            param = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
            # 0 where param >= 1 (no fold): the product is taken of 0 there, which cannot overflow
            fold = _times_power_of_two(tl.where(param < 1.0, param, 0.0), fold_exponent)
            carried = tl.where(finite, fold, float("nan"))
            return scale, tl.full(scale.shape, 1.0, tl.float32), tl.where(finite, 8, 0), carried

    @triton.jit
    def _node_accumulators(IN_BITS: tl.constexpr, VECS: tl.constexpr):
        """The accumulators of _node_values, zero."""
        if IN_BITS == 8:
            acc_hi = tl.zeros([8, VECS], dtype=tl.float32)
        else:
            acc_hi = tl.zeros([8, VECS], dtype=tl.float16)
        return acc_hi, tl.zeros([8, VECS], dtype=tl.float32)

    @triton.jit
    def _add_copy(received, offset, vector_scales, vector_down, vector_finite, code_start, live, acc_hi, acc_lo,
                  IN_BITS: tl.constexpr):
        """_node_values of the copy `offset` bytes into `received` (its scales and codes)."""
        scale = tl.load((vector_scales + offset).to(tl.pointer_type(tl.float32)), mask=live, other=0.0)
        normalized = tl.where(vector_finite, scale * vector_down, 0.0)
        return _node_values(_load_codes(received + offset, code_start, live, IN_BITS), normalized[None, :], acc_hi,
                            acc_lo, IN_BITS)

    @triton.jit(do_not_specialize=[
        "groups", "group_elems", "in_slot_bytes", "out_slot_bytes", "copy_stride", "copies", "summing", "shift",
        "tiles", "tiles_magic", "tiles_shift", "per_program", "row_magic"
    ])
    def _reduce_within_node_kernel(received, out, groups, group_elems, in_slot_bytes, out_slot_bytes, copy_stride,
                                   copies, summing, shift, tiles, tiles_magic, tiles_shift, per_program, row_magic,
                                   IN_BITS: tl.constexpr, ROWS: tl.constexpr, VPG_PAD: tl.constexpr,
                                   VECS: tl.constexpr, ONE_STEP: tl.constexpr):
        """Program (node, tile of `per_program` groups): the node's sums of those groups of this
        rank's partition, as int4 in the node's inter slot; the node's last tile zeros its tail."""
        pid = tl.program_id(0)
        node = ((_wide(pid) * tiles_magic) >> tiles_shift).to(tl.int32)  # pid // tiles
        tile = pid - node * tiles
        first = tile * per_program
        in_start = _wide(node) * in_slot_bytes
        in_group_bytes = group_elems * IN_BITS // 8
        in_scales = in_start + _wide(groups) * in_group_bytes
        out_start = _wide(node) * out_slot_bytes
        out_group_bytes = group_elems // 2
        out_scales = out_start + _wide(groups) * out_group_bytes
        vectors = group_elems // 8
        rows = tl.arange(0, ROWS)
        live_rows = (rows < per_program) & (first + rows < groups)
        row_scales = received + in_scales + 4 * _wide(first + rows)
        # the summing exponent: every copy's scale below 2**-summing after it
        largest = rows * 0
        finite = live_rows | ~live_rows
        for copy in tl.range(0, copies, loop_unroll_factor=1):  # trips: copies
            largest, finite = _fold_scales(largest, finite, row_scales + _wide(copy) * copy_stride, live_rows)
        exponent = tl.where(finite, _binary_exponent(largest), 0) + summing
        v = tl.arange(0, VECS)
        row, column, live = _program_rows(v, row_magic, vectors, first, per_program, groups, ONE_STEP)
        vector_down = tl.gather(_power_of_two(-exponent), row, 0)
        vector_finite = tl.gather(finite.to(tl.int32), row, 0) != 0
        vector_scales = received + in_scales + 4 * _wide(first + row)
        code_start = in_start + _wide(first + row) * in_group_bytes
        if ONE_STEP:
            acc_hi, acc_lo = _node_accumulators(IN_BITS, VECS)
            for copy in tl.range(0, copies, loop_unroll_factor=1):  # trips: copies
                acc_hi, acc_lo = _add_copy(received,
                                           _wide(copy) * copy_stride, vector_scales, vector_down, vector_finite,
                                           code_start + column * IN_BITS, live, acc_hi, acc_lo, IN_BITS)
            sums = acc_hi.to(tl.float32) + acc_lo  # at 8 bits the exact sums rounded once
            signed_max, unsigned_max = _vector_extrema(sums)
            index = _group_index(vectors, per_program, ROWS, VPG_PAD)
            positive, negative = _signed_magnitudes(_group_max(signed_max, index, ROWS, VPG_PAD),
                                                    _group_max(unsigned_max, index, ROWS, VPG_PAD))
        else:
            signed_max = tl.zeros([VECS], dtype=tl.int32)
            unsigned_max = tl.zeros([VECS], dtype=tl.uint32)
            for step in tl.range(0, vectors, VECS, loop_unroll_factor=1):  # trips: -(-group_elems // (8 * VECS))
                vector = step + column
                inside = live & (vector < vectors)
                acc_hi, acc_lo = _node_accumulators(IN_BITS, VECS)
                for copy in tl.range(0, copies, loop_unroll_factor=1):  # trips: copies
                    acc_hi, acc_lo = _add_copy(received,
                                               _wide(copy) * copy_stride, vector_scales, vector_down, vector_finite,
                                               code_start + vector * IN_BITS, inside, acc_hi, acc_lo, IN_BITS)
                step_signed, step_unsigned = _vector_extrema(acc_hi.to(tl.float32) + acc_lo)
                signed_max = tl.maximum(signed_max, step_signed)
                unsigned_max = tl.maximum(unsigned_max, step_unsigned)
            positive, negative = _signed_magnitudes(tl.max(signed_max, 0, keep_dims=True),
                                                    tl.max(unsigned_max, 0, keep_dims=True))
        scale, factor, bound, carried = _requantization(positive, negative, finite, exponent - shift, IN_BITS)
        tl.store((out + out_scales + 4 * _wide(first + rows)).to(tl.pointer_type(tl.float32)), carried, mask=live_rows)
        vector_factor = tl.gather(factor, row, 0)[None, :]
        vector_scale = tl.gather(scale, row, 0)[None, :]
        vector_bound = tl.gather(bound, row, 0)[None, :]
        out_codes = out_start + _wide(first + row) * out_group_bytes
        if ONE_STEP:
            codes = _codes(sums, vector_factor, vector_scale, vector_bound, IN_BITS == 8)
            _store_codes(out, out_codes + column * 4, codes, live, 4, VECS)
        else:
            for step in tl.range(0, vectors, VECS, loop_unroll_factor=1):  # trips: -(-group_elems // (8 * VECS))
                vector = step + column
                inside = live & (vector < vectors)
                acc_hi, acc_lo = _node_accumulators(IN_BITS, VECS)
                for copy in tl.range(0, copies, loop_unroll_factor=1):  # trips: copies
                    acc_hi, acc_lo = _add_copy(received,
                                               _wide(copy) * copy_stride, vector_scales, vector_down, vector_finite,
                                               code_start + vector * IN_BITS, inside, acc_hi, acc_lo, IN_BITS)
                codes = _codes(acc_hi.to(tl.float32) + acc_lo, vector_factor, vector_scale, vector_bound, IN_BITS == 8)
                _store_codes(out, out_codes + vector * 4, codes, inside, 4, VECS)
        if tile == tiles - 1:
            tail = out_scales + 4 * _wide(groups)
            # trips: (out_slot_bytes - groups * (group_elems // 2 + 4)) / 4096 / tiles
            for start in tl.range(tail, out_start + out_slot_bytes, 4096, loop_unroll_factor=1):
                _zero_bytes(out, start, out_start + out_slot_bytes, 4096)

    # ------------------------------------------------------------------------------------------
    # stage 2
    # ------------------------------------------------------------------------------------------

    @triton.jit
    def _dequantized_table(normalized, DTYPE: tl.constexpr, WIDE: tl.constexpr):
        """Per group (rows of `normalized`, its fp32 parameters): what each raw int4 pattern (0..15,
        two's complement) dequantizes to, fp16(code * parameter), in units of 2**-24 (exact), int64
        if WIDE; fp16 values past the dtype's largest (one node of fp16 gradients) limited to it,
        which the result's saturation would make of them."""
        patterns = tl.arange(0, 16)
        codes = ((patterns ^ 8) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        products = codes[None, :] * normalized[:, None]
        if DTYPE == 0:
            products = tl.minimum(tl.maximum(products, -65504.0), 65504.0)
        units = products.to(tl.float16).to(tl.float32) * 16777216.0
        if WIDE:
            return units.to(tl.int64)
        else:
            return units.to(tl.int32)

    @triton.jit
    def _average(sums, factor, restore, limit, finite, DTYPE: tl.constexpr):
        """The result in the gradients' dtype from the exact sums (integers in units of 2**-24):
        fp16 the sums rounded to fp32, then to fp16; bf16 and fp32 the sums times `factor` in fp64
        (the reference's rounding), then to fp32, within +-`limit` and times `restore` (a power of
        two: `limit` times it is fp32's largest value), then (bf16) to nearest even on the bits.
        Saturated at the dtype's largest value; NaN where a node's scale is not `finite`. Returns
        the bits, as int32 whatever the dtype (one type on every branch)."""
        if DTYPE == 0:
            value = sums.to(tl.float32) * 5.9604644775390625e-08
            value = tl.where(finite, tl.minimum(tl.maximum(value, -limit), limit), float("nan"))
            bits = value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        else:
            value = (sums.to(tl.float64) * factor).to(tl.float32)
            bits = (tl.minimum(tl.maximum(value, -limit), limit) * restore).to(tl.int32, bitcast=True)
            if DTYPE == 2:
                bits = tl.where(finite, bits, 0x7FC00000)
            else:
                rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
                # the values just below fp32's largest round up to bf16's infinity: its largest value
                rounded = tl.where((rounded & 0x7FFF) == 0x7F80, rounded - 1, rounded)
                bits = tl.where(finite, rounded, 0x7FC0)
        return bits

    @triton.jit
    def _store_result(out, start, bits, live, DTYPE: tl.constexpr, VECS: tl.constexpr):
        """Stores each vector's 8 results (bits, [8, VECS] int32) from element `start` ([VECS] int64,
        a multiple of 8) of `out` (the result viewed as int32 words): two 2-byte values to a word."""
        if DTYPE == 2:
            tl.store(out + tl.multiple_of(start, 8)[None, :] + _lanes(), bits, mask=live[None, :])
        else:
            pairs = tl.reshape(bits & 0xFFFF, [4, 2, VECS]) << (16 * tl.arange(0, 2)[None, :, None])
            words = out + tl.multiple_of(start // 2, 4)[None, :] + tl.arange(0, 4)[:, None]
            tl.store(words, tl.sum(pairs, axis=1), mask=live[None, :])

    @triton.jit(do_not_specialize=[
        "groups", "group_elems", "slot_bytes", "num_nodes", "world", "shift", "per_program", "row_magic"
    ])
    def _average_across_nodes_kernel(received, out, groups, group_elems, slot_bytes, num_nodes, world, shift,
                                     per_program, row_magic, DTYPE: tl.constexpr, WIDE: tl.constexpr,
                                     ROWS: tl.constexpr, VPG_PAD: tl.constexpr, VECS: tl.constexpr,
                                     ONE_STEP: tl.constexpr):
        """Program (tile of `per_program` groups): those groups of this rank's padded partition of
        the average."""
        first = tl.program_id(0) * per_program
        group_bytes = group_elems // 2
        scales = _wide(groups) * group_bytes
        vectors = group_elems // 8
        world_size = _wide(world).to(tl.float32)
        rows = tl.arange(0, ROWS)
        live_rows = (rows < per_program) & (first + rows < groups)
        row_scales = received + scales + 4 * _wide(first + rows)
        # the nodes' scales: the largest finite magnitude, and whether all are finite
        largest = rows * 0
        finite = live_rows | ~live_rows
        for node in tl.range(0, num_nodes, loop_unroll_factor=1):  # trips: num_nodes
            largest, finite = _fold_scales(largest, finite, row_scales + _wide(node) * slot_bytes, live_rows)
        if DTYPE != 0:
            # the scales brought near 1 by a power of two; the factor it leaves, over the world, in
            # units of 2**-24 (fp16: each scale over the world instead). Where the average could
            # pass fp32's range the fp64 product is taken 2**-64 smaller, rounded to fp32 and
            # multiplied back, so that no narrowing conversion overflows (the values stay normal).
            exponent = _binary_exponent(largest)
            down = _power_of_two(-exponent)
            beyond = tl.where(exponent > 64, 64, 0)
            factor = tl.math.div_rn(_power_of_two(exponent),
                                    tl.zeros_like(down) + world_size).to(tl.float64) * (
                                        (_wide(shift - beyond) + (1023 - 24)) << 52).to(tl.float64, bitcast=True)
            restore = _power_of_two(beyond)
            limit = tl.where(beyond > 0, 3.4028234663852886e38 / 18446744073709551616.0, 3.4028234663852886e38)
        v = tl.arange(0, VECS)
        row, column, live = _program_rows(v, row_magic, vectors, first, per_program, groups, ONE_STEP)
        vector_finite = tl.gather(finite.to(tl.int32), row, 0)[None, :] != 0
        if DTYPE != 0:
            vector_factor = tl.gather(factor, row, 0)[None, :]
            vector_restore = tl.gather(restore, row, 0)[None, :]
            vector_limit = tl.gather(limit, row, 0)[None, :]
        if ONE_STEP:
            steps = 1
        else:
            steps = tl.cdiv(vectors, VECS)  # (Triton's integer // truncates toward zero: no -(-a // b))
        # trips: 1 if ONE_STEP else -(-group_elems // (8 * VECS))
        for step in tl.range(0, steps, loop_unroll_factor=1):
            vector = step * VECS + column
            inside = live & (vector < vectors)
            code_start = _wide(first + row) * group_bytes + vector * 4
            if WIDE:
                sums = tl.zeros([8, VECS], dtype=tl.int64)
            else:
                sums = tl.zeros([8, VECS], dtype=tl.int32)
            for node in tl.range(0, num_nodes, loop_unroll_factor=1):  # trips: num_nodes
                offset = _wide(node) * slot_bytes
                scale = tl.load((row_scales + offset).to(tl.pointer_type(tl.float32)), mask=live_rows, other=0.0)
                if DTYPE == 0:
                    normalized = tl.math.div_rn(scale, tl.zeros_like(scale) + world_size) * _power_of_two(shift)
                else:
                    normalized = scale * down
                table = tl.reshape(_dequantized_table(tl.where(finite, normalized, 0.0), DTYPE, WIDE), [ROWS * 16])
                index = row[None, :] * 16 + _nibbles(received + offset, code_start, inside)
                sums += tl.reshape(tl.gather(table, tl.reshape(index, [8 * VECS]), 0), [8, VECS])
            if DTYPE == 0:
                bits = _average(sums, 0.0, 1.0, 65504.0, vector_finite, DTYPE)
            else:
                bits = _average(sums, vector_factor, vector_restore, vector_limit, vector_finite, DTYPE)
            _store_result(out, _wide(first + row) * group_elems + vector * 8, bits, inside, DTYPE, VECS)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _tensor_tables(layout: QuantizedReduceLayout, device: str):
    """(per tensor [numel, partition, first group] int64, per group of a padded partition its
    tensor int32, per partition its intra slot int32 (qgz_contract.swizzle_slot)), on `device`;
    cached per layout."""
    table = [[t.numel, t.partition, t.offset // layout.group_elems] for t in layout.tensors]
    owners = torch.repeat_interleave(torch.arange(len(layout.tensors), dtype=torch.int32),
                                     torch.tensor([t.num_groups for t in layout.tensors]))
    slots = [swizzle_slot(p, layout.num_nodes, layout.local_world_size) for p in range(layout.world_size)]
    return (torch.tensor(table, dtype=torch.int64,
                         device=device), owners.to(device), torch.tensor(slots, dtype=torch.int32, device=device))


def division_magic(divisor: int):
    """(magic, shift) with (n * magic) >> shift == n // divisor for every n < 2**31 (Granlund and
    Montgomery's round-up method, 31-bit dividends: magic = ceil(2**(31 + s) / divisor), s the bits
    of divisor - 1, below 2**32)."""
    bits = (divisor - 1).bit_length()
    return -(-(1 << (31 + bits)) // divisor), 31 + bits


def _tile_meta(shape: TileShape) -> dict:
    return dict(ROWS=shape.rows, VPG_PAD=shape.vectors_pad, VECS=TILE_VECTORS, ONE_STEP=shape.one_step)


def quantize_partitions(tensors: List[Tensor], layout: QuantizedReduceLayout) -> Tensor:
    """Stage 0 in one launch: quantized_pipeline.quantize_partitions's slots, read from the
    gradients where they lie."""
    fmt, world = layout.intra, layout.world_size
    device, dtype = tensors[0].device, tensors[0].dtype
    tensors = [t.contiguous() for t in tensors]
    table, owners, slot_of = _tensor_tables(layout, str(device))
    # the gradients' addresses: one asynchronous host-to-device copy from pinned memory per call, no
    # host synchronization (a copy on CPU too, so the accounting counts the same op)
    addresses = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, pin_memory=device.type == "cuda")
    pointers = addresses.to(device, non_blocking=True, copy=True)
    slots = torch.empty(world, fmt.slot_bytes, dtype=torch.int8, device=device)
    shape = tile_shape(layout.group_elems)
    tiles = -(-fmt.groups_per_partition // shape.groups)
    _launch(_quantize_partitions_kernel, (world * tiles, ),
            (pointers, table, owners, slot_of, slots, fmt.groups_per_partition, layout.group_elems, fmt.slot_bytes,
             tiles, *division_magic(tiles), shape.groups, shape.row_magic),
            dict(DTYPE=DTYPE_CODES[dtype], ELEM_BYTES=tensors[0].element_size(), BITS=fmt.bits, **_tile_meta(shape)),
            reads=tensors)
    return slots


# Stages 1 and 2 read the received slots as int32 words (vectorized where the words are known to be
# aligned), and Triton specializes a pointer argument on whether it is 16-byte aligned: a received view
# starting elsewhere would read misaligned words or run another compiled variant than the one the
# self-check ran. The launchers' own outputs are fresh allocations, aligned.
RECEIVED_ALIGNMENT = 16


def _check_received(received: Tensor, slots: int, slot_bytes: int, stage: str) -> None:
    """Raises ValueError, naming the values, unless `received` is a contiguous int8 tensor of `slots`
    slots of `slot_bytes` bytes starting on a RECEIVED_ALIGNMENT-byte boundary."""
    address = received.data_ptr()
    if (received.dtype != torch.int8 or received.numel() != slots * slot_bytes or not received.is_contiguous()
            or address % RECEIVED_ALIGNMENT):
        raise ValueError(
            f"{stage}: received must be a contiguous int8 tensor of {slots} x {slot_bytes} bytes starting "
            f"on a {RECEIVED_ALIGNMENT}-byte boundary, got {received.dtype} of shape "
            f"{tuple(received.shape)}, strides {received.stride()}, at an address "
            f"{address % RECEIVED_ALIGNMENT} bytes past one")


def reduce_within_node(received: Tensor, layout: QuantizedReduceLayout) -> Tensor:
    """Stage 1 in one launch: quantized_pipeline.reduce_within_node's slots.

    Raises:
        ValueError: `received` is not the intra slots of the layout's world (_check_received).
    """
    intra, inter = layout.intra, layout.inter
    _check_received(received, layout.world_size, intra.slot_bytes, "reduce_within_node")
    out = torch.empty(layout.num_nodes, inter.slot_bytes, dtype=torch.int8, device=received.device)
    shape = tile_shape(layout.group_elems)
    tiles = -(-intra.groups_per_partition // shape.groups)
    _launch(_reduce_within_node_kernel, (layout.num_nodes * tiles, ),
            (received, out, intra.groups_per_partition, layout.group_elems, intra.slot_bytes, inter.slot_bytes,
             layout.num_nodes * intra.slot_bytes, layout.local_world_size, summing_bits(layout.local_world_size),
             layout.inter_scale_shift, tiles, *division_magic(tiles), shape.groups, shape.row_magic),
            dict(IN_BITS=intra.bits, **_tile_meta(shape)))
    return out


# Stage 2 adds each value's nodes in units of 2**-24, int32 where no sum can leave int32's range for any
# finite scales the slots hold, int64 elsewhere. A bf16 or fp32 node's table entry is fp16(code *
# normalized), |code| <= 8, normalized the scale times 2**-e (e the largest finite scale's binary
# exponent, clamped at 126, as the reference does): below 4 for any finite fp32 scale, so an entry is
# at most 32 = 2**29 units, and 3 nodes' sum (3 * 2**29) fits in int32 where 4 nodes' (2**31) may not.
# (The node sums stage 1 writes keep normalized below 2, entries at most 16 = 2**28 units: 8 nodes of
# +16 or 9 of -16 already wrap.) fp16 values reach 65504 and take int64 at any node count.
NARROW_SUM_NODES = 3


def average_across_nodes(received: Tensor, layout: QuantizedReduceLayout, dtype: torch.dtype) -> Tensor:
    """Stage 2 in one launch: quantized_pipeline.average_across_nodes's padded partition.

    Raises:
        ValueError: `received` is not the inter slots of the layout's nodes (_check_received).
    """
    fmt = layout.inter
    _check_received(received, layout.num_nodes, fmt.slot_bytes, "average_across_nodes")
    average = torch.empty(layout.padded_partition, dtype=dtype, device=received.device)
    shape = tile_shape(layout.group_elems)
    wide = dtype == torch.float16 or layout.num_nodes > NARROW_SUM_NODES
    _launch(_average_across_nodes_kernel, (-(-fmt.groups_per_partition // shape.groups), ),
            (received, average.view(torch.int32), fmt.groups_per_partition, layout.group_elems, fmt.slot_bytes,
             layout.num_nodes, layout.world_size, layout.inter_scale_shift, shape.groups, shape.row_magic),
            dict(DTYPE=DTYPE_CODES[dtype], WIDE=wide, **_tile_meta(shape)))
    return average

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
DeepSpeed's quantizer op as Triton kernels: ``quantize``, ``swizzle_quant``, ``quantized_reduction``,
``dequantize`` and ``dequantize_fp32``, with the CUDA binding's signatures, output shapes and
dtypes (but ``quantize``'s scales, flat as the CPU op's), giving bit for bit what
deepspeed_qgz/qgz/qgz_reference.py states the CUDA kernels compute, for every call deepspeed_qgz/qgz/qgz_contract.py allows them (symmetric quantization: the only kind
qgZ and qwZ use). It reaches DeepSpeed's code through the package's one seam
(``_finder.plug_in_quantizer``): with ``DS_QGZ_QUANTIZER=triton`` the quantizer op qgZ's
``coalesced_collectives`` and qwZ's ``CUDAQuantizer`` cache is this one, so the series'
``all_to_all_quant_reduce`` runs these kernels unchanged.

What it changes against DeepSpeed's CUDA op: nothing to build with nvcc (Triton compiles the kernels
when first launched); divisions rounded as IEEE defines them and fp32 subnormals kept (the CUDA op
is built with ``--use_fast_math``, whose divisions may differ in the last bit of a scale and which
flushes fp32 subnormals to zero: docs/numerics.md says when that shows); statistics reduced over
whole tiles, never over lanes that do not exist. What it does not change: one launch per call, the
bytes each call writes and, for groups of at most 4096 values, reads (a larger group is read twice,
below), and the calls it accepts (the contract's, so that what runs here runs on the CUDA op too). Its
outputs have the CUDA binding's shapes, sized from the input's last dimension, and a call whose
output would not hold exactly what its kernel writes is refused before anything is allocated or
launched (qgz_contract.output_violations: a 4-bit ``quantize`` of an odd last dimension, a
``quantized_reduction`` whose last dimension the node's devices do not divide), where the CUDA op
writes past its output's end. Whether it is faster or slower on a GPU has not been measured.

Geometry: a program of 8 warps holds a tile of ``ROWS`` whole groups of ``BLOCK`` lanes (``BLOCK`` the
power of two at least the group, ``ROWS * BLOCK = TILE``, 16 values a thread) and reduces each group's
statistics, or loads its parameter, once; a group of more than ``TILE`` values takes one program,
which reads it in steps of ``TILE`` values twice, once for its statistics and once to quantize it
(quantized_reduction recomputes its sums then). Programs lie on grid axis 0. Every loop is left
rolled (``loop_unroll_factor=1``) and notes its trips for benchmarks/qgz_roofline.py.

Rounding: codes are rounded by adding 1.5 * 2**23 and reading the integer off the sum's bits (half to
even, no float-to-int conversion of a NaN); every launch passes ``enable_fp_fusion=False``, since a
contracted ``x * scale + 1.5 * 2**23`` would round once instead of twice.

Self-check: the first call of each compiled variant in a process (at least what Triton compiles a
binary for: the kernel, its constexprs, which integer arguments are 1 or multiples of 16 and which
pointers are 16-byte aligned) is compared, bit for bit, with qgz_reference on that call's own inputs; a
difference, or the kernel or the reference raising, raises RuntimeError naming the op, the variant
and the first value that differs, and nothing falls back. With torch.distributed initialized it
raises on every rank at that call, naming the rank (``_checked_call`` says how). It costs the
reference's run once per call size, on the call's device (on the largest exchange the series stages,
2**27 values, a few GB for the moment it runs), and a launch for each other alignment of the call's
inputs (two or four launches in all; one in Triton's interpreter, which compiles no variants).

On CPU tensors the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1`` before Triton is
first imported), which is how the tests run them.
"""

import itertools
import math
from typing import Optional

import torch

from deepspeed_qgz.qgz import qgz_contract as contract
from deepspeed_qgz.qgz import qgz_reference as reference

try:
    import triton
    import triton.language as tl
except ImportError:  # unavailable_reason says so
    triton = None

Symmetric = contract.SYMMETRIC
Asymmetric = contract.ASYMMETRIC

# Values a program holds at once.
TILE = 4096
NUM_WARPS = 8
# The most programs a launch may put on grid axis 0 (CUDA C++ Programming Guide, "Features and
# Technical Specifications": maximum x-dimension of a grid of thread blocks).
GRID_LIMIT = 2**31 - 1


def unavailable_reason(device_type: str) -> Optional[str]:
    """Why the kernels cannot run on `device_type` tensors in this process, or None if they can."""
    if triton is None:
        return "Triton is not installed (CUDA builds of torch ship it; otherwise pip install triton)"
    interpreted = _quantize_kernel.__class__.__name__ == "InterpretedFunction"
    if device_type == "cpu":
        return None if interpreted else ("on CPU tensors the Triton kernels run only in Triton's interpreter: "
                                         "TRITON_INTERPRET=1 must be set before Triton is first imported")
    if device_type != "cuda":
        return f"the Triton kernels run on CUDA devices (and on CPU under TRITON_INTERPRET=1), not on {device_type}"
    if torch.version.hip:
        return (f"ROCm {torch.version.hip}: the Triton kernels are compiled and checked for NVIDIA GPUs only "
                "(sm_80, sm_89, sm_90)")
    if interpreted:
        return "TRITON_INTERPRET=1 runs the Triton kernels on the CPU: unset it for CUDA tensors"
    return None


def tile(group_elems: int):
    """(BLOCK, ROWS, ONE_STEP) of every launch for groups of `group_elems` values."""
    if group_elems > TILE:
        return TILE, 1, False
    block = contract.next_pow2(group_elems)
    return block, TILE // block, True


def _launch(kernel, grid, args, meta):
    """One launch of `kernel` on `grid` programs (axis 0)."""
    if grid > GRID_LIMIT:
        raise ValueError(f"{kernel.fn.__name__}: {grid} programs exceed CUDA's grid limit {GRID_LIMIT}")
    kernel[(grid, )](*args, num_warps=NUM_WARPS, enable_fp_fusion=False, **meta)


if triton is not None:

    # x + ROUNDING for |x| < 2**22 is 1.5 * 2**23 plus x rounded to an integer (half to even): its
    # bits are ROUNDING_BITS plus that integer.
    ROUNDING = tl.constexpr(12582912.0)
    ROUNDING_BITS = tl.constexpr(0x4B400000)

    @triton.jit
    def _largest(values, live):
        """Per row of fp32 `values`: the largest magnitude of its live values that are not NaN, as
        int32 bits (finite non-negative floats order as their bits do), and whether it has one."""
        bits = values.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        counted = live & (bits <= 0x7F800000)
        return tl.max(tl.where(counted, bits, 0), axis=1), tl.max(counted.to(tl.int32), axis=1)

    @triton.jit
    def _scale(largest, seen, padded, BITS: tl.constexpr):
        """The kernels' scale 2**BITS / (2 * absmax), 1 for a group whose absmax is 0. Without
        zero-filled lanes (`padded` 0) a group of NaN alone has absmax -inf, as the kernels fold it."""
        absmax = largest.to(tl.float32, bitcast=True)
        absmax = tl.where((seen > 0) | (padded != 0), absmax, float("-inf"))
        scale = tl.math.div_rn(tl.full(absmax.shape, 2.0**BITS, tl.float32),
                               tl.where(absmax == 0.0, 1.0, 2.0 * absmax))
        return tl.where(absmax == 0.0, 1.0, scale)

    @triton.jit
    def _codes(values, scale, BITS: tl.constexpr):
        """rint(values * scale) clamped to the codes of BITS bits, 0 for NaN, as int32."""
        scaled = values * scale[:, None]
        rounded = (scaled + ROUNDING).to(tl.int32, bitcast=True) - ROUNDING_BITS
        codes = tl.minimum(tl.maximum(rounded, -(2**(BITS - 1))), 2**(BITS - 1) - 1)
        return tl.where(scaled == scaled, codes, 0)

    @triton.jit
    def _store_codes(row_out, step, codes, live, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """Stores rows of codes, values `step` to `step + BLOCK` of their groups, whose codes start at
        `row_out` ([ROWS, 1] pointers): a byte each at 8 bits, two per byte at 4, the first in the
        high nibble."""
        if BITS == 8:
            tl.store(row_out + step + tl.arange(0, BLOCK)[None, :], codes.to(tl.int8), mask=live)
        else:
            high, low = tl.split(tl.reshape(codes, [ROWS, BLOCK // 2, 2]))
            pair_live, _ = tl.split(tl.reshape(live.to(tl.int32), [ROWS, BLOCK // 2, 2]))
            packed = ((high & 15) << 4) | (low & 15)
            tl.store(row_out + step // 2 + tl.arange(0, BLOCK // 2)[None, :], packed.to(tl.int8), mask=pair_live != 0)

    @triton.jit
    def _load_codes(row_data, step, live, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """The codes of values `step` to `step + BLOCK` of groups whose codes start at `row_data`
        ([ROWS, 1] pointers), as fp32 (0 where not `live`)."""
        if BITS == 8:
            return tl.load(row_data + step + tl.arange(0, BLOCK)[None, :], mask=live, other=0).to(tl.float32)
        pair_live, _ = tl.split(tl.reshape(live.to(tl.int32), [ROWS, BLOCK // 2, 2]))
        byte = tl.load(row_data + step // 2 + tl.arange(0, BLOCK // 2)[None, :], mask=pair_live != 0,
                       other=0).to(tl.int32)
        return tl.reshape(tl.join(byte >> 4, (byte << 28) >> 28), [ROWS, BLOCK]).to(tl.float32)

    # No kernel parameter is named `params`, `options`, `specialization` or `backend`: the launcher Triton
    # generates for a kernel (runtime/jit.py, create_function_from_signature) has locals of those names,
    # and a parameter named `params` reaches the specializer as a dict ("failed to specialize argument
    # of type: dict") on a GPU, while Triton's interpreter, which has no such launcher, runs it.

    # Counts that do not change the code are not specialized on (fewer variants to compile); the group
    # size is, and row starts are hinted as multiples of the 8-value vector, so whole vectors move at once.

    @triton.jit(do_not_specialize=[
        "num_groups", "groups_per_partition", "per_stage", "num_nodes", "local_world_size", "padded"
    ])
    def _quantize_kernel(x, out, group_params, num_groups, group_elems, groups_per_partition, per_stage, num_nodes,
                         local_world_size, padded, BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         ONE_STEP: tl.constexpr):
        """quantize and swizzle_quant: groups in partition-major order in, each written to its
        place in the swizzle order (qgz_contract.swizzle_slot), pipeline stages outermost."""
        # group indices in int32 (the contract keeps them below 2**28), offsets in int64
        group = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live_rows = group < num_groups
        partition = group // groups_per_partition
        stage = (group % groups_per_partition) // per_stage
        slot = (partition % local_world_size) * num_nodes + partition // local_world_size
        target = (stage * (num_nodes * local_world_size) + slot) * per_stage + group % per_stage
        row_in = x + tl.multiple_of(group.to(tl.int64) * group_elems, 8)[:, None]
        row_out = out + tl.multiple_of(target.to(tl.int64) * group_elems * BITS // 8, BITS)[:, None]
        if ONE_STEP:
            lanes = tl.arange(0, BLOCK)[None, :]
            live = live_rows[:, None] & (lanes < group_elems)
            values = tl.load(row_in + lanes, mask=live, other=0.0).to(tl.float32)
            largest, seen = _largest(values, live)
            scale = _scale(largest, seen, padded, BITS)
            _store_codes(row_out, 0, _codes(values, scale, BITS), live, BITS, ROWS, BLOCK)
        else:
            largest = tl.zeros([ROWS], tl.int32)
            seen = tl.zeros([ROWS], tl.int32)
            for step in tl.range(0, group_elems, BLOCK, loop_unroll_factor=1):  # trips: -(-group_elems // BLOCK)
                lanes = step + tl.arange(0, BLOCK)[None, :]
                live = live_rows[:, None] & (lanes < group_elems)
                values = tl.load(row_in + lanes, mask=live, other=0.0).to(tl.float32)
                step_largest, step_seen = _largest(values, live)
                largest = tl.maximum(largest, step_largest)
                seen = tl.maximum(seen, step_seen)
            scale = _scale(largest, seen, padded, BITS)
            for step in tl.range(0, group_elems, BLOCK, loop_unroll_factor=1):  # trips: -(-group_elems // BLOCK)
                lanes = step + tl.arange(0, BLOCK)[None, :]
                live = live_rows[:, None] & (lanes < group_elems)
                values = tl.load(row_in + lanes, mask=live, other=0.0).to(tl.float32)
                _store_codes(row_out, step, _codes(values, scale, BITS), live, BITS, ROWS, BLOCK)
        tl.store(group_params + target, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), mask=live_rows)

    @triton.jit(do_not_specialize=["out_groups", "groups_per_device", "local_world_size", "padded"])
    def _quantized_reduction_kernel(data, scales, out, group_params, out_groups, out_group_elems, in_group_elems,
                                    bytes_per_device, groups_per_device, local_world_size, padded, BITS: tl.constexpr,
                                    ROWS: tl.constexpr, BLOCK: tl.constexpr, PASSES: tl.constexpr,
                                    SAME_GROUPS: tl.constexpr):
        """quantized_reduction: output group by output group, the devices' tensors dequantized to fp16
        and added in fp16 (one IEEE fp16 addition each) in device order from +0, then requantized. In
        PASSES 1 a step holds whole groups; in PASSES 2 the steps over a group take its statistics,
        then recompute its sums to quantize them. With SAME_GROUPS the input groups are the output
        groups; otherwise each value's is looked up."""
        group = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live_rows = group < out_groups
        group = tl.where(live_rows, group, 0)  # rows past the last read the first group, and store nothing
        row_start = group * out_group_elems
        row_byte = tl.multiple_of(row_start * BITS // 8, BITS)[:, None]
        row_out = out + row_byte
        first_in = (row_start // in_group_elems)[:, None]
        in_offset = (row_start % in_group_elems).to(tl.int32)[:, None]
        steps = tl.cdiv(out_group_elems, BLOCK)
        largest = tl.zeros([ROWS], tl.int32)
        seen = tl.zeros([ROWS], tl.int32)
        for k in tl.range(0, steps * PASSES, loop_unroll_factor=1):  # trips: -(-out_group_elems // BLOCK) * PASSES
            step = (k % steps) * BLOCK
            lanes = step + tl.arange(0, BLOCK)[None, :]
            live = live_rows[:, None] & (lanes < out_group_elems)
            sums = tl.zeros([ROWS, BLOCK], tl.float16)
            for device in tl.range(0, local_world_size, loop_unroll_factor=1):  # trips: local_world_size
                codes = _load_codes(data + device * bytes_per_device + row_byte, step, live, BITS, ROWS, BLOCK)
                device_scales = scales + device * groups_per_device
                if SAME_GROUPS:
                    param = tl.load(device_scales + group)[:, None]
                else:
                    param = tl.load(device_scales + first_in + (in_offset + lanes) // in_group_elems,
                                    mask=live,
                                    other=0.0)
                sums += (codes * param).to(tl.float16)
            values = sums.to(tl.float32)
            if k < steps:
                step_largest, step_seen = _largest(values, live)
                largest = tl.maximum(largest, step_largest)
                seen = tl.maximum(seen, step_seen)
            if k >= steps * (PASSES - 1):
                _store_codes(row_out, step, _codes(values, _scale(largest, seen, padded, BITS), BITS), live, BITS,
                             ROWS, BLOCK)
        scale = _scale(largest, seen, padded, BITS)
        tl.store(group_params + group, tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale), mask=live_rows)

    @triton.jit(do_not_specialize=["num_groups"])
    def _dequantize_kernel(data, group_params, out, num_groups, group_elems, BITS: tl.constexpr, FP32: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """dequantize and dequantize_fp32: each code times its group's parameter, rounded to the output."""
        group = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        live_rows = group < num_groups
        param = tl.load(group_params + group, mask=live_rows, other=0.0)[:, None]
        row_data = data + tl.multiple_of(group * group_elems * BITS // 8, BITS)[:, None]
        row_out = out + tl.multiple_of(group * group_elems, 8)[:, None]
        for step in tl.range(0, group_elems, BLOCK, loop_unroll_factor=1):  # trips: -(-group_elems // BLOCK)
            lanes = step + tl.arange(0, BLOCK)[None, :]
            live = live_rows[:, None] & (lanes < group_elems)
            values = _load_codes(row_data, step, live, BITS, ROWS, BLOCK) * param
            if FP32:
                tl.store(row_out + lanes, values, mask=live)
            else:
                tl.store(row_out + lanes, values.to(tl.float16), mask=live)


def _require_symmetric(op: str, quant_type) -> None:
    if int(quant_type) != Symmetric:
        raise ValueError(f"{op}: the Triton quantizer quantizes symmetrically only (quant_type {Symmetric}, what qgZ "
                         f"and qwZ use), got quant_type {int(quant_type)}")


def _require_runnable(op: str, **tensors) -> None:
    """The kernels run on these tensors' device and read them as contiguous buffers."""
    reason = unavailable_reason(next(iter(tensors.values())).device.type)
    if reason is not None:
        raise RuntimeError(f"{op}: {reason}")
    contract.require(contract.layout_violations(contiguous=tensors.items()), op)


# ----------------------------------------------------------------------------------------------------
# the self-check
# ----------------------------------------------------------------------------------------------------

# variants checked in this process
_checked = set()

# Whether a pointer's 16-byte alignment selects a binary of its own, as in Triton's compiler (its
# interpreter compiles nothing): fixed when Triton is first imported, so read once, not at every call.
_ALIGNMENT_SELECTS_BINARY = triton is not None and _quantize_kernel.__class__.__name__ != "InterpretedFunction"


def _variant(kernel, args, meta) -> tuple:
    """At least what Triton compiles one binary for: the kernel, its constexprs, and of its other
    arguments which integers are 1, multiples of 16 or beyond int32 (the kernels specialize on fewer:
    do_not_specialize), and which pointers are 16-byte aligned."""
    aligned = _ALIGNMENT_SELECTS_BINARY
    specialized = tuple(
        ("ptr", aligned and t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor) else (t == 1, t % 16 == 0,
                                                                                         not -2**31 <= t < 2**31)
        for t in args)
    return (kernel.fn.__name__, tuple(sorted(meta.items())), specialized)


def _first_difference(got, want) -> Optional[str]:
    """Where `got` differs from `want` in any bit (NaNs apart: a NaN's payload is the hardware's, and a
    GPU's differs from a CPU's), or None."""
    got, want = got.reshape(-1), want.to(got.device).reshape(-1)
    if got.dtype != want.dtype or got.numel() != want.numel():
        return f"{got.numel()} values of {got.dtype}, expected {want.numel()} of {want.dtype}"
    width = got.element_size()
    differs = (got.view(torch.uint8).view(-1, width) != want.view(torch.uint8).view(-1, width)).any(dim=1)
    if got.is_floating_point():
        differs &= ~(got.isnan() & want.isnan())
    if not differs.any():
        return None
    index = int(differs.nonzero()[0])
    return f"value {index} of {got.numel()}: {got[index].item()!r}, expected {want[index].item()!r}"


def _failures(failure: Optional[str]) -> list:
    """[(where, failure)] of this check, `failure` this rank's (None if it passed): every rank's, or
    this process's alone where torch.distributed is not initialized."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [] if failure is None else [("in this process", failure)]
    failures = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failure)
    return [(f"on rank {rank} of {len(failures)}", found) for rank, found in enumerate(failures) if found is not None]


def _realigned(args, outputs):
    """`args` with the inputs (the tensors the kernel does not write) copied to every other
    combination of 16-byte alignment, each with that combination: (aligned, ...) per input; none
    where alignment selects no binary."""
    if not _ALIGNMENT_SELECTS_BINARY:
        return
    written = {t.data_ptr() for t in outputs}
    inputs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.data_ptr() not in written]
    for alignment in itertools.product((True, False), repeat=len(inputs)):
        if all((args[i].data_ptr() % 16 == 0) == aligned for i, aligned in zip(inputs, alignment)):
            continue  # the call's own
        moved = list(args)
        for i, aligned in zip(inputs, alignment):
            # a new buffer starts aligned; one element on (at most 4 bytes), it is not
            shift = 0 if aligned else 1
            buffer = torch.empty(args[i].numel() + shift, dtype=args[i].dtype, device=args[i].device)
            moved[i] = buffer[shift:].view(args[i].shape).copy_(args[i])
        yield alignment, tuple(moved)


def _checked_call(op: str, kernel, grid, args, meta, outputs, expected):
    """Launches `kernel`; on its variant's first launch in this process, compares `outputs` with
    `expected()` (the reference's results on the same inputs).

    A check that fails on one rank fails on every rank, at the same call: each rank's verdict is
    all-gathered (torch.distributed's default group, when it is initialized). Every rank must reach
    that gathering at the same call. The call's sizes pick its variant but for its pointers'
    alignment, and the ranks of qgZ and qwZ make the same calls with the same sizes in the same order;
    alignment is where each rank's allocator put its buffers, so one rank can meet an unaligned
    variant at a call where the others meet the aligned one. So the first call of given sizes checks
    the kernel on its inputs at every alignment (copies), and every variant of those sizes is checked
    at the same call on every rank: none is ever checked on one rank alone, where a failure would
    leave the others waiting in the next collective until its timeout. A rank whose kernel or
    reference raises in the check still gathers, and every rank then raises."""
    variant = _variant(kernel, args, meta)
    if variant in _checked:
        _launch(kernel, grid, args, meta)
        return outputs
    failure = error = None
    checked = []
    try:
        want = expected()
        # the call's own inputs last, so that the outputs are this call's
        for alignment, call_args in list(_realigned(args, outputs)) + [(None, args)]:
            _launch(kernel, grid, call_args, meta)
            failure = next(filter(None, (_first_difference(got, w) for got, w in zip(outputs, want))), None)
            if failure is not None:
                if alignment is not None:
                    failure += f" (its inputs copied to 16-byte alignment {alignment})"
                break
            checked.append(_variant(kernel, call_args, meta))
    except Exception as raised:  # reaches every rank through the gathering below
        failure, error = f"{type(raised).__name__}: {raised}", raised
    failures = _failures(failure)
    if failures:
        raise RuntimeError(f"{op}: the Triton kernel's first call of a variant failed its check against the reference "
                           f"(" + "; ".join(f"{where}: {found}" for where, found in failures) +
                           f"; variant {variant}); nothing falls back: unset DS_QGZ_QUANTIZER to use DeepSpeed's "
                           f"op") from error
    _checked.update(checked)
    return outputs


# ----------------------------------------------------------------------------------------------------
# the op
# ----------------------------------------------------------------------------------------------------


def _quantize(op, x, num_groups, num_bits, pipeline_size, num_nodes, local_world_size, stat_slots, out_shape,
              expected):
    group_elems = x.numel() // num_groups
    block, rows, one_step = tile(group_elems)
    out = torch.empty(out_shape, dtype=torch.int8, device=x.device)
    params = torch.empty(num_groups, 1, dtype=torch.float32, device=x.device)
    groups_per_partition = num_groups // (num_nodes * local_world_size)
    args = (x, out, params, num_groups, group_elems, groups_per_partition, groups_per_partition // pipeline_size,
            num_nodes, local_world_size, int(stat_slots > group_elems))
    meta = dict(BITS=num_bits, ROWS=rows, BLOCK=block, ONE_STEP=one_step)
    return _checked_call(op, _quantize_kernel, math.ceil(num_groups / rows), args, meta, (out, params), expected)


def quantize(x, num_groups, num_bits, quant_type):
    """DeepSpeed's quantize (qwZ's weights): `num_groups` equal groups of fp16 `x`, in place order.
    The parameters come back flat, as the CPU op returns them (the CUDA op's are [groups, 1]): qwZ's
    gathers all-gather them into a flat buffer, which gloo refuses from another shape."""
    _require_symmetric("quantize", quant_type)
    contract.require(
        contract.tensor_violations(input=(x, "torch.float16")) +
        contract.quantize_violations(x.numel(), num_groups, num_bits) +
        contract.output_violations("quantize", x.shape, num_bits), "quantize")
    _require_runnable("quantize", input=x)
    out_shape = contract.output_sizes("quantize", x.shape, num_bits)[0]
    stat_slots = contract.quantize_stat_slots(x.numel() // num_groups)
    codes, params = _quantize("quantize", x, num_groups, num_bits, 1, 1, 1, stat_slots, out_shape,
                              lambda: reference.quantize(x, num_groups, num_bits, quant_type))
    return codes, params.view(-1)


def swizzle_quant(x, num_groups, num_bits, quant_type, pipeline_size, num_nodes, local_world_size):
    """DeepSpeed's swizzle_quant (qgZ's first stage): `num_groups` equal groups of fp16 `x`,
    quantized and written in the swizzle order."""
    _require_symmetric("swizzle_quant", quant_type)
    contract.require(
        contract.tensor_violations(input=(x, "torch.float16")) +
        contract.swizzle_quant_violations(x.numel(), num_groups, num_bits, pipeline_size, num_nodes, local_world_size),
        "swizzle_quant")
    _require_runnable("swizzle_quant", input=x)
    stat_slots = contract.swizzle_stat_slots(x.numel() // num_groups)
    return _quantize(
        "swizzle_quant", x, num_groups, num_bits, pipeline_size, num_nodes, local_world_size, stat_slots,
        contract.output_sizes("swizzle_quant", x.shape, num_bits)[0], lambda: reference.swizzle_quant(
            x, num_groups, num_bits, quant_type, pipeline_size, num_nodes, local_world_size))


def quantized_reduction(data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size):
    """DeepSpeed's quantized_reduction (qgZ's second stage): `local_world_size` equal chunks of
    `data` dequantized, summed in fp16 in chunk order, requantized in `out_groups` groups."""
    _require_symmetric("quantized_reduction", quant_type)
    contract.require(
        contract.tensor_violations(data=(data, "torch.int8"), scales=(scales, "torch.float32")) +
        contract.quantized_reduction_violations(data.numel(), scales.numel(), in_groups, out_groups, num_bits,
                                                quant_type, local_world_size) +
        contract.output_violations("quantized_reduction", data.shape, num_bits, local_world_size),
        "quantized_reduction")
    _require_runnable("quantized_reduction", data=data, scales=scales)
    per_byte = contract.values_per_byte(num_bits)
    bytes_per_device = data.numel() // local_world_size
    values_per_device = bytes_per_device * per_byte
    out_group_elems = values_per_device // out_groups
    block, rows, one_step = tile(out_group_elems)
    out = torch.empty(contract.output_sizes("quantized_reduction", data.shape, num_bits, local_world_size)[0],
                      dtype=torch.int8,
                      device=data.device)
    params = torch.empty(out_groups, 1, dtype=torch.float32, device=data.device)
    padded = contract.reduce_stat_slots(bytes_per_device // out_groups, num_bits) > out_group_elems
    in_group_elems = values_per_device // (in_groups // local_world_size)
    args = (data, scales, out, params, out_groups, out_group_elems, in_group_elems, bytes_per_device,
            in_groups // local_world_size, local_world_size, int(padded))
    meta = dict(BITS=num_bits,
                ROWS=rows,
                BLOCK=block,
                PASSES=1 if one_step else 2,
                SAME_GROUPS=in_group_elems == out_group_elems)
    return _checked_call(
        "quantized_reduction", _quantized_reduction_kernel,
        math.ceil(out_groups / rows), args, meta, (out, params), lambda: reference.quantized_reduction(
            data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size))


def _dequantize(op, dtype, data, params, num_groups, num_bits, quant_type):
    _require_symmetric(op, quant_type)
    contract.require(
        contract.tensor_violations(data=(data, "torch.int8"), params=(params, "torch.float32")) +
        contract.dequantize_violations(data.numel(), params.numel(), num_groups, num_bits, quant_type,
                                       torch.finfo(dtype).bits // 8), op)
    _require_runnable(op, data=data, params=params)
    out = torch.empty(contract.output_sizes(op, data.shape, num_bits)[0], dtype=dtype, device=data.device)
    group_elems = out.numel() // num_groups
    block, rows, _ = tile(group_elems)
    args = (data, params, out, num_groups, group_elems)
    meta = dict(BITS=num_bits, FP32=dtype == torch.float32, ROWS=rows, BLOCK=block)
    expected = getattr(reference, op)
    return _checked_call(op, _dequantize_kernel, math.ceil(num_groups / rows), args, meta, (out, ), lambda:
                         (expected(data, params, num_groups, num_bits, quant_type), ))[0]


def dequantize(data, params, num_groups, num_bits, quant_type):
    """DeepSpeed's dequantize: fp16 values of `num_groups` groups of codes."""
    return _dequantize("dequantize", torch.float16, data, params, num_groups, num_bits, quant_type)


def dequantize_fp32(data, params, num_groups, num_bits, quant_type):
    """DeepSpeed's dequantize_fp32: fp32 values of `num_groups` groups of codes."""
    return _dequantize("dequantize_fp32", torch.float32, data, params, num_groups, num_bits, quant_type)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
A readable pure-PyTorch statement of what the qgZ quantizer kernels compute, bit for bit.

Same signatures, argument meanings, output shapes and dtypes as the CUDA binding
(csrc/quantization/pt_binding.cpp): ``quantize``, ``swizzle_quant``, ``quantized_reduction``,
``dequantize`` and ``dequantize_fp32``. The CPU op (deepspeed_qgz/csrc/quantizer.cpp) is tested against this module,
bit for bit; so can the CUDA kernels be. It runs on any device.

Numerics, as the kernels define them:

* Inputs are read as fp16. Statistics are folded over the fp16 values; NaN is skipped (``__hmax2``
  and ``fmaxf`` return the other operand), and when the launch has more lanes than the group has
  values, the idle lanes contribute zeros (they load zero-filled vectors).
* Symmetric: ``scale = 2**bits / (2 * absmax)`` (1 when absmax is 0); ``q = clamp(rint(x * scale))``
  with round-half-to-even, NaN -> 0 and saturation; the stored parameter is ``1 / scale``.
* Asymmetric: ``scale = 2**bits / (max - min)`` (1 when equal), ``offset = (max + min) / 2``,
  ``q = clamp(rint((x - offset) * scale))``, parameters ``[1 / scale, offset]``; dequantization is
  ``fma(q, 1 / scale, offset)`` (nvcc contracts it).
* int4 packs two values per byte, the first in the high nibble.
* ``quantized_reduction`` dequantizes each device's chunk to fp16 and sums the chunks in fp16, in
  device order, starting from +0; then it requantizes the sum.

Non-finite inputs: NaN is quantized to 0 and does not enter the group statistics, so a NaN is lost
unless its whole group is NaN; a group holding +-inf gets ``scale = 0`` and a stored parameter of
inf, so it dequantizes to NaN. Callers that must propagate non-finite values (qgZ does) cannot rely
on the kernels for it.

Where the CUDA build may differ: it is compiled with ``--use_fast_math``, so ``2**bits / (2 * max)``
and ``1 / scale`` use approximate division (within 2 ulp) and fp32 subnormals flush to zero. This
module and the CPU op use IEEE division: the two can differ in a scale's last bit, and then in a
code whose value sits on a rounding tie.
"""

import torch

from deepspeed_qgz.qgz import qgz_contract as contract

Symmetric = contract.SYMMETRIC
Asymmetric = contract.ASYMMETRIC


def _is_asymmetric(quant_type) -> bool:
    return int(quant_type) == Asymmetric


def _fold_max(values: torch.Tensor, padded: bool) -> torch.Tensor:
    """Row-wise max that skips NaN, starting from -inf, with a zero lane if `padded`."""
    out = torch.where(torch.isnan(values), float('-inf'), values).amax(dim=-1)
    return out.clamp(min=0) if padded else out


def _params(rows: torch.Tensor, num_bits: int, asymmetric: bool, padded: bool):
    """Per-row (scale, offset) from fp32 rows holding fp16 values, as GroupStats/Params do."""
    levels = float(1 << num_bits)
    if asymmetric:
        gmax = _fold_max(rows, padded)
        gmin = -_fold_max(-rows, padded)
        scale = torch.where(gmax == gmin, torch.ones_like(gmax), levels / (gmax - gmin))
        return scale, (gmax + gmin) / 2
    absmax = _fold_max(rows.abs(), padded)
    scale = torch.where(absmax == 0, torch.ones_like(absmax), levels / (2 * absmax))
    return scale, None


def _quantize(rows: torch.Tensor, scale: torch.Tensor, offset, num_bits: int) -> torch.Tensor:
    """fp32 rows -> int8 codes in [-2**(bits-1), 2**(bits-1) - 1]."""
    shifted = rows if offset is None else rows - offset.unsqueeze(-1)
    codes = torch.round(shifted * scale.unsqueeze(-1))  # round half to even, like __float2int_rn
    codes = torch.nan_to_num(codes, nan=0.0)
    half = 1 << (num_bits - 1)
    return codes.clamp(-half, half - 1).to(torch.int8)


def _stored_params(scale: torch.Tensor, offset) -> torch.Tensor:
    stored = torch.reciprocal(scale)
    return stored.unsqueeze(-1) if offset is None else torch.stack([stored, offset], dim=-1)


def _pack(codes: torch.Tensor, num_bits: int) -> torch.Tensor:
    if num_bits == 8:
        return codes.reshape(-1)
    codes = codes.reshape(-1, 2).to(torch.int32)
    packed = ((codes[:, 0] & 0xF) << 4) | (codes[:, 1] & 0xF)
    return packed.to(torch.uint8).view(torch.int8)


def _unpack(data: torch.Tensor, num_bits: int) -> torch.Tensor:
    """int8 bytes -> fp32 codes, two per byte for int4 (high nibble first)."""
    if num_bits == 8:
        return data.reshape(-1).to(torch.float32)
    raw = data.reshape(-1).to(torch.int32) & 0xFF
    high, low = raw >> 4, raw & 0xF
    codes = torch.stack([high, low], dim=-1).reshape(-1)
    return torch.where(codes >= 8, codes - 16, codes).to(torch.float32)


def _fma_fp32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once. a * b is exact in fp64 (a is a small integer); the fp64 sum is
    rounded to odd, after which rounding to fp32 is correct (53 >= 24 + 2 bits)."""
    prod, c = a.double() * b.double(), c.double()
    total = prod + c
    tail = total - prod
    err = (prod - (total - tail)) + (c - tail)
    needs_odd = (err != 0) & ((total.view(torch.int64) & 1) == 0) & torch.isfinite(total)
    toward = torch.where(err > 0, torch.full_like(total, float('inf')), torch.full_like(total, float('-inf')))
    total = torch.where(needs_odd, torch.nextafter(total, toward), total)
    return total.float()


def _dequantize_rows(codes: torch.Tensor, params: torch.Tensor, asymmetric: bool) -> torch.Tensor:
    """fp32 code rows and [rows, 1|2] params -> fp32 values."""
    if asymmetric:
        return _fma_fp32(codes, params[:, 0:1], params[:, 1:2])
    return codes * params[:, 0:1]


def quantize(x: torch.Tensor, num_groups: int, num_bits: int, quant_type):
    """Quantize `num_groups` equal groups of fp16 `x`, in place order. Returns (int8 data, fp32
    params [num_groups, 1|2])."""
    contract.require(
        contract.tensor_violations(input=(x, "torch.float16")) +
        contract.quantize_violations(x.numel(), num_groups, num_bits) +
        contract.output_violations("quantize", x.shape, num_bits), "quantize")
    elems = x.numel() // num_groups
    asymmetric = _is_asymmetric(quant_type)
    rows = x.reshape(num_groups, elems).float()
    scale, offset = _params(rows, num_bits, asymmetric, contract.quantize_stat_slots(elems) > elems)
    out_shape = contract.output_sizes("quantize", x.shape, num_bits)[0]
    packed = _pack(_quantize(rows, scale, offset, num_bits), num_bits)
    return packed.reshape(out_shape), _stored_params(scale, offset).contiguous()


def swizzle_quant(x: torch.Tensor, num_groups: int, num_bits: int, quant_type, pipeline_size: int, num_nodes: int,
                  local_world_size: int):
    """Quantize `num_groups` equal groups of fp16 `x` and reorder them into the swizzle order
    (qgz_contract.swizzle_slot), pipeline stages outermost. Returns (int8 data, fp32 params
    [num_groups, 1|2])."""
    contract.require(
        contract.tensor_violations(input=(x, "torch.float16")) +
        contract.swizzle_quant_violations(x.numel(), num_groups, num_bits, pipeline_size, num_nodes, local_world_size),
        "swizzle_quant")
    elems = x.numel() // num_groups
    asymmetric = _is_asymmetric(quant_type)
    rows = x.reshape(num_groups, elems).float()
    scale, offset = _params(rows, num_bits, asymmetric, contract.swizzle_stat_slots(elems) > elems)
    codes = _quantize(rows, scale, offset, num_bits)
    params = _stored_params(scale, offset)

    partitions = num_nodes * local_world_size
    per_stage = num_groups // (partitions * pipeline_size)

    def swizzle(t):  # partition-major groups -> [pipeline stage, slot, group within the stage, ...]
        t = t.reshape(partitions, pipeline_size, per_stage, *t.shape[1:])
        slots = contract.to_slot_order(t, num_nodes, local_world_size)  # [D, N, pipeline, per_stage, ...]
        return slots.movedim(2, 0).reshape(num_groups, *t.shape[3:])

    return _pack(swizzle(codes), num_bits), swizzle(params).contiguous()


def quantized_reduction(data: torch.Tensor, scales: torch.Tensor, in_groups: int, out_groups: int, num_bits: int,
                        quant_type, local_world_size: int):
    """Dequantize `local_world_size` equal chunks of `data`, sum them in fp16 in chunk order and
    requantize the sum in `out_groups` groups. Returns (int8 data, fp32 params [out_groups, 1|2])."""
    contract.require(
        contract.tensor_violations(data=(data, "torch.int8"), scales=(scales, "torch.float32")) +
        contract.quantized_reduction_violations(data.numel(), scales.numel(), in_groups, out_groups, num_bits,
                                                quant_type, local_world_size) +
        contract.output_violations("quantized_reduction", data.shape, num_bits, local_world_size),
        "quantized_reduction")
    return quantized_reduction_beyond_contract(data, scales, in_groups, out_groups, num_bits, quant_type,
                                               local_world_size)


def quantized_reduction_beyond_contract(data: torch.Tensor, scales: torch.Tensor, in_groups: int, out_groups: int,
                                        num_bits: int, quant_type, local_world_size: int):
    """quantized_reduction without the contract checks, for sizes the contract refuses only because
    the kernel would reduce with fewer threads than a warp: what the kernel computes when its
    shuffles happen to read nothing stale. For studying callers that launch such sizes (grouping
    rules that do not meet the warp rule), never for qgZ itself."""
    asymmetric = _is_asymmetric(quant_type)
    per_byte = contract.values_per_byte(num_bits)
    bytes_per_tensor = data.numel() // local_world_size
    values_per_tensor = bytes_per_tensor * per_byte
    groups_per_tensor = in_groups // local_world_size
    flat_params = scales.reshape(-1).float()
    width = contract.param_width(quant_type)

    total = torch.zeros(values_per_tensor, dtype=torch.float16, device=data.device)
    for device in range(local_world_size):
        chunk = data.reshape(-1)[device * bytes_per_tensor:(device + 1) * bytes_per_tensor]
        codes = _unpack(chunk, num_bits).reshape(groups_per_tensor, -1)
        # The kernel offsets device j's parameters by j * groups_per_tensor floats whatever their
        # width, so for asymmetric parameters devices past the first read shifted pairs (a defect of
        # the kernel, reproduced: qgZ itself is symmetric).
        base = device * groups_per_tensor
        params = flat_params[base:base + groups_per_tensor * width].reshape(groups_per_tensor, width)
        values = _dequantize_rows(codes, params, asymmetric).half().reshape(-1)
        # The fp32 sum of two fp16 values rounded to fp16 is their fp16 sum: fp32's 24 bits are at
        # least 2 * 11 + 2, so rounding twice is harmless.
        total = (total.float() + values.float()).half()

    out_elems = values_per_tensor // out_groups
    rows = total.reshape(out_groups, out_elems).float()
    padded = contract.reduce_stat_slots(bytes_per_tensor // out_groups, num_bits) > out_elems
    scale, offset = _params(rows, num_bits, asymmetric, padded)
    out_shape = contract.output_sizes("quantized_reduction", data.shape, num_bits, local_world_size)[0]
    packed = _pack(_quantize(rows, scale, offset, num_bits), num_bits)
    return packed.reshape(out_shape), _stored_params(scale, offset).contiguous()


def _dequantize(name: str, data: torch.Tensor, params: torch.Tensor, num_groups: int, num_bits: int, quant_type,
                dtype: torch.dtype) -> torch.Tensor:
    asymmetric = _is_asymmetric(quant_type)
    contract.require(
        contract.tensor_violations(data=(data, "torch.int8"), params=(params, "torch.float32")) +
        contract.dequantize_violations(data.numel(), params.numel(), num_groups, num_bits, quant_type,
                                       torch.finfo(dtype).bits // 8), name)
    codes = _unpack(data, num_bits).reshape(num_groups, -1)
    values = _dequantize_rows(codes, params.reshape(num_groups, -1).float(), asymmetric).to(dtype)
    return values.reshape(contract.output_sizes(name, data.shape, num_bits)[0])


def dequantize(data: torch.Tensor, params: torch.Tensor, num_groups: int, num_bits: int, quant_type) -> torch.Tensor:
    return _dequantize("dequantize", data, params, num_groups, num_bits, quant_type, torch.float16)


def dequantize_fp32(data: torch.Tensor, params: torch.Tensor, num_groups: int, num_bits: int,
                    quant_type) -> torch.Tensor:
    return _dequantize("dequantize_fp32", data, params, num_groups, num_bits, quant_type, torch.float32)

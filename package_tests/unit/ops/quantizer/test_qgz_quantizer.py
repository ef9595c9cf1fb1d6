# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The CPU accelerator's quantizer op (swizzle_quant, quantized_reduction, dequantize) against the
PyTorch statement of the CUDA kernels (deepspeed_qgz/qgz/qgz_reference.py), bit for bit, and
the kernel contract both enforce."""

import math
import re

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from deepspeed.accelerator import get_accelerator
from deepspeed_qgz.qgz import qgz_contract as contract
from deepspeed_qgz.qgz import qgz_reference as ref

from unit.qgz_util import quantizer, same_bits

pytestmark = pytest.mark.skipif(get_accelerator().device_name() != "cpu",
                                reason="tests the CPU accelerator's quantizer op")


@pytest.fixture(scope="module")
def cpu_quantizer():
    return quantizer()


SPECIALS = [0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1e-4, float("inf"), float("-inf"), float("nan")]


@st.composite
def layouts(draw):
    num_nodes, local_size = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    groups_per_partition = draw(st.integers(1, 3))
    elems = 8 * draw(st.one_of(st.integers(1, 160), st.sampled_from([511, 512, 513, 1024, 5120])))
    bits = draw(st.sampled_from([4, 8]))
    asymmetric = draw(st.booleans())
    return num_nodes, local_size, groups_per_partition, elems, bits, asymmetric


@st.composite
def fp16_values(draw, numel):
    seed = draw(st.integers(0, 2**31))
    magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0, 30000.0]))
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * magnitude).clamp(-65504, 65504)
    for _ in range(draw(st.integers(0, 6))):
        x[draw(st.integers(0, numel - 1))] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()):  # a whole group of one value (zeros, ties, NaN...)
        elems = draw(st.sampled_from([e for e in (8, 16) if e <= numel]))
        start = draw(st.integers(0, numel // elems - 1)) * elems
        x[start:start + elems] = draw(st.sampled_from(SPECIALS + [2.5, -3.0]))
    return x.half()


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), data=st.data())
def test_ops_match_reference_bit_for_bit(cpu_quantizer, layout, data):
    op = cpu_quantizer
    num_nodes, local_size, gpp, elems, bits, asymmetric = layout
    num_groups = num_nodes * local_size * gpp
    assume(num_groups * elems <= 400_000)
    x = data.draw(fp16_values(num_groups * elems))
    op_type, ref_type = (op.Asymmetric, ref.Asymmetric) if asymmetric else (op.Symmetric, ref.Symmetric)

    q, s = op.swizzle_quant(x, num_groups, bits, op_type, 1, num_nodes, local_size)
    rq, rs = ref.swizzle_quant(x, num_groups, bits, ref_type, 1, num_nodes, local_size)
    assert same_bits(q, rq) and same_bits(s, rs)

    # qgZ's one-to-one in/out groups, or fewer and larger output groups where the contract allows
    # (groups of fewer than 136 values reduce with less than a warp: refused, tested below)
    candidates = [
        g for g in (num_groups // local_size, num_groups // local_size // gpp)
        if not contract.quantized_reduction_violations(q.numel(), s.numel(), num_groups, g, bits, op_type, local_size)
    ]
    if not candidates:
        r, rscale, out_groups = q, s, num_groups
    else:
        out_groups = data.draw(st.sampled_from(candidates))
        r, rscale = op.quantized_reduction(q, s, num_groups, out_groups, bits, op_type, local_size)
        rr, rrscale = ref.quantized_reduction(q, s, num_groups, out_groups, bits, ref_type, local_size)
        assert same_bits(r, rr) and same_bits(rscale, rrscale)

    for fn in ("dequantize", "dequantize_fp32"):
        assert same_bits(
            getattr(op, fn)(r, rscale, out_groups, bits, op_type),
            getattr(ref, fn)(r, rscale, out_groups, bits, ref_type))


Q = object()  # stands for each module's Symmetric


@pytest.mark.parametrize(
    "fn_args,message",
    [
        (("swizzle_quant", torch.zeros(96, dtype=torch.half), 7, 4, Q, 1, 1, 1), "not divisible by num_groups 7"),
        (("swizzle_quant", torch.zeros(96, dtype=torch.half), 4, 4, Q, 1, 3, 1), "num_nodes x local_world_size"),
        (("swizzle_quant", torch.zeros(80, dtype=torch.half), 4, 4, Q, 1, 2, 2), "vector width"),
        (("swizzle_quant", torch.zeros(49152, dtype=torch.half), 1, 4, Q, 1, 1, 1), "largest launch"),
        (("swizzle_quant", torch.zeros(64, dtype=torch.half), 4, 4, Q, 3, 2, 2), "pipeline_size"),
        (("swizzle_quant", torch.zeros(64, dtype=torch.half), 4, 3, Q, 1, 2, 2), "num_bits"),
        (("swizzle_quant", torch.zeros(64, dtype=torch.float32), 4, 4, Q, 1, 2, 2), "float16"),
        (("quantized_reduction", torch.zeros(60, dtype=torch.int8), torch.ones(
            6, 1), 6, 3, 4, Q, 4), "local_world_size 4"),
        (("quantized_reduction", torch.zeros(12, dtype=torch.int8), torch.ones(6, 1), 6, 3, 4, Q, 2), "4-byte load"),
        (("quantized_reduction", torch.zeros(48, dtype=torch.int8), torch.ones(5, 1), 6, 3, 4, Q, 2), "scales hold 5"),
        (("quantized_reduction", torch.zeros(2 * 65536, dtype=torch.int8), torch.ones(
            2, 1), 2, 1, 4, Q, 2), "largest launch"),
        # out-groups of 128 values: a 16-thread block, whose full-warp shuffles read lanes that do not exist
        (("quantized_reduction", torch.zeros(2 * 64, dtype=torch.int8), torch.ones(
            2, 1), 2, 1, 4, Q, 2), "elements per out-group 128 launch 16 threads, fewer than a warp"),
        (("quantized_reduction", torch.zeros(2 * 8, dtype=torch.int8), torch.ones(
            2, 1), 2, 1, 8, Q, 2), "elements per out-group 8 launch 1 threads, fewer than a warp"),
        # what the CUDA bindings would read as another type
        (("quantized_reduction", torch.zeros(2 * 68, dtype=torch.int8), torch.ones(
            2, 1).half(), 2, 1, 4, Q, 2), "scales must be torch.float32"),
        (("quantized_reduction", torch.zeros(2 * 68, dtype=torch.uint8), torch.ones(
            2, 1), 2, 1, 4, Q, 2), "data must be torch.int8"),
        (("dequantize", torch.zeros(16, dtype=torch.int8), torch.ones(
            2, 1).half(), 2, 4, Q), "params must be torch.float32"),
        (("dequantize", torch.zeros(16, dtype=torch.int8), torch.ones(2, 1, device="meta"), 2, 4, Q), "on one device"),
        # int indices past 2**31 in dequantize's last block (a stride-0 view: no memory behind it)
        (("dequantize", torch.zeros(1, dtype=torch.int8).expand(2**30), torch.ones(2**16, 1), 2**
          16, 4, Q), "output elements 2147483648 exceed the kernels' int32 indexing"),
        (("dequantize_fp32", torch.zeros(1, dtype=torch.int8).expand(2**30 - 4096), torch.ones(
            1, 1), 1, 4, Q), "last block, which indexes up to the next multiple of 16384"),
        (("dequantize", torch.zeros(20, dtype=torch.int8), torch.ones(3,
                                                                      1), 3, 4, Q), "not divisible by num_groups 3"),
        (("dequantize", torch.zeros(20, dtype=torch.int8), torch.ones(10, 1), 10, 4, Q), "vector width"),
        (("dequantize", torch.zeros(16, dtype=torch.int8), torch.ones(3, 1), 2, 4, Q), "params hold 3"),
    ])
def test_contract_violations_are_refused(cpu_quantizer, fn_args, message):
    name, *args = fn_args
    for module in (cpu_quantizer, ref):
        call_args = [module.Symmetric if arg is Q else arg for arg in args]
        with pytest.raises(ValueError, match=message):
            getattr(module, name)(*call_args)


def test_cpu_op_itself_refuses_sub_warp_reductions(cpu_quantizer):
    """The op, called without the contract checks, refuses what CUDA would leave undefined too."""
    ops = cpu_quantizer.ops
    data = torch.zeros(2 * 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="out-groups of 128 elements launch 16 threads, fewer than a warp"):
        ops.quantized_reduction(data, torch.ones(2, 1), 2, 1, 4, ops.Symmetric, 2)
    out, scales = ops.quantized_reduction(torch.zeros(2 * 68, dtype=torch.int8), torch.ones(2, 1), 2, 1, 4,
                                          ops.Symmetric, 2)
    assert out.shape == (68, ) and scales.shape == (1, 1)


def test_symmetric_int4_semantics(cpu_quantizer):
    op = cpu_quantizer
    x = torch.tensor([1.0, -1.0, 0.5, 0.0625, -0.0625, 0.1875, 0.0, 0.25], dtype=torch.half)
    q, s = op.swizzle_quant(x, 1, 4, op.Symmetric, 1, 1, 1)
    assert float(s) == 1 / 8  # stored parameter: 1 / scale, scale = 16 / (2 * absmax)
    # codes: 8 -> clamped to 7, -8, 4, 0.5 -> 0 (half to even), -0.5 -> -0, 1.5 -> 2, 0, 2; high nibble first
    assert [b & 0xFF for b in q.tolist()] == [0x78, 0x40, 0x02, 0x02]
    assert op.dequantize(q, s, 1, 4, op.Symmetric).tolist() == [0.875, -1.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.25]


def test_non_finite_inputs_as_the_kernels_treat_them(cpu_quantizer):
    """Documented behaviour: NaN is skipped by the absmax and quantized to 0 (lost); a group with an
    inf gets scale 0, stored parameter inf, and dequantizes to NaN. all_to_all_quant_reduce
    therefore carries non-finite groups in their scales itself."""
    op = cpu_quantizer
    x = torch.tensor([float("nan"), 1.0, -2.0, 0, 0, 0, 0, 0] + [float("inf"), 1.0] + [0] * 6, dtype=torch.half)
    q, s = op.swizzle_quant(x, 2, 4, op.Symmetric, 1, 1, 1)
    assert float(s[0]) == 2 / 8 and math.isinf(float(s[1]))
    out = op.dequantize(q, s, 2, 4, op.Symmetric)
    assert float(out[0]) == 0.0 and torch.isfinite(out[:8]).all()
    assert torch.isnan(out[8:]).all()


def test_launch_geometry_matches_the_contract(cpu_quantizer):
    """The CPU op's copy of the CUDA launch geometry (for the statistics' idle lanes) against
    qgz_contract's, for every group size the contract allows, and the parameter widths."""
    ops = cpu_quantizer.ops
    for elems in range(contract.VECTOR_ELEMS, contract.SWIZZLE_MAX_GROUP_ELEMS + 1, contract.VECTOR_ELEMS):
        assert tuple(ops._swizzle_launch(elems)) == contract.swizzle_launch(elems), elems
    for bits in contract.SUPPORTED_BITS:
        load = contract.reduce_load_bytes(bits)
        largest = contract.reduce_max_group_elems(bits) // contract.values_per_byte(bits)
        for out_group_bytes in range(load, largest + 1, load):
            assert tuple(ops._reduce_launch(out_group_bytes, bits)) == contract.reduce_launch(out_group_bytes, bits)
        assert contract.reduce_launch(largest + load, bits)[1] is None
        smallest = contract.reduce_min_out_group_elems(bits) // contract.values_per_byte(bits)
        assert ops._reduce_launch(smallest, bits)[0] >= contract.WARP_SIZE > ops._reduce_launch(smallest - load,
                                                                                                bits)[0]
    assert contract.swizzle_launch(contract.SWIZZLE_MAX_GROUP_ELEMS + contract.VECTOR_ELEMS)[1] is None
    for quant_type in (ops.Symmetric, ops.Asymmetric):
        assert ops._param_width(quant_type) == contract.param_width(quant_type)


def test_portable_path_matches_reference():
    """The scalar path (non-x86 machines) built here with QGZ_SCALAR, against the reference."""
    from deepspeed_qgz.cpu_quantizer import QuantizerBuilder
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer

    class ScalarQuantizerBuilder(QuantizerBuilder):
        NAME = "quantizer_cpu_scalar"

        def cxx_args(self):
            return super().cxx_args() + ["-DQGZ_SCALAR"]

    op = ContractCheckedQuantizer(ScalarQuantizerBuilder().load())
    gen = torch.Generator().manual_seed(5)
    for num_nodes, local_size, elems, asymmetric in [(3, 2, 1000, False), (2, 3, 136, True), (1, 4, 4096, False)]:
        num_groups = num_nodes * local_size * 2
        x = (torch.randn(num_groups * elems, generator=gen) * 50).half()
        x[3], x[elems + 1], x[-1] = float("nan"), float("inf"), -65504
        op_type, ref_type = (op.Asymmetric, ref.Asymmetric) if asymmetric else (op.Symmetric, ref.Symmetric)
        for bits in (4, 8):
            q, s = op.swizzle_quant(x, num_groups, bits, op_type, 1, num_nodes, local_size)
            rq, rs = ref.swizzle_quant(x, num_groups, bits, ref_type, 1, num_nodes, local_size)
            assert same_bits(q, rq) and same_bits(s, rs)
            r, r_s = op.quantized_reduction(q, s, num_groups, num_groups // local_size, bits, op_type, local_size)
            rr, rr_s = ref.quantized_reduction(q, s, num_groups, num_groups // local_size, bits, ref_type, local_size)
            assert same_bits(r, rr) and same_bits(r_s, rr_s)
            assert same_bits(op.dequantize(r, r_s, num_groups // local_size, bits, op_type),
                             ref.dequantize(r, r_s, num_groups // local_size, bits, ref_type))


@st.composite
def quantize_layouts(draw):
    """Group sizes the contract allows: up to 128 values (several groups per block, a whole number
    of blocks) or 264 to 16384 values (a block of at least a warp per group)."""
    elems = 8 * draw(st.one_of(st.integers(1, 16), st.integers(33, 2048)))
    per_block = contract.quantize_launch(elems)[1]
    num_groups = per_block * draw(st.integers(1, 3))
    return num_groups, elems, draw(st.sampled_from([4, 8])), draw(st.booleans())


@settings(max_examples=120, deadline=None)
@given(layout=quantize_layouts(), data=st.data())
def test_quantize_matches_reference_bit_for_bit(cpu_quantizer, layout, data):
    op = cpu_quantizer
    num_groups, elems, bits, asymmetric = layout
    assume(num_groups * elems <= 300_000)
    x = data.draw(fp16_values(num_groups * elems)).view(num_groups, elems)
    op_type, ref_type = (op.Asymmetric, ref.Asymmetric) if asymmetric else (op.Symmetric, ref.Symmetric)
    q, s = op.quantize(x, num_groups, bits, op_type)
    rq, rs = ref.quantize(x, num_groups, bits, ref_type)
    # the op's scales flat: ZeRO-3's quantized gathers all-gather them into a flat buffer (gloo
    # refuses the CUDA op's [groups, width] there)
    assert same_bits(q, rq) and same_bits(s, rs.view(-1))
    assert q.shape == (num_groups, elems * bits // 8)
    flat = q.view(-1)  # the codes dequantize reads are flat (qgz_contract's calling convention)
    assert same_bits(op.dequantize(flat, s, num_groups, bits, op_type),
                     ref.dequantize(flat, rs, num_groups, bits, ref_type).view(-1))


@pytest.mark.parametrize("args,message", [
    ((torch.zeros(136 * 2, dtype=torch.half), 2, 8), "elements per group 136 launch 16 threads, fewer than a warp"),
    ((torch.zeros(256, dtype=torch.half), 1, 8), "elements per group 256 launch 16 threads, fewer than a warp"),
    ((torch.zeros(64 * 3, dtype=torch.half), 3, 8), "not a multiple of the 32 groups of 64 values"),
    ((torch.zeros(16392, dtype=torch.half), 1, 8), "exceed quantize's largest launch (16384)"),
    ((torch.zeros(100, dtype=torch.half), 10, 8), "not a positive multiple of the 8-value vector width"),
    ((torch.zeros(264, dtype=torch.float32), 1, 8), "input must be torch.float16"),
])
def test_quantize_refuses_what_the_kernel_leaves_undefined(cpu_quantizer, args, message):
    for module in (cpu_quantizer, ref):
        with pytest.raises(ValueError, match=re.escape(message)):
            module.quantize(*args, module.Symmetric)


def test_cpu_op_itself_refuses_sub_warp_quantize_groups(cpu_quantizer):
    ops = cpu_quantizer.ops
    with pytest.raises(RuntimeError, match="groups of 200 elements launch 16 threads, fewer than a warp"):
        ops.quantize(torch.zeros(200, dtype=torch.half), 1, 8, ops.Symmetric)


def test_quantize_launch_geometry_matches_the_contract(cpu_quantizer):
    ops = cpu_quantizer.ops
    for elems in range(contract.VECTOR_ELEMS, 16384 + 1, contract.VECTOR_ELEMS):
        assert tuple(ops._quantize_launch(elems)) == contract.quantize_launch(elems), elems
    assert contract.quantize_launch(16392)[2] is None


def test_functions_the_cpu_op_lacks_name_themselves(cpu_quantizer):
    for name in ("dequantize_int4_to_half_experimental", "dequantize_int8_to_half_experimental"):
        with pytest.raises(RuntimeError, match=f"{name} has no CPU implementation"):
            getattr(cpu_quantizer.ops, name)(torch.zeros(8, dtype=torch.int8), torch.ones(1), torch.ones(1), 1, 8)


@pytest.mark.parametrize("fn_args,message", [
    (("dequantize", torch.zeros(2, 8, dtype=torch.int8), torch.ones(2, 1), 2, 4, Q),
     r"data must be a flat contiguous tensor \(every DeepSpeed quantizer reads it so\), got shape \(2, 8\)"),
    (("quantized_reduction", torch.zeros(2, 68, dtype=torch.int8), torch.ones(
        2, 1), 2, 1, 4, Q, 2), r"data must be a flat contiguous tensor .* got shape \(2, 68\)"),
    (("swizzle_quant", torch.zeros(2, 128, dtype=torch.half).t(), 4, 4, Q, 1, 1, 1),
     r"input must be contiguous, got shape \(128, 2\), strides \(1, 128\)"),
    (("dequantize", torch.zeros(16, dtype=torch.int8), torch.ones(2,
                                                                  2)[:, :1], 2, 4, Q), r"params must be contiguous"),
])
def test_the_calling_convention_is_checked_not_mended(cpu_quantizer, fn_args, message):
    """qgz_contract's calling convention, which every quantizer DeepSpeed ships accepts (NPUQuantizer
    asserts on 2-D codes): refused with the shape and strides, never copied into shape silently."""
    name, *args = fn_args
    call_args = [cpu_quantizer.Symmetric if arg is Q else arg for arg in args]
    with pytest.raises(ValueError, match=message):
        getattr(cpu_quantizer, name)(*call_args)

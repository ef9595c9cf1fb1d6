# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""This package's Triton quantizer op (deepspeed_qgz/triton_quantizer.py), in Triton's interpreter:
bit for bit the PyTorch statement of the CUDA kernels (deepspeed_qgz/qgz/qgz_reference.py) on every
call the kernels' contract allows, refusing the others; every output byte written; its self-check;
the series' all_to_all_quant_reduce on it equal to the series on the CPU op; and, without a GPU,
every variant its launchers make for the series' and qwZ's calls compiled by Triton's compiler for
sm_80, sm_89 and sm_90 (in a process without TRITON_INTERPRET: unit/qgz_compile.py), where a compile
error, a grid beyond CUDA's limits, a register spill, or an approximate division, an FMA or a
flush-to-zero instruction in the PTX fails."""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

import deepspeed.comm as dist
from deepspeed_qgz import triton_quantizer as tq
from deepspeed_qgz.qgz import qgz_reference as ref
from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer

from unit.common import DistributedTest
from unit.qgz_util import cluster_inputs, device, quantizer, quantizer_caches, same_values, simulated_nodes

needs_triton = pytest.mark.skipif(tq.triton is None, reason="Triton is not installed")
interpreted = pytest.mark.skipif(tq.triton is None or tq.unavailable_reason("cpu") is not None,
                                 reason="runs the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1)")

SPECIALS = [0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8, 1e-4, float("inf"), float("-inf"), float("nan")]


@st.composite
def layouts(draw):
    """A swizzle_quant call's sizes: nodes up to 15, groups of 8 values to 40960 (over TILE: in
    steps), and the values, with the specials and whole groups of one of them."""
    num_nodes, local_size = draw(st.integers(1, 15)), draw(st.integers(1, 4))
    pipeline = draw(st.sampled_from([1, 2]))
    groups = num_nodes * local_size * pipeline * draw(st.integers(1, 2))
    elems = 8 * draw(st.one_of(st.integers(1, 160), st.sampled_from([511, 512, 513, 1024, 5120])))
    assume(groups * elems <= 2**20)
    seed = draw(st.integers(0, 2**31))
    magnitude = draw(st.sampled_from([1e-6, 1e-2, 1.0, 300.0, 30000.0]))
    x = (torch.randn(groups * elems, generator=torch.Generator().manual_seed(seed)) * magnitude).clamp(-65504, 65504)
    for _ in range(draw(st.integers(0, 6))):
        x[draw(st.integers(0, x.numel() - 1))] = draw(st.sampled_from(SPECIALS))
    if draw(st.booleans()):
        start = draw(st.integers(0, groups - 1)) * elems
        x[start:start + elems] = draw(st.sampled_from(SPECIALS + [2.5, -3.0]))
    return x.half(), groups, draw(st.sampled_from([4, 8])), pipeline, num_nodes, local_size


def same(got, want):
    """The same shape and dtype, and bit for bit the same values (NaN payloads apart)."""
    return all(g.shape == w.shape and g.dtype == w.dtype and bool(same_values(g, w).all()) for g, w in zip(got, want))


def check_call(name, *args):
    """The Triton op's `name` on `args` against the reference's: the same results, or, for a call
    outside the contract, the same refusal."""
    try:
        want = getattr(ref, name)(*args)
    except ValueError as refusal:
        with pytest.raises(ValueError, match="outside the quantizer kernels' contract") as raised:
            getattr(tq, name)(*args)
        assert str(raised.value) == str(refusal)
        return None
    got = getattr(tq, name)(*args)
    want = want if isinstance(want, tuple) else (want, )
    assert same(got if isinstance(got, tuple) else (got, ), want), name
    return want


@interpreted
@settings(max_examples=60, deadline=None)
@given(layout=layouts(), out_split=st.sampled_from([1, 2]))
def test_ops_match_reference_bit_for_bit(layout, out_split):
    x, groups, bits, pipeline, num_nodes, local_size = layout
    codes, scales = check_call("swizzle_quant", x, groups, bits, tq.Symmetric, pipeline, num_nodes, local_size)
    check_call("dequantize", codes, scales, groups, bits, tq.Symmetric)
    check_call("dequantize_fp32", codes, scales, groups, bits, tq.Symmetric)
    # the node's copies as qgZ hands them over, requantized in groups of the same or twice the size
    reduced = check_call("quantized_reduction", codes, scales, groups, groups // local_size // out_split, bits,
                         tq.Symmetric, local_size)
    if reduced is not None:
        check_call("dequantize", reduced[0], reduced[1], reduced[1].numel(), bits, tq.Symmetric)


@interpreted
@pytest.mark.parametrize("elems, groups", [(128, 256), (512, 64), (2048, 8), (4104, 4), (8000, 3), (16384, 2)])
def test_quantize_matches_reference_bit_for_bit(elems, groups):
    """qwZ's quantize, in groups of any size the kernel takes (DeepSpeed's CUDAQuantizer makes groups of
    up to 16000 values)."""
    x = (torch.randn(4, groups * elems // 4, generator=torch.Generator().manual_seed(elems)) * 7).half()
    x.view(-1)[::97] = float("nan")
    x.view(-1)[5] = float("-inf")
    codes, scales = tq.quantize(x, groups, 8, tq.Symmetric)
    # the scales flat, as the CPU op returns them (qwZ's gathers all-gather them flat)
    assert same(
        (codes, scales),
        tuple(
            t.view(-1) if t.dim() == 2 and t.shape[1] == 1 else t for t in ref.quantize(x, groups, 8, ref.Symmetric)))
    check_call("dequantize", codes.view(-1), scales, groups, 8, tq.Symmetric)


@interpreted
@pytest.mark.parametrize("local_size", [8, 16])
@pytest.mark.parametrize("bits", [4, 8])
def test_node_sums_at_fp16s_limit(local_size, bits):
    """A node of 8 or 16 devices whose values sit at fp16's largest magnitude: where their signs
    agree the fp16 sums overflow to inf, and each out-group's stored parameter is inf and its values
    NaN, bit for bit as the kernels' are (the series scales each gradient so that a node's sum stays in
    range)."""
    elems, groups = 1024, 2 * local_size  # two groups a device
    device_of_group = torch.arange(groups) // 2
    x = torch.full((groups, elems), 65504.0)
    x[:, 1::2] *= (-1.0)**device_of_group[:, None]  # the odd values alternate in sign from device to device
    x[:, ::4] = 60000.0 * torch.linspace(-1, 1, local_size)[device_of_group][:, None]
    codes, scales = ref.swizzle_quant(x.half().view(-1), groups, bits, 0, 1, 1, local_size)
    reduced = check_call("quantized_reduction", codes, scales, groups, 2, bits, tq.Symmetric, local_size)
    values = check_call("dequantize", reduced[0], reduced[1], 2, bits, tq.Symmetric)[0]
    # the agreeing values' sums overflowed: each out-group's stored parameter (1 / scale) is inf, its values NaN
    assert torch.isinf(reduced[1]).all() and values.isnan().all()


@interpreted
def test_every_output_byte_is_written_and_none_past_it(monkeypatch):
    """Outputs allocated full of either of two poisons, each followed by guard bytes of the same
    poison, come back the reference's in the CUDA op's shapes, their guard bytes untouched; over
    inputs of one and two dimensions, the two below the refused shapes of
    test_shapes_whose_outputs_the_kernels_would_overrun_are_refused among them."""
    x = (torch.randn(6 * 2 * 4104) * 3).half()
    codes = ref.swizzle_quant(x[:288 * 2], 2, 4, 0, 1, 1, 2)
    calls = [
        ("swizzle_quant", lambda: (x, 12, 4, tq.Symmetric, 1, 3, 2)),
        ("swizzle_quant", lambda: (x[:6 * 136], 6, 8, tq.Symmetric, 1, 3, 2)),
        ("swizzle_quant", lambda: (x.view(12, 4104), 12, 4, tq.Symmetric, 1, 2, 3)),
        ("quantized_reduction", lambda: (*ref.swizzle_quant(x, 12, 4, 0, 1, 1, 2), 12, 6, 4, tq.Symmetric, 2)),
        ("quantized_reduction", lambda: (codes[0].view(16, 18), codes[1], 2, 1, 4, tq.Symmetric, 2)),
        ("quantized_reduction", lambda: (codes[0].view(18, 16), codes[1], 2, 1, 4, tq.Symmetric, 2)),
        ("quantize", lambda: (x.view(12, 4104), 12, 8, tq.Symmetric)),
        ("quantize", lambda: (x[:272].view(8, 34), 1, 4, tq.Symmetric)),
        ("quantize", lambda: (x[:264].view(8, 33), 1, 8, tq.Symmetric)),
        ("dequantize", lambda: (*ref.swizzle_quant(x, 12, 4, 0, 1, 1, 1), 12, 4, tq.Symmetric)),
        ("dequantize", lambda: (codes[0].view(16, 18), codes[1], 2, 4, tq.Symmetric)),
        ("dequantize_fp32", lambda: (*ref.swizzle_quant(x[:1000], 125, 8, 0, 1, 1, 1), 125, 8, tq.Symmetric)),
        ("dequantize_fp32", lambda: (codes[0].view(16, 18), codes[1], 2, 4, tq.Symmetric)),
    ]
    empty, guard = torch.empty, 64
    for name, arguments in calls:
        args = arguments()
        want = getattr(ref, name)(*args)
        want = want if isinstance(want, tuple) else (want, )
        for poison in (0x5A, 0xA5):
            guards = []

            def poisoned(*size, dtype, **kwargs):
                shape = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
                room = empty(shape.numel() * dtype.itemsize + guard, dtype=torch.uint8, **kwargs).fill_(poison)
                guards.append(room[-guard:])
                return room[:-guard].view(dtype).view(shape)

            monkeypatch.setattr(torch, "empty", poisoned)
            got = getattr(tq, name)(*args)
            monkeypatch.setattr(torch, "empty", empty)
            got = got if isinstance(got, tuple) else (got, )
            assert guards and all(bool((g == poison).all()) for g in guards), (name, args[0].shape, hex(poison))
            # quantize's scales come back flat (test_quantize_matches_reference_bit_for_bit)
            assert same(got[:1], want[:1]) and same(tuple(g.reshape(-1)
                                                          for g in got[1:]), tuple(w.reshape(-1)
                                                                                   for w in want[1:])), (name,
                                                                                                         hex(poison))


@interpreted
@pytest.mark.parametrize("name, args, rule", [
    ("quantize", lambda x: (x[:264].view(8, 33), 1, 4, tq.Symmetric),
     r"last dimension 33 \(shape \[8, 33\]\) is not a multiple of 2: the output, shaped \[8, 16\] as DeepSpeed's op "
     r"shapes it, holds 128 elements and the kernel writes 132"),
    ("quantized_reduction", lambda x:
     (ref.swizzle_quant(x[:544], 2, 4, 0, 1, 1, 2)[0].view(16, 17), torch.ones(2), 2, 1, 4, tq.Symmetric, 2),
     r"last dimension 17 \(shape \[16, 17\]\) is not a multiple of 2: the output, shaped \[16, 8\] as DeepSpeed's op "
     r"shapes it, holds 128 elements and the kernel writes 136"),
])
def test_shapes_whose_outputs_the_kernels_would_overrun_are_refused(monkeypatch, name, args, rule):
    """Refused before any launch or allocation, naming the op, the shape and the rule, as the
    reference and ContractCheckedQuantizer refuse them."""
    args = args((torch.randn(4104) * 3).half())
    monkeypatch.setattr(tq, "_launch", lambda *launch: pytest.fail(f"{name} launched {launch[0]}"))
    monkeypatch.setattr(torch, "empty", lambda *size, **kwargs: pytest.fail(f"{name} allocated {size}"))
    with pytest.raises(ValueError,
                       match=f"^{name}: call outside the quantizer kernels' contract: .*{rule}") as refused:
        getattr(tq, name)(*args)
    with pytest.raises(ValueError) as by_reference:
        getattr(ref, name)(*args)
    assert str(refused.value) == str(by_reference.value)
    with pytest.raises(ValueError, match=rule):  # and so does any op the contract wraps
        getattr(ContractCheckedQuantizer(ref), name)(*args)


SELF_CHECK = """
import torch
from deepspeed_qgz import triton_quantizer as tq
from deepspeed_qgz.qgz import qgz_reference as ref
x = (torch.randn(6 * 136) * 3).half()
right = ref.swizzle_quant
def wrong(*args):
    codes, scales = right(*args)
    return codes, scales * 2
ref.swizzle_quant = wrong
for attempt in range(2):
    try:
        tq.swizzle_quant(x, 6, 4, 0, 1, 3, 2)
        print("ran")
    except RuntimeError as error:
        print("refused", error)
ref.swizzle_quant = right
tq.swizzle_quant(x, 6, 4, 0, 1, 3, 2)
print("ran after the reference was mended")
ref.swizzle_quant = wrong
tq.swizzle_quant(x, 6, 4, 0, 1, 3, 2)
print("checked variant ran without the reference")
try:
    tq.swizzle_quant(torch.cat([x] * 32), 6, 4, 0, 1, 3, 2)
except RuntimeError as error:
    print("another variant refused")
"""


@interpreted
def test_the_first_call_of_each_variant_is_checked_against_the_reference():
    """A kernel whose bits differ from the reference's is refused, on every call until a call of its
    variant agrees; a variant checked once runs alone; another variant is checked again."""
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, "-c", SELF_CHECK],
                                cwd=cwd,
                                capture_output=True,
                                text=True,
                                timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) == 5, lines
    for line in lines[:2]:
        assert line.startswith("refused swizzle_quant: the Triton kernel's first call of a variant failed its check "
                               "against the reference (in this process: value 0 of 6: ")
        assert "DS_QGZ_QUANTIZER" in line
    assert lines[2:] == [
        "ran after the reference was mended", "checked variant ran without the reference", "another variant refused"
    ]


@interpreted
def test_refusals_name_the_values():
    x = torch.zeros(6 * 136, dtype=torch.half)
    with pytest.raises(ValueError, match="symmetrically only .* got quant_type 1"):
        tq.swizzle_quant(x, 6, 4, tq.Asymmetric, 1, 3, 2)
    with pytest.raises(ValueError, match="num_groups 6 is not divisible by num_nodes x local_world_size = 2 x 2 = 4"):
        tq.swizzle_quant(x, 6, 4, tq.Symmetric, 1, 2, 2)
    with pytest.raises(ValueError, match="input must be torch.float16 .* got torch.float32"):
        tq.swizzle_quant(x.float(), 6, 4, tq.Symmetric, 1, 3, 2)
    with pytest.raises(ValueError, match=r"data must be contiguous, got shape \(2, 16\)"):
        tq.dequantize(torch.zeros(16, 2, dtype=torch.int8).t(), torch.ones(8), 8, 4, tq.Symmetric)
    assert "not on xpu" in tq.unavailable_reason("xpu")


@interpreted
class TestFirstCallCheckAcrossTheWorld(DistributedTest):
    """A first-call check that fails on one rank fails on every rank at that call, naming the rank
    and what it found, and no rank waits for a collective's timeout: one rank's reference made to
    differ, then another rank's made to raise; mended, the call runs everywhere. The seconds each
    rank took to raise are printed."""
    reuse_dist_env = True

    @pytest.mark.parametrize("world_size", [2, 6])
    def test_every_rank_raises_naming_the_failing_rank(self, world_size):
        rank, world = dist.get_rank(), dist.get_world_size()
        # groups of 8 values: a variant no other test makes in these processes
        x = (torch.randn(4 * 8, generator=torch.Generator().manual_seed(rank)) * 3).half()
        args = (x, 4, 8, tq.Symmetric, 1, 1, 1)
        right = ref.swizzle_quant

        def differs(*args):
            codes, scales = right(*args)
            return codes, scales * 2

        def raises(*args):
            raise MemoryError("the reference ran out of memory")

        cases = [(world - 1, differs, "value 0 of 4: "), (0, raises, "MemoryError: the reference ran out of memory")]
        seconds = []
        try:
            for failing, wrong, found in cases:
                ref.swizzle_quant = wrong if rank == failing else right
                dist.barrier()
                start = time.perf_counter()
                with pytest.raises(RuntimeError, match=re.escape(f"(on rank {failing} of {world}: {found}")) as raised:
                    tq.swizzle_quant(*args)
                seconds.append(time.perf_counter() - start)
                assert f"on rank {failing} of" in str(raised.value) and str(raised.value).count(f" of {world}: ") == 1
                assert isinstance(raised.value.__cause__, MemoryError) == (wrong is raises and rank == failing)
        finally:
            ref.swizzle_quant = right
        assert same(tq.swizzle_quant(*args), right(*args))
        every_rank = [None] * world
        dist.all_gather_object(every_rank, seconds)
        if rank == 0:
            for (failing, _, found), taken in zip(cases, zip(*every_rank)):
                print(f"world of {world}, rank {failing}'s check failing ({found.split(':')[0]}): every rank raised, "
                      f"in {min(taken):.2f} to {max(taken):.2f} s")

    @pytest.mark.parametrize("world_size", [2, 6])
    def test_a_variant_of_one_alignment_fails_on_every_rank(self, world_size):
        """As compiled, where a pointer's alignment selects a binary: a kernel wrong on one rank only
        where its input is not 16-byte aligned (its launch made to garble what it writes) fails every
        rank at the first call of those sizes, though every rank's input there is aligned; mended, a
        rank whose input is unaligned at a later call runs it alone, checked already, while the others
        run the aligned one."""
        rank, world = dist.get_rank(), dist.get_world_size()
        # groups of 16 values: a variant no other test makes in these processes
        x = (torch.randn(4 * 16, generator=torch.Generator().manual_seed(rank)) * 3).half()
        args = (x, 4, 8, tq.Symmetric, 1, 1, 1)
        launch, selects = tq._launch, tq._ALIGNMENT_SELECTS_BINARY

        def miscompiled(kernel, grid, kernel_args, meta):
            launch(kernel, grid, kernel_args, meta)
            if kernel_args[0].data_ptr() % 16:
                for written in kernel_args[1:3]:
                    written.view(torch.uint8).bitwise_not_()

        failing = world - 1
        tq._ALIGNMENT_SELECTS_BINARY = True
        try:
            tq._launch = miscompiled if rank == failing else launch
            dist.barrier()
            start = time.perf_counter()
            with pytest.raises(RuntimeError, match=re.escape(f"(on rank {failing} of {world}: value 0 of ")) as raised:
                tq.swizzle_quant(*args)
            seconds = time.perf_counter() - start
            assert "(its inputs copied to 16-byte alignment (False,))" in str(raised.value)
            tq._launch = launch
            assert same(tq.swizzle_quant(*args), ref.swizzle_quant(*args))
            unaligned = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].copy_(x)
            assert unaligned.data_ptr() % 16
            mine = (unaligned if rank == 0 else x, ) + args[1:]
            assert same(tq.swizzle_quant(*mine), ref.swizzle_quant(*mine))
        finally:
            tq._launch, tq._ALIGNMENT_SELECTS_BINARY = launch, selects
        every_rank = [None] * world
        dist.all_gather_object(every_rank, seconds)
        if rank == 0:
            print(f"world of {world}, rank {failing}'s unaligned variant failing: every rank raised, "
                  f"in {min(every_rank):.2f} to {max(every_rank):.2f} s")


@needs_triton
def test_rocm_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.4")
    assert "ROCm 6.2.4: the Triton kernels are compiled and checked for NVIDIA GPUs only" in tq.unavailable_reason(
        "cuda")


@interpreted
class TestSeriesOnTritonOp(DistributedTest):
    """The series' all_to_all_quant_reduce with the Triton op as its quantizer gives, on every rank,
    bit for bit what it gives with the CPU op (both state the CUDA kernels), for the report's
    3 nodes x 2 and for 2 x 3."""
    world_size = 6
    reuse_dist_env = True

    @pytest.mark.parametrize("intra_node_bits", [4, 8])
    @pytest.mark.parametrize("local_size", [2, 3])
    def test_same_results_as_the_cpu_op(self, local_size, intra_node_bits):
        from deepspeed.runtime.comm import coalesced_collectives
        # groups of 136 values, padded partitions among them, and of 8000 (over a tile: in steps)
        shapes = [(314, 48), (32, 32), (2, 2, 12000), (7, 7), (171, )]
        rank, world = dist.get_rank(), dist.get_world_size()
        inputs = {
            dtype: [t.to(device()) for t in cluster_inputs(shapes, world, dtype, seed=local_size)[rank]]
            for dtype in (torch.float16, torch.bfloat16)
        }
        inputs[torch.float16][1].view(-1)[rank] = float("inf") if rank == 1 else 0.0
        results = {}
        with simulated_nodes(local_size) as groups:
            for name, op in (("triton", tq), ("cpu", quantizer().ops)):
                with quantizer_caches(op):
                    results[name] = [
                        coalesced_collectives.all_to_all_quant_reduce(tensors, groups, intra_node_bits)
                        for tensors in inputs.values()
                    ]
        for triton_outputs, cpu_outputs in zip(results["triton"], results["cpu"]):
            for got, want in zip(triton_outputs, cpu_outputs):
                assert got.shape == want.shape and got.dtype == want.dtype
                assert bool(same_values(got, want).all())
        if rank == 0:
            # an inf on one rank makes its quantization group NaN, for the overflow check (position 1 is rank 0's)
            assert results["triton"][0][1].view(-1)[1].isnan(), "an inf on one rank is NaN in its group"

    @pytest.mark.parametrize("intra_node_bits", [4, 8])
    @pytest.mark.parametrize("local_size", [2, 3])
    def test_the_compile_check_states_the_series_calls(self, local_size, intra_node_bits):
        """qgz_compile.exchange_calls (what CI compiles, and the roofline prices) is what the series
        calls: each exchange's quantizer calls in order, their tensors' dtypes, sizes and byte offsets
        (the pointers' alignment picks a compiled variant), and their other arguments."""
        from deepspeed.runtime.comm import coalesced_collectives
        from unit import qgz_compile
        calls = []

        class Recording:

            def __getattr__(self, name):
                value = getattr(quantizer(), name)
                if not callable(value):
                    return value

                def record(*args):
                    calls.append((name, args))
                    return value(*args)

                return record

        def described(op, args):
            return op, tuple(
                (a.dtype, a.numel(), a.storage_offset() * a.element_size()) if isinstance(a, torch.Tensor) else int(a)
                for a in args)

        shapes = [(3141, 48), (32, 32), (2, 2, 60000), (7, 7), (171, )]
        world = dist.get_world_size()
        tensors = [t.to(device()) for t in cluster_inputs(shapes, world, torch.bfloat16, seed=0)[dist.get_rank()]]
        with simulated_nodes(local_size) as groups, quantizer_caches(Recording()):
            coalesced_collectives.all_to_all_quant_reduce(tensors, groups, intra_node_bits)
        exchanges = 0
        while calls:
            op, (x, num_groups, *_) = calls[0]
            assert op == "swizzle_quant", f"an exchange begins with {op}"
            steps = qgz_compile.exchange_calls(x.numel(),
                                               x.numel() // num_groups, world // local_size, local_size,
                                               intra_node_bits)
            stated = [described(name, args) for _, name, step_calls in steps for args in step_calls]
            assert [described(*call) for call in calls[:len(stated)]] == stated
            del calls[:len(stated)]
            exchanges += 1
        assert exchanges >= 2


@needs_triton
def test_every_variant_compiles_for_every_target(tmp_path):
    tests = Path(__file__).resolve().parents[3]  # the directory that holds unit/
    report_path = tmp_path / "report.json"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-m", "unit.qgz_compile", "--out",
                    str(report_path)],
                   cwd=tests,
                   env=env,
                   check=True,
                   timeout=1200)
    report = json.loads(report_path.read_text())
    assert not report["problems"], "\n".join(report["problems"])
    from unit import qgz_compile
    compiled = {(entry["variant"].split()[0], entry["variant"].split()[1]) for entry in report["compiled"]}
    kernels = ("_quantize_kernel", "_quantized_reduction_kernel", "_dequantize_kernel")
    assert compiled == {(kernel, f"sm_{arch}") for kernel in kernels for arch in qgz_compile.ARCHES}
    assert 0 < report["largest_grid"] <= tq.GRID_LIMIT


@needs_triton
@pytest.mark.parametrize("ptx, problem", [
    ("div.full.f32 %f3, %f1, %f2;", "an approximate division"),
    ("rcp.approx.ftz.f32 %f2, %f1;", "an approximate division"),
    ("fma.rn.f32 %f4, %f1, %f2, %f3;", "an FMA"),
    ("cvt.rmi.ftz.f32.f32 %f2, %f1;", "a flush-to-zero instruction"),
])
def test_the_ptx_check_names_each_problem(ptx, problem):
    from unit import qgz_compile
    assert any(problem in found for found in qgz_compile.ptx_problems(ptx))
    assert not qgz_compile.ptx_problems("div.rn.f32 %f3, %f1, %f2;\nmul.rn.f32 %f4, %f1, %f2;")


@needs_triton
def test_a_grid_beyond_cudas_limits_is_refused():
    with pytest.raises(ValueError, match="2147483648 programs exceed CUDA's grid limit 2147483647"):
        tq._launch(tq._dequantize_kernel, 2**31, (), {})

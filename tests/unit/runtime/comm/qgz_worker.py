# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One rank of a simulated cluster (deepspeed_qgz.harness.run_world): runs a suite of cases against
the installed DeepSpeed and reports its findings. Every rank builds every rank's inputs from the
same seeds, so each checks its own partition against the exact float64 average."""

import math
import os
import sys
import time
import traceback

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import groups as ds_groups
from deepspeed_qgz.harness import CollectiveCounter, load_upstream_module, same_bits, write_report

# Per-element bound on |result - exact average|, as a multiple of (1/world) * sum over ranks of the
# rank's absmax over the partition: int4 rounding with the absmax clamped from 8 to 7 steps is at
# most absmax / 8 per value at each of the two stages (the second stage's absmax is a node sum).
ERROR_BOUND = 0.3
# Root-mean-square error relative to the exact average's, for inputs whose ranks share a signal;
# a partition delivered to the wrong rank or a wrong divisor gives about 1 or more.
RMS_BOUND = 0.2

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Magnitudes outside fp16's comfort: fp16 near its max (node sums overflow fp16), tiny bf16, huge fp32.
MAGNITUDE = {"fp16": 1e4, "bf16": 1e-6, "fp32": 1e7}


def rank_inputs(shapes, dtype_name, seed, world, magnitudes=None):
    """Every rank's tensors: a shared signal plus rank-specific noise, tensor i scaled by
    magnitudes[i] (default: the dtype's MAGNITUDE)."""
    inputs = [[] for _ in range(world)]
    for i, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        signal = torch.randn(shape, generator=gen, dtype=torch.float64)
        scale = MAGNITUDE[dtype_name] if magnitudes is None else magnitudes[i]
        for rank in range(world):
            noise = torch.randn(shape, generator=gen, dtype=torch.float64)
            inputs[rank].append(((signal + 0.25 * noise) * scale).to(DTYPES[dtype_name]))
    return inputs


def check_outputs(name, inputs, outputs, report, exact_path=None):
    """Each output against reduce_scatter_coalesced's shape and the exact average (per tensor, in
    that tensor's own magnitude)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = inputs[rank]
    failures = report["failures"]
    for i, out in enumerate(outputs):
        numel = mine[i].numel()
        chunk = math.ceil(numel / world)
        lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        if out.shape != (hi - lo, ) or out.dtype != mine[i].dtype:
            failures.append(f"{name}[{i}]: shape {tuple(out.shape)} {out.dtype}, reduce_scatter_coalesced gives "
                            f"({hi - lo},) {mine[i].dtype}")
            continue
        if hi == lo:
            continue
        parts = [inp[i].reshape(-1)[lo:hi].double() for inp in inputs]
        exact = torch.stack(parts).mean(0)
        exact_tensor = mine[i].dim() <= 1 if exact_path is None else exact_path
        if exact_tensor:
            # exact path: the dtype's rounding of the pre-divided shares and of their sum
            bound = 2**-6 * sum(p.abs() for p in parts) / world + 1e-30
        else:
            absmax = sum(p.abs().max() for p in parts) / world
            bound = ERROR_BOUND * absmax + exact.abs() * 2**-7 + 1e-30
        err = (out.double() - exact).abs()
        if not torch.isfinite(out).all():
            failures.append(f"{name}[{i}]: non-finite output")
            continue
        if (err > bound).any():
            j = int((err - bound).argmax())
            failures.append(f"{name}[{i}]: |err| {float(err[j]):.3g} > bound {float(bound[j]):.3g} "
                            f"at {lo + j} (got {float(out[j]):.6g}, exact {float(exact[j]):.6g})")
        if not exact_tensor and exact.numel() >= 64:
            rel = float(err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
            report["max_rel_rms"] = max(report.get("max_rel_rms", 0.0), rel)
            if rel > RMS_BOUND:
                failures.append(f"{name}[{i}]: relative rms error {rel:.3f} > {RMS_BOUND}")


def check_case(name, shapes, dtype_name, seed, groups, report, magnitudes=None, **kwargs):
    """One call against the exact average, and its quantized tensors against the same call
    simulated for the whole cluster in this process, bit for bit."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce
    start = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = rank_inputs(shapes, dtype_name, seed, world, magnitudes)
    mine = inputs[rank]
    originals = [t.clone() for t in mine]
    outputs = cc.all_to_all_quant_reduce(mine, groups, **kwargs)
    stats = cc.qgz_accounting.last_call
    quantized = [i for i, t in enumerate(mine) if t.dim() > 1 and t.numel() > 0]
    if stats.quantized_tensors != len(quantized):
        report["failures"].append(f"{name}: {stats.quantized_tensors} of {len(quantized)} multi-dim tensors quantized")
    if not all(same_bits(a, b) for a, b in zip(mine, originals)):
        report["failures"].append(f"{name}: the caller's tensors were written to")
    check_outputs(name, inputs, outputs, report)
    if quantized:
        simulated, _ = simulate_all_to_all_quant_reduce([[ranks[i] for i in quantized] for ranks in inputs],
                                                        world // int(os.environ["LOCAL_SIZE"]),
                                                        int(os.environ["LOCAL_SIZE"]), **kwargs)
        if not all(same_bits(outputs[i], sim) for i, sim in zip(quantized, simulated[rank])):
            report["failures"].append(f"{name}: differs from the simulated cluster")
    report["cases"] += 1
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 3)
    return outputs


def topology_suite(groups, report):
    world = dist.get_world_size()
    shape_sets = {
        "odd2d": [(7, 5)],
        "3d": [(3, 5, 7)],
        "tiny": [(1, 3)],
        "world": [(world, 1)],
        "vocab": [(3141, 48)],
        "bucket": [(33, 17), (64, ), (5, 5, 5), (0, 4), (1, 2), (128, 96), (11, ), (2, 1, 1)],
    }
    seed = 1
    for bits in INTRA_NODE_BITS:
        for name, shapes in shape_sets.items():
            for dtype_name in DTYPES:
                seed += 1
                check_case(f"{name}/{dtype_name}/{bits}",
                           shapes,
                           dtype_name,
                           seed,
                           groups,
                           report,
                           intra_node_bits=bits)
        # One group size for the whole call: no group may mix two tensors, so a tensor 10^6 times
        # smaller than its neighbours keeps its own precision.
        for dtype_name, magnitudes in (("fp32", [1e-3, 1e3, 1.0,
                                                 1e-3]), ("bf16", [1e-3, 1e3, 1.0,
                                                                   1e-3]), ("fp16", [1e-2, 1e4, 1.0, 1e-2])):
            seed += 1
            check_case(f"mixed-magnitude/{dtype_name}/{bits}", [(33, 17), (64, 48), (5, 5, 5), (1, 9)],
                       dtype_name,
                       seed,
                       groups,
                       report,
                       magnitudes,
                       intra_node_bits=bits)
        for group_size in (136, 1024):
            seed += 1
            check_case(f"group-size-{group_size}/{bits}", [(33, 17), (300, 7)],
                       "bf16",
                       seed,
                       groups,
                       report,
                       group_size=group_size,
                       intra_node_bits=bits)
        accounting(groups, report, bits)
        determinism(groups, report, bits)
        non_finite(groups, report, bits)
    bad_input(groups, report)


def accounting(groups, report, bits):
    """qgz_accounting's calls and bytes against what actually went through the collectives."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world_size = int(os.environ["LOCAL_SIZE"])
    mine = rank_inputs([(33, 17), (64, ), (5, 5, 5), (11, )], "bf16", 123, world)[rank]
    with CollectiveCounter([cc], world, local_world_size) as seen:
        cc.all_to_all_quant_reduce(mine, groups, intra_node_bits=bits)
    stats = cc.qgz_accounting.last_call
    got = (stats.collective_calls, stats.intra_node_bytes, stats.inter_node_bytes)
    expected = (seen.calls, seen.intra_bytes, seen.inter_bytes)
    if got != expected or seen.calls > 3:
        report["failures"].append(
            f"accounting/{bits}: reported (calls, intra, inter) {got}, collectives saw {expected}")


def determinism(groups, report, bits):
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = rank_inputs([(45, 33), (17, )], "bf16", 99, world)[rank]
    first = cc.all_to_all_quant_reduce(mine, groups, intra_node_bits=bits)
    second = cc.all_to_all_quant_reduce([t.clone() for t in mine], groups, intra_node_bits=bits)
    if not all(same_bits(a, b) for a, b in zip(first, second)):
        report["failures"].append(f"determinism/{bits}: two identical calls differ")


def non_finite(groups, report, bits):
    """A NaN in the last rank's input inside rank 0's partition, and an inf in rank 0's input inside
    the last rank's partition, must reach their owners, and only them."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (world * 5, 7)
    chunk = math.ceil(shape[0] * shape[1] / world)
    for dtype_name in DTYPES:
        mine = rank_inputs([shape], dtype_name, 7, world)[rank][0].clone()
        flat = mine.view(-1)
        if rank == world - 1:
            flat[chunk // 2] = float("nan")
        if rank == 0:
            flat[(world - 1) * chunk + 1] = float("inf")
        out = cc.all_to_all_quant_reduce([mine], groups, intra_node_bits=bits)[0]
        poisoned = rank in (0, world - 1)
        if poisoned and torch.isfinite(out).all():
            report["failures"].append(f"non-finite/{dtype_name}/{bits}: rank {rank}'s partition lost a NaN/inf")
        if not poisoned and not torch.isfinite(out).all():
            report["failures"].append(f"non-finite/{dtype_name}/{bits}: rank {rank}'s partition became non-finite")


def bad_input(groups, report):
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world_size = int(os.environ["LOCAL_SIZE"])
    num_nodes = world // local_world_size
    cases = {
        "int dtype":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4, dtype=torch.int32)], groups), "unsupported dtype"),
        "mixed dtypes":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4), torch.ones(4, 4).half()], groups), "share a dtype"),
        "group size":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], groups, group_size=100), "group_size 100"),
        "sub-warp group size":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], groups, group_size=128), "between 136 and"),
        "intra-node bits": (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], groups, intra_node_bits=2),
                            "intra_node_bits 2 must be one of (4, 8)"),
    }
    if num_nodes > 1:
        cases["missing group"] = (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], {}), "groups has no")
    if num_nodes > 1 and num_nodes != local_world_size:
        node, local_rank = divmod(rank, local_world_size)
        swapped = dict(groups)
        swapped[f"local_{node}"] = groups[f"global_{local_rank}"]
        cases["mismatched group"] = (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], swapped),
                                     f"expected {local_world_size}")

    class IndivisibleAccelerator:

        def device_count(self):
            return world + 1

    def indivisible_world():
        real = cc.get_accelerator
        cc.get_accelerator = IndivisibleAccelerator
        try:
            cc.all_to_all_quant_reduce([torch.ones(4, 4)], groups)
        finally:
            cc.get_accelerator = real

    cases["world not divisible"] = (indivisible_world, "not a multiple of the accelerator's device count")
    for name, (call, expected) in cases.items():
        try:
            call()
            report["failures"].append(f"bad input '{name}': no error")
        except ValueError as exc:
            if expected not in str(exc):
                report["failures"].append(f"bad input '{name}': unexpected message {exc}")
    if cc.all_to_all_quant_reduce([], groups) != []:
        report["failures"].append("empty list: expected []")
    # A call of 1-D tensors only exchanges nothing quantized: it needs no groups.
    inputs = rank_inputs([(10, ), (3, )], "bf16", 5, world)
    check_outputs("1-D only, no groups", inputs, cc.all_to_all_quant_reduce(inputs[rank], {}), report)


def npu_quantizer_suite(groups, report):
    """DeepSpeed's pure-PyTorch NPUQuantizer, set on coalesced_collectives.quantizer_module as
    DeepSpeed's own test does, is the quantizer used. It truncates where the CUDA kernels round;
    rank r holding -(r + 1) everywhere is exact at every stage in both, so the average is exact in
    fp16 and bf16 (fp32 would show the last-bit error of the kernels' reciprocal scales)."""
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    saved = cc.quantizer_module
    cc.quantizer_module = NPUQuantizer
    calls = []
    real = NPUQuantizer.swizzle_quant
    NPUQuantizer.swizzle_quant = staticmethod(lambda *args: calls.append(1) or real(*args))
    try:
        for bits in INTRA_NODE_BITS:
            for dtype_name in NPU_DTYPES:
                value = -(rank + 1.0)
                tensors = [torch.full((8, 16), value), torch.full((3, 5, 7), value), torch.full((16, ), value)]
                outputs = cc.all_to_all_quant_reduce([t.to(DTYPES[dtype_name]) for t in tensors],
                                                     groups,
                                                     intra_node_bits=bits)
                average = -(world + 1) / 2
                for i, out in enumerate(outputs):
                    if not torch.equal(out.double(), torch.full_like(out.double(), average)):
                        report["failures"].append(f"NPUQuantizer/{dtype_name}/{bits}[{i}]: got {out.tolist()[:4]}..., "
                                                  f"expected {average} everywhere")
                report["cases"] += 1
    finally:
        cc.quantizer_module = saved
        NPUQuantizer.swizzle_quant = staticmethod(real)
    # one swizzle_quant per call at 4 bits inside the node, two at 8 (the node sums are requantized)
    expected = len(NPU_DTYPES) * (1 + 2)
    if len(calls) != expected:
        report["failures"].append(f"NPUQuantizer: swizzle_quant called {len(calls)} times, expected {expected}")


def differential_suite(groups, report):
    """reduce_scatter_coalesced against upstream's, bit for bit."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    upstream = load_upstream_module("runtime/comm/coalesced_collectives.py", "upstream_coalesced_collectives")
    report["upstream_file"] = upstream.__file__
    world, rank = dist.get_world_size(), dist.get_rank()
    shape_sets = [[(world * 4, )], [(world * 3, 5)], [(7, 3)], [(1, )], [(2, )], [(5, 3), (world * 2, ), (1, ),
                                                                                  (9, 9)], [(world - 1, )],
                  [(101, 13), (3, )]]
    for s, shapes in enumerate(shape_sets):
        for dtype_name in DTYPES:
            mine = rank_inputs(shapes, dtype_name, 500 + s, world)[rank]
            ours = cc.reduce_scatter_coalesced([t.clone() for t in mine])
            theirs = upstream.reduce_scatter_coalesced([t.clone() for t in mine])
            for i, (a, b) in enumerate(zip(ours, theirs)):
                if not same_bits(a, b):
                    report["failures"].append(f"differential {shapes}[{i}] {dtype_name}: differs from upstream")
            report["cases"] += 1


NPU_DTYPES = ("fp16", "bf16")
INTRA_NODE_BITS = (4, 8)
SUITES = {"topology": topology_suite, "differential": differential_suite, "npu": npu_quantizer_suite}


def main():
    t0 = time.perf_counter()
    suites = sys.argv[1].split(",")
    report = {"rank": int(os.environ["RANK"]), "failures": [], "cases": 0}
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        report["init_s"] = round(time.perf_counter() - t0, 2)
        groups = ds_groups._get_local_all_to_all_group() if dist.get_world_size() > 1 else {}
        for suite in suites:
            SUITES[suite](groups, report)
        from deepspeed.runtime.comm import coalesced_collectives as cc
        report["module"] = cc.__file__
        report["totals"] = vars(cc.qgz_accounting.totals)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        report["failures"].append(traceback.format_exc())
    write_report(report)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One rank of a simulated cluster (see qgz_launch.py): runs a suite of cases against the installed
DeepSpeed and writes its findings to OUT_DIR/rank{RANK}.json. Every rank builds every rank's inputs
from the same seeds, so each checks its own partition against the exact float64 average."""

import importlib.util
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.utils import groups as ds_groups

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


def rank_inputs(shapes, dtype_name, seed, world):
    """Every rank's tensors: a shared signal plus rank-specific noise."""
    inputs = [[] for _ in range(world)]
    for i, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        signal = torch.randn(shape, generator=gen, dtype=torch.float64)
        for rank in range(world):
            noise = torch.randn(shape, generator=gen, dtype=torch.float64)
            value = (signal + 0.25 * noise) * MAGNITUDE[dtype_name]
            inputs[rank].append(value.to(DTYPES[dtype_name]))
    return inputs


def check_case(name, shapes, dtype_name, seed, groups, report):
    from deepspeed.runtime.comm import coalesced_collectives as cc
    start = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    inputs = rank_inputs(shapes, dtype_name, seed, world)
    mine = inputs[rank]
    outputs = cc.all_to_all_quant_reduce(mine, groups)
    stats = cc.qgz_accounting.last_call
    reference = cc.reduce_scatter_coalesced([t.clone() for t in mine])
    failures = report["failures"]
    multi_dim = sum(1 for t in mine if t.dim() > 1 and t.numel() > 0)
    if stats.quantized_tensors != multi_dim:
        failures.append(f"{name}: {stats.quantized_tensors} of {multi_dim} multi-dim tensors quantized (fallback)")
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        if out.shape != ref.shape or out.dtype != mine[i].dtype:
            failures.append(f"{name}[{i}]: shape {tuple(out.shape)} {out.dtype}, reduce_scatter_coalesced gives "
                            f"{tuple(ref.shape)} {mine[i].dtype}")
            continue
        numel = mine[i].numel()
        if numel == 0:
            continue
        chunk = math.ceil(numel / world)
        lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        parts = [inp[i].reshape(-1)[lo:hi].double() for inp in inputs]
        exact = torch.stack(parts).mean(0)
        if hi == lo:
            continue
        if mine[i].dim() <= 1:
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
            failures.append(f"{name}[{i}] {dtype_name}: |err| {float(err[j]):.3g} > bound {float(bound[j]):.3g} "
                            f"at {lo + j} (got {float(out[j]):.6g}, exact {float(exact[j]):.6g})")
        if mine[i].dim() > 1 and exact.numel() >= 64:
            rel = float(err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
            report["max_rel_rms"] = max(report.get("max_rel_rms", 0.0), rel)
            if rel > RMS_BOUND:
                failures.append(f"{name}[{i}] {dtype_name}: relative rms error {rel:.3f} > {RMS_BOUND}")
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
    for name, shapes in shape_sets.items():
        for dtype_name in DTYPES:
            seed += 1
            check_case(f"{name}/{dtype_name}", shapes, dtype_name, seed, groups, report)
    accounting(groups, report)
    determinism(groups, report)
    non_finite(groups, report)
    bad_input(groups, report)


def accounting(groups, report):
    """qgz_accounting's calls and bytes against what actually went through the collectives."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    local_size = int(os.environ["LOCAL_SIZE"])
    local_group = groups[f"local_{rank // local_size}"]
    seen = {"calls": 0, "intra": 0, "inter": 0}
    real_a2a, real_rs = cc.all_to_all_single, dist.reduce_scatter_fn

    def a2a(output, tensor, group=None, **kwargs):
        size = dist.get_world_size(group)
        seen["calls"] += 1
        sent = tensor.numel() * tensor.element_size() * (size - 1) // size
        seen["intra" if group is local_group else "inter"] += sent
        return real_a2a(output, tensor, group=group, **kwargs)

    def rs(output, tensor, group=None, **kwargs):
        share = tensor.numel() * tensor.element_size() // world
        seen["calls"] += 1
        seen["intra"] += (local_size - 1) * share
        seen["inter"] += (world - local_size) * share
        return real_rs(output, tensor, group=group, **kwargs)

    cc.all_to_all_single, dist.reduce_scatter_fn = a2a, rs
    try:
        mine = rank_inputs([(33, 17), (64, ), (5, 5, 5), (11, )], "bf16", 123, world)[rank]
        cc.all_to_all_quant_reduce(mine, groups)
    finally:
        cc.all_to_all_single, dist.reduce_scatter_fn = real_a2a, real_rs
    stats = cc.qgz_accounting.last_call
    got = {"calls": stats.collective_calls, "intra": stats.intra_node_bytes, "inter": stats.inter_node_bytes}
    if got != seen or seen["calls"] > 3:
        report["failures"].append(f"accounting: reported {got}, collectives saw {seen}")


def determinism(groups, report):
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = rank_inputs([(45, 33), (17, )], "bf16", 99, world)[rank]
    first = cc.all_to_all_quant_reduce(mine, groups)
    second = cc.all_to_all_quant_reduce([t.clone() for t in mine], groups)
    for a, b in zip(first, second):
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            report["failures"].append("determinism: two identical calls differ")


def non_finite(groups, report):
    """A NaN in the last rank's input inside rank 0's partition, and an inf in rank 0's input inside
    the last rank's partition, must reach their owners, and only them."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = (world * 5, 7)
    chunk = math.ceil(shape[0] * shape[1] / world)
    for dtype_name in ("fp16", "bf16"):
        mine = rank_inputs([shape], dtype_name, 7, world)[rank][0].clone()
        flat = mine.view(-1)
        if rank == world - 1:
            flat[chunk // 2] = float("nan")
        if rank == 0:
            flat[(world - 1) * chunk + 1] = float("inf")
        out = cc.all_to_all_quant_reduce([mine], groups)[0]
        poisoned = rank in (0, world - 1)
        if poisoned and torch.isfinite(out).all():
            report["failures"].append(f"non-finite/{dtype_name}: rank {rank}'s partition lost a NaN/inf")
        if not poisoned and not torch.isfinite(out).all():
            report["failures"].append(f"non-finite/{dtype_name}: rank {rank}'s partition became non-finite")


def bad_input(groups, report):
    from deepspeed.runtime.comm import coalesced_collectives as cc
    world, rank = dist.get_world_size(), dist.get_rank()
    cases = {
        "missing group": (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], {}), "groups has no"),
        "int dtype":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4, dtype=torch.int32)], groups), "unsupported dtype"),
        "mixed dtypes":
        (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4), torch.ones(4, 4).half()], groups), "share a dtype"),
    }
    local_size = int(os.environ["LOCAL_SIZE"])
    num_nodes = world // local_size
    if num_nodes > 1 and num_nodes != local_size:
        node, local_rank = divmod(rank, local_size)
        swapped = dict(groups)
        swapped[f"local_{node}"] = groups[f"global_{local_rank}"]
        cases["mismatched group"] = (lambda: cc.all_to_all_quant_reduce([torch.ones(4, 4)], swapped),
                                     f"expected {local_size}")

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


def load_upstream_coalesced():
    """DeepSpeed's own coalesced_collectives.py, loaded from the installed package's file."""
    path = Path(importlib.util.find_spec("deepspeed").origin).parent / "runtime" / "comm" / "coalesced_collectives.py"
    spec = importlib.util.spec_from_file_location("upstream_coalesced_collectives", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def differential_suite(groups, report):
    """reduce_scatter_coalesced against upstream's, bit for bit."""
    from deepspeed.runtime.comm import coalesced_collectives as cc
    upstream = load_upstream_coalesced()
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
                same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                                 b.contiguous().view(torch.uint8))
                if not same:
                    report["failures"].append(f"differential {shapes}[{i}] {dtype_name}: differs from upstream")
            report["cases"] += 1


def main():
    t0 = time.perf_counter()
    suite, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    report = {"rank": rank, "failures": [], "cases": 0}
    try:
        report["import_s"] = round(time.perf_counter() - t0, 2)
        deepspeed.init_distributed(dist_backend="gloo")
        report["init_s"] = round(time.perf_counter() - t0, 2)
        groups = ds_groups._get_local_all_to_all_group() if dist.get_world_size() > 1 else {}
        {"topology": topology_suite, "differential": differential_suite}[suite](groups, report)
        from deepspeed.runtime.comm import coalesced_collectives as cc
        report["module"] = cc.__file__
        report["totals"] = vars(cc.qgz_accounting.totals)
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        report["failures"].append(traceback.format_exc())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier() if dist.is_initialized() else None


if __name__ == "__main__":
    main()

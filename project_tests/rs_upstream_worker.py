# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One rank of a gloo world (qgz_harness.run_world): reduce_scatter_coalesced against DeepSpeed
0.19.8's own, bit for bit. Every rank builds every rank's inputs from the same seeds."""

import os
import sys
import traceback
from pathlib import Path

import torch

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from qgz_harness import load_upstream_module, release_deepspeed_shm, same_bits, write_report  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def rank_inputs(shapes, dtype_name, seed, world):
    """Every rank's tensors: a shared signal plus rank-specific noise."""
    inputs = [[] for _ in range(world)]
    for i, shape in enumerate(shapes):
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        signal = torch.randn(shape, generator=gen, dtype=torch.float64)
        for rank in range(world):
            noise = torch.randn(shape, generator=gen, dtype=torch.float64)
            inputs[rank].append(((signal + 0.25 * noise) * 1e3).to(DTYPES[dtype_name]))
    return inputs


def differential_suite(report):
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


def main():
    report = {"rank": int(os.environ["RANK"]), "failures": [], "cases": 0}
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        release_deepspeed_shm()
        differential_suite(report)
        from deepspeed.runtime.comm import coalesced_collectives as cc
        report["module"] = cc.__file__
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
        report["failures"].append(traceback.format_exc())
    write_report(report)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

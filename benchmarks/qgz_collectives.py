# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Side-by-side cost of one gradient reduce-scatter call on a simulated cluster (gloo, one process
per rank, default 3 nodes x 2), on the same buckets in one run:

  (a) qgz      this project's all_to_all_quant_reduce (coalesced, padded, any node count)
  (b) upstream DeepSpeed 0.19.8's all_to_all_quant_reduce, loaded from the installed file, with
               the CPU quantizer op supplied as its quantizer (falls back per tensor as 0.19.8 does)
  (c) fp16-rs  the fp16 reduce_scatter_coalesced that qgZ replaces

Reports the median over --repeats of the slowest rank's wall time, collective calls, the bytes each
rank sends inside its node and across nodes, padding, and a time modeled for a real cluster from
those counts. Writes qgz_collectives.json, .md and .png to --out.

    python benchmarks/qgz_collectives.py [--nodes 3 --devices 2] [--repeats 7] [--out DIR]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Modeled cluster: per-collective latency and per-rank link bandwidths.
LATENCY_S = 20e-6
INTRA_NODE_BPS = 300e9
INTER_NODE_BPS = 25e9


def buckets():
    """name -> list of gradient shapes (fp16)."""

    def block(hidden, ffn):
        return [(3 * hidden, hidden), (3 * hidden, ), (hidden, hidden), (hidden, ), (ffn, hidden), (ffn, ),
                (hidden, ffn), (hidden, ), (hidden, ), (hidden, )]

    return {
        "block-515 (odd)": block(515, 1379),
        "block-528 (upstream-aligned)": block(528, 1392),
        "48 x (96, 64)": [(96, 64)] * 48,
    }


# ----------------------------------------------------------------------------------------------
# worker (one rank)
# ----------------------------------------------------------------------------------------------


class Traffic:
    """Counts collective calls and the bytes this rank sends to ranks inside / outside its node."""

    def __init__(self, local_group, world, local_size):
        self.local_group, self.world, self.local_size = local_group, world, local_size
        self.reset()

    def reset(self):
        self.calls, self.intra, self.inter = 0, 0, 0

    def all_to_all(self, fn, size_of):

        def counted(output, tensor, group=None, **kwargs):
            size = size_of(group)
            self.calls += 1
            sent = tensor.numel() * tensor.element_size() * (size - 1) // size
            if group is self.local_group:
                self.intra += sent
            else:
                self.inter += sent
            return fn(output, tensor, group=group, **kwargs)

        return counted

    def reduce_scatter(self, fn):

        def counted(output, tensor, group=None, **kwargs):
            self.calls += 1
            chunk = tensor.numel() * tensor.element_size() // self.world
            self.intra += (self.local_size - 1) * chunk
            self.inter += (self.world - self.local_size) * chunk
            return fn(output, tensor, group=group, **kwargs)

        return counted


def worker(args):
    import importlib.util

    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import groups as ds_groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_size = args.devices
    groups = ds_groups._get_local_all_to_all_group()
    from deepspeed.runtime.comm import coalesced_collectives as ours
    from deepspeed.ops.op_builder.cpu.quantizer import QuantizerBuilder
    checked = QuantizerBuilder().load()

    path = Path(importlib.util.find_spec("deepspeed").origin).parent / "runtime/comm/coalesced_collectives.py"
    spec = importlib.util.spec_from_file_location("upstream_coalesced_collectives", path)
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    # 0.19.8's code runs whatever layout it computes, as the unchecked CUDA kernels would.
    upstream.quantizer_module = checked.ops
    upstream.logger.setLevel("ERROR")  # one fallback warning per tensor per call otherwise

    traffic = Traffic(groups[f"local_{rank // local_size}"], world, local_size)
    size_of = lambda group: dist.get_world_size(group)  # noqa: E731
    for module in (ours, upstream):
        module.all_to_all_single = traffic.all_to_all(module.all_to_all_single, size_of)
    dist.reduce_scatter_fn = traffic.reduce_scatter(dist.reduce_scatter_fn)

    methods = {
        "qgz": lambda ts: ours.all_to_all_quant_reduce(ts, groups),
        "upstream": lambda ts: upstream.all_to_all_quant_reduce(ts, groups),
        "fp16-rs": lambda ts: ours.reduce_scatter_coalesced(ts),
    }
    results = []
    for bucket, shapes in buckets().items():
        gen = torch.Generator().manual_seed(rank)
        tensors = [torch.randn(shape, generator=gen).half() for shape in shapes]
        elems = sum(t.numel() for t in tensors)
        for method, call in methods.items():
            row = {"bucket": bucket, "method": method, "tensors": len(tensors), "elems": elems}
            try:
                call([t.clone() for t in tensors])  # warm-up
                traffic.reset()
                ours.qgz_accounting.reset()
                call([t.clone() for t in tensors])
                row.update(calls=traffic.calls, intra_bytes=traffic.intra, inter_bytes=traffic.inter)
                if method == "qgz":
                    row["padding_elems"] = ours.qgz_accounting.last_call.padding_elems
                    row["quantized_elems"] = ours.qgz_accounting.last_call.quantized_elems
                times = []
                for _ in range(args.repeats):
                    inputs = [t.clone() for t in tensors]
                    dist.barrier()
                    start = time.perf_counter()
                    call(inputs)
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times.append(float(elapsed))
                row["median_s"] = statistics.median(times)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                dist.barrier()
            results.append(row)
    if rank == 0:
        Path(args.out, "qgz_collectives.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


# ----------------------------------------------------------------------------------------------
# launcher and report
# ----------------------------------------------------------------------------------------------


def modeled_s(row):
    return row["calls"] * LATENCY_S + row["intra_bytes"] / INTRA_NODE_BPS + row["inter_bytes"] / INTER_NODE_BPS


def report(results, args):
    by_key = {(r["bucket"], r["method"]): r for r in results}
    lines = [
        f"{args.nodes} nodes x {args.devices} ranks (gloo on one {os.cpu_count()}-core machine), fp16 gradients, "
        f"median of {args.repeats}; modeled: {LATENCY_S * 1e6:.0f} us per collective, "
        f"{INTRA_NODE_BPS / 1e9:.0f} GB/s in a node, {INTER_NODE_BPS / 1e9:.0f} GB/s between nodes", "",
        "| bucket | method | wall ms | vs upstream | calls | intra-node KB | inter-node KB | inter vs fp16-rs "
        "| padding | modeled us |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    ]
    for bucket in buckets():
        up, rs = by_key.get((bucket, "upstream")), by_key[(bucket, "fp16-rs")]
        for method in ("qgz", "upstream", "fp16-rs"):
            r = by_key[(bucket, method)]
            if "error" in r:
                lines.append(f"| {bucket} | {method} | error: {r['error']} | | | | | | | |")
                continue
            speedup = (f"{up['median_s'] / r['median_s']:.1f}x" if up and "error" not in up else "")
            padding = f"{r['padding_elems'] / r['elems']:.2%}" if "padding_elems" in r else ""
            lines.append(f"| {bucket} | {method} | {r['median_s'] * 1e3:.2f} | {speedup} | {r['calls']} | "
                         f"{r['intra_bytes'] / 1e3:.1f} | {r['inter_bytes'] / 1e3:.1f} | "
                         f"{r['inter_bytes'] / rs['inter_bytes']:.3f}x | {padding} | {modeled_s(r) * 1e6:.0f} |")
    return "\n".join(lines)


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(buckets())
    methods = ["qgz", "upstream", "fp16-rs"]
    by_key = {(r["bucket"], r["method"]): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, label in ((axes[0], lambda r: r["median_s"] * 1e3, "measured wall time, ms (gloo, CPU)"),
                              (axes[1], lambda r: modeled_s(r) * 1e6, "modeled cluster time, us")):
        width = 0.27
        for i, method in enumerate(methods):
            values = [metric(by_key[(b, method)]) if "error" not in by_key[(b, method)] else 0 for b in names]
            ax.bar([x + (i - 1) * width for x in range(len(names))], values, width, label=method)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=8)
        ax.set_title(label)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle("one reduce-scatter call per bucket: qgZ (this project) vs DeepSpeed 0.19.8 vs fp16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=".")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    world, port = args.nodes * args.devices, free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ,
                   RANK=str(rank),
                   WORLD_SIZE=str(world),
                   LOCAL_RANK=str(rank % args.devices),
                   LOCAL_SIZE=str(args.devices),
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        sys.exit(f"benchmark ranks failed: exit codes {codes}")
    results = json.loads(Path(args.out, "qgz_collectives.json").read_text())
    table = report(results, args)
    print(table)
    Path(args.out, "qgz_collectives.md").write_text(table + "\n")
    chart(results, Path(args.out, "qgz_collectives.png"))
    print(f"wrote {args.out}/qgz_collectives.json, .md, .png")


if __name__ == "__main__":
    sys.exit(main())

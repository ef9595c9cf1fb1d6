# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Side-by-side cost of one gradient reduce-scatter call on a simulated cluster (gloo, one process
per rank, default 3 nodes x 2), on the same buckets in one run:

  qgz-4/4      the series' all_to_all_quant_reduce (upstream/, what the overlay installs) at its
               defaults, int4 inside and across nodes, with the CPU quantizer op as its kernels
  qgz-8/4      the same, int8 inside the node, int4 across
  upstream     DeepSpeed 0.19.8's all_to_all_quant_reduce, loaded from the installed file, with
               the CPU quantizer op as its quantizer (per tensor; falls back as 0.19.8 does; its
               sub-warp reductions computed as if CUDA defined them)
  rs           reduce_scatter_coalesced (what ZeRO-3 runs with qgZ off; the series leaves it as it is)

For each: the slowest rank's median wall time here, the work a GPU would launch (dispatched ATen
ops, quantizer kernel calls, bytes of the tensors each reads or writes, per gradient element), the
collectives and the bytes each rank sends inside and across nodes, and two modeled times: the GPU
work (LAUNCH_S per op or kernel, HBM_BPS) and the network (LATENCY_S per collective, link bandwidths).
Then, in fresh worlds, the extra peak resident memory of one call on a large single tensor, with
glibc's mmap threshold fixed at 1 MB (MALLOC_MMAP_THRESHOLD_) so that what a call frees goes back to
the system and the peak is the call's, not the C library's retention.
Writes qgz_collectives.json, .md and .png to --out.

    python benchmarks/qgz_collectives.py [--nodes 3 --devices 2] [--repeats 7] [--out DIR]
"""

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from qgz_harness import log, run_world  # noqa: E402

# Modeled GPU: a launch per dispatched op or kernel, memory-bound at HBM bandwidth (H100/H200-class).
LAUNCH_S = 5e-6
HBM_BPS = 3e12
# Modeled network: per-collective latency and per-rank link bandwidths.
LATENCY_S = 20e-6
INTRA_NODE_BPS = 300e9
INTER_NODE_BPS = 25e9

DTYPES = ("fp16", "bf16")
METHODS = ("qgz-4/4", "qgz-8/4", "upstream", "rs")
MEMORY_METHODS = ("qgz-4/4", "qgz-8/4", "upstream")
# A large single tensor for the memory measurement: 4096 x 6144 = 25.2M elements, a multiple of
# 2 x world at 3x2, so 0.19.8 quantizes it too.
MEMORY_SHAPE = (4096, 6144)
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "1048576"}


def buckets():
    """name -> list of gradient shapes."""

    def block(hidden, ffn):
        return [(3 * hidden, hidden), (3 * hidden, ), (hidden, hidden), (hidden, ), (ffn, hidden), (ffn, ),
                (hidden, ffn), (hidden, ), (hidden, ), (hidden, )]

    return {
        "1 x (96, 64)": [(96, 64)],
        "8 x (96, 64)": [(96, 64)] * 8,
        "48 x (96, 64)": [(96, 64)] * 48,
        "block-515 (odd)": block(515, 1379),
        "block-528 (upstream-aligned)": block(528, 1392),
    }


# ----------------------------------------------------------------------------------------------
# worker (one rank)
# ----------------------------------------------------------------------------------------------


def setup_rank():
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed_qgz import cpu_quantizer
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
    from deepspeed.runtime.comm import coalesced_collectives as ours
    from deepspeed.utils import groups as ds_groups
    from qgz_harness import BeyondContract, load_upstream_module, release_deepspeed_shm

    deepspeed.init_distributed(dist_backend="gloo")
    release_deepspeed_shm()
    groups = ds_groups._get_local_all_to_all_group()
    ops = cpu_quantizer.load()
    upstream = load_upstream_module("runtime/comm/coalesced_collectives.py", "upstream_coalesced_collectives")
    upstream.logger.setLevel("ERROR")  # one fallback warning per tensor per call otherwise
    # 0.19.8's code runs whatever layout it computes, as the unchecked CUDA kernels would.
    quantizers = {"ours": ContractCheckedQuantizer(ops), "upstream": BeyondContract(ops)}
    return dist, groups, ours, upstream, quantizers


def methods(ours, upstream, groups):
    return {
        "qgz-4/4": (ours, lambda ts: ours.all_to_all_quant_reduce(ts, groups, intra_node_bits=4)),
        "qgz-8/4": (ours, lambda ts: ours.all_to_all_quant_reduce(ts, groups, intra_node_bits=8)),
        "upstream": (upstream, lambda ts: upstream.all_to_all_quant_reduce(ts, groups)),
        "rs": (ours, lambda ts: ours.reduce_scatter_coalesced(ts)),
    }


def work_worker(args):
    import torch
    from qgz_harness import CollectiveCounter, WorkCounter, write_report

    dist, groups, ours, upstream, quantizers = setup_rank()
    ours.quantizer_module, upstream.quantizer_module = quantizers["ours"], quantizers["upstream"]
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for bucket, shapes in buckets().items():
        for dtype_name in DTYPES:
            gen = torch.Generator().manual_seed(rank)
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
            tensors = [torch.randn(shape, generator=gen).to(dtype) for shape in shapes]
            elems = sum(t.numel() for t in tensors)
            for method, (module, call) in methods(ours, upstream, groups).items():
                row = {
                    "bucket": bucket,
                    "dtype": dtype_name,
                    "method": method,
                    "tensors": len(tensors),
                    "elems": elems
                }
                quantizer = quantizers["ours" if module is ours else "upstream"]
                try:
                    call([t.clone() for t in tensors])  # warm-up
                    inputs = [t.clone() for t in tensors]
                    work = WorkCounter()
                    module.quantizer_module = work.counting_quantizer(quantizer)
                    with CollectiveCounter([ours, upstream], world, args.devices) as traffic:
                        with work:
                            call(inputs)
                    module.quantizer_module = quantizer
                    row.update(ops=work.ops,
                               kernel_calls=work.kernel_calls,
                               bytes=work.bytes,
                               collectives=traffic.calls,
                               intra_bytes=traffic.intra_bytes,
                               inter_bytes=traffic.inter_bytes)
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
                    module.quantizer_module = quantizer
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    dist.barrier()
                results.append(row)
    write_report({"results": results})
    dist.barrier()
    dist.destroy_process_group()


def memory_worker(args):
    """Extra peak resident memory of one call on a tensor of --memory-shape, in a fresh process: the
    peak before the call (imports, a warm-up call on a small tensor, the input) against the peak
    after it."""
    import torch
    from qgz_harness import write_report

    dist, groups, ours, upstream, quantizers = setup_rank()
    ours.quantizer_module, upstream.quantizer_module = quantizers["ours"], quantizers["upstream"]
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.memory_dtype]
    call = methods(ours, upstream, groups)[args.memory_method][1]
    call([torch.ones(96, 64, dtype=dtype)])
    tensor = torch.randn(*args.memory_shape, dtype=dtype)
    gc.collect()
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    error = None
    try:
        outputs = call([tensor])
        del outputs
    except Exception as exc:  # noqa: BLE001 - reported in the table
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    write_report({"extra_bytes": after - before, "elems": tensor.numel(), "error": error})
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# launcher and report
# ----------------------------------------------------------------------------------------------


def gpu_s(row):
    return (row["ops"] + row["kernel_calls"]) * LAUNCH_S + row["bytes"] / HBM_BPS


def network_s(row):
    return row["collectives"] * LATENCY_S + row["intra_bytes"] / INTRA_NODE_BPS + row["inter_bytes"] / INTER_NODE_BPS


def report(results, memory, args):
    by_key = {(r["bucket"], r["dtype"], r["method"]): r for r in results}
    lines = [
        f"{args.nodes} nodes x {args.devices} ranks (gloo on one {os.cpu_count()}-core machine), median of "
        f"{args.repeats}. Modeled GPU: {LAUNCH_S * 1e6:.0f} us per op or kernel, {HBM_BPS / 1e12:.0f} TB/s; "
        f"network: {LATENCY_S * 1e6:.0f} us per collective, {INTRA_NODE_BPS / 1e9:.0f} GB/s in a node, "
        f"{INTER_NODE_BPS / 1e9:.0f} GB/s between nodes. Bytes per element: of the tensors each op or kernel "
        "reads or writes, per gradient element (collectives' own traffic excluded).", "",
        "| bucket | dtype | method | ops | per added tensor | kernels | collectives | bytes / elem | "
        "intra-node KB | intra vs rs | inter-node KB | inter vs rs | modeled GPU us | modeled network us | "
        "wall ms |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    ]
    singles = {(r["dtype"], r["method"]): r for r in results if r["bucket"] == "1 x (96, 64)" and "error" not in r}
    for bucket in buckets():
        for dtype_name in DTYPES:
            rs = by_key[(bucket, dtype_name, "rs")]
            for method in METHODS:
                r = by_key[(bucket, dtype_name, method)]
                if "error" in r:
                    why = ("its kernels take fp16 (on CUDA they read bf16 bits as fp16; the CPU op refuses)"
                           if method == "upstream" and dtype_name != "fp16" else r["error"])
                    lines.append(f"| {bucket} | {dtype_name} | {method} | n/a: {why} |||||||||||")
                    continue
                single = singles.get((dtype_name, method))
                per_tensor = ""
                if single and r["tensors"] > 1 and bucket.endswith("(96, 64)"):
                    added = r["ops"] + r["kernel_calls"] - single["ops"] - single["kernel_calls"]
                    per_tensor = f"{added / (r['tensors'] - 1):.1f}"
                lines.append(
                    f"| {bucket} | {dtype_name} | {method} | {r['ops']} | {per_tensor} | {r['kernel_calls']} | "
                    f"{r['collectives']} | {r['bytes'] / r['elems']:.1f} | {r['intra_bytes'] / 1e3:.1f} | "
                    f"{r['intra_bytes'] / rs['intra_bytes']:.3f}x | {r['inter_bytes'] / 1e3:.1f} | "
                    f"{r['inter_bytes'] / rs['inter_bytes']:.3f}x | {gpu_s(r) * 1e6:.0f} | "
                    f"{network_s(r) * 1e6:.0f} | {r['median_s'] * 1e3:.2f} |")
    for shape, names in ((MEMORY_SHAPE, MEMORY_METHODS), ):
        lines += [
            "", f"Extra peak resident memory of one call on a {shape[0]} x {shape[1]} tensor "
            f"({shape[0] * shape[1] / 1e6:.2f}M elements), bytes per gradient element, the largest over the ranks "
            "(glibc's mmap threshold at 1 MB):", "", "| dtype | " + " | ".join(names) + " |",
            "|---|" + "---:|" * len(names)
        ]
        for dtype_name in DTYPES:
            cells = []
            for method in names:
                m = memory[(shape, dtype_name, method)]
                cells.append(f"n/a: {m['error']}" if m["error"] else f"{m['extra_bytes'] / m['elems']:.2f}")
            lines.append(f"| {dtype_name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chart(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [b for b in buckets()]
    by_key = {(r["bucket"], r["method"]): r for r in results if r["dtype"] == "fp16"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / len(METHODS)
    for ax, metric, label in ((axes[0], gpu_s, "modeled GPU work, us (launches + HBM traffic)"),
                              (axes[1], network_s, "modeled network, us (collectives + link bytes)")):
        for i, method in enumerate(METHODS):
            values = [metric(by_key[(b, method)]) * 1e6 if "error" not in by_key[(b, method)] else 0 for b in names]
            ax.bar([x + (i - (len(METHODS) - 1) / 2) * width for x in range(len(names))], values, width, label=method)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.suptitle("one fp16 gradient reduce-scatter call per bucket, 3 nodes x 2:\nqgZ 4/4 and 8/4 (the series', on "
                 "DeepSpeed's kernels) vs DeepSpeed 0.19.8 vs the unquantized reduce-scatter")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=".")
    parser.add_argument("--worker", choices=("work", "memory"), help=argparse.SUPPRESS)
    parser.add_argument("--memory-method", help=argparse.SUPPRESS)
    parser.add_argument("--memory-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--memory-shape", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md and .png from --out's .json")
    args = parser.parse_args()
    if args.worker == "work":
        return work_worker(args)
    if args.worker == "memory":
        return memory_worker(args)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((Path(args.out) / "qgz_collectives.json").read_text())
        memory = {}
        for key, value in saved["memory"].items():
            shape, dtype_name, method = key.split("/", 2)
            memory[(tuple(map(int, shape.split("x"))), dtype_name, method)] = value
        return write_results(saved["results"], memory, args)
    common = [
        sys.executable, __file__, "--nodes",
        str(args.nodes), "--devices",
        str(args.devices), "--repeats",
        str(args.repeats)
    ]
    log(f"collectives: {len(buckets())} buckets x {len(DTYPES)} dtypes x {len(METHODS)} methods at "
        f"{args.nodes}x{args.devices}")
    results = run_world(common + ["--worker", "work"], args.nodes, args.devices, timeout=1800)[0]["results"]
    memory = {}
    for shape, names in ((MEMORY_SHAPE, MEMORY_METHODS), ):
        for dtype_name in DTYPES:
            for method in names:
                if method == "upstream" and dtype_name != "fp16":
                    memory[(shape, dtype_name, method)] = {
                        "error": "0.19.8 hands bf16 bits to fp16 kernels",
                        "extra_bytes": 0
                    }
                    continue
                log(f"memory: one {method} call on {shape[0]} x {shape[1]} {dtype_name} in a fresh world")
                reports = run_world(common + [
                    "--worker", "memory", "--memory-method", method, "--memory-dtype", dtype_name, "--memory-shape",
                    *map(str, shape)
                ],
                                    args.nodes,
                                    args.devices,
                                    timeout=1800,
                                    env=MEMORY_ENV)
                memory[(shape, dtype_name, method)] = max(reports, key=lambda r: r["extra_bytes"])
    return write_results(results, memory, args)


def write_results(results, memory, args):
    table = report(results, memory, args)
    print(table)
    out = Path(args.out)
    (out / "qgz_collectives.json").write_text(
        json.dumps(
            {
                "results": results,
                "memory": {
                    f"{shape[0]}x{shape[1]}/{d}/{m}": v
                    for (shape, d, m), v in memory.items()
                }
            },
            indent=1))
    (out / "qgz_collectives.md").write_text(table + "\n")
    chart(results, out / "qgz_collectives.png")
    log(f"wrote {out}/qgz_collectives.json, .md, .png")


if __name__ == "__main__":
    sys.exit(main())

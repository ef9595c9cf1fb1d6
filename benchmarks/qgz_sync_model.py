# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What one step's gradient synchronization of LLaMA-2-7B costs on a GPU cluster, modeled: the fp16
reduce-scatter against this package's qgZ pipeline (deepspeed_qgz/qgz/, which training does not run:
it runs the series' all_to_all_quant_reduce) with int4 inside the node (4/4) and with int8 inside
the node (8/4), on DeepSpeed's quantizer kernels with the glue and as fused Triton kernels.

Compute: one rank's dispatched ops and quantizer kernels (a launch each) and the bytes they read
and write per gradient element, counted at each modeled topology on one LLaMA-2-7B layer's
gradients in bf16: for qgZ, the pipeline's three stages (quantized_pipeline.py) with the exchanges
left out (the fused stages' launches counted from their arguments and the gradients they read, not
run: Triton's interpreter is far too slow for a layer); for the reduce-scatter, reduce_scatter_coalesced
with the collective left out. One call per ZeRO-3 reduce bucket. Bytes move at HBM bandwidth, except
a fused stage's: at the lower of HBM bandwidth and the ceiling its instructions set, from the static
roofline of its SASS for an H100 (benchmarks/qgz_roofline.py, groups of 136, the same topology). Network: the bytes each rank sends inside its node and to other nodes,
from the qgZ layout of each bucket (quantized_layout.py) and, for the reduce-scatter, NCCL's ring
(each rank moves (W - 1) / W of the bucket; D rings, each crossing the network through its own
NIC, so the ring runs at min(NVLink, D x NIC) per GPU). The qgZ stages and their two all-to-alls
run one after the other; nothing overlaps.

    python benchmarks/qgz_sync_model.py [--out DIR]
"""

import argparse
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "scripts"))  # qgz_harness
sys.path.insert(0, str(HERE))  # qgz_roofline

# Assumptions (stated in the output).
LAUNCH_S = 5e-6  # per dispatched op or kernel
HBM_BPS = 3.3e12  # H100/H200-class
NVLINK_BPS = 450e9  # per GPU and direction
LATENCY_S = 20e-6  # per collective
NETWORKS = {"8 x 400 Gb/s NICs per node": 400e9 / 8, "8 x 100 Gb/s NICs per node": 100e9 / 8}  # per GPU
REDUCE_BUCKET = 500_000_000  # ZeRO-3's default reduce_bucket_size, elements
TOPOLOGIES = [(3, 8), (4, 8)]
DTYPE = "bf16"
METHODS = {
    "fp16 reduce-scatter": "rs",
    "qgZ 4/4": "qgz-4/4",
    "qgZ 8/4": "qgz-8/4",
    "qgZ 4/4 fused": "qgz-4/4-fused",
    "qgZ 8/4 fused": "qgz-8/4-fused"
}
INTRA_NODE_BITS = {"qgz-4/4": 4, "qgz-8/4": 8, "qgz-4/4-fused": 4, "qgz-8/4-fused": 8}


def llama2_7b_layer():
    h, ffn = 4096, 11008
    return [(h, h)] * 4 + [(ffn, h)] * 2 + [(h, ffn)] + [(h, )] * 2


def llama2_7b():
    h, vocab = 4096, 32000
    return [(vocab, h)] + llama2_7b_layer() * 32 + [(h, ), (vocab, h)]


def count_work(method, num_nodes, local_world_size):
    """{"ops", "kernel_calls", "bytes_per_elem", "launch_bytes_per_elem" (per fused stage)} of one
    rank's call on a LLaMA-2-7B layer's gradients, the collectives left out (the network part is
    modeled apart); a fused call in the steady state (its tables cached, as ZeRO-3 repeats its
    buckets)."""
    from unittest import mock
    import torch
    from deepspeed_qgz import cpu_quantizer
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed_qgz.qgz.quantized_layout import DEFAULT_GROUP_SIZE
    from deepspeed_qgz.qgz.quantized_pipeline import (pipeline_stages, quantized_reduce_plan, quantized_reduce_scatter)
    from qgz_harness import WorkCounter

    world = num_nodes * local_world_size
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in llama2_7b_layer()]
    fused = method.endswith("-fused")
    work = WorkCounter(run_launches=not fused)
    if method == "rs":
        stub = mock.Mock(get_rank=lambda group=None: 0, get_world_size=lambda group=None: world)
        with mock.patch.object(coalesced_collectives, "dist", stub), \
                mock.patch.object(coalesced_collectives, "_torch_reduce_scatter_fn", lambda *a, **k: None), work:
            coalesced_collectives.reduce_scatter_coalesced(tensors)
    else:
        quantizer = work.counting_quantizer(ContractCheckedQuantizer(cpu_quantizer.load()))
        plan = quantized_reduce_plan(tuple(t.numel() for t in tensors), num_nodes, local_world_size,
                                     DEFAULT_GROUP_SIZE, INTRA_NODE_BITS[method])

        def call():
            for start, layout in plan:
                # the exchanges left out: what a rank receives has the shape of what it sends
                quantized_reduce_scatter(tensors[start:start + len(layout.tensors)], layout,
                                         pipeline_stages(quantizer, fused), lambda x: x, lambda x: x, 0)

        if fused:  # a call in the steady state: the fused stages' tables are cached per layout
            with WorkCounter(run_launches=False):
                call()
        with work:
            call()
    elems = sum(t.numel() for t in tensors)
    stages = {name: total / elems for name, (_, total) in work.op_names.items() if name.endswith("_kernel")}
    return {
        "ops": work.ops,
        "kernel_calls": work.kernel_calls,
        "bytes_per_elem": work.bytes / elems,
        "launch_bytes_per_elem": stages
    }


# the fused kernels, by the name of their roofline stage
FUSED_STAGES = {"_quantize_partitions_kernel": 0, "_reduce_within_node_kernel": 1, "_average_across_nodes_kernel": 2}
ROOFLINE_GPU = "H100"


def fused_ceilings(method, num_nodes, local_world_size):
    """Each fused stage's roofline ceiling (a share of HBM bandwidth) at this topology."""
    import os
    os.environ.pop("TRITON_INTERPRET", None)
    import qgz_roofline
    from deepspeed_qgz.qgz.quantized_layout import DEFAULT_GROUP_SIZE
    return {
        name:
        qgz_roofline.analyse(stage, DTYPE, INTRA_NODE_BITS[method], DEFAULT_GROUP_SIZE,
                             (num_nodes, local_world_size), ROOFLINE_GPU)["ceiling_percent"] / 100
        for name, stage in FUSED_STAGES.items()
    }


def buckets(shapes):
    """ZeRO-3's reduce buckets: consecutive gradients up to REDUCE_BUCKET elements."""
    out, current, size = [], [], 0
    for shape in shapes:
        numel = math.prod(shape)
        if current and size + numel > REDUCE_BUCKET:
            out.append(current)
            current, size = [], 0
        current.append(shape)
        size += numel
    return out + ([current] if current else [])


def network_bytes(method, bucket, num_nodes, local_world_size):
    """(bytes each rank sends inside its node, to other nodes) for one call; 2-byte elements."""
    from deepspeed_qgz.qgz.quantized_layout import DEFAULT_GROUP_SIZE
    from deepspeed_qgz.qgz.quantized_pipeline import quantized_reduce_plan
    world = num_nodes * local_world_size
    elems = sum(math.prod(s) for s in bucket)
    if method == "rs":
        return (world - 1) / world * elems * 2, 0.0  # the ring: see ring_seconds
    flat = [math.prod(s) for s in bucket if len(s) == 1]
    share = sum(math.ceil(n / world) for n in flat) * 2
    intra, inter = (local_world_size - 1) * share, (world - local_world_size) * share
    bits = INTRA_NODE_BITS[method]
    plan = quantized_reduce_plan(tuple(math.prod(s) for s in bucket if len(s) > 1), num_nodes, local_world_size,
                                 DEFAULT_GROUP_SIZE, bits)
    for _, layout in plan:
        intra += layout.intra_node_bytes
        inter += layout.inter_node_bytes
    return intra, inter


def memory_seconds_per_elem(row):
    """Seconds per gradient element the call's bytes take: at HBM bandwidth, a fused stage's at its
    roofline ceiling where that is lower."""
    ceilings = row.get("ceilings", {})
    slowed = sum(b * (1 / ceilings[name] - 1) for name, b in row["launch_bytes_per_elem"].items() if name in ceilings)
    return (row["bytes_per_elem"] + slowed) / HBM_BPS


def model(counts, nic_bps, num_nodes, local_world_size):
    rows = {}
    for label, method in METHODS.items():
        row = counts[method]
        compute = network = 0.0
        intra_total = inter_total = 0.0
        for bucket in buckets(llama2_7b()):
            elems = sum(math.prod(s) for s in bucket)
            compute += (row["ops"] + row["kernel_calls"]) * LAUNCH_S + memory_seconds_per_elem(row) * elems
            intra, inter = network_bytes(method, bucket, num_nodes, local_world_size)
            intra_total, inter_total = intra_total + intra, inter_total + inter
            if method == "rs":
                network += LATENCY_S + intra / min(NVLINK_BPS, local_world_size * nic_bps)
            else:
                network += 2 * LATENCY_S + intra / NVLINK_BPS + inter / nic_bps
        rows[label] = {
            "compute_ms": compute * 1e3,
            "network_ms": network * 1e3,
            "total_ms": (compute + network) * 1e3,
            "intra_gb": intra_total / 1e9,
            "inter_gb": inter_total / 1e9,
            "ops": row["ops"],
            "kernel_calls": row["kernel_calls"],
            "bytes_per_elem": row["bytes_per_elem"],
            "fused_ceilings": row.get("ceilings", {})
        }
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    params = sum(math.prod(s) for s in llama2_7b())
    lines = [
        f"LLaMA-2-7B ({params / 1e9:.2f}B gradient elements, {len(buckets(llama2_7b()))} reduce buckets of at most "
        f"{REDUCE_BUCKET / 1e6:.0f}M), {DTYPE} gradients, one step's gradient synchronization per GPU. Assumed: "
        f"{LAUNCH_S * 1e6:.0f} us per launch, HBM {HBM_BPS / 1e12:.1f} TB/s, NVLink {NVLINK_BPS / 1e9:.0f} GB/s per "
        f"GPU and direction, {LATENCY_S * 1e6:.0f} us per collective, one NIC per GPU; one call per bucket, with "
        "the ops, kernels and bytes touched per element of one rank's call counted at the topology on a layer's "
        "gradients; the fp16 reduce-scatter as NCCL's ring at min(NVLink, 8 NICs) per GPU (its inter-node bytes "
        "are not a separate phase); qgZ's phases in sequence; each fused stage's bytes at the lower of HBM "
        f"bandwidth and its roofline ceiling on an {ROOFLINE_GPU} (benchmarks/qgz_roofline.py).", "",
        "| network | nodes x GPUs | method | ops + kernels per call | bytes touched per element | compute ms | "
        "network ms | total ms | vs reduce-scatter | GB each GPU sends inside its node | "
        "GB each GPU sends to other nodes |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    ]
    counts = {}
    for num_nodes, local_world_size in TOPOLOGIES:
        counts[(num_nodes, local_world_size)] = {
            method: count_work(method, num_nodes, local_world_size)
            for method in METHODS.values()
        }
        for method, row in counts[(num_nodes, local_world_size)].items():
            if method.endswith("-fused"):
                row["ceilings"] = fused_ceilings(method, num_nodes, local_world_size)
                lines.insert(
                    1, f"Fused {method[4:7]} at {num_nodes}x{local_world_size}: roofline ceilings on an "
                    f"{ROOFLINE_GPU} (stages 0, 1, 2) " + ", ".join(f"{100 * row['ceilings'][name]:.0f}%"
                                                                    for name in FUSED_STAGES) + " of HBM bandwidth.")
    table = {}
    for network, nic_bps in NETWORKS.items():
        for num_nodes, local_world_size in TOPOLOGIES:
            rows = model(counts[(num_nodes, local_world_size)], nic_bps, num_nodes, local_world_size)
            table[f"{network}/{num_nodes}x{local_world_size}"] = rows
            base = rows["fp16 reduce-scatter"]["total_ms"]
            for label, row in rows.items():
                ring = label == "fp16 reduce-scatter"
                sent = (f"{row['intra_gb']:.2f} in the ring, both |  "
                        if ring else f"{row['intra_gb']:.2f} | {row['inter_gb']:.2f}")
                lines.append(f"| {network} | {num_nodes}x{local_world_size} | {label} | "
                             f"{row['ops'] + row['kernel_calls']} | {row['bytes_per_elem']:.1f} | "
                             f"{row['compute_ms']:.1f} | {row['network_ms']:.1f} | {row['total_ms']:.1f} | "
                             f"{row['total_ms'] / base:.2f}x | {sent} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "qgz_sync_model.md").write_text(text + "\n")
        (Path(args.out) / "qgz_sync_model.json").write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""GPU validation of the qgZ CUDA path (run through scripts/gpu_check.sh).

1. JIT-builds DeepSpeed's own CUDA QuantizerBuilder.
2. For layouts from quantized_reduce_layout (3x2, 5x2, 3x8, 2x8; odd and vocab-like shapes, the
   default group size) runs swizzle_quant, quantized_reduction and dequantize on the GPU and
   compares them bit for bit with the PyTorch reference (deepspeed/ops/quantizer/qgz_reference.py).
3. Runs all_to_all_quant_reduce's whole pipeline for a 3x2 cluster in one process
   (deepspeed.runtime.comm.quantized_simulation: one kernel per stage for a bucket of several
   tensors, the all-to-alls replaced by the permutations they perform) on the CUDA kernels, against
   the exact average and against the same pipeline run on the reference.
4. Times the kernels on a padded layout against a naturally aligned one of the same size.
Prints a PASS/FAIL table (and writes it to --out DIR); exits non-zero on any FAIL.

--dry-run-on-cpu runs the same script with the CPU quantizer op standing in for the CUDA kernels, to
check the script itself on a machine without a GPU; it proves nothing about the GPU.
"""

import argparse
import math
import sys
import time
from pathlib import Path

try:  # an install with --target processes no .pth file: start the overlay's import hook here
    from deepspeed_qgz._finder import install
    install()
except ImportError:
    pass

import torch  # noqa: E402

TOPOLOGIES = [(3, 2), (5, 2), (3, 8), (2, 8)]
SHAPES = {"odd 1031x77": (1031, 77), "vocab-like 50257x96": (50257, 96)}


def bits_equal(a, b):
    """(same bits?, what differs) for a GPU result against the reference's."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
    return diff == 0, f"{diff} of {a.numel() * a.element_size()} bytes differ"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="check this script with the CPU op")
    args = parser.parse_args()
    dry_run = args.dry_run_on_cpu
    if not torch.cuda.is_available() and not dry_run:
        print("gpu_check: CUDA is needed", file=sys.stderr)
        return 2
    device = "cpu" if dry_run else "cuda"

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.quantizer import qgz_reference as ref
    from deepspeed.ops.quantizer.qgz_contract import ContractCheckedQuantizer
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.runtime.comm.quantized_layout import quantized_reduce_layout, resolve_group_size
    from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce
    from deepspeed_qgz.harness import WorkCounter

    rows = []

    def record(check, ok, detail):
        rows.append((check, "PASS" if ok else "FAIL", detail))
        print(f"{'PASS' if ok else 'FAIL'}  {check}: {detail}", flush=True)

    start = time.perf_counter()
    # the accelerator's QuantizerBuilder: CUDA here, the CPU op in a dry run on the CPU accelerator
    op = ContractCheckedQuantizer(get_accelerator().create_op_builder("QuantizerBuilder").load())
    record(
        "build " + ("CPU (dry run)" if dry_run else "CUDA") + " QuantizerBuilder", True,
        f"{time.perf_counter() - start:.0f} s, deepspeed {deepspeed.__version__}, torch {torch.__version__}, "
        f"{'no GPU' if dry_run else torch.cuda.get_device_name()}")
    record("patched coalesced_collectives", hasattr(cc, "quantize_partitions"), cc.__file__)

    gen = torch.Generator().manual_seed(0)
    for nodes, devices in TOPOLOGIES:
        world = nodes * devices
        for name, shape in SHAPES.items():
            layout = quantized_reduce_layout((math.prod(shape), ), nodes, devices, resolve_group_size())
            groups = world * layout.groups_per_partition
            x = (torch.randn(world * layout.padded_partition, generator=gen) * 3).half()
            x[:layout.group_elems] = 0  # an all-zero group
            x[layout.group_elems:2 * layout.group_elems] = 1.5  # ties and a clamped absmax
            label = f"{nodes}x{devices} {name} ({layout.group_elems}/group)"
            q, s = op.swizzle_quant(x.to(device), groups, 4, op.Symmetric, 1, nodes, devices)
            rq, rs = ref.swizzle_quant(x, groups, 4, ref.Symmetric, 1, nodes, devices)
            ok_q, dq = bits_equal(q, rq)
            ok_s, ds = bits_equal(s, rs)
            record(f"swizzle_quant {label}", ok_q and ok_s, f"data: {dq}; scales: {ds}")
            r, r_s = op.quantized_reduction(q, s, groups, groups // devices, 4, op.Symmetric, devices)
            rr, rr_s = ref.quantized_reduction(q.cpu(), s.cpu(), groups, groups // devices, 4, ref.Symmetric, devices)
            ok_r, dr = bits_equal(r, rr)
            ok_rs, drs = bits_equal(r_s, rr_s)
            record(f"quantized_reduction {label}", ok_r and ok_rs, f"data: {dr}; scales: {drs}")
            d = op.dequantize(r, r_s, groups // devices, 4, op.Symmetric)
            ok_d, dd = bits_equal(d, ref.dequantize(r.cpu(), r_s.cpu(), groups // devices, 4, ref.Symmetric))
            record(f"dequantize {label}", ok_d, dd)

    # The whole collective's pipeline at 3x2: one kernel per stage for a bucket of several tensors.
    nodes, devices, world = 3, 2, 6
    shapes = [(1031, 77), (515, 3), (7, 5, 3), (64, 48)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        signals = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        inputs = [[(sig + 0.25 * torch.randn(sig.shape, generator=gen, dtype=torch.float64)).to(dtype)
                   for sig in signals] for _ in range(world)]
        counter = WorkCounter()
        gpu_out, _ = simulate_all_to_all_quant_reduce([[t.to(device) for t in ts] for ts in inputs], nodes, devices,
                                                      counter.counting_quantizer(op))
        ref_out, _ = simulate_all_to_all_quant_reduce(inputs, nodes, devices, ref)
        worst, same = 0.0, True
        for i, shape in enumerate(shapes):
            n = math.prod(shape)
            chunk = math.ceil(n / world)
            for rank in range(world):
                lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
                parts = [inputs[r][i].reshape(-1)[lo:hi].double() for r in range(world)]
                exact = torch.stack(parts).mean(0)
                bound = 0.3 * sum(p.abs().max() for p in parts) / world + exact.abs() * 2**-7
                err = (gpu_out[rank][i].cpu().double() - exact).abs()
                worst = max(worst, float((err / bound).max()))
                same &= bits_equal(gpu_out[rank][i], ref_out[rank][i])[0]
        record(
            f"3x2 all_to_all_quant_reduce pipeline {str(dtype)[6:]}, {len(shapes)} tensors", worst <= 1 and same
            and counter.kernel_calls == 3 * world,
            f"max error / bound {worst:.3f}; kernels == reference bitwise: {same}; "
            f"{counter.kernel_calls / world:.0f} kernel calls per rank")

    # Kernel time on a padded layout against an aligned one of about the same size.
    def kernel_seconds(numel):
        layout = quantized_reduce_layout((numel, ), nodes, devices, resolve_group_size())
        groups = world * layout.groups_per_partition
        x = torch.randn(world * layout.padded_partition, device=device).half()

        def run():
            q, s = op.swizzle_quant(x, groups, 4, op.Symmetric, 1, nodes, devices)
            r, r_s = op.quantized_reduction(q, s, groups, groups // devices, 4, op.Symmetric, devices)
            op.dequantize(r, r_s, groups // devices, 4, op.Symmetric)

        sync = (lambda: None) if dry_run else torch.cuda.synchronize
        for _ in range(3):
            run()
        sync()
        begin = time.perf_counter()
        for _ in range(20):
            run()
        sync()
        return (time.perf_counter() - begin) / 20, layout

    aligned_s, aligned = kernel_seconds(world * 1024 * 4096)
    padded_s, padded = kernel_seconds(world * (1024 * 4096 - 1001) + 1)
    record(
        "kernel time padded / aligned (3x2, ~25M elements)", True,
        f"{padded_s * 1e6:.0f} us / {aligned_s * 1e6:.0f} us = {padded_s / aligned_s:.3f} "
        f"({padded.group_elems} vs {aligned.group_elems} per group)")

    table = "| check | result | detail |\n|---|---|---|\n" + "\n".join(f"| {c} | {r} | {d} |" for c, r, d in rows)
    print("\n" + table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "gpu_check.md").write_text(table + "\n")
    return 0 if all(r == "PASS" for _, r, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Throughput of the CPU quantizer op against the PyTorch reference and a plain copy of the same
bytes, measured side by side in one run. GB/s are of fp16 values (2 bytes each) entering the op
(quantize, swizzle_quant, quantized_reduction) or leaving it (dequantize). The gradients' kernels as the
series' all_to_all_quant_reduce calls them at 3 x 2 on one tensor, in groups of 4096 values (its rule
for a 4096 x 4096 weight); quantize on the weights' groups.

    python benchmarks/quantizer_throughput.py [--elems 16777216] [--group-size 4096] [--nodes 3 --devices 2]
"""

import argparse
import statistics
import time

import torch

from deepspeed_qgz import cpu_quantizer
from deepspeed_qgz.qgz import qgz_reference as ref
from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer

# qwZ's weights: int8, in groups of up to CUDAQuantizer's target size
WEIGHT_BITS, WEIGHT_GROUP_SIZE = 8, CUDAQuantizer.target_group_size


def median_seconds(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elems", type=int, default=16 * 2**20)
    parser.add_argument("--group-size", type=int, default=4096)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ref-repeats", type=int, default=3)
    args = parser.parse_args()

    start = time.perf_counter()
    op = ContractCheckedQuantizer(cpu_quantizer.load())
    load_s = time.perf_counter() - start

    nodes, devices = args.nodes, args.devices
    world = nodes * devices
    group_size = args.group_size
    groups = world * -(-args.elems // (world * group_size))  # whole groups in every rank's padded partition
    numel = groups * group_size
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).half()
    data, scales = op.swizzle_quant(x, groups, 4, op.Symmetric, 1, nodes, devices)
    reduced, reduced_scales = op.quantized_reduction(data, scales, groups, groups // devices, 4, op.Symmetric, devices)

    def copy_of(nbytes):
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    weights = x[:numel // WEIGHT_GROUP_SIZE * WEIGHT_GROUP_SIZE]
    cases = [
        ("quantize (weights)", weights.numel(),
         lambda m, t: m.quantize(weights,
                                 weights.numel() // WEIGHT_GROUP_SIZE, WEIGHT_BITS, t)),
        ("swizzle_quant", numel, lambda m, t: m.swizzle_quant(x, groups, 4, t, 1, nodes, devices)),
        ("quantized_reduction", numel,
         lambda m, t: m.quantized_reduction(data, scales, groups, groups // devices, 4, t, devices)),
        ("dequantize", numel // devices, lambda m, t: m.dequantize(reduced, reduced_scales, groups // devices, 4, t)),
    ]
    print(f"CPU quantizer op: JIT build + load {load_s:.1f} s; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.elems} elements at {nodes}x{devices} "
          f"(padded {numel}, {group_size} per group)")
    print(f"{'op':<20} {'C++ GB/s':>9} {'ref GB/s':>9} {'copy GB/s':>10} {'C++/ref':>8} {'copy/C++':>9}")
    for name, fp16_values, call in cases:
        nbytes = 2 * fp16_values
        t_op = median_seconds(lambda: call(op, op.Symmetric), args.repeats)
        t_ref = median_seconds(lambda: call(ref, ref.Symmetric), args.ref_repeats)
        t_copy = median_seconds(copy_of(nbytes), args.repeats)
        gbps = lambda t: nbytes / t / 1e9  # noqa: E731
        print(f"{name:<20} {gbps(t_op):>9.2f} {gbps(t_ref):>9.2f} {gbps(t_copy):>10.2f} {t_ref / t_op:>7.1f}x "
              f"{t_op / t_copy:>8.2f}x")


if __name__ == "__main__":
    main()

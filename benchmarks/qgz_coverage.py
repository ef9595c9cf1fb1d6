# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What ZeRO++ quantizes of real models, on 2, 3 and 5 nodes. Pure arithmetic on parameter shapes.

Gradients (qgZ): the share of a model's gradient elements DeepSpeed 0.19.8 quantizes (tensors of two
or more dimensions whose numel is a multiple of 2 x world; the rest falls back to the fp16
reduce-scatter) and, of that, the share whose kernel calls leave the kernels' contract
(qgz_contract.py: its groups = max(shape[0], shape[1], world) rule; warp rule included), against the
series' (every tensor of two or more dimensions) and the padding it stages, at its default groups.

Weights (qwZ): the share of a model's weight elements DeepSpeed 0.19.8's quantized all-gather can
take, each parameter gathered alone (its partition ceil(numel / world) must be a multiple of 8
that its group search splits into groups below 16000 values, else an AssertionError stops
training), and of that the share whose quantize call leaves the contract; against the patch's
(every parameter) and the padding the series' quantizer (upstream/0009) adds to the all-gather.

    python benchmarks/qgz_coverage.py
"""

import math
import torch

from deepspeed_qgz.qgz.qgz_contract import (SYMMETRIC, quantize_violations, quantized_reduction_violations,
                                            swizzle_quant_violations)
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer


def llama2_7b():
    h, ffn, vocab = 4096, 11008, 32000
    layer = [(h, h)] * 4 + [(ffn, h)] * 2 + [(h, ffn)] + [(h, )] * 2
    return [(vocab, h)] + layer * 32 + [(h, ), (vocab, h)]


def qwen2_7b():
    h, ffn, vocab, kv = 3584, 18944, 152064, 512
    layer = [(h, h), (h, ), (kv, h), (kv, ), (kv, h), (kv, ), (h, h), (ffn, h), (ffn, h), (h, ffn), (h, ), (h, )]
    return [(vocab, h)] + layer * 28 + [(h, ), (vocab, h)]


def gpt2():
    h, vocab = 768, 50257
    layer = [(h, ), (h, ), (h, 3 * h), (3 * h, ), (h, h), (h, ), (h, ), (h, ), (h, 4 * h), (4 * h, ), (4 * h, h),
             (h, )]
    return [(vocab, h), (1024, h)] + layer * 12 + [(h, ), (h, )]


MODELS = {"LLaMA-2-7B": llama2_7b, "Qwen2-7B": qwen2_7b, "GPT-2 (124M)": gpt2}
TOPOLOGIES = [(2, 8), (3, 8), (3, 2), (5, 8)]


def numel(shape):
    n = 1
    for dim in shape:
        n *= dim
    return n


def coverage(shapes, nodes, devices):
    world = nodes * devices
    total = sum(numel(s) for s in shapes)

    def outside_contract(shape):
        n, groups = numel(shape), max(shape[0], shape[1], world)
        return (swizzle_quant_violations(n, groups, 4, 1, nodes, devices)
                or quantized_reduction_violations(n // 2, groups, groups, groups // devices, 4, SYMMETRIC, devices))

    upstream = [s for s in shapes if len(s) > 1 and numel(s) % (2 * world) == 0]
    upstream_broken = [s for s in upstream if outside_contract(s)]
    ours = [s for s in shapes if len(s) > 1]
    share = lambda group: sum(numel(s) for s in group) / total  # noqa: E731
    padding = sum(series_padding_elems(s, world) for s in ours) / sum(numel(s) for s in ours)
    return share(upstream), share(upstream_broken), share(ours), padding


def series_padding_elems(shape, world, max_group_size=40960):
    """The zeros the series' all_to_all_quant_reduce (upstream/0004, 0012) stages for a gradient of
    `shape` on `world` ranks: each rank's partition padded to whole groups of the shape rule's size
    (max(shape[0], shape[1], world) groups, whole vectors of 8 values, 136 to max_group_size)."""
    n = numel(shape)
    group = min(max(8 * math.ceil(n / max(shape[0], shape[1], world) / 8), 136), max_group_size)
    return world * group * math.ceil(math.ceil(n / world) / group) - n


def upstream_weight_groups(partition):
    """0.19.8's group search for a partition (CUDAQuantizer.quantize), or None where it asserts."""
    groups = math.ceil(partition / 8000)
    while groups < partition and partition % (8 * groups):
        groups += 1
    while partition % (16 * groups) == 0 and partition / groups > 8000:
        groups *= 2
    if partition % (8 * groups) or partition / groups >= 16000 or partition <= groups:
        return None
    return groups


def series_padding(partition):
    """The values the series' CUDAQuantizer.quantize (upstream/0009) adds to a partition of
    `partition` values: the length of its codes, from a stand-in op that returns its input."""

    class ReturnsInput:
        Symmetric = 0

        def quantize(self, values, groups, num_bits, quant_type):
            return values, None

    saved, CUDAQuantizer.quantizer_cuda_module = CUDAQuantizer.quantizer_cuda_module, ReturnsInput()
    try:
        codes, _ = CUDAQuantizer().quantize(torch.empty(partition, dtype=torch.half))
    finally:
        CUDAQuantizer.quantizer_cuda_module = saved
    return codes.numel() - partition


def weight_coverage(shapes, nodes, devices):
    world = nodes * devices
    total = sum(numel(s) for s in shapes)
    handled = broken = 0
    for shape in shapes:
        partition = math.ceil(numel(shape) / world)
        groups = upstream_weight_groups(partition)
        if groups is not None:
            handled += numel(shape)
            if quantize_violations(partition, groups, 8):
                broken += numel(shape)
    padding = world * sum(series_padding(math.ceil(numel(s) / world)) for s in shapes)
    return handled / total, broken / total, padding / total


def main():
    print("Gradients (qgZ), the series' default groups:\n")
    print("| model | nodes x GPUs | 0.19.8 quantizes | of which outside the kernel contract | the patch quantizes "
          "| padding added |")
    print("|---|---|---:|---:|---:|---:|")
    for model, build in MODELS.items():
        shapes = build()
        for nodes, devices in TOPOLOGIES:
            up, broken, ours, padding = coverage(shapes, nodes, devices)
            print(f"| {model} | {nodes}x{devices} | {up:.1%} | {broken:.1%} | {ours:.1%} | {padding:.3%} |")
    print("\nWeights (qwZ), each parameter gathered alone:\n")
    print("| model | nodes x GPUs | 0.19.8 gathers (the rest stops training) | of which outside the kernel contract "
          "| the patch gathers | padding added to the all-gather |")
    print("|---|---|---:|---:|---:|---:|")
    for model, build in MODELS.items():
        shapes = build()
        for nodes, devices in TOPOLOGIES:
            handled, broken, padding = weight_coverage(shapes, nodes, devices)
            print(f"| {model} | {nodes}x{devices} | {handled:.1%} | {broken:.1%} | 100.0% | {padding:.3%} |")


if __name__ == "__main__":
    main()

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Share of a model's gradient elements that qgZ quantizes: DeepSpeed 0.19.8's rule (tensors of two
or more dimensions whose numel is a multiple of 2 x world; the rest falls back to the fp16
reduce-scatter) against this project's (every tensor of two or more dimensions). Also the share
0.19.8 quantizes with a layout outside the kernels' contract (silently wrong results), by its
groups = max(shape[0], shape[1], world) rule. Pure arithmetic on parameter shapes.

    python benchmarks/qgz_coverage.py
"""

from deepspeed.ops.quantizer.qgz_contract import swizzle_quant_violations
from deepspeed.runtime.comm.quantized_layout import quantized_reduce_layout, resolve_group_size


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
    upstream = [s for s in shapes if len(s) > 1 and numel(s) % (2 * world) == 0]
    upstream_broken = [
        s for s in upstream if swizzle_quant_violations(numel(s), max(s[0], s[1], world), 4, 1, nodes, devices)
    ]
    ours = [s for s in shapes if len(s) > 1]
    layout = quantized_reduce_layout(tuple(numel(s) for s in ours), nodes, devices, resolve_group_size())
    share = lambda group: sum(numel(s) for s in group) / total  # noqa: E731
    return share(upstream), share(upstream_broken), share(ours), layout.padding_elems / share(ours) / total


def main():
    print("| model | nodes x GPUs | 0.19.8 quantizes | of which outside the kernel contract | this project quantizes "
          "| padding added |")
    print("|---|---|---:|---:|---:|---:|")
    for model, build in MODELS.items():
        shapes = build()
        for nodes, devices in TOPOLOGIES:
            up, broken, ours, padding = coverage(shapes, nodes, devices)
            print(f"| {model} | {nodes}x{devices} | {up:.1%} | {broken:.1%} | {ours:.1%} | {padding:.3%} |")


if __name__ == "__main__":
    main()

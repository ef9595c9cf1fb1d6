# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
This package's quantized reduce-scatter (quantized_pipeline.py) for a whole simulated cluster in
one process: every rank's stages run here, and the two all-to-alls become the permutations they
perform. For testing layouts, topologies and the fused kernels against their specification
without processes, and for checking one quantizer build against another.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from deepspeed_qgz import cpu_quantizer
from deepspeed_qgz.qgz.qgz_contract import checked
from deepspeed_qgz.qgz.quantized_fused_choice import choose_fused, resolve_fused
from deepspeed_qgz.qgz.quantized_layout import QuantizedReduceLayout, resolve_group_size, resolve_intra_node_bits
from deepspeed_qgz.qgz.quantized_pipeline import QuantizedStages, pipeline_stages, quantized_reduce_plan


def simulate_all_to_all_quant_reduce(inputs: Sequence[Sequence[torch.Tensor]],
                                     num_nodes: int,
                                     local_world_size: int,
                                     quantizer=None,
                                     group_size: Optional[int] = None,
                                     intra_node_bits: Optional[int] = None,
                                     fused=False) -> Tuple[List[List[torch.Tensor]], List[QuantizedReduceLayout]]:
    """Args:
        inputs: inputs[r] is rank r's list of tensors (two or more dimensions, the same shapes on
            every rank), for the num_nodes x local_world_size ranks in rank order.
        quantizer: the quantizer op module (default: the quantizer op of this accelerator, cpu_quantizer.load();
            not used where the fused kernels run), behind the contract checks.
        group_size: the largest quantization group (quantized_layout.resolve_group_size).
        intra_node_bits: 4 or 8 (quantized_layout.resolve_intra_node_bits).
        fused: False, True or "auto" (quantized_fused_choice.resolve_fused).

    Returns:
        (outputs, layouts): outputs[r] is rank r's list of results, reduce_scatter_coalesced's
        partitions of the average; layouts, the layout of each run of the call (one unless the call
        is split).
    """
    world = num_nodes * local_world_size
    if len(inputs) != world:
        raise ValueError(f"expected inputs for {num_nodes} x {local_world_size} = {world} ranks, got {len(inputs)}")
    plan = quantized_reduce_plan(tuple(t.numel() for t in inputs[0]), num_nodes, local_world_size,
                                 resolve_group_size(group_size), resolve_intra_node_bits(intra_node_bits))
    fused = resolve_fused(fused)
    if quantizer is None:
        quantizer = cpu_quantizer.load()
    quantizer = checked(quantizer)
    run_stages = []  # every run's kernels decided before any launch
    for start, layout in plan:
        run_tensors = list(inputs[0][start:start + len(layout.tensors)])
        run_stages.append(pipeline_stages(quantizer, choose_fused(fused, run_tensors, layout, quantizer, world=False)))
    outputs = [[] for _ in range(world)]
    for (start, layout), stages in zip(plan, run_stages):
        run = slice(start, start + len(layout.tensors))
        for rank, results in enumerate(_simulate_run([list(ranks[run]) for ranks in inputs], layout, stages)):
            outputs[rank] += results
    return outputs, [layout for _, layout in plan]


def _simulate_run(inputs, layout: QuantizedReduceLayout, stages: QuantizedStages) -> List[List[torch.Tensor]]:
    num_nodes, local_world_size, world = layout.num_nodes, layout.local_world_size, layout.world_size

    def coordinates(rank):
        return divmod(rank, local_world_size)  # (node, local rank)

    slots = [
        stages.quantize_partitions(inputs[rank], layout).view(local_world_size, num_nodes, -1) for rank in range(world)
    ]
    # Intra-node all-to-all: local rank d receives block d of each local peer, in peer order.
    node_sums = []
    for rank in range(world):
        node, local_rank = coordinates(rank)
        peers = range(node * local_world_size, (node + 1) * local_world_size)
        received = torch.cat([slots[peer][local_rank] for peer in peers])
        node_sums.append(stages.reduce_within_node(received, layout))
    # Inter-node all-to-all among equal local ranks: node n receives row n of each node's sums.
    outputs = []
    for rank in range(world):
        node, local_rank = coordinates(rank)
        received = torch.stack([node_sums[m * local_world_size + local_rank][node] for m in range(num_nodes)])
        average = stages.average_across_nodes(received, layout, dtype=inputs[rank][0].dtype)
        outputs.append(layout.partitions(average, rank))
    return outputs

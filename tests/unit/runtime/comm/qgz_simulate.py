# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""all_to_all_quant_reduce's exact kernel call sequence for a whole simulated cluster in one
process: every rank's stages run here and the two all-to-alls become the tensor permutations they
perform. Used by the property test (many topologies, no processes) and by scripts/gpu_check.py."""

import torch

from deepspeed.runtime.comm import coalesced_collectives as cc
from deepspeed.runtime.comm.quantized_layout import quantized_reduce_layout


def simulate_quant_reduce(inputs, num_nodes, local_world_size):
    """inputs[r] is rank r's list of tensors (two or more dims). Returns outputs[r], rank r's list
    of results, and the layout used."""
    world = num_nodes * local_world_size
    layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_world_size)
    device = inputs[0][0].device
    slot_bytes = layout.slot_bytes

    slots = []
    for rank in range(world):
        rank_slots = torch.empty(world, slot_bytes, dtype=torch.int8, device=device)
        for tensor, tensor_layout in zip(inputs[rank], layout.tensors):
            cc._quantize_into_slots(tensor, tensor_layout, rank_slots, num_nodes, local_world_size)
        slots.append(rank_slots.view(local_world_size, num_nodes, slot_bytes))

    # Intra-node all-to-all: local rank d of node n receives block d of each local peer, in peer order.
    node_slots = []
    for rank in range(world):
        node, local_rank = divmod(rank, local_world_size)
        received = torch.cat([slots[node * local_world_size + peer][local_rank] for peer in range(local_world_size)])
        out = torch.empty(num_nodes, slot_bytes, dtype=torch.int8, device=device)
        cc._reduce_node_slots(received, layout, out)
        node_slots.append(out)

    # Inter-node all-to-all among equal local ranks: node m receives row m of each node's slots.
    outputs = []
    for rank in range(world):
        node, local_rank = divmod(rank, local_world_size)
        received = torch.stack([node_slots[n * local_world_size + local_rank][node] for n in range(num_nodes)])
        outputs.append(cc._dequantize_average(received, layout, rank, [t.dtype for t in inputs[rank]]))
    return outputs, layout

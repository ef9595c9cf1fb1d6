# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The bug report's reproduction (train.py), unchanged in substance: a 32x32 linear model under
ZeRO-3, run by three torchrun agents of two processes each. Two changes: the data takes the model's
dtype (the report's config is fp16, which DeepSpeed's CPU accelerator refuses, so CPU runs use
bf16), and --steps bounds the run (--no-shm-op leaves DeepSpeed's shared-memory op unbuilt: run.py). Rank 0 ends with a QGZ_SUMMARY line of the gradient
reduce-scatter's collectives (DeepSpeed's comms logger: calls and bytes); with --loss-dir every rank
writes its losses and that summary, and rank 0 the trained weights. --then CONFIG trains again with
that config in the same processes, from the same seed (run.py --compare: qgZ on, then off); each
training's files go to LOSS_DIR/run<i>/."""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data.distributed import DistributedSampler

import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qgz_harness import release_deepspeed_shm  # noqa: E402


class SimpleModel(torch.nn.Module):

    def __init__(self, hidden_dim):
        super(SimpleModel, self).__init__()
        self.linear = torch.nn.Linear(hidden_dim, hidden_dim, bias=False)
        self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

    def forward(self, x, y):
        hidden1 = self.linear(x)
        hidden2 = self.linear(hidden1)
        return self.cross_entropy_loss(hidden2, y)


def get_data_loader(model, total_samples, hidden_dim, device, dtype):
    batch_size = model.train_micro_batch_size_per_gpu()
    train_data = torch.randn(total_samples, hidden_dim, device=device, dtype=dtype)
    train_label = torch.empty(total_samples, dtype=torch.long, device=device).random_(hidden_dim)
    train_dataset = torch.utils.data.TensorDataset(train_data, train_label)
    sampler = DistributedSampler(train_dataset)
    return torch.utils.data.DataLoader(train_dataset, batch_size=batch_size, sampler=sampler)


def main():
    rank = int(os.environ['RANK'])
    parser = argparse.ArgumentParser(description='Dummy Training')
    parser.add_argument('--steps', type=int, default=10)
    parser.add_argument('--loss-dir',
                        default=None,
                        help='also write each rank\'s losses to LOSS_DIR/run<i>/rank{r}.json')
    parser.add_argument('--no-shm-op', action='store_true', help='leave DeepSpeed\'s shared-memory op unbuilt')
    parser.add_argument('--then',
                        action='append',
                        default=[],
                        metavar='CONFIG',
                        help='train again with this ds config, in the same processes, from the same seed')
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    if args.no_shm_op:
        # it serves DeepSpeed's inference all-reduce only; deepspeed.comm builds it when it starts
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for index, config in enumerate([args.deepspeed_config] + args.then):
        args.deepspeed_config = config
        train(args, rank, index)
    # A clean shutdown: ranks that exit with their process group still up can abort in its
    # threads' destructors ("terminate called without an active exception"), and torchrun's agents
    # then wait out their exit barrier.
    dist.barrier()
    dist.destroy_process_group()


def train(args, rank, index):
    # Each training starts where a fresh process would: the same seed, so the same model and data,
    # and a comms logger that has counted nothing (the report records both starting points).
    torch.random.manual_seed(2222 + rank)
    if index:
        dist.comms_logger.comms_dict = {}
    hidden_dim = 32
    model = SimpleModel(hidden_dim)
    start_weights = digest(model.linear.weight)
    model, _, _, _ = deepspeed.initialize(args=args,
                                          model=model,
                                          model_parameters=model.parameters(),
                                          dist_init_required=True)
    if index == 0:
        release_deepspeed_shm()
    dtype = next(model.parameters()).dtype
    data_loader = get_data_loader(model, 256 * 32, hidden_dim, model.device, dtype)
    start_data = digest(data_loader.dataset.tensors[0])
    losses = []
    for step, batch in enumerate(data_loader):
        if step == args.steps:
            break
        loss = model(batch[0], batch[1])
        losses.append(loss.item())
        print("[{}] STEP {} LOSS: {}".format(dist.get_rank(), step, loss.item()), flush=True)
        model.backward(loss)
        model.step()

    weights = model._zero3_consolidated_16bit_state_dict()  # a collective: every rank takes part
    # what the gradient reduce-scatter sent, as DeepSpeed's comms logger (enabled in the configs) counts
    # it: qgZ's all-to-alls, and the exact path's reduce-scatter (logged as reduce_scatter where
    # DeepSpeed falls back from reduce_scatter_tensor to the list form)
    logged = dist.comms_logger.comms_dict
    collectives = {
        kind: {
            "calls": sum(record[0] for name in names for record in logged.get(name, {}).values()),
            "bytes": sum(size * record[0] for name in names for size, record in logged.get(name, {}).items())
        }
        for kind, names in (("all_to_all", ("all_to_all_single", )), ("reduce_scatter", ("reduce_scatter_tensor",
                                                                                         "reduce_scatter")))
    }
    # the quantizer op qgZ called (the module that defines it)
    from deepspeed.runtime.comm import coalesced_collectives
    quantizer = coalesced_collectives.quantizer_module
    quantizer = None if quantizer is None else quantizer.swizzle_quant.__module__
    if args.loss_dir:
        report = {
            "losses": losses,
            "collectives": collectives,
            "steps": len(losses),
            "quantizer": quantizer,
            "start": [start_weights, start_data]
        }
        if dist.get_rank() == 0:
            report["weights"] = {name: tensor.float().reshape(-1).tolist() for name, tensor in weights.items()}
        run_dir = os.path.join(args.loss_dir, f"run{index}")
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(report, f)
    if dist.get_rank() == 0:
        print("QGZ_SUMMARY " + json.dumps(collectives), flush=True)
    model.destroy()


def digest(tensor):
    return hashlib.sha256(tensor.detach().float().numpy().tobytes()).hexdigest()[:16]


if __name__ == '__main__':
    main()

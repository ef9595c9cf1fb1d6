# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO++'s quantized weights (qwZ) for any partition size, as the pull-request series has them
(upstream/; the overlay applies its hunks of partition_parameters.py, and CI runs the series' own
tests on it): the quantized all-gather on worlds of simulated nodes (with and without hpZ,
trainable and non-trainable weights kept quantized), and ZeRO++'s whole recipe (qwZ + hpZ + qgZ)
training, on the accelerator's quantizer op and on this package's Triton op."""

import math

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

from unit.common import DistributedTest
from unit.qgz_util import quantizer_caches, simulated_nodes


def int8_error_bound(exact, step, dtype):
    """Clamp-free int8: half a step of the group (absmax / 127), but a whole one for a value of the
    other sign than the group's largest magnitude within a step of it (it lands on code 128, which
    clamps to 127); then the dequantize kernel's fp16 product and the dtype's rounding."""
    near_extreme = exact.abs() >= 126 * step
    return torch.where(near_extreme, 1.01, 0.51) * step + exact.abs() * (2**-10 + torch.finfo(dtype).eps)


def group_steps(weight, parts):
    """Per element of `weight`, the int8 step (absmax / 127) of its quantization group when the
    weight is split into `parts` partitions: the partitions here are one group each (CUDAQuantizer
    splits a partition into groups of at most its target_group_size, 8000 values)."""
    flat = weight.reshape(-1).float()
    size = -(-flat.numel() // parts)
    assert size <= 8000
    return torch.cat([partition.abs().max().expand(partition.numel()) / 127 for partition in flat.split(size)])


class OddModel(torch.nn.Module):
    """Layers whose partitions are not multiples of 8 on 3, 5 or 7 nodes; the first frozen."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(37, 29)
        self.hidden = torch.nn.Linear(29, 41)
        self.out = torch.nn.Linear(41, 37, bias=False)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(torch.relu(self.frozen(x)))))


def zero_config(precision, lr=1e-3, **zero):
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": lr
            }
        },
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            **zero
        },
    }
    if precision != "fp32":
        config[precision] = {"enabled": True}
    return config


PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def usable_precisions():
    from deepspeed.accelerator import get_accelerator
    return [p for p in PRECISIONS if p != "fp16" or get_accelerator().is_fp16_supported()]


class QuantizedWeightsTests:
    """The quantized all-gather on `world_size` processes forming nodes of `local_size` ranks:
    every rank sees every weight within int8 error, with hpZ (secondary partitions inside the
    node) and without, trainable weights and non-trainable ones kept quantized."""
    local_size = None
    reuse_dist_env = True

    @pytest.mark.parametrize("hpz", [False, True])
    def test_every_rank_sees_the_weights(self, hpz):
        for precision in usable_precisions():
            dtype = PRECISIONS[precision]
            with simulated_nodes(self.local_size):
                torch.manual_seed(1)
                model = OddModel()
                exact = {name: p.detach().clone().to(dtype) for name, p in model.named_parameters()}
                largest_trainable = max(w.float().abs().max() for name, w in exact.items()
                                        if not name.startswith("frozen."))
                config = zero_config(precision,
                                     zero_quantized_weights=True,
                                     zero_quantized_nontrainable_weights=True,
                                     zero_hpz_partition_size=self.local_size if hpz else 1)
                engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
                seen = {}

                def capture(module, _inputs):
                    for name, param in module.named_parameters(recurse=False):
                        seen[f"{module.qualified}.{name}"] = param.detach().clone()

                for name, module in engine.module.named_children():
                    module.qualified = name
                    module.register_forward_pre_hook(capture)
                for _ in range(2):  # the second forward gathers hpZ's secondary partitions
                    seen.clear()
                    engine(torch.randn(2, 37, device=engine.device, dtype=dtype))
                    assert sorted(seen) == sorted(exact)
                    for name, weight in seen.items():
                        reference = exact[name].to(weight.device)
                        assert weight.shape == reference.shape and weight.dtype == dtype, name
                        # the int8 error of the groups of the rank's partition, or of hpZ's, for a frozen
                        # weight (kept quantized); a trainable one is quantized at each gather in groups that
                        # may hold other parameters of its bucket: up to a whole step of the largest trainable
                        # magnitude (a group's largest positive value clamps a whole step of its group)
                        flat = reference.float().view(-1)
                        if name.startswith("frozen."):
                            bound = torch.maximum(
                                int8_error_bound(flat, group_steps(reference, dist.get_world_size()), dtype),
                                int8_error_bound(flat, group_steps(reference, self.local_size), dtype))
                        else:
                            bound = int8_error_bound(flat, torch.full_like(flat, largest_trainable / 127), dtype)
                            bound += 0.5 * largest_trainable / 127
                        bound = bound.view(reference.shape)
                        assert ((weight.float() - reference.float()).abs() <= bound).all(), \
                            (precision, name, float(((weight.float() - reference.float()).abs() / bound).max()))
                engine.destroy()


class TestQuantizedWeights3Nodes2Ranks(QuantizedWeightsTests, DistributedTest):
    world_size = 6
    local_size = 2


class TestQuantizedWeights2Nodes3Ranks(QuantizedWeightsTests, DistributedTest):
    world_size = 6
    local_size = 3


class TestQuantizedWeights5Nodes2Ranks(QuantizedWeightsTests, DistributedTest):
    world_size = 10
    local_size = 2


class TestZeroPlusPlusRecipe3Nodes2Ranks(DistributedTest):
    """ZeRO++ as its tutorial configures it (quantized weights, hpZ inside the node, quantized
    gradients) trains on 3 nodes x 2 ranks next to plain ZeRO-3, from the same weights and data; on
    the CPU accelerator, this package's Triton op (in Triton's interpreter) gives the CPU op's losses,
    bit for bit (both state the CUDA kernels)."""
    world_size = 6
    reuse_dist_env = True

    @pytest.mark.parametrize("precision", ["bf16", "fp32"])
    def test_recipe_trains_next_to_zero3(self, precision):
        from deepspeed.accelerator import get_accelerator
        from deepspeed_qgz import triton_quantizer
        steps, losses = 8, {}
        recipes = ["zero3", "zero++"]
        # on the CPU accelerator, whose op rounds as the Triton op does (DeepSpeed's CUDA op, built with
        # fast math, may differ from both in a scale's last bit)
        if get_accelerator().device_name() == "cpu" and triton_quantizer.triton is not None and \
                triton_quantizer.unavailable_reason("cpu") is None:
            recipes.append("zero++ on the Triton op")
        for recipe in recipes:
            op = triton_quantizer if recipe.endswith("Triton op") else None
            with simulated_nodes(2), quantizer_caches(op):
                torch.manual_seed(2)
                model = torch.nn.Sequential(torch.nn.Linear(37, 53), torch.nn.ReLU(), torch.nn.Linear(53, 37))
                zero = {} if recipe == "zero3" else {
                    "zero_quantized_weights": True,
                    "zero_hpz_partition_size": 2,
                    "zero_quantized_gradients": True
                }
                engine, _, _, _ = deepspeed.initialize(model=model,
                                                       model_parameters=model.parameters(),
                                                       config=zero_config(precision, lr=1e-2, **zero))
                # one batch per rank, fitted for a few steps: the loss must fall under both
                x = torch.randn(2, 37, generator=torch.Generator().manual_seed(dist.get_rank()))
                x = x.to(engine.device, PRECISIONS[precision])
                losses[recipe] = []
                for _ in range(steps):
                    loss = (engine(x).float() - x.float()).pow(2).mean()
                    engine.backward(loss)
                    engine.step()
                    losses[recipe].append(float(loss))
                engine.destroy()
        assert all(math.isfinite(v) for v in losses["zero++"]), losses
        assert losses["zero++"][-1] < losses["zero++"][0], losses
        # the recipe tracks plain ZeRO-3: within 5% of the starting loss at every step
        for ours, reference in zip(losses["zero++"], losses["zero3"]):
            assert abs(ours - reference) <= 0.05 * losses["zero3"][0], losses
        if "zero++ on the Triton op" in losses:
            assert losses["zero++ on the Triton op"] == losses["zero++"], losses

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ZeRO config keys of the quantized gradient reduce-scatter (zero_quantized_gradients)."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.comm import quantized_layout
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from unit.common import DistributedTest
from unit.qgz_util import simulated_nodes

KEYS = {"zero_quantized_gradients_group_size": 256, "zero_quantized_gradients_intra_node_bits": 4}


def test_defaults_are_the_layouts():
    config = DeepSpeedZeroConfig(stage=3, zero_quantized_gradients=True)
    assert config.zero_quantized_gradients_group_size == quantized_layout.DEFAULT_GROUP_SIZE
    assert config.zero_quantized_gradients_intra_node_bits == quantized_layout.DEFAULT_INTRA_NODE_BITS
    assert DeepSpeedZeroConfig(stage=3, **KEYS).zero_quantized_gradients_group_size == 256


@pytest.mark.parametrize("key,value,allowed", [
    ("zero_quantized_gradients_group_size", 128, "a multiple of 8 between 136 and 40960"),
    ("zero_quantized_gradients_group_size", 300, "a multiple of 8 between 136 and 40960"),
    ("zero_quantized_gradients_intra_node_bits", 2, "one of (4, 8)"),
])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(key, value, allowed):
    with pytest.raises(ValueError) as raised:
        DeepSpeedZeroConfig(stage=3, zero_quantized_gradients=True, **{key: value})
    assert f"{key} {value} must be {allowed}" in str(raised.value)


def test_fused_is_auto_by_default_and_refused_where_it_cannot_run(monkeypatch):
    from deepspeed.runtime.comm import quantized_fused
    assert DeepSpeedZeroConfig(stage=3, zero_quantized_gradients=True).zero_quantized_gradients_fused == "auto"
    for value in (True, False, "auto"):
        assert DeepSpeedZeroConfig(stage=3, zero_quantized_gradients_fused=value).zero_quantized_gradients_fused \
            is value or value == "auto"
    with pytest.raises(ValueError) as raised:
        DeepSpeedZeroConfig(stage=3, zero_quantized_gradients=True, zero_quantized_gradients_fused="yes")
    assert "zero_quantized_gradients_fused 'yes' must be one of true, false or \"auto\"" in str(raised.value)
    monkeypatch.setattr(quantized_fused, "triton", None)
    assert DeepSpeedZeroConfig(stage=3, zero_quantized_gradients_fused="auto").zero_quantized_gradients_fused == "auto"
    with pytest.raises(ValueError) as raised:
        DeepSpeedZeroConfig(stage=3, zero_quantized_gradients=True, zero_quantized_gradients_fused=True)
    assert "zero_quantized_gradients_fused true cannot run here: Triton is not installed" in str(raised.value)


def model_and_config(**zero):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 33), torch.nn.ReLU(), torch.nn.Linear(33, 40))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3
            }
        },
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_gradients": True,
            **zero
        },
    }
    return model, config


class TestQuantizedGradientsConfigAtInitialize(DistributedTest):
    world_size = 1

    @pytest.mark.parametrize("key,value,message", [
        ("zero_quantized_gradients_intra_node_bits", 16, "zero_quantized_gradients_intra_node_bits 16 must be one of"),
        ("zero_quantized_gradients_fused", "on", "zero_quantized_gradients_fused 'on' must be one of true, false or"),
    ])
    def test_bad_value_fails_at_initialize(self, key, value, message):
        model, config = model_and_config(**{key: value})
        with pytest.raises(ValueError, match=message):
            deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


class TestQuantizedGradientsConfigReachesTheCall(DistributedTest):
    """At 3 nodes x 2 ranks, a ZeRO-3 step with non-default keys: stage 3 hands them to
    all_to_all_quant_reduce, whose accounting shows the layout they make."""
    world_size = 6
    reuse_dist_env = True

    def test_keys_reach_all_to_all_quant_reduce(self):
        from deepspeed.runtime.comm import coalesced_collectives
        from deepspeed.runtime.comm.quantized_pipeline import quantized_reduce_plan
        from deepspeed.runtime.zero import stage3

        def intra_node_bytes(tensors, group_size, bits):
            """What a call sends inside the node with these settings (3 nodes x 2 ranks)."""
            quantized = tuple(t.numel() for t in tensors if t.dim() > 1)
            exact = sum(-(-t.numel() // 6) * t.element_size() for t in tensors if t.dim() <= 1)
            return exact + sum(layout.intra_node_bytes
                               for _, layout in quantized_reduce_plan(quantized, 3, 2, group_size, bits))

        with simulated_nodes(2):
            model, config = model_and_config(**KEYS)
            engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            calls = []
            real = stage3.all_to_all_quant_reduce

            def recording(tensors, groups, **kwargs):
                outputs = real(tensors, groups, **kwargs)
                calls.append((kwargs, coalesced_collectives.qgz_accounting.last_call.intra_node_bytes,
                              intra_node_bytes(tensors, 256, 4),
                              intra_node_bytes(tensors, quantized_layout.DEFAULT_GROUP_SIZE,
                                               quantized_layout.DEFAULT_INTRA_NODE_BITS)))
                return outputs

            stage3.all_to_all_quant_reduce = recording
            try:
                x = torch.randn(2, 40, device=engine.device, dtype=torch.bfloat16)
                engine.backward(engine(x).float().pow(2).mean())
                engine.step()
            finally:
                stage3.all_to_all_quant_reduce = real
        assert calls and dist.get_world_size() == 6
        for kwargs, reported, with_keys, with_defaults in calls:
            assert kwargs == {"group_size": 256, "intra_node_bits": 4, "fused": "auto"}
            # the accounting shows the layout the keys make, which is not the defaults'
            assert reported == with_keys != with_defaults


class TestFusedSettingsTrainAsTheDefault(DistributedTest):
    """At 3 nodes x 2 ranks, ZeRO-3 with the default zero_quantized_gradients_fused ("auto") and
    with true: the same losses and the same weights, bit for bit, as with false (DeepSpeed's
    quantizer kernels), step by step."""
    world_size = 6
    reuse_dist_env = True

    def train(self, **zero):
        model, config = model_and_config(**zero)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        gen = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for _ in range(2):
            x = torch.randn(2, 40, generator=gen).to(device=engine.device, dtype=torch.bfloat16)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        # each rank's part of the weights: its partitions, less the padding past a parameter's end (which
        # holds whatever its memory held where qwZ is off)
        parts = []
        for p in engine.module.parameters():
            size = p.ds_tensor.ds_numel
            parts.append(p.ds_tensor.narrow(0, 0, max(0, min(p.ds_numel - dist.get_rank() * size, size))).clone())
        return losses, parts

    def assert_same_training(self, run, expected):
        assert run[0] == expected[0]
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(run[1], expected[1]))

    def test_the_default_config_trains_as_fused_false(self):
        """Without the interpreter the CPU takes DeepSpeed's kernels, saying why; under it the
        self-check and the times decide: the losses are the same either way."""
        from deepspeed.runtime.comm import quantized_fused_choice
        with simulated_nodes(2):
            default = self.train()
            off = self.train(zero_quantized_gradients_fused=False)
        self.assert_same_training(default, off)
        decided = [c for key, c in quantized_fused_choice.choices().items() if key.setting == "auto"]
        assert decided and all(
            c.reason.startswith('qgZ zero_quantized_gradients_fused "auto" (bfloat16') for c in decided)

    def test_fused_training_equals_the_default(self):
        from deepspeed.runtime.comm.quantized_fused import fused_unavailable_reason
        reason = fused_unavailable_reason(get_accelerator().device_name())
        if reason is not None:
            pytest.skip(f"fused kernels: {reason}")
        with simulated_nodes(2):
            self.assert_same_training(self.train(zero_quantized_gradients_fused=True),
                                      self.train(zero_quantized_gradients_fused=False))

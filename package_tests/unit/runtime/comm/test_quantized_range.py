# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The range contract of the quantized gradient reduce-scatter, for fp16, bf16 and fp32 and both
intra-node precisions: finite gradients never give NaN, a result is finite wherever the exact
average is (it saturates at the dtype's largest value), and the error bound holds (hypothesis, over
each dtype's whole finite range, on simulated clusters).

And the outputs, recorded: every case of `recorded_cases` was run through the simulated cluster
with the CPU quantizer op before the range contract changed the pipeline, and the SHA-256 of each
case's outputs (every rank's partitions, in rank order, NaNs written as one canonical NaN) is in
qgz_recorded_outputs.json. The cases stay where those outputs were finite, so the pipeline must
still give the same bits."""

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from deepspeed.accelerator import get_accelerator
from deepspeed_qgz.qgz.quantized_simulation import simulate_all_to_all_quant_reduce

from unit import qgz_util

RECORDED = Path(__file__).with_name("qgz_recorded_outputs.json")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BUCKET = [(33, 17), (64, 48), (5, 5, 5), (1, 9)]


@pytest.fixture(scope="module")
def cpu_quantizer():
    return qgz_util.quantizer()


@settings(max_examples=200, deadline=None)
@given(topology=st.sampled_from([(3, 2), (2, 3), (5, 1), (1, 4), (2, 8)]),
       shapes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 9)), min_size=1, max_size=2),
       dtype=st.sampled_from(list(DTYPES.values())),
       bits=st.sampled_from([4, 8]),
       pattern=st.sampled_from(qgz_util.RANGE_PATTERNS),
       seed=st.integers(0, 2**16))
def test_range_contract(cpu_quantizer, topology, shapes, dtype, bits, pattern, seed):
    """Finite inputs anywhere in the dtype's range: every result finite and within the error bound
    of the exact average."""
    num_nodes, local_size = topology
    inputs = qgz_util.range_inputs(shapes, num_nodes * local_size, dtype, seed, pattern)
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, cpu_quantizer, intra_node_bits=bits)
    problems = [
        f"rank {rank}{problem}" for rank in range(len(inputs))
        for problem in qgz_util.check_against_average(inputs, outputs[rank], rank)
    ]
    assert not problems, "\n".join(problems[:10])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=str)
def test_largest_values_come_back_finite(cpu_quantizer, dtype, bits):
    """A bucket of the dtype's largest value on every rank (fp16: 65504): the average is that value,
    and the result is within a quantization step of it, never inf; nodes of opposite signs average
    to about zero, never NaN, also with more than 4 ranks per node."""
    largest = torch.finfo(dtype).max
    for num_nodes, local_size in ((3, 2), (2, 8)):
        world = num_nodes * local_size
        same = [[torch.full((16, 17), largest, dtype=dtype)] for _ in range(world)]
        opposite = [[torch.full((16, 17), largest * (-1)**(rank // local_size), dtype=dtype)] for rank in range(world)]
        for inputs in (same, opposite):
            outputs, _ = simulate_all_to_all_quant_reduce(inputs,
                                                          num_nodes,
                                                          local_size,
                                                          cpu_quantizer,
                                                          intra_node_bits=bits)
            problems = [
                f"rank {rank}{p}" for rank in range(world)
                for p in qgz_util.check_against_average(inputs, outputs[rank], rank)
            ]
            assert not problems, "\n".join(problems[:10])


def _special(inputs, kind, world):
    """Edits a case's inputs in place: zero groups, a silent rank, non-finite values."""
    if kind == "zero groups":
        for rank in range(world):
            inputs[rank][1][:20].zero_()
        inputs[world - 1][0].zero_()
    elif kind == "non-finite":
        inputs[0][1].view(-1)[5] = float("nan")
        inputs[world - 1][0].view(-1)[-3] = float("inf")
        inputs[world // 2][2].view(-1)[7] = float("-inf")


def recorded_cases():
    """name -> (num_nodes, local_size, shapes, dtype, intra_node_bits, group_size, magnitudes, special)."""
    cases = {}
    magnitude_sets = {
        "fp16": {
            "unit": [1.0] * 4,
            "mixed": [1e-2, 1e4, 1.0, 1e-2],
            "subnormal": [1e-6, 1e-7, 1e-6, 1.0],
            "large": [8e3, 4e3, 6e3, 1.0],
        },
        "bf16": {
            "unit": [1.0] * 4,
            "mixed": [1e-3, 1e3, 1.0, 1e-3],
            "tiny": [1e-30, 1e-33, 1e-30, 1.0],
            "large": [1e30, 1e32, 1e30, 1.0],
        },
    }
    magnitude_sets["fp32"] = magnitude_sets["bf16"]
    for num_nodes, local_size in ((3, 2), (2, 3), (5, 2), (1, 4), (4, 1), (2, 8)):
        for dtype_name in DTYPES:
            for bits in (4, 8):
                for mag_name, magnitudes in magnitude_sets[dtype_name].items():
                    name = f"{num_nodes}x{local_size}/{dtype_name}/{bits}/{mag_name}"
                    cases[name] = (num_nodes, local_size, BUCKET, dtype_name, bits, 136, magnitudes, None)
                for special in ("zero groups", "non-finite"):
                    name = f"{num_nodes}x{local_size}/{dtype_name}/{bits}/{special}"
                    cases[name] = (num_nodes, local_size, BUCKET, dtype_name, bits, 136, [1.0] * 4, special)
    for group_size in (1024, 40960):
        for bits in (4, 8):
            name = f"3x2/bf16/{bits}/group size {group_size}"
            cases[name] = (3, 2, [(33, 17), (300, 7)], "bf16", bits, group_size, [1.0, 1.0], None)
    return cases


def case_inputs(name):
    num_nodes, local_size, shapes, dtype_name, bits, group_size, magnitudes, special = recorded_cases()[name]
    world = num_nodes * local_size
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    inputs = qgz_util.cluster_inputs(shapes, world, DTYPES[dtype_name], seed, magnitudes)
    _special(inputs, special, world)
    return inputs, dict(num_nodes=num_nodes, local_world_size=local_size, group_size=group_size, intra_node_bits=bits)


def outputs_digest(outputs):
    """SHA-256 of every rank's outputs in order; every NaN written as the canonical NaN."""
    digest = hashlib.sha256()
    for rank_outputs in outputs:
        for out in rank_outputs:
            out = out.detach().cpu()
            out = torch.where(torch.isnan(out), torch.full_like(out, float("nan")), out)
            digest.update(out.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def run_case(name, quantizer=None):
    inputs, kwargs = case_inputs(name)
    outputs, _ = simulate_all_to_all_quant_reduce(inputs, kwargs["num_nodes"], kwargs["local_world_size"], quantizer,
                                                  kwargs["group_size"], kwargs["intra_node_bits"])
    return outputs


def record():
    """Writes qgz_recorded_outputs.json from the pipeline as it is now."""
    digests = {name: outputs_digest(run_case(name)) for name in recorded_cases()}
    RECORDED.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")


@pytest.mark.skipif(get_accelerator().device_name() != "cpu",
                    reason="recorded with the CPU op, which is bit-exact to the reference; CUDA may differ "
                    "in the last bit of a scale (--use_fast_math)")
def test_outputs_equal_the_recorded_ones():
    recorded = json.loads(RECORDED.read_text())
    assert sorted(recorded) == sorted(recorded_cases())
    changed = [name for name in recorded_cases() if outputs_digest(run_case(name)) != recorded[name]]
    assert not changed, f"{len(changed)} of {len(recorded)} cases differ from the recorded outputs: {changed[:10]}"


if __name__ == "__main__" and "--record" in sys.argv:
    os.environ.setdefault("LOCAL_SIZE", "8")
    record()

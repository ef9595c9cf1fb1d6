# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Helpers for the tests of the quantized gradient reduce-scatter (ZeRO++ qgZ)."""

import contextlib
import functools
import math
import os
from unittest import mock

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed_qgz import cpu_quantizer

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
INTRA_NODE_BITS = (4, 8)
# Per-element bound on |result - exact average|, as a multiple of (1 / world) x the sum over ranks
# of the rank's absmax over the partition: an int4 stage errs by at most absmax / 8 per value (the
# absmax itself clamped from code 8 to 7), and there are two (the second on node sums).
ERROR_BOUND = 0.3


def device():
    return get_accelerator().current_device_name()


@functools.lru_cache(maxsize=None)
def quantizer():
    """The accelerator's quantizer op (this package's CPU op on the CPU accelerator) behind the
    kernel-contract checks, as this package's pipeline uses it."""
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
    return ContractCheckedQuantizer(cpu_quantizer.load())


def same_bits(a, b):
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8),
                       b.detach().cpu().contiguous().view(torch.uint8))


def same_values(a, b):
    """Elementwise: the same bits, or both NaN (NaN payloads are no part of the contract: a GPU
    gives every NaN one payload)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if not a.is_floating_point():
        return a == b
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (a.view(bits) == b.view(bits)) | (torch.isnan(a) & torch.isnan(b))


def cluster_inputs(shapes, world, dtype, seed, magnitudes=None):
    """Every rank's tensors (on the CPU): a shared signal plus rank-specific noise, tensor i
    scaled by magnitudes[i]. Every rank of a real world builds all of them from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    magnitudes = magnitudes or [1.0] * len(shapes)
    signals = [torch.randn(shape, generator=gen, dtype=torch.float64) * m for shape, m in zip(shapes, magnitudes)]
    return [[(s + 0.25 * torch.randn(s.shape, generator=gen, dtype=torch.float64) * m).to(dtype)
             for s, m in zip(signals, magnitudes)] for _ in range(world)]


RANGE_PATTERNS = ("mixed", "one rank far larger", "constant", "largest", "smallest")


def range_inputs(shapes, world, dtype, seed, pattern):
    """Every rank's tensors (on the CPU) over the dtype's whole finite range, from its smallest
    normal to its largest value, both signs: "mixed", each rank's values spread over the range;
    "one rank far larger", one rank near the top and the others anywhere below; "constant", every
    tensor of a rank one value; "largest", every value +-the largest; "smallest", every rank near
    the smallest normal."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    low, high = math.log2(info.tiny), math.log2(info.max)

    def uniform(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(*shape, generator=gen, dtype=torch.float64)

    def signs(*shape):
        return torch.randint(0, 2, shape, generator=gen).double() * 2 - 1

    big = int(torch.randint(0, world, (1, ), generator=gen))
    inputs = []
    for rank in range(world):
        tensors = []
        for shape in shapes:
            if pattern == "mixed":
                exponents = uniform(*shape, lo=low, hi=high)
            elif pattern == "one rank far larger":
                exponents = uniform(*shape, lo=high -
                                    4, hi=high) if rank == big else uniform(*shape, lo=low, hi=high - 8)
            elif pattern == "constant":
                exponents = uniform(1, lo=low, hi=high).expand(shape)
            elif pattern == "largest":
                exponents = torch.full(shape, high, dtype=torch.float64)
            else:
                exponents = uniform(*shape, lo=low, hi=low + 4)
            sign = signs(1).expand(shape) if pattern == "constant" else signs(*shape)
            values = (sign * torch.exp2(exponents)).clamp(-info.max, info.max)
            tensors.append(values.to(dtype))
        inputs.append(tensors)
    return inputs


def partition_bounds(numel, world, rank):
    chunk = math.ceil(numel / world)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def check_against_average(inputs, outputs, rank, exact_indices=(), rms_bound=None):
    """Problems (a list of strings) with `rank`'s results against reduce_scatter_coalesced's
    contract: its partition of each tensor, the tensor's dtype, within the quantization error of
    the exact average in that tensor's own magnitude (tensors in `exact_indices`: within the
    dtype's rounding), and, with `rms_bound`, a relative RMS error below it."""
    world, problems = len(inputs), []
    for i, out in enumerate(outputs):
        tensor = inputs[rank][i]
        lo, hi = partition_bounds(tensor.numel(), world, rank)
        if out.shape != (hi - lo, ) or out.dtype != tensor.dtype:
            problems.append(f"[{i}]: shape {tuple(out.shape)} {out.dtype}, expected ({hi - lo},) {tensor.dtype}")
            continue
        if hi == lo:
            continue
        parts = [inputs[r][i].reshape(-1)[lo:hi].cpu().double() for r in range(world)]
        exact = torch.stack(parts).mean(0)
        got = out.detach().cpu().double()
        if not torch.isfinite(got).all():
            problems.append(f"[{i}]: non-finite output")
            continue
        # the floor: half a unit in the last place of the dtype's subnormals
        floor = torch.finfo(tensor.dtype).tiny * torch.finfo(tensor.dtype).eps
        if i in exact_indices:
            bound = 2**-6 * sum(p.abs() for p in parts) / world + floor
        else:
            bound = ERROR_BOUND * sum(p.abs().max() for p in parts) / world + exact.abs() * 2**-7 + floor
        err = (got - exact).abs()
        if (err > bound).any():
            j = int((err - bound).argmax())
            problems.append(f"[{i}]: |err| {float(err[j]):.3g} > bound {float(bound[j]):.3g} at {lo + j} "
                            f"(got {float(got[j]):.6g}, exact {float(exact[j]):.6g})")
        if rms_bound is not None and i not in exact_indices and exact.numel() >= 64:
            rel = float(err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
            if rel > rms_bound:
                problems.append(f"[{i}]: relative rms error {rel:.3f} > {rms_bound}")
    return problems


@contextlib.contextmanager
def simulated_nodes(local_size):
    """Inside: the accelerator reports `local_size` devices per node, so the processes of a test's
    world form nodes of that many ranks (LOCAL_SIZE on the CPU accelerator, the device count
    elsewhere). Yields the qgZ groups of that topology, built afresh.

    The all-to-all groups built inside (these, and those of a DeepSpeed engine initialized inside)
    are destroyed on exit: DeepSpeed builds new ones at every call of _get_local_all_to_all_group,
    an idle gloo group keeps a polling thread in each of its processes (20 groups: 4% of a core per
    process), and the worlds DeepSpeed's harness reuses live for the whole session, so a session's
    groups, kept, starve the machine the tests run on. (DeepSpeed's other groups are built once per
    process and kept for later engines.)"""
    from deepspeed.utils import groups
    accelerator = get_accelerator()
    saved = os.environ.get("LOCAL_SIZE")
    os.environ["LOCAL_SIZE"] = str(local_size)
    patched = accelerator.device_name() != "cpu"
    if patched:
        accelerator.device_count = lambda: local_size
    before = dict(groups._ALL_TO_ALL_GROUP)
    built = []
    real = groups._get_local_all_to_all_group

    def recorded():
        made = real()
        built.extend(g for g in made.values() if not any(g is b for b in built))
        return made

    try:
        with mock.patch.object(groups, "_get_local_all_to_all_group", recorded):
            yield dict(recorded())
    finally:
        groups._ALL_TO_ALL_GROUP.clear()
        groups._ALL_TO_ALL_GROUP.update(before)
        for group in built:
            if not any(group is b for b in before.values()):
                dist.destroy_process_group(group)
        if patched:
            del accelerator.device_count
        if saved is None:
            os.environ.pop("LOCAL_SIZE", None)
        else:
            os.environ["LOCAL_SIZE"] = saved

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Helpers for the tests of this package's quantizer ops and of ZeRO++ (qgZ, qwZ) on simulated nodes."""

import contextlib
import functools
import os
from unittest import mock

import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed_qgz import cpu_quantizer


def device():
    return get_accelerator().current_device_name()


@functools.lru_cache(maxsize=None)
def quantizer():
    """The accelerator's quantizer op (this package's CPU op on the CPU accelerator) behind the
    kernel-contract checks."""
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


def cluster_inputs(shapes, world, dtype, seed):
    """Every rank's tensors (on the CPU): a shared signal plus rank-specific noise. Every rank of a
    real world builds all of them from the same seed."""
    gen = torch.Generator().manual_seed(seed)
    signals = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    return [[(s + 0.25 * torch.randn(s.shape, generator=gen, dtype=torch.float64)).to(dtype) for s in signals]
            for _ in range(world)]


@contextlib.contextmanager
def quantizer_caches(op):
    """qgZ's and qwZ's quantizer op caches set to `op` inside (None: left as they are)."""
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer
    saved = coalesced_collectives.quantizer_module, CUDAQuantizer.quantizer_cuda_module
    if op is not None:
        coalesced_collectives.quantizer_module = CUDAQuantizer.quantizer_cuda_module = op
    try:
        yield
    finally:
        coalesced_collectives.quantizer_module, CUDAQuantizer.quantizer_cuda_module = saved


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

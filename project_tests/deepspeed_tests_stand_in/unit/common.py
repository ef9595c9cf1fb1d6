# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A stand-in for DeepSpeed's tests/unit/common.py where DeepSpeed's test tree is not at hand (its
source distribution ships no tests): the patch's DeepSpeed-form tests run on it in this project's
CI, and on DeepSpeed's own DistributedTest from a DeepSpeed checkout (scripts/deepspeed_tests.sh).

Only the interface those tests use, with DeepSpeed's semantics: a DistributedTest class names its
`world_size` (or a test its `world_size` argument); each test method runs in every process of a world of that many processes, with
MASTER_ADDR/MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_SIZE (= the world size) set and
deepspeed.init_distributed called on the accelerator's backend; a world larger than the
accelerator's device count is skipped; `reuse_dist_env` keeps one pool of processes per world size
for the whole session. A failure in any process fails the test; pytest.skip in the processes
skips it."""

import importlib.util
import multiprocessing
import os
import socket
import sys
import tempfile
import types
from pathlib import Path

import pytest
from _pytest.outcomes import Skipped

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from qgz_harness import release_deepspeed_shm  # scripts/, on PYTHONPATH (scripts/deepspeed_tests.sh)

TIMEOUT_S = int(os.environ.get("DS_UNITTEST_TIMEOUT", "600"))


def _npu_quantizer_stand_in():
    """DeepSpeed's tests take NPUQuantizer, its pure-PyTorch quantizer, on an accelerator with no
    compiled one (the CPU); releases before 0.19 ship none. There this package's CPU op, which states
    the CUDA kernels, stands in for it, in every process of the tests (scripts/releases_check.sh)."""
    if importlib.util.find_spec("deepspeed.ops.op_builder.npu.quantizer") is None:
        from deepspeed_qgz.cpu_quantizer import load
        module = types.ModuleType("deepspeed.ops.op_builder.npu.quantizer")
        module.NPUQuantizer = load()
        sys.modules[module.__name__] = module


_npu_quantizer_stand_in()

# What deepspeed.initialize imports on first use, imported here too (below: once for every world's
# processes): torch.optim's first optimizer imports torch._dynamo, and DeepSpeed's check of the
# optimizer its Muon module where the release has one, whose torch.compile decorators import
# torch's inductor. Each process that trains spent about 5 s of CPU on them.
for _name in ("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"):
    try:
        importlib.import_module(_name)
    except ImportError:  # a release without it
        pass

# The worlds' processes fork from a server that has imported this module (torch, DeepSpeed and the
# quantizer op with it) once: a process that imports them itself spends seconds of CPU before it
# runs a test, which made most of a session's time (forking is safe here: the server runs no
# collective and no OpenMP region).
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload([__name__])


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class DistributedTest:
    world_size = 2
    backend = get_accelerator().communication_backend_name()
    reuse_dist_env = False
    is_dist_test = True
    _pools = {}  # world size -> (pool, port, init file), shared by every class when reused

    def _launch(self, test_name, kwargs):
        world = kwargs.get("world_size", self.world_size)  # a parametrized world size, as DeepSpeed's takes it
        if get_accelerator().device_count() < world:
            pytest.skip(f"{world} processes need {world} devices, the accelerator has "
                        f"{get_accelerator().device_count()}")
        if self.reuse_dist_env and world in DistributedTest._pools:
            pool, port, init_file = DistributedTest._pools[world]
        else:
            pool = FORKSERVER.Pool(world)
            port = _free_port()
            init_file = tempfile.NamedTemporaryFile(delete=False, suffix="_filestore").name
            if self.reuse_dist_env:
                DistributedTest._pools[world] = (pool, port, init_file)
        try:
            work = pool.starmap_async(self._run_in_process,
                                      [(rank, world, port, init_file, test_name, kwargs) for rank in range(world)])
            try:
                skips = work.get(TIMEOUT_S)
            except multiprocessing.TimeoutError:
                pytest.exit(f"{type(self).__name__}.{test_name} hung for {TIMEOUT_S} s", returncode=1)
        finally:
            if not self.reuse_dist_env:
                close_pool(pool, world)
        skips = [message for message in skips if message]
        if skips:
            pytest.skip(skips[0])

    def _run_in_process(self, rank, world, port, init_file, test_name, kwargs):
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port),
                              RANK=str(rank),
                              LOCAL_RANK=str(rank),
                              WORLD_SIZE=str(world),
                              LOCAL_SIZE=str(world))
            get_accelerator().set_device(rank)
            if os.environ.get("DS_TESTS_SKIP_SHM_OP"):
                # A DeepSpeed imported from a source tree builds this op anew (four minutes on two
                # cores); the tests that set this (scripts/check_series.sh) use no collective of it.
                deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
            deepspeed.init_distributed(dist_backend=self.backend,
                                       init_method=f"file://{init_file}",
                                       rank=rank,
                                       world_size=world)
            release_deepspeed_shm()
        try:
            getattr(self, test_name)(**kwargs)
        except Skipped as skip:
            return skip.msg
        return ""


def _destroy():
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def close_pool(pool, world):
    pool.starmap(_destroy, [() for _ in range(world)])
    pool.close()
    pool.join()


def close_all_pools():
    for world, (pool, _, init_file) in list(DistributedTest._pools.items()):
        close_pool(pool, world)
        Path(init_file).unlink(missing_ok=True)
    DistributedTest._pools.clear()

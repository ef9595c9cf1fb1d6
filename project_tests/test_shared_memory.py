# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The simulated clusters leave nothing in /dev/shm: DeepSpeed's CPU communication op gives every
process a 69 MB shared-memory buffer it never unlinks, and every test, benchmark and script world
here runs on a new port, so without qgz_harness.release_deepspeed_shm a test run would leave
gigabytes behind."""

import sys

from qgz_harness import SCRIPTS_DIR, run_world

WORKER = """
import glob, os, sys
import torch, deepspeed, deepspeed.comm as dist
sys.path.insert(0, {scripts!r})
from qgz_harness import release_deepspeed_shm, write_report
deepspeed.init_distributed(dist_backend="gloo")
names = "/dev/shm/deepspeed_allreduce_buffer_%d_%s_%s_*" % (os.getuid(), os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
before = sorted(glob.glob(names))
release_deepspeed_shm()
dist.barrier()
after = sorted(glob.glob(names))
total = torch.full((4096,), float(dist.get_rank() + 1))
dist.inference_all_reduce(total)  # through the shared buffers where the CPU supports the op's kernel
write_report({{"before": len(before), "after": after, "total": sorted(set(total.tolist())),
              "shm_level": getattr(dist.cdb, "shm_vector_kernel_level", None)}})
"""


def test_worlds_release_deepspeed_shared_memory():
    code = WORKER.format(scripts=str(SCRIPTS_DIR))
    reports = run_world([sys.executable, "-c", code], num_nodes=1, local_world_size=3)
    for rank, report in enumerate(reports):
        assert report["before"] == 3, (rank, report)  # one buffer per rank while the world starts
        assert report["after"] == [], (rank, report)  # none left once every rank has mapped them
        assert report["total"] == [6.0], (rank, report)  # the buffers still work, unlinked

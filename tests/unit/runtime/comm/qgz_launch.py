# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run a worker script as a gloo world of simulated nodes on this machine.

Each rank is its own Python process with the environment a launcher gives it (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_SIZE = devices per node, MASTER_ADDR on loopback), so DeepSpeed's CPU accelerator
reports LOCAL_SIZE devices and builds the qgZ groups exactly as on a cluster of that shape. One
spawn runs many cases: process start-up (importing torch and deepspeed) dominates."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "qgz_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_world(num_nodes: int, local_size: int, suite: str, timeout: float = 600, extra_env=None):
    """Run `suite` of qgz_worker.py on num_nodes x local_size ranks; returns each rank's report."""
    world = num_nodes * local_size
    port = free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = []
        for rank in range(world):
            env = dict(os.environ,
                       RANK=str(rank),
                       WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % local_size),
                       LOCAL_SIZE=str(local_size),
                       MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1",
                       **(extra_env or {}))
            log = open(Path(out_dir) / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen([sys.executable, str(WORKER), suite, out_dir],
                                           env=env,
                                           stdout=log,
                                           stderr=subprocess.STDOUT), log))
        failed = []
        try:
            for rank, (proc, log) in enumerate(procs):
                proc.wait(timeout=timeout)
                log.close()
                if proc.returncode != 0:
                    failed.append(rank)
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
        if failed:
            logs = "\n".join(f"--- rank {r} ---\n" + (Path(out_dir) / f"rank{r}.log").read_text()[-3000:]
                             for r in failed[:2])
            raise AssertionError(f"{num_nodes}x{local_size} {suite}: ranks {failed} failed\n{logs}")
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run the report's training on 3 nodes x 2 processes on this machine: three torchrun agents with
a c10d rendezvous on 127.0.0.1, LOCAL_SIZE=2 so DeepSpeed's CPU accelerator sees two devices per
node. With --compare, runs qgZ on and off and prints both loss curves side by side."""

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODES, PROCS_PER_NODE = 3, 2


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(config, steps, timeout=600):
    """Returns ({rank: [loss per step]}, rank 0's qgZ totals, the agents' combined output)."""
    port = free_port()
    env = dict(os.environ, LOCAL_SIZE=str(PROCS_PER_NODE), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as logs:
        agents = []
        for node in range(NODES):
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes",
                str(NODES), "--nproc-per-node",
                str(PROCS_PER_NODE), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                f"qgz-{port}", "--local_addr", "127.0.0.1",
                str(HERE / "train.py"), "--deepspeed_config",
                str(config), "--steps",
                str(steps), "--loss-dir", logs
            ]
            log = open(Path(logs) / f"node{node}.log", "w+")
            agents.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
        try:
            codes = [proc.wait(timeout=timeout) for proc, _ in agents]
        finally:
            for proc, _ in agents:
                if proc.poll() is None:
                    proc.kill()
        output = ""
        for _, log in agents:
            log.seek(0)
            output += log.read()
            log.close()
        if any(codes):
            raise RuntimeError(f"training failed (agent exit codes {codes}):\n{output[-6000:]}")
        reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in Path(logs).glob("rank*.json")}
    losses = {rank: reports[rank]["losses"] for rank in sorted(reports)}
    return losses, reports[0]["qgz"], output


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compare", action="store_true", help="also run with zero_quantized_gradients: false")
    args = parser.parse_args()

    qgz_losses, summary, _ = run(HERE / "ds_config_qgz.json", args.steps)
    exact_losses = run(HERE / "ds_config_exact.json", args.steps)[0] if args.compare else None
    print(f"3 nodes x 2 processes, ZeRO-3, bf16, {args.steps} steps; rank 0 loss per step")
    print(f"{'step':>4}  {'qgZ on':>10}" + (f"  {'qgZ off':>10}  {'rel diff':>8}" if exact_losses else ""))
    for step, loss in enumerate(qgz_losses[0]):
        line = f"{step:>4}  {loss:>10.6f}"
        if exact_losses:
            ref = exact_losses[0][step]
            line += f"  {ref:>10.6f}  {abs(loss - ref) / abs(ref):>8.2e}"
        print(line)
    finite = all(math.isfinite(l) for losses in qgz_losses.values() for l in losses)
    print(f"all {len(qgz_losses)} ranks finite: {finite}")
    print(f"qgZ: {summary['calls']} calls, {summary['quantized_tensors']} tensors ({summary['quantized_elems']} "
          f"elements) quantized, {summary['padding_elems']} padding elements added, {summary['exact_tensors']} 1-D "
          f"tensors exact, {summary['collective_calls']} collective calls")
    return 0 if finite and summary["quantized_tensors"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())

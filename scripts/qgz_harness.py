# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the tests, benchmarks and scripts of this project share: simulated clusters on one machine
(a gloo world of processes, or torchrun agents, each simulated node with its own LOCAL_SIZE),
DeepSpeed's unpatched modules for side-by-side runs, collective counters and bitwise comparison.
Nothing here runs in a user's training; importing it imports neither torch nor deepspeed."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

# The unpatched DeepSpeed to compare against, where the installed one is patched in-tree: a source
# tree (an unpacked source distribution) whose deepspeed/ package holds upstream's files.
UPSTREAM_ENV = "QGZ_UPSTREAM_DEEPSPEED"
# This folder: what a fresh interpreter puts on sys.path to import this module.
SCRIPTS_DIR = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log(message: str) -> None:
    """A progress line for long commands (stdout, flushed, with the time of day)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def rank_env(rank: int, num_nodes: int, local_world_size: int, port: int) -> Dict[str, str]:
    """The environment a launcher gives one rank of a num_nodes x local_world_size world on this
    machine: DeepSpeed's CPU accelerator reports LOCAL_SIZE devices, so it builds the qgZ groups
    exactly as on a cluster of that shape."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(num_nodes * local_world_size),
        "LOCAL_RANK": str(rank % local_world_size),
        "LOCAL_SIZE": str(local_world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def run_world(command: Sequence[str],
              num_nodes: int,
              local_world_size: int,
              timeout: float = 900,
              env: Optional[Dict[str, str]] = None) -> List[dict]:
    """Run `command` once per rank of a num_nodes x local_world_size gloo world (one process each).
    Each rank must write its report as JSON to $QGZ_REPORT_DIR/rank{RANK}.json; returns them in
    rank order.

    Raises:
        AssertionError: a rank failed or timed out, with the tail of the first failing ranks' output.
    """
    world, port = num_nodes * local_world_size, free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = []
        for rank in range(world):
            rank_vars = dict(os.environ, **rank_env(rank, num_nodes, local_world_size, port), QGZ_REPORT_DIR=out_dir)
            log_file = open(Path(out_dir) / f"rank{rank}.log", "w")
            procs.append((subprocess.Popen(list(command),
                                           env=dict(rank_vars, **(env or {})),
                                           stdout=log_file,
                                           stderr=subprocess.STDOUT), log_file))
        failed = []
        deadline = time.monotonic() + timeout
        try:
            for rank, (proc, log_file) in enumerate(procs):
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                log_file.close()
                if proc.returncode != 0:
                    failed.append(rank)
        finally:
            for proc, _ in procs:
                if proc.poll() is None:
                    proc.kill()
        if failed:
            logs = "\n".join(f"--- rank {r} ---\n" + (Path(out_dir) / f"rank{r}.log").read_text()[-3000:]
                             for r in failed[:2])
            raise AssertionError(f"{num_nodes}x{local_world_size} {' '.join(command[1:])}: ranks {failed} failed "
                                 f"(or timed out after {timeout:.0f} s)\n{logs}")
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def release_deepspeed_shm() -> None:
    """Unlink this rank's shared-memory buffer of DeepSpeed's CPU communication op; call on every
    rank right after DeepSpeed initialized the process group.

    On the CPU accelerator, deepspeed.init_distributed gives every process a 69 MB buffer in
    /dev/shm named after MASTER_ADDR, MASTER_PORT and the rank (csrc/cpu/comm/shm.cpp) and never
    unlinks it, so every world on a new port would leave world size x 69 MB in /dev/shm until the
    machine restarts. Every rank maps every other rank's buffer before its initialization returns,
    so after a barrier the names are no longer needed: the memory is freed when the world exits.
    On other accelerators only the barrier."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    dist.barrier()
    if get_accelerator().device_name() != "cpu":
        return
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_"
            f"{dist.get_rank()}")
    Path("/dev/shm", name).unlink(missing_ok=True)


def write_report(report: dict) -> None:
    """A rank's side of run_world."""
    Path(os.environ["QGZ_REPORT_DIR"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(report))


def run_torchrun_nodes(script: Sequence[str],
                       num_nodes: int,
                       local_world_size: int,
                       timeout: float = 1800,
                       env: Optional[Dict[str, str]] = None,
                       on_output: Optional[Callable[[str], None]] = None) -> str:
    """Run `script` (a Python file and its arguments) as a num_nodes x local_world_size job of
    num_nodes torchrun agents with a c10d rendezvous on 127.0.0.1, as on a real cluster.
    `on_output` receives the first agent's output lines while the job runs (rank 0 is there).
    Returns the agents' combined output.

    Raises:
        RuntimeError: an agent failed or the job ran past `timeout`, with the output's tail.
    """
    port = free_port()
    agent_env = dict(os.environ, LOCAL_SIZE=str(local_world_size), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    agent_env.update(env or {})
    with tempfile.TemporaryDirectory() as logs:
        agents = []
        for node in range(num_nodes):
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes",
                str(num_nodes), "--nproc-per-node",
                str(local_world_size), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id",
                f"qgz-{port}", "--local_addr", "127.0.0.1", *script
            ]
            out = open(Path(logs) / f"node{node}.log", "w+")
            agents.append((subprocess.Popen(command, env=agent_env, stdout=out, stderr=subprocess.STDOUT), out))
        deadline, seen, pending = time.monotonic() + timeout, 0, ""
        try:
            while any(proc.poll() is None for proc, _ in agents) and time.monotonic() < deadline:
                time.sleep(0.5)
                if on_output is not None:
                    text = (Path(logs) / "node0.log").read_text(errors="replace")
                    pending += text[seen:]
                    seen = len(text)
                    *lines, pending = pending.split("\n")
                    for line in lines:
                        on_output(line)
        finally:
            for proc, _ in agents:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        codes = [proc.returncode for proc, _ in agents]
        output = ""
        for _, out in agents:
            out.seek(0)
            output += out.read()
            out.close()
    if any(codes):
        if "ChildFailedError" not in output and any(sign in output for sign in LAUNCHER_RACE):
            # No worker failed: the agents' own shutdown raced on their store (pytorch/pytorch#69520).
            # The caller checks that every rank reported.
            log(f"warning: torchrun agents exited with codes {codes} after their workers finished "
                f"(their store went away during the exit barrier, pytorch/pytorch#69520)")
            return output
        # the workers' own errors (torchrun prefixes their lines with [rankN]) before the agents' tails
        workers = "\n".join([line for line in output.splitlines() if line.startswith("[rank")][-60:])
        raise RuntimeError(f"{' '.join(script)} failed (agent exit codes {codes}; a negative code is a kill, "
                           f"e.g. after the {timeout:.0f} s timeout):\n{workers}\n...\n{output[-3000:]}")
    return output


# What torchrun agents print when their exit barrier loses its store after the workers are done.
LAUNCHER_RACE = ("exit barrier", "TCPStore", "DistStoreError", "RendezvousConnectionError")


class Progress:
    """A progress bar over `total` steps on one line of a terminal, or a line every tenth of the
    way in a log (CI)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.start = total, label, time.monotonic()
        self.done, self.printed = 0, -1
        self.first = None  # (time, steps) of the first update: the rate leaves start-up out
        self.tty = sys.stdout.isatty()

    def update(self, done: int, note: str = "") -> None:
        self.done = min(done, self.total)
        now = time.monotonic()
        self.first = self.first or (now, self.done)
        rate = f", {(now - self.first[0]) / (self.done - self.first[1]):.2f} s/step" if self.done > self.first[
            1] else ""
        bar = "#" * (30 * self.done // self.total)
        line = (f"  {self.label} [{bar:<30}] {self.done}/{self.total} ({now - self.start:.0f} s{rate})"
                f"{f' {note}' if note else ''}")
        tenth = 10 * self.done // self.total
        if self.tty:
            print("\r" + line, end="\n" if self.done == self.total else "", flush=True)
        elif tenth != self.printed:
            self.printed = tenth
            print(line, flush=True)


def overlay_active() -> bool:
    from deepspeed_qgz._finder import overlay_state
    return overlay_state()[0]


def load_upstream_module(relative_path: str, name: str):
    """DeepSpeed's own, unpatched module at `relative_path` (e.g. "runtime/comm/coalesced_collectives.py"
    inside the deepspeed package), loaded under `name`: from the installed package when the overlay
    is active (the installed files are upstream's), else from $QGZ_UPSTREAM_DEEPSPEED.

    Raises:
        LookupError: DeepSpeed is patched in-tree and QGZ_UPSTREAM_DEEPSPEED is not set.
    """
    if overlay_active():
        root = Path(importlib.util.find_spec("deepspeed").origin).parent
    elif os.environ.get(UPSTREAM_ENV):
        root = Path(os.environ[UPSTREAM_ENV]) / "deepspeed"
    else:
        raise LookupError(f"the installed DeepSpeed is patched and {UPSTREAM_ENV} does not name an unpatched one")
    spec = importlib.util.spec_from_file_location(name, root / relative_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BeyondContract:
    """The quantizer op `ops` for running DeepSpeed 0.19.8's own calls: its grouping can make
    quantized_reduction reduce with fewer threads than a warp, which is undefined on CUDA and which
    the op refuses; such calls are computed by the PyTorch reference as if the shuffles read nothing
    stale. Every call within the kernels' contract is the op's."""

    def __init__(self, ops):
        self.ops, self.Symmetric = ops, ops.Symmetric

    def quantized_reduction(self, data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size):
        from deepspeed_qgz.qgz import qgz_contract, qgz_reference
        args = (data, scales, in_groups, out_groups, num_bits, quant_type, local_world_size)
        if qgz_contract.quantized_reduction_violations(data.numel(), scales.numel(), in_groups, out_groups, num_bits,
                                                       quant_type, local_world_size):
            return qgz_reference.quantized_reduction_beyond_contract(*args)
        return self.ops.quantized_reduction(*args)

    def __getattr__(self, name):
        return getattr(self.ops, name)


class CollectiveCounter:
    """Counts a rank's collective calls and the bytes it sends to ranks inside and outside its node,
    by wrapping `all_to_all_single` in the given modules and deepspeed.comm's reduce_scatter_fn.
    A group counts as inside the node when all its ranks are (rank // local_world_size). Use as a
    context manager; `reset()` between measurements."""

    def __init__(self, modules, world_size: int, local_world_size: int):
        self.modules = list(modules)
        self.world_size, self.local_world_size = world_size, local_world_size
        self.reset()

    def reset(self):
        self.calls, self.all_to_all_calls, self.intra_bytes, self.inter_bytes = 0, 0, 0, 0

    def _within_node(self, group) -> bool:
        import torch.distributed as torch_dist
        ranks = torch_dist.get_process_group_ranks(group) if group is not None else range(self.world_size)
        return len({r // self.local_world_size for r in ranks}) == 1

    def _all_to_all(self, real):
        import deepspeed.comm as dist

        def counted(output, tensor, group=None, **kwargs):
            size = dist.get_world_size(group)
            self.calls += 1
            self.all_to_all_calls += 1
            sent = tensor.numel() * tensor.element_size() * (size - 1) // size
            if self._within_node(group):
                self.intra_bytes += sent
            else:
                self.inter_bytes += sent
            return real(output, tensor, group=group, **kwargs)

        return counted

    def _reduce_scatter(self, real):

        def counted(output, tensor, group=None, **kwargs):
            share = tensor.numel() * tensor.element_size() // self.world_size
            self.calls += 1
            self.intra_bytes += (self.local_world_size - 1) * share
            self.inter_bytes += (self.world_size - self.local_world_size) * share
            return real(output, tensor, group=group, **kwargs)

        return counted

    def __enter__(self):
        import deepspeed.comm as dist
        self._saved = [(m, m.all_to_all_single) for m in self.modules]
        for module, real in self._saved:
            module.all_to_all_single = self._all_to_all(real)
        self._saved_rs = dist.reduce_scatter_fn
        dist.reduce_scatter_fn = self._reduce_scatter(self._saved_rs)
        return self

    def __exit__(self, *exc):
        import deepspeed.comm as dist
        for module, real in self._saved:
            module.all_to_all_single = real
        dist.reduce_scatter_fn = self._saved_rs
        return False


def same_bits(a, b) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    import torch
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8),
                       b.detach().cpu().contiguous().view(torch.uint8))


# Allocations that write nothing: not counted as work (ATen op names, any overload).
_ALLOCATIONS = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided")


def _tensor_bytes(values) -> int:
    """Bytes of the distinct tensors among `values` (a tensor written in place counts once)."""
    import torch
    seen, total = set(), 0
    for value in values:
        if isinstance(value, (list, tuple)):
            stack = list(value)
        else:
            stack = [value]
        for item in stack:
            if isinstance(item, torch.Tensor):
                key = (item.data_ptr(), item.dtype, tuple(item.shape), tuple(item.stride()))
                if key not in seen:
                    seen.add(key)
                    total += item.numel() * item.element_size()
    return total


class WorkCounter:
    """Counts the work of a piece of code as a GPU would launch it: dispatched ATen ops (views and
    allocations that write nothing excluded, collectives excluded: CollectiveCounter counts those),
    quantizer kernel calls (through `counting_quantizer`), and the bytes of the distinct tensors each
    op or kernel reads or writes. Use as a context manager."""

    def __init__(self):
        self.ops, self.kernel_calls, self.bytes = 0, 0, 0
        self.op_names = {}  # name -> (calls, bytes)
        self._inside_kernel = False  # a quantizer computed in PyTorch: its ops are the kernel's

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        counter = self

        class Mode(TorchDispatchMode):

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                name = func.name()
                if (counter._inside_kernel or func.is_view or func.namespace == "c10d"
                        or func.overloadpacket.__name__ in _ALLOCATIONS):
                    return out
                counter.ops += 1
                touched = _tensor_bytes(list(args) + list(kwargs.values()) + [out])
                counter.bytes += touched
                calls, total = counter.op_names.get(name, (0, 0))
                counter.op_names[name] = (calls + 1, total + touched)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False

    def counting_quantizer(self, quantizer):
        """`quantizer` with its kernel calls counted by this counter."""
        counter = self

        class Counted:

            def __getattr__(self, name):
                value = getattr(quantizer, name)
                if name not in ("swizzle_quant", "quantized_reduction", "dequantize", "dequantize_fp32"):
                    return value

                def call(*args):
                    counter._inside_kernel = True
                    try:
                        out = value(*args)
                    finally:
                        counter._inside_kernel = False
                    counter.kernel_calls += 1
                    touched = _tensor_bytes(list(args) + [out])
                    counter.bytes += touched
                    calls, total = counter.op_names.get(name, (0, 0))
                    counter.op_names[name] = (calls + 1, total + touched)
                    return out

                return call

        return Counted()

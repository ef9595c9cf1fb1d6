# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Host time per call of the Triton quantizer op after a variant's first call: the CPU time of
everything the op does in Python (its refusals, output allocation, variant lookup) with Triton's
launch itself left out (the kernels run in Triton's interpreter here, which no GPU pays). Each
file given is a copy of deepspeed_qgz/triton_quantizer.py, timed in turns in one process, so two
versions compare on the same machine at the same moment:

    TRITON_INTERPRET=1 python benchmarks/triton_host_time.py \\
        <(git show 2ad792c:deepspeed_qgz/triton_quantizer.py) deepspeed_qgz/triton_quantizer.py

With --gather-world N, also what the first call of each signature adds in a gloo world of N processes
on this machine: the gathering of every rank's verdict (deepspeed_qgz.triton_quantizer._failures).
"""

import argparse
import importlib.machinery
import importlib.util
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def load(path, index):
    loader = importlib.machinery.SourceFileLoader(f"triton_quantizer_{index}", path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def calls(op):
    """The series' calls at 3 x 2, groups of 4104 values (one a rank), and qwZ's quantize."""
    x = (torch.randn(6 * 4104, generator=torch.Generator().manual_seed(0)) * 3).half()
    codes, scales = op.swizzle_quant(x, 6, 4, op.Symmetric, 1, 3, 2)
    return {
        "swizzle_quant": lambda: op.swizzle_quant(x, 6, 4, op.Symmetric, 1, 3, 2),
        "quantized_reduction": lambda: op.quantized_reduction(codes, scales, 6, 3, 4, op.Symmetric, 2),
        "dequantize": lambda: op.dequantize(codes, scales, 6, 4, op.Symmetric),
        "quantize": lambda: op.quantize(x.view(6, 4104), 6, 8, op.Symmetric),
    }


def gather_seconds(rank, world, port, repeats, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    from deepspeed_qgz import triton_quantizer
    taken = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        triton_quantizer._failures(None, gather=True)
        taken.append(time.perf_counter() - start)
    results[rank] = statistics.median(taken)
    torch.distributed.destroy_process_group()


def gather_cost(world, repeats=50):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(gather_seconds, args=(world, port, repeats, results), nprocs=world)
    print(f"the gathering at a signature's first call, gloo world of {world}: median of {repeats}, slowest rank: "
          f"{max(results.values()) * 1e3:.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gather-world", type=int, nargs="*", default=[])
    args = parser.parse_args()
    ops = [load(path, index) for index, path in enumerate(args.files)]
    timed = [calls(op) for op in ops]
    for per_op in timed:
        for call in per_op.values():
            call()  # each variant's first call, checked against the reference, in the interpreter
    # from here on a launch does nothing: what remains is the op's own host time
    interpreted = type(ops[0]._quantize_kernel)
    interpreted.__getitem__ = lambda kernel, grid: lambda *args, **kwargs: None
    samples = [{name: [] for name in per_op} for per_op in timed]
    # the files take turns op by op; each round is this thread's CPU time, which the time other
    # processes hold the cores does not add to, and the fastest round counts
    for _ in range(args.rounds):
        for name in timed[0]:
            for per_op, sample in zip(timed, samples):
                call = per_op[name]
                start = time.thread_time()
                for _ in range(args.calls):
                    call()
                sample[name].append((time.thread_time() - start) / args.calls * 1e6)
    print(f"us of CPU per call, fastest and median of {args.rounds} rounds of {args.calls} calls; "
          f"torch {torch.__version__}")
    print("file".ljust(40) + "".join(name.rjust(21) for name in timed[0]))
    for path, sample in zip(args.files, samples):
        print(path[-40:].ljust(40) + "".join(f"{min(s):12.1f} ({statistics.median(s):5.1f})" for s in sample.values()))
    for world in args.gather_world:
        gather_cost(world)


if __name__ == "__main__":
    main()

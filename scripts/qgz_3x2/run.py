# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run the report's training on 3 nodes x 2 processes on this machine: three torchrun agents with
a c10d rendezvous on 127.0.0.1, LOCAL_SIZE=2 so DeepSpeed's CPU accelerator sees two devices per
node. With --compare, trains with qgZ on and then off in the same processes (the same seeds: each
training starts from the same weights and data, which the job checks), and prints the loss curves
side by side and the bytes the gradient reduce-scatter's collectives took, as DeepSpeed's comms
logger counts them. With --triton, a second job runs qgZ on with this package's Triton quantizer op
(DS_QGZ_QUANTIZER=triton, in Triton's interpreter on the CPU), and compares its losses and trained
weights with the CPU op's, bit for bit."""

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qgz_harness import Progress, log, run_torchrun_nodes  # noqa: E402

HERE = Path(__file__).resolve().parent
NODES, PROCS_PER_NODE = 3, 2
STEP_LINE = re.compile(r"^\[0\] STEP (\d+) ")
# qgZ's loss at each step and rank, relative to qgZ off's: int4 gradients move the loss a little.
LOSS_TOLERANCE = 0.02
# What a DeepSpeed release logs when its qgZ falls back to the reduce-scatter.
FALLBACK_WARNING = "falls back to reduce_scatter"


def within_tolerance(losses, reference):
    return all(
        abs(loss - ref) <= LOSS_TOLERANCE * abs(ref) for rank in reference
        for loss, ref in zip(losses[rank], reference[rank]))


def build_ops(deepspeed_ops=True):
    """JIT-build the ops the trainings load once, here, with a line each, before six ranks would
    wait on one build with nothing on screen but step 0 of the first progress bar."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed_qgz import cpu_quantizer
    ops = [(cpu_quantizer.builder(), "the CPU quantizer op (about 40 s the first time)")]
    if deepspeed_ops:
        ops += [(get_accelerator().create_op_builder("FusedAdamBuilder"),
                 "DeepSpeed's CPU Adam op (a few minutes the first time)"),
                (get_accelerator().create_op_builder("ShareMemCommBuilder"),
                 "DeepSpeed's shared-memory communication op (a minute or two the first time)")]
    for builder, what in ops:
        log(f"op build: {what}; cached after")
        start = time.perf_counter()
        builder.load(verbose=False)
        log(f"op build: done in {time.perf_counter() - start:.1f} s")


def run(configs, steps, labels=(), timeout=900, env=None, deepspeed_ops=True):
    """Trains with each of `configs` in turn in one job (train.py --then: the same processes, the same
    seeds). Returns one ({rank: [loss per step]}, rank 0's report (its gradient collectives' calls
    and bytes under "collectives", the trained weights under "weights")) per config, and the agents'
    combined output."""
    bars = [Progress(steps, label) for label in labels]
    current = [0, -1]  # the training rank 0 is in, and its last step

    def on_output(line):
        match = STEP_LINE.match(line)
        if bars and match:
            step = int(match.group(1))
            current[0] += step < current[1]  # step 0 again: the next training began
            current[1] = step
            bars[min(current[0], len(bars) - 1)].update(step + 1)

    with tempfile.TemporaryDirectory() as losses_dir:
        extra = []
        if not deepspeed_ops:
            extra = ["--no-shm-op"]
            written = []
            for config in configs:
                settings = json.loads(Path(config).read_text())
                settings["optimizer"]["params"]["torch_adam"] = True
                written.append(Path(losses_dir) / Path(config).name)
                written[-1].write_text(json.dumps(settings))
            configs = written
        then = [arg for config in configs[1:] for arg in ("--then", str(config))]
        output = run_torchrun_nodes([
            str(HERE / "train.py"), "--deepspeed_config",
            str(configs[0]), *then, "--steps",
            str(steps), "--loss-dir", losses_dir, *extra
        ],
                                    NODES,
                                    PROCS_PER_NODE,
                                    timeout=timeout,
                                    env=env,
                                    on_output=on_output)
        results, starts = [], None
        for index in range(len(configs)):
            files = Path(losses_dir, f"run{index}").glob("rank*.json")
            reports = {int(p.stem[4:]): json.loads(p.read_text()) for p in files}
            if sorted(reports) != list(range(NODES * PROCS_PER_NODE)):
                raise RuntimeError(f"training {index + 1}: ranks {sorted(reports)} reported, expected all "
                                   f"{NODES * PROCS_PER_NODE}:\n{output[-6000:]}")
            if starts is not None and starts != {rank: report["start"] for rank, report in reports.items()}:
                raise RuntimeError(f"training {index + 1} did not start from the first one's weights and data")
            starts = {rank: report["start"] for rank, report in reports.items()}
            results.append(({rank: reports[rank]["losses"] for rank in sorted(reports)}, reports[0]))
    return results, output


def mean_loss(losses, step):
    return sum(rank_losses[step] for rank_losses in losses.values()) / len(losses)


def relative_difference(weights, reference):
    diff = sum((a - b)**2 for name in reference for a, b in zip(weights[name], reference[name]))
    norm = sum(b**2 for name in reference for b in reference[name])
    return math.sqrt(diff / norm)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compare", action="store_true", help="also run with zero_quantized_gradients: false")
    parser.add_argument("--triton", action="store_true", help="also run qgZ on the Triton quantizer op")
    parser.add_argument("--no-deepspeed-ops",
                        action="store_true",
                        help="train with torch's Adam (torch_adam) and without DeepSpeed's shared-memory op "
                        "(its inference all-reduce's): neither is on qgZ's path, and each DeepSpeed release "
                        "builds both anew, minutes on a CPU (scripts/releases_check.sh)")
    args = parser.parse_args()
    deepspeed_ops = not args.no_deepspeed_ops

    build_ops(deepspeed_ops)
    jobs = 1 + args.triton
    configs = [HERE / "ds_config_qgz.json"] + ([HERE / "ds_config_exact.json"] if args.compare else [])
    then = ", then false in the same processes" if args.compare else ""
    log(f"job 1/{jobs}: zero_quantized_gradients true{then}, {NODES} torchrun agents x {PROCS_PER_NODE} processes")
    labels = ["qgZ on ", "qgZ off"][:len(configs)]
    results, output = run(configs, args.steps, labels, deepspeed_ops=deepspeed_ops)
    (qgz_losses, qgz), (exact_losses, exact) = results[0], results[1] if args.compare else (None, None)
    triton = None
    if args.triton:
        log(f"job {jobs}/{jobs}: zero_quantized_gradients true, the Triton quantizer op (DS_QGZ_QUANTIZER=triton) "
            f"in Triton's interpreter")
        [(triton_losses, triton)], _ = run([HERE / "ds_config_qgz.json"],
                                           args.steps, ["Triton "],
                                           env={
                                               "DS_QGZ_QUANTIZER": "triton",
                                               "TRITON_INTERPRET": "1"
                                           },
                                           deepspeed_ops=deepspeed_ops)
    print(f"{NODES} nodes x {PROCS_PER_NODE} processes, ZeRO-3, bf16, {args.steps} steps; loss per step, the mean "
          f"over the {len(qgz_losses)} ranks")
    print(f"{'step':>4}  {'qgZ on':>10}" + (f"  {'qgZ off':>10}  {'difference':>11}" if exact_losses else ""))
    for step in range(args.steps):
        loss = mean_loss(qgz_losses, step)
        line = f"{step:>4}  {loss:>10.6f}"
        if exact_losses:
            ref = mean_loss(exact_losses, step)
            line += f"  {ref:>10.6f}  {loss - ref:>+11.6f}"
        print(line)
    finite = all(math.isfinite(loss) for losses in qgz_losses.values() for loss in losses)
    print(f"all {len(qgz_losses)} ranks finite: {finite}")
    on = qgz["collectives"]
    all_to_all, fallback = on["all_to_all"], on["reduce_scatter"]["calls"]
    print(f"qgZ, rank 0: {all_to_all['calls']} all-to-alls of {all_to_all['bytes']} bytes in all, {fallback} "
          f"reduce-scatters (DeepSpeed's comms logger)")
    if exact:
        print(f"trained weights, qgZ on against off: relative difference "
              f"{relative_difference(qgz['weights'], exact['weights']):.2e}")
        off = exact["collectives"]["reduce_scatter"]["bytes"]
        ratio = f" ({all_to_all['bytes'] / off:.3f}x)" if off else ""
        print(f"bytes handed to the gradient collectives per step, rank 0: qgZ on "
              f"{all_to_all['bytes'] / args.steps:.0f} (all-to-all), off {off / args.steps:.0f} (reduce-scatter)" +
              ratio)
    close = True
    if exact:
        close = within_tolerance(qgz_losses, exact_losses)
        print(f"every rank's loss at every step within {LOSS_TOLERANCE:.0%} of qgZ off's: {close}")
    warned = FALLBACK_WARNING in output
    print(f"fallback warning ('{FALLBACK_WARNING}') in qgZ on's output: {warned}")
    same = True
    if triton:
        same = (triton["quantizer"] == "deepspeed_qgz.triton_quantizer" and triton_losses == qgz_losses
                and triton["weights"] == qgz["weights"])
        print(f"qgZ on the quantizer op of {triton['quantizer']} against {qgz['quantizer']}: losses and trained "
              f"weights {'the same, bit for bit' if same else 'DIFFER'}")
    return 0 if finite and all_to_all["calls"] > 0 and fallback == 0 and close and not warned and same else 1


if __name__ == "__main__":
    sys.exit(main())

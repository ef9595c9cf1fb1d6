# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Does qgZ train as well as the unquantized reduce-scatter, and with which of its options?

A byte-level GPT (plain PyTorch, 4 layers, width 256, context 64) is trained from scratch with
DeepSpeed ZeRO-3 in bf16 on 3 nodes x 2 processes (three torchrun agents on one machine), on real
text available offline: the Python standard library's own source, with every tenth file held out
for validation. Every run uses the same seeds, initial weights and batches, so qgZ-off and qgZ-on
runs pair step by step. Runs (one torchrun job runs them one after the other):

  off              zero_quantized_gradients false (the bf16 reduce-scatter)
  qgz-4/4          qgZ with its defaults: int4 inside and across nodes, each gradient's groups by
                   the shape rule (zero_quantized_gradients_max_group_size 40960)
  qgz-8/4          int8 inside the node (zero_quantized_gradients_intra_node_bits 8)
  qgz-4/4-136      groups of at most 136 values (zero_quantized_gradients_max_group_size 136)
  qgz-8/4-136      both
  zero++           ZeRO++'s whole recipe: quantized weights (qwZ) gathered for every layer, hpZ
                   inside the node, qgZ 8/4 (the other runs keep the weights gathered, which is
                   exact, so they pair with it as they are)
  0.19.8           DeepSpeed 0.19.8's all_to_all_quant_reduce as users get it (its fallbacks and
                   its average over nodes only), with the CPU op reading the bf16 gradients' bits
                   as fp16, as the CUDA kernels do

Then, in the same world, on the trained qgZ-off model's real gradients (one micro-batch per rank),
the relative RMS error of each setting's averaged gradient against the exact average, per layer
class, and its shrinkage along the exact average.

Bytes are counted at the collectives (qgz_harness.CollectiveCounter): what each rank sends to the
other ranks of its node and to other nodes.

Writes convergence.json, convergence.md and convergence.png to --out.

    python benchmarks/convergence.py [--steps 300] [--out DIR] [--runs a,b] [--seeds N] [--smoke]
"""

import argparse
import json
import math
import re
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1] / "scripts"))  # qgz_harness
NODES, PROCS_PER_NODE = 3, 2
VOCAB, WIDTH, LAYERS, HEADS, CONTEXT = 256, 256, 4, 4, 64
MICRO_BATCH = 2
LR, WARMUP = 1e-3, 30
EVAL_EVERY, EVAL_BATCHES = 25, 2
LAYER_CLASSES = ("embeddings", "attention", "MLP", "output head")

# name -> (zero_quantized_gradients, the qgZ keys, variant, seeds)
RUNS = {
    "off": (False, {}, None, (0, 1)),
    "0.19.8": (True, {}, "upstream", (0, )),
    "zero++": (True, {
        "zero_quantized_gradients_intra_node_bits": 8
    }, "zero++", (0, )),
    "qgz-4/4": (True, {}, None, (0, 1)),
    "qgz-8/4": (True, {
        "zero_quantized_gradients_intra_node_bits": 8
    }, None, (0, 1)),
    "qgz-4/4-136": (True, {
        "zero_quantized_gradients_max_group_size": 136
    }, None, (0, )),
    "qgz-8/4-136": (True, {
        "zero_quantized_gradients_intra_node_bits": 8,
        "zero_quantized_gradients_max_group_size": 136
    }, None, (0, )),
}
# the trained qgZ-off model (seed 0) the fidelity study takes its gradients from
MODEL = "model_off_seed0.pt"
FIDELITY_FILE = "fidelity.json"
SMOKE_RUNS = {"off": RUNS["off"][:3] + ((0, ), ), "qgz-8/4": RUNS["qgz-8/4"][:3] + ((0, ), )}
# fidelity: name -> all_to_all_quant_reduce's keyword arguments
FIDELITY = {
    "qgz-4/4": {},
    "qgz-8/4": {
        "intra_node_bits": 8
    },
    "qgz-4/4-136": {
        "max_group_size": 136
    },
    "qgz-8/4-136": {
        "intra_node_bits": 8,
        "max_group_size": 136
    },
}

# ----------------------------------------------------------------------------------------------
# data and model
# ----------------------------------------------------------------------------------------------


def stdlib_corpus():
    """(train bytes, validation bytes) of the standard library's .py files, every tenth file (in
    sorted order) held out for validation."""
    import torch
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, val = bytearray(), bytearray()
    for i, path in enumerate(files):
        (val if i % 10 == 0 else train).extend(path.read_bytes())
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


def batch(data, seed, step, rank, size=MICRO_BATCH):
    """The same (inputs, targets) for a (seed, step, rank) in every run."""
    import torch
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - CONTEXT - 1, (size, ), generator=gen)
    rows = torch.stack([data[s:s + CONTEXT + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def make_model():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):

        def __init__(self):
            super().__init__()
            # no biases: fewer tensors for ZeRO-3 to walk each step (the norms' weights stay 1-D)
            self.ln1, self.ln2 = nn.LayerNorm(WIDTH, bias=False), nn.LayerNorm(WIDTH, bias=False)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
            self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = (y.view(b, t, HEADS, c // HEADS).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(c, 2))
            x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):

        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
            self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
            self.ln_f, self.head = nn.LayerNorm(WIDTH, bias=False), nn.Linear(WIDTH, VOCAB, bias=False)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))

    return GPT()


def layer_class(name):
    """The layer class of a parameter, or None for 1-D tensors (norms, biases: reduced exactly)."""
    if name.endswith("bias") or ".ln" in name or name.startswith("ln_"):
        return None
    if name.startswith(("tok.", "pos.")):
        return "embeddings"
    if ".qkv." in name or ".proj." in name:
        return "attention"
    if ".fc." in name or ".out." in name:
        return "MLP"
    return "output head"


def upstream_as_users_get_it():
    """DeepSpeed 0.19.8's all_to_all_quant_reduce with the CPU op reading every input's bits as fp16,
    as the CUDA kernels do ((__half*)data_ptr()): bf16 gradients are quantized as garbage."""
    import torch
    from deepspeed_qgz import cpu_quantizer
    from qgz_harness import BeyondContract, load_upstream_module
    upstream = load_upstream_module("runtime/comm/coalesced_collectives.py", "upstream_coalesced_collectives")
    upstream.logger.setLevel("ERROR")  # a fallback warning per tensor per step otherwise
    ops = BeyondContract(cpu_quantizer.load())

    class ReadsFp16Bits:
        Symmetric = ops.Symmetric

        def swizzle_quant(self, x, *args):
            return ops.swizzle_quant(x.view(torch.float16) if x.element_size() == 2 else x, *args)

        def __getattr__(self, name):
            return getattr(ops, name)

    upstream.quantizer_module = ReadsFp16Bits()
    return upstream


# ----------------------------------------------------------------------------------------------
# training (one rank of the torchrun job)
# ----------------------------------------------------------------------------------------------


def run_plan(args):
    """(the runs' settings, [(run name, seed)] in the order they run)."""
    runs = SMOKE_RUNS if args.smoke else RUNS
    if args.runs:
        runs = {name: RUNS[name] for name in args.runs.split(",")}
    plan = [(name, seed) for name, (_, _, _, seeds) in runs.items()
            for seed in (range(args.seeds) if args.seeds else seeds)]
    return runs, plan


def run_file(name, seed):
    return f"run_{name.replace('/', '-')}_seed{seed}.json"


def ds_config(quantized, keys=None, variant=None):
    zero = {
        "stage": 3,
        "zero_quantized_gradients": quantized,
        # every parameter of this small model stays gathered (no all-gather per layer and step: on
        # 2 cores that overhead would dominate); gradients are still reduce-scattered and the
        # optimizer state still partitioned, which is what qgZ changes
        "stage3_param_persistence_threshold": 10**7,
    }
    if quantized and variant != "upstream":
        zero.update(keys or {})
    if variant == "zero++":
        # ZeRO++ as its tutorial configures it: weights gathered (quantized) for every layer, hpZ's
        # secondary partitions inside the node
        zero.update(zero_quantized_weights=True,
                    zero_hpz_partition_size=PROCS_PER_NODE,
                    stage3_param_persistence_threshold=0)
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "betas": [0.9, 0.95],
                "weight_decay": 0.0
            }
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": LR,
                "warmup_num_steps": WARMUP,
                "warmup_type": "linear"
            }
        },
        "gradient_clipping": 1.0,
        "bf16": {
            "enabled": True
        },
        "zero_optimization": zero,
    }


def worker(args):
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.runtime.zero import stage3
    from qgz_harness import CollectiveCounter, release_deepspeed_shm

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    release_deepspeed_shm()
    rank, world = dist.get_rank(), dist.get_world_size()
    train, val = stdlib_corpus()
    ours_reduce = stage3.all_to_all_quant_reduce
    upstream = upstream_as_users_get_it()
    out = Path(args.out)
    runs, plan = run_plan(args)
    for index, (name, seed) in enumerate(plan):
        quantized, keys, variant, _ = runs[name]
        # stage 3 passes the config keys, which 0.19.8's function does not take
        stage3.all_to_all_quant_reduce = ((
            lambda tensors, groups, *_, **__: upstream.all_to_all_quant_reduce(tensors, groups))
                                          if variant == "upstream" else ours_reduce)
        torch.manual_seed(seed)
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=ds_config(quantized, keys, variant))
        losses, evals = [], []
        started = time.perf_counter()

        def evaluate(engine, step):
            engine.eval()
            with torch.no_grad():
                total = torch.zeros(1)
                for b in range(EVAL_BATCHES):
                    x, y = batch(val, 10**6 + b, 0, rank)
                    total += engine(x, y).float()
            dist.all_reduce(total)
            evals.append((step, float(total) / (EVAL_BATCHES * world)))
            engine.train()

        with CollectiveCounter([cc, upstream], world, PROCS_PER_NODE) as traffic:
            for step in range(args.steps):
                if step % EVAL_EVERY == 0:
                    evaluate(engine, step)
                x, y = batch(train, seed, step, rank)
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                mean = loss.detach().float().clone()
                dist.all_reduce(mean)
                losses.append(float(mean) / world)
                if rank == 0:
                    print(f"RUN {index + 1}/{len(plan)} {name} seed {seed} STEP {step + 1} LOSS {losses[-1]:.4f}",
                          flush=True)
            evaluate(engine, args.steps)
        result = {
            "name": name,
            "seed": seed,
            "losses": losses,
            "evals": evals,
            "seconds": time.perf_counter() - started,
            "inter_bytes_per_step": traffic.inter_bytes / args.steps,
            "intra_bytes_per_step": traffic.intra_bytes / args.steps,
            "all_to_all_calls": traffic.all_to_all_calls,
        }
        if name == "off" and seed == 0:
            state = engine._zero3_consolidated_16bit_state_dict()
            if rank == 0:
                torch.save({k: v.float() for k, v in state.items()}, out / MODEL)
        if rank == 0:
            (out / run_file(name, seed)).write_text(json.dumps(result))
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, model
    # every rank decides from the plan, not from the file rank 0 writes (a rank that looked before
    # the file landed would skip the fidelity's collectives and leave the others waiting)
    if ("off", 0) in plan and not args.smoke:
        dist.barrier()  # rank 0 saved it
        if rank == 0:
            print("PHASE fidelity: every setting on the trained qgZ-off model's gradients", flush=True)
        fid = fidelity(out / MODEL, rank, world)
        if rank == 0:
            (out / FIDELITY_FILE).write_text(json.dumps(fid))
    dist.barrier()
    dist.destroy_process_group()  # a clean shutdown (see scripts/qgz_3x2/train.py)


# ----------------------------------------------------------------------------------------------
# gradient fidelity (in the same world, after the runs)
# ----------------------------------------------------------------------------------------------


def fidelity(model_path, rank, world):
    """{setting: {layer class: relative RMS error, "shrinkage": ...}} of all_to_all_quant_reduce on
    the trained model's real gradients (one micro-batch per rank) against the exact average
    (reduce_scatter_coalesced in fp64), the same partitions on every rank; every rank takes part."""
    import torch
    import deepspeed.comm as dist
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.utils import groups
    train, _ = stdlib_corpus()
    model = make_model()
    model.load_state_dict(torch.load(model_path))
    model = model.to(torch.bfloat16)
    x, y = batch(train, 7, 0, rank)
    model(x, y).backward()
    named = [(layer_class(n), p.grad.detach().clone()) for n, p in model.named_parameters() if layer_class(n)]
    classes, grads = [c for c, _ in named], [g for _, g in named]
    exact = cc.reduce_scatter_coalesced([g.double() for g in grads])
    all_to_all_groups = groups._get_local_all_to_all_group()
    results = {}
    for setting, kwargs in FIDELITY.items():
        outputs = cc.all_to_all_quant_reduce(grads, all_to_all_groups, **kwargs)
        # per layer class: squared error, squared norm; then the dot product and norm of all
        sums = torch.zeros(2 * len(LAYER_CLASSES) + 2, dtype=torch.float64)
        for cls, out, ref in zip(classes, outputs, exact):
            k = LAYER_CLASSES.index(cls)
            got = out.double()
            sums[2 * k] += (got - ref).pow(2).sum()
            sums[2 * k + 1] += ref.pow(2).sum()
            sums[-2] += (got * ref).sum()
            sums[-1] += ref.pow(2).sum()
        dist.all_reduce(sums)
        row = {cls: math.sqrt(sums[2 * k] / sums[2 * k + 1]) for k, cls in enumerate(LAYER_CLASSES)}
        row["shrinkage"] = float(sums[-2] / sums[-1]) - 1  # of the average along the exact average
        results[setting] = row
    return {f"{NODES}x{PROCS_PER_NODE}": results}


# ----------------------------------------------------------------------------------------------
# launcher and report
# ----------------------------------------------------------------------------------------------


def quantized_share(upstream):
    """Share of this model's gradient elements qgZ quantizes: those of its tensors of two or more
    dimensions; 0.19.8 (`upstream`) only those whose size is a multiple of 2 x world as well."""
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    world = NODES * PROCS_PER_NODE
    quantized = sum(p.numel() for p in model.parameters()
                    if p.dim() > 1 and not (upstream and p.numel() % (2 * world)))
    return quantized / total


def paired_gap(run, off):
    """Mean over steps of (loss - qgZ-off loss) / qgZ-off loss, same seed."""
    return sum((a - b) / b for a, b in zip(run["losses"], off["losses"])) / len(off["losses"])


def summarize(results, steps):
    import statistics
    offs = {r["seed"]: r for r in results if r["name"] == "off"}
    names = list(dict.fromkeys(r["name"] for r in results))
    rows = []
    for name in names:
        runs = [r for r in results if r["name"] == name]
        gaps = [paired_gap(r, offs[r["seed"]]) for r in runs if name != "off" and r["seed"] in offs]
        finals = [r["evals"][-1][1] for r in runs]
        rows.append({
            "name": name,
            "seeds": [r["seed"] for r in runs],
            "final_val": statistics.mean(finals),
            "final_val_each": finals,
            "gap": statistics.mean(gaps) if gaps else 0.0,
            "gap_each": gaps,
            "inter_bytes_per_step": runs[0]["inter_bytes_per_step"],
            "intra_bytes_per_step": runs[0]["intra_bytes_per_step"],
            "quantized_share": quantized_share(name == "0.19.8") if runs[0]["all_to_all_calls"] else 0.0,
            "seconds": statistics.mean(r["seconds"] for r in runs),
        })
    return rows


def ratio(row, off, key):
    return f"{row[key] / off[key]:.3f}x" if off else ""


def report(rows, fid, steps):
    off = next((r for r in rows if r["name"] == "off"), None)
    lines = [
        f"{NODES} nodes x {PROCS_PER_NODE} processes, ZeRO-3, bf16, {LAYERS} layers x {WIDTH}, context {CONTEXT}, "
        f"batch {MICRO_BATCH} x {CONTEXT} per rank, {steps} steps, Adam {LR} (warm-up {WARMUP}), Python "
        f"{sys.version.split()[0]} standard library source (every tenth file held out). Gap: mean over steps of "
        "the relative difference of the training loss (mean over ranks) to the qgZ-off run with the same seed; "
        "bytes: the gradient reduce-scatter's, per step, as each rank sends them to the other ranks of its node "
        "(intra) and to other nodes (inter).", "",
        "| run | seeds | final validation loss | training-loss gap vs off | inter-node KB / step | vs off | "
        "intra-node KB / step | vs off | gradient elements quantized | s / run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    ]
    for r in rows:
        each = ", ".join(f"{g:+.2%}" for g in r["gap_each"])
        gap = "" if r["name"] == "off" else f"{r['gap']:+.3%}" + (f" ({each})" if len(r["gap_each"]) > 1 else "")
        finals = ", ".join(f"{v:.4f}" for v in r["final_val_each"])
        lines.append(f"| {r['name']} | {', '.join(map(str, r['seeds']))} | {finals} | {gap} | "
                     f"{r['inter_bytes_per_step'] / 1e3:.1f} | {ratio(r, off, 'inter_bytes_per_step')} | "
                     f"{r['intra_bytes_per_step'] / 1e3:.1f} | {ratio(r, off, 'intra_bytes_per_step')} | "
                     f"{r['quantized_share']:.1%} | {r['seconds']:.0f} |")
    if fid:
        lines += [
            "", "Relative RMS error of the averaged gradient against the exact average, per layer class, on the "
            "trained qgZ-off model's real gradients (one micro-batch per rank), and the average's shrinkage "
            "along the exact average (the clamp's bias):", ""
        ]
        for topology, methods in fid.items():
            lines += [
                f"| {topology} | " + " | ".join(LAYER_CLASSES) + " | shrinkage |",
                "|---|" + "---:|" * (len(LAYER_CLASSES) + 1)
            ]
            for method, row in methods.items():
                lines.append(f"| {method} | " + " | ".join(f"{row[c]:.3f}"
                                                           for c in LAYER_CLASSES) + f" | {row['shrinkage']:+.2%} |")
            lines.append("")
    return "\n".join(lines)


def _moving_average(values, window):
    return [
        sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
        for i in range(len(values))
    ]


def chart(results, path):
    """One line per run: seed 0's training loss, the validation loss and the paired gap averaged over
    the run's seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    offs = {r["seed"]: r for r in results if r["name"] == "off"}
    names = list(dict.fromkeys(r["name"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.4))
    for i, name in enumerate(names):
        runs = [r for r in results if r["name"] == name]
        style = {"color": f"C{i}", "linewidth": 1, "label": f"{name} ({len(runs)} seeds)"}
        axes[0].plot(_moving_average(runs[0]["losses"], 10), **style)
        steps = [s for s, _ in runs[0]["evals"]]
        axes[1].plot(steps, [sum(r["evals"][k][1] for r in runs) / len(runs) for k in range(len(steps))],
                     marker="o",
                     markersize=3,
                     **style)
        gaps = [[100 * (a - b) / b for a, b in zip(r["losses"], offs[r["seed"]]["losses"])] for r in runs
                if name != "off" and r["seed"] in offs]
        if gaps:
            axes[2].plot(_moving_average([sum(g) / len(g) for g in zip(*gaps)], 50), **style)
    axes[0].set_title(f"training loss, seed {results[0]['seed']} (mean over ranks, 10-step moving average)",
                      fontsize=10)
    axes[1].set_title("validation loss (mean over seeds)", fontsize=10)
    axes[2].set_title("gap to qgZ off, same seed, % (mean over seeds, 50-step moving average)", fontsize=10)
    axes[2].axhline(0.05, color="grey", linewidth=0.8, linestyle=":")
    axes[2].axhline(0.0, color="black", linewidth=0.8)
    for ax in axes[:2]:
        ax.set_xlim(left=25)
        ax.set_ylim(1.9, 3.2)
    for ax in axes:
        ax.set_xlabel("step")
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
    fig.suptitle("byte-level GPT on the Python standard library, ZeRO-3 bf16, 3 nodes x 2: qgZ settings vs "
                 "the unquantized reduce-scatter vs DeepSpeed 0.19.8")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=".")
    parser.add_argument("--smoke", action="store_true", help="qgZ off and 8/4 only, one seed (for the suite)")
    parser.add_argument("--runs", help="comma-separated run names (default: all of RUNS)")
    parser.add_argument("--seeds", type=int, help="seeds for each chosen run (default: as RUNS says)")
    parser.add_argument("--report-only",
                        action="store_true",
                        help="rebuild the tables and the chart from OUT/convergence.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.report_only:
        saved = json.loads((Path(args.out) / "convergence.json").read_text())
        return write_outputs(Path(args.out), saved["runs"], saved["fidelity"], args.steps)

    from qgz_harness import Progress, log, run_torchrun_nodes
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import deepspeed
    log(f"environment: torch {torch.__version__}, deepspeed {deepspeed.__version__}, Python {sys.version.split()[0]}")
    train, val = stdlib_corpus()
    log(f"data: {train.numel() / 1e6:.1f} MB of training text, {val.numel() / 1e6:.1f} MB held out")
    log("op build: the CPU quantizer op (about 40 s the first time)")
    from deepspeed_qgz import cpu_quantizer
    cpu_quantizer.builder().load(verbose=False)
    runs, plan = run_plan(args)
    work = Path(tempfile.mkdtemp(prefix="qgz-convergence-"))  # the runs' own files and the trained model
    log(f"training: {len(plan)} runs of {args.steps} steps in one job of {NODES} torchrun agents x {PROCS_PER_NODE}")
    bars = {}
    line_re = re.compile(r"^RUN (\d+)/(\d+) (\S+) seed (\d+) STEP (\d+) LOSS (\S+)")

    def on_output(line):
        if line.startswith("PHASE "):
            log(line[len("PHASE "):])
        match = line_re.match(line)
        if match:
            index = int(match.group(1))
            if index not in bars:
                bars[index] = Progress(args.steps,
                                       f"run {index}/{match.group(2)} {match.group(3):<16} seed {match.group(4)}")
            bars[index].update(int(match.group(5)), f"loss {float(match.group(6)):.3f}")

    command = [str(HERE), "--worker"] + sys.argv[1:] + ["--out", str(work)]
    # the runs' results stay in `work` if the job fails, for a look at what did run
    log(f"training: each run's results in {work} until the job ends")
    output = run_torchrun_nodes(command, NODES, PROCS_PER_NODE, timeout=3600, on_output=on_output)
    missing = [f"{name} seed {seed}" for name, seed in plan if not (work / run_file(name, seed)).exists()]
    if missing:
        raise RuntimeError(f"runs without results: {missing}:\n{output[-6000:]}")
    results = [json.loads((work / run_file(name, seed)).read_text()) for name, seed in plan]
    fid = json.loads((work / FIDELITY_FILE).read_text()) if (work / FIDELITY_FILE).exists() else None
    shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, results, fid, args.steps)


def write_outputs(out, results, fid, steps):
    from qgz_harness import log
    rows = summarize(results, steps)
    table = report(rows, fid, steps)
    print(table)
    (out / "convergence.json").write_text(json.dumps({"runs": results, "summary": rows, "fidelity": fid}, indent=1))
    (out / "convergence.md").write_text(table + "\n")
    chart(results, out / "convergence.png")
    log(f"wrote {out}/convergence.json, .md, .png")


if __name__ == "__main__":
    sys.exit(main())

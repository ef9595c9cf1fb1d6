# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Does qgZ train as well as the unquantized reduce-scatter, and with which intra-node precision
and quantization group size?

A byte-level GPT (plain PyTorch, 4 layers, width 256, context 64) is trained from scratch with
DeepSpeed ZeRO-3 in bf16 on 3 nodes x 2 processes (three torchrun agents on one machine), on real
text available offline: the Python standard library's own source, with every tenth file held out
for validation. Every run uses the same seeds, initial weights and batches, so qgZ-off and qgZ-on
runs pair step by step. Runs (one torchrun job runs them one after the other):

  off              zero_quantized_gradients false (the bf16 reduce-scatter)
  qgz-4/4          qgZ, int4 inside and across nodes, groups of at most 136 values (the config keys
                   zero_quantized_gradients_intra_node_bits 4, _group_size 136)
  qgz-8/4          qgZ, int8 inside the node, int4 across, groups of at most 136 values (the default
                   group size; zero_quantized_gradients_intra_node_bits 8)
  ... first quantization clamped   study variants: the first quantization (inside the node) with
                   the kernels' formula, a group's positive absmax clamped from the largest code
                   plus one, instead of clamp-free
  qgz-8/4-256      qgZ 8/4 with groups of at most 256 values
  zero++           ZeRO++'s whole recipe: quantized weights (qwZ) gathered for every layer, hpZ
                   inside the node, qgZ 8/4 (the other runs keep the weights gathered, which is
                   exact, so they pair with it as they are)
  0.19.8           DeepSpeed 0.19.8's all_to_all_quant_reduce as users get it (its fallbacks and
                   its average over nodes only), with the CPU op reading the bf16 gradients' bits
                   as fp16, as the CUDA kernels do

Then, in one process on the trained qgZ-off model's real gradients (one micro-batch per rank), the
relative RMS error of the averaged gradient per layer class at 3x2 and 4x8 for each setting, the
study variants (also 8/4 with both quantizations clamped), and 0.19.8's grouping rule (with a correct fp16 conversion and average, so the grouping alone is
compared).

Writes convergence.json, convergence.md and convergence.png to --out.

    python benchmarks/convergence.py [--steps 300] [--out DIR] [--runs a,b] [--seeds N] [--smoke]
"""

import argparse
import contextlib
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

# name -> (zero_quantized_gradients, group size, intra-node bits, variant, seeds)
RUNS = {
    "off": (False, None, None, None, (0, 1, 2, 3)),
    "qgz-4/4": (True, 136, 4, None, (0, 1, 2, 3)),
    "qgz-4/4 first quantization clamped": (True, 136, 4, "first-clamped", (0, 1, 2, 3)),
    "qgz-8/4": (True, 136, 8, None, (0, 1, 2, 3)),
    "qgz-8/4 first quantization clamped": (True, 136, 8, "first-clamped", (0, 1, 2, 3)),
    "qgz-8/4-256": (True, 256, 8, None, (0, )),
    "zero++": (True, 136, 8, "zero++", (0, 1)),
    "0.19.8": (True, None, None, "upstream", (0, )),
}
# the trained qgZ-off model (seed 0) the fidelity study takes its gradients from
MODEL = "model_off_seed0.pt"
FIDELITY_TOPOLOGIES = [(3, 2), (4, 8)]
SMOKE_RUNS = {"off": (False, None, None, None, (0, )), "qgz-8/4": (True, 136, 8, None, (0, ))}
# fidelity: name -> (group size, intra-node bits, variant)
FIDELITY = {
    "qgz-4/4": (136, 4, None),
    "qgz-4/4 first quantization clamped": (136, 4, "first-clamped"),
    "qgz-4/4-256": (256, 4, None),
    "qgz-4/4-1024": (1024, 4, None),
    "qgz-8/4": (136, 8, None),
    "qgz-8/4 first quantization clamped": (136, 8, "first-clamped"),
    "qgz-8/4 both quantizations clamped": (136, 8, "clamped"),
    "qgz-8/4-256": (256, 8, None),
    "0.19.8 rule": (None, None, "upstream"),
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


# ----------------------------------------------------------------------------------------------
# study variants
# ----------------------------------------------------------------------------------------------


def study_variant(variant):
    """A context for a study variant of the pipeline's quantizations (the kernels' clamp instead of
    clamp-free): "first-clamped" for the first one (inside the node), "clamped" for every one the
    glue makes; anything else changes nothing."""
    import torch
    from deepspeed.runtime.comm import quantized_pipeline
    if variant not in ("first-clamped", "clamped"):
        return contextlib.nullcontext()
    real = quantized_pipeline._prepare_groups

    def clamped(groups, out, clamp_free=False):
        first = groups.dtype != torch.float64  # the node sums' requantization reads their fp64 sums
        return real(groups, out, clamp_free=clamp_free and variant == "first-clamped" and not first)

    @contextlib.contextmanager
    def patched():
        quantized_pipeline._prepare_groups = clamped
        try:
            yield
        finally:
            quantized_pipeline._prepare_groups = real

    return patched()


def upstream_as_users_get_it():
    """DeepSpeed 0.19.8's all_to_all_quant_reduce with the CPU op reading every input's bits as fp16,
    as the CUDA kernels do ((__half*)data_ptr()): bf16 gradients are quantized as garbage."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from qgz_harness import BeyondContract, load_upstream_module
    upstream = load_upstream_module("runtime/comm/coalesced_collectives.py", "upstream_coalesced_collectives")
    upstream.logger.setLevel("ERROR")  # a fallback warning per tensor per step otherwise
    ops = BeyondContract(get_accelerator().create_op_builder("QuantizerBuilder").load())

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
    plan = [(name, seed) for name, (_, _, _, _, seeds) in runs.items()
            for seed in (range(args.seeds) if args.seeds else seeds)]
    return runs, plan


def run_file(name, seed):
    return f"run_{name.replace('/', '-')}_seed{seed}.json"


def ds_config(quantized, group_size=None, bits=None, variant=None):
    zero = {
        "stage": 3,
        "zero_quantized_gradients": quantized,
        # every parameter of this small model stays gathered (no all-gather per layer and step: on
        # 2 cores that overhead would dominate); gradients are still reduce-scattered and the
        # optimizer state still partitioned, which is what qgZ changes
        "stage3_param_persistence_threshold": 10**7,
    }
    if quantized and variant != "upstream":
        zero.update(zero_quantized_gradients_group_size=group_size, zero_quantized_gradients_intra_node_bits=bits)
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
        quantized, group_size, bits, variant, _ = runs[name]
        # stage 3 passes the config keys, which 0.19.8's function does not take
        stage3.all_to_all_quant_reduce = ((
            lambda tensors, groups, **_: upstream.all_to_all_quant_reduce(tensors, groups))
                                          if variant == "upstream" else ours_reduce)
        study = study_variant(variant)
        study.__enter__()
        torch.manual_seed(seed)
        model = make_model()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=ds_config(quantized, group_size, bits, variant))
        cc.qgz_accounting.reset()
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
        totals = vars(cc.qgz_accounting.totals)
        result = {
            "name": name,
            "seed": seed,
            "losses": losses,
            "evals": evals,
            "seconds": time.perf_counter() - started,
            "inter_bytes_per_step": traffic.inter_bytes / args.steps,
            "intra_bytes_per_step": traffic.intra_bytes / args.steps,
            "qgz": totals,
        }
        if name == "off" and seed == 0:
            state = engine._zero3_consolidated_16bit_state_dict()
            if rank == 0:
                torch.save({k: v.float() for k, v in state.items()}, out / MODEL)
        if rank == 0:
            (out / run_file(name, seed)).write_text(json.dumps(result))
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, model
        study.__exit__(None, None, None)
    dist.barrier()
    dist.destroy_process_group()  # a clean shutdown (see scripts/qgz_3x2/train.py)


# ----------------------------------------------------------------------------------------------
# gradient fidelity (one process, simulated clusters)
# ----------------------------------------------------------------------------------------------


def upstream_rule_simulation(inputs, num_nodes, local_world_size, ops):
    """0.19.8's all_to_all_quant_reduce for every rank, in one process, with its grouping rule
    (max(shape[0], shape[1], world) groups per tensor) and its fallback (numel not a multiple of
    2 x world, and 1-D tensors, reduced exactly), but with the gradients converted to fp16 and the
    result divided by the world size: its grouping alone, not its dtype and averaging bugs."""
    import torch
    world = num_nodes * local_world_size
    outputs = [[] for _ in range(world)]
    for i, tensor in enumerate(inputs[0]):
        numel = tensor.numel()
        exact = torch.stack([inputs[r][i].reshape(-1).double() for r in range(world)]).mean(0)
        if tensor.dim() == 1 or numel % (2 * world):
            chunk = math.ceil(numel / world)
            for r in range(world):
                outputs[r].append(exact[r * chunk:(r + 1) * chunk].to(tensor.dtype))
            continue
        num_groups = max(tensor.shape[0], tensor.shape[1], world)
        sent = [
            ops.swizzle_quant(inputs[r][i].half().reshape(-1), num_groups, 4, ops.Symmetric, 1, num_nodes,
                              local_world_size) for r in range(world)
        ]
        slot_bytes, slot_groups = sent[0][0].numel() // world, num_groups // world
        node_sums = []
        for r in range(world):
            node, local_rank = divmod(r, local_world_size)
            peers = range(node * local_world_size, (node + 1) * local_world_size)
            data = torch.cat([sent[p][0].view(local_world_size, -1)[local_rank] for p in peers])
            scales = torch.cat([sent[p][1].view(local_world_size, -1)[local_rank] for p in peers])
            node_sums.append(
                ops.quantized_reduction(data, scales.view(-1, 1), num_groups, num_groups // local_world_size, 4,
                                        ops.Symmetric, local_world_size))
        for r in range(world):
            node, local_rank = divmod(r, local_world_size)
            sources = [node_sums[m * local_world_size + local_rank] for m in range(num_nodes)]
            data = torch.cat([s[0].view(num_nodes, slot_bytes)[node] for s in sources])
            scales = torch.cat([s[1].view(num_nodes, slot_groups)[node] for s in sources])
            values = ops.dequantize(data, scales.view(-1, 1), scales.numel(), 4, ops.Symmetric)
            outputs[r].append((values.float().view(num_nodes, -1).sum(0) / world).to(tensor.dtype))
    return outputs


def fidelity(model_path, topologies):
    """{topology: {setting: {layer class: relative RMS error, "shrinkage": ...}}} on real gradients."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.quantizer.qgz_contract import ContractCheckedQuantizer
    from deepspeed.runtime.comm.quantized_simulation import simulate_all_to_all_quant_reduce
    from qgz_harness import BeyondContract
    ops = get_accelerator().create_op_builder("QuantizerBuilder").load()
    quantizer = ContractCheckedQuantizer(ops)
    ops = BeyondContract(ops)  # for 0.19.8's rule
    train, _ = stdlib_corpus()
    model = make_model()
    model.load_state_dict(torch.load(model_path))
    model = model.to(torch.bfloat16)
    names = [n for n, _ in model.named_parameters()]
    results = {}
    for num_nodes, local_world_size in topologies:
        world = num_nodes * local_world_size
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = batch(train, 7, 0, rank)
            model(x, y).backward()
            grads.append([p.grad.detach().clone() for p in model.parameters()])
        exact = [torch.stack([g[i].double() for g in grads]).mean(0).reshape(-1) for i in range(len(names))]
        topology = f"{num_nodes}x{local_world_size}"
        results[topology] = {}
        for method, (group_size, bits, variant) in FIDELITY.items():
            if variant == "upstream":
                outputs = upstream_rule_simulation(grads, num_nodes, local_world_size, ops)
                full = [torch.cat([outputs[r][i].double() for r in range(world)]) for i in range(len(names))]
            else:
                quantized = [i for i, n in enumerate(names) if layer_class(n)]
                with study_variant(variant):
                    outputs, _ = simulate_all_to_all_quant_reduce([[g[i] for i in quantized] for g in grads],
                                                                  num_nodes, local_world_size, quantizer, group_size,
                                                                  bits)
                full = list(exact)
                for j, i in enumerate(quantized):
                    full[i] = torch.cat([outputs[r][j].double() for r in range(world)])
            row, dot, norm = {}, 0.0, 0.0
            for cls in LAYER_CLASSES:
                members = [i for i, n in enumerate(names) if layer_class(n) == cls]
                err = sum(float((full[i] - exact[i]).pow(2).sum()) for i in members)
                ref = sum(float(exact[i].pow(2).sum()) for i in members)
                row[cls] = math.sqrt(err / ref)
            for i, n in enumerate(names):
                if layer_class(n):
                    dot += float((full[i] * exact[i]).sum())
                    norm += float(exact[i].pow(2).sum())
            row["shrinkage"] = dot / norm - 1  # of the average along the exact average
            results[topology][method] = row
    return results


# ----------------------------------------------------------------------------------------------
# launcher and report
# ----------------------------------------------------------------------------------------------


def upstream_quantized_share(world):
    """Share of this model's gradient elements 0.19.8 quantizes at `world` ranks (its rule)."""
    model = make_model()
    total = sum(p.numel() for p in model.parameters())
    quantized = sum(p.numel() for p in model.parameters() if p.dim() > 1 and p.numel() % (2 * world) == 0)
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
        qgz = runs[0]["qgz"]
        elems = qgz["quantized_elems"] + qgz["exact_elems"]
        share = qgz["quantized_elems"] / elems if elems else 0.0
        rows.append({
            "name": name,
            "seeds": [r["seed"] for r in runs],
            "final_val": statistics.mean(finals),
            "final_val_each": finals,
            "gap": statistics.mean(gaps) if gaps else 0.0,
            "gap_each": gaps,
            "inter_bytes_per_step": runs[0]["inter_bytes_per_step"],
            "intra_bytes_per_step": runs[0]["intra_bytes_per_step"],
            "quantized_share": upstream_quantized_share(NODES * PROCS_PER_NODE) if name == "0.19.8" else share,
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
    parser.add_argument("--fidelity-only",
                        action="store_true",
                        help="only the fidelity table, on the model a full run kept in OUT (replacing the one "
                        "in OUT/convergence.json, if any)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.report_only:
        saved = json.loads((Path(args.out) / "convergence.json").read_text())
        return write_outputs(Path(args.out), saved["runs"], saved["fidelity"], args.steps)
    if args.fidelity_only:
        fid = fidelity(Path(args.out) / MODEL, FIDELITY_TOPOLOGIES)
        saved = Path(args.out) / "convergence.json"
        if saved.exists():  # the runs' tables keep their results, the fidelity table is replaced
            return write_outputs(Path(args.out), json.loads(saved.read_text())["runs"], fid, args.steps)
        print(report([], fid, args.steps))
        return 0

    from qgz_harness import Progress, log, run_torchrun_nodes
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import deepspeed
    log(f"environment: torch {torch.__version__}, deepspeed {deepspeed.__version__}, Python {sys.version.split()[0]}")
    train, val = stdlib_corpus()
    log(f"data: {train.numel() / 1e6:.1f} MB of training text, {val.numel() / 1e6:.1f} MB held out")
    log("op build: the CPU quantizer op (about 40 s the first time)")
    from deepspeed.accelerator import get_accelerator
    get_accelerator().create_op_builder("QuantizerBuilder").load(verbose=False)
    runs, plan = run_plan(args)
    work = Path(tempfile.mkdtemp(prefix="qgz-convergence-"))  # the runs' own files and the trained model
    log(f"training: {len(plan)} runs of {args.steps} steps in one job of {NODES} torchrun agents x {PROCS_PER_NODE}")
    bars = {}
    line_re = re.compile(r"^RUN (\d+)/(\d+) (\S+) seed (\d+) STEP (\d+) LOSS (\S+)")

    def on_output(line):
        match = line_re.match(line)
        if match:
            index = int(match.group(1))
            if index not in bars:
                bars[index] = Progress(args.steps,
                                       f"run {index}/{match.group(2)} {match.group(3):<16} seed {match.group(4)}")
            bars[index].update(int(match.group(5)), f"loss {float(match.group(6)):.3f}")

    command = [str(HERE), "--worker"] + sys.argv[1:] + ["--out", str(work)]
    try:
        output = run_torchrun_nodes(command, NODES, PROCS_PER_NODE, timeout=3600, on_output=on_output)
        missing = [f"{name} seed {seed}" for name, seed in plan if not (work / run_file(name, seed)).exists()]
        if missing:
            raise RuntimeError(f"runs without results: {missing}:\n{output[-6000:]}")
        results = [json.loads((work / run_file(name, seed)).read_text()) for name, seed in plan]
        fid = None
        if not args.smoke and (work / MODEL).exists():
            shutil.copy(work / MODEL, out / MODEL)  # kept for --fidelity-only
            log("fidelity: real gradients of the trained model, simulated 3x2 and 4x8 clusters")
            fid = fidelity(out / MODEL, FIDELITY_TOPOLOGIES)
    finally:
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

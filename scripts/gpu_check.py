# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The qgZ CUDA path in one run (through scripts/gpu_check.sh): what no CPU test can show.

Sections, each adding rows to DIR/gpu_check.md (PASS, FAIL or INFO) and its measurements to
DIR/gpu_check.json:

1. environment: nvcc, torch, CUDA, the device and its architecture; DeepSpeed's CUDA
   QuantizerBuilder JIT-built for it (its output in DIR/build.log).
2. kernels: swizzle_quant, quantized_reduction, dequantize and quantize against the PyTorch reference
   (deepspeed_qgz/qgz/qgz_reference.py) over group sizes 8 to 40960 and four topologies, on
   groups of magnitudes 2**-20 to 2**15, all-zero groups, exact rounding ties, +-65504,
   subnormals, inf and NaN. Each kernel gets the same inputs as the reference (the previous GPU
   output). The CUDA build uses --use_fast_math, so its scale divisions may differ in the last
   bit, and a code may flip where the value sits on a rounding tie: both are counted apart; only
   a real mismatch fails.
3. sub-warp probe: quantized_reduction with output groups of 8 to 128 values (a block of fewer
   than 32 threads, which the kernel contract refuses), called on the raw op right after a kernel
   that leaves large values behind, repeated. Stable bits equal to the reference would be evidence
   to relax the contract's warp rule; anything else is evidence that it is needed. INFO rows.
4. triton: this package's Triton quantizer op (deepspeed_qgz/triton_quantizer.py) on the same
   inputs as section 2, bit for bit against the reference (no fast math: any difference fails),
   including its self-check on each variant's first call.
5. ranks: four processes sharing the GPU (gloo carries CUDA tensors; NCCL refuses two ranks on one
   device), the accelerator's device count set to 2 (2 nodes x 2): the series' all_to_all_quant_reduce
   on DeepSpeed's CUDA kernels (0011's dequantize and swizzle_quant calls at 8 bits among them) and on
   the Triton op, on a mixed 2-D/1-D bucket against the exact average, reduce_scatter_coalesced's
   partitions, shapes and dtypes; the bug report's training under ZeRO-3 in fp16 and bf16, qgZ on and
   off.
6. speed: each kernel's GB/s, DeepSpeed's CUDA op and the Triton op side by side, against a
   device-to-device copy at groups of 128, 136, 256, 1024, 4096 and 40960, as the series calls them at
   3x2, with the Triton op's static roofline ceiling on this GPU's architecture
   (benchmarks/qgz_roofline.py) beside it.

--dry-run-on-cpu runs every section that can run without CUDA, on the CPU op and CPU tensors,
smaller (section 5 on gloo with CPU tensors, bf16 and fp32: the CPU accelerator refuses fp16
training; the Triton op in Triton's interpreter). It checks this script, nothing about a GPU.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

try:  # an install with --target processes no .pth file: start the overlay's import hook here
    from deepspeed_qgz._finder import install
    install()
except ImportError:
    pass

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # qgz_harness
GROUP_SIZES = [8, 64, 120, 128, 136, 256, 1024, 4096, 40960]
TOPOLOGIES = [(3, 2), (5, 2), (2, 8), (3, 8)]
PROBE_SIZES = list(range(8, 129, 8))
PROBE_REPEATS = 10
SPEED_GROUPS = [128, 136, 256, 1024, 4096, 40960]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
RANKS_NODES, RANKS_LOCAL = 2, 2


class Report:
    """Rows of the PASS/FAIL table and everything measured, written to --out as they come."""

    def __init__(self, out):
        self.out, self.rows, self.data, self.start = out, [], {}, time.perf_counter()
        if out:
            out.mkdir(parents=True, exist_ok=True)

    def row(self, section, check, status, detail):
        self.rows.append((section, check, status, detail))
        print(f"[{time.perf_counter() - self.start:6.1f} s] {status:4s} {section}: {check}: {detail}", flush=True)
        self.write()

    def record(self, section, key, value):
        self.data.setdefault(section, {})[key] = value

    @contextlib.contextmanager
    def section(self, name):
        begin = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a failing section is a FAIL row, the rest still runs
            self.row(name, "section", "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        self.record(name, "seconds", round(time.perf_counter() - begin, 1))

    def table(self):
        return ("| section | check | result | detail |\n|---|---|---|---|\n" + "\n".join(f"| {s} | {c} | {r} | {d} |"
                                                                                         for s, c, r, d in self.rows))

    def write(self):
        if self.out:
            (self.out / "gpu_check.md").write_text(self.table() + "\n")
            (self.out / "gpu_check.json").write_text(json.dumps({"rows": self.rows, "data": self.data}, indent=1))


# ----------------------------------------------------------------------------------------------
# comparisons
# ----------------------------------------------------------------------------------------------


def ulp_distance(a, b):
    """Per element, the distance in fp32 units in the last place (inf where signs or NaN-ness differ)."""
    a, b = a.float().cpu().reshape(-1), b.float().cpu().reshape(-1)
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    dist = (ia - ib).abs().double()
    both_nan = torch.isnan(a) & torch.isnan(b)
    return torch.where(both_nan, 0.0, torch.where(torch.isnan(a) | torch.isnan(b), math.inf, dist))


def classify_quantized(x, ref_scale, codes, ref_codes, params, ref_params, group_elems):
    """Counts for one quantizer kernel's output against the reference's: equal, scales a last bit
    apart (fast-math division), codes a step apart on a rounding tie, and real mismatches.
    `x` holds the values quantized (fp32, in output group order), `ref_scale` the reference's
    per-group scale (the multiplier before rounding)."""
    dist = ulp_distance(params, ref_params)
    scale_last_bit = int(((dist > 0) & (dist <= 2)).sum())
    scale_real = int((dist > 2).sum())
    code_diff = (codes.long() - ref_codes.long()).abs().reshape(-1)
    product = (x.float().reshape(-1, group_elems) * ref_scale.float().reshape(-1, 1)).reshape(-1)
    frac = product - product.floor()
    near_tie = (frac - 0.5).abs() <= 4 * 2**-24 * product.abs() + 2**-30
    differs = code_diff != 0
    tie_flips = int((differs & (code_diff == 1) & near_tie).sum())
    code_real = int((differs & ~((code_diff == 1) & near_tie)).sum())
    return {
        "elements": int(codes.numel()),
        "groups": int(params.numel()),
        "scale_last_bit": scale_last_bit,
        "scale_real": scale_real,
        "tie_flips": tie_flips,
        "code_real": code_real
    }


def unpack(data, bits):
    from deepspeed_qgz.qgz import qgz_reference as ref
    return ref._unpack(data.cpu(), bits)


def same_bits(a, b):
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------------------------
# 1. environment and build
# ----------------------------------------------------------------------------------------------


def command_output(command):
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unavailable ({exc})"


def environment(report, device, out):
    import deepspeed
    from deepspeed_qgz import cpu_quantizer
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "deepspeed": deepspeed.__version__,
        "nvcc": command_output(["nvcc", "--version"]).splitlines()[-1:] or ["not found"],
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name,
                    capability=f"sm_{props.major}{props.minor}",
                    memory_gb=props.total_memory / 2**30)
    report.record("environment", "info", info)
    report.row("environment", "versions", "INFO", ", ".join(f"{k} {v}" for k, v in info.items()))
    log_path = (out or Path(tempfile.mkdtemp())) / "build.log"
    begin = time.perf_counter()
    builder = cpu_quantizer.builder()
    with open(log_path, "w") as log, redirect_fds(log):
        ops = builder.load(verbose=True)
    report.row("environment", f"build {builder.__class__.__module__}.{builder.__class__.__name__}", "PASS",
               f"{time.perf_counter() - begin:.0f} s, output in {log_path.name}")
    from deepspeed.runtime.comm import coalesced_collectives as cc
    patched = hasattr(cc, "quant_reduce_exchange_values")  # a name the series adds
    report.row("environment", "the series' coalesced_collectives", "PASS" if patched else "FAIL", cc.__file__)
    return ops, ContractCheckedQuantizer(ops)


@contextlib.contextmanager
def redirect_fds(log):
    """stdout and stderr of this process and its children (ninja, nvcc) into `log`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


# ----------------------------------------------------------------------------------------------
# 2. kernels against the reference
# ----------------------------------------------------------------------------------------------


def test_values(num_groups, group_elems, gen):
    """fp16 groups of magnitudes 2**-20 to 2**15 with special groups: all zeros, exact ties, +-65504,
    subnormals only, an inf, a NaN."""
    magnitudes = torch.pow(2.0, torch.empty(num_groups, 1).uniform_(-20, 15, generator=gen))
    x = (torch.randn(num_groups, group_elems, generator=gen) * magnitudes).clamp(-65504, 65504)
    specials = [
        torch.zeros(group_elems),
        torch.tensor([8.0] + [k + 0.5 for k in range(-7, 7)] * (group_elems // 14 + 1))[:group_elems],
        torch.full((group_elems, ), -65504.0),
        torch.arange(group_elems, dtype=torch.float32) * 6e-8,
    ]
    for i, row in enumerate(specials[:num_groups]):
        x[i] = row
    if num_groups > 6:
        x[4, group_elems // 2] = float("inf")
        x[5, group_elems // 3] = float("nan")
        x[6, 0] = 65504.0
    return x.half()


def kernels(report, op, device, dry_run, section="kernels", strict=False):
    """Each kernel of `op` against the reference on the same inputs; with `strict` (an op without
    fast math) any difference fails, else only a real mismatch does."""
    from deepspeed_qgz.qgz import qgz_contract as contract
    from deepspeed_qgz.qgz import qgz_reference as ref
    gen = torch.Generator().manual_seed(0)
    topologies = TOPOLOGIES[:1] if dry_run else TOPOLOGIES
    group_sizes = [g for g in GROUP_SIZES if g <= 4096] if dry_run else GROUP_SIZES
    for group_elems in group_sizes:
        totals = {
            name: {}
            for name in ("swizzle_quant", "quantized_reduction", "dequantize", "swizzle_quant 8-bit",
                         "dequantize 8-bit", "quantize (weights)")
        }
        for num_nodes, local_size in topologies:
            partitions = num_nodes * local_size
            # in-groups per out-group so quantized_reduction's out-groups launch a whole warp
            merge = -(-contract.reduce_min_out_group_elems(4) // group_elems)
            per_partition = 2 * merge
            num_groups = partitions * per_partition
            x = test_values(num_groups, group_elems, gen)
            q, s = op.swizzle_quant(x.to(device), num_groups, 4, op.Symmetric, 1, num_nodes, local_size)
            rq, rs = ref.swizzle_quant(x, num_groups, 4, ref.Symmetric, 1, num_nodes, local_size)
            # the reference's scales and inputs in output (swizzled) group order
            order = swizzled_order(num_groups, num_nodes, local_size)
            ref_scale, _ = ref._params(x.float(), 4, False, contract.swizzle_stat_slots(group_elems) > group_elems)
            add(
                totals["swizzle_quant"],
                classify_quantized(x.float()[order], ref_scale[order], unpack(q, 4), unpack(rq, 4), s, rs,
                                   group_elems))

            out_groups = num_groups // local_size // merge
            r, r_s = op.quantized_reduction(q, s, num_groups, out_groups, 4, op.Symmetric, local_size)
            rr, rr_s = ref.quantized_reduction(q.cpu(), s.cpu(), num_groups, out_groups, 4, ref.Symmetric, local_size)
            sums = reduction_sums(q.cpu(), s.cpu(), num_groups, local_size)
            out_elems = sums.numel() // out_groups
            sum_scale, _ = ref._params(sums.view(out_groups, out_elems), 4, False,
                                       contract.reduce_stat_slots(out_elems // 2, 4) > out_elems)
            add(totals["quantized_reduction"],
                classify_quantized(sums, sum_scale, unpack(r, 4), unpack(rr, 4), r_s, rr_s, out_elems))

            d = op.dequantize(r, r_s, out_groups, 4, op.Symmetric)
            rd = ref.dequantize(r.cpu(), r_s.cpu(), out_groups, 4, ref.Symmetric)
            mismatched = int((d.cpu().view(torch.int16) != rd.view(torch.int16)).sum())
            add(totals["dequantize"], {"elements": d.numel(), "code_real": mismatched})

            # the int8 intra-node exchange: swizzle_quant and dequantize at 8 bits
            q8, s8 = op.swizzle_quant(x.to(device), num_groups, 8, op.Symmetric, 1, num_nodes, local_size)
            rq8, rs8 = ref.swizzle_quant(x, num_groups, 8, ref.Symmetric, 1, num_nodes, local_size)
            ref_scale8, _ = ref._params(x.float(), 8, False, contract.swizzle_stat_slots(group_elems) > group_elems)
            add(
                totals["swizzle_quant 8-bit"],
                classify_quantized(x.float()[order], ref_scale8[order], unpack(q8, 8), unpack(rq8, 8), s8, rs8,
                                   group_elems))
            d8 = op.dequantize(q8, s8, num_groups, 8, op.Symmetric)
            rd8 = ref.dequantize(q8.cpu(), s8.cpu(), num_groups, 8, ref.Symmetric)
            mismatched = int((d8.cpu().view(torch.int16) != rd8.view(torch.int16)).sum())
            add(totals["dequantize 8-bit"], {"elements": d8.numel(), "code_real": mismatched})

            # the weights' quantize (qwZ), where the contract allows the group size
            weight_groups = contract.quantize_launch(group_elems)[1] * 2
            if not contract.quantize_violations(weight_groups * group_elems, weight_groups, 8):
                w = test_values(weight_groups, group_elems, gen)
                qw, sw = op.quantize(w.to(device), weight_groups, 8, op.Symmetric)
                rqw, rsw = ref.quantize(w, weight_groups, 8, ref.Symmetric)
                w_scale, _ = ref._params(w.float(), 8, False, contract.quantize_stat_slots(group_elems) > group_elems)
                add(totals["quantize (weights)"],
                    classify_quantized(w.float(), w_scale, unpack(qw, 8), unpack(rqw, 8), sw, rsw, group_elems))
        for name, counts in totals.items():
            if not counts:  # the weights' quantize refuses groups of 136 to 256 values (sub-warp)
                continue
            differing = ("code_real", "scale_real") + (("scale_last_bit", "tie_flips") if strict else ())
            real = sum(counts.get(key, 0) for key in differing)
            detail = ", ".join(f"{k} {v}" for k, v in counts.items())
            report.row(section, f"{name}, groups of {group_elems}, {len(topologies)} topologies",
                       "PASS" if real == 0 else "FAIL", detail)
            report.record(section, f"{name}/{group_elems}", counts)


def add(totals, counts):
    for key, value in counts.items():
        totals[key] = totals.get(key, 0) + value


def swizzled_order(num_groups, num_nodes, local_size):
    """For each output group of swizzle_quant, its input group."""
    from deepspeed_qgz.qgz.qgz_contract import to_slot_order
    index = torch.arange(num_groups).view(num_nodes * local_size, -1)
    return to_slot_order(index, num_nodes, local_size).reshape(-1)


def reduction_sums(data, scales, in_groups, local_size):
    """quantized_reduction's fp16 sums (the values it requantizes), from the reference's pieces."""
    from deepspeed_qgz.qgz import qgz_reference as ref
    per_tensor = data.numel() // local_size
    groups = in_groups // local_size
    total = torch.zeros(per_tensor * 2, dtype=torch.float16)
    for device in range(local_size):
        codes = ref._unpack(data[device * per_tensor:(device + 1) * per_tensor], 4).view(groups, -1)
        params = scales.reshape(-1)[device * groups:(device + 1) * groups].view(-1, 1).float()
        total = (total.float() + ref._dequantize_rows(codes, params, False).half().reshape(-1).float()).half()
    return total.float()


# ----------------------------------------------------------------------------------------------
# 3. sub-warp probe
# ----------------------------------------------------------------------------------------------


def unchecked_reduction(ops, device):
    """quantized_reduction without the warp rule: the raw CUDA op, or on the CPU (whose op refuses
    such launches itself) the reference's computation of it, standing in for a dry run."""
    from deepspeed_qgz.qgz import qgz_reference as ref
    return ops.quantized_reduction if device == "cuda" else ref.quantized_reduction_beyond_contract


def probe(report, ops, device, dry_run):
    from deepspeed_qgz.qgz import qgz_reference as ref
    reduction = unchecked_reduction(ops, device)
    gen = torch.Generator().manual_seed(1)
    sizes = PROBE_SIZES[::4] if dry_run else PROBE_SIZES
    repeats = 2 if dry_run else PROBE_REPEATS
    local_size, out_groups = 2, 256 if dry_run else 8192
    # a kernel that leaves large values in registers: a big quantized_reduction of +-65504
    big = ops.swizzle_quant(torch.full((8192 * 64, ), 65504.0, dtype=torch.float16, device=device), 64, 4,
                            ops.Symmetric, 1, 1, 1)
    results = {}
    for bits in (4, 8):
        for elems in sizes:
            num_groups = local_size * out_groups
            x = (torch.randn(num_groups * elems, generator=gen) * 3).half()
            q, s = ops.swizzle_quant(x.to(device), num_groups, bits, ops.Symmetric, 1, 1, local_size)
            expected = ref.quantized_reduction_beyond_contract(q.cpu(), s.cpu(), num_groups, out_groups, bits,
                                                               ref.Symmetric, local_size)
            runs = []
            for _ in range(repeats):
                ops.quantized_reduction(big[0], big[1], 64, 32, 4, ops.Symmetric, 2)
                runs.append(reduction(q, s, num_groups, out_groups, bits, ops.Symmetric, local_size))
            stable = all(same_bits(a[0], runs[0][0]) and same_bits(a[1], runs[0][1]) for a in runs)
            equal = all(same_bits(a[1], expected[1]) for a in runs)
            codes_equal = all(same_bits(a[0], expected[0]) for a in runs)
            results[f"{bits}/{elems}"] = {"stable": stable, "scales_equal": equal, "codes_equal": codes_equal}
        summary = {k: v for k, v in results.items() if k.startswith(f"{bits}/")}
        ok = [k.split("/")[1] for k, v in summary.items() if v["stable"] and v["scales_equal"]]
        bad = [k.split("/")[1] for k, v in summary.items() if not (v["stable"] and v["scales_equal"])]
        report.row("sub-warp probe", f"quantized_reduction, {bits} bits, out-groups of {sizes[0]}-{sizes[-1]} values",
                   "INFO", f"stable and equal to the reference: {ok or 'none'}; otherwise: {bad or 'none'}")
    report.record("sub-warp probe", "results", results)


def cluster_inputs(shapes, world, dtype, gen):
    signals = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return [[(sig + 0.25 * torch.randn(sig.shape, generator=gen, dtype=torch.float64)).to(dtype) for sig in signals]
            for _ in range(world)]


def rank_error_over_bound(inputs, outputs, rank):
    """The largest |result - exact average| over the tests' per-element bound in `rank`'s partitions
    (`outputs`); inf where a partition's shape or dtype is not reduce_scatter_coalesced's."""
    world, worst = len(inputs), 0.0
    for i, tensor in enumerate(inputs[0]):
        numel = tensor.numel()
        chunk = math.ceil(numel / world)
        lo, hi = min(rank * chunk, numel), min((rank + 1) * chunk, numel)
        if outputs[i].shape != (hi - lo, ) or outputs[i].dtype != tensor.dtype:
            return math.inf
        if hi == lo:
            continue
        parts = [inputs[r][i].reshape(-1)[lo:hi].double() for r in range(world)]
        exact = torch.stack(parts).mean(0)
        bound = 0.3 * sum(p.abs().max() for p in parts) / world + exact.abs() * 2**-7
        worst = max(worst, float(((outputs[i].cpu().double() - exact).abs() / bound).max()))
    return worst


# ----------------------------------------------------------------------------------------------
# 5. ranks sharing the device
# ----------------------------------------------------------------------------------------------

RANK_BUCKET = [(33, 17), (64, ), (5, 5, 5), (300, 7), (11, )]
TRAIN_STEPS = 10


def ranks(report, device, dry_run):
    from qgz_harness import run_world
    env = {"QGZ_GPU_CHECK_DEVICE": device}
    reports = run_world([sys.executable, __file__, "--rank-worker"] + (["--dry-run-on-cpu"] if dry_run else []),
                        RANKS_NODES,
                        RANKS_LOCAL,
                        timeout=400,
                        env=env)
    first = reports[0]
    for name in first["collective"]:
        worst = max(r["collective"][name] for r in reports)
        report.row(
            "ranks", f"all_to_all_quant_reduce {name}, {RANKS_NODES}x{RANKS_LOCAL} on one device",
            "PASS" if worst <= 1 else "FAIL",
            f"every rank's partitions, shapes and dtypes reduce_scatter_coalesced's; the largest error "
            f"over the bound {worst:.3f}")
    for name, run in first["training"].items():
        if "error" in run:
            report.row("ranks", f"training {name}", "FAIL", run["error"])
            continue
        finite = all(math.isfinite(x) for r in reports for x in r["training"][name]["losses"])
        detail = f"losses {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}, all-to-alls {run['all_to_all_calls']}"
        ok = finite and (run["all_to_all_calls"] > 0) == name.endswith("qgZ on")
        if name.endswith("qgZ on"):
            off = first["training"].get(name.replace("qgZ on", "qgZ off"), {})
            if "losses" in off:
                gap = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], off["losses"]))
                detail += f", largest step difference to qgZ off {gap:.2%}"
                ok = ok and gap <= 0.05
        report.row("ranks", f"training {name}", "PASS" if ok else "FAIL", detail)
    report.record("ranks", "reports", reports)


def rank_worker(dry_run):
    """One of the four processes of section 5."""
    import importlib.util
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.comm import coalesced_collectives as cc
    from deepspeed.utils import groups as ds_groups
    from qgz_harness import release_deepspeed_shm, write_report
    device = os.environ["QGZ_GPU_CHECK_DEVICE"]
    accelerator = get_accelerator()
    if device == "cuda":  # every rank on the one GPU, which counts as RANKS_LOCAL devices per node
        accelerator.device_count = lambda: RANKS_LOCAL
        accelerator.set_device = lambda index: torch.cuda.set_device(0)
        os.environ["LOCAL_RANK"] = "0"
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="gloo")
    release_deepspeed_shm()
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = ds_groups._get_local_all_to_all_group()
    out = {"rank": rank, "collective": {}, "training": {}}
    gen = torch.Generator().manual_seed(3)
    from deepspeed_qgz import triton_quantizer
    for dtype_name, dtype in DTYPES.items():
        for bits in (4, 8):
            inputs = cluster_inputs(RANK_BUCKET, world, dtype, gen)
            mine = [t.to(device) for t in inputs[rank]]
            results = cc.all_to_all_quant_reduce(mine, groups, intra_node_bits=bits)
            out["collective"][f"{dtype_name}, {bits}/4"] = rank_error_over_bound(inputs, results, rank)
            if triton_quantizer.unavailable_reason(device):
                continue
            saved, cc.quantizer_module = cc.quantizer_module, triton_quantizer
            try:
                results = cc.all_to_all_quant_reduce(mine, groups, intra_node_bits=bits)
            finally:
                cc.quantizer_module = saved
            out["collective"][f"{dtype_name}, {bits}/4, Triton op"] = rank_error_over_bound(inputs, results, rank)
    spec = importlib.util.spec_from_file_location("qgz_report_train", HERE / "qgz_3x2" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    # A dry run checks the script: of the GPU run's precisions, the CPU accelerator trains bf16 (it
    # refuses fp16), and a second precision there would run the same code again.
    precisions = ("bf16", ) if device == "cpu" else ("fp16", "bf16")
    for precision in precisions:
        for quantized in (True, False):
            name = f"{precision}, qgZ {'on' if quantized else 'off'}"
            try:
                out["training"][name] = train_run(train, precision, quantized, device)
            except Exception as exc:  # noqa: BLE001 - reported as a FAIL row
                out["training"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    write_report(out)
    dist.barrier()
    dist.destroy_process_group()


def train_run(train, precision, quantized, device):
    import deepspeed
    import deepspeed.comm as dist
    config = json.loads((HERE / "qgz_3x2" / "ds_config_qgz.json").read_text())
    config["train_batch_size"] = 4 * RANKS_NODES * RANKS_LOCAL
    config.pop("bf16", None)
    if precision != "fp32":
        config[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    config["zero_optimization"]["zero_quantized_gradients"] = quantized
    torch.manual_seed(2222)
    model = train.SimpleModel(32)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dtype = next(engine.parameters()).dtype
    loader = train.get_data_loader(engine, 64 * 32, 32, engine.device, dtype)
    dist.comms_logger.comms_dict = {}  # the config enables DeepSpeed's comms logger
    losses = []
    for step, batch in enumerate(loader):
        if step == TRAIN_STEPS:
            break
        loss = engine(batch[0], batch[1])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    if hasattr(engine, "destroy"):
        engine.destroy()
    logged = dist.comms_logger.comms_dict.get("all_to_all_single", {})
    return {"losses": losses, "all_to_all_calls": sum(record[0] for record in logged.values())}


# ----------------------------------------------------------------------------------------------
# 6. speed
# ----------------------------------------------------------------------------------------------


def timed(fn, device, repeats):
    """Median seconds of fn() over `repeats` runs after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def speed(report, ops, checked, device, dry_run):
    from deepspeed_qgz import triton_quantizer
    repeats = 3 if dry_run else 20
    num_nodes, local_size = 3, 2
    world = num_nodes * local_size
    per_rank = 1 << (16 if dry_run else 24)  # about this many fp16 values per partition
    for group_elems in SPEED_GROUPS[:4] if dry_run else SPEED_GROUPS:
        num_groups = world * max(1, per_rank // group_elems)
        x = torch.randn(num_groups * group_elems, device=device).half()
        gbs = {"copy": x.numel() * 2 / timed(lambda: x.clone(), device, repeats) / 1e9}
        for name, op in (("DeepSpeed's", ops), ("Triton", triton_quantizer)):
            if name == "Triton" and (group_elems < 136 or triton_quantizer.unavailable_reason(device)):
                continue  # the contract refuses its reduction's sub-warp groups; the CUDA op's is unchecked
            # groups of 128: the unchecked op (a sub-warp launch), for comparison only
            reduce_fn = unchecked_reduction(ops, device) if group_elems < 136 else op.quantized_reduction
            q, s = op.swizzle_quant(x, num_groups, 4, op.Symmetric, 1, num_nodes, local_size)
            r, r_s = reduce_fn(q, s, num_groups, num_groups // local_size, 4, op.Symmetric, local_size)
            for kernel, call in (
                ("swizzle_quant", lambda: op.swizzle_quant(x, num_groups, 4, op.Symmetric, 1, num_nodes, local_size)),
                ("quantized_reduction",
                 lambda: reduce_fn(q, s, num_groups, num_groups // local_size, 4, op.Symmetric, local_size)),
                ("dequantize", lambda: op.dequantize(r, r_s, num_groups // local_size, 4, op.Symmetric)),
            ):
                gbs[f"{name} {kernel}"] = x.numel() * 2 / timed(call, device, repeats) / 1e9
        ceilings = roofline_ceilings(device, group_elems)
        report.record("speed", f"kernels/{group_elems}", {"GB/s": gbs, "Triton roofline": ceilings})
        report.row(
            "speed", f"kernels, groups of {group_elems}", "INFO",
            ", ".join(f"{k} {v:.0f} GB/s" for k, v in gbs.items()) + " (GB/s of fp16 values); the Triton "
            "op's roofline ceilings: " + ", ".join(f"{k} {v}" for k, v in ceilings.items()))


def roofline_ceilings(device, group_elems):
    """{call: "N% of GPU's HBM, G GB/s of fp16 values"}: the Triton op's static roofline ceiling for each of the
    series' 4/4 calls at 3x2 in groups of `group_elems` values (benchmarks/qgz_roofline.py, run
    without TRITON_INTERPRET: it compiles) on this GPU, or the modeled GPU of its architecture (H100
    in a dry run); {} for groups the series does not make."""
    if group_elems < 136:
        return {}
    if device == "cuda":
        name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    else:
        name, capability = "H100", (9, 0)
    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    import qgz_roofline
    gpu = qgz_roofline.gpu_for(name, capability)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "case.json"
        subprocess.run([
            sys.executable,
            str(HERE.parent / "benchmarks" / "qgz_roofline.py"), "--case", gpu, "3x2", "4",
            str(group_elems), "--case-out",
            str(out)
        ],
                       env=env,
                       check=True,
                       stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    hbm = qgz_roofline.GPUS[gpu]["hbm"]
    # in the speed rows' unit: GB/s of the exchange's fp16 values (the roofline's bytes are per value)
    return {
        r["call"]:
        f"{r['ceiling_percent']:.0f}% of {gpu}'s HBM, "
        f"{r['ceiling_percent'] / 100 * hbm / r['bytes_per_value'] * 2 / 1e9:.0f} GB/s of fp16 values"
        for r in rows
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for gpu_check.md, gpu_check.json and build.log")
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="check this script with the CPU op")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    dry_run = args.dry_run_on_cpu
    if args.rank_worker:
        return rank_worker(dry_run)
    if not torch.cuda.is_available() and not dry_run:
        print("gpu_check: CUDA is needed", file=sys.stderr)
        return 2
    device = "cpu" if dry_run else "cuda"
    if dry_run:  # the Triton op on CPU tensors, in Triton's interpreter (before Triton is imported)
        os.environ["TRITON_INTERPRET"] = "1"
    report = Report(Path(args.out) if args.out else None)
    ops = checked = None
    with report.section("environment"):
        ops, checked = environment(report, device, report.out)
    if ops is not None:
        with report.section("kernels"):
            kernels(report, checked, device, dry_run)
        with report.section("sub-warp probe"):
            probe(report, ops, device, dry_run)
        with report.section("triton"):
            from deepspeed_qgz import triton_quantizer
            reason = triton_quantizer.unavailable_reason(device)
            if reason is None:
                kernels(report, triton_quantizer, device, dry_run, section="triton", strict=True)
            else:
                report.row("triton", "the Triton op", "INFO", f"not run: {reason}")
        with report.section("ranks"):
            ranks(report, device, dry_run)
        with report.section("speed"):
            speed(report, ops, checked, device, dry_run)
    report.record("total", "seconds", round(time.perf_counter() - report.start, 1))
    report.write()
    print("\n" + report.table())
    return 0 if all(status != "FAIL" for _, _, status, _ in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

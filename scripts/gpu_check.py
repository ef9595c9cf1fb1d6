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
4. glue: the whole pipeline (quantized_pipeline.py) on CUDA tensors with the PyTorch reference as
   the quantizer, bit for bit against the same on CPU, fp16, bf16 and fp32, both intra-node
   precisions, on a side stream under torch.cuda.set_sync_debug_mode("error") (a host
   synchronisation raises); then with the CUDA kernels, against the exact average.
5. ranks: four processes sharing the GPU (gloo carries CUDA tensors; NCCL refuses two ranks on one
   device), the accelerator's device count set to 2 (2 nodes x 2): the series' all_to_all_quant_reduce
   (DeepSpeed's CUDA kernels, 0011's dequantize and swizzle_quant calls at 8 bits among them) on a
   mixed 2-D/1-D bucket against the exact average, reduce_scatter_coalesced's partitions, shapes and
   dtypes; the bug report's training under ZeRO-3 in fp16 and bf16, qgZ on and off.
6. speed: each kernel's GB/s against a device-to-device copy at groups of 128, 136, 256 and 1024;
   one rank's pipeline for buckets of 1M to 100M elements: time, kernel launches, peak memory.
7. fused: the fused Triton stages (quantized_fused.py) stage by stage against the glue on the
   PyTorch reference quantizer (bit for bit: a mismatch fails) and on the CUDA kernels (where
   --use_fast_math may move a last bit or a tie: counted, INFO), over three topologies, three
   group sizes, fp16, bf16 and fp32, both intra-node precisions, with zero groups, subnormals,
   each dtype's largest and smallest values, inf and NaN; each fused kernel's GB/s beside its
   static roofline ceiling on this GPU's architecture (benchmarks/qgz_roofline.py) and a
   device-to-device copy's; one call's time and extra peak memory for the fused stages, the default
   stages and the reduce-scatter's own work (its copy-in and division) at 1M to 100M elements,
   fp16 and bf16.
8. fused choice: zero_quantized_gradients_fused "auto" at a first call of 8Mi elements (3x2
   layout) in fp16, bf16 and fp32 at both intra-node precisions: the self-check (a mismatch fails),
   the choice with both paths' times, the start-up time with Triton's compilation, the extra peak
   memory, and the self-check's time once compiled (quantized_fused_choice.py).

--dry-run-on-cpu runs every section that can run without CUDA, on the CPU op and CPU tensors,
smaller (section 5 on gloo with CPU tensors, bf16 and fp32: the CPU accelerator refuses fp16
training; sections 7 and 8 in Triton's interpreter). It checks this script, nothing about a GPU.
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
SPEED_GROUPS = [128, 136, 256, 1024]
PIPELINE_BUCKETS = [1_000_000, 10_000_000, 100_000_000]
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


def kernels(report, op, device, dry_run):
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
            real = counts.get("code_real", 0) + counts.get("scale_real", 0)
            detail = ", ".join(f"{k} {v}" for k, v in counts.items())
            report.row("kernels", f"{name}, groups of {group_elems}, {len(topologies)} topologies",
                       "PASS" if real == 0 else "FAIL", detail)
            report.record("kernels", f"{name}/{group_elems}", counts)


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


# ----------------------------------------------------------------------------------------------
# 4. glue
# ----------------------------------------------------------------------------------------------

GLUE_SHAPES = [(1031, 77), (515, 3), (7, 5, 3), (64, 48)]


def cluster_inputs(shapes, world, dtype, gen):
    signals = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    return [[(sig + 0.25 * torch.randn(sig.shape, generator=gen, dtype=torch.float64)).to(dtype) for sig in signals]
            for _ in range(world)]


def glue(report, checked, device, dry_run):
    from deepspeed_qgz.qgz import qgz_reference as ref
    from deepspeed_qgz.qgz.quantized_simulation import simulate_all_to_all_quant_reduce
    gen = torch.Generator().manual_seed(2)
    num_nodes, local_size = 3, 2
    world = num_nodes * local_size
    for dtype_name, dtype in DTYPES.items():
        for bits in (4, 8):
            inputs = cluster_inputs(GLUE_SHAPES, world, dtype, gen)
            on_cpu, _ = simulate_all_to_all_quant_reduce(inputs, num_nodes, local_size, ref, intra_node_bits=bits)
            moved = [[t.to(device) for t in ranks] for ranks in inputs]
            if device == "cuda":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with torch.cuda.stream(stream):
                        on_device, _ = simulate_all_to_all_quant_reduce(moved,
                                                                        num_nodes,
                                                                        local_size,
                                                                        ref,
                                                                        intra_node_bits=bits)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                torch.cuda.synchronize()
            else:
                on_device, _ = simulate_all_to_all_quant_reduce(moved,
                                                                num_nodes,
                                                                local_size,
                                                                ref,
                                                                intra_node_bits=bits)
            same = all(same_bits(a, b) for ra, rb in zip(on_device, on_cpu) for a, b in zip(ra, rb))
            where = "side stream, sync debug mode 'error'" if device == "cuda" else "CPU (dry run)"
            report.row("glue", f"pipeline with the reference quantizer, {dtype_name}, {bits}/4",
                       "PASS" if same else "FAIL", f"{where}: bit-identical to CPU: {same}")

            kernels_out, _ = simulate_all_to_all_quant_reduce(moved,
                                                              num_nodes,
                                                              local_size,
                                                              checked,
                                                              intra_node_bits=bits)
            worst = error_over_bound(inputs, kernels_out)
            same_as_ref = all(same_bits(a, b) for ra, rb in zip(kernels_out, on_cpu) for a, b in zip(ra, rb))
            report.row("glue", f"pipeline on the kernels, {dtype_name}, {bits}/4", "PASS" if worst <= 1 else "FAIL",
                       f"max error / bound {worst:.3f}; bit-identical to the reference: {same_as_ref}")
            report.record("glue", f"{dtype_name}/{bits}", {
                "same_as_cpu": same,
                "error_over_bound": worst,
                "kernels_same_as_reference": same_as_ref
            })


def error_over_bound(inputs, outputs):
    """The largest |result - exact average| over the tests' per-element bound, every rank's."""
    return max(rank_error_over_bound(inputs, outputs[rank], rank) for rank in range(len(inputs)))


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
    for dtype_name, dtype in DTYPES.items():
        for bits in (4, 8):
            inputs = cluster_inputs(RANK_BUCKET, world, dtype, gen)
            mine = [t.to(device) for t in inputs[rank]]
            results = cc.all_to_all_quant_reduce(mine, groups, intra_node_bits=bits)
            out["collective"][f"{dtype_name}, {bits}/4"] = rank_error_over_bound(inputs, results, rank)
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
    from deepspeed_qgz.qgz import quantized_pipeline as pipeline
    from deepspeed_qgz.qgz.quantized_layout import quantized_reduce_layout
    repeats = 3 if dry_run else 20
    num_nodes, local_size = 3, 2
    world = num_nodes * local_size
    per_rank = 1 << (18 if dry_run else 24)  # about this many fp16 values per partition
    for group_elems in SPEED_GROUPS:
        num_groups = world * (per_rank // group_elems)
        x = torch.randn(num_groups * group_elems, device=device).half()
        copy = timed(lambda: x.clone(), device, repeats)
        q, s = ops.swizzle_quant(x, num_groups, 4, ops.Symmetric, 1, num_nodes, local_size)
        swizzle = timed(lambda: ops.swizzle_quant(x, num_groups, 4, ops.Symmetric, 1, num_nodes, local_size), device,
                        repeats)
        # groups of 128: the unchecked op (a sub-warp launch), for comparison only
        reduce_fn = unchecked_reduction(ops, device) if group_elems < 136 else checked.quantized_reduction
        reduction = timed(lambda: reduce_fn(q, s, num_groups, num_groups // local_size, 4, ops.Symmetric, local_size),
                          device, repeats)
        r, r_s = reduce_fn(q, s, num_groups, num_groups // local_size, 4, ops.Symmetric, local_size)
        dequant = timed(lambda: ops.dequantize(r, r_s, num_groups // local_size, 4, ops.Symmetric), device, repeats)
        gbs = {
            name: x.numel() * 2 / seconds / 1e9
            for name, seconds in (("copy", copy), ("swizzle_quant", swizzle), ("quantized_reduction", reduction),
                                  ("dequantize", dequant))
        }
        report.record("speed", f"kernels/{group_elems}", gbs)
        report.row("speed", f"kernels, groups of {group_elems}", "INFO",
                   ", ".join(f"{k} {v:.0f} GB/s" for k, v in gbs.items()) + " (GB/s of fp16 values)")
    buckets = PIPELINE_BUCKETS[:1] if dry_run else PIPELINE_BUCKETS
    for numel in buckets:
        for dtype_name in ("fp16", "bf16"):
            for bits in (4, 8):
                tensor = torch.randn(numel // 1024, 1024, device=device).to(DTYPES[dtype_name])
                layout = quantized_reduce_layout((tensor.numel(), ), num_nodes, local_size, 136, bits)

                def one_rank():
                    slots = pipeline.quantize_partitions([tensor], layout, checked)
                    received = slots.view(local_size, num_nodes, -1)[0].repeat(local_size, 1)
                    sums = pipeline.reduce_within_node(received, layout, checked)
                    return pipeline.average_across_nodes(sums, layout, checked, tensor.dtype)

                seconds = timed(one_rank, device, 3 if dry_run else 10)
                launches, peak = "n/a", "n/a"
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        one_rank()
                        torch.cuda.synchronize()
                    launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
                    peak = f"{(torch.cuda.max_memory_allocated() - base) / numel:.2f} B/elem"
                report.record("speed", f"pipeline/{numel}/{dtype_name}/{bits}", {
                    "seconds": seconds,
                    "launches": launches,
                    "peak": peak
                })
                report.row("speed", f"one rank's pipeline, {numel / 1e6:.0f}M {dtype_name}, {bits}/4", "INFO",
                           f"{seconds * 1e3:.2f} ms, {launches} kernel launches, extra peak memory {peak}")


# ----------------------------------------------------------------------------------------------
# 7. fused kernels
# ----------------------------------------------------------------------------------------------

FUSED_TOPOLOGIES = [(3, 2), (2, 8), (5, 2)]
FUSED_GROUP_SIZES = [136, 1024, 40960]  # 40960: groups of more than one kernel step


def fused_inputs(shapes, world, dtype, gen):
    """Every rank's tensors: a shared signal with zero groups, subnormals, the dtype's largest and
    smallest normal values, inf and NaN."""
    info = torch.finfo(dtype)
    inputs = cluster_inputs(shapes, world, dtype, gen)
    for rank, tensors in enumerate(inputs):
        flat = tensors[0].view(-1)
        flat[:flat.numel() // 8].zero_()
        flat[-200:] *= info.tiny
        flat[-5] = info.tiny * info.eps
        flat[-7] = info.max * (-1)**rank
        if rank == 1:
            tensors[-1].view(-1)[3] = float("nan")
            tensors[-1].view(-1)[-2] = float("inf")
    return inputs


def slot_mismatches(got, expected, fmt):
    """Values of `got` that differ from `expected` (slots of `fmt`), by the self-check's rule."""
    from deepspeed_qgz.qgz.quantized_fused_choice import slot_differences
    return sum(difference[1] for difference in slot_differences(got, expected, fmt))


def value_mismatches(got, expected):
    """Values of `got` whose bits differ from `expected`'s (NaN equal to NaN), by the self-check's rule."""
    from deepspeed_qgz.qgz.quantized_fused_choice import value_difference
    difference = value_difference(got, expected)
    return 0 if difference is None else difference[0]


def fused(report, checked, device, dry_run):
    from deepspeed_qgz.qgz import qgz_reference as ref
    from deepspeed_qgz.qgz import quantized_fused
    from deepspeed_qgz.qgz import quantized_pipeline as pipeline
    from deepspeed_qgz.qgz.quantized_layout import quantized_reduce_layout
    reason = quantized_fused.fused_unavailable_reason(device)
    report.row("fused", "the fused kernels can run", "FAIL" if reason else "PASS", reason or device)
    if reason:
        return
    stages = {
        "reference": pipeline.pipeline_stages(ref),
        "kernels": pipeline.pipeline_stages(checked),
        "fused": pipeline.pipeline_stages(None, fused=True)
    }
    gen = torch.Generator().manual_seed(7)
    topologies = FUSED_TOPOLOGIES[:1] if dry_run else FUSED_TOPOLOGIES
    group_sizes = [136, 4096] if dry_run else FUSED_GROUP_SIZES
    shapes = [(600, 40), (33, 17), (5, 5, 5)] if dry_run else [(3000, 257), (1031, 77), (33, 17), (5, 5, 5)]
    for dtype_name, dtype in DTYPES.items():
        for bits in (4, 8):
            counts = {
                "reference": {
                    "stage 0": 0,
                    "stage 1": 0,
                    "stage 2": 0,
                    "values": 0
                },
                "kernels": {
                    "stage 2": 0,
                    "values": 0
                }
            }
            worst = 0.0
            for num_nodes, local_size in topologies:
                world = num_nodes * local_size
                inputs = fused_inputs(shapes, world, dtype, gen)
                moved = [[t.to(device) for t in tensors] for tensors in inputs]
                for group_size in group_sizes:
                    layout = quantized_reduce_layout(tuple(t.numel() for t in inputs[0]), num_nodes, local_size,
                                                     group_size, bits)
                    outputs = {(name, 0): run.quantize_partitions(moved[0], layout) for name, run in stages.items()}
                    # stages 1 and 2 of every implementation on what the reference's exchanges carry
                    base = stages["reference"]
                    all_slots = [
                        base.quantize_partitions(moved[r], layout).view(local_size, num_nodes, -1)
                        for r in range(world)
                    ]
                    received = [
                        torch.cat([all_slots[n * local_size + d][0] for d in range(local_size)])
                        for n in range(num_nodes)
                    ]
                    sums = [base.reduce_within_node(received[n], layout) for n in range(num_nodes)]
                    across = torch.stack([sums[n][0] for n in range(num_nodes)])
                    for name, run in stages.items():
                        outputs[name, 1] = run.reduce_within_node(received[0], layout)
                        outputs[name, 2] = run.average_across_nodes(across, layout, dtype=dtype)
                    counts["reference"]["stage 0"] += slot_mismatches(outputs["fused", 0], outputs["reference", 0],
                                                                      layout.intra)
                    counts["reference"]["stage 1"] += slot_mismatches(outputs["fused", 1], outputs["reference", 1],
                                                                      layout.inter)
                    counts["reference"]["stage 2"] += value_mismatches(outputs["fused", 2], outputs["reference", 2])
                    counts["kernels"]["stage 2"] += value_mismatches(outputs["fused", 2], outputs["kernels", 2])
                    counts["reference"]["values"] += outputs["fused", 2].numel()
                    counts["kernels"]["values"] += outputs["fused", 2].numel()
                    finite = torch.isfinite(outputs["fused", 2]) & torch.isfinite(outputs["kernels", 2])
                    diff = (outputs["fused", 2][finite].double() - outputs["kernels", 2][finite].double()).abs()
                    scale = outputs["kernels", 2][finite].double().abs().max() if finite.any() else 1.0
                    worst = max(worst, float(diff.max() / scale) if diff.numel() else 0.0)
            real = sum(v for k, v in counts["reference"].items() if k != "values")
            report.row(
                "fused", f"stages against the glue on the reference quantizer, {dtype_name}, {bits}/4",
                "PASS" if real == 0 else "FAIL",
                f"{len(topologies)} topologies x {len(group_sizes)} group sizes, mismatches: " +
                ", ".join(f"{k} {v}" for k, v in counts["reference"].items()))
            report.row(
                "fused", f"stage 2 against the glue on the CUDA kernels, {dtype_name}, {bits}/4", "INFO",
                f"values differing {counts['kernels']['stage 2']} of {counts['kernels']['values']} "
                f"(fast-math last bits and ties), largest difference {worst:.2e} of the largest value")
            report.record("fused", f"{dtype_name}/{bits}", {"counts": counts, "largest_difference": worst})
    fused_no_sync(report, stages, device)
    fused_speed(report, stages, device, dry_run)


def fused_no_sync(report, stages, device):
    """One fused call on a side stream with host synchronizations made errors (on a GPU)."""
    from deepspeed_qgz.qgz.quantized_layout import quantized_reduce_layout
    gen = torch.Generator().manual_seed(9)
    tensors = [t.to(device) for t in cluster_inputs([(1031, 77), (33, 17)], 1, torch.bfloat16, gen)[0]]
    layout = quantized_reduce_layout(tuple(t.numel() for t in tensors), 3, 2, 136, 8)
    run = stages["fused"]

    def one_call():
        slots = run.quantize_partitions(tensors, layout)
        received = slots.view(2, 3, -1)[0].repeat(2, 1)
        return run.average_across_nodes(run.reduce_within_node(received, layout), layout, dtype=torch.bfloat16)

    expected = one_call()  # compiles the kernels and caches the layout's tables (copies that synchronize)
    if device == "cuda":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = one_call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        where = "side stream, sync debug mode 'error'"
    else:
        got, where = one_call(), "CPU (dry run)"
    same = value_mismatches(got, expected) == 0
    report.row("fused", "one call without a host synchronization", "PASS" if same else "FAIL",
               f"{where}; the same bits as the call before: {same}")


def roofline_ceilings(device, topology, dtype_name, bits):
    """{stage: "N% of HBM, G GB/s on GPU"}: each fused stage's static roofline ceiling
    (benchmarks/qgz_roofline.py, run without TRITON_INTERPRET: it compiles) for this GPU, or the
    modeled GPU of its architecture (H100 in a dry run)."""
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
            str(HERE.parent / "benchmarks" / "qgz_roofline.py"), "--case", gpu, f"{topology[0]}x{topology[1]}",
            dtype_name,
            str(bits), "--case-out",
            str(out)
        ],
                       env=env,
                       check=True,
                       stdout=subprocess.DEVNULL)
        rows = json.loads(out.read_text())
    hbm = qgz_roofline.GPUS[gpu]["hbm"] / 1e9
    return {
        f"stage {k}": f"{r['ceiling_percent']:.0f}% of {gpu}'s HBM, {r['ceiling_percent'] * hbm / 100:.0f} GB/s"
        for k, r in enumerate(rows)
    }


def fused_speed(report, stages, device, dry_run):
    from deepspeed_qgz.qgz.quantized_layout import quantized_reduce_layout
    from deepspeed_qgz.qgz.quantized_pipeline import chunk_cat
    num_nodes, local_size = 3, 2
    world = num_nodes * local_size
    repeats = 2 if dry_run else 10
    numel = 1 << (14 if dry_run else 24)
    tensor = torch.randn(numel // 1024, 1024, device=device).to(torch.bfloat16)
    for bits in (4, 8):
        layout = quantized_reduce_layout((tensor.numel(), ), num_nodes, local_size, 136, bits)
        run = stages["fused"]
        slots = run.quantize_partitions([tensor], layout)
        received = slots.view(local_size, num_nodes, -1)[0].repeat(local_size, 1)
        sums = run.reduce_within_node(received, layout)
        average = run.average_across_nodes(sums, layout, dtype=tensor.dtype)
        copy = tensor.clone()
        copy_s = timed(lambda: copy.copy_(tensor), device, repeats)
        rates = {"copy": 2 * tensor.numel() * 2 / copy_s / 1e9}
        for name, fn, moved in (("stage 0", lambda: run.quantize_partitions([tensor], layout), tensor.numel() * 2 +
                                 slots.numel()), ("stage 1", lambda: run.reduce_within_node(received, layout),
                                                  received.numel() + sums.numel()),
                                ("stage 2", lambda: run.average_across_nodes(sums, layout, dtype=tensor.dtype),
                                 sums.numel() + average.numel() * 2)):
            rates[name] = moved / timed(fn, device, repeats) / 1e9
        ceilings = roofline_ceilings(device, (num_nodes, local_size), "bf16", bits)
        report.row(
            "fused", f"kernels' GB/s (bytes read and written), {tensor.numel() / 1e6:g}M bf16, {bits}/4", "INFO",
            ", ".join(f"{k} {v:.0f}" + (f" (roofline {ceilings[k]})" if k in ceilings else "")
                      for k, v in rates.items()))
        report.record("fused", f"speed/{bits}", {"measured": rates, "roofline": ceilings})
    buckets = [1 << 16] if dry_run else PIPELINE_BUCKETS
    for numel in buckets:
        for dtype_name in ("fp16", "bf16"):
            tensor = torch.randn(numel // 1024, 1024, device=device).to(DTYPES[dtype_name])
            layout = quantized_reduce_layout((tensor.numel(), ), num_nodes, local_size, 136, 8)
            cells = {}
            for name in ("fused", "kernels", "reduce-scatter"):

                def one_call(name=name):
                    if name == "reduce-scatter":  # its copy-in and division, the collective left out
                        buffer = torch.empty(world, -(-tensor.numel() // world), dtype=tensor.dtype, device=device)
                        chunk_cat([tensor.view(-1)], buffer)
                        return buffer.div_(world)
                    run = stages[name]
                    slots = run.quantize_partitions([tensor], layout)
                    received = slots.view(local_size, num_nodes, -1)[0].repeat(local_size, 1)
                    return run.average_across_nodes(run.reduce_within_node(received, layout),
                                                    layout,
                                                    dtype=tensor.dtype)

                seconds = timed(one_call, device, repeats)
                peak = "n/a"
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    one_call()
                    torch.cuda.synchronize()
                    peak = f"{(torch.cuda.max_memory_allocated() - base) / numel:.2f} B/elem"
                cells[name] = {"ms": seconds * 1e3, "peak": peak}
            report.row("fused", f"one call, {numel / 1e6:g}M {dtype_name}, 8/4, 3x2 (exchanges left out)", "INFO",
                       "; ".join(f"{k} {v['ms']:.2f} ms, extra peak {v['peak']}" for k, v in cells.items()))
            report.record("fused", f"call/{numel}/{dtype_name}", cells)


def fused_choice(report, checked, device, dry_run):
    """zero_quantized_gradients_fused "auto" as a user's first qgZ call meets it (one rank, 3x2
    layout): the self-check's verdict, the choice, both paths' times on the call's bucket, the
    start-up time (Triton's compilation of the variants included) and the check's extra peak
    memory; then the self-check alone again, compiled."""
    from deepspeed_qgz.qgz import quantized_fused_choice as choice
    from deepspeed_qgz.qgz.quantized_layout import quantized_reduce_layout
    numel = 24576 if dry_run else 8 * 2**20
    gen = torch.Generator().manual_seed(11)
    for dtype_name, dtype in DTYPES.items():
        for bits in (8, 4):
            tensors = [t.to(device) for t in cluster_inputs([(numel // 1024, 1024)], 1, dtype, gen)[0]]
            layout = quantized_reduce_layout((numel, ), 3, 2, 136, bits)
            synchronize(device)
            base = memory_allocated(device)
            begin = time.perf_counter()
            fused = choice.choose_fused(choice.AUTO, tensors, layout, checked)
            synchronize(device)
            startup = time.perf_counter() - begin
            extra = (max_memory_allocated(device) - base) / 2**20
            reason = [
                c.reason for key, c in choice.choices().items() if key.dtype == dtype and key.intra_node_bits == bits
            ][-1]
            begin = time.perf_counter()
            again = choice.self_check(3, 2, 136, bits, dtype, device)
            synchronize(device)
            warm = time.perf_counter() - begin
            status = "PASS" if "the self-check gave the reference's bits" in reason and again is None else "FAIL"
            report.row(
                "fused choice", f"\"auto\" at the first call, {dtype_name}, {bits}/4, "
                f"{numel / 2**20:g}Mi elements", status,
                f"{'fused' if fused else 'default'}; start-up {startup:.2f} s (self-check compiled "
                f"{warm:.2f} s), extra peak {extra:.1f} MiB; {reason}")
            report.record("fused choice", f"{dtype_name}/{bits}", {
                "fused": fused,
                "startup_s": startup,
                "self_check_s": warm,
                "extra_peak_mib": extra,
                "reason": reason
            })


def synchronize(device):
    if device == "cuda":
        torch.cuda.synchronize()


def memory_allocated(device):
    if device != "cuda":
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def max_memory_allocated(device):
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


# ----------------------------------------------------------------------------------------------


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
    if dry_run:  # the fused kernels on CPU tensors, in Triton's interpreter (before they are imported)
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
        with report.section("glue"):
            glue(report, checked, device, dry_run)
        with report.section("ranks"):
            ranks(report, device, dry_run)
        with report.section("speed"):
            speed(report, ops, checked, device, dry_run)
        with report.section("fused"):
            fused(report, checked, device, dry_run)
        with report.section("fused choice"):
            fused_choice(report, checked, device, dry_run)
    report.record("total", "seconds", round(time.perf_counter() - report.start, 1))
    report.write()
    print("\n" + report.table())
    return 0 if all(status != "FAIL" for _, _, status, _ in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())

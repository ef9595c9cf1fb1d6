# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Triton's compiler on this package's Triton quantizer op (deepspeed_qgz/triton_quantizer.py), without a
GPU: the launches the op makes, recorded on meta tensors; each specialized as Triton's runtime
specializes it and compiled for an NVIDIA target; its PTX, cubin, resource usage and SASS.

Triton's interpreter never runs its compiler, so this must run in a process without
TRITON_INTERPRET (test_qgz_triton_quantizer.py starts one):

    python -m unit.qgz_compile --out report.json     # from the tests directory

The report names every distinct variant compiled, for which targets, and every problem: a compile
error, a grid beyond CUDA's limits, local memory (a register spill), in the PTX an approximate
division or transcendental, an FMA or a flush-to-zero instruction, or a variant that random calls of
the series and qwZ make and the matrix does not compile.
"""

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from deepspeed_qgz.qgz.qgz_contract import quantized_reduction_violations

# The GPUs the kernels are for: sm_80 (A100), sm_89 (L40S, RTX 40xx), sm_90 (H100, H200).
ARCHES = (80, 89, 90)
# What no kernel's PTX may hold (the module docstring of triton_quantizer.py says why).
PTX_FORBIDDEN = {
    "an approximate division or transcendental":
    re.compile(r"\b(div\.(approx|full)|(rcp|sqrt|rsqrt|ex2|lg2|sin|cos|"
               r"tanh)\.approx)"),
    "an FMA":
    re.compile(r"\bfma\."),
    "a flush-to-zero instruction":
    re.compile(r"\.ftz\b"),
}


def meta(numel, dtype=torch.float16):
    return torch.empty(numel, dtype=dtype, device="meta")


@dataclass
class Launch:
    """One launch a launcher made: its kernel (a JITFunction), grid, arguments and meta-parameters."""
    kernel: object
    grid: Tuple[int, ...]
    args: tuple
    meta: dict

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def __reduce__(self):
        # to a worker process: the kernel by name, tensors as meta tensors of their dtype, shape and offset
        args = tuple(("tensor", str(a.dtype), tuple(a.shape), a.storage_offset()) if isinstance(a, torch.Tensor) else a
                     for a in self.args)
        return _rebuild_launch, (self.name, self.grid, args, self.meta)


def _rebuild_launch(name, grid, args, meta_parameters):
    args = tuple(
        at_offset(math.prod(a[2]), getattr(torch, a[1].split(".")[-1]), a[3]).
        view(a[2]) if isinstance(a, tuple) and a[:1] == ("tensor", ) else a for a in args)
    return Launch(getattr(quantizer_module(), name), grid, args, meta_parameters)


def quantizer_module():
    from deepspeed_qgz import triton_quantizer
    if triton_quantizer.triton is None:
        raise RuntimeError("Triton is not installed")
    if triton_quantizer.unavailable_reason("cpu") is None:
        raise RuntimeError("TRITON_INTERPRET=1 is set: Triton's compiler needs a process without it")
    return triton_quantizer


def record_quantizer_launches(calls) -> List[Launch]:
    """The launches the Triton quantizer op makes for `calls` ((op name, arguments) on meta tensors):
    its launches recorded instead of made, and not checked against the reference."""
    op = quantizer_module()
    launches = []

    def record(name, kernel, grid, args, meta, outputs, expected):
        if grid > op.GRID_LIMIT:
            raise ValueError(f"{kernel.fn.__name__}: {grid} programs exceed CUDA's grid limit {op.GRID_LIMIT}")
        launches.append(Launch(kernel, (grid, ), tuple(args), dict(meta)))
        return outputs

    saved = op._checked_call, op._require_runnable
    op._checked_call, op._require_runnable = record, lambda name, **tensors: None
    try:
        for name, args in calls:
            getattr(op, name)(*args)
    finally:
        op._checked_call, op._require_runnable = saved
    return launches


def _options(launch: Launch) -> dict:
    return dict(launch.meta, num_warps=sys.modules[launch.kernel.fn.__module__].NUM_WARPS, enable_fp_fusion=False)


def specialization(launch: Launch, arch: int):
    """(signature, constexprs, attrs, options) of `launch` for sm_`arch`, as Triton's runtime
    computes them when it launches the kernel (create_function_from_signature, _pack_args)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, backend)
    kwargs = _options(launch)
    bound, specialized, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound, specialized, options)
    return signature, constexprs, attrs, options


def bound_arguments(launch: Launch) -> Dict[str, object]:
    """The kernel's parameters by name: ints and constexprs as values, tensors as themselves."""
    names = [p.name for p in launch.kernel.params]
    values = dict(zip(names, launch.args))
    values.update(launch.meta)
    return values


def variant_key(launch: Launch, arch: int) -> str:
    """What Triton compiles one binary for: the kernel, its signature, constants and attributes."""
    signature, constexprs, attrs, options = specialization(launch, arch)
    return repr((launch.name, arch, sorted(signature.items()), sorted(constexprs.items()), sorted(attrs.items()),
                 sorted((k, str(v)) for k, v in options.__dict__.items())))


def compile_launch(launch: Launch, arch: int):
    """Triton's compiler on `launch` for sm_`arch` (no GPU needed): the CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature, constexprs, attrs, options = specialization(launch, arch)
    source = ASTSource(launch.kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options.__dict__)


def tool(name: str) -> str:
    """A CUDA binary tool shipped in Triton's wheel (cuobjdump, nvdisasm)."""
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{name} is not in Triton's wheel ({path})")
    return path


def _with_cubin(cubin: bytes, command) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(command + [f.name], check=True, capture_output=True, text=True).stdout


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """cuobjdump --dump-resource-usage of the kernel: REG, STACK, SHARED, LOCAL (spills), ..."""
    out = _with_cubin(cubin, [tool("cuobjdump"), "--dump-resource-usage"])
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}


@dataclass
class Instruction:
    """One SASS instruction: its address, opcode (with modifiers), operands, the source lines it came
    from (innermost first: a line of an inlined function, then the lines that called it) and
    the predicate that guards it."""
    address: int
    opcode: str
    operands: str
    lines: Tuple[int, ...]
    predicate: str  # the guarding predicate register ("P3" for @P3 or @!P3), "" if none


@dataclass
class Disassembly:
    instructions: List[Instruction]
    labels: Dict[str, int]  # label -> address of the instruction it marks
    subroutines_from: int  # the first address of the subroutines after the kernel (a division's slow path)


_LINE = re.compile(r'//## File ".*?", line (\d+)((?: inlined at ".*?", line \d+)*)')
_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")


def disassemble(cubin: bytes) -> Disassembly:
    """nvdisasm's SASS of the kernel, with the source lines of each instruction (Triton compiles with
    line information)."""
    out = _with_cubin(cubin, [tool("nvdisasm"), "-c", "-gi"])
    instructions, labels, pending, lines = [], {}, [], ()
    subroutines_from = None
    for text in out.splitlines():
        match = _LINE.search(text)
        if match:
            lines = (int(match.group(1)), ) + tuple(int(n) for n in re.findall(r"line (\d+)", match.group(2)))
            continue
        label = re.match(r"^(\.L_x_\d+|\$[\w$]+):", text.strip())
        if label:
            pending.append(label.group(1))
            if label.group(1).startswith("$__internal") and subroutines_from is None:
                subroutines_from = -1  # the next instruction's address
            continue
        match = _INSTRUCTION.match(text)
        if not match:
            continue
        address = int(match.group(1), 16)
        if subroutines_from == -1:
            subroutines_from = address
        for name in pending:
            labels[name] = address
        pending = []
        predicate = (match.group(2) or "").strip().lstrip("@").lstrip("!")
        instructions.append(Instruction(address, match.group(3), match.group(4), lines, predicate))
    end = instructions[-1].address + 16 if instructions else 0
    return Disassembly(instructions, labels, subroutines_from if subroutines_from not in (None, -1) else end)


def ptx_problems(ptx: str) -> List[str]:
    return [
        f"the PTX holds {what} ({m.group(0)!r})" for what, pattern in PTX_FORBIDDEN.items()
        for m in [pattern.search(ptx)] if m
    ]


# --------------------------------------------------------------------------------------------------
# the launches CI compiles
# --------------------------------------------------------------------------------------------------

TOPOLOGIES = ((1, 2), (2, 1), (3, 2), (5, 2), (7, 1), (2, 8), (3, 8), (2, 16), (16, 2))
SERIES_GROUPS = (136, 40960)  # the series' groups: multiples of 8 values from 136 to 40960
GROUPS_PER_RANK = (1, 2, 3, 4)
SERIES_EXCHANGE_VALUES = 2**27  # the series' quant_reduce_exchange_values: the values one exchange stages
QWZ_GROUPS = (264, 8000)  # qwZ's: CUDAQuantizer quantizes in groups of multiples of 8 from 264 to 8000 values
SAMPLES = 3000  # random calls whose variants must be among those compiled


def group_sizes(lowest: int, highest: int) -> List[int]:
    """Group sizes that make every variant the groups from `lowest` to `highest` make: the first four
    sizes of each tile class (the op's BLOCK, and whether a group takes more than a tile), whose
    residues mod 32 are every multiple of 8's, and `highest`. A kernel specializes on a group size's
    divisibility by 16, and on that of the size times a count, halved at 4 bits (the bytes of a
    device's codes); so, with the counts of GROUPS_PER_RANK and TOPOLOGIES, on the size mod 32.
    check() verifies this on SAMPLES random calls."""
    from deepspeed_qgz.triton_quantizer import tile
    sizes, taken = [], {}
    for size in range(lowest, highest + 1, 8):
        block, _, one_step = tile(size)
        if taken.setdefault((block, one_step), 0) < 4:
            taken[block, one_step] += 1
            sizes.append(size)
    return sorted(set(sizes + [highest]))


def exchange_calls(values: int, group: int, num_nodes: int, local: int, bits: int):
    """(step, op, [arguments of each call, on meta tensors]) of the quantizer calls the series'
    all_to_all_quant_reduce makes, in order, for one exchange of `values` staged values (every rank's
    padded partitions) in groups of `group` values, with `bits` inside the node. At 8 bits a copy per
    local rank is dequantized, each a chunk of what the all-to-all received, so at that chunk's offset:
    a pointer 16-byte aligned or not, which Triton compiles a variant for. The other calls' inputs
    are buffers of their own."""
    groups = values // group
    node_groups = groups // local
    steps = [("swizzle_quant", "swizzle_quant", [(meta(values), groups, bits, 0, 1, num_nodes, local)])]
    if bits == 4:
        steps.append(("quantized_reduction", "quantized_reduction", [
            (meta(values // 2, torch.int8), meta(groups, torch.float32), groups, node_groups, 4, 0, local)
        ]))
    else:
        copies = zip(meta(values, torch.int8).chunk(local), meta(groups, torch.float32).chunk(local))
        steps.append(("dequantize (each copy, 8 bits)", "dequantize", [(codes, scales, node_groups, 8, 0)
                                                                       for codes, scales in copies]))
        steps.append(
            ("swizzle_quant (node sums)", "swizzle_quant", [(meta(values // local), node_groups, 4, 0, 1, 1, 1)]))
    steps.append(("dequantize", "dequantize", [(meta(values // local // 2,
                                                     torch.int8), meta(node_groups,
                                                                       torch.float32), node_groups, 4, 0)]))
    return steps


def quantizer_calls():
    """(what, (op, arguments on meta tensors)) for the Triton quantizer op's calls CI compiles: the
    calls the series' all_to_all_quant_reduce makes (exchange_calls) at each topology, group size and
    intra-node precision, for one to four groups per rank and the largest exchange; qwZ's quantize and
    dequantize, whose inputs are 16-byte aligned or not (a partition is a view into ZeRO-3's flat
    buffer, at any offset)."""
    for num_nodes, local in TOPOLOGIES:
        world = num_nodes * local
        for group in group_sizes(*SERIES_GROUPS):
            for bits in (4, 8):
                for per_rank in GROUPS_PER_RANK + (max(1, SERIES_EXCHANGE_VALUES // (world * group)), ):
                    what = f"{num_nodes}x{local}, {bits}/4, groups of {group}, {per_rank} per rank"
                    for _, op, calls in exchange_calls(world * group * per_rank, group, num_nodes, local, bits):
                        for args in calls:
                            yield what, (op, args)
                    # out-groups of three in-groups each: the per-value parameter lookup, which the
                    # series' calls (out-groups of one in-group) never compile
                    code_bytes, scale_values = world * group * per_rank // 2, world * per_rank
                    if bits == 4 and per_rank == 3 and not quantized_reduction_violations(
                            code_bytes, scale_values, world * per_rank, num_nodes, 4, 0, local):
                        yield what + ", out-groups of 3 in-groups", ("quantized_reduction", (meta(
                            code_bytes, torch.int8), meta(scale_values,
                                                          torch.float32), world * per_rank, num_nodes, 4, 0, local))
    for group in group_sizes(*QWZ_GROUPS):
        for groups in (16, 4096):
            what = f"qwZ, groups of {group}, {groups} groups"
            yield from qwz_calls(what, group, groups, [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)])


def qwz_calls(what, group, groups, offsets):
    """qwZ's quantize, dequantize and dequantize_fp32 of `groups` groups of `group` values, for each
    (values', codes', scales') offsets in elements into their buffers."""
    seen = set()
    for x_offset, codes_offset, scales_offset in offsets:
        if x_offset not in seen:
            seen.add(x_offset)
            yield what, ("quantize", (at_offset(groups * group, torch.float16, x_offset), groups, 8, 0))
        codes = at_offset(groups * group, torch.int8, codes_offset)
        scales = at_offset(groups, torch.float32, scales_offset)
        for name in ("dequantize", "dequantize_fp32"):
            yield what, (name, (codes, scales, groups, 8, 0))


def at_offset(numel, dtype, offset):
    """A meta tensor `offset` elements into a buffer: its pointer is as far past an aligned one."""
    return meta(offset + numel, dtype)[offset:]


def sampled_calls(count: int, seed: int = 0):
    """(what, (op, arguments)) of `count` calls drawn at random from all the series and qwZ can make:
    exchanges of any topology up to 16 x 16, group size, groups per rank and precision; qwZ's calls
    at any group size and offsets."""
    rng = random.Random(seed)
    for _ in range(count):
        num_nodes, local = rng.randint(1, 16), rng.randint(1, 16)
        group = 8 * rng.randint(SERIES_GROUPS[0] // 8, SERIES_GROUPS[1] // 8)
        per_rank = rng.randint(1, max(1, min(64, SERIES_EXCHANGE_VALUES // (num_nodes * local * group))))
        bits = rng.choice((4, 8))
        what = f"sampled: {num_nodes}x{local}, {bits}/4, groups of {group}, {per_rank} per rank"
        for _, op, calls in exchange_calls(num_nodes * local * group * per_rank, group, num_nodes, local, bits):
            for args in calls:
                yield what, (op, args)
        group = 8 * rng.randint(QWZ_GROUPS[0] // 8, QWZ_GROUPS[1] // 8)
        offsets = (rng.randint(0, 7), rng.randint(0, 15), rng.randint(0, 3))
        yield from qwz_calls(f"sampled: qwZ, groups of {group}, offsets {offsets}", group, rng.randint(1, 64),
                             [offsets])


def _compile_variant(item):
    """Worker: compile one variant for one target; (key, problems, resources, seconds)."""
    key, launch, arch = item
    start = time.perf_counter()
    try:
        compiled = compile_launch(launch, arch)
    except Exception as exc:  # noqa: BLE001 - a compile error is what this reports
        return key, [f"does not compile: {type(exc).__name__}: {str(exc).splitlines()[-1][:300]}"], {}, 0.0
    problems = ptx_problems(compiled.asm["ptx"])
    resources = resource_usage(compiled.asm["cubin"])
    if resources.get("LOCAL", 0):
        problems.append(f"spills {resources['LOCAL']} bytes to local memory")
    return key, problems, resources, time.perf_counter() - start


def check(workers: int = 2) -> dict:
    """Records the CI matrix's launches, compiles each distinct variant for every target in ARCHES
    and returns the report; a variant of SAMPLES random calls that is not among them is a problem."""
    print(f"recording the matrix's launches, then {SAMPLES} random calls' (about 20 s)", file=sys.stderr, flush=True)
    variants, seen_by, largest_grid = {}, {}, 0
    problems = []
    launches = ((what, launch) for what, call in quantizer_calls() for launch in record_quantizer_launches([call]))
    for what, launch in launches:
        largest_grid = max(largest_grid, launch.grid[0])
        for arch in ARCHES:
            key = variant_key(launch, arch)
            if key not in variants:
                variants[key] = (launch, arch)
                seen_by[key] = what
    missed = {}
    for what, call in sampled_calls(SAMPLES):
        for launch in record_quantizer_launches([call]):
            # Triton's specialization does not depend on the target: one is enough
            key = variant_key(launch, ARCHES[0])
            if key not in variants:
                missed.setdefault(key, (what, launch))
    problems.extend(f"{launch.name} {sorted(launch.meta.items())}: a variant the matrix does not compile, first made "
                    f"by {what}" for what, launch in missed.values())
    print(
        f"compiling {len(variants)} variants ({len(variants) // len(ARCHES)} per target) for "
        f"{', '.join(f'sm_{a}' for a in ARCHES)}",
        file=sys.stderr,
        flush=True)
    report = {"variants": len(variants), "largest_grid": largest_grid, "compiled": [], "problems": problems}
    items = [(key, launch, arch) for key, (launch, arch) in variants.items()]
    start, done = time.perf_counter(), 0
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for key, found, resources, seconds in pool.map(_compile_variant, items):
            done += 1
            launch, arch = variants[key]
            name = f"{launch.name} sm_{arch} {sorted((k, v) for k, v in launch.meta.items())}"
            report["compiled"].append({"variant": name, "registers": resources.get("REG"), "seconds": seconds})
            problems.extend(f"{name} (first seen at {seen_by[key]}): {p}" for p in found)
            if done % 20 == 0 or done == len(items):
                print(f"  {done}/{len(items)} compiled, {time.perf_counter() - start:.0f} s",
                      file=sys.stderr,
                      flush=True)
    return report


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    args = parser.parse_args(argv)
    report = check(args.workers)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['variants']} variants compiled, {len(report['problems'])} problems", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

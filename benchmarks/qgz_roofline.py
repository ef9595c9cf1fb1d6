# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A static roofline of this package's Triton quantizer op (deepspeed_qgz/triton_quantizer.py) as the
series' all_to_all_quant_reduce calls it, read off the machine code Triton's compiler makes for each
GPU, without a GPU.

For each kernel call of one exchange, intra-node precision, group size and topology: the launch the
op makes for the exchange of one LLaMA-2-7B layer's gradients (recorded on meta tensors), compiled
for the GPU's architecture; its SASS, with every
instruction weighted by how often a program runs it (the loop bodies by their trip counts, read
from the ``# trips:`` note on (or above) each loop of the kernel source and the loop's induction step in the
SASS, so that a loop ptxas unrolled counts once per source iteration; the slow path of a division,
a subroutine, left out; code under a branch counted as if taken); per gradient value of the call,
the thread instructions of each class and the bytes the launch reads and writes. Against each GPU's
per-SM rate of each class, its issue rate and its HBM bandwidth, the ceiling each sets on the
kernel's share of HBM bandwidth, and the class that binds.

Rates per SM and clock, by compute capability (NVIDIA, CUDA C++ Programming Guide, "Arithmetic
Instructions", table "Throughput of Native Arithmetic Instructions", columns 8.0, 8.9 and 9.0): results
of 32-bit floating-point add/multiply/multiply-add 64, 128, 128; of 16-bit 256, 128, 256 (two per
instruction: fp16x2); of 64-bit 32, 2, 64; 32-bit reciprocal and other MUFU functions 16; 32-bit integer
add, multiply-add, shift, compare/minimum/maximum and bitwise operations 64; bit-field extract/insert
and bit reverse 16; count of leading zeros and population count 16; warp shuffle 32; conversions to or
from 64-bit types 16, 2, 16; all other conversions 16. Shared memory: 32 banks of 32 bits per clock
(the guide's "Shared Memory" sections for these compute capabilities). Every SM issues 4 warp
instructions per clock (4 schedulers). Instructions NVIDIA's table does not rate (branches, moves of
uniform values, loads and stores to global memory, predicate logic) count only against the issue
rate; global memory against HBM bandwidth. GPUs (NVIDIA's data sheets): A100 SXM4 80 GB (sm_80, 108
SMs, 1410 MHz boost, 2039 GB/s), H100 SXM5 (sm_90, 132 SMs, 1980 MHz, 3350 GB/s), H200 SXM (sm_90, 132
SMs, 1980 MHz, 4800 GB/s), L40S (sm_89, 142 SMs, 2520 MHz, 864 GB/s).

What it leaves out: latencies and occupancy (see the registers column), shared-memory bank
conflicts, cache effects, the load-store unit's own rate (not in the table), the tail of a launch.
A ceiling is what the instruction mix allows, not a measured speed; scripts/gpu_check.sh measures
each kernel's GB/s beside it.

    python benchmarks/qgz_roofline.py [--out DIR] [--quick]
    python benchmarks/qgz_roofline.py --case GPU NODESxGPUS BITS GROUP --case-out FILE   # one case's calls (JSON)

Needs Triton and torch (CPU is enough); runs Triton's compiler, so TRITON_INTERPRET must be unset.
"""

import argparse
import ast
import json
import math
import os
import sys
import time
from collections import Counter
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "package_tests"))  # unit.qgz_compile: the launches and Triton's compiler

GPUS = {
    "A100": dict(arch=80, sms=108, clock=1.41e9, hbm=2039e9),
    "H100": dict(arch=90, sms=132, clock=1.98e9, hbm=3350e9),
    "H200": dict(arch=90, sms=132, clock=1.98e9, hbm=4800e9),
    "L40S": dict(arch=89, sms=142, clock=2.52e9, hbm=864e9),
}
# The targets: each kernel's ceiling at least this share of HBM bandwidth.
TARGETS = {"A100": 80, "H100": 80, "H200": 70, "L40S": 60}
ISSUE_PER_CLOCK = 4 * 32  # thread instructions: 4 warp instructions per SM and clock
# Thread instructions per SM and clock, by class and architecture (see the module docstring; an
# fp16x2 instruction makes two of the table's results).
RATES = {
    "fp32": {
        80: 64,
        89: 128,
        90: 128
    },
    "fp16x2": {
        80: 128,
        89: 64,
        90: 128
    },
    "fp16 to fp32 (one result)": {
        80: 256,
        89: 128,
        90: 256
    },
    "fp64": {
        80: 32,
        89: 2,
        90: 64
    },
    "MUFU": {
        80: 16,
        89: 16,
        90: 16
    },
    "integer add": {
        80: 64,
        89: 64,
        90: 64
    },
    "integer multiply-add": {
        80: 64,
        89: 64,
        90: 64
    },
    "shift": {
        80: 64,
        89: 64,
        90: 64
    },
    "compare, min, max, select": {
        80: 64,
        89: 64,
        90: 64
    },
    "bitwise, byte permute": {
        80: 64,
        89: 64,
        90: 64
    },
    "bit field, warp reduce": {
        80: 16,
        89: 16,
        90: 16
    },
    "leading zeros, population count": {
        80: 16,
        89: 16,
        90: 16
    },
    "warp shuffle": {
        80: 32,
        89: 32,
        90: 32
    },
    "conversion to or from 64 bits": {
        80: 16,
        89: 2,
        90: 16
    },
    "other conversion": {
        80: 16,
        89: 16,
        90: 16
    },
    "shared memory (32-bit words)": {
        80: 32,
        89: 32,
        90: 32
    },
}
OPCODES = {
    "fp32": ("FADD", "FMUL", "FFMA", "FADD32I", "FMUL32I", "FFMA32I"),
    "fp16x2": ("HADD2", "HMUL2", "HFMA2", "HMNMX2"),
    "fp64": ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX"),
    "MUFU": ("MUFU", ),
    "integer add": ("IADD3", "IADD", "IADD32I", "VIADD", "LEA", "IABS"),
    "integer multiply-add": ("IMAD", "IMUL", "IMADSP"),
    "shift": ("SHF", "SHL", "SHR"),
    "compare, min, max, select":
    ("ISETP", "FSETP", "IMNMX", "VIMNMX", "VIMNMX3", "FMNMX", "SEL", "FSEL", "VIADDMNMX", "FCHK"),
    "bitwise, byte permute": ("LOP3", "LOP", "PRMT"),
    "bit field, warp reduce": ("BFE", "BFI", "BREV", "SGXT", "REDUX", "BMSK"),
    "leading zeros, population count": ("FLO", "POPC"),
    "warp shuffle": ("SHFL", ),
    "other conversion": ("F2F", "F2FP", "I2F", "F2I", "FRND", "I2FP", "F2IP", "I2I", "I2IP"),
    "shared memory (32-bit words)": ("LDS", "STS", "LDSM", "ATOMS"),
}
_CLASS_OF = {opcode: cls for cls, opcodes in OPCODES.items() for opcode in opcodes}
SUMMARY_CLASSES = ("fp32", "integer", "compare, min, max, select", "bitwise, byte permute", "conversion",
                   "shared memory (32-bit words)", "fp64", "other")


def instruction_class(opcode: str):
    """The throughput class of a SASS opcode (with modifiers), None for issue-only instructions."""
    base, *modifiers = opcode.split(".")
    if base in ("HADD2", "HFMA2", "HMUL2") and "F32" in modifiers:
        return "fp16 to fp32 (one result)"
    if base in ("F2F", "I2F", "F2I") and any(m in ("F64", "S64", "U64") for m in modifiers):
        return "conversion to or from 64 bits"
    return _CLASS_OF.get(base)


def shared_words(opcode: str) -> int:
    """32-bit words per thread an LDS or STS moves (1 for 8-, 16- and 32-bit accesses)."""
    for width, words in ((".128", 4), (".64", 2)):
        if width in opcode:
            return words
    return 1


def shared_words_average(ins, weights) -> float:
    """The 32-bit words an LDS or STS of the program moves per thread, on average (1 if none)."""
    words = [(w, shared_words(i.opcode)) for i, w in zip(ins, weights)
             if instruction_class(i.opcode) and instruction_class(i.opcode).startswith("shared")]
    total = sum(w for w, _ in words)
    return sum(w * n for w, n in words) / total if total else 1.0


def summary_class(cls: str) -> str:
    if cls is None:
        return "other"
    if cls in ("integer add", "integer multiply-add", "shift"):
        return "integer"
    if "conversion" in cls:
        return "conversion"
    if cls.startswith("fp16"):
        return "fp32"
    return cls if cls in SUMMARY_CLASSES else "other"


# --------------------------------------------------------------------------------------------------
# loops: the kernel source's `# trips:` notes, the SASS loops' induction steps
# --------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def source_loops(path: str):
    """Every `for` of the kernel module: (first line, last line, the trips expression, the step
    expression of its range, None for a loop not to be unrolled), from the `# trips:` note on its
    header."""
    text = Path(path).read_text()
    lines = text.splitlines()
    loops = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.For):
            continue
        header = lines[node.lineno - 1:node.body[0].lineno - 1]
        above = lines[node.lineno - 2].strip()  # or a comment line of its own above it
        if above.startswith("# trips:"):
            header = [above] + header
        note = next((line.split("# trips:", 1)[1].strip() for line in header if "# trips:" in line), None)
        call = node.iter
        step = ast.unparse(call.args[2]) if isinstance(call, ast.Call) and len(call.args) > 2 else "1"
        # a loop Triton is told not to unroll runs once per source iteration: its step needs no
        # reading off the SASS, whose induction variable the compiler may count in bytes
        if isinstance(call, ast.Call) and any(k.arg == "loop_unroll_factor" and ast.unparse(k.value) == "1"
                                              for k in call.keywords):
            step = None
        loops.append((node.lineno, node.end_lineno, note, step))
    return loops


def _constant(register, before):
    """The immediate `register` was last set to by a move before the loop, or None."""
    for ins in reversed(before):
        parts = [p.strip() for p in ins.operands.split(",")]
        if parts and parts[0] == register:
            if ins.opcode.startswith(("MOV", "IMAD.MOV", "UMOV")) and parts[-1].lstrip("-").startswith("0x"):
                return int(parts[-1], 16)
            return None
    return None


def _induction_step(body, branch, before=()):
    """The immediate by which the loop's counter moves per iteration: the registers the compares
    writing the back edge's predicate read, and the add that steps one of them by a constant (an
    immediate, or a register a move before the loop set to one)."""
    predicates = {branch.predicate}
    if not branch.predicate:  # an unconditional back edge: the loop leaves by a branch out of its body
        first, last = body[0].address, body[-1].address
        predicates = {  # (ptxas may leave a loop by a call, CALL.REL.NOINC, to its exit)
            i.predicate
            for i in body if i.opcode.startswith(("BRA", "CALL")) and i.predicate and "`(" in i.operands
            and not first <= _LABELS.get(i.operands.split("`(")[-1].rstrip(")").strip(), first) <= last
        }
    compared = set()  # every register a compare writing the branch's predicate reads (a 64-bit
    for ins in body:  # counter is compared in two halves, .EX the second)
        if "SETP" in ins.opcode and ins.operands.split(",")[0].strip() in predicates:
            compared |= {
                r
                for r in (p.strip() for p in ins.operands.replace(".reuse", "").split(",")[1:])
                if r.startswith("R") or r.startswith("UR")
            }

    def registers(ins):
        return [p.strip() for p in ins.operands.replace(".reuse", "").split(",")]

    # one step back: a compared register computed in the loop from other registers (a lane's offset
    # plus a uniform counter, say) brings those in
    for ins in body:
        parts = registers(ins)
        if parts and parts[0] in set(compared) and not ins.opcode.startswith(("ISETP", "UISETP")):
            compared |= {p for p in parts[1:] if p.startswith(("R", "UR")) and p not in ("RZ", "URZ")}
    for ins in body:
        base = ins.opcode.split(".")[0]
        if base not in ("IADD3", "VIADD", "IADD", "IADD32I", "UIADD3"):
            continue
        parts = registers(ins)
        if not any(p in compared for p in parts[:3]):
            continue
        for part in parts[1:]:
            value = int(part, 16) if part.lstrip("-").startswith("0x") else _constant(part, before)
            if value is not None:
                return abs(value - (1 << 32) if value >= 1 << 31 else value)  # a 32-bit immediate, signed
    return None


def _exit_induction_step(body, before=()):
    """_induction_step for a loop with an unconditional back edge that it leaves by exiting the program
    (the loop ends the kernel: stage 2's steps over a group longer than a program): the predicate of
    the EXIT, followed through the PLOP3 that copies it from a uniform predicate, the compare writing
    that (its low half: a 64-bit counter's high half is compared by the .EX one), and the add of an
    immediate writing a register that compare reads."""
    predicates = {i.predicate for i in body if i.opcode.startswith("EXIT") and i.predicate}
    for ins in body:
        parts = [p.strip().lstrip("!") for p in ins.operands.split(",")]
        if ins.opcode.startswith(("PLOP3", "UPLOP3")) and parts[0] in predicates:
            predicates |= {
                p
                for p in parts[1:] if p[:1] == "P" and p[1:].isdigit() or p[:2] == "UP" and p[2:].isdigit()
            }
    compared = set()
    for ins in body:
        parts = [p.strip() for p in ins.operands.replace(".reuse", "").split(",")]
        if "SETP" in ins.opcode and ".EX" not in ins.opcode and parts[0] in predicates:
            compared |= {r for r in parts[1:] if r.startswith(("R", "UR")) and r not in ("RZ", "URZ")}
    for ins in body:
        parts = [p.strip() for p in ins.operands.replace(".reuse", "").split(",")]
        if ins.opcode.split(".")[0] in ("IADD3", "VIADD", "IADD", "IADD32I", "UIADD3") and parts[0] in compared:
            for part in parts[1:]:
                value = int(part, 16) if part.lstrip("-").startswith("0x") else _constant(part, before)
                if value is not None:
                    return abs(value - (1 << 32) if value >= 1 << 31 else value)
    return None


_LABELS = {}  # the labels of the disassembly loop_weights reads


def loop_weights(dis, path, arguments):
    """Per instruction of `dis` (a qgz_compile.Disassembly), how many times a program runs it."""
    _LABELS.clear()
    _LABELS.update(dis.labels)
    ins = [i for i in dis.instructions if i.address < dis.subroutines_from]
    by_address = {i.address: k for k, i in enumerate(ins)}
    loops = []  # (first index, last index, source loop, step)
    for k, branch in enumerate(ins):
        if not branch.opcode.startswith("BRA"):
            continue
        target = branch.operands.split("`(")[-1].rstrip(")").strip() if "`(" in branch.operands else None
        if target not in dis.labels or dis.labels[target] >= branch.address:
            continue  # forward, or the branch to itself that ends the code
        first = by_address[dis.labels[target]]
        # the source loop: the `for` holding the most of the body's instructions (any of their lines,
        # inlined or calling), the innermost of those on a tie (the branch itself may carry only the
        # line that called the function holding the loop)
        holds = {
            loop: sum(any(loop[0] <= line <= loop[1] for line in i.lines) for i in ins[first:k + 1])
            for loop in source_loops(path)
        }
        source = max(holds, key=lambda loop: (holds[loop], loop[0] - loop[1])) if holds else None
        if source is None or not holds[source] or source[2] is None:
            raise ValueError(f"SASS loop at {branch.address:#x} (lines {branch.lines}) maps to no `for` with a "
                             "`# trips:` note")
        if source[3] is None:
            loops.append((first, k, source, 1))
            continue
        step = _induction_step(ins[first:k + 1], branch, ins[:first])
        if step is None:
            step = _exit_induction_step(ins[first:k + 1], ins[:first])
        if step is None:
            shown = [
                f"{i.address:#x} {i.opcode} {i.operands}" for i in ins[first:k + 1]
                if "SETP" in i.opcode or "ADD" in i.opcode
            ]
            raise ValueError(f"SASS loop {ins[first].address:#x}..{branch.address:#x} (@{branch.predicate}): its "
                             "induction step was not found among\n  " + "\n  ".join(shown))
        namespace = dict(arguments)
        unroll = step / eval(source[3], {}, namespace)  # noqa: S307 - the kernel source's own expressions
        loops.append((first, k, source, max(1.0, round(unroll))))
    trips_of = {}
    for source in {loop[2] for loop in loops}:
        trips_of[source] = float(eval(source[2], {"max": max, "min": min}, dict(arguments)))  # noqa: S307
    weights = [1.0] * len(ins)
    for first, last, source, unroll in loops:
        trips = trips_of[source]
        mains = [l for l in loops if l[2] == source and l[3] > 1]
        if unroll > 1:
            weight = trips / unroll if trips < unroll else trips // unroll
        elif mains:
            main = mains[0][3]
            weight = trips - main * (trips // main) if trips >= main else 0.0
        else:
            weight = trips
        for k in range(first, last + 1):
            weights[k] *= weight
    return ins, weights


# --------------------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------------------

BUCKET = ((4096, 4096), ) * 4 + ((11008, 4096), ) * 2 + ((4096, 11008), )  # one LLaMA-2-7B layer's weights


def series_calls(group: int, topology, bits: int):
    """(values, steps): the steps of qgz_compile.exchange_calls (step, op, arguments of each call) for
    BUCKET in groups of `group` values, as one exchange: each tensor's partitions padded to whole
    groups."""
    from unit import qgz_compile
    num_nodes, local = topology
    world = num_nodes * local
    values = world * group * sum(-(-math.prod(shape) // (world * group)) for shape in BUCKET)
    return values, qgz_compile.exchange_calls(values, group, num_nodes, local, bits)


def launch_bytes(launch) -> float:
    """Bytes of global memory the launch reads and writes: every tensor argument once."""
    import torch
    return sum(a.numel() * a.element_size() for a in launch.args if isinstance(a, torch.Tensor))


def gpu_for(name: str, capability) -> str:
    """The modeled GPU for a device name and compute capability: by name, else by architecture
    (the first modeled GPU of that compute capability)."""
    for gpu in GPUS:
        if gpu in name.replace(" ", ""):
            return gpu
    arch = capability[0] * 10 + capability[1]
    return next((gpu for gpu, spec in GPUS.items() if spec["arch"] == arch), "H100")


def analyse(call: int, bits: int, group: int, topology, gpu: str):
    """One row: step number `call` of series_calls, the instruction mix of its calls per gradient
    value of the exchange and the ceilings on `gpu`."""
    from unit import qgz_compile
    values, steps = series_calls(group, topology, bits)
    name, op, calls = steps[call]
    spec = GPUS[gpu]
    bytes_per_clock = spec["hbm"] / (spec["sms"] * spec["clock"])
    mix, summary, issue, bytes_per_value, registers = Counter(), Counter(), 0.0, 0.0, 0
    memory_time = step_time = 0.0  # the calls run one after the other: each at the pace of what binds it
    for args in calls:
        # each call is its own launch: the 8-bit copies' variants differ by their pointers' alignment
        (launch, ) = qgz_compile.record_quantizer_launches([(op, args)])
        compiled = compiled_kernel(launch, spec["arch"])
        arguments = {k: v for k, v in qgz_compile.bound_arguments(launch).items() if not hasattr(v, "dtype")}
        ins, weights = loop_weights(qgz_compile.disassemble(compiled.asm["cubin"]),
                                    launch.kernel.fn.__code__.co_filename, arguments)
        threads = sys.modules[launch.kernel.fn.__module__].NUM_WARPS * 32
        per_value = threads * launch.grid[0] / values  # thread instructions per program instruction, per value
        call_mix, call_issue = Counter(), 0.0
        for instruction, weight in zip(ins, weights):
            if instruction.opcode.startswith("NOP"):
                continue
            call_issue += weight * per_value
            cls = instruction_class(instruction.opcode)
            if cls is not None:
                amount = weight * per_value * (shared_words(instruction.opcode) if cls.startswith("shared") else 1)
                call_mix[cls] += amount
        # the summary counts instructions: an LDS or STS once, whatever words it moves
        words = shared_words_average(ins, weights)
        counted = Counter()
        for cls, amount in call_mix.items():
            counted[summary_class(cls)] += amount / (words if cls.startswith("shared") else 1)
        counted["other"] += call_issue - sum(counted.values())
        summary.update(counted)
        mix.update(call_mix)
        issue += call_issue
        bytes_per_value += launch_bytes(launch) / values
        registers = max(registers, qgz_compile.resource_usage(compiled.asm["cubin"]).get("REG"))
        call_times = {cls: amount / RATES[cls][spec["arch"]] for cls, amount in call_mix.items()}
        call_memory_time = launch_bytes(launch) / values / bytes_per_clock
        memory_time += call_memory_time
        step_time += max([call_memory_time, call_issue / ISSUE_PER_CLOCK] + list(call_times.values()))
    times = {cls: amount / RATES[cls][spec["arch"]] for cls, amount in mix.items()}
    times["issue"] = issue / ISSUE_PER_CLOCK
    binding = max(times, key=times.get)
    ceiling = 100.0 * memory_time / step_time
    return {
        "call": name,
        "bits": bits,
        "group_elems": group,
        "topology": "x".join(str(n) for n in topology),
        "gpu": gpu,
        "instructions_per_value": issue,
        "mix": {
            cls: summary.get(cls, 0.0)
            for cls in SUMMARY_CLASSES
        },
        "bytes_per_value": bytes_per_value,
        "registers": registers,
        "ceiling_percent": ceiling,
        "bound_by": binding if ceiling < 100.0 else "memory",
        "binding_class": binding,
    }


_COMPILED = {}


def compiled_kernel(launch, arch):
    from unit import qgz_compile
    key = qgz_compile.variant_key(launch, arch)
    if key not in _COMPILED:
        _COMPILED[key] = qgz_compile.compile_launch(launch, arch)
    return _COMPILED[key]


def rows(quick: bool = False):
    topologies = [(2, 8)] if quick else [(2, 8), (3, 8)]
    # groups of 136 (the smallest), 4096 (the series' own for this layer) and 40960 (the largest:
    # longer than a program, in steps of 4096 values)
    cases = [(call, bits, group, topology) for bits in (4, 8) for group in (136, 4096, 40960)
             for topology in topologies for call in range(len(series_calls(group, topology, bits)[1]))]
    out = []
    start = time.time()
    for k, (call, bits, group, topology) in enumerate(cases):
        for gpu in GPUS:
            try:
                out.append(analyse(call, bits, group, topology, gpu))
            except Exception as exc:
                raise RuntimeError(f"call {call}, {bits}/4, groups of {group}, {topology}, {gpu}: {exc}") from exc
        if (k + 1) % 4 == 0 or k + 1 == len(cases):
            print(f"[{time.strftime('%H:%M:%S')}] roofline: {k + 1}/{len(cases)} cases ({time.time() - start:.0f} s)",
                  file=sys.stderr,
                  flush=True)
    return out


def table(results) -> str:
    head = ("| call | bits | groups of | topology | GPU | thread instructions / value | " +
            " | ".join(SUMMARY_CLASSES) + " | bytes / value | registers | ceiling, % of HBM | bound by |")
    lines = [head, "|" + "---|" * 5 + "---:|" * (len(SUMMARY_CLASSES) + 4) + "---|"]
    for r in results:
        lines.append(
            f"| {r['call']} | {r['bits']}/4 | {r['group_elems']} | {r['topology']} | {r['gpu']} | "
            f"{r['instructions_per_value']:.1f} | " + " | ".join(f"{r['mix'][c]:.1f}" for c in SUMMARY_CLASSES) +
            f" | {r['bytes_per_value']:.2f} | {r['registers']} | {r['ceiling_percent']:.0f} | {r['bound_by']} |")
    return "\n".join(lines)


def lowest_lines(results):
    lines = []
    for gpu in GPUS:
        worst = min((r for r in results if r["gpu"] == gpu), key=lambda r: r["ceiling_percent"])
        lines.append(f"lowest ceiling on {gpu}: {worst['ceiling_percent']:.0f}% ({worst['call']}, {worst['bits']}/4, "
                     f"groups of {worst['group_elems']}, {worst['topology']}, bound by {worst['bound_by']}); target "
                     f"{TARGETS[gpu]}%")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="directory for qgz_roofline.md and qgz_roofline.json")
    parser.add_argument("--quick", action="store_true", help="2x8 only")
    parser.add_argument("--case",
                        nargs=4,
                        metavar=("GPU", "TOPOLOGY", "BITS", "GROUP"),
                        help="only this case's calls (e.g. H200 3x2 8 136)")
    parser.add_argument("--case-out", help="with --case: the JSON file the rows go to")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: the roofline runs Triton's compiler", file=sys.stderr)
        return 2
    if args.case:
        gpu, topology, bits, group = args.case
        topology = tuple(int(n) for n in topology.split("x"))
        calls = range(len(series_calls(int(group), topology, int(bits))[1]))
        rows_ = [analyse(call, int(bits), int(group), topology, gpu) for call in calls]
        Path(args.case_out).write_text(json.dumps(rows_))
        return 0
    results = rows(args.quick)
    text = table(results) + "\n\n" + "\n".join(lowest_lines(results))
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "qgz_roofline.md").write_text(text + "\n")
        (Path(args.out) / "qgz_roofline.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""python -m deepspeed_qgz {status,diff}"""

import argparse
import difflib
import importlib.util
import sys
import time
from pathlib import Path

from . import DISABLE_ENV, __version__
from ._finder import TREE, overlay_modules, overlay_state

# installed-package directory -> DeepSpeed source-tree directory, for reviewable diff paths
SOURCE_PATHS = (("deepspeed/ops/op_builder/", "op_builder/"), ("deepspeed/ops/csrc/", "csrc/"))


def _upstream_root():
    spec = importlib.util.find_spec("deepspeed")
    return Path(list(spec.submodule_search_locations)[0]).parent if spec else None


def _overlay_files():
    """(installed path relative to site-packages, overlay file) for every file the patch carries."""
    for path in sorted(p for p in TREE.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        yield path.relative_to(TREE).as_posix(), path


def _source_path(installed):
    for prefix, source in SOURCE_PATHS:
        if installed.startswith(prefix):
            return source + installed[len(prefix):]
    return installed


def status(_args):
    import torch
    active, reason = overlay_state()
    root = _upstream_root()
    print(f"deepspeed-qgz {__version__}")
    print(f"deepspeed     {_version('deepspeed')} ({root / 'deepspeed' if root else 'not installed'})")
    print(f"torch         {torch.__version__}")
    print(f"overlay       {'ACTIVE' if active else 'INACTIVE'}: {reason}  (switch off: {DISABLE_ENV}=0)")
    print("files:")
    for installed, _ in _overlay_files():
        kind = "replaces" if root and (root / installed).exists() else "adds"
        print(f"  {kind:8s} {_source_path(installed)}")
    if active:
        import deepspeed.runtime.zero.stage3 as stage3
        import deepspeed.runtime.comm.coalesced_collectives as collectives
        calls_overlay = stage3.all_to_all_quant_reduce is collectives.all_to_all_quant_reduce
        print(f"stage3.all_to_all_quant_reduce from {collectives.__file__ if calls_overlay else 'elsewhere (!)'}")
    print("cpu quantizer op: ", end="", flush=True)
    if not active:
        print("not available (overlay inactive)")
        return 0
    try:
        from deepspeed.ops.op_builder.cpu.quantizer import QuantizerBuilder
        start = time.perf_counter()
        QuantizerBuilder().load(verbose=False)
        print(f"builds and loads ({time.perf_counter() - start:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - status reports, never raises
        print(f"FAILED: {exc!r}")
        return 1
    return 0


def diff(_args):
    root = _upstream_root()
    if root is None:
        print("deepspeed is not installed", file=sys.stderr)
        return 1
    for installed, overlay in _overlay_files():
        source = _source_path(installed)
        upstream = root / installed
        old = upstream.read_text().splitlines(keepends=True) if upstream.exists() else []
        new = overlay.read_text().splitlines(keepends=True)
        sys.stdout.writelines(difflib.unified_diff(old, new, f"a/{source}" if old else "/dev/null", f"b/{source}"))
    return 0


def _version(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m deepspeed_qgz", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("status",
                        help="versions, overlay state, overlaid files, CPU op build").set_defaults(run=status)
    commands.add_parser("diff",
                        help="unified diff of every overlaid file against installed upstream").set_defaults(run=diff)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

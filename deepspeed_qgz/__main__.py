# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""python -m deepspeed_qgz {status,diff}"""

import argparse
import difflib
import importlib.util
import os
import sys
import time
from pathlib import Path

from . import DISABLE_ENV, QUANTIZER_ENV, __version__
from ._finder import TREE, overlay_state
from .releases import edits_state, grafted_definitions, summary, whole_series
from .replaced_modules import replace_module
from .upstream_edits import EditError, apply_edits, edited_paths


def _upstream_root():
    spec = importlib.util.find_spec("deepspeed")
    return Path(list(spec.submodule_search_locations)[0]).parent if spec else None


def _overlay_files():
    """(DeepSpeed path, the same in its source tree and under site-packages; overlay file) for every
    module the patch carries."""
    for path in sorted(p for p in TREE.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        yield path.relative_to(TREE).as_posix(), path


def status(_args):
    import torch
    active, reason = overlay_state()
    root = _upstream_root()
    print(f"deepspeed-qgz {__version__}")
    print(f"deepspeed     {_version('deepspeed')} ({root / 'deepspeed' if root else 'not installed'})")
    print(f"torch         {torch.__version__}")
    print(f"overlay       {'ACTIVE' if active else 'INACTIVE'}: {reason}  (switch off: {DISABLE_ENV}=0)")
    installed = _version("deepspeed")
    if active:
        print(f"series        {summary(installed)}")
    print("files:")
    whole, edited = active and whole_series(installed), active and edits_state(installed)[0]
    for path, _ in _overlay_files():
        kind = "adds" if not (root and (root / path).exists()) else "replaces" if whole or not active else "binds"
        print(f"  {kind:8s} {path}" +
              ("" if kind != "binds" else f": the series' {', '.join(grafted_definitions()[0])}, into this release's"))
    for path in edited_paths():
        print(f"  {'edits' if edited or not active else 'keeps':8s} {path}")
    import deepspeed.runtime.zero.stage3 as stage3
    import deepspeed.runtime.comm.coalesced_collectives as collectives
    patched = hasattr(collectives, "quant_reduce_exchange_values")  # a name the series adds
    print(f"coalesced_collectives {'patched' if patched else 'UPSTREAM'}: {collectives.__file__}")
    if stage3.all_to_all_quant_reduce is not collectives.all_to_all_quant_reduce:
        print("stage3.all_to_all_quant_reduce: NOT the module's function (!)")
    from deepspeed.accelerator import get_accelerator
    from ._finder import chosen_quantizer
    device = get_accelerator().device_name()
    try:
        chosen, _ = chosen_quantizer(device)
    except ValueError as exc:
        print(f"quantizer op  FAILED: {exc}")
        return 1
    print(f"quantizer op  {chosen} ({QUANTIZER_ENV}={os.environ.get(QUANTIZER_ENV, '')!r}, {device} accelerator): ",
          end="",
          flush=True)
    if not patched:
        print("not plugged in (the series' module is not installed)")
        return 0
    if chosen == "deepspeed":
        print("DeepSpeed's own")
        return 0
    if chosen == "triton":
        from . import triton_quantizer
        reason = triton_quantizer.unavailable_reason(device)
        print("runs here" if reason is None else f"does NOT run here: {reason}")
        return 0 if reason is None else 1
    from .cpu_quantizer import QuantizerBuilder
    builder = QuantizerBuilder()
    try:
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"{builder.name} builds and loads ({time.perf_counter() - start:.1f} s)")
    except Exception as exc:  # noqa: BLE001 - status reports, never raises
        print(f"FAILED: {exc!r}")
        return 1
    return 0


def _patch(root, deepspeed_tree=None):
    """(DeepSpeed source-tree path, upstream text or None, patched text) for every file the patch
    replaces or edits: against the installed DeepSpeed or, with `deepspeed_tree` (a DeepSpeed git
    checkout), against that tree's files, and then also its documentation and test module, which
    only its tree has. A replaced module keeps the tree's definitions the patch does not replace
    (replaced_modules.py).

    Raises:
        EditError: the upstream files are not what the edits and replacements were written for.
    """

    def upstream(path, edited=False):
        file = deepspeed_tree / path if deepspeed_tree is not None else root / path
        if edited and not file.exists():
            raise EditError(f"deepspeed-qgz: {file}, which the patch edits, does not exist")
        return file.read_text() if file.exists() else None

    for path, overlay in _overlay_files():
        ours = overlay.read_text()
        text = upstream(path)
        yield path, text, ours if text is None else replace_module(path, text, ours)
    for path in edited_paths():
        text = upstream(path, edited=True)
        yield path, text, apply_edits(path, text)
    if deepspeed_tree is not None:  # DeepSpeed's docs and test modules, which only its tree has
        for path in edited_paths(in_package=False):
            text = upstream(path, edited=True)
            yield path, text, apply_edits(path, text)


def diff(args):
    root = _upstream_root()
    if root is None:
        print("deepspeed is not installed", file=sys.stderr)
        return 1
    tree = Path(args.deepspeed_tree) if args.deepspeed_tree else None
    if tree is not None and not (tree / "tests" / "unit" / "common.py").exists():
        print(f"{tree} is not a DeepSpeed git checkout (no tests/unit/common.py)", file=sys.stderr)
        return 1
    if tree is None:
        print(
            "deepspeed_qgz diff: without --deepspeed-tree, the hunks of the documentation and the tests "
            "(which only DeepSpeed's git tree has) are left out",
            file=sys.stderr)
    try:
        hunks = list(_patch(root, tree))
    except EditError as error:
        print(error, file=sys.stderr)
        return 1
    for path, old, new in hunks:
        old_lines = old.splitlines(keepends=True) if old is not None else []
        sys.stdout.writelines(
            difflib.unified_diff(old_lines, new.splitlines(keepends=True),
                                 f"a/{path}" if old is not None else "/dev/null", f"b/{path}"))
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
    diff_parser = commands.add_parser("diff",
                                      help="the patch against the installed upstream (or --deepspeed-tree), as a "
                                      "unified diff at DeepSpeed's source-tree paths (git apply-able)")
    diff_parser.add_argument("--deepspeed-tree",
                             metavar="PATH",
                             help="a DeepSpeed git checkout: the hunks against its files, and also those of its "
                             "documentation and tests")
    diff_parser.set_defaults(run=diff)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

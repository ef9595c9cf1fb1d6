# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What of the pull-request series a DeepSpeed release gets, decided once per process from the
series and the release's own files, and stated at start-up (``summary``).

* qgZ's collective, on every release from OLDEST_DEEPSPEED to SERIES_DEEPSPEED: stage 3 of each imports
  ``all_to_all_quant_reduce`` by name and calls it as ``(tensors, groups)``. On SERIES_DEEPSPEED, whose
  module the series' was made from, the series' module is imported whole. On an older release its own
  module is imported, and the definitions the series adds or changes in that module (``graft``) are
  compiled from the series' file and bound into it: everything else stays the release's (LoCo's
  collective where the release has one, ``reduce_scatter_coalesced``). Their parameters that the
  release's stage 3 does not pass keep the series' defaults.
* The series' hunks to the release's other files (qwZ's fixes, the keys): on SERIES_DEEPSPEED every one
  must apply, and one that does not raises. On an older release they install only if every one applies
  (a key's config, stage 3 and engine hunks go together); otherwise those files stay the release's and
  the start-up line names the first hunk that does not apply.
"""

import ast
import builtins
import functools
import importlib.machinery
import re
import symtable
from pathlib import Path
from typing import Dict, List, Tuple

from . import OLDEST_DEEPSPEED, SERIES_DEEPSPEED
from .replaced_modules import COLLECTIVES, _bound, _source, _start
from .series import revert, series_edits
from .upstream_edits import EditError, apply_edits, edited_paths


class GraftError(EditError):
    pass


def release(version: str) -> Tuple[int, ...]:
    """A release's number as a tuple ("0.17.6+cu121" -> (0, 17, 6)); () for a version that names none,
    which is outside every range."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(part) for part in match.groups()) if match else ()


def supported(version: str) -> bool:
    return release(OLDEST_DEEPSPEED) <= release(version) <= release(SERIES_DEEPSPEED)


def whole_series(version: str) -> bool:
    """Whether `version` is the release the series' module and hunks were made against."""
    return release(version) == release(SERIES_DEEPSPEED)


def series_module_file() -> Path:
    from ._finder import overlay_modules
    return overlay_modules()[COLLECTIVES[:-3].replace("/", ".")]


def _statements(tree: ast.Module) -> Dict[str, ast.stmt]:
    return {name: node for node in tree.body for name in _bound(node)}


@functools.lru_cache(maxsize=None)
def grafted_definitions() -> Tuple[Tuple[str, ...], Dict[str, str]]:
    """(the top-level names the series adds or changes in coalesced_collectives.py, other than
    imports; {name=default} of their functions' parameters), read from the series' module against the
    module the series was made against (its own hunks taken back out)."""
    text = series_module_file().read_text()
    ours, base = ast.parse(text), _statements(ast.parse(revert(COLLECTIVES, text)))
    names, defaults = [], {}
    for node in ours.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for name in _bound(node):
            if name not in base or ast.dump(base[name]) != ast.dump(node):
                names.append(name)
        if isinstance(node, ast.FunctionDef) and node.name in names:
            args = node.args.args[len(node.args.args) - len(node.args.defaults):]
            defaults.update({arg.arg: ast.unparse(value) for arg, value in zip(args, node.args.defaults)})
    return tuple(names), defaults


def _globals_read(table: symtable.SymbolTable) -> set:
    names = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_global()}
    for child in table.get_children():
        names |= _globals_read(child)
    return names


def graft(module) -> List[str]:
    """Binds into `module` (a release's coalesced_collectives) the series' definitions of
    ``grafted_definitions``, compiled from the series' file (its line numbers kept), and those of the
    series' top-level statements (imports included) that bind a name they read and the release's
    module lacks. Returns the names bound.

    Raises:
        GraftError: a name they read is bound neither by the release's module nor by the series'.
    """
    path = series_module_file()
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    statements = _statements(ast.parse(text))
    wanted = {statements[name] for name in grafted_definitions()[0]}
    while True:
        source = "".join(_source(lines, node) for node in sorted(wanted, key=lambda node: node.lineno))
        needed = _globals_read(symtable.symtable(source, str(path), "exec")) - set(vars(module)) - set(
            dir(builtins)) - {name
                              for node in wanted
                              for name in _bound(node)}
        unknown = needed - set(statements)
        if unknown:
            raise GraftError(f"deepspeed-qgz: the series' {', '.join(grafted_definitions()[0])} read "
                             f"{', '.join(sorted(unknown))}, which neither {module.__file__} nor {path} binds")
        if not needed:
            break
        wanted |= {statements[name] for name in needed}
    # compiled from the series' text, every other line blank: the line numbers are the series' file's
    kept = {line for node in wanted for line in range(_start(node), node.end_lineno + 1)}
    source = "".join(line if number in kept else "\n" for number, line in enumerate(lines, 1))
    exec(compile(source, str(path), "exec", dont_inherit=True), vars(module))  # noqa: S102
    return sorted(name for node in wanted for name in _bound(node))


def _release_root():
    spec = importlib.machinery.PathFinder.find_spec("deepspeed")
    return Path(list(spec.submodule_search_locations)[0]).parent


@functools.lru_cache(maxsize=None)
def edits_state(version: str) -> Tuple[bool, str]:
    """(whether the series' hunks to the release's other files install, why not)."""
    if whole_series(version):
        return True, ""
    root = _release_root()
    try:
        for path in edited_paths():
            apply_edits(path, (root / path).read_text())
    except EditError as error:
        return False, str(error).replace("deepspeed-qgz: ", "")
    return True, ""


def _numbers(patches) -> str:
    return ", ".join(sorted({patch.split("-", 1)[0] for patch in patches}))


def summary(version: str) -> str:
    """What of the series is active on `version` and what not, and why: rank 0's start-up line and
    ``python -m deepspeed_qgz status``."""
    collective = {patch for patch, _, _ in series_edits(COLLECTIVES)}
    rest = {patch for path in edited_paths() for patch, _, _ in series_edits(path)}
    if whole_series(version):
        return f"{version}: every pull request of the series active ({_numbers(collective | rest)})"
    active, why = edits_state(version)
    names, defaults = grafted_definitions()
    line = (f"{version}: qgZ fix active ({_numbers(collective)}: the series' {', '.join(names)} in this "
            f"release's coalesced_collectives")
    if active:
        return line + f"); {_numbers(rest)} active (their hunks apply to this release's files)"
    return (line + f", at {', '.join(f'{k}={v}' for k, v in defaults.items())} as this release's stage 3 calls it); "
            f"qwZ fixes and the keys not available on this release ({_numbers(rest)}: {why})")

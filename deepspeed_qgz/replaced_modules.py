# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The modules of DeepSpeed's that the patch replaces, made against a given DeepSpeed tree.

The patch's module owns the top-level names it defines. Against a tree, ``replace_module``:

* refuses, naming the definition and the tree's digest, where the tree's version of a name the
  patch replaces is none of the versions the replacement was written from (``KNOWN``): upstream
  changed code the patch would drop, and that change has to be read and carried into the patch
  before it is made against that tree (silently dropping it is the worst outcome);
* keeps, verbatim and after the same neighbour, every top-level definition of the tree's module
  that the patch's module does not have (DeepSpeed's trees from before LoCo's removal, PR #8534,
  keep ``all_to_all_loco_quant_reduce``, which their stage 3 imports), with the imports those need
  added to the patch's import block.

A digest is of a definition's text (its decorators to its last line, trailing blanks stripped), so
it does not depend on the Python that runs ``diff``; a comment changed upstream counts as a change.
"""

import ast
import hashlib
from typing import Dict, List, Set

from .upstream_edits import EditError

COLLECTIVES = "deepspeed/runtime/comm/coalesced_collectives.py"

# DeepSpeed's versions of the definitions the patch replaces: path -> name -> digest -> where seen.
KNOWN: Dict[str, Dict[str, Dict[str, str]]] = {
    COLLECTIVES: {
        "_torch_reduce_scatter_fn": {
            "9348a661fcb8": "0.19.8, edaa722, 17b3b557"
        },
        "quantizer_module": {
            "e5124bdad409": "0.19.8, edaa722, 17b3b557"
        },
        "all_to_all_quant_reduce": {
            "23b3a10bd5f6": "0.19.8, edaa722",
            "1e4e87febf9c": "17b3b557 (divides by every rank, after PR #8534)",
        },
        "reduce_scatter_coalesced": {
            "d49fb6b733d0": "0.19.8, edaa722, 17b3b557"
        },
    },
}


class ReplacementError(EditError):
    pass


def _start(node: ast.stmt) -> int:
    return min([node.lineno] + [decorator.lineno for decorator in getattr(node, "decorator_list", [])])


def _source(lines: List[str], node: ast.stmt) -> str:
    return "".join(lines[_start(node) - 1:node.end_lineno])


def digest(text: str) -> str:
    """The digest of a definition's text, as KNOWN records it."""
    normalized = "\n".join(line.rstrip() for line in text.strip("\n").splitlines())
    return hashlib.sha256(normalized.encode()).hexdigest()[:12]


def _bound(node: ast.stmt) -> List[str]:
    """The module-level names a top-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(alias.asname or alias.name).split(".")[0] for alias in node.names]
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return [name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
    return []


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _used(node: ast.stmt) -> Set[str]:
    """The names a definition reads or declares global."""
    names = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Global):
            names.update(child.names)
    return names


def _add_imports(text: str, imports: List[ast.stmt], lines_of_tree: List[str], needed: Set[str]) -> str:
    """`text` (the patch's module) with the names of `needed` that the tree's `imports` bind
    imported too: into the patch's `from M import ...` line of the same module, or as the tree's
    statement after the patch's last import."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    ours = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    appended = []
    for node in imports:
        names = [alias for alias in node.names if (alias.asname or alias.name).split(".")[0] in needed]
        if not names:
            continue
        same = [
            mine for mine in ours if isinstance(node, ast.ImportFrom) and isinstance(mine, ast.ImportFrom)
            and mine.module == node.module and mine.level == node.level and mine.lineno == mine.end_lineno
        ]
        if same:
            line = same[0].lineno - 1
            aliases = {ast.unparse(alias) for alias in same[0].names + names}
            lines[line] = f"from {'.' * node.level}{node.module or ''} import {', '.join(sorted(aliases))}\n"
        elif len(names) == len(node.names):
            appended.append(_source(lines_of_tree, node))
        else:
            module = f"{'.' * node.level}{node.module or ''}"
            appended.append(f"from {module} import {', '.join(ast.unparse(alias) for alias in names)}\n" if isinstance(
                node, ast.ImportFrom) else f"import {', '.join(map(ast.unparse, names))}\n")
    if appended:
        last = ours[-1].end_lineno if ours else 0
        lines[last:last] = appended
    return "".join(lines)


def replace_module(path: str, upstream: str, ours: str) -> str:
    """The patch's module `ours` in place of the tree's `upstream` at `path`: checked against
    KNOWN, with the tree's definitions that `ours` lacks kept (see the module's docstring).

    Raises:
        ReplacementError: a replaced definition is not a known version, or a statement of the tree's
            module is one the patch can neither replace nor keep.
    """
    up_tree, our_tree = ast.parse(upstream), ast.parse(ours)
    up_lines = upstream.splitlines(keepends=True)
    ours_bind = {name for node in our_tree.body for name in _bound(node)}
    known = KNOWN.get(path, {})
    kept = []  # (the patch's definition it follows or None, the tree's statement)
    anchor = None
    for node in up_tree.body:
        names = _bound(node)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (node is up_tree.body[0] and _is_docstring(node)):
            continue
        if not names:
            raise ReplacementError(f"deepspeed-qgz: {path}: line {node.lineno} of this tree's module binds no name "
                                   "the patch knows how to replace or keep")
        if set(names) <= ours_bind:
            for name in names:
                found = digest(_source(up_lines, node))
                if found not in known.get(name, {}):
                    versions = ", ".join(f"{d} ({where})" for d, where in known.get(name, {}).items()) or "none"
                    raise ReplacementError(
                        f"deepspeed-qgz: {path}: this tree's {name} (line {_start(node)}, digest {found}) is none of "
                        f"the versions the patch replaces (known: {versions}); read what changed upstream and "
                        "carry it into the patch before making it against this tree")
            anchor = names[-1]
        elif set(names) & ours_bind:
            raise ReplacementError(f"deepspeed-qgz: {path}: line {_start(node)} binds {sorted(names)}, of which the "
                                   f"patch's module defines only {sorted(set(names) & ours_bind)}")
        else:
            kept.append((anchor, node))
    if not kept:
        return ours
    # every name the tree binds that the patch's module does not is kept, so what a kept definition
    # may lack is an import
    imports = [node for node in up_tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    imported = {name for node in imports for name in _bound(node)}
    needed = {name for _, node in kept for name in _used(node) & imported} - ours_bind
    text = _add_imports(ours, imports, up_lines, needed)
    # each kept definition after the patch's definition of the name it followed in the tree
    our_tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    ends = {name: node.end_lineno for node in our_tree.body for name in _bound(node)}
    last_import = max([node.end_lineno for node in our_tree.body if isinstance(node, (ast.Import, ast.ImportFrom))],
                      default=0)
    insertions: Dict[int, List[str]] = {}
    for after, node in kept:
        insertions.setdefault(ends[after] if after else last_import, []).append("\n\n" + _source(up_lines, node))
    for line in sorted(insertions, reverse=True):
        lines[line:line] = insertions[line]
    return "".join(lines)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The pull-request series (``upstream/*.patch``) as the overlay's edits. Each hunk of a patch that
changes a file the overlay edits is an exact text (its context and removed lines) and what it becomes
(its context and added lines), applied in the series' order: what users install today is what the
series asks DeepSpeed to take, from the same patch files."""

from functools import lru_cache
from pathlib import Path
from typing import List, Tuple

_HERE = Path(__file__).resolve().parent


def series_dir() -> Path:
    """The patches as an installed package ships them (setup.py), or in a source checkout."""
    packaged = _HERE / "series"
    return packaged if packaged.is_dir() else _HERE.parent / "upstream"


def hunks(patch_text: str, path: str) -> List[Tuple[str, str]]:
    """(old, new) for each hunk of `patch_text` (a git format-patch file) that changes `path`: its
    context and removed lines, and its context and added lines, as many as its header counts."""
    found, in_path, old_left, new_left, old, new = [], False, 0, 0, [], []
    for line in patch_text.splitlines(keepends=True):
        if old_left or new_left:
            tag, text = line[:1], line[1:]
            if tag in " -":
                old.append(text)
                old_left -= 1
            if tag in " +":
                new.append(text)
                new_left -= 1
            if not (old_left or new_left) and in_path:
                found.append(("".join(old), "".join(new)))
        elif line.startswith("diff --git "):
            in_path = line.split()[2] == f"a/{path}"
        elif line.startswith("@@ "):
            # @@ -start[,count] +start[,count] @@: a count left out is 1
            old_range, new_range = line.split()[1:3]
            old_left, new_left = (int((r.split(",") + ["1"])[1]) for r in (old_range, new_range))
            old, new = [], []
    return found


@lru_cache(maxsize=None)
def series_edits(path: str) -> Tuple[Tuple[str, str, str], ...]:
    """(patch file name, old, new) for every hunk of the series that changes `path`, in order."""
    return tuple((patch.name, old, new) for patch in sorted(series_dir().glob("*.patch"))
                 for old, new in hunks(patch.read_text(), path))

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The pull-request series (``upstream/*.patch``) as the overlay's edits. Each hunk of a patch that
changes a file the overlay edits is an exact text (its context and removed lines) and what it becomes
(its context and added lines), applied in the series' order: what users install today is what the
series asks DeepSpeed to take, from the same patch files."""

from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Tuple

_HERE = Path(__file__).resolve().parent


def series_dir() -> Path:
    """The patches as an installed package ships them (setup.py), or in a source checkout."""
    packaged = _HERE / "series"
    return packaged if packaged.is_dir() else _HERE.parent / "upstream"


def file_diffs(patch_text: str) -> Dict[str, List[List[str]]]:
    """{path: [hunk, ...]} of a git format-patch file, each hunk its body lines, tagged ' ', '-' or '+'
    and without their line ends, as many as its header counts."""
    diffs, hunk, old_left, new_left = {}, None, 0, 0
    for line in patch_text.splitlines():
        if old_left or new_left:
            line = line or " "  # an empty context line whose blank was stripped
            hunk.append(line)
            old_left -= line[0] in " -"
            new_left -= line[0] in " +"
        elif line.startswith("diff --git "):
            hunks_of_path = diffs.setdefault(line.split(" b/", 1)[1], [])
        elif line.startswith("@@ "):
            # @@ -start[,count] +start[,count] @@: a count left out is 1
            old_range, new_range = line.split()[1:3]
            old_left, new_left = (int((r.split(",") + ["1"])[1]) for r in (old_range, new_range))
            hunk = []
            hunks_of_path.append(hunk)
    return diffs


def hunks(patch_text: str, path: str) -> List[Tuple[str, str]]:
    """(old, new) for each hunk of `patch_text` that changes `path`: its context and removed lines,
    and its context and added lines."""

    def text(hunk, tags):
        return "".join(line[1:] + "\n" for line in hunk if line[0] in tags)

    return [(text(hunk, " -"), text(hunk, " +")) for hunk in file_diffs(patch_text).get(path, [])]


@lru_cache(maxsize=None)
def series_edits(path: str) -> Tuple[Tuple[str, str, str], ...]:
    """(patch file name, old, new) for every hunk of the series that changes `path`, in order."""
    return tuple((patch.name, old, new) for patch in sorted(series_dir().glob("*.patch"))
                 for old, new in hunks(patch.read_text(), path))


def revert(path: str, text: str) -> str:
    """`text`, the series' result of `path`, with the series' hunks taken back out, last first: the file
    the series was made against.

    Raises:
        ValueError: a hunk's result does not occur exactly once in what is left of `text`.
    """
    for patch, old, new in reversed(series_edits(path)):
        if text.count(new) != 1:
            raise ValueError(f"a hunk of {patch} found {text.count(new)} times in {path}")
        text = text.replace(new, old)
    return text

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch's changes to files DeepSpeed already has and the patch does not replace: the
pull-request series' own hunks (SERIES_PATHS), each an exact piece of upstream text and what it
becomes. The overlay applies them to the installed DeepSpeed's source when it imports those modules;
``python -m deepspeed_qgz diff`` turns them into the whole patch's hunks. An edit whose text does
not occur exactly once raises, so a DeepSpeed release that moved the code fails loudly instead of
loading half a patch."""

from dataclasses import dataclass
from typing import Tuple

from .series import series_edits


@dataclass(frozen=True)
class Edit:
    path: str  # in DeepSpeed's source tree
    old: str  # found exactly once, and replaced
    new: str
    patch: str  # the series' file of the hunk

    @property
    def in_package(self) -> bool:
        """Whether the file ships in an installed deepspeed package (and so in the overlay);
        documentation and tests exist only in DeepSpeed's git tree."""
        return not self.path.startswith(TREE_ONLY)


# Paths of DeepSpeed's git tree that its installed package does not have.
TREE_ONLY = ("docs/", "tests/")


class EditError(RuntimeError):
    pass


# The files of DeepSpeed's that the series edits, in order, with the pull requests' own hunks: those
# an installed package has, where the release has the text the pull requests were made against (the
# overlay edits them at import), and DeepSpeed's docs and test modules (`diff --deepspeed-tree` edits
# them). The series' coalesced_collectives.py is made against master's, which 0.19.8's predates: the
# overlay carries the series' result of it whole, deepspeed/runtime/comm/coalesced_collectives.py,
# and of its test module, which the suite runs on the overlay. (The series' tests in test_zeropp.py,
# a module this repository does not hold, are in upstream/ only.)
SERIES_PATHS = ("deepspeed/runtime/zero/partition_parameters.py", "deepspeed/runtime/zero/config.py",
                "deepspeed/runtime/zero/stage3.py", "deepspeed/runtime/engine.py", "docs/_pages/config-json.md",
                "tests/unit/runtime/comm/test_coalesced_collectives.py")
EDITS: Tuple[Edit, ...] = tuple(
    Edit(path, old, new, patch) for path in SERIES_PATHS for patch, old, new in series_edits(path))


def edited_paths(in_package: bool = True) -> Tuple[str, ...]:
    """The DeepSpeed source-tree paths the patch edits: those in an installed package (what the
    overlay edits at import), or with in_package False those only DeepSpeed's git tree has."""
    return tuple(sorted({edit.path for edit in EDITS if edit.in_package == in_package}))


def apply_edits(path: str, text: str) -> str:
    """`text` (the upstream file at source-tree `path`) with the patch's edits applied.

    Raises:
        EditError: an edit's text does not occur exactly once.
    """
    for edit in EDITS:
        if edit.path != path:
            continue
        found = text.count(edit.old)
        if found != 1:
            raise EditError(f"deepspeed-qgz: expected 1 occurrence of {edit.old[:80]!r}... in {path}, found {found} "
                            f"(a hunk of {edit.patch}); this DeepSpeed release differs from the patched ones")
        text = text.replace(edit.old, edit.new)
    return text

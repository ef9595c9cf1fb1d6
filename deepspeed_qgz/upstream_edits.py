# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch's changes to files DeepSpeed already has and the patch does not replace: edits, each an
exact piece of upstream text and what it becomes, nearly all of them the pull-request series' own
hunks (SERIES_PATHS). The overlay applies them to the installed DeepSpeed's source when it imports
those modules; ``python -m deepspeed_qgz diff`` turns them into the whole patch's hunks. An edit
whose text is not found the expected number of times raises, so a DeepSpeed release that moved the
code fails loudly instead of loading half a patch."""

from dataclasses import dataclass
from typing import Tuple

from .series import series_edits


@dataclass(frozen=True)
class Edit:
    path: str  # in DeepSpeed's source tree
    old: str
    new: str
    count: int = 1  # occurrences of `old` expected (all are replaced)
    when: str = ""  # if set, the edit applies only to a file holding this text (some supported trees lack it)

    @property
    def in_package(self) -> bool:
        """Whether the file ships in an installed deepspeed package (and so in the overlay);
        documentation exists only in DeepSpeed's git tree."""
        return not self.path.startswith(TREE_ONLY)


# Paths of DeepSpeed's git tree that its installed package does not have.
TREE_ONLY = ("docs/", "tests/")


class EditError(RuntimeError):
    pass


EDITS: Tuple[Edit, ...] = (
    # The CPU accelerator's op registry hands out the CPU quantizer for "QuantizerBuilder", so that
    # deepspeed.ops.op_builder.QuantizerBuilder, create_op_builder, __compatible_ops__ and ds_report
    # all see it (they fall back to NotImplementedBuilder otherwise).
    Edit("op_builder/cpu/__init__.py", "from .pin_memory import PinMemoryBuilder\n",
         "from .pin_memory import PinMemoryBuilder\nfrom .quantizer import QuantizerBuilder\n"),
    Edit("accelerator/cpu_accelerator.py",
         "PinMemoryBuilder, NotImplementedBuilder",
         "PinMemoryBuilder, QuantizerBuilder, NotImplementedBuilder",
         count=2),
    Edit(
        "accelerator/cpu_accelerator.py", '        elif class_name == "PinMemoryBuilder":\n'
        '            return PinMemoryBuilder\n', '        elif class_name == "PinMemoryBuilder":\n'
        '            return PinMemoryBuilder\n'
        '        elif class_name == "QuantizerBuilder":\n'
        '            return QuantizerBuilder\n'),
)

# The files of DeepSpeed's that the series edits, in order, with the pull requests' own hunks: those
# an installed package has, where the release has the text the pull requests were made against (the
# overlay edits them at import), and DeepSpeed's docs and test modules (`diff --deepspeed-tree` edits
# them). The series' coalesced_collectives.py is made against master's, which 0.19.8's predates: the
# overlay carries the series' result of it whole, deepspeed/runtime/comm/coalesced_collectives.py,
# and of its test module, which the suite runs on the overlay. (The series' tests in test_zeropp.py,
# a module this repository does not hold, are in upstream/ only.)
QWZ_PATH = "deepspeed/runtime/zero/partition_parameters.py"
SERIES_PATHS = (QWZ_PATH, "deepspeed/runtime/zero/config.py", "deepspeed/runtime/zero/stage3.py",
                "deepspeed/runtime/engine.py", "docs/_pages/config-json.md",
                "tests/unit/runtime/comm/test_coalesced_collectives.py")
EDITS += tuple(Edit(path, old, new) for path in SERIES_PATHS for _, old, new in series_edits(path))


def edited_paths(in_package: bool = True) -> Tuple[str, ...]:
    """The DeepSpeed source-tree paths the patch edits: those in an installed package (what the
    overlay edits at import), or with in_package False those only DeepSpeed's git tree has."""
    return tuple(sorted({edit.path for edit in EDITS if edit.in_package == in_package}))


def apply_edits(path: str, text: str) -> str:
    """`text` (the upstream file at source-tree `path`) with the patch's edits applied; an edit
    with `when` only where `text` holds that text.

    Raises:
        EditError: an edit's text occurs a different number of times than expected.
    """
    for edit in EDITS:
        if edit.path != path or (edit.when and edit.when not in text):
            continue
        found = text.count(edit.old)
        if found != edit.count:
            raise EditError(f"deepspeed-qgz: expected {edit.count} occurrence(s) of {edit.old[:80]!r}... in {path}, "
                            f"found {found}; this DeepSpeed release differs from the patched ones")
        text = text.replace(edit.old, edit.new)
    return text

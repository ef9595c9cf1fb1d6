# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch's changes to files DeepSpeed already has and the patch does not replace: small edits,
each an exact piece of upstream text and what it becomes. The overlay applies them to the installed
DeepSpeed's source when it imports those modules; ``python -m deepspeed_qgz diff`` turns them into
the pull request's hunks. An edit whose text is not found the expected number of times raises,
so a DeepSpeed release that moved the code fails loudly instead of loading half a patch."""

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Edit:
    path: str  # in DeepSpeed's source tree
    old: str
    new: str
    count: int = 1  # occurrences of `old` expected (all are replaced)


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


def edited_paths() -> Tuple[str, ...]:
    return tuple(sorted({edit.path for edit in EDITS}))


def apply_edits(path: str, text: str) -> str:
    """`text` (the upstream file at source-tree `path`) with the patch's edits applied.

    Raises:
        EditError: an edit's text occurs a different number of times than expected.
    """
    for edit in EDITS:
        if edit.path != path:
            continue
        found = text.count(edit.old)
        if found != edit.count:
            raise EditError(f"deepspeed-qgz: expected {edit.count} occurrence(s) of {edit.old!r} in {path}, "
                            f"found {found}; this DeepSpeed release differs from the patched one")
        text = text.replace(edit.old, edit.new)
    return text

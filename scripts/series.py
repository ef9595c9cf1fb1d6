# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The pull-request series under upstream/, checked the way CI can check it without a DeepSpeed checkout.

  python scripts/series.py stand-in DIR      DIR: an unpacked DeepSpeed 0.19.8 source distribution,
                                             made into a stand-in for master (below)
  python scripts/series.py tests PATCH OUT   the tests PATCH adds, as a module OUT that runs beside
                                             the DistributedTest stand-in
  python scripts/series.py source PATCH OUT  PATCH without its hunks of tests/ (what applies to a
                                             source distribution, which ships no tests)

The series is made against DeepSpeed's master at MASTER. Its source differs from 0.19.8's in one
definition the series edits (coalesced_collectives.py's average), and the series' patches show
master's lines of it as their context and removed lines. `stand-in` puts those lines in place of
0.19.8's and accepts the result only if its git blob id is master's, so the stand-in's module is
master's file, byte for byte. DeepSpeed's test modules are not in the source distribution: `tests`
runs the classes a patch adds, with the imports their module has, and the module's own tests run
where a DeepSpeed checkout is at hand (docs/upstreaming.md)."""

import hashlib
import re
import sys
from pathlib import Path

MASTER = "17b3b557120923866d02a45dc0598d8688303e0a"
# git blob ids of master's files that the stand-in must reproduce
MASTER_BLOBS = {"deepspeed/runtime/comm/coalesced_collectives.py": "1b7153e73c6d26a7efe6dc8973876e16e5a7be9b"}

TEST_MODULE_HEADER = '''# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The test classes {patch} adds to {path}, with the names that module imports."""

import pytest
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced

from unit.common import DistributedTest
'''


def file_diffs(patch_text):
    """{path: [hunk, ...]} of a git patch, each hunk a list of its body lines (' ', '-', '+' prefixed)."""
    diffs, path, hunk = {}, None, None
    for line in patch_text.splitlines():
        if line.startswith("diff --git "):
            path, hunk = line.split(" b/", 1)[1], None
            diffs[path] = []
        elif path and line.startswith("@@ "):
            hunk = []
            diffs[path].append(hunk)
        elif line == "-- ":  # format-patch's signature
            hunk = None
        elif hunk is not None and line[:1] in (" ", "-", "+", ""):
            hunk.append(line if line else " ")
    return diffs


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _find(lines, block):
    return [i for i in range(len(lines) - len(block) + 1) if lines[i:i + len(block)] == block]


def stand_in(tree: Path, patches):
    for path, blob in MASTER_BLOBS.items():
        target = tree / path
        lines = target.read_text().splitlines()
        for patch in patches:
            for hunk in file_diffs(patch.read_text()).get(path, []):
                before = [line[1:] for line in hunk if line[0] in " -"]
                if _find(lines, before):
                    continue
                # master's lines of this hunk replace 0.19.8's between the hunk's first line and its
                # last three, which both have, once each
                tops = _find(lines, before[:1])
                bottoms = [i for i in _find(lines, before[-3:]) if tops and tops[0] < i]
                if len(tops) != 1 or not bottoms:
                    sys.exit(f"stand-in: {patch.name}: a hunk of {path} has no place in the source distribution")
                lines[tops[0]:bottoms[0] + 3] = before
        data = ("\n".join(lines) + "\n").encode()
        if blob_id(data) != blob:
            sys.exit(f"stand-in: {path} is not master's ({MASTER[:8]}): blob {blob_id(data)}, master's {blob}")
        target.write_bytes(data)
        print(f"stand-in: {path} is master's ({MASTER[:8]}, blob {blob[:12]})")


def tests(patch: Path, out: Path):
    added = {}
    for path, hunks in file_diffs(patch.read_text()).items():
        if re.match(r"tests/.*test_[^/]*\.py$", path):
            added[path] = "\n".join(line[1:] for hunk in hunks for line in hunk if line[0] == "+")
    if len(added) != 1:
        sys.exit(f"tests: {patch.name} adds tests to {sorted(added) or 'no file'}; one test module is supported")
    (path, body), = added.items()
    out.write_text(TEST_MODULE_HEADER.format(patch=patch.name, path=path) + body + "\n")


def source(patch: Path, out: Path):
    kept, keep = [], True
    for line in patch.read_text().splitlines(keepends=True):
        if line.startswith("diff --git "):
            keep = not line.split(" b/", 1)[1].startswith("tests/")
        if keep:
            kept.append(line)
    out.write_text("".join(kept))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "stand-in":
        stand_in(Path(args[0]), sorted((Path(__file__).resolve().parents[1] / "upstream").glob("*.patch")))
    elif command == "tests":
        tests(Path(args[0]), Path(args[1]))
    elif command == "source":
        source(Path(args[0]), Path(args[1]))
    else:
        sys.exit(__doc__)

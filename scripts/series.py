# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The pull-request series under upstream/, checked the way CI can check it without a DeepSpeed checkout.

  python scripts/series.py stand-in DIR      DIR: an unpacked DeepSpeed 0.19.8 source distribution,
                                             made into a stand-in for master (below)
  python scripts/series.py tests PATCH DIR   the tests PATCH and the patches before it add to each of
                                             PATCH's test modules (or change there), each as one module
                                             in DIR that runs beside the DistributedTest stand-in;
                                             prints their names, one a line
  python scripts/series.py own PATCH         the tests PATCH itself adds (its top-level test classes and
                                             functions), one MODULE::NAME a line, and each module where
                                             it adds none but changes others'
  python scripts/series.py source PATCH OUT  PATCH without its hunks of tests/ and docs/ (what applies
                                             to a source distribution, which ships neither)
  python scripts/series.py sizes             each patch's source and test lines, as its message,
                                             the README and docs/PULL_REQUEST.md state them; its
                                             message at most MESSAGE_LINES lines
  python scripts/series.py index DIR         each patch's index lines name the git blob and mode of
                                             the file it applies to: DIR's (the stand-in), master's
                                             (the files a source distribution does not ship) or the
                                             patch before it's
  python scripts/series.py applied PATCH DIR PATCH's source files in DIR, after it, are the blobs its
                                             index lines name

The series is made against DeepSpeed's master at MASTER. Master's coalesced_collectives.py differs
from 0.19.8's in one definition the series edits (the average), and the series' patches show
master's lines of it as their context and removed lines. `stand-in` puts those lines (the first
patch's that changes it: the later ones show the series') in place of 0.19.8's and accepts the
result only if its git blob id is master's, so the stand-in's module is
master's file, byte for byte. Its other files, partition_parameters.py among them, are
0.19.8's. DeepSpeed's test modules are not in the source distribution: `tests`
runs the tests the series adds to a module up to a patch (a later patch's tests may use an earlier
one's helpers), with the imports that module has, and the module's own tests run where a DeepSpeed
checkout is at hand (docs/upstreaming.md)."""

import hashlib
import re
import sys
from pathlib import Path

# the patches read as the overlay reads them (deepspeed_qgz/series.py, installed from this checkout:
# check_series.sh checks that it is)
from deepspeed_qgz.series import file_diffs

MASTER = "17b3b557120923866d02a45dc0598d8688303e0a"
# git blob ids of master's files that the stand-in must reproduce
MASTER_BLOBS = {"deepspeed/runtime/comm/coalesced_collectives.py": "1b7153e73c6d26a7efe6dc8973876e16e5a7be9b"}
# the modes of the series' files that DeepSpeed's git holds as executable (a source distribution keeps none)
MASTER_EXECUTABLE = ("deepspeed/runtime/engine.py", "deepspeed/runtime/zero/partition_parameters.py",
                     "docs/_pages/config-json.md")
# (git blob id, mode) of master's files that the series changes and a source distribution does not ship
MASTER_NOT_SHIPPED = {
    "tests/unit/runtime/comm/test_coalesced_collectives.py": ("160d79283d15c302bfa2596c7cecf86ea5040d14", "100644"),
    "tests/unit/runtime/zero/test_zeropp.py": ("b575102359865dc925ef8e8df03f9b7d71b01bc6", "100644"),
    "docs/_pages/config-json.md": ("df064c7d3ae93fc46d765a8505c103a08994da24", "100755"),
}

TEST_MODULE_HEADER = '''# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The tests the series adds to {path}, up to {patch}, with the names that module imports."""

'''
# the imports of each DeepSpeed test module the series adds tests to (less those its new tests do not
# need and CI does not have, such as test_zeropp.py's transformers)
TEST_MODULE_IMPORTS = {
    "tests/unit/runtime/comm/test_coalesced_collectives.py":
    '''import pytest
import torch
import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce, reduce_scatter_coalesced

from unit.common import DistributedTest
''',
    "tests/unit/runtime/zero/test_zeropp.py":
    '''import pytest
import deepspeed.comm as dist
import torch
import torch.nn as nn

from unit.common import DistributedTest

import deepspeed

from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
from deepspeed.runtime.zero.partition_parameters import CUDAQuantizer, Init, ZeroParamStatus
''',
}


def is_test(path: str) -> bool:
    """A patch's test files are those under tests/; the rest is its source, but for its documentation."""
    return path.startswith("tests/")


def is_docs(path: str) -> bool:
    """A patch's documentation (DeepSpeed's docs/, which a source distribution does not ship): neither."""
    return path.startswith("docs/")


def blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _find(lines, block):
    return [i for i in range(len(lines) - len(block) + 1) if lines[i:i + len(block)] == block]


def stand_in(tree: Path, patches):
    for path, blob in MASTER_BLOBS.items():
        target = tree / path
        lines = target.read_text().splitlines()
        # only the first patch that changes the file shows master's lines of it; later ones show the series'
        patch = next(patch for patch in patches if path in file_diffs(patch.read_text()))
        for hunk in file_diffs(patch.read_text())[path]:
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
    for path in MASTER_EXECUTABLE:
        if (tree / path).exists():
            (tree / path).chmod(0o755)


def _mode(path: Path) -> str:
    return "100755" if path.stat().st_mode & 0o100 else "100644"


def index_lines(patch: Path):
    """{path: (blob before, blob after, mode)} of a patch's index lines."""
    lines, path = {}, None
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[1]
        elif line.startswith("index ") and path:
            blobs, mode = line.split()[1:3]
            lines[path] = (*blobs.split(".."), mode)
            path = None
    return lines


def index(tree: Path, patches):
    """Each patch's blob before and mode, for every file it changes, are those of the file it applies to:
    the stand-in's, master's where a source distribution does not ship the file, or the patch before's."""
    state = {}
    for patch in patches:
        for path, (before, after, mode) in index_lines(patch).items():
            if path not in state:
                if (tree / path).exists():
                    state[path] = (blob_id((tree / path).read_bytes()), _mode(tree / path))
                elif path in MASTER_NOT_SHIPPED:
                    state[path] = MASTER_NOT_SHIPPED[path]
                else:
                    sys.exit(f"index: {patch.name} changes {path}, which is neither the stand-in's nor master's")
            blob, held_mode = state[path]
            if not blob.startswith(before) or mode != held_mode:
                sys.exit(f"index: {patch.name}: {path} is {before} {mode} in its index line, {blob[:12]} {held_mode} "
                         "in the tree it applies to")
            state[path] = (after, mode)
    print(f"index: every patch's index lines name the blobs and modes of the files it applies to "
          f"({len(state)} files)")


def applied(patch: Path, tree: Path):
    """The source files a patch changed in `tree` are the blobs its index lines name after it."""
    for path, (_, after, mode) in index_lines(patch).items():
        if is_test(path) or is_docs(path):
            continue
        blob = blob_id((tree / path).read_bytes())
        if not blob.startswith(after) or _mode(tree / path) != mode:
            sys.exit(
                f"applied: {patch.name}: {path} is {blob[:12]} {_mode(tree / path)}, its index line {after} {mode}")


def test_hunks(patch: Path):
    """{test module: its hunks} of a patch."""
    return {
        path: hunks
        for path, hunks in file_diffs(patch.read_text()).items() if re.match(r"tests/.*test_[^/]*\.py$", path)
    }


def module_name(path: str) -> str:
    """The name of the module that runs the series' tests of DeepSpeed's test module `path`."""
    return f"test_series_{Path(path).stem.removeprefix('test_')}.py"


def _placed(lines, hunk):
    """The hunk, less as few of its outer context lines as leave its lines before it once among `lines`
    (the context git shows may reach into master's own tests, which `lines` does not hold); the hunk
    itself where there are none such."""
    changed = [i for i, line in enumerate(hunk) if line[0] in "+-"]
    first, last = changed[0], changed[-1] + 1
    for trimmed in range(first + len(hunk) - last + 1):
        for lead in range(max(0, trimmed - (len(hunk) - last)), min(trimmed, first) + 1):
            part = hunk[lead:len(hunk) - (trimmed - lead)]
            before = [line[1:] for line in part if line[0] in " -"]
            if before and len(_find(lines, before)) == 1:
                return part
    return hunk


def tests(patch: Path, out_dir: Path):
    modules = test_hunks(patch)
    if not modules:
        sys.exit(f"tests: {patch.name} changes no test module")
    for path in modules:
        if path not in TEST_MODULE_IMPORTS:
            sys.exit(f"tests: {patch.name} adds tests to {path}, whose imports series.py does not know")
        _module_tests(patch, path, out_dir)


def _module_tests(patch: Path, path: str, out_dir: Path):
    series = sorted(patch.parent.glob("*.patch"))
    # The series' lines of the module, patch by patch: a hunk whose lines before it are among them (a
    # later patch changing an earlier one's test) is applied there; one that adds lines next to master's
    # own appends them as a block (git may show a block's blank lines before it or after it).
    lines = []
    for earlier in series[:series.index(patch) + 1]:
        for hunk in test_hunks(earlier).get(path, []):
            hunk = _placed(lines, hunk)
            before = [line[1:] for line in hunk if line[0] in " -"]
            after = [line[1:] for line in hunk if line[0] in " +"]
            places = _find(lines, before)
            if len(places) == 1:
                lines[places[0]:places[0] + len(before)] = after
            elif any(line[0] == "-" for line in hunk):
                sys.exit(f"tests: {earlier.name} changes lines of {path} that the series did not add")
            else:
                block = "\n".join(line[1:] for line in hunk if line[0] == "+").strip("\n").split("\n")
                lines += ["", ""] + block if lines else block
    header = TEST_MODULE_HEADER.format(patch=patch.name, path=path) + TEST_MODULE_IMPORTS[path]
    out = out_dir / module_name(path)
    out.write_text(header + "\n\n" + "\n".join(lines) + "\n")
    print(out.name)


def own(patch: Path):
    """The tests a patch adds, and each module where it adds none (it changes an earlier patch's)."""
    for path, hunks in test_hunks(patch).items():
        added = "\n".join(line[1:] for hunk in hunks for line in hunk if line[0] == "+")
        names = ["".join(name) for name in re.findall(r"^(?:class (Test\w+)|def (test_\w+))", added, re.MULTILINE)]
        for name in names or [None]:
            print(module_name(path) + (f"::{name}" if name else ""))


# a pull request's description is what a reviewer reads whole
MESSAGE_LINES = 40


def sizes(root: Path):
    """Each patch's size as its own message, the README's table and the cover letter's state it, and its
    message no longer than MESSAGE_LINES."""
    tables = {name: (root / name).read_text() for name in ("README.md", "docs/PULL_REQUEST.md")}
    for patch in sorted((root / "upstream").glob("*.patch")):
        text = patch.read_text()
        counts = {True: [0, 0], False: [0, 0]}  # is a test file: [added, removed]
        for path, hunks in file_diffs(text).items():
            for line in (line for hunk in hunks for line in hunk):
                if line[0] in "+-" and not is_docs(path):
                    counts[is_test(path)][line[0] == "-"] += 1
        source_lines, test_lines = (f"+{added} -{removed}" if removed else f"+{added}"
                                    for added, removed in (counts[False], counts[True]))
        stated = {"its message": f"Size: {source_lines} source lines, {test_lines} test lines." in text}
        message = text[text.index("Subject: "):text.index("\n---\n")].splitlines()
        if len(message) > MESSAGE_LINES:
            sys.exit(f"sizes: {patch.name}'s message has {len(message)} lines, more than {MESSAGE_LINES}")
        # a description says what changes and what was measured, not how it was reviewed
        if re.search(r"\breview", "\n".join(message), re.IGNORECASE):
            sys.exit(f"sizes: {patch.name}'s message speaks of a review")
        for name, text in tables.items():
            rows = [row for row in text.splitlines() if row.startswith(f"| [{patch.name[:4]}](")]
            stated[name] = len(rows) == 1 and f"| {source_lines} | {test_lines} |" in rows[0]
        wrong = [where for where, right in stated.items() if not right]
        if wrong:
            sys.exit(f"sizes: {patch.name} changes {source_lines} source and {test_lines} test lines; "
                     f"not so stated in {', '.join(wrong)}")
        print(f"sizes: {patch.name[:4]}: {source_lines} source lines, {test_lines} test lines, as stated")


def source(patch: Path, out: Path):
    kept, keep = [], True
    for line in patch.read_text().splitlines(keepends=True):
        if line.startswith("diff --git "):
            path = line.split(" b/", 1)[1]
            keep = not is_test(path) and not is_docs(path)
        if keep:
            kept.append(line)
    out.write_text("".join(kept))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "stand-in":
        stand_in(Path(args[0]), sorted((Path(__file__).resolve().parents[1] / "upstream").glob("*.patch")))
    elif command == "tests":
        tests(Path(args[0]).resolve(), Path(args[1]))
    elif command == "own":
        own(Path(args[0]))
    elif command == "sizes":
        sizes(Path(__file__).resolve().parents[1])
    elif command == "index":
        index(Path(args[0]), sorted((Path(__file__).resolve().parents[1] / "upstream").glob("*.patch")))
    elif command == "applied":
        applied(Path(args[0]), Path(args[1]))
    elif command == "source":
        source(Path(args[0]), Path(args[1]))
    else:
        sys.exit(__doc__)

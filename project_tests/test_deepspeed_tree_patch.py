# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`python -m deepspeed_qgz diff --deepspeed-tree` on small DeepSpeed trees written here, one with
DeepSpeed's LoCo test (trees before its removal, DeepSpeed PR #8534) and one without (after it):
the hunks of those trees' files apply to both with git apply, and the edit that makes the LoCo test skip on the CPU
quantizer is there only where that test is."""

import subprocess
import sys

import pytest

from qgz_harness import overlay_active

pytestmark = pytest.mark.skipif(not overlay_active(), reason="DeepSpeed is patched in-tree: no overlay installed")

TEST_MODULE = "tests/unit/runtime/comm/test_coalesced_collectives.py"
HEAD = '''# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
unit tests for coalesced collectives
"""

import torch
import pytest

from unit.common import DistributedTest


class TestReduceScatterCoalesced(DistributedTest):
    world_size = 2

    def test_single_input(self):
        pass
'''
LOCO = '''

class TestLocoQuantized(DistributedTest):
    world_size = 1

    def test_loco_quantized_reduction(self):
        from deepspeed.ops.op_builder import QuantizerBuilder
        quantizer_module = QuantizerBuilder().load()
        quantizer_module.loco_swizzle_quant
'''
DOCS = '''    "zero_quantized_gradients": [true|false],
|Boolean indicating whether to enable communication efficient quantized gradients of ZeRO++. | `False`   |
'''


def tree(path, with_loco):
    files = {
        "tests/unit/common.py": "class DistributedTest:\n    pass\n",
        TEST_MODULE: HEAD + (LOCO if with_loco else ""),
        "docs/_pages/config-json.md": DOCS,
        "requirements/requirements-dev.txt": "future\nimportlib-metadata>=4\n",
    }
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


@pytest.mark.parametrize("with_loco", [True, False], ids=["with the LoCo test", "without it"])
def test_the_patch_applies_to_the_tree(tmp_path, with_loco):
    root = tree(tmp_path / "DeepSpeed", with_loco)
    patch = subprocess.run([sys.executable, "-m", "deepspeed_qgz", "diff", "--deepspeed-tree",
                            str(root)],
                           capture_output=True,
                           text=True,
                           check=True).stdout
    (tmp_path / "qgz.patch").write_text(patch)
    # the hunks of what only DeepSpeed's tree has (the small tree has none of its package's files)
    subprocess.run([
        "git", "apply", "--whitespace=error-all", "--include=tests/*", "--include=docs/*", "--include=requirements/*",
        str(tmp_path / "qgz.patch")
    ],
                   cwd=root,
                   check=True)
    module = (root / TEST_MODULE).read_text()
    assert ("this accelerator's quantizer op has no LoCo kernels" in module) == with_loco
    assert "class TestQuantizedReduceScatter3Nodes2Ranks" in module  # the patch's own tests follow DeepSpeed's
    assert module.startswith(HEAD.split("import torch")[0])


def test_a_loco_test_whose_text_moved_fails_loudly():
    from deepspeed_qgz.upstream_edits import EditError, apply_edits
    moved = HEAD + LOCO.replace("        quantizer_module = QuantizerBuilder().load()\n", "        module = None\n")
    with pytest.raises(EditError, match="expected 1 occurrence"):
        apply_edits(TEST_MODULE, moved)
    assert apply_edits(TEST_MODULE, HEAD) == HEAD

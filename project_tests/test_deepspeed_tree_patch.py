# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`python -m deepspeed_qgz diff --deepspeed-tree` on small DeepSpeed trees written here: the files
the patch edits and replaces are the installed DeepSpeed 0.19.8's (after LoCo's removal, DeepSpeed PR
#8534), or those in the forms of the trees from before it (edaa722: LoCo's collective, its stage 3
call and its test). The whole patch applies to the first with git apply; the series' hunks of ZeRO's
config and stage 3 are made against 0.19.8's, so a tree from before #8534 is refused, naming the
file, as is a tree whose versions of the replaced definitions the patch was not written from."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from qgz_harness import overlay_active

pytestmark = pytest.mark.skipif(not overlay_active(), reason="DeepSpeed is patched in-tree: no overlay installed")

ROOT = Path(__file__).resolve().parents[1]
TEST_MODULE = "tests/unit/runtime/comm/test_coalesced_collectives.py"


def _master_test_module():
    """Master's test module of the collectives: this repository's, the series' result, with the
    series' hunks taken back out (scripts/check_series.sh checks it is master's, by its blob id)."""
    from deepspeed_qgz.series import revert
    return revert(TEST_MODULE, (ROOT / TEST_MODULE).read_text())


LOCO = '''

class TestLocoQuantized(DistributedTest):
    world_size = 1

    def test_loco_quantized_reduction(self):
        from deepspeed.ops.op_builder import QuantizerBuilder
        quantizer_module = QuantizerBuilder().load()
        quantizer_module.loco_swizzle_quant
'''


def _docs_page():
    """The lines of DeepSpeed's docs/_pages/config-json.md that the series' hunks change, with their context."""
    from deepspeed_qgz.series import series_edits
    return "\n".join(old for patch, old, _ in series_edits("docs/_pages/config-json.md") if patch.startswith("0011"))


COLLECTIVES = "deepspeed/runtime/comm/coalesced_collectives.py"
# A LoCo collective as the trees before PR #8534 have one beside all_to_all_quant_reduce: it uses
# typing's Any, the quantizer op global and reduce_scatter_coalesced (written for this test)
LOCO_COLLECTIVE = """

@torch.no_grad()
def all_to_all_loco_quant_reduce(params: List[Tensor], groups: {}, loco_param: Any = None) -> List[Tensor]:
    global quantizer_module
    return [reduce_scatter_coalesced([p.grad])[0] for p in params]
"""
# the pre-#8534 forms of the text the edits change (edaa722's)
BEFORE_8534 = {
    "deepspeed/runtime/zero/config.py":
    [("from typing import Optional\n", "from typing import Optional, Dict, Any\n"),
     ('    for efficient all_2_all_reduce comm\n    """\n\n', '    for efficient all_2_all_reduce comm\n    """\n'
      '    zeropp_loco_param: Optional[Dict[str, Any]] = None\n'
      '    """\n    LoCo\'s parameters\n    """\n\n')],
    "deepspeed/runtime/zero/stage3.py":
    [("            grad_partitions_for_rank = all_to_all_quant_reduce(full_grads_for_rank, self.all2all_process_group)\n",
      "            grad_partitions_for_rank = (all_to_all_loco_quant_reduce(params_to_reduce, self.all2all_process_group,\n"
      "                                                                     self.zeropp_loco_param)\n"
      "                                        if self.zeropp_loco_param is not None else all_to_all_quant_reduce(\n"
      "                                            full_grads_for_rank, self.all2all_process_group))\n")],
    COLLECTIVES: [("from typing import List\n", "from typing import List, Any\n"),
                  ("\n\n@instrument_w_nvtx\n@torch.no_grad()\ndef reduce_scatter_coalesced(",
                   LOCO_COLLECTIVE + "\n\n@instrument_w_nvtx\n@torch.no_grad()\ndef reduce_scatter_coalesced(")],
}


def installed(path):
    """The installed DeepSpeed's file at source-tree `path` (upstream's: the overlay changes none)."""
    from deepspeed_qgz.__main__ import _upstream_root
    return (_upstream_root() / path).read_text()


def tree(path, with_loco, changes=()):
    """A DeepSpeed tree with the installed DeepSpeed's files the patch edits and replaces, in the
    pre-#8534 forms `with_loco`, and each (path, old, new) of `changes` made."""
    from deepspeed_qgz.upstream_edits import edited_paths
    files = {name: installed(name) for name in edited_paths() + (COLLECTIVES, )}
    files.update({
        "tests/unit/common.py": "class DistributedTest:\n    pass\n",
        TEST_MODULE: _master_test_module() + (LOCO if with_loco else ""),
        "docs/_pages/config-json.md": _docs_page(),
    })
    for name, old, new in [(name, old, new) for name, forms in BEFORE_8534.items()
                           for old, new in forms] if with_loco else []:
        assert files[name].count(old) == 1, (name, old)
        files[name] = files[name].replace(old, new)
    for name, old, new in changes:
        assert files[name].count(old) == 1, (name, old)
        files[name] = files[name].replace(old, new)
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    return path


def diff(root):
    return subprocess.run([sys.executable, "-m", "deepspeed_qgz", "diff", "--deepspeed-tree",
                           str(root)],
                          capture_output=True,
                          text=True)


def test_the_patch_applies_to_the_tree(tmp_path):
    root = tree(tmp_path / "DeepSpeed", False)
    made = diff(root)
    assert made.returncode == 0, made.stderr
    (tmp_path / "qgz.patch").write_text(made.stdout)
    subprocess.run(["git", "apply", "--whitespace=error-all", str(tmp_path / "qgz.patch")], cwd=root, check=True)
    import deepspeed.runtime.comm.coalesced_collectives as ours
    # what the overlay imports in place of this release's module
    assert (root / COLLECTIVES).read_text() == open(ours.__file__).read()
    stage3 = (root / "deepspeed/runtime/zero/stage3.py").read_text()
    assert "max_group_size=self.zero_quantized_gradients_max_group_size)\n" in stage3
    assert "zero_quantized_gradients_intra_node_bits" in (root / "docs/_pages/config-json.md").read_text()


def test_a_tree_from_before_locos_removal_is_refused_naming_the_file(tmp_path):
    made = diff(tree(tmp_path / "DeepSpeed", True))
    assert made.returncode == 1 and made.stdout == ""
    assert "this DeepSpeed release differs from the patched ones" in made.stderr, made.stderr
    assert "deepspeed/runtime/zero/" in made.stderr, made.stderr


def test_the_patched_files_pass_deepspeeds_formatters(tmp_path):
    root = tree(tmp_path / "DeepSpeed", False)
    (tmp_path / "qgz.patch").write_text(diff(root).stdout)
    subprocess.run(["git", "apply", str(tmp_path / "qgz.patch")], cwd=root, check=True)
    from deepspeed_qgz.upstream_edits import edited_paths
    files = [str(root / path) for path in edited_paths() + (COLLECTIVES, )]
    for check in (["yapf", "--style", str(ROOT / ".style.yapf"),
                   "--diff"], ["flake8", "--config", str(ROOT / ".flake8")]):
        found = subprocess.run([sys.executable, "-m"] + check + files, capture_output=True, text=True)
        assert found.returncode == 0, found.stdout + found.stderr


def test_a_replaced_definition_changed_upstream_is_refused(tmp_path):
    changed = (COLLECTIVES, "    group: ProcessGroup = None,\n",
               "    group: ProcessGroup = None,\n    fp32_comm=False,\n")
    made = diff(tree(tmp_path / "DeepSpeed", False, [changed]))
    assert made.returncode == 1 and made.stdout == ""
    assert re.search(
        r"coalesced_collectives.py: this tree's reduce_scatter_coalesced \(line \d+, digest [0-9a-f]{12}\) is none "
        r"of the versions the patch replaces \(known: d49fb6b733d0 \(0.19.8, edaa722, 17b3b557\)\)", made.stderr), \
        made.stderr


def test_an_edit_found_twice_fails_loudly():
    from deepspeed_qgz.upstream_edits import EditError, apply_edits
    config = installed("deepspeed/runtime/zero/config.py")
    with pytest.raises(EditError, match="expected 1 occurrence"):
        apply_edits("deepspeed/runtime/zero/config.py", config + config)
    assert "zero_quantized_gradients_max_group_size" in apply_edits("deepspeed/runtime/zero/config.py", config)


def test_the_supported_release_has_npu_quantizer():
    """DeepSpeed 0.19.8 has NPUQuantizer, so the collective's tests with it run in CI (they skip on
    trees without it, edaa722)."""
    import importlib.util
    assert importlib.util.find_spec("deepspeed.ops.op_builder.npu.quantizer") is not None

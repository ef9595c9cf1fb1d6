# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The installed overlay, seen from fresh interpreters started outside the source tree."""

import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import deepspeed_qgz
from qgz_harness import SCRIPTS_DIR, free_port, overlay_active

pytestmark = pytest.mark.skipif(not overlay_active(), reason="DeepSpeed is patched in-tree: no overlay installed")

PROBE = ("import deepspeed.runtime.zero.stage3 as s3, deepspeed.runtime.comm.coalesced_collectives as cc; "
         "assert s3.all_to_all_quant_reduce is cc.all_to_all_quant_reduce; "
         "assert s3.reduce_scatter_coalesced is cc.reduce_scatter_coalesced; print(cc.__file__)")


def python(code_or_args, **env):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else code_or_args
    with tempfile.TemporaryDirectory() as cwd:
        result = subprocess.run([sys.executable, *args],
                                cwd=cwd,
                                env=dict(os.environ, **env),
                                capture_output=True,
                                text=True,
                                timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_stage3_calls_the_overlay():
    assert python(PROBE).strip().endswith("deepspeed_qgz/tree/deepspeed/runtime/comm/coalesced_collectives.py")


def test_switch_off_loads_upstream():
    path = python(PROBE, DS_QGZ_OVERLAY="0").strip().splitlines()[-1]
    assert "deepspeed_qgz" not in path and path.endswith("deepspeed/runtime/comm/coalesced_collectives.py")


def test_status_cli(cpu_quantizer):
    out = python(["-m", "deepspeed_qgz", "status"])
    assert "overlay       ACTIVE" in out
    assert "deepspeed     0.19.8" in out
    assert "replaces deepspeed/runtime/comm/coalesced_collectives.py" in out
    # nothing beside the series' files: the CPU op is this package's own
    assert not [line for line in out.splitlines() if line.strip().startswith("adds ")], out
    for path in ("deepspeed/runtime/zero/config.py", "deepspeed/runtime/zero/stage3.py", "deepspeed/runtime/engine.py",
                 "deepspeed/runtime/zero/partition_parameters.py"):
        assert f"edits    {path}" in out
    assert "coalesced_collectives patched: " in out and "deepspeed_qgz/tree" in out
    assert "NOT the module's function" not in out
    assert "quantizer op  cpu (DS_QGZ_QUANTIZER='', cpu accelerator): quantizer_cpu builds and loads" in out
    triton = python(["-m", "deepspeed_qgz", "status"], DS_QGZ_QUANTIZER="triton", TRITON_INTERPRET="1")
    assert "quantizer op  triton (DS_QGZ_QUANTIZER='triton', cpu accelerator): runs here" in triton
    off = python(["-m", "deepspeed_qgz", "status"], DS_QGZ_OVERLAY="0")
    assert "overlay       INACTIVE: switched off by DS_QGZ_OVERLAY=0" in off
    assert "quantizer op  cpu (DS_QGZ_QUANTIZER='', cpu accelerator): not plugged in" in off


def test_diff_cli_is_a_reviewable_patch():
    out = python(["-m", "deepspeed_qgz", "diff"])
    assert "--- a/deepspeed/runtime/comm/coalesced_collectives.py" in out
    assert "+++ b/deepspeed/runtime/comm/coalesced_collectives.py" in out
    assert "+def all_to_all_quant_reduce" in out or "def all_to_all_quant_reduce" in out
    # upstream's silent fallback is gone
    assert "-            logger.warning(" in out
    # edits to upstream files are hunks of those files, at source-tree paths: the series' keys
    assert "--- a/deepspeed/runtime/zero/config.py\n+++ b/deepspeed/runtime/zero/config.py" in out
    assert "+    zero_quantized_gradients_intra_node_bits: Literal[4, 8] = 4" in out
    headers = [line for line in out.splitlines() if line.startswith(("--- ", "+++ "))]
    assert not [h for h in headers if "/dev/null" in h or "op_builder" in h or "accelerator" in h], headers


def test_untested_deepspeed_release_keeps_upstream(monkeypatch):
    import warnings
    from deepspeed_qgz import _finder
    monkeypatch.setattr(_finder, "deepspeed_version", lambda: "0.14.3")
    monkeypatch.setattr(_finder.OverlayFinder, "warned", False)
    _finder.overlay_state.cache_clear()
    try:
        active, reason = _finder.overlay_state()
        assert not active and "0.14.3 is outside the supported releases 0.14.4 to 0.19.8" in reason
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _finder.OverlayFinder().find_spec("deepspeed.runtime.comm.coalesced_collectives") is None
        assert any("outside the supported releases" in str(w.message) for w in caught)
    finally:
        _finder.overlay_state.cache_clear()


def test_first_call_logs_overlay_version_once_on_rank_0():
    code = ("import logging, torch, deepspeed, deepspeed.comm as dist\n"
            "from deepspeed.utils import logger\n"
            "logger.setLevel(logging.INFO); [h.setLevel(logging.INFO) for h in logger.handlers]\n"
            "deepspeed.init_distributed(dist_backend='gloo')\n"
            f"import sys; sys.path.insert(0, {str(SCRIPTS_DIR)!r})\n"
            "from qgz_harness import release_deepspeed_shm; release_deepspeed_shm()\n"
            "from deepspeed.runtime.zero import stage3\n"
            "for _ in range(2): stage3.reduce_scatter_coalesced([torch.ones(4)])\n"
            "from deepspeed.ops.op_builder import OpBuilder\n"
            "print('loaded', sorted(name for name in OpBuilder._loaded_ops if name.startswith('quantizer')))\n")
    out = python(code, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    lines = [line for line in out.splitlines() if "qgZ overlay active" in line]
    expected = f"deepspeed-qgz {deepspeed_qgz.__version__} on deepspeed 0.19.8, quantizer op cpu"
    assert len(lines) == 1 and "[Rank 0]" in lines[0] and expected in lines[0]
    # naming the op in the log line does not load it: a reduce-scatter needs no quantizer
    assert "loaded []" in out.splitlines()


def test_an_edit_that_no_longer_matches_fails_loudly():
    from deepspeed_qgz.upstream_edits import EditError, apply_edits
    with pytest.raises(EditError, match="expected 1 occurrence .* in deepspeed/runtime/zero/stage3.py, found 0"):
        apply_edits("deepspeed/runtime/zero/stage3.py", "class DeepSpeedZeroOptimizer_Stage3: pass\n")


def _running_source(fn, name):
    """The text, read where its code says it was compiled from, of the function `name` that `fn` is or
    wraps (functools.wraps or a closure)."""
    import inspect
    found = [fn]
    while found:
        fn = found.pop()
        if fn.__code__.co_name == name:
            return inspect.getsource(fn)
        found += [getattr(fn, "__wrapped__", None)] + [cell.cell_contents for cell in fn.__closure__ or ()]
        found = [f for f in found if hasattr(f, "__code__")]
    raise AssertionError(f"no function {name} in {fn}")


def _source(path, name):
    from deepspeed_qgz.replaced_modules import _source as definition
    text = path.read_text()
    node = next(node for node in ast.parse(text).body if getattr(node, "name", None) == name)
    return definition(text.splitlines(keepends=True), node)


def test_the_series_definitions_in_the_release_s_module():
    """On any supported release, qgZ's module holds the series' definitions of what the series changes,
    compiled from this repository's file (the one source), and the release's own of everything else."""
    import deepspeed
    import deepspeed.runtime.zero.stage3 as stage3
    from deepspeed.runtime.comm import coalesced_collectives as module
    from deepspeed_qgz.releases import grafted_definitions
    series_file = Path(__file__).resolve().parents[1] / "deepspeed/runtime/comm/coalesced_collectives.py"
    release_file = Path(deepspeed.__file__).parent / "runtime/comm/coalesced_collectives.py"
    changed = grafted_definitions()[0]
    assert "all_to_all_quant_reduce" in changed
    releases = {node.name for node in ast.parse(release_file.read_text()).body if isinstance(node, ast.FunctionDef)}
    for name in sorted(releases | {name for name in changed if callable(getattr(module, name))}):
        assert _running_source(getattr(module, name),
                               name) == _source(series_file if name in changed else release_file, name), name
    assert stage3.all_to_all_quant_reduce is module.all_to_all_quant_reduce

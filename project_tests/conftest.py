# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The project's own tests: what only the overlay, this repository's scripts and benchmarks, and the
comparison with unpatched DeepSpeed need (the patch's own tests are DeepSpeed's, under tests/).
They test the installed package, never this source tree: run them from another directory (see
README / .ci/run). The code under test is DeepSpeed 0.19.8 with the deepspeed-qgz overlay, or a
DeepSpeed patched in-tree with `python -m deepspeed_qgz diff` (scripts/check_intree.sh)."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # qgz_harness

# CI runs the same examples every time (a failure found there reproduces); elsewhere hypothesis explores.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_configure(config):
    import deepspeed
    origin = getattr(deepspeed, "__file__", None)
    if origin is None or Path(origin).resolve().parent == (ROOT / "deepspeed").resolve():
        raise pytest.UsageError("deepspeed was imported from the source tree; run the suite from another directory")


@pytest.fixture(scope="session")
def cpu_quantizer():
    """The CPU quantizer op, as the overlay plugs it into DeepSpeed on the CPU accelerator, behind
    the kernel-contract checks; JIT-built once before any multi-process test needs it."""
    from deepspeed_qgz.cpu_quantizer import load
    from deepspeed_qgz.qgz.qgz_contract import ContractCheckedQuantizer
    return ContractCheckedQuantizer(load())


@pytest.fixture(scope="session")
def code_under_test():
    """"overlay" or "in-tree", and the coalesced_collectives file every process must be running."""
    import importlib.util
    from qgz_harness import overlay_active
    origin = importlib.util.find_spec("deepspeed.runtime.comm.coalesced_collectives").origin
    return ("overlay" if overlay_active() else "in-tree"), origin

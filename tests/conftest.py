# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The suite tests the installed package (deepspeed with the deepspeed-qgz overlay), never this
source tree: run it from another directory (see README / .ci/run)."""

import os
import sys
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs the same examples every time (a failure found there reproduces); elsewhere hypothesis explores.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "unit" / "runtime" / "comm"))


def pytest_configure(config):
    import deepspeed
    origin = getattr(deepspeed, "__file__", None)
    if origin is None or Path(origin).resolve().parent == (HERE.parent / "deepspeed").resolve():
        raise pytest.UsageError("deepspeed was imported from the source tree; run the suite from another directory")


@pytest.fixture(scope="session")
def cpu_quantizer():
    """The CPU quantizer op, JIT-built once before any multi-process test needs it."""
    from deepspeed.ops.op_builder.cpu.quantizer import QuantizerBuilder
    return QuantizerBuilder().load()

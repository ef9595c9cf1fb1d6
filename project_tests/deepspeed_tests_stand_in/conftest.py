# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The pytest hooks DeepSpeed's tests/conftest.py provides for DistributedTest, for the stand-in
unit/common.py (see there): a DistributedTest's method runs in its world of processes, not in
pytest's own; the pooled worlds close at the end of the session."""

import inspect
import os

import pytest
from hypothesis import settings

# CI runs the same examples every time (a failure found there reproduces); elsewhere hypothesis explores.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if getattr(item.cls, "is_dist_test", False):
        test = item.cls()
        names = inspect.signature(item.function).parameters
        test._launch(item.function.__name__, {k: v for k, v in item.funcargs.items() if k in names})
        item.runtest = lambda: True  # already run, in the processes


def pytest_sessionfinish(session):
    from unit.common import close_all_pools
    close_all_pools()

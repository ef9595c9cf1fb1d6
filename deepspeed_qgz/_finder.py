# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The import hook. Imported from a .pth file at interpreter start-up, so it imports nothing heavy:
the DeepSpeed version is read from package metadata the first time a deepspeed module is looked up."""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from . import DISABLE_ENV, SUPPORTED_DEEPSPEED, __version__

TREE = Path(__file__).resolve().parent / "tree"


@functools.lru_cache(maxsize=None)
def overlay_modules():
    """{module name: file} for every Python file the patch carries."""
    modules = {}
    for path in sorted(TREE.rglob("*.py")):
        parts = path.relative_to(TREE).with_suffix("").parts
        modules[".".join(parts)] = path
    return modules


def deepspeed_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def overlay_state():
    """(active, reason) for this process."""
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False, f"switched off by {DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    installed = deepspeed_version()
    if installed is None:
        return False, "deepspeed is not installed"
    if installed.split("+")[0] not in SUPPORTED_DEEPSPEED:
        return False, (f"deepspeed {installed} is outside the tested releases {', '.join(SUPPORTED_DEEPSPEED)}; "
                       "upstream modules are kept")
    return True, f"deepspeed-qgz {__version__} on deepspeed {installed}"


# The reduce-scatter entry points ZeRO-3 calls. The first call in a process (deepspeed.comm is up
# by then, and the user's log level set) logs through DeepSpeed's logger, on rank 0, that the
# overlay is active.
ANNOUNCE_ON_FIRST_CALL = ("deepspeed.runtime.comm.coalesced_collectives",
                          ("all_to_all_quant_reduce", "reduce_scatter_coalesced"))


class _AnnouncingLoader(importlib.machinery.SourceFileLoader):
    announced = False

    def exec_module(self, module):
        super().exec_module(module)
        name, functions = ANNOUNCE_ON_FIRST_CALL
        if module.__name__ == name:
            for function in functions:
                setattr(module, function, _announce_first_call(getattr(module, function), module.__file__))


def _announce_first_call(fn, origin):

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _AnnouncingLoader.announced:
            _AnnouncingLoader.announced = True
            from deepspeed.utils.logging import log_dist
            log_dist(f"qgZ overlay active: {overlay_state()[1]} ({origin})", ranks=[0])
        return fn(*args, **kwargs)

    return wrapper


class OverlayFinder(importlib.abc.MetaPathFinder):
    warned = False

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        origin = overlay_modules().get(fullname)
        if origin is None:
            return None
        active, reason = overlay_state()
        if not active:
            if not reason.startswith("switched off") and not OverlayFinder.warned:
                OverlayFinder.warned = True
                warnings.warn(f"deepspeed-qgz: {reason}", RuntimeWarning, stacklevel=2)
            return None
        loader = _AnnouncingLoader(fullname, str(origin))
        return importlib.util.spec_from_file_location(fullname, origin, loader=loader)


def install():
    if not any(isinstance(finder, OverlayFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OverlayFinder())

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The import hook. Imported from a .pth file at interpreter start-up, so it imports nothing heavy:
the DeepSpeed version is read from package metadata the first time a deepspeed module is looked up.

For a ``deepspeed.*`` module the hook supplies, in this order:
* the patch's own file, for a module the patch carries (``tree/``), announcing itself on its first
  reduce-scatter call for coalesced_collectives;
* upstream's file with the patch's edits applied (``upstream_edits``), for a module it edits.
After qgZ's collectives and qwZ's partitioning are imported, on DeepSpeed's CPU accelerator, their
quantizer op is this package's (``AFTER_IMPORT``, ``plug_in_cpu_quantizer``). Every other module is left to
the normal import system."""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from . import DISABLE_ENV, SUPPORTED_DEEPSPEED, __version__, installed_path

TREE = Path(__file__).resolve().parent / "tree"


def _module_name(installed: str) -> str:
    parts = Path(installed).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.lru_cache(maxsize=None)
def overlay_modules():
    """{module name: file} for every Python file the patch carries."""
    return {_module_name(path.relative_to(TREE).as_posix()): path for path in sorted(TREE.rglob("*.py"))}


@functools.lru_cache(maxsize=None)
def edited_modules():
    """{module name: DeepSpeed source-tree path} for every upstream module the patch edits."""
    from .upstream_edits import edited_paths
    return {_module_name(installed_path(path)): path for path in edited_paths()}


def deepspeed_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=None)
def overlay_state():
    """(active, reason) for this process."""
    if not TREE.is_dir():
        return False, "the overlay's files are not installed (deepspeed-qgz tools only)"
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
ANNOUNCE_ON_FIRST_CALL = ("deepspeed.runtime.comm.coalesced_collectives", ("all_to_all_quant_reduce",
                                                                           "reduce_scatter_coalesced"))


class _AnnouncingLoader(importlib.machinery.SourceFileLoader):
    announced = False

    def exec_module(self, module):
        super().exec_module(module)
        name, functions = ANNOUNCE_ON_FIRST_CALL
        if module.__name__ == name:
            for function in functions:
                setattr(module, function, _announce_first_call(getattr(module, function), module.__file__))
        if module.__name__ in AFTER_IMPORT:
            AFTER_IMPORT[module.__name__](module)


def _announce_first_call(fn, origin):

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _AnnouncingLoader.announced:
            _AnnouncingLoader.announced = True
            from deepspeed.utils.logging import log_dist
            log_dist(f"qgZ overlay active: {overlay_state()[1]} ({origin})", ranks=[0])
        return fn(*args, **kwargs)

    return wrapper


class _EditedLoader(importlib.machinery.SourceFileLoader):
    """Upstream's source with the patch's edits, compiled afresh (upstream's bytecode cache holds
    the unedited module)."""

    def __init__(self, fullname, path, source_tree_path):
        super().__init__(fullname, path)
        self.source_tree_path = source_tree_path

    def get_code(self, fullname):
        from .upstream_edits import apply_edits
        text = apply_edits(self.source_tree_path, Path(self.path).read_text())
        return compile(text, self.path, "exec", dont_inherit=True)

    def exec_module(self, module):
        super().exec_module(module)
        if module.__name__ in AFTER_IMPORT:
            AFTER_IMPORT[module.__name__](module)


class _CPUQuantizerOnFirstUse:
    """This package's CPU quantizer op (cpu_quantizer.py), loaded when DeepSpeed's code first reads one
    of its attributes. (Imported then, not before: cpu_quantizer imports DeepSpeed, whose import
    reaches the modules this hook follows.)"""

    def __init__(self):
        self._op = None

    def __getattr__(self, name):
        if self._op is None:
            from .cpu_quantizer import QuantizerBuilder
            self._op = QuantizerBuilder().load()
        return getattr(self._op, name)


_CPU_QUANTIZER = _CPUQuantizerOnFirstUse()


def plug_in_cpu_quantizer(holder, attribute):
    """On the CPU accelerator, DeepSpeed's quantizer op cache `holder.attribute`, unless something set
    it already, holds this package's op."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() == "cpu" and getattr(holder, attribute) is None:
        setattr(holder, attribute, _CPU_QUANTIZER)


# What runs after a module is imported: the seam through which this package's CPU quantizer op
# reaches DeepSpeed's code, qgZ's and qwZ's quantizer op caches.
AFTER_IMPORT = {
    "deepspeed.runtime.comm.coalesced_collectives":
    lambda module: plug_in_cpu_quantizer(module, "quantizer_module"),
    "deepspeed.runtime.zero.partition_parameters":
    lambda module: plug_in_cpu_quantizer(module.CUDAQuantizer, "quantizer_cuda_module"),
}


def _upstream_spec(fullname, path):
    return importlib.machinery.PathFinder.find_spec(fullname, path)


class OverlayFinder(importlib.abc.MetaPathFinder):
    warned = False

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        origin = overlay_modules().get(fullname)
        edited = edited_modules().get(fullname)
        if origin is None and edited is None:
            return None
        active, reason = overlay_state()
        if not active:
            if not reason.startswith("switched off") and not OverlayFinder.warned:
                OverlayFinder.warned = True
                warnings.warn(f"deepspeed-qgz: {reason}", RuntimeWarning, stacklevel=2)
            return None
        if origin is not None:
            loader = _AnnouncingLoader(fullname, str(origin))
            return importlib.util.spec_from_file_location(fullname, origin, loader=loader)
        upstream = _upstream_spec(fullname, path)
        if upstream is None or upstream.origin is None:
            return None
        loader = _EditedLoader(fullname, upstream.origin, edited)
        return importlib.util.spec_from_file_location(fullname,
                                                      upstream.origin,
                                                      loader=loader,
                                                      submodule_search_locations=upstream.submodule_search_locations)


def install():
    if not any(isinstance(finder, OverlayFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OverlayFinder())

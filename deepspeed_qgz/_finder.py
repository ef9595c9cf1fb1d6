# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The import hook. Imported from a .pth file at interpreter start-up, so it imports nothing heavy:
the DeepSpeed version is read from package metadata the first time a deepspeed module is looked up.

For a ``deepspeed.*`` module the hook supplies, in this order:
* the patch's own file, for a module the patch carries (``tree/``), announcing itself on its first
  reduce-scatter call for coalesced_collectives;
* upstream's file with the patch's edits applied (``upstream_edits``), for a module it edits.
After qgZ's collectives and qwZ's partitioning are imported, their quantizer op is the one
``DS_QGZ_QUANTIZER`` chooses (``AFTER_IMPORT``, ``plug_in_quantizer``): this package's Triton op, or
DeepSpeed's own except on the CPU accelerator, which has none and takes this package's CPU op. Every
other module is left to the normal import system."""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from . import DISABLE_ENV, OLDEST_DEEPSPEED, QUANTIZER_ENV, SERIES_DEEPSPEED, __version__

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
    return {_module_name(path): path for path in edited_paths()}


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
    from .releases import supported
    if not supported(installed):
        return False, (f"deepspeed {installed} is outside the supported releases {OLDEST_DEEPSPEED} to "
                       f"{SERIES_DEEPSPEED}; upstream modules are kept")
    return True, f"deepspeed-qgz {__version__} on deepspeed {installed}"


# The reduce-scatter entry points ZeRO-3 calls. The first call in a process (deepspeed.comm is up
# by then, and the user's log level set) logs through DeepSpeed's logger, on rank 0, that the
# overlay is active, and which quantizer op it plugged in.
ANNOUNCE_ON_FIRST_CALL = ("deepspeed.runtime.comm.coalesced_collectives", ("all_to_all_quant_reduce",
                                                                           "reduce_scatter_coalesced"))


class _AnnouncingLoader(importlib.machinery.SourceFileLoader):
    """The series' module, or with `graft` a release's own module with the series' definitions bound
    into it (releases.py)."""
    announced = False

    def __init__(self, fullname, path, graft=False):
        super().__init__(fullname, path)
        self.graft = graft

    def exec_module(self, module):
        super().exec_module(module)
        if self.graft:
            from .releases import graft
            graft(module)
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
            from .releases import summary
            log_dist(
                f"qgZ overlay active: {overlay_state()[1]}, quantizer op {cached_quantizer()} ({origin}); "
                f"{summary(deepspeed_version())}",
                ranks=[0])
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


class _OpOnFirstUse:
    """A quantizer op of this package, loaded when DeepSpeed's code first reads one of its attributes.
    (Imported then, not before: the op's modules import DeepSpeed or Triton, and DeepSpeed's import
    reaches the modules this hook follows.)"""

    def __init__(self, load):
        self._load = load
        self._op = None

    def __getattr__(self, name):
        if self._op is None:
            self._op = self._load()
        return getattr(self._op, name)


def _load_cpu_op():
    from .cpu_quantizer import QuantizerBuilder
    return QuantizerBuilder().load()


def _load_triton_op():
    from . import triton_quantizer
    return triton_quantizer


# The quantizer ops DS_QGZ_QUANTIZER chooses from: "triton" (deepspeed_qgz/triton_quantizer.py, plugged
# in on any accelerator; it runs on NVIDIA GPUs, and on the CPU in Triton's interpreter, and refuses
# other devices at its first call, naming why), or, unset or "deepspeed", DeepSpeed's own op, except on
# the CPU accelerator, which has none and takes this package's (deepspeed_qgz/cpu_quantizer.py).
QUANTIZERS = {"triton": _OpOnFirstUse(_load_triton_op), "cpu": _OpOnFirstUse(_load_cpu_op)}


def chosen_quantizer(device_name: str):
    """(name, op) of the quantizer op DS_QGZ_QUANTIZER chooses on accelerator `device_name`; op None
    where DeepSpeed's own is kept.

    Raises:
        ValueError: DS_QGZ_QUANTIZER holds something else than "triton" or "deepspeed".
    """
    chosen = os.environ.get(QUANTIZER_ENV, "").strip().lower() or "deepspeed"
    if chosen not in ("triton", "deepspeed"):
        raise ValueError(f"{QUANTIZER_ENV} must be 'triton' or 'deepspeed' (or unset), got "
                         f"{os.environ[QUANTIZER_ENV]!r}")
    if chosen == "triton":
        return "triton", QUANTIZERS["triton"]
    if device_name == "cpu":
        return "cpu", QUANTIZERS["cpu"]
    return "deepspeed", None


def cached_quantizer() -> str:
    """The quantizer op qgZ's cache holds: "triton" or "cpu" (this package's), "deepspeed" (None
    until first use, when DeepSpeed loads its own), or the name of one set there by a caller (a
    module's or a class's, such as NPUQuantizer)."""
    from deepspeed.runtime.comm import coalesced_collectives
    cached = coalesced_collectives.quantizer_module
    if cached is None:
        return "deepspeed"
    for name, op in QUANTIZERS.items():
        if cached is op:  # by identity: reading an attribute of this package's op would load it
            return name
    return getattr(cached, "__name__", type(cached).__name__)


def plug_in_quantizer(holder, attribute):
    """DeepSpeed's quantizer op cache `holder.attribute`, unless something set it already, holds the
    op chosen_quantizer names (left to DeepSpeed where it names none)."""
    from deepspeed.accelerator import get_accelerator
    _, op = chosen_quantizer(get_accelerator().device_name())
    if op is not None and getattr(holder, attribute) is None:
        setattr(holder, attribute, op)


# What runs after a module is imported: the seam through which this package's quantizer ops reach
# DeepSpeed's code, qgZ's and qwZ's quantizer op caches.
AFTER_IMPORT = {
    "deepspeed.runtime.comm.coalesced_collectives":
    lambda module: plug_in_quantizer(module, "quantizer_module"),
    "deepspeed.runtime.zero.partition_parameters":
    lambda module: plug_in_quantizer(module.CUDAQuantizer, "quantizer_cuda_module"),
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
        from .releases import edits_state, whole_series
        if origin is not None and whole_series(deepspeed_version()):
            loader = _AnnouncingLoader(fullname, str(origin))
            return importlib.util.spec_from_file_location(fullname, origin, loader=loader)
        upstream = _upstream_spec(fullname, path)
        if upstream is None or upstream.origin is None:
            return None
        if origin is not None:
            loader = _AnnouncingLoader(fullname, upstream.origin, graft=True)
            return importlib.util.spec_from_file_location(fullname, upstream.origin, loader=loader)
        if not edits_state(deepspeed_version())[0]:
            return None
        loader = _EditedLoader(fullname, upstream.origin, edited)
        return importlib.util.spec_from_file_location(fullname,
                                                      upstream.origin,
                                                      loader=loader,
                                                      submodule_search_locations=upstream.submodule_search_locations)


def install():
    if not any(isinstance(finder, OverlayFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, OverlayFinder())

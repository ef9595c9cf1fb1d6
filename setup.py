# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
deepspeed-qgz: the qgZ fix as an overlay on an installed DeepSpeed release.

The series' results this repository holds live at DeepSpeed's own source paths (deepspeed/,
tests/). Building copies the module under deepspeed_qgz/tree/ at the path an installed DeepSpeed uses,
copies the series (upstream/) under deepspeed_qgz/series/, ships the CPU quantizer op's source
(deepspeed_qgz/csrc/) and adds deepspeed_qgz.pth, which starts the import hook.
"""

import importlib.util
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _this_package():
    # by file: an installed deepspeed-qgz is already imported (its .pth runs in every interpreter)
    spec = importlib.util.spec_from_file_location("_deepspeed_qgz_source", ROOT / "deepspeed_qgz" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PACKAGE = _this_package()

# The series' result this repository holds that the overlay imports, at DeepSpeed's source-tree path
# (its test module under tests/ is DeepSpeed's: `diff --deepspeed-tree` makes it from the series' hunks).
PATCH_DIRS = ("deepspeed", )
OVERLAY_SUFFIXES = {".py"}


def overlay_files():
    """(file in this repository, its path inside an installed deepspeed package, or under tests/)."""
    for source_dir in PATCH_DIRS:
        for path in sorted((ROOT / source_dir).rglob("*")):
            if path.is_file() and path.suffix in OVERLAY_SUFFIXES and "__pycache__" not in path.parts:
                yield path, path.relative_to(ROOT)


class BuildWithOverlay(build_py):

    def run(self):
        super().run()
        build_lib = Path(self.build_lib)
        # a previous build's overlay may linger in build_lib: start from none
        shutil.rmtree(build_lib / "deepspeed_qgz" / "tree", ignore_errors=True)
        (build_lib / "deepspeed_qgz.pth").unlink(missing_ok=True)
        for source, installed in overlay_files():
            target = build_lib / "deepspeed_qgz" / "tree" / installed
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)  # keeps mtimes: a reinstall does not invalidate JIT-built ops
        # the pull-request series, whose hunks the overlay applies to the files it edits (series.py)
        shutil.rmtree(build_lib / "deepspeed_qgz" / "series", ignore_errors=True)
        (build_lib / "deepspeed_qgz" / "series").mkdir()
        for patch in sorted((ROOT / "upstream").glob("*.patch")):
            shutil.copy2(patch, build_lib / "deepspeed_qgz" / "series" / patch.name)
        (build_lib / "deepspeed_qgz.pth").write_text("import deepspeed_qgz._startup\n")


setup(
    name="deepspeed-qgz",
    version=PACKAGE.__version__,
    description="ZeRO++ quantized gradients (qgZ) for any node count, as an overlay on DeepSpeed",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",  # torch >= 2.0 and deepspeed 0.19.8: requirements/requirements.txt
    packages=["deepspeed_qgz", "deepspeed_qgz.qgz"],
    package_data={"deepspeed_qgz": ["csrc/*.cpp"]},
    install_requires=(ROOT / "requirements" / "requirements.txt").read_text().split(),
    cmdclass={"build_py": BuildWithOverlay},
    zip_safe=False,
)

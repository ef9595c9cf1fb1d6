# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
deepspeed-qgz: the qgZ fix as an overlay on an installed DeepSpeed release.

The patch's files live at DeepSpeed's own source paths (deepspeed/, op_builder/, csrc/). Building
copies them under deepspeed_qgz/tree/ at the paths an installed DeepSpeed uses (op_builder/ and
csrc/ live in deepspeed/ops/ there) and adds deepspeed_qgz.pth, which starts the import hook.
"""

import re
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "deepspeed_qgz" / "__init__.py").read_text()).group(1)

# source-tree directory -> its place inside an installed deepspeed package
OVERLAY_DIRS = {
    "deepspeed": "deepspeed",
    "op_builder": "deepspeed/ops/op_builder",
    "csrc": "deepspeed/ops/csrc",
}
OVERLAY_SUFFIXES = {".py", ".cpp", ".h"}


def overlay_files():
    for source_dir, installed_dir in OVERLAY_DIRS.items():
        for path in sorted((ROOT / source_dir).rglob("*")):
            if path.is_file() and path.suffix in OVERLAY_SUFFIXES and "__pycache__" not in path.parts:
                yield path, Path(installed_dir) / path.relative_to(ROOT / source_dir)


class BuildWithOverlay(build_py):

    def run(self):
        super().run()
        build_lib = Path(self.build_lib)
        for source, installed in overlay_files():
            target = build_lib / "deepspeed_qgz" / "tree" / installed
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)  # keeps mtimes: a reinstall does not invalidate JIT-built ops
        (build_lib / "deepspeed_qgz.pth").write_text("import deepspeed_qgz._startup\n")


setup(
    name="deepspeed-qgz",
    version=VERSION,
    description="ZeRO++ quantized gradients (qgZ) for any node count, as an overlay on DeepSpeed",
    long_description=(ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=["deepspeed_qgz"],
    install_requires=(ROOT / "requirements" / "requirements.txt").read_text().split(),
    cmdclass={"build_py": BuildWithOverlay},
    zip_safe=False,
)

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
qgZ for any cluster shape, installed on top of a DeepSpeed release.

This package carries the patch's files at DeepSpeed's own paths (under ``tree/``) and a meta-path
finder, started from a ``.pth`` file in every Python process of the environment, that imports
them in place of (or beside) the installed DeepSpeed's modules. Nothing of DeepSpeed's own
installation is modified; ``pip uninstall deepspeed-qgz`` restores it completely.

``DS_QGZ_OVERLAY=0`` switches the overlay off for a process (and the processes it starts).
"""

__version__ = "0.1.0"

# The DeepSpeed releases this patch was tested on; elsewhere upstream is kept, with a warning.
SUPPORTED_DEEPSPEED = ("0.19.8", )

DISABLE_ENV = "DS_QGZ_OVERLAY"

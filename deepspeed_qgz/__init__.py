# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""
ZeRO++ for any cluster shape: the pull-request series (upstream/) installed on a DeepSpeed release.

This package carries the series' results it holds at DeepSpeed's own paths (under ``tree/``), the
series' patches, whose hunks it applies to the DeepSpeed files they change (``series``,
``upstream_edits``), and a meta-path finder, started from a ``.pth`` file in every Python process of
the environment, that imports the carried modules in place of the installed DeepSpeed's and applies
the hunks as it imports the edited modules. It plugs its own quantizer ops into DeepSpeed's code
through the quantizer op DeepSpeed caches: its Triton kernels with ``DS_QGZ_QUANTIZER=triton``
(``triton_quantizer``), and on DeepSpeed's CPU accelerator, which has no quantizer op, its C++ one
(``cpu_quantizer``); ``qgz`` holds the kernels' contract and the PyTorch statement of them that both
ops are tested against. Nothing of DeepSpeed's own installation is modified; ``pip uninstall
deepspeed-qgz`` restores it completely.

``DS_QGZ_OVERLAY=0`` switches the overlay off for a process (and the processes it starts);
``DS_QGZ_QUANTIZER=triton`` makes qgZ and qwZ call the Triton kernels.
"""

__version__ = "0.5.0"

# The DeepSpeed releases the overlay installs on (what each gets: releases.py); outside them upstream is
# kept, with a warning. The oldest is the first that imports with torch 2.13 (0.14.0 to 0.14.3 import names
# torch's elastic agent no longer has: docs/upstreaming.md); the newest is the one the series' module and
# hunks were made against.
OLDEST_DEEPSPEED = "0.14.4"
SERIES_DEEPSPEED = "0.19.8"

DISABLE_ENV = "DS_QGZ_OVERLAY"
# Which quantizer op qgZ and qwZ call: "triton" (this package's Triton kernels) or "deepspeed" (the default).
QUANTIZER_ENV = "DS_QGZ_QUANTIZER"

# Copyright (c) Microsoft Corporation.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run by deepspeed_qgz.pth in every interpreter of the environment. A broken overlay must never
stop Python from starting, so failures are reported and swallowed."""

try:
    from deepspeed_qgz._finder import install
    install()
except Exception as exc:  # noqa: BLE001
    import sys
    print(f"deepspeed-qgz: overlay not installed: {exc!r}", file=sys.stderr)

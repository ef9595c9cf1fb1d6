#!/usr/bin/env bash
# One-command GPU validation of the qgZ CUDA path (see docs/gpu-check.md).
#   bash scripts/gpu_check.sh [--out DIR]
# Needs CUDA, torch and ninja. DeepSpeed and this package may come as wheels in .whl/ (built on a
# CPU machine: docs/gpu-check.md lists the commands); they are installed into /tmp/qgz-site, not the system.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: CUDA is needed (torch.cuda.is_available() is false or torch is missing); nothing was run." >&2
    exit 2
fi
if compgen -G "$ROOT/.whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/qgz-site "$ROOT"/.whl/*.whl
    export PYTHONPATH=/tmp/qgz-site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"

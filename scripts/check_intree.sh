#!/usr/bin/env bash
# The in-tree route, as a maintainer takes the whole patch: DeepSpeed 0.19.8's source
# distribution with `python -m deepspeed_qgz diff` applied by git apply. Its documentation and tests
# are not in the source distribution: their hunks need a DeepSpeed checkout
# (scripts/deepspeed_tests.sh --deepspeed-tree).
#
# The suites run once, against the overlay (scripts/test.sh), on the same files: here, that the
# patched tree is what the overlay imports, file by file (the module the patch replaces is this
# repository's; the files it edits are the overlay's edits of 0.19.8's), and that a wheel of it, as
# pip builds one to install it, ships that module.
#   bash scripts/check_intree.sh     (after scripts/setup_env.sh has run once)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"
say() { echo "[$(date +%H:%M:%S)] $*"; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say "in-tree: DeepSpeed 0.19.8's source distribution"
pip download -q --no-deps --no-binary :all: -d "$WORK" deepspeed==0.19.8
mkdir "$WORK/patched" "$WORK/upstream"
tar xzf "$WORK"/deepspeed-0.19.8.tar.gz -C "$WORK/patched"
tar xzf "$WORK"/deepspeed-0.19.8.tar.gz -C "$WORK/upstream"
python -m deepspeed_qgz diff > "$WORK/qgz.patch"
say "in-tree: git apply ($(grep -c '^+++ ' "$WORK/qgz.patch") files)"
git -C "$WORK/patched/deepspeed-0.19.8" apply --whitespace=error-all "$WORK/qgz.patch"
say "in-tree: the patched files are what the overlay imports"
python - "$WORK/upstream/deepspeed-0.19.8" "$WORK/patched/deepspeed-0.19.8" "$ROOT" <<'PY'
import subprocess
import sys
from pathlib import Path

from deepspeed_qgz.upstream_edits import apply_edits, edited_paths

upstream, patched, root = (Path(p) for p in sys.argv[1:])
ours = subprocess.run(["git", "-C", str(root), "ls-files", "deepspeed"], capture_output=True, text=True,
                      check=True).stdout.split()
differ = [path for path in ours if (root / path).read_bytes() != (patched / path).read_bytes()]
differ += [path for path in edited_paths()
           if apply_edits(path, (upstream / path).read_text()) != (patched / path).read_text()]
if differ:
    sys.exit(f"in-tree: these patched files differ from what the overlay imports: {differ}")
print(f"in-tree: {len(ours)} added or replaced files are this repository's, "
      f"{len(edited_paths())} edited files the overlay's edits")
PY
say "in-tree: a wheel of the patched tree, as pip builds one to install it, holds every file the patch adds"
# (the overlay off: its edits are already in the tree)
DS_QGZ_OVERLAY=0 pip wheel -q --no-deps --no-build-isolation -w "$WORK/wheel" "$WORK/patched/deepspeed-0.19.8"
python - "$WORK"/wheel/deepspeed-*.whl "$ROOT" <<'PY'
import subprocess
import sys
import zipfile

wheel, root = sys.argv[1:]
shipped = set(zipfile.ZipFile(wheel).namelist())
ours = subprocess.run(["git", "-C", root, "ls-files", "deepspeed"], capture_output=True, text=True,
                      check=True).stdout.split()
missing = [path for path in ours if path not in shipped]
if missing:
    sys.exit(f"in-tree: the wheel of the patched tree lacks {missing}")
print(f"in-tree: the wheel ships all {len(ours)} files")
PY

#!/usr/bin/env bash
# DeepSpeed's formatting and lint checks, with its versions and settings (.style.yapf, .flake8,
# .clang-format, codespell's arguments, its license header): all of its pre-commit hooks
# (scripts/deepspeed_hooks.sh, check-torchdist and check-torchcuda included) on the files at
# DeepSpeed's paths, its formatters and linters on this repository's other files and on the
# DeepSpeed files the patch edits, as they are once edited. (The series under upstream/ is
# linted by scripts/check_series.sh.)
# Run by scripts/test.sh; alone: bash scripts/lint.sh (after scripts/setup_env.sh has run once).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"
say() { echo "[$(date +%H:%M:%S)] $*"; }
cd "$ROOT"
status=0
# The files at DeepSpeed's paths, which go upstream: every hook DeepSpeed runs on them.
mapfile -t DS_PY < <(git ls-files 'deepspeed/*.py' 'tests/*.py')
say "lint: DeepSpeed's hooks on the ${#DS_PY[@]} files at DeepSpeed's paths (scripts/deepspeed_hooks.sh)"
bash "$ROOT/scripts/deepspeed_hooks.sh" "${DS_PY[@]}" || status=1
# This repository's own files (the overlay, scripts, benchmarks, project tests): DeepSpeed's
# formatters and license header too; its GPU check uses CUDA directly, as a GPU check must.
mapfile -t OWN_PY < <(git ls-files '*.py' ':!deepspeed/' ':!tests/')
mapfile -t CPP < <(git ls-files '*.cpp' '*.h' '*.cu')
say "lint: yapf (${#OWN_PY[@]} files)"
yapf --diff "${OWN_PY[@]}" || status=1
say "lint: flake8"
flake8 --config .flake8 "${OWN_PY[@]}" || status=1
say "lint: clang-format (${#CPP[@]} files)"
clang-format --dry-run --Werror "${CPP[@]}" || status=1
say "lint: codespell"
codespell --skip='*.png,*.json' --ignore-regex='\\n' --ignore-words-list=youn,unsupport,noe,cann --check-filenames \
    --check-hidden $(git ls-files) || status=1
say "lint: license headers"
for f in "${OWN_PY[@]}" "${CPP[@]}"; do
    for line in "Copyright (c) Microsoft Corporation." "SPDX-License-Identifier: Apache-2.0" "DeepSpeed Team"; do
        grep -qF "$line" "$f" || { echo "$f: no '$line' header line"; status=1; }
    done
done
say "lint: the edited DeepSpeed files, edited (yapf, flake8)"
EDITED=$(mktemp -d)
trap 'rm -rf "$EDITED"' EXIT
python - "$EDITED" <<'PY'
import sys
from pathlib import Path
import importlib.util
from deepspeed_qgz.upstream_edits import apply_edits, edited_paths
root = Path(importlib.util.find_spec("deepspeed").origin).parent.parent
for path in edited_paths():
    target = Path(sys.argv[1]) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(apply_edits(path, (root / path).read_text()))
PY
(cd "$EDITED" && yapf --style "$ROOT/.style.yapf" --diff -r . && flake8 --config "$ROOT/.flake8" .) || status=1
[ "$status" -eq 0 ] && say "lint: clean" || say "lint: FAILED"
exit "$status"

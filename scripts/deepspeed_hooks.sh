#!/usr/bin/env bash
# DeepSpeed's pre-commit hooks for Python files, as its .pre-commit-config.yaml runs them on the
# files a change touches, at its pinned versions (requirements/requirements-lint.txt) and with its
# settings (this repository's .style.yapf and .flake8 are DeepSpeed's): trailing whitespace and end
# of file, yapf, flake8, codespell with DeepSpeed's arguments, the license header (check-license),
# no torch.distributed outside deepspeed.comm (check-torchdist, which skips deepspeed/comm/ and
# coalesced_collectives.py) and no torch.cuda without "#ignore-cuda", .cuda() or .is_cuda
# (check-torchcuda). Run from the root of the tree the paths are relative to.
#   bash scripts/deepspeed_hooks.sh [--unused-imports] FILE...
# --unused-imports: flake8 lets unused imports pass (a module assembled from a patch's added lines).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FLAKE8_EXTRA=()
if [ "${1:-}" = "--unused-imports" ]; then
    FLAKE8_EXTRA=(--extend-ignore=F401)
    shift
fi
status=0
fail() { echo "$1"; status=1; }
for f in "$@"; do
    grep -nE '[[:space:]]+$' "$f" | sed "s|^|$f: trailing whitespace: |" | grep . && status=1
    [ -z "$(tail -c 1 "$f")" ] || fail "$f: no newline at the end of the file"
    for line in "SPDX-License-Identifier: Apache-2.0" "DeepSpeed Team"; do
        grep -qE "^(#|//) $line$" "$f" || fail "$f: no '$line' license line"
    done
    case "$f" in
        deepspeed/comm/* | */coalesced_collectives.py) ;;
        *) grep -nP 'torch\.distributed(?!\.nn)' "$f" | sed "s|^|$f: torch.distributed (use deepspeed.comm): |" | grep . && status=1 ;;
    esac
    grep -n 'torch\.cuda' "$f" | grep -v '#ignore-cuda' | sed "s|^|$f: torch.cuda (use get_accelerator()): |" | grep . && status=1
    grep -nE '\.cuda\(\)|\.is_cuda' "$f" | sed "s|^|$f: .cuda() or .is_cuda (use get_accelerator()): |" | grep . && status=1
done
yapf --style "$ROOT/.style.yapf" --diff "$@" || status=1
flake8 --config "$ROOT/.flake8" "${FLAKE8_EXTRA[@]}" "$@" || status=1
codespell --ignore-regex='\\n' --ignore-words-list=youn,unsupport,noe,cann --check-filenames --check-hidden "$@" || status=1
[ "$status" -eq 0 ] && echo "DeepSpeed's hooks: clean ($# files)"
exit "$status"

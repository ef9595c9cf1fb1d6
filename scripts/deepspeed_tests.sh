#!/usr/bin/env bash
# The tests in DeepSpeed's form: the patch's (tests/, at DeepSpeed's paths: the series' result of
# DeepSpeed's test module of the collectives) and this package's own (package_tests/: its CPU and
# Triton quantizer ops, and qwZ and ZeRO++ on worlds of simulated nodes), against the
# installed DeepSpeed (the overlay, or a DeepSpeed patched in-tree) or a patched DeepSpeed checkout,
# on the CPU accelerator, run as DeepSpeed runs its CPU tests: LOCAL_SIZE in the environment at least
# the largest world size (10).
#   bash scripts/deepspeed_tests.sh [--deepspeed-tree PATH] [pytest arguments]
# With --deepspeed-tree PATH (a DeepSpeed git checkout): a copy of the tree with the whole patch
# (`python -m deepspeed_qgz diff --deepspeed-tree PATH`, made against that tree's files) applied by
# git apply and installed as DeepSpeed installs into a fresh environment (scripts/patched_env.sh),
# its tests run there with DeepSpeed's own conftest.py, pytest.ini and unit/common.py; DeepSpeed's
# own tests of the module run beside the new ones. Without: the repository's tests/ and package_tests/
# beside a stand-in for DeepSpeed's DistributedTest (project_tests/deepspeed_tests_stand_in), against the
# installed DeepSpeed, which is how CI runs them (DeepSpeed's source distribution ships no tests).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TREE=
if [ "${1:-}" = "--deepspeed-tree" ]; then
    TREE=$(cd "$2" && pwd)
    shift 2
fi
say() { echo "[$(date +%H:%M:%S)] $*"; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -n "$TREE" ]; then
    say "DeepSpeed tests: a copy of $TREE with the patch applied"
    python -m deepspeed_qgz diff --deepspeed-tree "$TREE" > "$WORK/qgz.patch"
    mkdir "$WORK/tree"
    (cd "$TREE" && tar -c --exclude=./.git .) | tar -x -C "$WORK/tree"
    git -C "$WORK/tree" init -q
    git -C "$WORK/tree" apply --whitespace=error-all "$WORK/qgz.patch"
    say "DeepSpeed tests: git apply: $(grep -c '^+++ ' "$WORK/qgz.patch") files"
    source "$ROOT/scripts/patched_env.sh"
    patched_deepspeed_env "$WORK/tree" "$WORK/venv"
    # the patched tree's ops build apart from any other DeepSpeed's (the same op names)
    export TORCH_EXTENSIONS_DIR="$WORK/torch_extensions"
    ln -s tree/tests "$WORK/tests"
    mapfile -t FILES < <(grep '^+++ b/tests/.*/test_[^/]*\.py$' "$WORK/qgz.patch" | sed 's|^+++ b/tests/||')
else
    say "DeepSpeed tests: this repository's tests/ and package_tests/ with a stand-in for DeepSpeed's DistributedTest"
    cp -r "$ROOT/tests" "$WORK/tests"
    cp -r "$ROOT/package_tests/." "$WORK/tests/"
    cp -r "$ROOT/project_tests/deepspeed_tests_stand_in/." "$WORK/tests/"
    export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"  # the stand-in's qgz_harness
    # QGZ_TEST_FILES: a folder of them alone (scripts/releases_check.sh)
    mapfile -t FILES < <(cd "$WORK/tests" && find "${QGZ_TEST_FILES:-unit}" -name 'test_*.py' | sort)
fi
# Without a GPU the Triton quantizer op's tests run in Triton's interpreter (they skip without Triton).
if ! python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    export TRITON_INTERPRET=1
fi
# One OpenMP thread per process: a world puts up to 10 processes on the machine's cores, and PyTorch's
# default (a thread per core in every process) leaves their threads spinning past each other (the
# 5 x 2 world's collective tests ran 3x slower, some calls 10x).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
say "DeepSpeed tests: ${#FILES[@]} files, LOCAL_SIZE=10, OMP_NUM_THREADS=$OMP_NUM_THREADS${TRITON_INTERPRET:+, TRITON_INTERPRET=1}"
cd "$WORK/tests"
LOCAL_SIZE=10 python -m pytest -p no:cacheprovider -q -rA --durations=10 "${FILES[@]}" "$@"

#!/usr/bin/env bash
# The in-tree route, as a maintainer takes the patch: DeepSpeed 0.19.8's source distribution,
# `python -m deepspeed_qgz diff --sdist` applied with git apply, installed into a fresh virtual
# environment without the overlay (deepspeed-qgz is installed there for its command line only),
# then the project's tests and the patch's DeepSpeed tests against DeepSpeed's own, patched files.
# DeepSpeed's git tree has deepspeed/ops/op_builder, deepspeed/ops/csrc and deepspeed/accelerator as
# symbolic links to the top-level directories; its source distribution ships copies, which --sdist
# patches too. Its documentation and tests are not in the source distribution: their hunks need a
# DeepSpeed checkout (scripts/deepspeed_tests.sh --deepspeed-tree).
#   bash scripts/check_intree.sh [pytest arguments]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say "in-tree: DeepSpeed 0.19.8's source distribution"
pip download -q --no-deps --no-binary :all: -d "$WORK" deepspeed==0.19.8
mkdir "$WORK/patched" "$WORK/upstream"
tar xzf "$WORK"/deepspeed-0.19.8.tar.gz -C "$WORK/patched"
tar xzf "$WORK"/deepspeed-0.19.8.tar.gz -C "$WORK/upstream"
python -m deepspeed_qgz diff --sdist > "$WORK/qgz.patch"
say "in-tree: git apply ($(grep -c '^+++ ' "$WORK/qgz.patch") files)"
git -C "$WORK/patched/deepspeed-0.19.8" apply --whitespace=error-all "$WORK/qgz.patch"
deactivate
source "$ROOT/scripts/patched_env.sh"
patched_deepspeed_env "$WORK/patched/deepspeed-0.19.8" "$WORK/venv"
DS_QGZ_TOOLS_ONLY=1 pip install -q --no-deps "$ROOT"
say "in-tree: op builds (the CPU quantizer op; DeepSpeed's CPU Adam and shared-memory ops beside it)"
start_deepspeed_ops_build
python -m deepspeed_qgz status
wait_for_deepspeed_ops
cd "$WORK"
# What does not depend on how the patch is installed runs once, on the overlay route (scripts/test.sh):
# the convergence benchmark's smoke run, the GPU check's dry run, the tests of the new modules and the
# CPU op alone (layout, pipeline, range, fused kernels, quantizer op), whose files the patch adds as
# they are in this repository (checked below), and the collective's other worlds. Here: what goes
# through DeepSpeed's edited files: the op registry, the config keys (ZeRO-3 training with the fused
# kernels' key on included), qwZ and ZeRO++'s recipe, the collective at 3 nodes x 2 ranks (the bug
# report's shape; the 2x3, 5x2 and 2x2 worlds run the same module on the overlay route).
say "in-tree: the project's tests against the patched DeepSpeed"
QGZ_UPSTREAM_DEEPSPEED="$WORK/upstream/deepspeed-0.19.8" \
    python -m pytest -p no:cacheprovider -q -rA --durations=5 "$ROOT/project_tests" \
    -k "not test_convergence_benchmark_smoke and not test_gpu_check_script_logic_on_cpu" "$@"
say "in-tree: the modules the patch adds or replaces are this repository's files"
INSTALLED=$(python -c "import importlib.util as u, os; print(os.path.dirname(u.find_spec('deepspeed').origin))")/..
for file in $(git -C "$ROOT" ls-files deepspeed); do
    cmp "$ROOT/$file" "$INSTALLED/$file"
done
say "in-tree: the patch's DeepSpeed tests against the patched DeepSpeed (DeepSpeed-bound files)"
bash "$ROOT/scripts/deepspeed_tests.sh" -k "test_qgz_op_registry or test_qgz_config or 3Nodes2Ranks" "$@"

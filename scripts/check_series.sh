#!/usr/bin/env bash
# The pull-request series, upstream/*.patch, in order, on a stand-in for DeepSpeed's master made from
# DeepSpeed 0.19.8's source distribution (scripts/series.py: master's module, checked by its git blob
# id, and DeepSpeed's file modes). First, each pull request's size is the one its message and the two
# tables (README.md, docs/PULL_REQUEST.md) state, and each patch's index lines name the blob and mode
# of what it applies to. Then the series is applied one pull request at a time, as a maintainer
# merges or bisects it: its own tests fail on the tree before it (all of them run; some may pass:
# they guard what it must keep), its source hunks apply with git apply, DeepSpeed's hooks pass on
# what it changes, and its tests and every earlier pull request's in the modules it changes pass on
# the tree with it (below: why the other module's need not run). After the last, what the overlay
# installs of DeepSpeed's files (the series' own hunks on 0.19.8's, or the series' result carried
# whole) is the series' result, byte for byte, and every pull request's tests pass on DeepSpeed
# 0.19.8 with the overlay: the series' result, as users install it.
# DeepSpeed's own test modules are not in the source distribution: the tests the series adds to each
# of them run as a module of their own (up to the pull request checked), on the DistributedTest
# stand-in, with LOCAL_SIZE=10 (docs/upstreaming.md). Run by scripts/test.sh; alone:
#   bash scripts/check_series.sh [pytest arguments]     (after scripts/setup_env.sh has run once)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
# shellcheck disable=SC1091
source "$VENV/bin/activate"
say() { echo "[$(date +%H:%M:%S)] $*"; }
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
say "series: each pull request's size, as stated"
python "$ROOT/scripts/series.py" sizes
say "series: DeepSpeed 0.19.8's source distribution, made a stand-in for master"
pip download -q --no-deps --no-binary :all: -d "$WORK" deepspeed==0.19.8
tar xzf "$WORK"/deepspeed-0.19.8.tar.gz -C "$WORK"
TREE=$WORK/deepspeed-0.19.8
python "$ROOT/scripts/series.py" stand-in "$TREE"
say "series: each patch's index lines, against the stand-in and the patches before it"
python "$ROOT/scripts/series.py" index "$TREE"
# the files the series changes, before it, for the overlay's reading of its hunks (below)
mkdir -p "$TREE.orig/deepspeed/runtime/zero"
cp "$TREE"/deepspeed/runtime/zero/{partition_parameters,config,stage3}.py "$TREE.orig/deepspeed/runtime/zero/"
cp "$TREE/deepspeed/runtime/engine.py" "$TREE.orig/deepspeed/runtime/"
git -C "$TREE" init -q
cp -r "$ROOT/project_tests/deepspeed_tests_stand_in" "$WORK/tests"
# The stand-in tree is imported from source (the overlay off); one OpenMP thread per process.
export DS_QGZ_OVERLAY=0 PYTHONPATH="$TREE:$ROOT/scripts" DS_TESTS_SKIP_SHM_OP=1 OMP_NUM_THREADS=1 LOCAL_SIZE=10
run_tests() { (cd "$WORK/tests" && python -m pytest -p no:cacheprovider -q -rfE "$@"); }
PATCHES=("$ROOT"/upstream/*.patch)
for patch in "${PATCHES[@]}"; do
    name=$(basename "$patch" .patch)
    mapfile -t MODULES < <(python "$ROOT/scripts/series.py" tests "$patch" "$WORK/tests/unit")
    # the tests it adds (the earlier pull requests' pass there), and each module where it changes
    # earlier tests instead
    mapfile -t TARGETS < <(python "$ROOT/scripts/series.py" own "$patch")
    TARGETS=("${TARGETS[@]/#/unit/}")
    say "series: $name: its tests before it (they must fail)"
    status=0
    run_tests --tb=line "${TARGETS[@]}" "$@" || status=$?
    if [ "$status" -ne 1 ]; then
        say "series: $name: its tests before it gave pytest's exit status $status, not 1 (tests failed)"
        exit 1
    fi
    python "$ROOT/scripts/series.py" source "$patch" "$WORK/source.patch"
    mapfile -t FILES < <(grep '^diff --git ' "$WORK/source.patch" | sed 's|^diff --git a/\([^ ]*\) .*|\1|')
    say "series: $name: git apply, its source hunks (${#FILES[@]} files)"
    git -C "$TREE" apply --whitespace=error-all "$WORK/source.patch"
    python "$ROOT/scripts/series.py" applied "$patch" "$TREE"
    say "series: $name: DeepSpeed's hooks on the files it changes"
    (cd "$TREE" && bash "$ROOT/scripts/deepspeed_hooks.sh" "${FILES[@]}")
    # the added test lines, as the modules above hold them (their headers' imports may go unused)
    (cd "$WORK/tests" && bash "$ROOT/scripts/deepspeed_hooks.sh" --unused-imports "${MODULES[@]/#/unit/}")
    # Every earlier pull request's tests in the modules it changes run again. The other module's
    # exercise none of the code it changes: test_coalesced_collectives.py's call the collectives
    # alone, and test_zeropp.py's train with qgZ off but for the keys' tests, from whose pull
    # request on every pull request changes both modules. After the last, every module runs, once,
    # on what users install (below).
    if [ "$patch" != "${PATCHES[-1]}" ]; then
        say "series: $name: its tests and every earlier pull request's in the modules it changes, after it"
        run_tests "${MODULES[@]/#/unit/}" "$@"
    fi
done
# the overlay installed in the environment must be this checkout's (scripts/setup_env.sh installs it)
(cd "$WORK" && DS_QGZ_OVERLAY=0 python - "$ROOT" <<'PY'
import subprocess
import sys
from pathlib import Path

import deepspeed_qgz

root, package = Path(sys.argv[1]), Path(deepspeed_qgz.__file__).parent
files = subprocess.run(["git", "-C", str(root), "ls-files", "deepspeed_qgz", "deepspeed"],
                       capture_output=True, text=True, check=True).stdout.split()
stale = [path for path in files if (root / path).read_bytes() != (
    package / path.removeprefix("deepspeed_qgz/") if path.startswith("deepspeed_qgz/") else package / "tree" / path).read_bytes()]
# the series the overlay applies (deepspeed_qgz/series.py) is this checkout's upstream/
patches = sorted(p.name for p in (root / "upstream").glob("*.patch"))
if sorted(p.name for p in (package / "series").glob("*.patch")) != patches:
    stale.append("upstream/")
stale += [f"upstream/{name}" for name in patches
          if (root / "upstream" / name).read_bytes() != (package / "series" / name).read_bytes()]
if stale:
    sys.exit(f"series: the installed overlay is not this checkout's ({stale}): pip install --no-deps {root}")
PY
)
# One source of truth: what the overlay installs of DeepSpeed's files is the series' result. It edits
# the files the series made against 0.19.8's with the series' own hunks (deepspeed_qgz/series.py),
# and carries the two whose base is master's whole: coalesced_collectives.py must be the stand-in's
# after the last pull request, and its test module, with the series' hunks taken back out, master's
say "series: what the overlay installs of DeepSpeed's files is the series' result, byte for byte"
(cd "$WORK" && DS_QGZ_OVERLAY=0 python - "$TREE" "$ROOT" <<'PY'
import sys
from pathlib import Path

from deepspeed_qgz.series import revert
from deepspeed_qgz.upstream_edits import SERIES_PATHS, TREE_ONLY, apply_edits
from series import blob_id

tree, root = Path(sys.argv[1]), Path(sys.argv[2])
for path in SERIES_PATHS:
    if path.startswith(TREE_ONLY):  # the source distribution has no docs or tests (the test module: below)
        continue
    if apply_edits(path, (Path(sys.argv[1] + ".orig") / path).read_text()) != (tree / path).read_text():
        sys.exit(f"series: the overlay's {path} differs from the series' result")
    print(f"series: the overlay's {path} (0.19.8's with the series' hunks) is the series' result")
path = "deepspeed/runtime/comm/coalesced_collectives.py"
if (root / path).read_bytes() != (tree / path).read_bytes():
    sys.exit(f"series: this repository's {path} differs from the series' result")
print(f"series: this repository's {path} is the series' result")
path, master_blob = "tests/unit/runtime/comm/test_coalesced_collectives.py", "160d79283d15c302bfa2596c7cecf86ea5040d14"
text = revert(path, (root / path).read_text())
if blob_id(text.encode()) != master_blob:
    sys.exit(f"series: this repository's {path} without the series' hunks is not master's (blob {master_blob[:12]})")
print(f"series: this repository's {path} is master's (blob {master_blob[:12]}) with the series' hunks")
PY
)
# The tree after the last pull request and DeepSpeed 0.19.8 with the overlay now hold the same
# DeepSpeed files: every pull request's tests run once, there, where users take the series from.
say "series: $name: every pull request's tests, after it, on DeepSpeed 0.19.8 with the overlay (its result, as users install it)"
(cd "$WORK/tests" && DS_QGZ_OVERLAY=1 PYTHONPATH="$ROOT/scripts" python -m pytest -p no:cacheprovider -q -rfE \
    unit/test_series_*.py "$@")
say "series: every pull request checked"

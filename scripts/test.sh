#!/usr/bin/env bash
# The test suite, from a fresh machine (what .ci/run runs): set up the environment, build the CPU
# quantizer op once, run DeepSpeed's linters; check the pull-request series under upstream/ on a
# stand-in for DeepSpeed's master (scripts/check_series.sh), beside the rest; test against the
# *installed* package (DeepSpeed 0.19.8 with the overlay), from a directory outside the source tree:
# the project's own tests (project_tests/) and the patch's DeepSpeed tests (tests/,
# scripts/deepspeed_tests.sh); and the in-tree route beside them (scripts/check_intree.sh: the patch
# applied to DeepSpeed's source distribution, checked against the overlay's files) and the older
# releases (scripts/releases_check.sh) beside them. Extra arguments go to every pytest run.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup_env.sh"
WORK=$(mktemp -d)
# a check left running in the background when another fails stops with the script
trap 'jobs -p | xargs -r kill 2>/dev/null; rm -rf "$WORK"' EXIT
# The series imports DeepSpeed from its stand-in's source and needs none of the ops building beside
# it (the quantizer op it shares with the rest builds once, whichever asks first); the longest of the
# checks, it starts first and runs beside the rest.
say "series: the pull requests under upstream/, in the background (their output follows the suites')"
bash "$ROOT/scripts/check_series.sh" "$@" >"$WORK/series.log" 2>&1 &
SERIES=$!
# Everything after it at a lower priority: the series, one pull request after another, is the longest
# chain, and beside the suites it got one core of two and ran 5 minutes past them with the machine
# part idle.
renice -n 10 -p $$ >/dev/null
say "op builds and overlay state (the CPU quantizer op builds in about 40 s the first time; DeepSpeed's CPU Adam and shared-memory ops build beside it and the linters)"
start_deepspeed_ops_build
(cd "$WORK" && python -m deepspeed_qgz status)
say "in-tree: the whole patch on DeepSpeed 0.19.8's source distribution (scripts/check_intree.sh), in the background (its output comes last)"
bash "$ROOT/scripts/check_intree.sh" "$@" >"$WORK/intree.log" 2>&1 &
INTREE=$!
bash "$ROOT/scripts/lint.sh"
wait_for_deepspeed_ops
# The older releases (one of each version of qgZ's module) set up and run one after the other in
# environments of their own, beside the suites; none builds an op (scripts/releases_check.sh). Started
# earlier, they took the cores from the build of DeepSpeed's ops above, which the suites wait for.
say "releases: the overlay on older DeepSpeed releases (scripts/releases_check.sh), in the background (their output follows the series')"
bash "$ROOT/scripts/releases_check.sh" "$@" >"$WORK/releases.log" 2>&1 &
RELEASES=$!
# The two suites run side by side: each keeps about one of two cores busy (their worlds' processes
# mostly start, import and wait on each other), so one after the other left half the machine idle.
# They share the built ops (the DeepSpeed tests' own variant of the CPU op has a name of its own).
say "suite: DeepSpeed 0.19.8 with the overlay: the project's tests, in the background (their output follows the DeepSpeed tests')"
(cd "$WORK" && python -m pytest -p no:cacheprovider -q -rA --durations=10 "$ROOT/project_tests" "$@" \
    >"$WORK/project_tests.log" 2>&1) &
PROJECT_TESTS=$!
say "suite: DeepSpeed 0.19.8 with the overlay: the patch's DeepSpeed tests"
status=0
(cd "$WORK" && bash "$ROOT/scripts/deepspeed_tests.sh" "$@") || status=$?
say "suite: the project's tests (run beside the DeepSpeed tests)"
wait "$PROJECT_TESTS" || status=$?
cat "$WORK/project_tests.log"
say "series: the pull requests under upstream/ (run beside the rest)"
wait "$SERIES" || status=$?
cat "$WORK/series.log"
say "releases: the overlay on older DeepSpeed releases (run beside the rest)"
wait "$RELEASES" || status=$?
cat "$WORK/releases.log"
say "in-tree: the whole patch on DeepSpeed 0.19.8's source distribution (run beside the rest)"
wait "$INTREE" || status=$?
cat "$WORK/intree.log"
[ "$status" -eq 0 ] || { say "suite: FAILED (above)"; exit 1; }
say "all checks passed"

#!/usr/bin/env bash
# The overlay on older DeepSpeed releases: one of each version of coalesced_collectives.py before the
# series' own release (QGZ_RELEASES; 0.19.8 is the main environment's, which the rest of
# scripts/test.sh checks), each in an environment of its own (scripts/release_env.sh), one after the
# other: `python -m deepspeed_qgz status`, that qgZ's module holds the series' definitions of what the
# series changes and the release's of the rest (project_tests/test_overlay.py), the report's 3 x 2 job with qgZ on and off
# (scripts/qgz_3x2/run.py --compare, which fails on a fallback, a reduce-scatter, a non-finite loss or
# a loss beyond the tolerance of qgZ off's), and the repository's qgZ collective tests
# (tests/unit/runtime/comm/ but the cases that need a newer comms logger, scripts/deepspeed_tests.sh).
# None of them builds an op: this package's is the main environment's build (scripts/release_env.sh),
# and DeepSpeed's CPU Adam and shared-memory ops, neither on qgZ's path, are left out (torch's Adam
# instead; about three minutes a release on two cores otherwise). A release that does not install or
# fails any of them fails the script. Needs the main environment (scripts/setup_env.sh).
#   bash scripts/releases_check.sh [pytest arguments]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${QGZ_VENV:-$ROOT/.venv}
# 0.14.0-0.16.1, 0.16.2 (LoCo added), 0.17.0-0.19.7
RELEASES=${QGZ_RELEASES:-0.14.5 0.16.2 0.18.9}
say() { echo "[$(date +%H:%M:%S)] $*"; }
# shellcheck disable=SC1091
source "$ROOT/scripts/release_env.sh"
for release in $RELEASES; do
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    release_deepspeed_env "$release" "$VENV-deepspeed-$release"
    WORK=$(mktemp -d)
    say "releases: $release: status"
    (cd "$WORK" && python -m deepspeed_qgz status)
    say "releases: $release: the series' definitions in the release's module"
    (cd "$WORK" && python -m pytest -p no:cacheprovider -q "$ROOT/project_tests/test_overlay.py" -k series_definitions)
    say "releases: $release: the report's 3 x 2 job, qgZ on and off"
    (cd "$WORK" && python "$ROOT/scripts/qgz_3x2/run.py" --compare --no-deepspeed-ops)
    say "releases: $release: the qgZ collective tests"
    # The any-shape and three-node cases count the collectives with comms_logger.get_total_operations, which
    # DeepSpeed added after these releases (0.14.5 has none): they run on 0.19.8 only (scripts/test.sh).
    (cd "$WORK" && QGZ_TEST_FILES=unit/runtime/comm DS_TESTS_SKIP_SHM_OP=1 bash "$ROOT/scripts/deepspeed_tests.sh" \
        -k "not AnyShape and not ThreeNodes" "$@")
    rm -rf "$WORK"
    deactivate
done
say "releases: $RELEASES passed"

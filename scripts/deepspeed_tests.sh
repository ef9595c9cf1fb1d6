#!/usr/bin/env bash
# DeepSpeed's own unit tests for coalesced_collectives, unmodified, against the installed package
# (the overlay, or a DeepSpeed patched in-tree), on the CPU accelerator. DeepSpeed's source
# distribution ships no tests: point this at a DeepSpeed git checkout.
#   bash scripts/deepspeed_tests.sh /path/to/DeepSpeed [pytest arguments]
# Each DistributedTest class runs its world on one node, so LOCAL_SIZE (the CPU accelerator's
# device count) is set to the class's world size: 2, and 4 for TestAllToAllQuantReduceAverage.
set -euo pipefail
DS=$(cd "$1" && pwd)
shift
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
for f in tests/conftest.py tests/pytest.ini tests/unit/common.py tests/unit/util.py \
    tests/unit/runtime/comm/test_coalesced_collectives.py; do
    mkdir -p "$WORK/$(dirname "$f")"
    cp "$DS/$f" "$WORK/$f"
done
cd "$WORK/tests"
TESTS=unit/runtime/comm/test_coalesced_collectives.py
status=0
LOCAL_SIZE=2 python -m pytest -p no:cacheprovider -rA -q "$TESTS" -k "not TestAllToAllQuantReduceAverage" "$@" || status=1
if grep -q "class TestAllToAllQuantReduceAverage" "$TESTS"; then
    LOCAL_SIZE=4 python -m pytest -p no:cacheprovider -rA -q "$TESTS" -k TestAllToAllQuantReduceAverage "$@" || status=1
fi
exit "$status"

#!/usr/bin/env bash
# The daemon crash test's long run (tests/README.md "Crash test"): N kill -9s (default 100)
# of a daemon under random durable traffic, each followed by a restart that must hold every
# acknowledged write. By default the spill tier also injects storage faults
# (integration CrashTest.RandomKillsAndStorageFaultsLoseNoAcknowledgedWrite, rates RATES for
# KVSHADE_FAILPOINT_SPILL_FAULTS); -f none runs the kills alone
# (CrashTest.RandomKillsLoseNoAcknowledgedWrite). Prints the test's summary line and a
# summary of the run; exit status 1 on any loss.
#
#   scripts/crash-test.sh [-n N] [-s SEED] [-f RATES|none] [-b BUILD_DIR]
#   (RATES e.g. write=0.05,read=0.2: the probability of an injected write and read error)
set -euo pipefail
n=100
seed=20261202
faults="write=0.05,read=0.2"
build=build
while getopts "n:s:f:b:" opt; do
  case "$opt" in
    n) n=$OPTARG ;;
    s) seed=$OPTARG ;;
    f) faults=$OPTARG ;;
    b) build=$OPTARG ;;
    *) sed -n '2,11p' "$0"; exit 2 ;;
  esac
done
bin="$build/tests/integration/integration_test"
[ -x "$bin" ] || { echo "crash-test: no $bin (build it first: make build)" >&2; exit 2; }
if [ "$faults" = none ]; then
  test_case=CrashTest.RandomKillsLoseNoAcknowledgedWrite
else
  test_case=CrashTest.RandomKillsAndStorageFaultsLoseNoAcknowledgedWrite
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
rc=0
KVSHADE_CRASH_ITERATIONS=$n KVSHADE_CRASH_SEED=$seed KVSHADE_CRASH_FAULTS=$faults "$bin" \
  --gtest_filter="$test_case" >"$log" 2>&1 || rc=$?
grep -E "^crash test|Failure|^iteration|^\[  (FAILED|PASSED) " "$log" | head -40
failures=$(grep -c "Failure" "$log" || true)
echo "summary: $test_case, faults $faults, seed $seed, $(( $(date +%s) - start )) s, $failures failed checks, exit $rc"
exit $rc

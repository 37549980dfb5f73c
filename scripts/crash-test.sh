#!/usr/bin/env bash
# The daemon crash test's long run (tests/README.md "Crash test"): integration
# CrashTest.RandomKillsLoseNoAcknowledgedWrite with N kill -9s (default 100) of a daemon
# under random durable traffic, each followed by a restart that must hold every
# acknowledged write. Prints the test's summary line; exit status 1 on any loss.
#
#   scripts/crash-test.sh [-n N] [-s SEED] [-b BUILD_DIR]
set -euo pipefail
n=100
seed=20261202
build=build
while getopts "n:s:b:" opt; do
  case "$opt" in
    n) n=$OPTARG ;;
    s) seed=$OPTARG ;;
    b) build=$OPTARG ;;
    *) sed -n '2,7p' "$0"; exit 2 ;;
  esac
done
bin="$build/tests/integration/integration_test"
[ -x "$bin" ] || { echo "crash-test: no $bin (build it first: make build)" >&2; exit 2; }
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s)
rc=0
KVSHADE_CRASH_ITERATIONS=$n KVSHADE_CRASH_SEED=$seed "$bin" \
  --gtest_filter='CrashTest.RandomKillsLoseNoAcknowledgedWrite' >"$log" 2>&1 || rc=$?
grep -E "^crash test:|Failure|^iteration|^\[  (FAILED|PASSED) " "$log" | head -40
echo "seed $seed, $(( $(date +%s) - start )) s, exit $rc"
exit $rc

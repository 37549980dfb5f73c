#!/usr/bin/env bash
# The threshold tests over many seeds (not part of CI, which runs the fixed default seed):
# runs the seeded gtest binaries case by case and the seeded Python suites with
# KVSHADE_TEST_SEED=1..N and reports, per failing test case, how many seeds failed it and
# which (replay one with KVSHADE_TEST_SEED=<seed>, tests/README.md "Seeds").
#
#   scripts/seed-sweep.sh [-n N] [-b BUILD_DIR] [-f GTEST_FILTER] [-p] [TEST ...]
#
# TEST: kernels_test, storage_test, service_test (default: all three); -p adds the seeded
# Python suites (python_client, python_ucx, python_torch_hook) through ctest. -f narrows
# the gtest cases (default: all). Exit status 1 when any case failed at any seed.
set -euo pipefail

n=20
build=build
filter='*'
python=0
while getopts "n:b:f:p" opt; do
  case "$opt" in
    n) n=$OPTARG ;;
    b) build=$OPTARG ;;
    f) filter=$OPTARG ;;
    p) python=1 ;;
    *) sed -n '2,12p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(kernels_test storage_test service_test)

declare -A path=([kernels_test]="$build/tests/kernels_test"
                 [storage_test]="$build/tests/storage/storage_test"
                 [service_test]="$build/tests/service/service_test")
for t in "${tests[@]}"; do
  [ -x "${path[$t]:-}" ] || { echo "seed-sweep: no binary for $t (build it first)" >&2; exit 2; }
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
runs=0
for seed in $(seq 1 "$n"); do
  for t in "${tests[@]}"; do
    KVSHADE_TEST_SEED=$seed OMP_WAIT_POLICY=passive "${path[$t]}" --gtest_filter="$filter" \
      >"$out/log" 2>&1 || true
    # "[  FAILED  ] Suite.Case (12 ms)": one line per failed case.
    sed -n 's/^\[  FAILED  \] \([^ ]*\) (.*$/\1/p' "$out/log" | sed "s/\$/ $seed/" >>"$out/failed"
  done
  if [ "$python" = 1 ]; then
    KVSHADE_TEST_SEED=$seed ctest --test-dir "$build" -R '^(python_client|python_ucx|python_torch_hook)$' \
      >"$out/log" 2>&1 || true
    sed -n 's/^ *[0-9]* - \(python_[a-z_]*\) (Failed).*$/\1/p' "$out/log" | sed "s/\$/ $seed/" >>"$out/failed"
  fi
  runs=$((runs + 1))
  echo "seed $seed done" >&2
done

touch "$out/failed"
echo "seeds: 1..$n; binaries: ${tests[*]}$([ "$python" = 1 ] && echo ' + Python suites'); filter: $filter"
if [ ! -s "$out/failed" ]; then
  echo "no case failed at any seed"
  exit 0
fi
echo "failures (case: failed seeds / $runs, seeds):"
awk '{n[$1]++; s[$1] = s[$1] " " $2} END {for (c in n) printf "  %s: %d/%d (%.0f%%) seeds%s\n", c, n[c], R, 100 * n[c] / R, s[c]}' \
  R="$runs" "$out/failed" | sort
exit 1

#!/usr/bin/env bash
# The closing lines of `make test`: from ctest's output log (ctest --output-log), how many
# tests ran, passed, failed and were skipped, and why the skipped ones were.
# Usage: tests/ctest-summary.sh <ctest output log>
set -uo pipefail
log=${1:?usage: tests/ctest-summary.sh <ctest output log>}
[ -f "$log" ] || { echo "ctest-summary: no log $log" >&2; exit 0; }
# One result line per test: "  3/250 Test   #3: name ......   Passed    0.12 sec"
results=$(grep -E '^ *[0-9]+/[0-9]+ Test +#[0-9]+: ' "$log")
count() { [ -z "$results" ] && echo 0 || grep -cE "$1" <<< "$results"; }
total=$(count .)
passed=$(count ' Passed +[0-9.]+ sec')
skipped=$(count '\*\*\*Skipped ')
notrun=$(count '\*\*\*Not Run')
failed=$((total - passed - skipped - notrun))
line="$total tests: $passed passed, $failed failed, $skipped skipped"
[ "$notrun" -gt 0 ] && line+=", $notrun not run (disabled or missing)"
echo "== make test: $line =="
skipped_names=$(grep -E '\*\*\*Skipped ' <<< "$results" | sed -E 's/.*Test +#[0-9]+: ([^ ]+) .*/\1/')
[ -z "$skipped_names" ] && exit 0
gpu=$(grep -cE '^(kernels_gpu_test|storage_gpu_test|delivery_gpu_test)\.' <<< "$skipped_names")
if [ "$gpu" -gt 0 ]; then
  if nvidia-smi -L > /dev/null 2>&1; then
    echo "   $gpu GPU tests (label gpu) skipped although nvidia-smi sees a GPU: CUDA did not start (see their output)"
  else
    echo "   $gpu GPU tests (label gpu) skipped: no CUDA device on this machine; they run on the GPU machine (scripts/gpu-bundle.sh, then .gpu/gpu-run.sh .gpu; tests/README.md)"
  fi
fi
if grep -qx python_hf_adapter <<< "$skipped_names"; then
  echo "   python_hf_adapter skipped: transformers is not importable by /usr/bin/python3 (it runs on the GPU machine)"
fi
san=$(grep -cE '^sanitize\.' <<< "$skipped_names")
if [ "$san" -gt 0 ]; then
  echo "   $san sanitizer runs (label sanitize) skipped: their sanitizer build has no such binary (the integration tests' long runs are built by hand: scripts/sanitize.sh build address build/asan, or thread build/tsan; tests/README.md \"Sanitizers\")"
fi
other=$(grep -vE '^(kernels_gpu_test|storage_gpu_test|delivery_gpu_test)\.|^python_hf_adapter$|^sanitize\.' <<< "$skipped_names")
if [ -n "$other" ]; then
  echo "   also skipped (their output says why; ctest --test-dir <build> -R <name> -V):"
  sed 's/^/     /' <<< "$other"
fi

#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a bundle made by gpu-bundle.sh:
# the GPU test label (CUDA vs CPU parity), the CPU tests as a sanity check, and the kernel
# benchmark table. Logs go to $OUT (or ./gpu-out).
# Usage: .gpu/gpu-run.sh [bundle-dir] [bench args...]
set -uo pipefail
BUNDLE=${1:-.gpu}
shift || true
OUTDIR=${OUT:-gpu-out}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUTDIR/gpu.txt"
rc=0
"$BUNDLE/bin/kernels_gpu_test" 2>&1 | tee "$OUTDIR/gpu_test.log" || rc=1
"$BUNDLE/bin/kvshade_kernel_bench" --backend cuda "$@" 2>&1 | tee "$OUTDIR/bench.log" || rc=1
echo "== summary =="
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|parity" "$OUTDIR/gpu_test.log" | tail -40
exit $rc

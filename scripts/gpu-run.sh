#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, over a bundle made by gpu-bundle.sh:
# the GPU test label (CUDA vs CPU parity of the kernels and storage; CUDA IPC delivery
# between two processes), the kernel benchmark table and the delivery benchmark, and the
# Python tests that need torch/transformers or a CUDA daemon. Logs go to $OUT (or ./gpu-out).
# Usage: .gpu/gpu-run.sh [bundle-dir] [kernel-bench args...]
#   KVSHADE_GPU_STAGES="tests kbench dbench ubench python" selects stages (default: all).
# Here a skip is a failure: KVSHADE_REQUIRE_GPU=1 makes a GPU test that cannot reach CUDA
# (and the transformers suite without transformers or CUDA) fail instead of skip, and a
# test binary or Python suite that still reports a skipped case makes the exit status 1.
set -uo pipefail
BUNDLE=${1:-.gpu}
shift || true
OUTDIR=${OUT:-gpu-out}
STAGES=${KVSHADE_GPU_STAGES:-tests kbench dbench ubench python}
mkdir -p "$OUTDIR"
rm -f "$OUTDIR/skipped.txt"
export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
export UCX_MODULE_DIR="$PWD/$BUNDLE/lib/ucx"
export KVSHADE_SERVER="$PWD/$BUNDLE/bin/kvshade-server"
export KVSHADE_LIB="$PWD/$BUNDLE/lib/libkvshade.so"
export OMP_WAIT_POLICY=passive
export KVSHADE_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv \
  | tee "$OUTDIR/gpu.txt"
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has tests; then
  for t in kernels_gpu_test storage_gpu_test delivery_gpu_test; do
    "$BUNDLE/bin/$t" 2>&1 | tee "$OUTDIR/$t.log" || rc=1
    if grep -q "^\[  SKIPPED \]" "$OUTDIR/$t.log"; then
      echo "$t: skipped cases on the GPU machine count as failures" | tee -a "$OUTDIR/skipped.txt"
      rc=1
    fi
  done
fi
if has kbench; then
  "$BUNDLE/bin/kvshade_kernel_bench" --backend cuda "$@" 2>&1 | tee "$OUTDIR/bench.log" || rc=1
fi
if has dbench; then
  "$BUNDLE/bin/kvshade_delivery_bench" --server "$KVSHADE_SERVER" 2>&1 \
    | tee "$OUTDIR/delivery_bench.log" || rc=1
fi
if has ubench; then
  # The data plane against a daemon on the CUDA backend, shm and tcp on loopback.
  for tl in shm,self tcp,self; do
    "$BUNDLE/bin/kvshade_ucx_bench" --server "$KVSHADE_SERVER" --backend cuda --transports "$tl" \
      --reps 400 2>&1 | tee "$OUTDIR/ucx_bench_${tl%%,*}.log" || rc=1
  done
fi
if has python; then
  # The ctypes package from this checkout; the Python, torch and transformers of the
  # machine; the daemon on the CPU backend, then the adapter against the CUDA backend.
  export PYTHONPATH="$PWD/client/python:${PYTHONPATH:-}"
  # d = 64 for the adapter here too: its same-node case decodes with the CUDA kernels.
  for t in test_torch_hook test_hf_adapter; do
    [ -f "tests/python/$t.py" ] || continue
    (cd tests/python && KVSHADE_TEST_HEAD_DIM=64 python3 run_unittest.py "$t") 2>&1 \
      | tee "$OUTDIR/py_${t}_cpu.log" || rc=1
  done
  # Same-node decode over a CUDA daemon's exported state (CUDA IPC, CUDA graphs).
  (cd tests/python && KVSHADE_TEST_BACKEND=cuda python3 run_unittest.py test_local) 2>&1 \
    | tee "$OUTDIR/py_test_local_cuda.log" || rc=1
  # Continuous batching (kvshade.integrations.serving) and the device ingest path's window.
  (cd tests/python && KVSHADE_TEST_BACKEND=cuda KVSHADE_TEST_HEAD_DIM=64 python3 run_unittest.py test_serving) \
    2>&1 | tee "$OUTDIR/py_test_serving_cuda.log" || rc=1
  # The CUDA kernels take head dims 64, 80, 96, 128 and 256: the tiny model gets d = 64.
  if [ -f tests/python/test_hf_adapter.py ]; then
    for tl in "" tcp,self; do
      (cd tests/python && KVSHADE_TEST_BACKEND=cuda KVSHADE_TEST_HEAD_DIM=64 KVSHADE_TEST_UCX=$tl \
        python3 run_unittest.py test_hf_adapter) 2>&1 \
        | tee "$OUTDIR/py_test_hf_adapter_cuda${tl:+_ucx}.log" || rc=1
    done
  fi
fi
echo "== summary =="
grep -hE "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|parity\]|ipc delivery\]" "$OUTDIR"/*_test.log 2>/dev/null | tail -60
for f in "$OUTDIR"/py_*.log; do [ -f "$f" ] && echo "$(basename "$f"): $(grep -hE "^(Ran|OK|FAILED)" "$f" | tr "\n" " ")"; done
# run_unittest.py lists skipped Python tests under "skipped N of M:".
for f in "$OUTDIR"/py_*.log; do
  if [ -f "$f" ] && grep -q "^skipped [0-9]* of [0-9]*:" "$f"; then
    echo "$(basename "$f"): skipped tests on the GPU machine count as failures" | tee -a "$OUTDIR/skipped.txt"
    rc=1
  fi
done
if [ -s "$OUTDIR/skipped.txt" ]; then
  echo "== skipped (exit status 1) =="
  cat "$OUTDIR/skipped.txt"
fi
exit $rc

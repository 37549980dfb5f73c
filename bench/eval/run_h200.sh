#!/usr/bin/env bash
# Selection fidelity on the GPU machine: trains the evaluation model (bench/eval/train.py,
# <= 6 minutes on one H200), starts a kvshade-server on the CUDA backend, decodes the
# evaluation tasks through kvshade (bench/eval/evaluate.py, <= 3 minutes) and writes
# everything under $OUT (default bench/eval/out):
#   train.log, evallm.pt (+ .json: the steps taken, to repeat the run), eval.log,
#   selection_fidelity.md (the table), selection_fidelity.json (every sample), gpu.txt.
# Run from the repository root of a checkout with the GPU bundle unpacked in .gpu/
# (scripts/gpu-bundle.sh); python3 with torch (CUDA) and numpy.
#   bench/eval/run_h200.sh                       # train + evaluate (about 9 minutes)
#   bench/eval/run_h200.sh --skip-train W.pt     # evaluate existing weights
#   bench/eval/run_h200.sh --smoke               # CPU, tiny model, 512-token prompts, a few minutes:
#                                                # the whole pipeline against build/service/kvshade-server
# Arguments after these go to evaluate.py (e.g. --per-cell 16, --shadow-option NAME:field=value).
# Environment: KVSHADE_SERVER, KVSHADE_LIB (default: the bundle's, else build/), PYTHON
# (default python3), KVSHADE_BUNDLE (default .gpu), OUT, TRAIN_BUDGET_S (default 330: training
# seconds), EVAL_TIME_LIMIT_S (default 150: no new samples after this long).
set -euo pipefail
cd "$(dirname "$0")/../.."
SMOKE=0
WEIGHTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1; shift ;;
    --skip-train) WEIGHTS="$2"; shift 2 ;;
    *) break ;;
  esac
done
OUTDIR=${OUT:-bench/eval/out}
mkdir -p "$OUTDIR"
BUNDLE=${KVSHADE_BUNDLE:-.gpu}
if [ -d "$BUNDLE/lib" ] && [ "$SMOKE" = 0 ]; then
  export LD_LIBRARY_PATH="$PWD/$BUNDLE/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}"
  export UCX_MODULE_DIR="$PWD/$BUNDLE/lib/ucx"
  : "${KVSHADE_SERVER:=$PWD/$BUNDLE/bin/kvshade-server}"
  : "${KVSHADE_LIB:=$PWD/$BUNDLE/lib/libkvshade.so}"
else
  : "${KVSHADE_SERVER:=$PWD/build/service/kvshade-server}"
  : "${KVSHADE_LIB:=$PWD/build/client/libkvshade.so}"
fi
export KVSHADE_SERVER KVSHADE_LIB
export PYTHONPATH="$PWD/client/python:${PYTHONPATH:-}"
export OMP_WAIT_POLICY=passive
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then
  PY=${PYTHON:-/usr/bin/python3}   # Debian's, which has torch here
  BACKEND=cpu
  TRAIN_ARGS=(--smoke --device cpu)
  EVAL_ARGS=(--device cpu --length 512 --per-cell 1)
else
  BACKEND=cuda
  TRAIN_ARGS=(--budget-s "${TRAIN_BUDGET_S:-330}")
  EVAL_ARGS=(--per-cell 8 --time-limit-s "${EVAL_TIME_LIMIT_S:-150}")
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUTDIR/gpu.txt" 2>&1 || true
fi
t0=$(date +%s)
if [ -z "$WEIGHTS" ]; then
  WEIGHTS="$OUTDIR/evallm.pt"
  timeout 420 "$PY" bench/eval/train.py --out "$WEIGHTS" --log "$OUTDIR/train_curve.jsonl" "${TRAIN_ARGS[@]}" \
    2>&1 | tee "$OUTDIR/train.log"
fi
t1=$(date +%s)
timeout 300 "$PY" bench/eval/evaluate.py --weights "$WEIGHTS" --spawn "$KVSHADE_SERVER" --backend "$BACKEND" \
  --out-json "$OUTDIR/selection_fidelity.json" --out-md "$OUTDIR/selection_fidelity.md" \
  "${EVAL_ARGS[@]}" "$@" 2>&1 | tee "$OUTDIR/eval.log"
t2=$(date +%s)
echo "train $((t1 - t0)) s, evaluate $((t2 - t1)) s; results in $OUTDIR" | tee -a "$OUTDIR/eval.log"

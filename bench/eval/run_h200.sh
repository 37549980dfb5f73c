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
#   bench/eval/run_h200.sh --hard                # the hard tasks (kv, kvm: distinct random words, no
#                                                # chunk locality): train the hard model and evaluate it,
#                                                # results under $OUT (default bench/eval/out-hard)
#   bench/eval/run_h200.sh --hard --smoke        # the same pipeline on the CPU
# Arguments after these go to evaluate.py (e.g. --per-cell 16, --shadow-option NAME:field=value).
# Environment: KVSHADE_SERVER, KVSHADE_LIB (default: the bundle's, else build/), PYTHON
# (default python3), KVSHADE_BUNDLE (default .gpu), OUT, TRAIN_BUDGET_S (default 330: training
# seconds), EVAL_TIME_LIMIT_S (default 150: no new samples after this long); with --hard also
# HARD_WORDS (default 8448: the vocabulary, an 8K context of distinct words) and HARD_CURRICULUM
# (default 64:0.25,256:0.2,1024:0.15,2048:0.1,8192:0.3).
set -euo pipefail
cd "$(dirname "$0")/../.."
SMOKE=0
HARD=0
WEIGHTS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1; shift ;;
    --hard) HARD=1; shift ;;
    --skip-train) WEIGHTS="$2"; shift 2 ;;
    *) break ;;
  esac
done
if [ "$HARD" = 1 ]; then
  OUTDIR=${OUT:-bench/eval/out-hard}
else
  OUTDIR=${OUT:-bench/eval/out}
fi
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
if [ "$HARD" = 1 ]; then
  # The hard model: span retrieval (kv) and majority span (kvm), with rep (copying a
  # context from a word on: the same lookup, densely) to leave the plateau early; the
  # vocabulary follows --words (the harness reads it back from the weights).
  if [ "$SMOKE" = 1 ]; then
    TRAIN_ARGS+=(--tasks rep,kv,kvm --words 1024)
    EVAL_ARGS+=(--tasks kv,kvm)
  else
    TRAIN_ARGS+=(--tasks rep,kv,kvm --words "${HARD_WORDS:-8448}"
                 --curriculum "${HARD_CURRICULUM:-64:0.25,256:0.2,1024:0.15,2048:0.1,8192:0.3}")
    EVAL_ARGS=(--tasks kv,kvm --per-cell 16 --time-limit-s "${EVAL_TIME_LIMIT_S:-150}")
  fi
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

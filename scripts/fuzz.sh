#!/usr/bin/env bash
# libFuzzer targets of fuzz/ (fuzz/README.md, tests/README.md "Fuzzing").
#
#   scripts/fuzz.sh build [DIR]             configure (clang, -DKVSHADE_FUZZ=ON, libraries
#                                           as unity builds: -DKVSHADE_UNITY=ON) and build
#                                           the fuzzers and service_test (the same ASan +
#                                           UBSan objects) in DIR (default build-fuzz)
#   scripts/fuzz.sh run DIR TARGET [ARGS]   run TARGET from DIR over its checked-in corpus
#                                           (fuzz/corpus/TARGET, read-only: new inputs go to
#                                           a temporary directory) with libFuzzer ARGS, e.g.
#                                           -max_total_time=20 or -runs=10000000; exit 1 on
#                                           any crash, leak, timeout or sanitizer report,
#                                           with the reproducer copied to DIR/crashes/;
#                                           FUZZ_WORKERS=N runs N libFuzzer workers over
#                                           one shared corpus, each running ARGS' -runs
#   scripts/fuzz.sh smoke DIR [SECONDS]     `run` every target for SECONDS (default 20)
#   scripts/fuzz.sh seeds DIR               regenerate the generated seeds of fuzz/corpus/
#
# Exit status 77 (ctest's skip code) from `run` when DIR holds no such fuzzer.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
TARGETS=(config_fuzzer record_format_fuzzer rpc_fuzzer durable_fuzzer ucx_fuzzer)

pick_clang() {
  for v in clang++-14 clang++; do
    if command -v "$v" >/dev/null; then echo "$v"; return; fi
  done
  echo "fuzz.sh: clang++ not found (scripts/install-deps.sh installs clang-14)" >&2
  exit 1
}

cmd="${1:-}"
case "$cmd" in
  build)
    dir="${2:-$ROOT/build-fuzz}"
    cxx="$(pick_clang)"
    cc="${cxx/++/}"
    if [ ! -f "$dir/CMakeCache.txt" ]; then
      CC="$cc" CXX="$cxx" cmake -S "$ROOT" -B "$dir" -G Ninja -DKVSHADE_FUZZ=ON \
        -DKVSHADE_CUDA=OFF -DKVSHADE_BUILD_TESTS=ON -DKVSHADE_BUILD_BENCH=OFF \
        -DKVSHADE_UNITY=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    elif ! grep -q '^KVSHADE_BUILD_TESTS:BOOL=ON' "$dir/CMakeCache.txt"; then
      cmake -S "$ROOT" -B "$dir" -DKVSHADE_BUILD_TESTS=ON >/dev/null  # a tree made before
    fi
    # The service unit tests too: built from the same ASan + UBSan objects, they are the
    # short ASan run of `make test` (sanitize.asan.service_test).
    cmake --build "$dir" --target fuzzers service_test -j "${JOBS:-$(nproc)}"
    ;;
  run)
    dir="$2"; target="$3"; shift 3
    [ -d "$dir" ] && dir="$(cd "$dir" && pwd)"
    bin="$dir/fuzz/$target"
    if [ ! -x "$bin" ]; then
      echo "fuzz.sh: $bin not built (scripts/fuzz.sh build $dir); skipped"
      exit 77
    fi
    # Inputs hold whole requests and records: the RPC and durable targets need longer ones.
    case "$target" in
      rpc_fuzzer) max_len=32768 ;;
      durable_fuzzer) max_len=65536 ;;
      *) max_len=4096 ;;
    esac
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/new" "$dir/crashes"
    # Parallel workers (libFuzzer's -jobs/-workers) share $work/new; libFuzzer copies each
    # worker's log into its own output when the worker ends, and fails if any worker does.
    workers="${FUZZ_WORKERS:-1}"
    parallel=()
    [ "$workers" -gt 1 ] && parallel=(-jobs="$workers" -workers="$workers")
    rc=0
    # Timeouts and out-of-memory count as failures; the corpus directory is only read. One
    # OpenMP thread: the inputs' tensors are tiny.
    (cd "$work" && OMP_NUM_THREADS=1 "$bin" -timeout=25 -rss_limit_mb=2048 -max_len=$max_len -print_final_stats=1 \
       -artifact_prefix="$work/" "${parallel[@]}" "$@" "$work/new" "$ROOT/fuzz/corpus/$target") \
       >"$work/log" 2>&1 || rc=$?
    grep -E "^#[0-9]+[[:space:]]+DONE|^stat::|Done [0-9]+ runs" "$work/log" || true
    if [ $rc -ne 0 ]; then
      tail -n 60 "$work/log"
      for f in "$work"/crash-* "$work"/leak-* "$work"/timeout-* "$work"/oom-*; do
        [ -e "$f" ] || continue
        cp "$f" "$dir/crashes/$target-$(basename "$f")"
        echo "fuzz.sh: reproducer: $dir/crashes/$target-$(basename "$f")"
      done
      echo "fuzz.sh: $target FAILED (exit $rc)"
      exit 1
    fi
    echo "fuzz.sh: $target passed"
    ;;
  smoke)
    dir="$2"; secs="${3:-20}"; failed=0
    for t in "${TARGETS[@]}"; do
      "$0" run "$dir" "$t" -max_total_time="$secs" || { rc=$?; [ $rc -eq 77 ] || failed=1; }
    done
    exit $failed
    ;;
  seeds)
    dir="$2"
    for t in record_format_fuzzer rpc_fuzzer; do
      mkdir -p "$ROOT/fuzz/corpus/$t"
      KVSHADE_FUZZ_WRITE_SEED="$ROOT/fuzz/corpus/$t" "$dir/fuzz/$t"
    done
    mkdir -p "$ROOT/fuzz/corpus/durable_fuzzer"
    KVSHADE_FUZZ_WRITE_SEED="$ROOT/fuzz/corpus/durable_fuzzer/sessions" "$dir/fuzz/durable_fuzzer"
    ;;
  *)
    sed -n '2,17p' "$0"
    exit 2
    ;;
esac

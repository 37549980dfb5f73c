#!/usr/bin/env bash
# Sanitizer builds and runs (tests/README.md "Sanitizers"): the service's unit tests and the
# integration tests (the real kvshade-server, built with the same sanitizer) under
# AddressSanitizer + UndefinedBehaviorSanitizer or ThreadSanitizer, with gcc (Debian's
# libraries work with it). Any report fails the run.
#
#   scripts/sanitize.sh build address|thread DIR [TARGETS...]
#        configure DIR with -DKVSHADE_SANITIZE=<kind> (no CUDA, no benchmarks, libraries
#        as unity builds: -DKVSHADE_UNITY=ON) and build
#        TARGETS (default: service_test integration_test)
#   scripts/sanitize.sh run DIR BINARY [GTEST ARGS...]
#        run DIR/tests/BINARY (service_test or integration_test) with the sanitizer options
#        below; exit 77 (ctest's skip code) when DIR has no such binary
#
# Options: ASan halts on the first error and checks leaks; UBSan prints a stack and halts;
# TSan halts on the first report, with tests/tsan.supp for races inside libraries that are
# not built with TSan (see the file), and ignores the memory accesses those libraries make
# through TSan's interceptors (ignore_noninstrumented_modules): without it, each 64 KiB
# copy that libstdc++ makes for gRPC out of a received message went through TSan's race
# report path (to be suppressed), and reading one large Ingest message took longer than
# the daemon's 30 s stream idle timeout.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

cmd="${1:-}"
case "$cmd" in
  build)
    kind="$2"; dir="$3"; shift 3
    targets=("$@")
    [ ${#targets[@]} -gt 0 ] || targets=(service_test integration_test)
    if [ ! -f "$dir/CMakeCache.txt" ]; then
      cmake -S "$ROOT" -B "$dir" -G Ninja -DKVSHADE_SANITIZE="$kind" -DKVSHADE_CUDA=OFF \
        -DKVSHADE_BUILD_BENCH=OFF -DKVSHADE_UNITY=ON >/dev/null
    fi
    cmake --build "$dir" --target "${targets[@]}" -j "${JOBS:-$(nproc)}"
    ;;
  run)
    dir="$2"; bin="$3"; shift 3
    [ -d "$dir" ] && dir="$(cd "$dir" && pwd)"
    exe="$dir/tests/$bin"
    [ -x "$exe" ] || exe="$dir/tests/integration/$bin"
    [ -x "$exe" ] || exe="$dir/tests/service/$bin"
    if [ ! -x "$exe" ]; then
      echo "sanitize.sh: no $bin in $dir (scripts/sanitize.sh build ...); skipped"
      exit 77
    fi
    symbolizer=/usr/lib/llvm-14/bin/llvm-symbolizer
    [ -x "$symbolizer" ] || symbolizer="$(command -v llvm-symbolizer || true)"
    export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0:detect_stack_use_after_return=0${ASAN_EXTRA:+:$ASAN_EXTRA}"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
    export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:ignore_noninstrumented_modules=1:suppressions=$ROOT/tests/tsan.supp${TSAN_EXTRA:+:$TSAN_EXTRA}"
    export LSAN_OPTIONS="suppressions=$ROOT/tests/lsan.supp"
    # UCX's memory-event hooks (libucm) intercept madvise and mmap; under TSan they crash
    # in thread teardown, and sanitizers track memory themselves: off.
    export UCX_MEM_EVENTS=no
    # Passive OpenMP waiting (unless set): under ctest other tests share the cores, which
    # spinning OpenMP threads take from them (tests/CMakeLists.txt, kvshade_add_test).
    export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
    # OpenMP (libgomp) and OpenBLAS threads synchronize in uninstrumented code (barriers),
    # so TSan would report their hand-offs as races: one thread each under TSan (our own
    # threads are what it checks).
    if grep -q '^KVSHADE_SANITIZE:STRING=thread' "$dir/CMakeCache.txt" 2>/dev/null; then
      export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    fi
    if [ -n "$symbolizer" ]; then
      export ASAN_SYMBOLIZER_PATH="$symbolizer" TSAN_SYMBOLIZER_PATH="$symbolizer"
    fi
    exec "$exe" "$@"
    ;;
  *)
    sed -n '2,19p' "$0"
    exit 2
    ;;
esac

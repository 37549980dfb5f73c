#!/usr/bin/env bash
# scripts/demo.sh (`make demo`) end to end, small: it passes over UCX and keeps the
# server's log in the build directory; and since that job is meant to run over UCX, it
# fails with exit 4 when the client falls back to gRPC (forced here by client transports
# that do not exist). ctest: integration.demo_script.
#   demo_script_test.sh SOURCE_DIR BUILD_DIR
set -u
SRC=$1
BUILD=$2
SMALL=(--doc-tokens 1024 --layers 2 --questions 2 --steps 2 --no-progress)
LOG="$(cd "$BUILD" && pwd)/demo-server.log"
fail() {
  echo "FAIL: $*" >&2
  exit 1
}

rm -f "$LOG"
out=$("$SRC/scripts/demo.sh" "$BUILD" "${SMALL[@]}" 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 0 ] || fail "demo.sh exited $rc"
grep -q "over UCX via" <<<"$out" || fail "the demo did not run over UCX"
grep -qF "its log: $LOG" <<<"$out" || fail "demo.sh did not say where the server's log is"
[ -s "$LOG" ] || fail "the server's log $LOG is gone or empty after the run"

out=$("$SRC/scripts/demo.sh" "$BUILD" "${SMALL[@]}" --ucx-transports no-such-transport 2>&1)
rc=$?
echo "$out"
[ "$rc" -eq 4 ] || fail "demo.sh exited $rc after a fallback to gRPC, expected 4"
grep -q "\[transport\] FAILED" <<<"$out" || fail "no [transport] FAILED line"
echo "demo_script_test: OK"

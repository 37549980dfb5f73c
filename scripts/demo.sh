#!/usr/bin/env bash
# `make demo`: starts kvshade-server on the CPU backend on a free loopback port with its
# UCX data plane on (`ucx.enable: true`), waits for grpc.health.v1 SERVING (`kvshade status
# --wait`), runs the synthetic prefix-cached document-QA workload (`kvshade demo --ucx`:
# this job is meant to run over UCX, so it fails, exit 4, if the client falls back to
# gRPC), then stops the server with SIGTERM (graceful drain). The server's log is kept in
# BUILD_DIR/demo-server.log. Exits with the demo's status (or the server's, if only the
# shutdown failed).
#   scripts/demo.sh [BUILD_DIR] [extra `kvshade demo` flags...]
#   KVSHADE_UCX_TRANSPORTS=tcp,self scripts/demo.sh   # UCX_TLS of both sides ("" = UCX's choice)
#   scripts/demo.sh build --no-ucx                    # the gRPC-inline path
set -euo pipefail
BUILD=${1:-build}
shift || true
SERVER="$BUILD/service/kvshade-server"
CLI="$BUILD/client/kvshade"
for bin in "$SERVER" "$CLI"; do
  if [ ! -x "$bin" ]; then
    echo "demo: $bin not found; build first (make build)" >&2
    exit 2
  fi
done

# The CPU backend's OpenMP threads wait passively: spinning barriers collapse throughput
# when the cores are shared with anything else (deploy/README.md, "CPU backend").
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvshade-demo.XXXXXX")
# The server's log outlives the run (WORK does not): one per build directory, replaced by
# the next run.
LOG="$(cd "$BUILD" && pwd)/demo-server.log"
SERVER_PID=""
stop_server() {
  # SIGTERM, then up to 30 s for the drain; SIGKILL only if it hangs.
  [ -n "$SERVER_PID" ] || return 0
  local rc=0
  if kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 300); do
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "demo: server did not stop within 30 s; killing it" >&2
      kill -KILL "$SERVER_PID" 2>/dev/null || true
    fi
  fi
  wait "$SERVER_PID" 2>/dev/null || rc=$?
  SERVER_PID=""
  return $rc
}
cleanup() {
  stop_server || true
  rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# The UCX data plane: transports UCX's choice unless KVSHADE_UCX_TRANSPORTS names them
# (e.g. tcp,self or shm,self); the same value goes to the client (`kvshade` reads the
# variable too).
UCX_TRANSPORTS=${KVSHADE_UCX_TRANSPORTS:-}
export KVSHADE_UCX_TRANSPORTS="$UCX_TRANSPORTS"
printf 'ucx:\n  enable: true\n  transports: "%s"\n' "$UCX_TRANSPORTS" >"$WORK/kvshade.yaml"

# Port 0: the kernel picks a free port; the server writes it to --port-file once bound.
"$SERVER" --config "$WORK/kvshade.yaml" --backend cpu --listen 127.0.0.1:0 --port-file "$WORK/port" \
  --host-budget 4GiB --device-budget 2GiB >"$LOG" 2>&1 &
SERVER_PID=$!
for _ in $(seq 300); do  # at most 30 s to bind
  [ -s "$WORK/port" ] && break
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then
    echo "demo: kvshade-server exited during start-up ($LOG):" >&2
    cat "$LOG" >&2
    exit 1
  fi
  sleep 0.1
done
if [ ! -s "$WORK/port" ]; then
  echo "demo: kvshade-server did not bind within 30 s ($LOG):" >&2
  cat "$LOG" >&2
  exit 1
fi
TARGET="127.0.0.1:$(cat "$WORK/port")"
UCX_SHOWN=${UCX_TRANSPORTS:-default}
echo "demo: kvshade-server (CPU backend, UCX data plane on, transports: $UCX_SHOWN) on $TARGET, log $LOG"
"$CLI" --target "$TARGET" status --wait 30

set +e
# --ucx: a fallback to gRPC fails the job; a later --no-ucx in "$@" still wins.
"$CLI" --target "$TARGET" demo --doc-tokens 32768 --layers 4 --questions 8 --steps 24 --ucx "$@"
DEMO_RC=$?
set -e
SERVER_RC=0
stop_server || SERVER_RC=$?
if [ "$SERVER_RC" -ne 0 ]; then
  echo "demo: kvshade-server exited with status $SERVER_RC on SIGTERM; its log ($LOG):" >&2
  cat "$LOG" >&2
fi
echo "demo: server stopped cleanly: $([ "$SERVER_RC" -eq 0 ] && echo yes || echo no); its log: $LOG"
if [ "$DEMO_RC" -ne 0 ]; then exit "$DEMO_RC"; fi
exit "$SERVER_RC"

#!/usr/bin/env bash
# Builds the kvshade image and checks it as a user would run it (deploy/README.md "Docker"):
# the image builds; the container starts as user kvshade and serves; its HEALTHCHECK command
# answers SERVING; `kvshade demo` (the CLI in the image) runs twice against the one
# long-lived server (the second run finds the document cached); /metrics answers; SIGTERM
# drains and the container exits 0. Run from the repository root:
#
#   deploy/docker/check.sh [docker|podman]      (default: docker if on PATH, else podman)
#
# Extra arguments for the build and run commands: BUILD_ARGS, RUN_ARGS (e.g. with podman
# where the build cannot make namespaces: BUILD_ARGS="--isolation chroot").
# Needs curl; ports 50551 and 9464 of the host must be free (the container uses the host
# network).
set -euo pipefail
engine="${1:-}"
if [ -z "$engine" ]; then
  if command -v docker >/dev/null; then engine=docker; else engine=podman; fi
fi
image="${IMAGE:-kvshade:check}"
name="kvshade-check-$$"
# shellcheck disable=SC2086
"$engine" build ${BUILD_ARGS:-} -f deploy/docker/Dockerfile -t "$image" .
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; }
trap cleanup EXIT
# shellcheck disable=SC2086
"$engine" run -d --name "$name" --network host ${RUN_ARGS:-} "$image" >/dev/null
ok=0
for _ in $(seq 60); do
  if "$engine" exec "$name" kvshade status --wait 1 >/dev/null 2>&1; then ok=1; break; fi
  sleep 1
done
if [ "$ok" != 1 ]; then
  echo "check.sh: the container did not become SERVING" >&2
  "$engine" logs "$name" >&2
  exit 1
fi
echo "== health: $("$engine" exec "$name" kvshade status --wait 3 | head -1)"
[ "$("$engine" exec "$name" id -u)" = 10001 ] || { echo "check.sh: not running as uid 10001" >&2; exit 1; }
for run in 1 2; do
  "$engine" exec "$name" kvshade demo --no-ucx > "/tmp/$name-demo-$run.log" 2>&1 \
    || { cat "/tmp/$name-demo-$run.log" >&2; echo "check.sh: demo run $run failed" >&2; exit 1; }
  echo "== demo run $run: $(tail -1 "/tmp/$name-demo-$run.log")"
  rm -f "/tmp/$name-demo-$run.log"
done
metrics="$(curl -s http://127.0.0.1:9464/metrics | grep -c '^kvshade_' || true)"
[ "${metrics:-0}" -gt 0 ] || { echo "check.sh: /metrics exported no kvshade_ series" >&2; exit 1; }
echo "== metrics: $metrics kvshade_ samples"
"$engine" stop -t 30 "$name" >/dev/null
code="$("$engine" inspect "$name" --format '{{.State.ExitCode}}')"
[ "$code" = 0 ] || { echo "check.sh: the container exited $code after SIGTERM" >&2; "$engine" logs "$name" >&2; exit 1; }
echo "== SIGTERM: drained, exit 0"
echo "check.sh: image $image passed"

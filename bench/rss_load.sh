#!/usr/bin/env bash
# Memory under load (a benchmark, not a test): the resident set of kvshade-server over a
# steady workload, sampled every 10 s. The workload is `kvshade demo` in a loop over 8
# documents in turn (seeds 0..7: after the first round every document is a cached prefix),
# each run creating question sessions, ingesting them, decoding and closing them. Prints
# one CSV line per sample (elapsed_s,rss_mib,demo_runs) and a summary: RSS after the
# warm-up (the first round of 8 documents), at the end, the maximum, and the growth after
# the warm-up.
#
#   bench/rss_load.sh [-d SECONDS] [-b BUILD_DIR] [-- extra kvshade-server flags]
#   (defaults: 600 s, build; CPU backend)
set -euo pipefail
duration=600
build=build
while getopts "d:b:" opt; do
  case "$opt" in
    d) duration=$OPTARG ;;
    b) build=$OPTARG ;;
    *) sed -n '2,13p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
server="$build/service/kvshade-server"
cli="$build/client/kvshade"
[ -x "$server" ] && [ -x "$cli" ] || { echo "rss_load: build $server and $cli first (make build)" >&2; exit 2; }
dir=$(mktemp -d)
"$server" --listen 127.0.0.1:0 --port-file "$dir/port" --backend cpu "$@" >"$dir/server.log" 2>&1 &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do [ -s "$dir/port" ] && break; sleep 0.1; done
target="127.0.0.1:$(cat "$dir/port")"
rss() { echo $(( $(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status") / 1024 )); }
runs=0
start=$(date +%s)
next=0
warm=""
max=0
echo "elapsed_s,rss_mib,demo_runs"
while :; do
  now=$(( $(date +%s) - start ))
  if [ "$now" -ge "$next" ]; then
    r=$(rss)
    [ "$r" -gt "$max" ] && max=$r
    echo "$now,$r,$runs"
    next=$(( next + 10 ))
  fi
  [ "$now" -ge "$duration" ] && break
  "$cli" -t "$target" demo --wait 10 --doc-tokens 4096 --questions 4 --steps 16 --seed $(( runs % 8 )) \
    >/dev/null 2>>"$dir/demo.err" || { echo "rss_load: demo failed:" >&2; tail -5 "$dir/demo.err" >&2; exit 1; }
  runs=$(( runs + 1 ))
  if [ -z "$warm" ] && [ "$runs" -eq 8 ]; then warm=$(rss); warm_at=$now; fi
done
end_rss=$(rss)
echo "summary: $runs demo runs in ${duration} s; RSS after the warm-up (8 runs, ${warm_at:-?} s) ${warm:-?} MiB, at the end ${end_rss} MiB, max ${max} MiB$( [ -n "$warm" ] && echo ", growth after the warm-up $(( (end_rss - warm) * 100 / warm ))%")"

#!/usr/bin/env bash
# deploy/systemd/kvshade.service: `systemd-analyze verify` reports nothing (an unknown or
# misspelt directive, a bad value or a missing executable is reported), and
# `systemd-analyze security --offline` rates its exposure at most 3.0 (of 10; "OK").
# ExecStart's /usr/local/bin/kvshade-server is pointed at the built binary for the check;
# ExecStartPre runs the real --check-config of the unit against deploy/kvshade.yaml.
# Exits 77 (skipped) without systemd-analyze. Usage: systemd_test.sh SOURCE_DIR KVSHADE_SERVER
set -euo pipefail
src=$1 server=$2
if ! command -v systemd-analyze > /dev/null; then
  echo "SKIPPED: systemd-analyze is not installed (Debian package systemd)"
  exit 77
fi
tmp=$(mktemp -d /tmp/kvshade-systemd-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
sed "s|/usr/local/bin/kvshade-server|$server|g" "$src/deploy/systemd/kvshade.service" > "$tmp/kvshade.service"
out=$(systemd-analyze verify "$tmp/kvshade.service" 2>&1) || { echo "$out"; echo "FAIL: verify exited non-zero"; exit 1; }
if [ -n "$out" ]; then echo "$out"; echo "FAIL: systemd-analyze verify reported the above"; exit 1; fi
systemd-analyze security --offline=yes --threshold=30 "$tmp/kvshade.service" > "$tmp/security.txt" 2>&1 \
  || { tail -20 "$tmp/security.txt"; echo "FAIL: exposure above 3.0"; exit 1; }
tail -1 "$tmp/security.txt"
# The unit's ExecStartPre, as systemd would run it, on the example configuration.
pre=$(sed -n 's|^ExecStartPre=||p' "$tmp/kvshade.service" | sed "s|/etc/kvshade/kvshade.yaml|$src/deploy/kvshade.yaml|")
env -i PATH=/usr/bin:/bin $pre > "$tmp/pre.txt" 2>&1 || { cat "$tmp/pre.txt"; echo "FAIL: ExecStartPre"; exit 1; }
grep -q "configuration OK" "$tmp/pre.txt" || { cat "$tmp/pre.txt"; echo "FAIL: no 'configuration OK'"; exit 1; }
echo "systemd_test: OK (verify clean, exposure within 3.0, ExecStartPre accepts deploy/kvshade.yaml)"

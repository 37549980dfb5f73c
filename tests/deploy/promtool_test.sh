#!/usr/bin/env bash
# deploy/prometheus with Debian's promtool: `promtool check rules` on the rule file and
# `promtool test rules` on its unit tests (a case per alert). Exits 77 (skipped) when
# promtool is not installed. Usage: promtool_test.sh SOURCE_DIR
set -euo pipefail
dir=$1/deploy/prometheus
if ! command -v promtool > /dev/null; then
  echo "SKIPPED: promtool is not installed (Debian package prometheus; scripts/install-deps.sh installs it)"
  exit 77
fi
promtool check rules "$dir/kvshade-rules.yml"
cd "$dir/tests" && promtool test rules kvshade-rules.test.yml

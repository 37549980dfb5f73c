#!/usr/bin/env bash
# deploy/helm/kvshade without Helm (not in Debian): rendered by helmrender (Go text/template
# + Debian's sprig + Helm's functions, tests/deploy/helmrender), checked by helm_check.py
# (selectors, probes, mounts, ServiceMonitor job, the ConfigMap through kvshade-server
# --check-config), then validated against the Kubernetes and prometheus-operator schemas of
# the npm packages kubernetes-models (tests/deploy/k8s-validate). Values: the defaults and
# helm-values-tls-tenants.yaml; TLS without its Secret must fail to render.
# Exits 77 (skipped) without Go and sprig; the schema step is skipped (said so) when npm
# cannot install its packages. Usage: helm_test.sh SOURCE_DIR BUILD_DIR KVSHADE_SERVER
set -euo pipefail
src=$1 build=$(cd "$2" && pwd) server=$3
here=$src/tests/deploy
chart=$src/deploy/helm/kvshade
py=/usr/bin/python3
if ! command -v go > /dev/null || [ ! -d /usr/share/gocode/src/github.com/Masterminds/sprig ]; then
  echo "SKIPPED: go or sprig missing (Debian golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev)"
  exit 77
fi
tools=$build/deploy-tools
mkdir -p "$tools/gopath/src"
rm -rf "$tools/gopath/src/helmrender" && cp -r "$here/helmrender" "$tools/gopath/src/"
GO111MODULE=off GOPATH=$tools/gopath:/usr/share/gocode GOCACHE=$tools/gocache GOFLAGS= \
  go build -o "$tools/helmrender" helmrender
tmp=$(mktemp -d /tmp/kvshade-helm-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

"$tools/helmrender" -name kvshade "$chart" > "$tmp/default.yaml"
"$tools/helmrender" -name edge -f "$here/helm-values-tls-tenants.yaml" "$chart" > "$tmp/tls.yaml"
"$py" "$here/helm_check.py" "$tmp/default.yaml" "$server" "$tmp/default.json"
"$py" "$here/helm_check.py" "$tmp/tls.yaml" "$server" "$tmp/tls.json"
printf 'tls:\n  enabled: true\n' > "$tmp/tls-no-secret.yaml"
if "$tools/helmrender" -f "$tmp/tls-no-secret.yaml" "$chart" > /dev/null 2> "$tmp/err.txt"; then
  echo "FAIL: tls.enabled without tls.existingSecret rendered"; exit 1
fi
grep -q "tls.existingSecret" "$tmp/err.txt" || { cat "$tmp/err.txt"; echo "FAIL: wrong error"; exit 1; }

# Schemas: the npm packages, installed once into the build directory from the lock file.
val=$tools/k8s-validate
if [ ! -d "$val/node_modules/kubernetes-models" ]; then
  mkdir -p "$val" && cp "$here/k8s-validate/package.json" "$here/k8s-validate/package-lock.json" "$val/"
  (cd "$val" && timeout 180 npm ci --no-audit --no-fund > "$tmp/npm.log" 2>&1) || true
fi
if [ -d "$val/node_modules/kubernetes-models" ] && command -v node > /dev/null; then
  cp "$here/k8s-validate/validate.mjs" "$val/"
  node "$val/validate.mjs" "$tmp/default.json"
  node "$val/validate.mjs" "$tmp/tls.json"
  echo "helm_test: OK (rendered, checked, schema-validated)"
else
  echo "helm_test: schema validation SKIPPED (npm could not install kubernetes-models: $(tail -1 "$tmp/npm.log" 2>/dev/null))"
  echo "helm_test: OK (rendered, checked)"
fi

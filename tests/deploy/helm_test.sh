#!/usr/bin/env bash
# deploy/helm/kvshade without Helm (not in Debian): rendered by helmrender (Go text/template
# + Debian's sprig + Helm's functions, tests/deploy/helmrender), checked by helm_check.py
# (selectors, probes, mounts, ServiceMonitor job, the ConfigMap through kvshade-server
# --check-config), then validated against the Kubernetes and prometheus-operator schemas of
# the npm packages kubernetes-models (tests/deploy/k8s-validate). Values: the defaults,
# helm-values-tls-tenants.yaml, helm-values-per-gpu.yaml (one daemon per GPU on a 4-GPU
# node: 4 containers, cuda:0..3, each with its own ports, config and spill directory) and
# helm-values-all-gpus.yaml (one daemon for every GPU: backend cuda:all, GPUs in PCI bus
# order); TLS without its Secret, per-GPU values that would make the daemons collide, and
# an all-GPU daemon with several containers or a binding KV-events endpoint must fail to
# render; NOTES.txt must render and name every daemon's port.
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
"$tools/helmrender" -name kvshade -f "$here/helm-values-per-gpu.yaml" "$chart" > "$tmp/per-gpu.yaml"
"$py" "$here/helm_check.py" "$tmp/per-gpu.yaml" "$server" "$tmp/per-gpu.json" 4
"$tools/helmrender" -name kvshade -f "$here/helm-values-all-gpus.yaml" "$chart" > "$tmp/all-gpus.yaml"
"$py" "$here/helm_check.py" "$tmp/all-gpus.yaml" "$server" "$tmp/all-gpus.json"
# One container, on backend cuda:all, numbering the GPUs in PCI bus order.
grep -q '^    backend: "cuda:all"' "$tmp/all-gpus.yaml" || { echo "FAIL: all-gpus: backend is not cuda:all"; exit 1; }
grep -A1 'name: CUDA_DEVICE_ORDER' "$tmp/all-gpus.yaml" | grep -q 'value: PCI_BUS_ID' \
  || { echo "FAIL: all-gpus: no CUDA_DEVICE_ORDER=PCI_BUS_ID"; exit 1; }
if grep -q 'name: CUDA_DEVICE_ORDER' "$tmp/default.yaml"; then
  echo "FAIL: default: CUDA_DEVICE_ORDER set for a one-GPU daemon"; exit 1
fi

# Values that must not render: each file, then a word its error must hold.
refused() {  # NAME WORD VALUES-YAML
  printf '%b' "$3" > "$tmp/$1.yaml"
  if "$tools/helmrender" -f "$tmp/$1.yaml" "$chart" > /dev/null 2> "$tmp/err.txt"; then
    echo "FAIL: $1 rendered"; exit 1
  fi
  grep -q -- "$2" "$tmp/err.txt" || { cat "$tmp/err.txt"; echo "FAIL: $1: the error does not name $2"; exit 1; }
}
refused tls-no-secret tls.existingSecret 'tls:\n  enabled: true\n'
refused per-gpu-zero gpusPerNode 'gpusPerNode: 0\n'
refused per-gpu-cpu "backend must be auto or cuda" 'gpusPerNode: 2\nbackend: cpu\n'
refused per-gpu-cuda-n "backend must be auto or cuda" 'gpusPerNode: 2\nbackend: "cuda:1"\n'
refused per-gpu-visible visibleDevices 'gpusPerNode: 2\ngpu:\n  visibleDevices: "0,1"\n'
refused per-gpu-listen env.KVSHADE_LISTEN 'gpusPerNode: 2\nenv:\n  KVSHADE_LISTEN: "0.0.0.0:50551"\n'
refused per-gpu-spill config.spill_path 'gpusPerNode: 2\nconfig:\n  spill_path: /var/lib/kvshade/x\n'
refused per-gpu-ports overlap 'gpusPerNode: 8\nservice:\n  grpcPort: 9460\n'
refused per-gpu-kv-events "kv_events.endpoint" 'gpusPerNode: 2\nconfig:\n  kv_events:\n    endpoint: "tcp://*:5557"\n'
refused per-gpu-broker descriptor_broker 'gpusPerNode: 2\nenv:\n  KVSHADE_SAME_NODE_DESCRIPTOR_BROKER: "@kvshade"\n'
refused all-gpus-per-gpu "choose one" 'gpusPerNode: 2\nbackend: "cuda:all"\n'
refused all-gpus-list-per-gpu "choose one" 'gpusPerNode: 2\nbackend: "cuda:0,cuda:1"\n'
refused all-gpus-kv-events "kv_events.endpoint" 'backend: "cuda:all"\nconfig:\n  kv_events:\n    endpoint: "tcp://*:5557"\n'
refused all-gpus-broker descriptor_broker 'backend: "cuda:all"\nenv:\n  KVSHADE_SAME_NODE_DESCRIPTOR_BROKER: "@kvshade"\n'

# NOTES.txt (which Helm prints and helmrender skips): rendered from a copy of the chart where
# it is a template, for the defaults and for the per-GPU values.
cp -r "$chart" "$tmp/chart" && mv "$tmp/chart/templates/NOTES.txt" "$tmp/chart/templates/notes.yaml"
"$tools/helmrender" -name kvshade "$tmp/chart" | sed -n '/templates\/notes.yaml/,$p' > "$tmp/notes.txt"
grep -q "kvshade.default.svc:50551" "$tmp/notes.txt" || { cat "$tmp/notes.txt"; echo "FAIL: NOTES"; exit 1; }
"$tools/helmrender" -name kvshade -f "$here/helm-values-per-gpu.yaml" "$tmp/chart" \
  | sed -n '/templates\/notes.yaml/,$p' > "$tmp/notes.txt"
for i in 0 1 2 3; do
  grep -q "GPU $i: kvshade.default.svc:5055$((1 + i))  (metrics $((9464 + i)))" "$tmp/notes.txt" \
    || { cat "$tmp/notes.txt"; echo "FAIL: NOTES does not name GPU $i's daemon"; exit 1; }
done
"$tools/helmrender" -name kvshade -f "$here/helm-values-all-gpus.yaml" "$tmp/chart" \
  | sed -n '/templates\/notes.yaml/,$p' > "$tmp/notes.txt"
grep -q "serves every GPU of its node (backend cuda:all" "$tmp/notes.txt" \
  || { cat "$tmp/notes.txt"; echo "FAIL: NOTES does not say the daemon serves every GPU"; exit 1; }

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
  node "$val/validate.mjs" "$tmp/per-gpu.json"
  node "$val/validate.mjs" "$tmp/all-gpus.json"
  echo "helm_test: OK (rendered, checked, schema-validated)"
else
  echo "helm_test: schema validation SKIPPED (npm could not install kubernetes-models: $(tail -1 "$tmp/npm.log" 2>/dev/null))"
  echo "helm_test: OK (rendered, checked)"
fi

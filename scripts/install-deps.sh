#!/usr/bin/env bash
# Installs the Debian packages kvshade builds and tests with (one list, one place), and Ruff
# from npm for the Python lint:
# `make test` and `.ci/run` call this. Idempotent: does nothing when all are present.
# --build-only: only what building needs (no test tools), for container builds.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config
  libgtest-dev libgmock-dev
  libabsl-dev
  libopenblas-dev liblapacke-dev
  libxxhash-dev
  librocksdb-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libucx-dev
  prometheus-cpp-dev
  libcli11-dev libspdlog-dev libyaml-cpp-dev libcpp-httplib-dev
  libssl-dev openssl
  # KV-events (service/kv_events.cc): ZMQ and msgpack's C++ headers; their test's subscriber.
  libzmq3-dev libmsgpack-dev python3-zmq python3-msgpack
  # Fuzz targets (fuzz/, scripts/fuzz.sh): clang with libFuzzer and the sanitizer runtimes;
  # llvm-14 for llvm-symbolizer (symbolized sanitizer reports).
  clang-14 libclang-rt-14-dev llvm-14
  # Python package tests (tests/python): numpy, torch for the attention-hook test, mypy for
  # the type check (python_typecheck); Node.js runs Ruff for the lint (python_lint; Ruff
  # itself comes from npm, below).
  python3 python3-numpy python3-torch python3-mypy nodejs
)
# Deployment and packaging tests (tests/deploy, tests/install): Prometheus and promtool
# (rules, dashboard), Python packaging with Debian's pip, setuptools and venv, and Go with
# Debian's sprig and yaml for the Helm chart's renderer.
PACKAGES+=(
  prometheus
  python3-pip python3-setuptools python3-venv
  golang-go golang-github-masterminds-sprig-dev golang-gopkg-yaml.v3-dev
)

# `install-deps.sh --build-only`: what building kvshade-server, the CLI and libkvshade
# needs (deploy/docker/Dockerfile's build stage): the list above less what only tests use.
TEST_ONLY=" libgtest-dev libgmock-dev ccache python3-numpy python3-torch python3-mypy nodejs clang-14 libclang-rt-14-dev llvm-14
  prometheus python3-pip python3-setuptools python3-venv golang-go golang-github-masterminds-sprig-dev
  golang-gopkg-yaml.v3-dev "
if [ "${1:-}" = "--build-only" ]; then
  kept=()
  for p in "${PACKAGES[@]}"; do
    case "$TEST_ONLY" in *[[:space:]]"$p"[[:space:]]*) ;; *) kept+=("$p") ;; esac
  done
  PACKAGES=("${kept[@]}")
fi

# One dpkg-query for the whole list (one per package took seconds); it exits 1 when any
# package is unknown to dpkg (never installed).
installed=" $({ dpkg-query -W -f='${Package} ${Status}\n' "${PACKAGES[@]}" 2>/dev/null || true; } |
  awk '/ install ok installed$/ {print $1}' | tr '\n' ' ') "
missing=()
for p in "${PACKAGES[@]}"; do
  case "$installed" in *" $p "*) ;; *) missing+=("$p") ;; esac
done
# Debian's own nodejs comes without npm (NodeSource's includes it): npm installs Ruff below.
if [ "${1:-}" != "--build-only" ] && ! command -v npm >/dev/null 2>&1; then
  missing+=(npm)
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Ruff for the Python lint (python_lint): its official WebAssembly build and a TOML reader,
# from npm at the versions scripts/ruff/package-lock.json pins, into scripts/ruff/node_modules
# (again only when the lock file changed).
if [ "${1:-}" != "--build-only" ]; then
  ruff_dir="$(cd "$(dirname "$0")" && pwd)/ruff"
  if [ ! -f "$ruff_dir/node_modules/.package-lock.json" ] ||
     [ "$ruff_dir/package-lock.json" -nt "$ruff_dir/node_modules/.package-lock.json" ]; then
    echo "install-deps: installing Ruff from npm (scripts/ruff)"
    npm ci --prefix "$ruff_dir" --no-audit --no-fund --loglevel=error
  fi
fi

#!/usr/bin/env bash
# client/python/pyproject.toml: the package installs with Debian's pip and setuptools,
# offline (no index, no build isolation, no dependencies fetched), into a --target
# directory and into a venv, and what is installed imports, reports the package's version
# in its metadata and talks to libkvshade. Usage: python_package_test.sh SOURCE_DIR LIBKVSHADE
set -euo pipefail
src=$1 libkvshade=$(realpath "$2")
py=/usr/bin/python3
tmp=$(mktemp -d /tmp/kvshade-pyproject-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
# setuptools builds in the source directory: build from a copy, so the checkout stays clean
# and concurrent runs do not meet.
cp -r "$src/client/python" "$tmp/src"
rm -rf "$tmp/src/build" "$tmp/src"/*.egg-info

check() {  # check PYTHON [PYTHONPATH]: import, metadata version, a call into the library
  local python=$1
  (cd "$tmp" && PYTHONPATH=${2:-} KVSHADE_LIB=$libkvshade "$python" - <<'PY'
import importlib.metadata, os, sys
import kvshade
where = os.path.dirname(kvshade.__file__)
assert "/src/" not in where, where
meta = importlib.metadata.version("kvshade")
assert meta == kvshade.__version__, (meta, kvshade.__version__)
from kvshade import _native
assert _native.lib().kvshade_abi_version() == _native.ABI_VERSION
print("kvshade", meta, "from", where)
PY
  )
}

"$py" -m pip install --no-deps --no-build-isolation --target "$tmp/target" "$tmp/src" > "$tmp/pip-target.log" 2>&1 \
  || { cat "$tmp/pip-target.log"; fail "pip install --target"; }
[ -e "$tmp/target/kvshade/__init__.py" ] || fail "--target holds no kvshade/"
for f in decoders/__init__.py decoders/local.py integrations/__init__.py integrations/hf_cache.py py.typed; do
  [ -e "$tmp/target/kvshade/$f" ] || fail "--target holds no kvshade/$f"
done
check "$py" "$tmp/target" || fail "the --target install does not work"

"$py" -m venv --system-site-packages "$tmp/venv" || fail "python3 -m venv"
"$tmp/venv/bin/python" -m pip install --no-deps --no-build-isolation "$tmp/src" > "$tmp/pip-venv.log" 2>&1 \
  || { cat "$tmp/pip-venv.log"; fail "pip install into a venv"; }
check "$tmp/venv/bin/python" || fail "the venv install does not work"
show=$("$tmp/venv/bin/python" -m pip show kvshade) || fail "pip show kvshade"
grep -q '^Requires: numpy' <<< "$show" || fail "metadata lacks the numpy requirement"
echo "python_package_test: OK (--target and venv installs import, metadata version matches)"

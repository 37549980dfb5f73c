#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then use what it installed as a user would:
# the binaries run (--version), a C program builds against libkvshade with pkg-config and
# with find_package(kvshade) (kvshade::client) and runs, and the installed Python package
# finds the installed library on its own. Usage: install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
tmp=$(mktemp -d /tmp/kvshade-install-test-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$prefix" > "$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
for f in bin/kvshade-server bin/kvshade include/kvshade/kvshade.h; do
  [ -e "$prefix/$f" ] || fail "$f not installed"
done
lib=$(dirname "$(find "$prefix" -name libkvshade.so.1 | head -1)")
[ -n "$lib" ] && [ -e "$lib/libkvshade.so" ] || fail "libkvshade.so.1 and its libkvshade.so link not installed"
# A build with CUDA: the CUDA backend's plugin beside the library, which links no CUDA library.
if [ -e "$build/client/libkvshade_cuda.so" ]; then
  [ -e "$lib/libkvshade_cuda.so" ] || fail "libkvshade_cuda.so (the CUDA backend plugin) not installed"
fi
if readelf -d "$lib/libkvshade.so.1" | grep -E '\(NEEDED\)' | grep -qE 'lib(cudart|cublas|cusolver)'; then
  fail "libkvshade.so.1 links a CUDA library"
fi
[ -e "$lib/pkgconfig/kvshade.pc" ] || fail "kvshade.pc not installed"
[ -e "$lib/cmake/kvshade/kvshadeConfig.cmake" ] || fail "kvshadeConfig.cmake not installed"
pkgdir=$(dirname "$(find "$prefix" -path '*dist-packages/kvshade/__init__.py' | head -1)")
[ -n "$pkgdir" ] && [ -e "$pkgdir/_native.py" ] || fail "Python package not installed"
[ -e "$pkgdir/decoders/local.py" ] && [ -e "$pkgdir/integrations/hf_cache.py" ] \
  || fail "the Python package's subpackages not installed"
# The installed binaries run from the prefix (no build-tree RPATH left behind).
v=$("$prefix/bin/kvshade-server" --version) || fail "kvshade-server --version exited $?"
case "$v" in "kvshade-server "*) ;; *) fail "kvshade-server --version printed '$v'";; esac
v=$("$prefix/bin/kvshade" --version) || fail "kvshade --version exited $?"
case "$v" in "kvshade "*) ;; *) fail "kvshade --version printed '$v'";; esac
if readelf -d "$prefix/bin/kvshade-server" | grep -E 'R(UN)?PATH' | grep -q "$build"; then
  fail "kvshade-server keeps the build tree in its RPATH"
fi

abi=$(sed -n 's/^#define KVSHADE_ABI_VERSION \([0-9]*\).*/\1/p' "$src/client/include/kvshade/kvshade.h")
mkdir -p "$tmp/hello"
cat > "$tmp/hello/hello.c" <<'C'
#include <stdio.h>
#include <kvshade/kvshade.h>
int main(void) {
  /* The header's ABI and the library's must agree; print the library's. */
  if (kvshade_abi_version() != KVSHADE_ABI_VERSION) return 3;
  printf("abi %d\n", kvshade_abi_version());
  return 0;
}
C

# pkg-config, from a prefix it has never seen (the .pc file is relocatable).
export PKG_CONFIG_PATH=$lib/pkgconfig
[ "$(pkg-config --modversion kvshade)" = "$(sed -n 's/^project(kvshade VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")" ] \
  || fail "pkg-config --modversion kvshade: $(pkg-config --modversion kvshade)"
# shellcheck disable=SC2046
cc -Wall -Werror -o "$tmp/hello/hello_pc" "$tmp/hello/hello.c" $(pkg-config --cflags --libs kvshade) \
  || fail "cc with pkg-config kvshade"
out=$(LD_LIBRARY_PATH=$lib "$tmp/hello/hello_pc") || fail "hello (pkg-config) exited $?"
[ "$out" = "abi $abi" ] || fail "hello (pkg-config) printed '$out', expected 'abi $abi'"

# find_package(kvshade) -> kvshade::client.
cat > "$tmp/hello/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(hello C)
find_package(kvshade 0.1 REQUIRED)
add_executable(hello_cmake hello.c)
target_link_libraries(hello_cmake PRIVATE kvshade::client)
CM
cmake -S "$tmp/hello" -B "$tmp/hello/build" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_C_COMPILER_LAUNCHER= > "$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; fail "find_package(kvshade)"; }
cmake --build "$tmp/hello/build" > "$tmp/cmake-build.log" 2>&1 || { cat "$tmp/cmake-build.log"; fail "build against kvshade::client"; }
out=$("$tmp/hello/build/hello_cmake") || fail "hello (find_package) exited $?"
[ "$out" = "abi $abi" ] || fail "hello (find_package) printed '$out', expected 'abi $abi'"

# The installed Python package loads the installed library by itself.
py=/usr/bin/python3
got=$(cd "$tmp" && env -u KVSHADE_LIB PYTHONPATH="$(dirname "$pkgdir")" "$py" -c \
  'import kvshade, os; print(os.path.realpath(kvshade.library_path()))') || fail "import the installed package"
case "$got" in "$(realpath "$lib")"/libkvshade.so*) ;; *) fail "the installed package loaded $got, not the prefix's library";; esac

echo "install_test: OK (prefix layout, --version, pkg-config and find_package builds print 'abi $abi', Python loads $got)"

#!/usr/bin/env bash
# Builds the CUDA-enabled test and benchmark binaries for Hopper (sm_90) and gathers them
# with the Debian shared libraries they need into one folder (default .gpu/), to run on a
# GPU machine that has the CUDA 13 runtime libraries but not our Debian packages.
# Excluded from the bundle: glibc, libstdc++, libgcc, the driver (libcuda) and CUDA's own
# libraries (cudart, cuBLAS, cuSOLVER...), which the GPU machine provides.
# Usage: scripts/gpu-bundle.sh [bundle-dir] [build-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE=${1:-.gpu}
BUILD=${2:-build-gpu}
# KVSHADE_BUNDLE_TARGETS (space-separated) narrows the bundle to some binaries.
read -r -a TARGETS <<< "${KVSHADE_BUNDLE_TARGETS:-kernels_gpu_test storage_gpu_test delivery_gpu_test \
kvshade_kernel_bench kvshade_select_bench kvshade_delivery_bench kvshade_ucx_bench kvshade-server kvshade kvshade_c}"

# KVSHADE_BUNDLE_REUSE=1 builds the targets in an existing CUDA-enabled build folder as it is
# configured (e.g. `make build`'s, which already compiles sm_90) instead of configuring a
# Release build.
if [ "${KVSHADE_BUNDLE_REUSE:-0}" != 1 ]; then
  cmake -S . -B "$BUILD" -G Ninja -DKVSHADE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_BUILD_TYPE=Release >/dev/null
fi
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for t in "${TARGETS[@]}"; do
  [ "$t" = kvshade_c ] && continue  # the C ABI library: below
  # The build's own binary, not one of a nested tree (scripts/sanitize.sh builds asan/ and
  # tsan/ trees inside the build folder): the shallowest match.
  f=$(find "$BUILD" -type f -name "$t" -perm -u+x | awk -F/ '{print NF, $0}' | sort -n | head -1 | cut -d' ' -f2-)
  cp "$f" "$BUNDLE/bin/"
  strip "$BUNDLE/bin/$t"
done
# The C ABI (for the Python package) and the Python package itself.
cp -L "$BUILD/client/libkvshade.so" "$BUNDLE/lib/"
# Its CUDA backend, which it loads from its own directory.
cp -L "$BUILD/client/libkvshade_cuda.so" "$BUNDLE/lib/"
mkdir -p "$BUNDLE/python"
cp -r client/python/kvshade "$BUNDLE/python/"
rm -rf "$BUNDLE/python/kvshade/__pycache__"
mkdir -p "$BUNDLE/lib/ucx"
cp -L /usr/lib/x86_64-linux-gnu/ucx/libuc[mst]_*.so* "$BUNDLE/lib/ucx/" 2>/dev/null || true
# Shared libraries named by ldd, minus the ones the GPU machine has.
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl|librt|libpthread|libstdc\+\+|libgcc_s|libcuda\.so|libcudart|libcublas|libcublasLt|libcusolver|libcusparse|libnvJitLink|libcufft|libcurand)'
for bin in "$BUNDLE"/bin/* "$BUNDLE/lib/libkvshade.so" "$BUNDLE/lib/libkvshade_cuda.so" "$BUNDLE"/lib/ucx/*; do
  ldd "$bin" | awk '/=>/ {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    [ -f "$path" ] && cp -L -n "$path" "$BUNDLE/lib/" || true
  done
done
strip --strip-unneeded "$BUNDLE"/lib/*.so* 2>/dev/null || true
cp scripts/gpu-run.sh "$BUNDLE/"
du -sh "$BUNDLE"

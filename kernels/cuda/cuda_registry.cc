// Entry points of the CUDA backend for the registry (common/registry.cc): device count
// and construction. Kept apart from the backend class so that the registry sees only
// cuda_backend.h (no CUDA headers).
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <cctype>
#include <memory>
#include <string>
#include <utility>

#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // "no device" / "no driver" is an answer, not a sticky fault
    return 0;
  }
  return n;
}

std::string CudaDevicePciBusId(int device) {
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, static_cast<int>(sizeof(id)), device) != cudaSuccess) {
    cudaGetLastError();  // an unknown ordinal is an answer, not a sticky fault
    return {};
  }
  std::string out(id);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(device);
  if (!backend.ok()) return backend.status();
  return std::unique_ptr<Backend>(std::move(backend).value());
}

}  // namespace kvshade::kernels

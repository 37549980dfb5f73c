// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend.h"

#include <cuda_runtime.h>

namespace kvshade::kernels {

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int) {
  return absl::UnimplementedError("cuda backend");
}

}  // namespace kvshade::kernels

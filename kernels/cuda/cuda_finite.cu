// FirstNonFinite on the CUDA backend: the index of the first NaN or infinity of a bf16 array
// in device memory. One thread per value in a grid-stride loop; a thread that finds one
// takes the minimum index with an atomic, so the result is the first index whatever order
// the blocks run in (deterministic). Bound by reading x once (HBM).
#include <algorithm>
#include <cstdint>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"

namespace kvshade::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void SetKernel(unsigned long long* first, unsigned long long value) { *first = value; }

__global__ void __launch_bounds__(kThreads)
FirstNonFiniteKernel(const uint16_t* __restrict__ x, size_t n, unsigned long long* first) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if ((x[i] & 0x7f80u) == 0x7f80u) {
      atomicMin(first, static_cast<unsigned long long>(i));
      return;  // this thread's later indices are larger
    }
  }
}

}  // namespace

absl::Status CudaBackend::FirstNonFinite(absl::Span<const bf16> x, absl::Span<int64_t> first,
                                         Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::FirstNonFinite(x.data(), x.size(), first.size()));
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  cudaStream_t s = cuda::ToCudaStream(stream);
  auto* out = reinterpret_cast<unsigned long long*>(first.data());
  SetKernel<<<1, 1, 0, s>>>(out, static_cast<unsigned long long>(x.size()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  if (x.empty()) return absl::OkStatus();
  const int blocks = int(std::min<size_t>(cuda::CeilDiv<size_t>(x.size(), kThreads), 4096));
  FirstNonFiniteKernel<<<blocks, kThreads, 0, s>>>(reinterpret_cast<const uint16_t*>(x.data()),
                                                  x.size(), out);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

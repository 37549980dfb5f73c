// ApplyRope on the CUDA backend: rotary position embedding of x [n, heads, d] bf16 in
// place, at absolute positions [n] int64 (device). Arithmetic is the CPU backend's
// (common/rope_math.h): angle and cos/sin in double rounded once to float, rotation in
// fp32 without FMA contraction, one bf16 rounding per element, so results match the CPU
// bit for bit except where CUDA's double sincos differs from glibc's in the last place.
// Each (token, pair) computes its cos/sin once and rotates that pair in every head.
#include <algorithm>
#include <cstdint>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"

namespace kvshade::kernels {
namespace {

using cuda::DeviceRope;

constexpr int kRopeThreads = 256;

//   x         : [n, heads, d] bf16, device, in place
//   positions : [n] int64, device, absolute token positions
// Block b covers tokens [b*tokens_per_block, ...), thread item = (token, pair).
__global__ void __launch_bounds__(kRopeThreads)
    RopeKernel(const __grid_constant__ DeviceRope rope, const long long* __restrict__ positions,
               int n, int heads, int d, int tokens_per_block, __nv_bfloat16* __restrict__ x) {
  const int half = rope.rotary_dim / 2;
  const int items = tokens_per_block * half;
  for (int item = threadIdx.x; item < items; item += blockDim.x) {
    const long long t = static_cast<long long>(blockIdx.x) * tokens_per_block + item / half;
    if (t >= n) break;
    const int pair = item % half;
    float c, s;
    cuda::RopeCosSin(rope, positions[t], pair, &c, &s);
    const int2 dims = cuda::RopePairDims(rope, pair);
    __nv_bfloat16* row = x + t * heads * d;
    for (int hh = 0; hh < heads; ++hh) {
      __nv_bfloat16* v = row + static_cast<long long>(hh) * d;
      float x0 = __bfloat162float(v[dims.x]);
      float x1 = __bfloat162float(v[dims.y]);
      cuda::RopeRotate(c, s, &x0, &x1);
      v[dims.x] = __float2bfloat16_rn(x0);
      v[dims.y] = __float2bfloat16_rn(x1);
    }
  }
}

}  // namespace

absl::Status CudaBackend::ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions,
                                    int heads, int d, absl::Span<bf16> x, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ApplyRope(rope, positions.size(), heads, d, x.size()));
  KVSHADE_ASSIGN_OR_RETURN(DeviceRope table, cuda::MakeDeviceRope(rope, d));
  const int n = static_cast<int>(positions.size());
  const int half = table.rotary_dim / 2;
  if (n == 0 || half == 0 || heads == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const int tokens_per_block = std::max(1, kRopeThreads / half);
  const int blocks = cuda::CeilDiv(n, tokens_per_block);
  static_assert(sizeof(long long) == sizeof(int64_t));
  RopeKernel<<<blocks, kRopeThreads, 0, cuda::ToCudaStream(stream)>>>(
      table, reinterpret_cast<const long long*>(positions.data()), n, heads, d,
      tokens_per_block, cuda::AsNv(x.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// TopK on the CUDA backend: per row of scores [rows, cols] f32, the k best eligible
// columns, best first, in the CPU backend's strict total order (cpu_topk.cc):
//   any number beats NaN; larger (largest=true) or smaller score first; equal scores
//   (+0 == -0, NaN == NaN) by lower column; masked columns are never chosen.
// Method: each element becomes one unsigned 64-bit key whose ascending order IS that
// order (order-preserving float bits, flipped for `largest`, -0 folded onto +0, NaN and
// masked entries mapped above every number, the column in the low bits), then CUB's
// segmented radix sort (one segment per row, only the bits in use) and a gather of the
// first k keys. Keys are unique, so the result is unique and deterministic.
//
// Difference from the CPU: a row with fewer than k eligible columns is not an error here
// (finding it needs the data, and a synchronizing check would stall the stream); its
// missing trailing entries are -1. Callers that need the CPU's InvalidArgument check the
// mask counts themselves.
//
// Workspace: keys in/out [rows, cols] u64, segment offsets [rows + 1] i32 and CUB's
// temporary storage. Cost: ~(32 + log2 cols)/6 radix passes over rows*cols keys; a
// rows=8, cols=16K call is a few tens of microseconds. rows*cols must fit an int32 (CUB).
#include <algorithm>
#include <climits>
#include <cstdint>

#include <cub/device/device_segmented_radix_sort.cuh>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"

namespace kvshade::kernels {
namespace {

constexpr uint32_t kNanKey = 0xFFFFFFFEu;     // after every number
constexpr uint32_t kMaskedKey = 0xFFFFFFFFu;  // after NaN; never output

// Bits needed for a column index in [0, cols).
int ColumnBits(int cols) {
  int bits = 0;
  while (bits < 31 && (int64_t{1} << bits) < cols) ++bits;
  return bits;
}

struct TopKPlan {
  uint64_t* keys_in = nullptr;   // [rows, cols]
  uint64_t* keys_out = nullptr;  // [rows, cols]
  int* offsets = nullptr;        // [rows + 1]
  void* cub_temp = nullptr;
  size_t cub_bytes = 0;
  size_t bytes = 0;
};

// Plans (base == nullptr: sizes only) the workspace; cub_bytes == 0 with an error status
// when CUB's size query fails.
absl::StatusOr<TopKPlan> PlanTopK(void* base, int rows, int cols, cudaStream_t stream) {
  TopKPlan p;
  const size_t items = size_t(rows) * cols;
  const int end_bit = 32 + ColumnBits(cols);
  KVSHADE_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
      nullptr, p.cub_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<int>(items), rows, static_cast<const int*>(nullptr),
      static_cast<const int*>(nullptr), 0, end_bit, stream));
  cuda::WorkspaceCarver c(base);
  p.keys_in = c.Take<uint64_t>(items);
  p.keys_out = c.Take<uint64_t>(items);
  p.offsets = c.Take<int>(size_t(rows) + 1);
  p.cub_temp = c.Take<std::byte>(std::max<size_t>(p.cub_bytes, 1));
  p.bytes = c.bytes();
  return p;
}

bool TopKPlannable(int rows, int cols) {
  return rows >= 1 && cols >= 1 && int64_t{rows} * cols <= INT_MAX;
}

//   scores : [rows, cols] f32;  mask : [rows, cols] u8 or null
//   keys   : [rows, cols] u64 out, (order key << col_bits) | col
__global__ void TopKKeysKernel(const float* __restrict__ scores, const uint8_t* __restrict__ mask,
                               int rows, int cols, int col_bits, bool largest,
                               uint64_t* __restrict__ keys, int* __restrict__ offsets) {
  const size_t items = size_t(rows) * cols;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < items; e += stride) {
    const uint32_t col = static_cast<uint32_t>(e % cols);
    uint32_t order;
    const float x = scores[e];
    if (mask != nullptr && mask[e] != 0) {
      order = kMaskedKey;
    } else if (isnan(x)) {
      order = kNanKey;
    } else {
      // Ascending-order bits: flip all bits of negatives, set the sign bit of positives.
      // +inf maps to 0xFF800000 and -inf (flipped for largest) likewise, below kNanKey.
      uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
      u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
      order = largest ? ~u : u;
    }
    keys[e] = (static_cast<uint64_t>(order) << col_bits) | col;
  }
  for (size_t r = size_t(blockIdx.x) * blockDim.x + threadIdx.x; r <= size_t(rows); r += stride) {
    offsets[r] = static_cast<int>(r * cols);
  }
}

//   sorted : [rows, cols] u64 (ascending per row);  out : [rows, k] i32
__global__ void TopKGatherKernel(const uint64_t* __restrict__ sorted, int rows, int cols, int k,
                                 int col_bits, int32_t* __restrict__ out) {
  const size_t total = size_t(rows) * k;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const uint64_t col_mask = (uint64_t{1} << col_bits) - 1;
  for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const size_t row = e / k, i = e % k;
    const uint64_t key = sorted[row * cols + i];
    out[e] = (key >> col_bits) == kMaskedKey ? -1 : static_cast<int32_t>(key & col_mask);
  }
}

}  // namespace

size_t CudaBackend::TopKWorkspaceBytes(int rows, int cols, int /*k*/) const {
  if (!TopKPlannable(rows, cols)) return 0;
  if (!cuda::UseDevice(device_).ok()) return 0;
  absl::StatusOr<TopKPlan> p = PlanTopK(nullptr, rows, cols, nullptr);
  return p.ok() ? p->bytes : 0;
}

absl::Status CudaBackend::TopK(absl::Span<const float> scores, absl::Span<const uint8_t> mask,
                               int rows, int cols, int k, bool largest, absl::Span<int32_t> out,
                               Workspace ws, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::TopK(scores.size(), mask.size(), rows, cols, k, out.size(),
                                         ws, TopKWorkspaceBytes(rows, cols, k)));
  if (rows == 0) return absl::OkStatus();
  if (int64_t{rows} * cols > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("TopK: rows*cols = ", int64_t{rows} * cols,
                                                   " exceeds the CUDA backend's limit ", INT_MAX));
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const cudaStream_t s = cuda::ToCudaStream(stream);
  KVSHADE_ASSIGN_OR_RETURN(TopKPlan p, PlanTopK(ws.data, rows, cols, s));
  if (p.bytes > ws.bytes) {
    return absl::InternalError(
        absl::StrCat("TopK: workspace plan needs ", p.bytes, " bytes, have ", ws.bytes));
  }
  const int col_bits = ColumnBits(cols);
  const size_t items = size_t(rows) * cols;
  const int threads = 256;
  const int blocks = static_cast<int>(std::clamp<size_t>(cuda::CeilDiv<size_t>(items, threads), 1, 4096));
  TopKKeysKernel<<<blocks, threads, 0, s>>>(scores.data(), mask.empty() ? nullptr : mask.data(),
                                            rows, cols, col_bits, largest, p.keys_in, p.offsets);
  KVSHADE_CUDA_LAUNCH_CHECK();
  size_t cub_bytes = p.cub_bytes;
  KVSHADE_CUDA_RETURN_IF_ERROR(cub::DeviceSegmentedRadixSort::SortKeys(
      p.cub_temp, cub_bytes, p.keys_in, p.keys_out, static_cast<int>(items), rows, p.offsets,
      p.offsets + 1, 0, 32 + col_bits, s));
  const size_t total = size_t(rows) * k;
  const int gblocks = static_cast<int>(std::clamp<size_t>(cuda::CeilDiv<size_t>(total, threads), 1, 4096));
  TopKGatherKernel<<<gblocks, threads, 0, s>>>(p.keys_out, rows, cols, k, col_bits, out.data());
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

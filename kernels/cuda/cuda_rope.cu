// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

absl::Status CudaBackend::ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions, int heads, int d, absl::Span<bf16> x, Stream) {
  return absl::UnimplementedError("ApplyRope");
}

}  // namespace kvshade::kernels

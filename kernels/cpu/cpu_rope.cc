// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

absl::Status CpuBackend::ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions, int heads, int d, absl::Span<bf16> x, Stream) {
  return absl::UnimplementedError("ApplyRope");
}

}  // namespace kvshade::kernels

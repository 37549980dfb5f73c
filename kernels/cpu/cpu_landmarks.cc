// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

absl::Status CpuBackend::BuildLandmarks(absl::Span<const bf16> kr, int n, int h, int d, int C, int n_chunks, absl::Span<bf16> landmarks, absl::Span<float> min_cos, Stream) {
  return absl::UnimplementedError("BuildLandmarks");
}

}  // namespace kvshade::kernels

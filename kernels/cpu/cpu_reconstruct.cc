// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::ReconstructWorkspaceBytes(const LayerShape& shape, int k, absl::Span<const ReconstructItem> items) const {
  return 0;
}

absl::Status CpuBackend::Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope, const ValueCodecSpec& codec, absl::Span<const ReconstructItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Reconstruct");
}

}  // namespace kvshade::kernels

// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

size_t CudaBackend::ReconstructWorkspaceBytes(const LayerShape& shape, int k, absl::Span<const ReconstructItem> items) const {
  return 0;
}

absl::Status CudaBackend::Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope, const ValueCodecSpec& codec, absl::Span<const ReconstructItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Reconstruct");
}

}  // namespace kvshade::kernels

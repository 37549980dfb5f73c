// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

size_t CudaBackend::AttendWorkspaceBytes(const LayerShape& shape, absl::Span<const AttendItem> items) const {
  return 0;
}

absl::Status CudaBackend::Attend(const LayerShape& shape, float scale, absl::Span<const AttendItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Attend");
}

}  // namespace kvshade::kernels

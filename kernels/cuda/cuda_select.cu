// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

size_t CudaBackend::SelectWorkspaceBytes(const LayerShape& shape, int k, absl::Span<const SelectItem> items) const {
  return 0;
}

absl::Status CudaBackend::Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Select");
}

}  // namespace kvshade::kernels

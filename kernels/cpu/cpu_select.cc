// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::SelectWorkspaceBytes(const LayerShape& shape, int k, absl::Span<const SelectItem> items) const {
  return 0;
}

absl::Status CpuBackend::Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Select");
}

}  // namespace kvshade::kernels

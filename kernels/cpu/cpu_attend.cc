// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::AttendWorkspaceBytes(const LayerShape& shape, absl::Span<const AttendItem> items) const {
  return 0;
}

absl::Status CpuBackend::Attend(const LayerShape& shape, float scale, absl::Span<const AttendItem> items, Workspace ws, Stream) {
  return absl::UnimplementedError("Attend");
}

}  // namespace kvshade::kernels

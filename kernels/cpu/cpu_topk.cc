// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::TopKWorkspaceBytes(int rows, int cols, int k) const {
  return 0;
}

absl::Status CpuBackend::TopK(absl::Span<const float> scores, absl::Span<const uint8_t> mask, int rows, int cols, int k, bool largest, absl::Span<int32_t> out, Workspace ws, Stream) {
  return absl::UnimplementedError("TopK");
}

}  // namespace kvshade::kernels

// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::ObservationWorkspaceBytes(int w, int n, const LayerShape& shape) const {
  return 0;
}

absl::Status CpuBackend::ObservationMass(absl::Span<const bf16> qobs, absl::Span<const int64_t> q_positions, int w, absl::Span<const bf16> kr, absl::Span<const int64_t> k_positions, int n, const LayerShape& shape, absl::Span<float> mass, Workspace ws, Stream) {
  return absl::UnimplementedError("ObservationMass");
}

absl::Status CpuBackend::ChunkSum(absl::Span<const float> mass, int h, int n, int C, int n_chunks, absl::Span<float> chunk_mass, Stream) {
  return absl::UnimplementedError("ChunkSum");
}

}  // namespace kvshade::kernels

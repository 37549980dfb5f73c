// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

size_t CudaBackend::ObservationWorkspaceBytes(int w, int n, const LayerShape& shape) const {
  return 0;
}

absl::Status CudaBackend::ObservationMass(absl::Span<const bf16> qobs, absl::Span<const int64_t> q_positions, int w, absl::Span<const bf16> kr, absl::Span<const int64_t> k_positions, int n, const LayerShape& shape, absl::Span<float> mass, Workspace ws, Stream) {
  return absl::UnimplementedError("ObservationMass");
}

absl::Status CudaBackend::ChunkSum(absl::Span<const float> mass, int h, int n, int C, int n_chunks, absl::Span<float> chunk_mass, Stream) {
  return absl::UnimplementedError("ChunkSum");
}

}  // namespace kvshade::kernels

// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

size_t CudaBackend::FactorizeWorkspaceBytes(int n, const LayerShape& shape, const FactorizeOptions& options) const {
  return 0;
}

absl::StatusOr<FactorizeResult> CudaBackend::Factorize(absl::Span<const bf16> k, int n, const LayerShape& shape, const FactorizeOptions& options, absl::Span<bf16> a, absl::Span<bf16> b, absl::Span<float> eigenvalues_host, Workspace ws, Stream) {
  return absl::UnimplementedError("Factorize");
}

size_t CudaBackend::ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const {
  return 0;
}

absl::StatusOr<ProjectionResult> CudaBackend::ProjectKeys(absl::Span<const bf16> k, int n, const LayerShape& shape, absl::Span<const bf16> b, int r, absl::Span<bf16> a, Workspace ws, Stream) {
  return absl::UnimplementedError("ProjectKeys");
}

}  // namespace kvshade::kernels

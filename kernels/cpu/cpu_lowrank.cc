// PENDING IMPLEMENTATION (scaffold).
#include "cpu/cpu_backend.h"

namespace kvshade::kernels {

size_t CpuBackend::FactorizeWorkspaceBytes(int n, const LayerShape& shape, const FactorizeOptions& options) const {
  return 0;
}

absl::StatusOr<FactorizeResult> CpuBackend::Factorize(absl::Span<const bf16> k, int n, const LayerShape& shape, const FactorizeOptions& options, absl::Span<bf16> a, absl::Span<bf16> b, absl::Span<float> eigenvalues_host, Workspace ws, Stream) {
  return absl::UnimplementedError("Factorize");
}

size_t CpuBackend::ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const {
  return 0;
}

absl::StatusOr<ProjectionResult> CpuBackend::ProjectKeys(absl::Span<const bf16> k, int n, const LayerShape& shape, absl::Span<const bf16> b, int r, absl::Span<bf16> a, Workspace ws, Stream) {
  return absl::UnimplementedError("ProjectKeys");
}

}  // namespace kvshade::kernels

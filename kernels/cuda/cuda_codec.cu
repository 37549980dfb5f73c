// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

absl::Status CudaBackend::EncodeValueChunks(absl::Span<const bf16> v, int n, int h, int d, int C, int n_chunks, const ValueCodecSpec& spec, absl::Span<std::byte> out, Stream) {
  return absl::UnimplementedError("EncodeValueChunks");
}

absl::Status CudaBackend::DecodeValueChunks(absl::Span<const std::byte> encoded, int m, int C, int d, const ValueCodecSpec& spec, absl::Span<bf16> out, Stream) {
  return absl::UnimplementedError("DecodeValueChunks");
}

absl::Status CudaBackend::KiviQuantize(absl::Span<const bf16> x, const KiviLayout& layout, absl::Span<uint32_t> codes, absl::Span<fp16> scale, absl::Span<fp16> mn, Stream) {
  return absl::UnimplementedError("KiviQuantize");
}

absl::Status CudaBackend::KiviDequantize(absl::Span<const uint32_t> codes, absl::Span<const fp16> scale, absl::Span<const fp16> mn, const KiviLayout& layout, absl::Span<bf16> x, Stream) {
  return absl::UnimplementedError("KiviDequantize");
}

}  // namespace kvshade::kernels

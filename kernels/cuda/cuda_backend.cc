// PENDING IMPLEMENTATION (scaffold).
#include "cuda/cuda_backend_impl.h"

namespace kvshade::kernels {

CudaBackend::~CudaBackend() = default;

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(int device) {
  return absl::UnimplementedError("cuda backend");
}

absl::StatusOr<Buffer> CudaBackend::Allocate(size_t bytes) {
  return absl::UnimplementedError("Allocate");
}

absl::StatusOr<Buffer> CudaBackend::AllocateHostVisible(size_t bytes) {
  return absl::UnimplementedError("AllocateHostVisible");
}

absl::Status CudaBackend::CopyFromHost(void* dst, const void* src_host, size_t bytes, Stream) {
  return absl::UnimplementedError("CopyFromHost");
}

absl::Status CudaBackend::CopyToHost(void* dst_host, const void* src, size_t bytes, Stream) {
  return absl::UnimplementedError("CopyToHost");
}

absl::Status CudaBackend::Fill(void* dst, uint8_t byte, size_t bytes, Stream) {
  return absl::UnimplementedError("Fill");
}

absl::StatusOr<Stream> CudaBackend::CreateStream() {
  return absl::UnimplementedError("CreateStream");
}

absl::Status CudaBackend::DestroyStream(Stream) {
  return absl::UnimplementedError("DestroyStream");
}

absl::Status CudaBackend::Synchronize(Stream) {
  return absl::UnimplementedError("Synchronize");
}

}  // namespace kvshade::kernels

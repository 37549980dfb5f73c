// CPU backend memory: ordinary aligned host memory (64-byte alignment for vector loads).
// Host-visible memory is the same thing on this backend.
#include "cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace kvshade::kernels {
namespace {
constexpr size_t kAlignment = 64;
}

absl::StatusOr<Buffer> CpuBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

absl::StatusOr<Buffer> CpuBackend::AllocateHostVisible(size_t bytes) { return Allocate(bytes); }

absl::Status CpuBackend::CopyFromHost(void* dst, const void* src_host, size_t bytes, Stream) {
  if (bytes != 0 && (dst == nullptr || src_host == nullptr)) {
    return absl::InvalidArgumentError("CopyFromHost: null pointer");
  }
  if (bytes != 0) std::memcpy(dst, src_host, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyToHost(void* dst_host, const void* src, size_t bytes, Stream) {
  return CopyFromHost(dst_host, src, bytes, {});
}

absl::Status CpuBackend::Fill(void* dst, uint8_t byte, size_t bytes, Stream) {
  if (bytes != 0 && dst == nullptr) return absl::InvalidArgumentError("Fill: null pointer");
  if (bytes != 0) std::memset(dst, byte, bytes);
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

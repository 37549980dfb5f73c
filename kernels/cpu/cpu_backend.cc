// CPU backend memory: ordinary aligned host memory (64-byte alignment for vector loads).
// Host-visible memory is the same thing on this backend.
#include "cpu/cpu_backend.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>


#include "absl/strings/str_cat.h"
#include "kvshade/base/bf16.h"
#include "kvshade/base/status_macros.h"
#include "common/validate.h"
#include "kvshade/kernels/shared_memory.h"

namespace kvshade::kernels {
namespace {
constexpr size_t kAlignment = 64;
}

absl::StatusOr<Buffer> CpuBackend::Allocate(size_t bytes) {
  if (bytes == 0) return Buffer();
  if (shared_) return AllocateSharedHost(bytes);  // page-aligned
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
  }
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

absl::StatusOr<Buffer> CpuBackend::AllocateHostVisible(size_t bytes) { return Allocate(bytes); }

absl::StatusOr<Buffer> CpuBackend::AllocateStaging(size_t bytes) {
  if (bytes == 0) return Buffer();
  // MAP_POPULATE faults every page in now rather than on first use.
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                 -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cpu: cannot map ", bytes, " staging bytes: ", std::strerror(errno)));
  }
  return Buffer(p, bytes, [bytes](void* q) { munmap(q, bytes); });
}

absl::Status CpuBackend::CopyFromHost(void* dst, const void* src_host, size_t bytes, Stream) {
  if (bytes != 0 && (dst == nullptr || src_host == nullptr)) {
    return absl::InvalidArgumentError("CopyFromHost: null pointer");
  }
  if (bytes != 0) std::memcpy(dst, src_host, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Copy(void* dst, const void* src, size_t bytes, Stream) {
  if (bytes != 0 && (dst == nullptr || src == nullptr)) {
    return absl::InvalidArgumentError("Copy: null pointer");
  }
  if (bytes != 0) std::memmove(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                                size_t width, size_t height, Stream) {
  if (width == 0 || height == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) return absl::InvalidArgumentError("Copy2D: null pointer");
  if (dst_pitch < width || src_pitch < width) {
    return absl::InvalidArgumentError(absl::StrCat("Copy2D: pitches (", dst_pitch, ", ", src_pitch,
                                                   ") must be >= width = ", width));
  }
  for (size_t i = 0; i < height; ++i) {
    std::memmove(static_cast<char*>(dst) + i * dst_pitch,
                 static_cast<const char*>(src) + i * src_pitch, width);
  }
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

absl::Status CpuBackend::FirstNonFinite(absl::Span<const bf16> x, absl::Span<int64_t> first,
                                        Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::FirstNonFinite(x.data(), x.size(), first.size()));
  first[0] = static_cast<int64_t>(
      base::FirstNonFiniteBf16Bits(reinterpret_cast<const uint16_t*>(x.data()), x.size()));
  return absl::OkStatus();
}

absl::Status CpuBackend::CopyRows(const void* src, void* dst, size_t row_bytes, int n,
                                  const int64_t* src_rows, const int64_t* dst_rows, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::CopyRows(src, dst, row_bytes, n, src_rows, dst_rows));
  const auto* s = static_cast<const std::byte*>(src);
  auto* d = static_cast<std::byte*>(dst);
  for (int i = 0; i < n; ++i) {
    std::memcpy(d + dst_rows[i] * row_bytes, s + src_rows[i] * row_bytes, row_bytes);
  }
  return absl::OkStatus();
}

absl::StatusOr<PeerBuffer> CpuBackend::OpenPeerBuffer(std::string_view) {
  return absl::FailedPreconditionError(
      "CUDA IPC buffers need the CUDA backend (this daemon runs the cpu backend)");
}

absl::Status CpuBackend::ClosePeerBuffer(const PeerBuffer&) {
  return absl::FailedPreconditionError("cpu backend: there are no peer buffers to close");
}

}  // namespace kvshade::kernels

namespace kvshade::kernels {

absl::StatusOr<ExportedMemory> CpuBackend::ExportMemory(const void* p) {
  if (std::optional<ExportedMemory> m = ExportSharedHost(p)) return *m;
  return absl::FailedPreconditionError(
      "cpu: this memory is not shareable (the backend was not set up for same-node export)");
}

absl::StatusOr<ImportedMemory> CpuBackend::ImportMemory(const ExportedMemory& m) {
  if (m.kind != ExportedMemory::Kind::kHostFile) {
    return absl::FailedPreconditionError(
        "cpu: cannot map device memory or CUDA host memory of another process (the daemon "
        "runs on a GPU backend; open the worker with the cuda backend)");
  }
  return MapSharedHostRegion(m);
}

absl::Status CpuBackend::ReleaseImported(const ImportedMemory& m) {
  UnmapSharedHostRegion(m);
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

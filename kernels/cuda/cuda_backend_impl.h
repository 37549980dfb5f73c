// The CUDA backend: one instance per device, owning its default stream and the cuBLAS and
// cuSOLVER handles (ggml-style device context). Memory space: device. Each op lives in its
// own cuda_<op>.cu; this header declares the class once. Tested against the CPU reference.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>

#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

class CudaBackend final : public Backend {
 public:
  // Binds to `device`; use CreateCudaBackend (cuda_backend.h).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string_view name() const override { return "cuda"; }
  absl::Status DeviceFault() const override;
  MemorySpace space() const override { return MemorySpace::kDevice; }
  int device() const { return device_; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  absl::StatusOr<Buffer> AllocateHostVisible(size_t bytes) override;
  absl::StatusOr<Buffer> AllocateStaging(size_t bytes) override;
  absl::Status CopyFromHost(void* dst, const void* src_host, size_t bytes, Stream) override;
  absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes, Stream) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream) override;
  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                      size_t width, size_t height, Stream) override;
  absl::Status Fill(void* dst, uint8_t byte, size_t bytes, Stream) override;
  absl::StatusOr<Stream> CreateStream() override;
  absl::Status DestroyStream(Stream) override;
  absl::Status Synchronize(Stream) override;
  absl::Status FirstNonFinite(absl::Span<const bf16> x, absl::Span<int64_t> first,
                              Stream stream) override;
  absl::Status CopyRows(const void* src, void* dst, size_t row_bytes, int n,
                        const int64_t* src_rows, const int64_t* dst_rows, Stream) override;
  absl::StatusOr<PeerBuffer> OpenPeerBuffer(std::string_view handle) override;
  absl::Status ClosePeerBuffer(const PeerBuffer& buffer) override;
  void EnableSharedMemory(SharedHostMemory how) override {
    shared_ = true;
    shared_how_ = how;
  }
  absl::StatusOr<ExportedMemory> ExportMemory(const void* p) override;
  absl::StatusOr<ImportedMemory> ImportMemory(const ExportedMemory& m) override;
  absl::Status ReleaseImported(const ImportedMemory& m) override;

  absl::Status ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions, int heads,
                         int d, absl::Span<bf16> x, Stream) override;

  size_t FactorizeWorkspaceBytes(int n, const LayerShape& shape,
                                 const FactorizeOptions& options) const override;
  absl::StatusOr<FactorizeResult> Factorize(absl::Span<const bf16> k, int n,
                                            const LayerShape& shape,
                                            const FactorizeOptions& options, absl::Span<bf16> a,
                                            absl::Span<bf16> b, absl::Span<float> eigenvalues_host,
                                            Workspace ws, Stream) override;
  size_t ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const override;
  absl::StatusOr<ProjectionResult> ProjectKeys(absl::Span<const bf16> k, int n,
                                               const LayerShape& shape, absl::Span<const bf16> b,
                                               int r, absl::Span<bf16> a, Workspace ws,
                                               Stream) override;

  absl::Status BuildLandmarks(absl::Span<const bf16> kr, int n, int h, int d, int C, int n_chunks,
                              absl::Span<bf16> landmarks, absl::Span<float> min_cos,
                              Stream) override;
  absl::Status EncodeSignatures(absl::Span<const bf16> kr, absl::Span<const bf16> landmarks, int h,
                                int d, int C, int n_chunks, int bits, absl::Span<std::byte> sig,
                                Stream) override;
  size_t TopKWorkspaceBytes(int rows, int cols, int k) const override;
  absl::Status TopK(absl::Span<const float> scores, absl::Span<const uint8_t> mask, int rows,
                    int cols, int k, bool largest, absl::Span<int32_t> out, Workspace ws,
                    Stream) override;

  size_t ObservationWorkspaceBytes(int w, int n, const LayerShape& shape) const override;
  absl::Status ObservationMass(absl::Span<const bf16> qobs, absl::Span<const int64_t> q_positions,
                               int w, absl::Span<const bf16> kr,
                               absl::Span<const int64_t> k_positions, int n,
                               const LayerShape& shape, absl::Span<float> mass, Workspace ws,
                               Stream) override;
  absl::Status ChunkSum(absl::Span<const float> mass, int h, int n, int C, int n_chunks,
                        absl::Span<float> chunk_mass, Stream) override;

  absl::Status EncodeValueChunks(absl::Span<const bf16> v, int n, int h, int d, int C,
                                 int n_chunks, const ValueCodecSpec& spec,
                                 absl::Span<std::byte> out, Stream) override;
  absl::Status DecodeValueChunks(absl::Span<const std::byte> encoded, int m, int C, int d,
                                 const ValueCodecSpec& spec, absl::Span<bf16> out,
                                 Stream) override;
  absl::Status KiviQuantize(absl::Span<const bf16> x, const KiviLayout& layout,
                            absl::Span<uint32_t> codes, absl::Span<fp16> scale,
                            absl::Span<fp16> mn, Stream) override;
  absl::Status KiviDequantize(absl::Span<const uint32_t> codes, absl::Span<const fp16> scale,
                              absl::Span<const fp16> mn, const KiviLayout& layout,
                              absl::Span<bf16> x, Stream) override;

  size_t SelectWorkspaceBytes(const LayerShape& shape, int k,
                              absl::Span<const SelectItem> items) const override;
  absl::Status Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                      Workspace ws, Stream) override;
  size_t SelectExWorkspaceBytes(const LayerShape& shape, int k, const SelectOptions& options,
                                absl::Span<const SelectItem> items) const override;
  absl::Status SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                        absl::Span<const SelectItem> items, Workspace ws, Stream) override;
  size_t AssignSlotsWorkspaceBytes(const LayerShape& shape, int k,
                                   absl::Span<const SelectItem> items) const override;
  absl::Status AssignSlots(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                           Workspace ws, Stream) override;
  size_t ReconstructWorkspaceBytes(const LayerShape& shape, int k,
                                   absl::Span<const ReconstructItem> items) const override;
  absl::Status Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                           const ValueCodecSpec& codec, absl::Span<const ReconstructItem> items,
                           Workspace ws, Stream) override;

  size_t AttendWorkspaceBytes(const LayerShape& shape,
                              absl::Span<const AttendItem> items) const override;
  absl::Status Attend(const LayerShape& shape, float scale, absl::Span<const AttendItem> items,
                      Workspace ws, Stream) override;

 private:
  // Live allocations of Allocate (base -> bytes): ExportMemory names the one holding a
  // pointer (shared with the release callbacks, which may outlive the backend).
  struct DeviceAllocations {
    struct Allocation {
      size_t bytes = 0;
      uint64_t id = 0;  // never reused (a later allocation at the same address gets another)
      // Its CUDA IPC handle once ExportMemory has asked for it (empty before): an export
      // names the same allocation for many pointers, and a handle holds for the
      // allocation's life.
      std::string ipc_handle;
    };
    std::mutex mu;
    std::map<uintptr_t, Allocation> by_base;
    uint64_t next_id = 1;
  };
  std::shared_ptr<DeviceAllocations> allocs_ = std::make_shared<DeviceAllocations>();
  bool shared_ = false;  // EnableSharedMemory: host-visible memory is shareable
  SharedHostMemory shared_how_ = SharedHostMemory::kAuto;
  explicit CudaBackend(int device) : device_(device) {}
  int device_ = 0;
  // Staging memory (AllocateStaging) of Factorize's host eigensolve (common/subspace_host.h),
  // kept for reuse: a call takes a buffer and gives it back, so concurrent calls never share
  // one. A call that fails on the way simply frees its buffer.
  absl::StatusOr<Buffer> TakeHostScratch(size_t bytes);
  void ReturnHostScratch(Buffer scratch);
  std::mutex host_scratch_mu_;
  std::vector<Buffer> host_scratch_;
  // Handles bound to the default stream; ops on other streams rebind with
  // cublasSetStream / cusolverDnSetStream (filled in by Create).
  cublasHandle_t cublas_ = nullptr;
  cusolverDnHandle_t cusolver_ = nullptr;
};

}  // namespace kvshade::kernels

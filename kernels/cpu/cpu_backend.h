// The CPU reference backend: the embedded default and the oracle every other backend is
// tested against. Multi-threaded with OpenMP; dense linear algebra through OpenBLAS and
// LAPACKE (ssyrk/ssyevd, the same algorithm as the CUDA path). Memory space: host.
// Each op lives in its own cpu_<op>.cc; this header declares the class once.
#pragma once

#include <memory>

#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// RoPE cos/sin tables this backend reuses across calls (cpu_rope.cc).
class CosSinCache;
std::shared_ptr<CosSinCache> NewCosSinCache();

class CpuBackend final : public Backend {
 public:
  CpuBackend() = default;

  std::string_view name() const override { return "cpu"; }
  MemorySpace space() const override { return MemorySpace::kHost; }

  absl::StatusOr<Buffer> Allocate(size_t bytes) override;
  absl::StatusOr<Buffer> AllocateHostVisible(size_t bytes) override;
  absl::StatusOr<Buffer> AllocateStaging(size_t bytes) override;
  absl::Status CopyFromHost(void* dst, const void* src_host, size_t bytes, Stream) override;
  absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes, Stream) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream) override;
  absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                      size_t width, size_t height, Stream) override;
  absl::Status Fill(void* dst, uint8_t byte, size_t bytes, Stream) override;
  absl::StatusOr<Stream> CreateStream() override { return Stream{}; }
  absl::Status DestroyStream(Stream) override { return absl::OkStatus(); }
  absl::Status Synchronize(Stream) override { return absl::OkStatus(); }
  absl::Status FirstNonFinite(absl::Span<const bf16> x, absl::Span<int64_t> first,
                              Stream) override;
  absl::Status CopyRows(const void* src, void* dst, size_t row_bytes, int n,
                        const int64_t* src_rows, const int64_t* dst_rows, Stream) override;
  absl::StatusOr<PeerBuffer> OpenPeerBuffer(std::string_view handle) override;
  absl::Status ClosePeerBuffer(const PeerBuffer& buffer) override;
  void EnableSharedMemory(SharedHostMemory) override { shared_ = true; }  // always files
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
  std::shared_ptr<CosSinCache> rope_cache_ = NewCosSinCache();
 private:
  bool shared_ = false;  // EnableSharedMemory: Allocate from shared memory files
};

}  // namespace kvshade::kernels

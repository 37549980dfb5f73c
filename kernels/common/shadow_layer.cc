// CompressShadowLayer: docs/ALGORITHM.md "Prefill / ingest" steps 1-7 for one layer of one
// segment, composed from Backend ops (layouts in shadow_layer.h).
//
// Order of work: positions; Factorize(K_pre) -> A, B; Kr = RoPE(K_pre); BuildLandmarks(Kr)
// -> landmarks, min-cosine; TopK(smallest min-cosine, sink masked) -> outliers;
// [ObservationMass(Qobs, Kr) -> ChunkSum -> TopK(largest, static masked) -> heavy chunks];
// EncodeValueChunks(V) -> host-visible store; then the static set and the tail are gathered.
// Everything stays in backend memory: the post-RoPE keys are a device copy of K_pre, the
// static set and the INT2 heavy rows are gathered with CopyRows, the tail with Copy, and the values
// are encoded into host-visible memory (the caller's block when values_out is given, e.g.
// the host value store's slab); a device encodes slices in its own memory and copies each
// out by DMA. Only small things cross to the host: the outlier/heavy chunk ids (TopK
// results) and the eigenvalues.
#include "kvshade/kernels/shadow_layer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("CompressShadowLayer: ", what));
}

// The backend plus where the composite's buffers come from (see Allocator).
struct Mem {
  Backend& be;
  Allocator* allocator;
  absl::StatusOr<Buffer> Alloc(size_t bytes, BufferKind kind) {
    return allocator != nullptr ? allocator->Allocate(bytes, kind) : be.Allocate(bytes);
  }
};

template <typename T>
absl::StatusOr<Buffer> AllocElems(Mem& mem, size_t count, BufferKind kind) {
  return mem.Alloc(count * sizeof(T), kind);
}

template <typename T>
absl::StatusOr<Buffer> Upload(Mem& mem, const T* host, size_t count, BufferKind kind,
                              Stream stream) {
  KVSHADE_ASSIGN_OR_RETURN(Buffer buf, mem.Alloc(count * sizeof(T), kind));
  if (count > 0) {
    KVSHADE_RETURN_IF_ERROR(mem.be.CopyFromHost(buf.data(), host, count * sizeof(T), stream));
  }
  return buf;
}

template <typename T>
absl::Span<T> SpanOf(const Buffer& b, size_t count) {
  return absl::Span<T>(static_cast<T*>(b.data()), count);
}

// Per-head TopK on the backend, downloaded and sorted ascending per head.
absl::StatusOr<std::vector<int32_t>> TopKChunks(Mem& mem, const Buffer& scores,
                                                const std::vector<uint8_t>& mask, int h,
                                                int n_chunks, int k, bool largest,
                                                Stream stream) {
  Backend& be = mem.be;
  KVSHADE_ASSIGN_OR_RETURN(Buffer mask_buf,
                           Upload(mem, mask.data(), mask.size(), BufferKind::kScratch, stream));
  KVSHADE_ASSIGN_OR_RETURN(Buffer out,
                           AllocElems<int32_t>(mem, size_t(h) * k, BufferKind::kScratch));
  KVSHADE_ASSIGN_OR_RETURN(Buffer ws, mem.Alloc(be.TopKWorkspaceBytes(h, n_chunks, k),
                                                BufferKind::kScratch));
  KVSHADE_RETURN_IF_ERROR(be.TopK(SpanOf<const float>(scores, size_t(h) * n_chunks),
                                  SpanOf<const uint8_t>(mask_buf, mask.size()), h, n_chunks, k,
                                  largest, SpanOf<int32_t>(out, size_t(h) * k), ws.workspace(),
                                  stream));
  std::vector<int32_t> ids(size_t(h) * k);
  KVSHADE_RETURN_IF_ERROR(be.Synchronize(stream));
  KVSHADE_RETURN_IF_ERROR(be.CopyToHost(ids.data(), out.data(), ids.size() * sizeof(int32_t), stream));
  KVSHADE_RETURN_IF_ERROR(be.Synchronize(stream));
  for (int hh = 0; hh < h; ++hh) std::sort(ids.begin() + size_t(hh) * k, ids.begin() + size_t(hh + 1) * k);
  return ids;
}

// Bytes of encoded values a device stages at a time before copying them to host memory.
constexpr size_t kValueSliceBytes = size_t{32} << 20;

// Rows of d elements gathered out of a [n, h, d] tensor (row token * h + head): whole
// chunks of the static set and the INT2 heavy rows with their padding. With rows of a
// multiple of 16 bytes this is one CopyRows launch per tensor from a row index uploaded
// once (a static set of 49 chunks x 8 heads would otherwise be 392 copies per tensor);
// other head dims copy row by row.
class RowGather {
 public:
  RowGather(Mem& mem, int h, int d, int C) : mem_(mem), h_(h), d_(d), C_(C) {}

  // The C tokens of chunk `chunk` of head `head` to destination rows dst_row...
  void AddChunk(int head, int chunk, size_t dst_row) {
    for (int t = 0; t < C_; ++t) AddRow(int64_t(chunk) * C_ + t, head, dst_row + t);
  }
  void AddRow(int64_t token, int head, size_t dst_row) {
    src_.push_back(token * h_ + head);
    dst_.push_back(int64_t(dst_row));
  }

  absl::Status Prepare(Stream stream) {
    if (src_.empty() || RowBytes() % 16 != 0 || src_.size() > size_t(std::numeric_limits<int>::max())) {
      return absl::OkStatus();
    }
    host_index_ = src_;
    host_index_.insert(host_index_.end(), dst_.begin(), dst_.end());
    if (mem_.be.space() == MemorySpace::kHost) {
      index_data_ = host_index_.data();  // the backend reads host memory: no allocation
    } else {
      KVSHADE_ASSIGN_OR_RETURN(index_, Upload(mem_, host_index_.data(), host_index_.size(),
                                              BufferKind::kScratch, stream));
      index_data_ = static_cast<const int64_t*>(index_.data());
    }
    return absl::OkStatus();
  }

  absl::Status Copy(const bf16* src, bf16* dst, Stream stream) const {
    const int n = static_cast<int>(src_.size());
    if (index_data_ != nullptr) {
      return mem_.be.CopyRows(src, dst, RowBytes(), n, index_data_, index_data_ + n, stream);
    }
    for (size_t i = 0; i < src_.size(); ++i) {
      KVSHADE_RETURN_IF_ERROR(mem_.be.Copy(dst + size_t(dst_[i]) * d_, src + size_t(src_[i]) * d_,
                                           RowBytes(), stream));
    }
    return absl::OkStatus();
  }

 private:
  size_t RowBytes() const { return size_t(d_) * sizeof(bf16); }
  Mem& mem_;
  int h_, d_, C_;
  std::vector<int64_t> src_, dst_;
  std::vector<int64_t> host_index_;  // source rows, then destination rows
  Buffer index_;                     // host_index_ in device memory (device backends)
  const int64_t* index_data_ = nullptr;
};

}  // namespace

SegmentView ShadowLayer::Segment() const {
  SegmentView s;
  s.n_chunks = n_chunks;
  s.first_position = first_position;
  s.landmarks = static_cast<const bf16*>(landmarks.data());
  s.excluded = static_cast<const uint8_t*>(excluded.data());
  s.a = static_cast<const bf16*>(a.data());
  s.values = static_cast<const std::byte*>(values.data());
  s.value_head_stride = int64_t(n_chunks) * int64_t(value_chunk_bytes);
  s.value_chunk_stride = int64_t(value_chunk_bytes);
  s.sig = signature_bits > 0 ? static_cast<const std::byte*>(sig.data()) : nullptr;
  return s;
}

SessionLayerView ShadowLayer::View() const {
  SessionLayerView v;
  v.segments[0] = Segment();
  v.n_segments = 1;
  v.b = static_cast<const bf16*>(b.data());
  v.r = r;
  v.sig_bits = signature_bits;
  return v;
}

KvBlock ShadowLayer::SlotBlock(const bf16* slot_k, const bf16* slot_v, int k_slots,
                               const int32_t* len_per_head) const {
  KvBlock blk;
  blk.k = slot_k;
  blk.v = slot_v;
  blk.len = int64_t(k_slots) * C;
  blk.len_per_head = len_per_head;
  blk.head_stride = int64_t(k_slots) * C * shape.d;
  blk.token_stride = shape.d;
  return blk;
}

AttendItem ShadowLayer::MakeAttendItem(const bf16* q, const KvBlock& slots, float* out,
                                       const KvBlock* extra) const {
  AttendItem item;
  item.q = q;
  item.out = out;
  if (static_capacity > 0) {
    KvBlock& s = item.blocks[0];
    s.k = static_cast<const bf16*>(static_k.data());
    s.v = static_cast<const bf16*>(static_v.data());
    s.len = int64_t(static_capacity) * C;
    s.len_per_head = static_cast<const int32_t*>(static_len.data());
    s.head_stride = int64_t(static_capacity) * C * shape.d;
    s.token_stride = shape.d;
  }  // else an empty block (len 0), skipped by Attend
  item.blocks[1] = slots;
  KvBlock& t = item.blocks[2];
  t.k = static_cast<const bf16*>(tail_k.data());
  t.v = static_cast<const bf16*>(tail_v.data());
  t.len = n_tail;
  t.head_stride = shape.d;
  t.token_stride = int64_t(shape.h) * shape.d;
  item.n_blocks = 3;
  if (extra != nullptr) item.blocks[item.n_blocks++] = *extra;
  return item;
}

size_t ShadowLayer::ResidentBytes() const {
  size_t total = 0;
  for (const Buffer* buf : {&a, &b, &landmarks, &excluded, &sig, &static_k, &static_v, &static_len,
                            &heavy_k_codes, &heavy_k_scale, &heavy_k_min, &heavy_v_codes,
                            &heavy_v_scale, &heavy_v_min, &tail_k, &tail_v}) {
    total += buf->bytes();
  }
  return total;
}

absl::StatusOr<ShadowLayer> CompressShadowLayer(Backend& be, const LayerShape& shape,
                                                const RopeSpec& rope, const ShadowParams& p,
                                                absl::Span<const bf16> k_pre,
                                                absl::Span<const bf16> v, int n,
                                                int64_t first_position,
                                                const ShadowObservation* obs, Stream stream,
                                                Allocator* allocator,
                                                absl::Span<std::byte> values_out) {
  Mem mem{be, allocator};
  // --- arguments ---
  KVSHADE_RETURN_IF_ERROR(validate::Shape(shape));
  const int h = shape.h, d = shape.d, D = shape.D();
  if (p.C < 1) return Bad(absl::StrCat("params.C must be >= 1, got ", p.C));
  if (p.local_min < 0) return Bad(absl::StrCat("params.local_min must be >= 0, got ", p.local_min));
  if (p.outliers < 0) return Bad(absl::StrCat("params.outliers must be >= 0, got ", p.outliers));
  if (p.signature_bits != 0 &&
      (!ValidSignatureBits(p.signature_bits) || (int64_t{d} * p.signature_bits) % 32 != 0)) {
    return Bad(absl::StrCat("params.signature_bits must be 0 or ", kSignatureBitsText, " (with d*bits a multiple "
                            "of 32), got ", p.signature_bits));
  }
  if (p.heavy_chunks < 0) {
    return Bad(absl::StrCat("params.heavy_chunks must be >= 0, got ", p.heavy_chunks));
  }
  if (int64_t(n) < int64_t(p.local_min) + p.C) {
    return Bad(absl::StrCat("n must be >= local_min + C = ", int64_t(p.local_min) + p.C,
                            ", got ", n));
  }
  if (first_position < 0) return Bad(absl::StrCat("first_position must be >= 0, got ", first_position));
  if (k_pre.size() != size_t(n) * D) {
    return Bad(absl::StrCat("k_pre must have n*h*d = ", size_t(n) * D, " elements, got ",
                            k_pre.size()));
  }
  if (v.size() != size_t(n) * D) {
    return Bad(absl::StrCat("v must have n*h*d = ", size_t(n) * D, " elements, got ", v.size()));
  }
  auto chunk_bytes = ValueChunkBytes(p.codec, p.C, d);
  if (!chunk_bytes.ok()) return Bad(std::string(chunk_bytes.status().message()));
  const bool want_heavy = obs != nullptr && p.heavy_chunks > 0;
  if (want_heavy) {
    if (obs->w < 1) return Bad(absl::StrCat("observation.w must be >= 1, got ", obs->w));
    if (obs->qobs.size() != size_t(obs->w) * shape.query_heads() * d) {
      return Bad(absl::StrCat("observation.qobs must have w*h*g*d = ",
                              size_t(obs->w) * shape.query_heads() * d, " elements, got ",
                              obs->qobs.size()));
    }
    if (obs->q_positions.size() != size_t(obs->w)) {
      return Bad(absl::StrCat("observation.q_positions must have w = ", obs->w,
                              " elements, got ", obs->q_positions.size()));
    }
    // The INT2 group must divide d (values) and be a multiple of 16; the key tokens are
    // padded to a multiple of it.
    const KiviLayout probe{p.heavy_group, d, 2, p.heavy_group, KiviAxis::kPerToken};
    if (absl::Status st = ValidateKiviLayout(probe); !st.ok()) {
      return Bad(absl::StrCat("params.heavy_group = ", p.heavy_group, ": ", st.message()));
    }
  }

  ShadowLayer L;
  L.shape = shape;
  L.C = p.C;
  L.n = n;
  L.first_position = first_position;
  L.n_chunks = (n - p.local_min) / p.C;
  L.n_tail = n - L.n_chunks * p.C;
  L.codec = p.codec;
  L.value_chunk_bytes = *chunk_bytes;
  const int C = p.C, n_chunks = L.n_chunks;

  std::vector<int64_t> pos_host(n);
  std::iota(pos_host.begin(), pos_host.end(), first_position);
  KVSHADE_ASSIGN_OR_RETURN(Buffer pos, Upload(mem, pos_host.data(), pos_host.size(), BufferKind::kScratch, stream));
  const auto positions = SpanOf<const int64_t>(pos, n);

  // --- 1. low-rank keys (unless the caller brings its own basis) ---
  if (p.factorize) {
    FactorizeOptions fo;
    fo.rank = p.rank;
    fo.energy_target = p.energy_target;
    fo.subspace_iterations = p.subspace_iterations;
    fo.host_subspace_min_tokens = p.host_subspace_min_tokens;
    const size_t alloc_rank = size_t(std::max(p.rank, 0));
    KVSHADE_ASSIGN_OR_RETURN(L.a, AllocElems<bf16>(mem, size_t(n) * alloc_rank, BufferKind::kFactorA));
    KVSHADE_ASSIGN_OR_RETURN(L.b, AllocElems<bf16>(mem, size_t(h) * alloc_rank * d, BufferKind::kFactorB));
    L.eigenvalues.assign(D, 0.0f);
    KVSHADE_ASSIGN_OR_RETURN(Buffer ws, mem.Alloc(be.FactorizeWorkspaceBytes(n, shape, fo), BufferKind::kScratch));
    KVSHADE_ASSIGN_OR_RETURN(
        L.factorize,
        be.Factorize(k_pre, n, shape, fo, SpanOf<bf16>(L.a, size_t(n) * alloc_rank),
                     SpanOf<bf16>(L.b, size_t(h) * alloc_rank * d),
                     absl::MakeSpan(L.eigenvalues), ws.workspace(), stream));
    L.r = L.factorize.rank;
  }

  // --- 2. post-RoPE keys: a copy of K_pre in backend memory, rotated in place ---
  KVSHADE_ASSIGN_OR_RETURN(Buffer kr, AllocElems<bf16>(mem, size_t(n) * D, BufferKind::kScratch));
  KVSHADE_RETURN_IF_ERROR(be.Copy(kr.data(), k_pre.data(), size_t(n) * D * sizeof(bf16), stream));
  const auto kr_span = SpanOf<bf16>(kr, size_t(n) * D);
  KVSHADE_RETURN_IF_ERROR(be.ApplyRope(rope, positions, h, d, kr_span, stream));

  // --- 3-4. chunks and landmarks ---
  KVSHADE_ASSIGN_OR_RETURN(L.landmarks, AllocElems<bf16>(mem, size_t(n_chunks) * h * d, BufferKind::kLandmarks));
  KVSHADE_ASSIGN_OR_RETURN(Buffer min_cos, AllocElems<float>(mem, size_t(h) * n_chunks, BufferKind::kScratch));
  KVSHADE_RETURN_IF_ERROR(be.BuildLandmarks(
      kr_span, n, h, d, C, n_chunks, SpanOf<bf16>(L.landmarks, size_t(n_chunks) * h * d),
      SpanOf<float>(min_cos, size_t(h) * n_chunks), stream));
  if (p.signature_bits > 0) {
    L.signature_bits = p.signature_bits;
    const size_t sig_bytes = size_t(n_chunks) * C * h * SignatureRecordBytes(p.signature_bits, d);
    KVSHADE_ASSIGN_OR_RETURN(L.sig, mem.Alloc(std::max<size_t>(sig_bytes, 1), BufferKind::kSignatures));
    KVSHADE_RETURN_IF_ERROR(be.EncodeSignatures(
        kr_span, SpanOf<const bf16>(L.landmarks, size_t(n_chunks) * h * d), h, d, C, n_chunks,
        p.signature_bits, SpanOf<std::byte>(L.sig, sig_bytes), stream));
  }

  // --- 5. outliers (and the sink) ---
  const int sink = p.keep_sink ? 1 : 0;
  std::vector<uint8_t> excluded(size_t(h) * n_chunks, 0);
  if (sink) {
    for (int hh = 0; hh < h; ++hh) excluded[size_t(hh) * n_chunks] = 1;
  }
  L.n_outliers = std::min(p.outliers, n_chunks - sink);
  if (L.n_outliers > 0) {
    KVSHADE_ASSIGN_OR_RETURN(L.outlier_chunks,
                             TopKChunks(mem, min_cos, excluded, h, n_chunks, L.n_outliers,
                                        /*largest=*/false, stream));
  }
  for (int hh = 0; hh < h; ++hh)
    for (int i = 0; i < L.n_outliers; ++i)
      excluded[size_t(hh) * n_chunks + L.outlier_chunks[size_t(hh) * L.n_outliers + i]] = 1;

  // --- 6. heavy chunks ---
  if (want_heavy) L.n_heavy = std::min(p.heavy_chunks, n_chunks - sink - L.n_outliers);
  if (L.n_heavy > 0) {
    KVSHADE_ASSIGN_OR_RETURN(Buffer qpos, Upload(mem, obs->q_positions.data(), size_t(obs->w), BufferKind::kScratch, stream));
    KVSHADE_ASSIGN_OR_RETURN(Buffer mass, AllocElems<float>(mem, size_t(h) * n, BufferKind::kScratch));
    KVSHADE_ASSIGN_OR_RETURN(Buffer ws, mem.Alloc(be.ObservationWorkspaceBytes(obs->w, n, shape), BufferKind::kScratch));
    KVSHADE_RETURN_IF_ERROR(be.ObservationMass(
        obs->qobs, SpanOf<const int64_t>(qpos, obs->w), obs->w, kr_span, positions, n, shape,
        SpanOf<float>(mass, size_t(h) * n), ws.workspace(), stream));
    KVSHADE_ASSIGN_OR_RETURN(Buffer chunk_mass, AllocElems<float>(mem, size_t(h) * n_chunks, BufferKind::kScratch));
    KVSHADE_RETURN_IF_ERROR(be.ChunkSum(SpanOf<const float>(mass, size_t(h) * n), h, n, C,
                                        n_chunks, SpanOf<float>(chunk_mass, size_t(h) * n_chunks),
                                        stream));
    KVSHADE_ASSIGN_OR_RETURN(L.heavy_chunks, TopKChunks(mem, chunk_mass, excluded, h, n_chunks,
                                                        L.n_heavy, /*largest=*/true, stream));
    for (int hh = 0; hh < h; ++hh)
      for (int i = 0; i < L.n_heavy; ++i)
        excluded[size_t(hh) * n_chunks + L.heavy_chunks[size_t(hh) * L.n_heavy + i]] = 1;
  }
  KVSHADE_ASSIGN_OR_RETURN(L.excluded, Upload(mem, excluded.data(), excluded.size(), BufferKind::kLandmarks, stream));

  // --- 7. values, encoded straight into their host-visible home ---
  // Scratch read by queued device work lives until the synchronization at the end: an
  // allocator may hand freed memory to another stream at once.
  Buffer value_scratch;
  {
    const size_t bytes = size_t(h) * n_chunks * L.value_chunk_bytes;
    absl::Span<std::byte> dst = values_out;
    if (dst.data() == nullptr) {
      KVSHADE_ASSIGN_OR_RETURN(L.values, be.AllocateHostVisible(bytes));
      dst = SpanOf<std::byte>(L.values, bytes);
    } else if (dst.size() != bytes) {
      return Bad(absl::StrCat("values_out must have h*n_chunks*chunk_bytes = ", bytes,
                              " bytes, got ", dst.size()));
    }
    if (be.space() == MemorySpace::kHost || n_chunks == 0) {
      KVSHADE_RETURN_IF_ERROR(be.EncodeValueChunks(v, n, h, d, C, n_chunks, p.codec, dst, stream));
    } else {
      // A device encodes into its own memory and copies each slice out by DMA: a kernel's
      // small scattered stores straight into host memory cross PCIe many times slower than
      // one copy of the same bytes. Slices of whole chunks of every head bound the scratch.
      const size_t per_chunk = size_t(h) * L.value_chunk_bytes;
      const int slice = int(std::clamp<size_t>(kValueSliceBytes / per_chunk, 1, size_t(n_chunks)));
      KVSHADE_ASSIGN_OR_RETURN(value_scratch, mem.Alloc(size_t(slice) * per_chunk, BufferKind::kScratch));
      auto* sp = static_cast<std::byte*>(value_scratch.data());
      for (int j0 = 0; j0 < n_chunks; j0 += slice) {
        const int m = std::min(slice, n_chunks - j0);
        const size_t row = size_t(m) * L.value_chunk_bytes;  // one head's chunks of the slice
        KVSHADE_RETURN_IF_ERROR(be.EncodeValueChunks(
            v.subspan(size_t(j0) * C * D, size_t(m) * C * D), m * C, h, d, C, m, p.codec,
            absl::Span<std::byte>(sp, size_t(h) * row), stream));
        KVSHADE_RETURN_IF_ERROR(be.Copy2D(dst.data() + size_t(j0) * L.value_chunk_bytes,
                                          size_t(n_chunks) * L.value_chunk_bytes, sp, row, row, h,
                                          stream));
      }
    }
  }

  // --- static set: exact sink/outlier chunks, then heavy chunks; and the tail ---
  // Gathered in backend memory: chunk c of head hh is C rows of d elements, D apart.
  const size_t row = size_t(d) * sizeof(bf16);
  const bf16* kr_d = static_cast<const bf16*>(kr.data());
  const bf16* v_d = v.data();
  const int n_exact = sink + L.n_outliers;
  L.static_capacity = n_exact + L.n_heavy;
  L.static_count.assign(h, L.static_capacity);
  L.static_chunks.assign(size_t(h) * L.static_capacity, -1);
  for (int hh = 0; hh < h; ++hh) {
    int32_t* srow = L.static_chunks.data() + size_t(hh) * L.static_capacity;
    int i = 0;
    if (sink) srow[i++] = 0;  // chunk 0 is masked out of the outlier TopK: no duplicate
    for (int j = 0; j < L.n_outliers; ++j) srow[i++] = L.outlier_chunks[size_t(hh) * L.n_outliers + j];
    std::sort(srow, srow + n_exact);
    for (int j = 0; j < L.n_heavy; ++j) srow[i++] = L.heavy_chunks[size_t(hh) * L.n_heavy + j];
  }
  const size_t rows_per_head = size_t(L.static_capacity) * C;
  if (L.static_capacity > 0) {
    KVSHADE_ASSIGN_OR_RETURN(L.static_k, AllocElems<bf16>(mem, size_t(h) * rows_per_head * d, BufferKind::kStatic));
    KVSHADE_ASSIGN_OR_RETURN(L.static_v, AllocElems<bf16>(mem, size_t(h) * rows_per_head * d, BufferKind::kStatic));
  }
  bf16* sk = static_cast<bf16*>(L.static_k.data());
  bf16* sv = static_cast<bf16*>(L.static_v.data());
  RowGather exact(mem, h, d, C);  // its row index is read until the final synchronization
  for (int hh = 0; hh < h; ++hh) {
    for (int i = 0; i < n_exact; ++i) {
      exact.AddChunk(hh, L.static_chunks[size_t(hh) * L.static_capacity + i],
                     size_t(hh) * rows_per_head + size_t(i) * C);
    }
  }
  KVSHADE_RETURN_IF_ERROR(exact.Prepare(stream));
  KVSHADE_RETURN_IF_ERROR(exact.Copy(kr_d, sk, stream));
  KVSHADE_RETURN_IF_ERROR(exact.Copy(v_d, sv, stream));

  if (L.n_heavy > 0) {
    const int G = p.heavy_group;
    const int heavy_rows = L.n_heavy * C;
    L.heavy_rows_per_head = (heavy_rows + G - 1) / G * G;
    const int rows = h * L.heavy_rows_per_head;
    L.heavy_k_layout = KiviLayout{rows, d, 2, G, KiviAxis::kPerChannel};
    L.heavy_v_layout = KiviLayout{rows, d, 2, G, KiviAxis::kPerToken};
    // Gather [h * heavy_rows_per_head, d], padding each head with copies of its last heavy
    // token; quantize, dequantize in place, and the dequantized rows join the static set.
    struct Part {
      const bf16* src;
      bf16* static_rows;
      const KiviLayout* layout;
      Buffer *codes, *scale, *mn;
    };
    Part parts[2] = {{kr_d, sk, &L.heavy_k_layout, &L.heavy_k_codes, &L.heavy_k_scale, &L.heavy_k_min},
                     {v_d, sv, &L.heavy_v_layout, &L.heavy_v_codes, &L.heavy_v_scale, &L.heavy_v_min}};
    // Each head: its heavy chunks, then copies of its last heavy token up to a whole group.
    RowGather heavy(mem, h, d, C);
    for (int hh = 0; hh < h; ++hh) {
      const int32_t* chunks = L.heavy_chunks.data() + size_t(hh) * L.n_heavy;
      const size_t first = size_t(hh) * L.heavy_rows_per_head;
      for (int j = 0; j < L.n_heavy; ++j) heavy.AddChunk(hh, chunks[j], first + size_t(j) * C);
      const int64_t last = int64_t(chunks[L.n_heavy - 1]) * C + C - 1;
      for (int rr = heavy_rows; rr < L.heavy_rows_per_head; ++rr) heavy.AddRow(last, hh, first + rr);
    }
    KVSHADE_RETURN_IF_ERROR(heavy.Prepare(stream));
    for (Part& q : parts) {
      const KiviLayout& l = *q.layout;
      KVSHADE_ASSIGN_OR_RETURN(Buffer x, AllocElems<bf16>(mem, size_t(rows) * d, BufferKind::kScratch));
      bf16* xd = static_cast<bf16*>(x.data());
      KVSHADE_RETURN_IF_ERROR(heavy.Copy(q.src, xd, stream));
      KVSHADE_ASSIGN_OR_RETURN(*q.codes, AllocElems<uint32_t>(mem, l.code_words(), BufferKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(*q.scale, AllocElems<fp16>(mem, l.n_groups(), BufferKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(*q.mn, AllocElems<fp16>(mem, l.n_groups(), BufferKind::kStatic));
      const auto xs = SpanOf<bf16>(x, size_t(rows) * d);
      KVSHADE_RETURN_IF_ERROR(be.KiviQuantize(
          xs, l, SpanOf<uint32_t>(*q.codes, l.code_words()),
          SpanOf<fp16>(*q.scale, l.n_groups()), SpanOf<fp16>(*q.mn, l.n_groups()), stream));
      KVSHADE_RETURN_IF_ERROR(be.KiviDequantize(
          SpanOf<const uint32_t>(*q.codes, l.code_words()),
          SpanOf<const fp16>(*q.scale, l.n_groups()), SpanOf<const fp16>(*q.mn, l.n_groups()), l,
          xs, stream));
      for (int hh = 0; hh < h; ++hh) {
        KVSHADE_RETURN_IF_ERROR(be.Copy(q.static_rows + (size_t(hh) * rows_per_head + size_t(n_exact) * C) * d,
                                        xd + size_t(hh) * L.heavy_rows_per_head * d,
                                        size_t(heavy_rows) * row, stream));
      }
      // x is scratch: wait for the copies out of it before it is released.
      KVSHADE_RETURN_IF_ERROR(be.Synchronize(stream));
    }
  }
  if (L.static_capacity > 0) {
    std::vector<int32_t> lens(h);
    for (int hh = 0; hh < h; ++hh) lens[hh] = L.static_count[hh] * C;
    KVSHADE_ASSIGN_OR_RETURN(L.static_len, Upload(mem, lens.data(), lens.size(), BufferKind::kStatic, stream));
  }

  // Tail: tokens [n_chunks*C, n) are contiguous in [n, h, d].
  const size_t tail_offset = size_t(n_chunks) * C * D, tail_elems = size_t(L.n_tail) * D;
  KVSHADE_ASSIGN_OR_RETURN(L.tail_k, AllocElems<bf16>(mem, tail_elems, BufferKind::kStatic));
  KVSHADE_ASSIGN_OR_RETURN(L.tail_v, AllocElems<bf16>(mem, tail_elems, BufferKind::kStatic));
  KVSHADE_RETURN_IF_ERROR(be.Copy(L.tail_k.data(), kr_d + tail_offset, tail_elems * sizeof(bf16), stream));
  KVSHADE_RETURN_IF_ERROR(be.Copy(L.tail_v.data(), v_d + tail_offset, tail_elems * sizeof(bf16), stream));
  KVSHADE_RETURN_IF_ERROR(be.Synchronize(stream));  // staging and scratch die with this scope
  return L;
}

}  // namespace kvshade::kernels

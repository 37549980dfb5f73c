// The kernel backend interface: every compression and decode operation of docs/ALGORITHM.md,
// implemented once per backend (CPU reference in kernels/cpu, CUDA in kernels/cuda).
//
// Contract
// - Memory: every pointer and span passed to a backend lives in that backend's memory
//   space (`space()`): host memory for the CPU backend, device memory for CUDA, unless the
//   comment says "host" (ordinary host memory) or "host-visible" (memory from
//   `AllocateHostVisible`: pinned and mapped for CUDA, so kernels read it over PCIe).
// - Shapes are written outer-to-inner, row-major; `n` tokens, `h` KV heads, `g` query
//   heads per KV head, `d` head dim, `D = h*d`, `C` chunk size, `r` rank, `k` top-k.
// - Launchers validate shapes and options and return InvalidArgument naming the problem
//   before touching memory; kernels never allocate on the request path: callers pass a
//   workspace of at least `*WorkspaceBytes(...)` bytes (backend memory).
// - Ops are asynchronous on `stream` (the CPU backend runs them to completion); outputs
//   are ready after `Synchronize(stream)`. Ops returning a host value (StatusOr) are
//   synchronous.
// - Determinism: same inputs on the same backend give bit-identical outputs.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/codec.h"
#include "kvshade/kernels/rope.h"
#include "kvshade/kernels/types.h"

namespace kvshade::kernels {

enum class MemorySpace { kHost, kDevice };

// An opaque execution stream (a cudaStream_t for CUDA; ignored by the CPU backend).
// A default-constructed Stream is the backend's default stream.
struct Stream {
  void* handle = nullptr;
};

// Scratch memory in the backend's space, owned by the caller.
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// Move-only owner of one allocation from a backend.
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, size_t bytes, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = o.data_;
      bytes_ = o.bytes_;
      release_ = std::move(o.release_);
      o.data_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  absl::Span<T> span() const {
    return absl::Span<T>(static_cast<T*>(data_), bytes_ / sizeof(T));
  }
  Workspace workspace() const { return Workspace{data_, bytes_}; }

 private:
  void Reset() {
    if (data_ != nullptr && release_) release_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

// Dimensions of one attention layer.
struct LayerShape {
  int h = 8;    // KV heads
  int g = 4;    // query heads per KV head (GQA group), >= 1
  int d = 128;  // head dim
  int D() const { return h * d; }
  int query_heads() const { return h * g; }
};

// ---------------------------------------------------------------------------------------
// Low-rank keys
struct FactorizeOptions {
  int rank = 160;             // multiple of 8, <= D; the rank used when energy_target == 0
  double energy_target = 0;   // in (0, 1]: adaptive rank, the smallest multiple of 8 whose
                              // captured energy reaches it, capped at `rank`
  // 0: full eigendecomposition of the Gram matrix. q > 0: only the top `rank` eigenpairs,
  // by q steps of block subspace iteration and a Rayleigh-Ritz step (kernels/common/
  // subspace.h); eigenvalues past the top `rank` are then reported as 0.
  int subspace_iterations = 0;
  // Backends with a device: the subspace iteration runs on the host, leaving the device to
  // whatever shares it (a model's prefill), when n >= host_subspace_min_tokens > 0, else on
  // the device. The CPU backend always solves on the host. The same eigenpairs either way,
  // to rounding.
  int host_subspace_min_tokens = 0;
};

struct FactorizeResult {
  int rank = 0;                // rank chosen (== options.rank unless adaptive)
  double captured_energy = 0;  // sum(top rank eigenvalues) / trace(K^T K)
  // Subspace iteration was asked for but its block was rank deficient, so the full
  // eigendecomposition ran instead (common/subspace.h).
  bool subspace_fallback = false;
};

// Energies of a projection onto an existing basis.
struct ProjectionResult {
  double key_energy = 0;       // ||K||_F^2
  double residual_energy = 0;  // ||K - K W W^T||_F^2 / ||K||_F^2 (0 when K == 0)
};

// ---------------------------------------------------------------------------------------
// One session's compressed state for one layer, as the decode ops read it. A session is
// a chain of immutable segments (a shared prefix first, then its own turns); their chunks
// form one chunk-id space in order (segment 0's chunks first). All segments share the
// basis `b` (later segments were projected onto it).
inline constexpr int kMaxSegments = 8;

struct SegmentView {
  int32_t n_chunks = 0;           // chunks of this segment (selectable or static)
  int64_t first_position = 0;     // absolute position of the segment's first token;
                                  // chunk j covers positions first_position + j*C + [0, C)
  const bf16* landmarks = nullptr;     // [n_chunks, h, d] bf16 (post-RoPE chunk means)
  const uint8_t* excluded = nullptr;   // [h, n_chunks] u8, 1 = static for that head (not
                                       // selectable); null = all selectable
  const bf16* a = nullptr;             // [n_chunks*C, r] bf16 token coordinates
  const std::byte* values = nullptr;   // encoded value chunks, host-visible:
                                       // chunk j of head hh at
                                       // values + hh*value_head_stride + j*value_chunk_stride
  int64_t value_head_stride = 0;       // bytes
  int64_t value_chunk_stride = 0;      // bytes (>= ValueChunkBytes)
  // Key signatures of the chunked tokens (SessionLayerView::sig_bits > 0):
  // [n_chunks*C, h, SignatureRecordBytes(sig_bits, d)] bytes, token-major (see
  // EncodeSignatures); null when the segment has none.
  const std::byte* sig = nullptr;
};

struct SessionLayerView {
  std::array<SegmentView, kMaxSegments> segments{};
  int n_segments = 0;
  const bf16* b = nullptr;  // [h, r, d] bf16 basis shared by all segments
  int r = 0;
  int sig_bits = 0;  // bits of the segments' key signatures (2, 4 or 8); 0: none
  int total_chunks() const {
    int t = 0;
    for (int i = 0; i < n_segments; ++i) t += segments[i].n_chunks;
    return t;
  }
  // Absolute position of the first of chunk c's C tokens (c in [0, total_chunks())).
  int64_t chunk_position(int c, int C) const {
    int i = 0;
    while (i + 1 < n_segments && c >= segments[i].n_chunks) c -= segments[i++].n_chunks;
    return segments[i].first_position + int64_t(c) * C;
  }
};

// Per-session state and outputs of one decode step for one layer.
//   q           : [h*g, d] bf16, post-RoPE query of the newest token
//   slots       : [h, k] int32, in/out slot table (chunk id, or -1 for an empty slot;
//                 ids distinct per head). The slot diff keeps hits in place and puts
//                 misses into the other slots (ascending chunk into ascending slot); a
//                 slot no miss needs keeps its chunk when it is a chunk of the view that
//                 this step did not select, and is emptied (-1) otherwise (empty, out of
//                 range, or a second copy of a selected chunk). So when fewer than k chunks
//                 are selected (a mass budget, model-native ids) the table still holds only
//                 chunks delivered before, and one that is selected again is a hit.
//   selected    : [h, k] int32 out, top-k chunk ids by descending score (ties: lower id)
//   miss_slot   : [h, k] int32 out, entries [0, miss_count[hh]) of row hh are the slots
//                 filled this step, ascending
//   miss_chunk  : [h, k] int32 out, the chunk now in miss_slot (ascending chunk id)
//   miss_count  : [h] int32 out
struct SelectItem {
  SessionLayerView view;
  const bf16* q = nullptr;
  int32_t* slots = nullptr;
  int32_t* selected = nullptr;
  int32_t* miss_slot = nullptr;
  int32_t* miss_chunk = nullptr;
  int32_t* miss_count = nullptr;
};

// Options of SelectEx (docs/ALGORITHM.md, "Selection options"). All off by default, which
// makes SelectEx select exactly what Select selects (same order, same slot diff).
//   candidates : two-stage selection when > 0 (and >= k). Stage 1 ranks the selectable chunks
//                by landmark score as Select does and keeps the best min(candidates,
//                selectable) per KV head; stage 2 normalises each query head n of the group
//                over every token t of every candidate, as stage 1 does over the landmarks,
//                  l_n(t) = dot(q[n], bf16(RoPE(A[t] . B_h, pos_t))) / sqrt(d)
//                  p_n(t) = softmax over all candidate tokens of l_n
//                  m[c]   = max over n and the C tokens t of c of p_n(t)
//                (keys reconstructed as Reconstruct does them, fp32 dots; per candidate and
//                n the max logit M and S = sum_t exp(l_n(t) - M), LSE_n = logsumexp over the
//                candidates of M + log S, m[c] = max_n exp(M - LSE_n); non-finite logits
//                carry no weight, and a candidate without a finite one scores 0) and re-ranks
//                the candidates by (m desc, id asc), NaN last. candidates >= total chunks
//                makes stage 2 score every selectable chunk: the oracle top-k of
//                reconstructed keys.
//   C, rope    : chunk size and RoPE of the view (stage 2 only).
//   top_p      : mass budget when in (0, 1]: after ranking, each head keeps the shortest
//                prefix whose estimated attention mass reaches top_p, at least min_k and at
//                most k chunks (k is the cap and the slot-table width). The mass of a chunk
//                is its landmark score s (Select's max over the group of the per-query-head
//                softmax) in one stage, and w[c] = max over n of sum_{t in c} p_n(t) (its
//                share of query head n's attention over the candidates, the group's
//                maximum; exp(M + log S - LSE_n)) in two; summed in rank order in fp32.
//                Group maxima can sum past 1 when g > 1, so top_p = 1 may cut before k.
//   min_k      : the floor of the mass budget, in [0, k].
//   signatures : stage 2 scores the candidates' tokens from their key signatures
//                (SegmentView::sig) instead of reconstructing their keys: the logit of token
//                t of chunk c for query head n is
//                  l_n(t) = (dot(q[n], L[c]) + scale_t * s_n * dot(q8[n], code_t - half))
//                           / sqrt(d)
//                (L[c] the chunk's landmark, code_t and scale_t the token's signature record,
//                half = (2^bits - 1) / 2, q8[n] and s_n the int8 query row and its scale;
//                fp32 with the arithmetic of codec.h's SignatureQueryReference,
//                SignatureDotReference and SignatureBaseReference, which every backend
//                reproduces bit for bit; then the same normalisation and ranking as
//                above). Needs view.sig_bits > 0 and every segment's sig; no basis, RoPE or
//                token coordinates are read.
//   unit       : selection units of u = unit tokens (u = 1: token-granular selection);
//                0 or C selects whole chunks as above, bit for bit. With 0 < u < C (u must
//                divide C, and two stages are needed) the view's tokens are cut into units:
//                unit j is tokens [(j*u) % C, +u) of chunk (j*u) / C, ids global in chunk
//                order, total_units = total_chunks * C/u of them. Stage 1 is unchanged: the
//                best min(max(candidates, ceil(k*u/C)), selectable) chunks by landmark
//                score (the candidates always hold k units). Stage 2 computes the same
//                logits l_n(t) (reconstructed keys, or signatures) and normalises each query
//                head over every token of every candidate chunk as above (LSE_n over all
//                candidate units), but folds (M, S) per unit (its u tokens, in token order)
//                instead of per chunk, and ranks the candidates' units by
//                  m[j] = max_n exp(M - LSE_n)   (the unit's best token probability)
//                by (m desc, unit id asc), NaN last; the mass budget sums
//                  w[j] = max_n exp(M + log S - LSE_n) (the unit's share of the attention)
//                in rank order. k, min_k and every [h, k] array of SelectItem then count
//                units: selected, the slot table, miss_slot and miss_chunk hold unit ids,
//                k <= total_units (a caller keeping the token budget of kc chunks passes
//                k = kc * C/u), and the slot diff runs unchanged on unit ids (a slot no
//                miss needs keeps its unit when that unit belongs to a chunk the head may
//                select). ReconstructItem::unit = u reconstructs such misses. Both
//                backends; the CUDA backend's limits (InvalidArgument naming them): k <=
//                4096 units and at most 16384 candidate units per head (stage-1 width, or
//                total chunks when every chunk is a candidate, times C/u). AssignSlots
//                (model-native ids) stays on whole chunks.
// A head that keeps fewer than k chunks (units) has -1 in its trailing `selected` entries;
// the slots it does not need keep the chunks (units) they held (SelectItem::slots).
struct SelectOptions {
  int candidates = 0;
  int C = 0;
  RopeSpec rope;
  float top_p = 0.0f;
  int min_k = 0;
  bool signatures = false;
  int unit = 0;
  bool two_stage() const { return candidates > 0; }
  // Selection by units smaller than a chunk (0 < unit < C; validity is checked by SelectEx).
  bool units() const { return unit > 0 && unit < C; }
  // Tokens per selection unit: unit, or C for whole chunks.
  int unit_tokens() const { return units() ? unit : C; }
  // Units per chunk: C / unit, or 1 for whole chunks.
  int units_per_chunk() const { return units() ? C / unit : 1; }
};

// Key signatures (docs/ALGORITHM.md, "Key signatures"): per chunked token and KV head, the
// residual of its post-RoPE key from its chunk's landmark, r = float(k) - float(L[c]),
// quantized symmetric with one scale per record:
//   L = 2^bits - 1, half = L / 2, amax = max_i |r_i|, scale = amax / half (fp32),
//   code_i = clamp(rint(r_i / scale + half), 0, L) (round half to even); scale 0 (or not
//   finite) stores scale 0 and codes 0; the key is read back as L[c] + (code - half) * scale.
// Record of one (token, head): d*bits/32 uint32 words (channel i in bits
// [bits*(i % (32/bits)), ...) of word i / (32/bits), least significant first), then the
// float scale. Both backends produce the same bytes.
// Widths a signature may have, and how messages name them.
inline constexpr int kSignatureBits[] = {2, 4, 8};
inline constexpr const char* kSignatureBitsText = "2, 4 or 8";
inline bool ValidSignatureBits(int bits) {
  for (int b : kSignatureBits) {
    if (b == bits) return true;
  }
  return false;
}
inline size_t SignatureRecordBytes(int bits, int d) { return size_t(d) * bits / 8 + 4; }


// Output of reconstruction for one session: keys and values of the missed chunks (or, with
// `unit` = u, 0 < u < C, of the missed units of u tokens: SelectOptions::unit).
//   miss_chunk : [h, k] int32, entries [0, miss_count[hh]) of row hh are chunk ids (unit
//                ids with `unit`: unit j is tokens [(j*u) % C, +u) of chunk (j*u) / C,
//                j < total_chunks * C/u, and k <= total_chunks * C/u)
//   miss_count : [h] int32
//   miss_slot  : [h, k] int32 or null (SelectItem::miss_slot of the same step): output
//                row of each miss; entries [0, miss_count[hh]) of row hh must be distinct
//                and in [0, k)
//   keys       : [h, k, C, d] bf16 out (post-RoPE K); miss j of head hh is written to row
//                (hh, j), or to row (hh, miss_slot[hh*k + j]) when miss_slot is set
//   values     : [h, k, C, d] bf16 out; same rows, decoded V
//   unit       : 0 or C: whole chunks. 0 < u < C (u divides C): keys and values are
//                [h, k, u, d], row (hh, j) holding unit miss_chunk[hh*k + j]'s u tokens:
//                token i of unit j is token (j*u) % C + i of chunk (j*u) / C, its key from
//                that token's A row, RoPE'd at its absolute position, its value decoded from
//                that chunk's encoding (the same bits as the chunk's row in a whole-chunk
//                Reconstruct). Both backends.
// Rows not named by a miss are left untouched. With miss_slot set, keys and values can be
// a persistent slot buffer (the slot table's layout): each step's misses land in their
// slots and the hits already there stay.
struct ReconstructItem {
  SessionLayerView view;
  const int32_t* miss_chunk = nullptr;  // [h, k]
  const int32_t* miss_count = nullptr;  // [h]
  bf16* keys = nullptr;
  bf16* values = nullptr;
  const int32_t* miss_slot = nullptr;  // [h, k] or null: when set, miss j of head hh is
                                       // written to row (hh, miss_slot[hh*k + j]) instead
                                       // of row (hh, j)
  int unit = 0;                        // tokens per miss: 0 or C = chunks, else units
};

// One block of keys/values an attention reads. Element (head hh, token t, channel c) is
// at ptr[hh*head_stride + t*token_stride + c] (elements). Tokens [0, len_per_head[hh])
// (or [0, len) when len_per_head is null) of each head are attended.
struct KvBlock {
  const bf16* k = nullptr;
  const bf16* v = nullptr;
  int64_t len = 0;
  const int32_t* len_per_head = nullptr;  // [h] int32, backend memory, or null
  int64_t head_stride = 0;
  int64_t token_stride = 0;
};

inline constexpr int kMaxKvBlocks = 4;

// One decode attention: o = softmax(q K^T * scale) V over the union of blocks, per query
// head against its KV head (query head qh uses KV head qh / g).
//   q   : [h*g, d] bf16
//   out : [h*g, d] f32
//   lse : [h*g] f32 or null: log(sum_j exp(q.k_j * scale)) (natural log) per query head,
//         -inf for a head with no attended token; with it a caller merges this output with
//         attention over other tokens (o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2))
struct AttendItem {
  const bf16* q = nullptr;
  std::array<KvBlock, kMaxKvBlocks> blocks{};
  int n_blocks = 0;
  float* out = nullptr;
  float* lse = nullptr;
};

// Another process's device allocation mapped into this one (OpenPeerBuffer): the whole
// allocation, whatever offset inside it the handle was taken at.
struct PeerBuffer {
  void* base = nullptr;
  size_t bytes = 0;
};

// Memory named for another process on this node (same-node decode; shared_memory.h).
struct ExportedMemory {
  // kHostFile: host memory in a memory file; kDeviceIpc: a CUDA device allocation;
  // kHostVmm: pinned host memory allocated by the CUDA driver and exported as a descriptor.
  enum class Kind { kHostFile = 0, kDeviceIpc = 1, kHostVmm = 2 };
  Kind kind = Kind::kHostFile;
  uint64_t region_id = 0;  // unique per region within the exporting process
  int64_t pid = 0;         // kHostFile, kHostVmm: the exporting process
  int32_t fd = -1;         // kHostFile, kHostVmm: its descriptor of the region
  // kHostFile, kHostVmm: the exporting process's descriptor broker (a Unix socket that
  // hands `fd` over by SCM_RIGHTS; "@name" is an abstract socket), "" when it runs none.
  std::string broker;
  std::string ipc_handle;  // kDeviceIpc: the cudaIpcMemHandle_t bytes of the allocation
  size_t region_bytes = 0; // bytes of the whole region
  size_t offset = 0;       // of the exported pointer inside the region
};

// How shareable host memory is made (Backend::EnableSharedMemory).
enum class SharedHostMemory {
  // CUDA: pinned host memory of the CUDA driver exported as a descriptor where the GPU
  // supports it (a CUDA worker maps it without pinning the pages again), else kFile.
  // The CPU backend always uses kFile.
  kAuto,
  // Memory files: any process of the daemon's user maps them; a CUDA worker then
  // registers (pins) every page in its own context, about 0.1-0.25 s per GiB.
  kFile,
};

// A region mapped into this process by Backend::ImportMemory.
struct ImportedMemory {
  ExportedMemory::Kind kind = ExportedMemory::Kind::kHostFile;
  void* base = nullptr;  // the region's first byte in this process
  size_t bytes = 0;
};

// What a buffer allocated on the ingest path holds, for budget accounting.
enum class BufferKind { kFactorA, kFactorB, kLandmarks, kStatic, kScratch, kSignatures };

// A source of backend memory for composites that must allocate (the ingest path, e.g.
// CompressShadowLayer). The service passes one over its device arena, so that every byte
// counts against the device budget and nothing calls the device allocator per request;
// where none is given, composites call Backend::Allocate.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes, BufferKind kind) = 0;
};

// ---------------------------------------------------------------------------------------
// A backend is two interfaces. DeviceRuntime: the device's memory, copies and streams,
// and memory shared with other processes: what the storage tiers, the transports and the
// same-node plumbing use. KernelOps: the algorithm's operations over that memory (RoPE,
// factorization, landmarks, selection, reconstruction, attention). Code that only moves
// or holds bytes takes a DeviceRuntime.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;

  virtual std::string_view name() const = 0;  // "cpu" or "cuda"
  virtual MemorySpace space() const = 0;
  // OK while the device works. After an error that leaves the device unusable for this
  // process (CUDA's sticky errors: an illegal address, a failed launch, an uncorrectable
  // ECC error, a device-side assert...), that error, for good: every later operation fails
  // too and only a new process recovers. The service stops serving and exits on it.
  virtual absl::Status DeviceFault() const { return absl::OkStatus(); }

  // --- Memory and streams (set-up time, never on the request path) ---
  virtual absl::StatusOr<Buffer> Allocate(size_t bytes) = 0;
  // Host memory the backend's kernels can read directly (pinned + mapped for CUDA).
  virtual absl::StatusOr<Buffer> AllocateHostVisible(size_t bytes) = 0;
  // Host memory to stage copies to the backend from (e.g. a data plane's receive buffers):
  // faulted in on allocation, page-locked on CUDA (copies from it are DMA and need no
  // bounce through a driver buffer), private to this process (never exported for
  // same-node decode, unlike AllocateHostVisible's memory once sharing is on).
  virtual absl::StatusOr<Buffer> AllocateStaging(size_t bytes) = 0;
  virtual absl::Status CopyFromHost(void* dst, const void* src_host, size_t bytes,
                                    Stream stream = {}) = 0;
  virtual absl::Status CopyToHost(void* dst_host, const void* src, size_t bytes,
                                  Stream stream = {}) = 0;
  // Copies bytes between two buffers the backend can address (its own memory, host-visible
  // memory, an opened peer buffer), in stream order: a device-to-device copy on CUDA.
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes, Stream stream = {}) = 0;
  // Copies `height` rows of `width` bytes: row i from src + i*src_pitch to dst + i*dst_pitch
  // (pitches >= width), between buffers Copy can address, in stream order.
  virtual absl::Status Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height, Stream stream = {}) = 0;
  virtual absl::Status Fill(void* dst, uint8_t byte, size_t bytes, Stream stream = {}) = 0;
  virtual absl::StatusOr<Stream> CreateStream() = 0;
  virtual absl::Status DestroyStream(Stream stream) = 0;
  virtual absl::Status Synchronize(Stream stream = {}) = 0;

  // --- Another process's device memory ---
  // Maps another process's device allocation, named by its CUDA IPC handle (the 64 bytes
  // of a cudaIpcMemHandle_t), into this process. FailedPrecondition on backends without
  // inter-process device memory (cpu).
  virtual absl::StatusOr<PeerBuffer> OpenPeerBuffer(std::string_view handle) = 0;
  virtual absl::Status ClosePeerBuffer(const PeerBuffer& buffer) = 0;

  // --- Same-node export of a daemon's state to worker processes (shared_memory.h) ---
  // Called once at start-up by a process that exports its memory: from then on,
  // host-visible memory (and on the CPU backend every Allocate) is shareable. Memory
  // allocated before stays private.
  virtual void EnableSharedMemory(SharedHostMemory how) = 0;
  // Names the allocation that holds p (this backend's memory, or host-visible memory) for
  // another process on this node. FailedPrecondition for memory that cannot be shared.
  virtual absl::StatusOr<ExportedMemory> ExportMemory(const void* p) = 0;
  // Maps a region another process exported into this one, readable by this backend's
  // kernels (a CUDA backend registers host regions and opens IPC handles); released with
  // ReleaseImported. FailedPrecondition for a kind this backend cannot map.
  virtual absl::StatusOr<ImportedMemory> ImportMemory(const ExportedMemory& m) = 0;
  virtual absl::Status ReleaseImported(const ImportedMemory& m) = 0;
};

// The algorithm's operations, over the memory of the DeviceRuntime they come with.
class KernelOps {
 public:
  virtual ~KernelOps() = default;

  // --- Checks ---
  // first [1] int64 (backend memory) = the flat index of the first non-finite value (NaN
  // or infinity) of x, or x.size() when every value is finite: how a device backend checks
  // bytes it was handed without reading them on the host.
  virtual absl::Status FirstNonFinite(absl::Span<const bf16> x, absl::Span<int64_t> first,
                                      Stream stream = {}) = 0;

  // --- RoPE ---
  // x [n, heads, d] bf16, in place; positions [n] int64 absolute.
  virtual absl::Status ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions,
                                 int heads, int d, absl::Span<bf16> x, Stream stream = {}) = 0;

  // --- Low-rank factorization (ingest) ---
  // k [n, D] bf16 pre-RoPE keys -> a [n, rank] bf16 (= K W), b [h, rank, d] bf16 (= W^T per
  // head), eigenvalues [D] f32 host, descending. a and b are sized for options.rank; an
  // adaptive rank r' <= rank fills a as [n, r'] and b as [h, r', d] (dense at r').
  virtual size_t FactorizeWorkspaceBytes(int n, const LayerShape& shape,
                                         const FactorizeOptions& options) const = 0;
  virtual absl::StatusOr<FactorizeResult> Factorize(absl::Span<const bf16> k, int n,
                                                    const LayerShape& shape,
                                                    const FactorizeOptions& options,
                                                    absl::Span<bf16> a, absl::Span<bf16> b,
                                                    absl::Span<float> eigenvalues_host,
                                                    Workspace ws, Stream stream = {}) = 0;
  // Projects new pre-RoPE keys k [n, D] bf16 onto an existing basis b [h, r, d] bf16:
  // a [n, r] bf16 = K W, and the residual energy of the projection.
  virtual size_t ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const = 0;
  virtual absl::StatusOr<ProjectionResult> ProjectKeys(absl::Span<const bf16> k, int n,
                                                       const LayerShape& shape,
                                                       absl::Span<const bf16> b, int r,
                                                       absl::Span<bf16> a, Workspace ws,
                                                       Stream stream = {}) = 0;

  // --- Landmarks and outliers (ingest) ---
  // kr [n, h, d] bf16 post-RoPE keys, n >= n_chunks*C ->
  //   landmarks [n_chunks, h, d] bf16 (fp32 mean of each chunk, rounded once),
  //   min_cos   [h, n_chunks] f32 (min over the chunk's tokens of cos(landmark, key);
  //             a zero vector has cosine 1 with itself and 0 with anything else)
  virtual absl::Status BuildLandmarks(absl::Span<const bf16> kr, int n, int h, int d, int C,
                                      int n_chunks, absl::Span<bf16> landmarks,
                                      absl::Span<float> min_cos, Stream stream = {}) = 0;

  // Key signatures of the chunked tokens (SignatureRecordBytes above):
  //   kr [n_chunks*C or more, h, d] bf16 post-RoPE keys, landmarks [n_chunks, h, d] bf16 (as
  //   BuildLandmarks wrote them) -> sig [n_chunks*C, h, SignatureRecordBytes(bits, d)].
  // InvalidArgument unless bits is 2, 4 or 8 and d*bits is a multiple of 32.
  virtual absl::Status EncodeSignatures(absl::Span<const bf16> kr, absl::Span<const bf16> landmarks,
                                        int h, int d, int C, int n_chunks, int bits,
                                        absl::Span<std::byte> sig, Stream stream = {}) = 0;

  // Per row, the k best columns of scores [rows, cols] f32: largest (or smallest) first,
  // ties by lower column; columns with mask[row, col] != 0 are never chosen.
  //   mask : [rows, cols] u8 or empty;  out : [rows, k] int32
  // InvalidArgument when a row has fewer than k eligible columns.
  virtual size_t TopKWorkspaceBytes(int rows, int cols, int k) const = 0;
  virtual absl::Status TopK(absl::Span<const float> scores, absl::Span<const uint8_t> mask,
                            int rows, int cols, int k, bool largest, absl::Span<int32_t> out,
                            Workspace ws, Stream stream = {}) = 0;

  // --- Heavy hitters (ingest) ---
  // Cumulative attention of observation queries, per KV head and token:
  //   qobs  [w, h*g, d] bf16 post-RoPE;  q_positions [w] int64
  //   kr    [n, h, d] bf16 post-RoPE;    k_positions [n] int64
  //   mass  [h, n] f32 out: sum over rows t and the head's g query heads of
  //         softmax_j(q_t . k_j / sqrt(d)) over keys with k_positions[j] <= q_positions[t]
  virtual size_t ObservationWorkspaceBytes(int w, int n, const LayerShape& shape) const = 0;
  virtual absl::Status ObservationMass(absl::Span<const bf16> qobs,
                                       absl::Span<const int64_t> q_positions, int w,
                                       absl::Span<const bf16> kr,
                                       absl::Span<const int64_t> k_positions, int n,
                                       const LayerShape& shape, absl::Span<float> mass,
                                       Workspace ws, Stream stream = {}) = 0;
  // chunk_mass [h, n_chunks] f32 = sums of mass [h, n] over each chunk of C tokens.
  virtual absl::Status ChunkSum(absl::Span<const float> mass, int h, int n, int C, int n_chunks,
                                absl::Span<float> chunk_mass, Stream stream = {}) = 0;

  // --- Codecs ---
  // v [n, h, d] bf16 -> out: chunk j of head hh (tokens j*C..j*C+C-1) encoded at
  // out + (hh*n_chunks + j) * ValueChunkBytes(spec, C, d).
  virtual absl::Status EncodeValueChunks(absl::Span<const bf16> v, int n, int h, int d, int C,
                                         int n_chunks, const ValueCodecSpec& spec,
                                         absl::Span<std::byte> out, Stream stream = {}) = 0;
  // encoded [m, ValueChunkBytes] -> out [m, C, d] bf16.
  virtual absl::Status DecodeValueChunks(absl::Span<const std::byte> encoded, int m, int C,
                                         int d, const ValueCodecSpec& spec, absl::Span<bf16> out,
                                         Stream stream = {}) = 0;
  // KIVI quantization of x [rows, cols] bf16 (layout in codec.h).
  virtual absl::Status KiviQuantize(absl::Span<const bf16> x, const KiviLayout& layout,
                                    absl::Span<uint32_t> codes, absl::Span<fp16> scale,
                                    absl::Span<fp16> mn, Stream stream = {}) = 0;
  virtual absl::Status KiviDequantize(absl::Span<const uint32_t> codes,
                                      absl::Span<const fp16> scale, absl::Span<const fp16> mn,
                                      const KiviLayout& layout, absl::Span<bf16> x,
                                      Stream stream = {}) = 0;

  // --- Decode: select, reconstruct, attend ---
  // For each item: scores p = softmax over the head's selectable chunks of q.L/sqrt(d)
  // (fp32) per query head, s = max over the group, top-k per KV head, then the slot-table
  // diff (hits stay; misses fill freed slots, ascending chunk into ascending slot).
  // Items are independent; `items` is host memory. k <= view.total_chunks() is checked;
  // when a head has fewer than k selectable chunks its trailing `selected` entries are -1
  // (the slots it does not need: SelectItem::slots).
  virtual size_t SelectWorkspaceBytes(const LayerShape& shape, int k,
                                      absl::Span<const SelectItem> items) const = 0;
  virtual absl::Status Select(const LayerShape& shape, int k,
                              absl::Span<const SelectItem> items, Workspace ws,
                              Stream stream = {}) = 0;
  // Select with options (SelectOptions above): two-stage re-ranking, mass budgets and
  // selection units, with the same outputs and slot diff as Select (over unit ids with
  // units, where k <= total_chunks * C/unit is checked instead).
  virtual size_t SelectExWorkspaceBytes(const LayerShape& shape, int k,
                                        const SelectOptions& options,
                                        absl::Span<const SelectItem> items) const = 0;
  virtual absl::Status SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                                absl::Span<const SelectItem> items, Workspace ws,
                                Stream stream = {}) = 0;
  // Model-native selection: the caller chose the chunks. Per item and KV head, `selected`
  // [h, k] is an input: the chunk ids to attend, in any order, -1 entries ignored; ids
  // outside [0, total_chunks), static for that head (excluded) or repeated are ignored too
  // (callers that must refuse them check before). The slot diff is Select's (hits stay,
  // misses in ascending chunk id fill the free slots in ascending slot order, unused slots
  // keep or drop their chunk as SelectItem::slots says) and fills slots, miss_slot, miss_chunk and miss_count; `q` is not read.
  virtual size_t AssignSlotsWorkspaceBytes(const LayerShape& shape, int k,
                                           absl::Span<const SelectItem> items) const = 0;
  virtual absl::Status AssignSlots(const LayerShape& shape, int k,
                                   absl::Span<const SelectItem> items, Workspace ws,
                                   Stream stream = {}) = 0;
  // Reconstructs the missed chunks (units with ReconstructItem::unit): keys k_hat =
  // A[token] . B_h, RoPE'd at each token's absolute position; values decoded from the
  // host-visible store (fused gather+decode).
  virtual absl::Status Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                                   const ValueCodecSpec& codec,
                                   absl::Span<const ReconstructItem> items, Workspace ws,
                                   Stream stream = {}) = 0;
  virtual size_t ReconstructWorkspaceBytes(const LayerShape& shape, int k,
                                           absl::Span<const ReconstructItem> items) const = 0;

  // Decode attention (flash-decoding style, fp32 accumulation). scale is usually 1/sqrt(d).
  virtual size_t AttendWorkspaceBytes(const LayerShape& shape,
                                      absl::Span<const AttendItem> items) const = 0;
  virtual absl::Status Attend(const LayerShape& shape, float scale,
                              absl::Span<const AttendItem> items, Workspace ws,
                              Stream stream = {}) = 0;

  // --- Delivery into a worker's slot buffers ---
  // Copies n rows of row_bytes each: row src_rows[i] of src to row dst_rows[i] of dst.
  //   src                : backend memory, rows of row_bytes
  //   dst                : backend memory, or a peer buffer from OpenPeerBuffer
  //   src_rows, dst_rows : [n] int64, backend memory
  // row_bytes must be a positive multiple of 16. Rows of dst must not repeat.
  virtual absl::Status CopyRows(const void* src, void* dst, size_t row_bytes, int n,
                                const int64_t* src_rows, const int64_t* dst_rows,
                                Stream stream = {}) = 0;
};

// A backend: a device runtime and the operations that run on it ("cpu", "cuda").
class Backend : public DeviceRuntime, public KernelOps {};

// Backends compiled into this build, by name ("cpu" always; "cuda" when built and a device
// is visible).
std::vector<std::string> AvailableBackends();
// A backend name's kind and device: "cpu", "auto", "cuda" (device 0) or "cuda:N" (N a
// non-negative decimal); InvalidArgument for anything else. Whether it can be created here
// is CreateBackend's question.
struct BackendName {
  std::string kind;  // "cpu", "cuda" or "auto"
  int device = 0;
};
absl::StatusOr<BackendName> ParseBackendName(std::string_view name);
// Creates a backend: "cpu", "cuda" (device 0), "cuda:N", or "auto" (cuda when available,
// else cpu). Unavailable when the backend is not built or no device is present.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name);

}  // namespace kvshade::kernels

// The `shadow` profile's ingest of one layer of one session segment (docs/ALGORITHM.md,
// "Prefill / ingest", steps 1-7), composed from Backend ops only, so that the service, the
// tests and the benchmarks compress layers the same way on any backend. Ingest path: it
// allocates its buffers and scratch (never use it on the decode path).
//
// What a ShadowLayer holds (backend memory unless noted; token order within a chunk):
//   a          [n, r] bf16       token coordinates K W for all n tokens (the view reads
//                                the first n_chunks*C rows; the tail's rows are kept for
//                                when its tokens later become chunks)
//   b          [h, r, d] bf16    the layer's basis
//   landmarks  [n_chunks, h, d] bf16 post-RoPE chunk means
//   excluded   [h, n_chunks] u8  1 = static for that head (sink, outlier or heavy chunk)
//   sig        [n_chunks*C, h, SignatureRecordBytes(signature_bits, d)] key signatures of
//                                the chunked tokens (when params.signature_bits > 0)
//   values     [h, n_chunks, value_chunk_bytes], host-visible: every chunk encoded with
//                                `codec` (static chunks too, though decode never reads them)
//   static set, per head hh, as [h, static_capacity*C, d] bf16 (static_k, static_v):
//                                chunk-major rows of the head's static chunks in the order
//                                of static_chunks[hh] (exact chunks first, ascending id,
//                                then heavy chunks, ascending id); static_len[hh] =
//                                (number of static chunks of hh) * C tokens
//   heavy chunks: their post-RoPE K and V are quantized INT2 (KIVI, group `heavy_group`):
//                                keys per-channel (groups of G consecutive tokens of one
//                                channel, over the head's heavy tokens in chunk order,
//                                padded to a multiple of G by repeating the last token),
//                                values per-token (groups of G channels). The codes are the
//                                resident form (heavy_k_* / heavy_v_*, layouts in codec.h,
//                                one [h * rows, d] tensor each); the dequantized K and V
//                                are written once, at ingest, into the static set rows,
//                                since Attend reads bf16 blocks.
//   tail_k, tail_v [n_tail, h, d] bf16: the exact local tail (post-RoPE K, V) of the last
//                                n_tail = n - n_chunks*C tokens (the newest token included)
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

struct ShadowParams {
  int C = 8;                   // chunk size (tokens)
  int rank = 160;              // multiple of 8, <= min(D, n); the cap under energy_target
  double energy_target = 0;    // (0, 1]: adaptive rank (FactorizeOptions)
  int subspace_iterations = 0; // FactorizeOptions::subspace_iterations (0 = full solve)
  int host_subspace_min_tokens = 0;  // FactorizeOptions::host_subspace_min_tokens
  int outliers = 48;           // outlier chunks per head (fewer when fewer chunks exist)
  bool keep_sink = true;       // chunk 0 static for every head
  int local_min = 32;          // exact local tail, at least this many tokens
  int heavy_chunks = 0;        // H_l: heavy chunks per head (needs observation queries)
  int heavy_group = kDefaultKiviGroup;  // KIVI group of the INT2 heavy chunks
  ValueCodecSpec codec;        // host value store codec
  int signature_bits = 0;      // 2, 4 or 8: key signatures of every chunked token (backend.h,
                               // EncodeSignatures); 0: none
  bool factorize = true;       // false: no step 1 (a, b and eigenvalues stay empty, r = 0;
                               // rank and energy_target are not used): the caller projects
                               // the keys onto a basis it already has (a suffix after a
                               // cached prefix), and the factorization, whose cost does not
                               // shrink with n (an eigensolve of the D x D Gram matrix),
                               // would be thrown away
};

// Observation queries for heavy-chunk detection (step 6), optional.
//   qobs        : [w, h*g, d] bf16, backend memory, post-RoPE
//   q_positions : [w] int64, HOST memory, absolute positions of the query rows
struct ShadowObservation {
  absl::Span<const bf16> qobs;
  absl::Span<const int64_t> q_positions;
  int w = 0;
};

// One compressed layer of one segment. Move-only (owns backend Buffers).
struct ShadowLayer {
  LayerShape shape;
  int C = 0;
  int n = 0;                    // tokens of the segment
  int64_t first_position = 0;   // absolute position of token 0
  int n_chunks = 0;             // chunked tokens: [0, n_chunks*C)
  int n_tail = 0;               // exact tail tokens: [n_chunks*C, n)
  int r = 0;                    // rank in use (a is dense [n, r], b dense [h, r, d])
  FactorizeResult factorize;
  std::vector<float> eigenvalues;  // [D] host, descending (Gram eigenvalues)
  ValueCodecSpec codec;
  size_t value_chunk_bytes = 0;

  Buffer a, b, landmarks, excluded;
  int signature_bits = 0;
  Buffer sig;     // key signatures (signature_bits > 0)
  Buffer values;  // host-visible

  // Static set. static_capacity = max over heads of the static chunk count.
  int static_capacity = 0;
  std::vector<int32_t> static_chunks;  // [h, static_capacity] host, -1 padded
  std::vector<int32_t> static_count;   // [h] host, chunks
  std::vector<int32_t> outlier_chunks; // [h, n_outliers] host, ascending per head
  std::vector<int32_t> heavy_chunks;   // [h, n_heavy] host, ascending per head
  int n_outliers = 0, n_heavy = 0;
  Buffer static_k, static_v;  // [h, static_capacity*C, d] bf16
  Buffer static_len;          // [h] int32 tokens

  // INT2 heavy chunks (present when n_heavy > 0): layouts heavy_k_layout / heavy_v_layout
  // over rows = h * heavy_rows_per_head, cols = d.
  int heavy_rows_per_head = 0;
  KiviLayout heavy_k_layout, heavy_v_layout;
  Buffer heavy_k_codes, heavy_k_scale, heavy_k_min;
  Buffer heavy_v_codes, heavy_v_scale, heavy_v_min;

  Buffer tail_k, tail_v;  // [n_tail, h, d] bf16

  // The decode view of this layer as a one-segment session (add segments for chains).
  SessionLayerView View() const;
  SegmentView Segment() const;

  // A KvBlock over slot buffers [h, k_slots*C, d] bf16 (slot s of head hh holds its
  // chunk's C tokens at rows s*C ..). Every slot is attended, or the first
  // len_per_head[hh] tokens when given (backend memory): callers keep filled slots first
  // (a slot table that starts empty does, see Select) or pass lengths.
  KvBlock SlotBlock(const bf16* slot_k, const bf16* slot_v, int k_slots,
                    const int32_t* len_per_head = nullptr) const;

  // The Attend item over [static set; slots; tail; extra] for query q [h*g, d] bf16 and
  // output out [h*g, d] f32. `extra` (e.g. generated tokens) is optional.
  AttendItem MakeAttendItem(const bf16* q, const KvBlock& slots, float* out,
                            const KvBlock* extra = nullptr) const;

  // Bytes of this layer in backend memory (everything but the host-visible value store;
  // the static set's dequantized heavy rows included).
  size_t ResidentBytes() const;
};

// Compresses one layer of one segment:
//   k_pre : [n, h, d] bf16, backend memory, pre-RoPE keys (not modified)
//   v     : [n, h, d] bf16, backend memory
// Token i sits at absolute position first_position + i. Requires n >= local_min + C.
// Every buffer (the layer's and the scratch) comes from `allocator` when given, else from
// Backend::Allocate. Values are encoded into values_out when it is given (host-visible
// memory of h*n_chunks*ValueChunkBytes bytes, [h, n_chunks, chunk_bytes]; `values` then
// stays empty), else into a block from Backend::AllocateHostVisible.
// InvalidArgument on bad params or sizes; errors of the underlying ops pass through.
absl::StatusOr<ShadowLayer> CompressShadowLayer(Backend& backend, const LayerShape& shape,
                                                const RopeSpec& rope, const ShadowParams& params,
                                                absl::Span<const bf16> k_pre,
                                                absl::Span<const bf16> v, int n,
                                                int64_t first_position,
                                                const ShadowObservation* observation = nullptr,
                                                Stream stream = {},
                                                Allocator* allocator = nullptr,
                                                absl::Span<std::byte> values_out = {});

}  // namespace kvshade::kernels

// Vocabulary shared by every storage tier: 128-bit identities (segments and prefix keys),
// the value layout of one segment in the host store and on disk, and the kinds of factor
// blobs the spill tier keeps.
//
// A segment is immutable once sealed; its identity is a 128-bit id chosen by the caller
// (for shared prefixes, usually the prefix key of its last block). The same id names it in
// the host value store, the spill tier and the prefix index.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvshade/kernels/codec.h"

namespace kvshade::storage {

// A 128-bit identity. `hi` and `lo` are the high and low 64 bits; the canonical text form is
// 32 lowercase hex digits, hi first (the same order as XXH128_canonical_t).
struct Id128 {
  uint64_t hi = 0;
  uint64_t lo = 0;

  friend bool operator==(const Id128&, const Id128&) = default;
  friend auto operator<=>(const Id128&, const Id128&) = default;
  template <typename H>
  friend H AbslHashValue(H h, const Id128& id) {
    return H::combine(std::move(h), id.hi, id.lo);
  }

  std::string ToHex() const;
  // Parses 32 hex digits (either case); InvalidArgument otherwise.
  static absl::StatusOr<Id128> FromHex(std::string_view hex);
};

using SegmentId = Id128;
using PrefixKey = Id128;

// Encoded value chunks are placed at multiples of this many bytes (16 = one vector load),
// so chunk_stride >= ValueChunkBytes.
inline constexpr size_t kValueChunkAlign = 16;

// Where the values of one segment live: per layer, ONE contiguous block
//   values : [h, n_chunks, chunk_stride] bytes, host-visible
// chunk j of head hh at base + hh*head_stride() + j*chunk_stride, holding chunk_bytes
// encoded bytes (codec.h layout) followed by zero padding. Every layer of a segment has the
// same layout (n_chunks depends only on the segment's token count).
struct SegmentValueLayout {
  int n_layers = 0;
  int h = 0;         // KV heads
  int n_chunks = 0;  // chunks per head (>= 0)
  int C = 8;         // tokens per chunk
  int d = 128;       // head dim
  kernels::ValueCodecSpec codec;
  size_t chunk_bytes = 0;   // kernels::ValueChunkBytes(codec, C, d)
  size_t chunk_stride = 0;  // chunk_bytes rounded up to kValueChunkAlign

  size_t head_stride() const { return size_t(n_chunks) * chunk_stride; }
  size_t layer_bytes() const { return size_t(h) * head_stride(); }
  size_t total_bytes() const { return size_t(n_layers) * layer_bytes(); }
  // Bytes of one layer packed without padding ([h, n_chunks, chunk_bytes], as
  // Backend::EncodeValueChunks writes it).
  size_t dense_layer_bytes() const { return size_t(h) * size_t(n_chunks) * chunk_bytes; }

  // Validates the dimensions (InvalidArgument naming the bad one) and fills the derived
  // sizes. Limits: 1 <= n_layers <= 4096, 1 <= h <= 1024, 0 <= n_chunks <= 1<<24,
  // 1 <= C <= 4096, 1 <= d <= 4096, layer_bytes < 1 TiB.
  static absl::StatusOr<SegmentValueLayout> Make(int n_layers, int h, int n_chunks, int C,
                                                  int d, const kernels::ValueCodecSpec& codec);

  friend bool operator==(const SegmentValueLayout& a, const SegmentValueLayout& b) {
    return a.n_layers == b.n_layers && a.h == b.h && a.n_chunks == b.n_chunks && a.C == b.C &&
           a.d == b.d && a.codec.codec == b.codec.codec && a.codec.group == b.codec.group &&
           a.chunk_bytes == b.chunk_bytes && a.chunk_stride == b.chunk_stride;
  }
};

// Per-layer blobs the spill tier keeps beside the values (the values themselves are not a
// factor). The numbers are part of the on-disk format (storage/README.md).
enum class FactorKind : uint8_t {
  kA = 1,          // [n, r] bf16 token coordinates
  kB = 2,          // [h, r, d] bf16 basis
  kLandmarks = 3,  // [n_chunks, h, d] bf16
  kStatic = 4,     // static set (sink, outliers, heavy chunks, tail), service-defined layout
  kExcluded = 5,   // [h, n_chunks] u8 mask
  kSignatures = 6, // [n_chunks*C, h, record] key signatures (kernels::SignatureRecordBytes)
  kOther = 15,
};
std::string_view FactorKindName(FactorKind k);
bool IsValidFactorKind(uint8_t k);

}  // namespace kvshade::storage

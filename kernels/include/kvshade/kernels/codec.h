// Value and key codecs (docs/ALGORITHM.md, "INT2 / INT4 codec"): the byte layouts every
// backend and the storage tiers agree on.
//
// Value chunks: one chunk of one head is C tokens x d channels, chunk-major. Encoded layout
// of one chunk, by codec (all little-endian, no padding between parts):
//   kBF16 : [C, d] bf16
//   kFP8  : float32 scale, then [C, d] fp8 e4m3 codes; x = code * scale,
//           scale = max|x| / 448 (scale 0 -> all zeros)
//   kINT4 / kINT2 (KIVI values: per-token groups of G consecutive channels):
//           codes [C, d/G, G*bits/32] uint32 (element i of a group in bits [bits*i, ...),
//           least significant first), then scale [C, d/G] fp16, then min [C, d/G] fp16
//
// KIVI tensors in general (`KiviLayout`): a [rows, cols] tensor quantized in groups of G
// either along a row (kPerToken: G consecutive columns of one row; values) or along a
// column (kPerChannel: G consecutive rows of one column; keys). Layout:
//   codes  [n_groups_outer, n_groups_inner, G*bits/32] uint32
//   scale  [n_groups_outer, n_groups_inner] fp16
//   min    [n_groups_outer, n_groups_inner] fp16
// with (outer, inner) = (rows, cols/G) for kPerToken and (rows/G, cols) for kPerChannel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/kernels/types.h"

namespace kvshade::kernels {

enum class ValueCodec : int { kBF16 = 0, kFP8 = 1, kINT4 = 2, kINT2 = 3 };

std::string_view ValueCodecName(ValueCodec c);
absl::StatusOr<ValueCodec> ParseValueCodec(std::string_view name);

inline constexpr int kDefaultKiviGroup = 16;

struct ValueCodecSpec {
  ValueCodec codec = ValueCodec::kBF16;
  int group = kDefaultKiviGroup;  // G for int4/int2; must divide d and be a multiple of 32/bits
};

// Bits of one code for the integer codecs (4 or 2); 0 for bf16/fp8.
int CodecBits(ValueCodec c);

// Bytes of one encoded value chunk of C tokens x d channels; InvalidArgument when the
// group does not fit d.
absl::StatusOr<size_t> ValueChunkBytes(const ValueCodecSpec& spec, int C, int d);

enum class KiviAxis { kPerToken, kPerChannel };

struct KiviLayout {
  int rows = 0, cols = 0, bits = 2, group = kDefaultKiviGroup;
  KiviAxis axis = KiviAxis::kPerToken;
  int outer() const { return axis == KiviAxis::kPerToken ? rows : rows / group; }
  int inner() const { return axis == KiviAxis::kPerToken ? cols / group : cols; }
  int words_per_group() const { return group * bits / 32; }
  size_t code_words() const { return size_t(outer()) * inner() * words_per_group(); }
  size_t n_groups() const { return size_t(outer()) * inner(); }
};

// Checks bits in {2,4}, G a positive multiple of 32/bits, and that G divides the grouped
// dimension.
absl::Status ValidateKiviLayout(const KiviLayout& l);

// Reference quantization of one group of G floats (docs/ALGORITHM.md): mn and scale rounded to
// fp16 first, q = round_half_to_even(clamp((x - mn)/scale, 0, 2^bits-1)), scale 0 -> q 0.
// Writes G*bits/32 packed words. Both backends reproduce these codes exactly.
void KiviQuantizeGroupReference(const float* x, int G, int bits, uint32_t* words, fp16* scale,
                                fp16* mn);

// Reference key signature of one (token, head) (backend.h, SignatureRecordBytes): the
// residual key - landmark (d channels each) quantized to `bits` into `record`
// (SignatureRecordBytes(bits, d) bytes). Both backends reproduce these bytes exactly.
void SignatureEncodeReference(const bf16* key, const bf16* landmark, int d, int bits,
                              std::byte* record);

// Stage 2 from signatures (SelectOptions::signatures) scores with the query row quantized
// to int8 (docs/ALGORITHM.md "Key signatures"), so that its dot with a record's codes is an
// exact integer on every backend, in any order: amax = max |q[i]|; inv = 127 / amax and
// q8[i] = rint(q[i] * inv) (fp32, ties to even); returns the query scale amax / 127. A row
// of zeros gives 0 (q8 all 0); a row with a non-finite channel gives NaN (q8 all 0), so
// its logits carry no weight.
float SignatureQueryReference(const bf16* q, int d, int8_t* q8);
// A record's codes, one per channel, and its scale.
void SignatureUnpackReference(const std::byte* record, int d, int bits, uint8_t* codes,
                              float* scale);
// dot(q, code - half) of a record's codes from the int8 query of SignatureQueryReference:
// D = sum q8[i] * code[i] and S = sum q8[i] (exact integers), then
// float(2*D - (2^bits - 1)*S) * (q_scale / 2), one fp32 rounding.
float SignatureDotReference(const int8_t* q8, float q_scale, const uint8_t* codes, int d,
                            int bits);
// dot(q, L) of a query row and a landmark row for a signature logit: the fp32 sum of
// channels [0, d/2) in order plus the fp32 sum of [d/2, d) in order (each product and sum
// rounded), so that two lanes of a GPU form it the same way.
float SignatureBaseReference(const bf16* q, const bf16* landmark, int d);

}  // namespace kvshade::kernels

// Codec names, layout sizes and the reference KIVI group quantizer (docs/ALGORITHM.md,
// "INT2 / INT4 codec"). Every backend's quantizer reproduces KiviQuantizeGroupReference
// code for code; its arithmetic, in order:
//   mn_h    = fp16(min(x))                       (round to nearest even)
//   scale_h = fp16((max(x) - min(x)) / (2^bits - 1))   (fp32 subtract and divide)
//   q       = rint(clamp((x - float(mn_h)) / float(scale_h), 0, 2^bits - 1))  (fp32 divide)
//   scale_h == 0 -> q = 0; a NaN quotient clamps to 0.
// Decoding (in the backends) is fmaf(q, float(scale_h), float(mn_h)).
#include "kvshade/kernels/codec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvshade::kernels {

std::string_view ValueCodecName(ValueCodec c) {
  switch (c) {
    case ValueCodec::kBF16:
      return "bf16";
    case ValueCodec::kFP8:
      return "fp8";
    case ValueCodec::kINT4:
      return "int4";
    case ValueCodec::kINT2:
      return "int2";
  }
  return "unknown";
}

absl::StatusOr<ValueCodec> ParseValueCodec(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char ch) { return char(std::tolower(ch)); });
  for (ValueCodec c : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4,
                       ValueCodec::kINT2}) {
    if (lower == ValueCodecName(c)) return c;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "value codec: expected one of bf16, fp8, int4, int2; got \"", std::string(name), "\""));
}

int CodecBits(ValueCodec c) {
  switch (c) {
    case ValueCodec::kINT4:
      return 4;
    case ValueCodec::kINT2:
      return 2;
    default:
      return 0;
  }
}

absl::StatusOr<size_t> ValueChunkBytes(const ValueCodecSpec& spec, int C, int d) {
  if (C <= 0) return absl::InvalidArgumentError(absl::StrCat("value chunk: C must be > 0, got ", C));
  if (d <= 0) return absl::InvalidArgumentError(absl::StrCat("value chunk: d must be > 0, got ", d));
  const size_t elems = size_t(C) * size_t(d);
  switch (spec.codec) {
    case ValueCodec::kBF16:
      return elems * sizeof(bf16);
    case ValueCodec::kFP8:
      return sizeof(float) + elems;
    case ValueCodec::kINT4:
    case ValueCodec::kINT2: {
      KiviLayout l;
      l.rows = C;
      l.cols = d;
      l.bits = CodecBits(spec.codec);
      l.group = spec.group;
      l.axis = KiviAxis::kPerToken;
      if (absl::Status st = ValidateKiviLayout(l); !st.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("value codec ", std::string(ValueCodecName(spec.codec)), ": ",
                         st.message()));
      }
      return l.code_words() * sizeof(uint32_t) + 2 * l.n_groups() * sizeof(fp16);
    }
  }
  return absl::InvalidArgumentError(
      absl::StrCat("value codec: unknown codec id ", static_cast<int>(spec.codec)));
}

absl::Status ValidateKiviLayout(const KiviLayout& l) {
  if (l.bits != 2 && l.bits != 4) {
    return absl::InvalidArgumentError(absl::StrCat("kivi: bits must be 2 or 4, got ", l.bits));
  }
  if (l.axis != KiviAxis::kPerToken && l.axis != KiviAxis::kPerChannel) {
    return absl::InvalidArgumentError("kivi: unknown axis");
  }
  if (l.rows <= 0 || l.cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kivi: rows and cols must be > 0, got ", l.rows, " x ", l.cols));
  }
  const int per_word = 32 / l.bits;
  if (l.group <= 0 || l.group % per_word != 0) {
    return absl::InvalidArgumentError(absl::StrCat("kivi: group must be a positive multiple of ",
                                                   per_word, " for ", l.bits,
                                                   "-bit codes, got ", l.group));
  }
  const bool per_token = l.axis == KiviAxis::kPerToken;
  const int grouped = per_token ? l.cols : l.rows;
  if (grouped % l.group != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kivi: group ", l.group, " must divide ", per_token ? "cols" : "rows", " = ", grouped));
  }
  return absl::OkStatus();
}

void KiviQuantizeGroupReference(const float* x, int G, int bits, uint32_t* words, fp16* scale,
                                fp16* mn) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < G; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const int levels = (1 << bits) - 1;
  const fp16 mn_h = FloatToFp16(lo);
  const fp16 scale_h = FloatToFp16((hi - lo) / float(levels));
  *mn = mn_h;
  *scale = scale_h;
  const float mn_f = Fp16ToFloat(mn_h);
  const float scale_f = Fp16ToFloat(scale_h);
  const int per_word = 32 / bits;
  for (int w = 0; w < G / per_word; ++w) {
    uint32_t word = 0;
    for (int j = 0; j < per_word; ++j) {
      uint32_t q = 0;
      if (scale_f != 0.0f) {
        float v = (x[w * per_word + j] - mn_f) / scale_f;
        v = v > 0.0f ? v : 0.0f;  // also maps NaN to 0
        v = v < float(levels) ? v : float(levels);
        q = static_cast<uint32_t>(std::nearbyint(v));
      }
      word |= q << (bits * j);
    }
    words[w] = word;
  }
}

void SignatureEncodeReference(const bf16* key, const bf16* landmark, int d, int bits,
                              std::byte* record) {
  const int levels = (1 << bits) - 1;
  const float half = float(levels) / 2.0f;
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) {
    amax = std::fmax(amax, std::fabs(Bf16ToFloat(key[i]) - Bf16ToFloat(landmark[i])));
  }
  float scale = amax / half;
  if (!(scale > 0.0f) || !std::isfinite(scale)) scale = 0.0f;
  const int per_word = 32 / bits;
  auto* words = reinterpret_cast<uint32_t*>(record);
  for (int w = 0; w < d / per_word; ++w) {
    uint32_t word = 0;
    for (int j = 0; j < per_word && scale != 0.0f; ++j) {
      const int i = w * per_word + j;
      float v = (Bf16ToFloat(key[i]) - Bf16ToFloat(landmark[i])) / scale + half;
      v = v > 0.0f ? v : 0.0f;  // also maps NaN to 0
      v = v < float(levels) ? v : float(levels);
      word |= static_cast<uint32_t>(std::nearbyint(v)) << (bits * j);
    }
    words[w] = word;
  }
  std::memcpy(record + size_t(d) * bits / 8, &scale, sizeof(float));
}

float SignatureQueryReference(const bf16* q, int d, int8_t* q8) {
  if (d <= 0) return 0.0f;
  float amax = 0.0f;
  bool finite = true;
  for (int i = 0; i < d; ++i) {
    const float x = Bf16ToFloat(q[i]);
    finite = finite && std::isfinite(x);
    amax = std::fmax(amax, std::fabs(x));
  }
  std::fill(q8, q8 + d, int8_t{0});
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.0f) return 0.0f;
  const float inv = 127.0f / amax;
  for (int i = 0; i < d; ++i) {
    q8[i] = static_cast<int8_t>(std::nearbyint(Bf16ToFloat(q[i]) * inv));
  }
  return amax / 127.0f;
}

void SignatureUnpackReference(const std::byte* record, int d, int bits, uint8_t* codes,
                              float* scale) {
  const int per_word = 32 / bits;
  const uint32_t levels = (1u << bits) - 1u;
  for (int w = 0; w < d / per_word; ++w) {
    uint32_t word = 0;
    std::memcpy(&word, record + size_t(w) * 4, 4);
    for (int j = 0; j < per_word; ++j) {
      codes[w * per_word + j] = uint8_t((word >> (bits * j)) & levels);
    }
  }
  std::memcpy(scale, record + size_t(d) * bits / 8, sizeof(float));
}

float SignatureDotReference(const int8_t* q8, float q_scale, const uint8_t* codes, int d,
                            int bits) {
  int32_t dot = 0, sum = 0;
  for (int i = 0; i < d; ++i) {
    dot += int32_t(q8[i]) * int32_t(codes[i]);
    sum += q8[i];
  }
  const int32_t levels = (1 << bits) - 1;
  return float(2 * dot - levels * sum) * (q_scale * 0.5f);
}

float SignatureBaseReference(const bf16* q, const bf16* landmark, int d) {
  float lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < d / 2; ++i) lo += Bf16ToFloat(q[i]) * Bf16ToFloat(landmark[i]);
  for (int i = d / 2; i < d; ++i) hi += Bf16ToFloat(q[i]) * Bf16ToFloat(landmark[i]);
  return lo + hi;
}

}  // namespace kvshade::kernels

// CPU value codecs (codec.h layouts): bf16 copy, fp8 e4m3 with a per-chunk fp32 scale, and
// KIVI int4/int2 (values: per-token groups; KiviQuantize/KiviDequantize: either axis).
// Arithmetic, which the CUDA backend reproduces bit for bit:
//   fp8 encode: scale = max|x| / 448 (fp32 divide), code = FloatToFp8E4M3(x / scale),
//               scale == 0 -> all codes 0;  decode: bf16(Fp8E4M3ToFloat(code) * scale)
//   kivi encode: KiviQuantizeGroupReference;  decode: bf16(fmaf(q, scale, mn))
// Parallel over chunks (or groups) with OpenMP; every element is computed by one thread in
// a fixed order, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_codec_internal.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

// Work below this many elements runs on the calling thread (OpenMP start-up costs more).
constexpr int64_t kParallelMinElements = 1 << 15;

// fmaf, as CUDA's contracted q * scale + mn.
inline float DecodeKivi(uint32_t q, float scale, float mn) {
  return std::fma(float(q), scale, mn);
}

}  // namespace

namespace cpu_internal {

void EncodeValueChunk(const bf16* v, int64_t token_stride, int C, int d,
                      const ValueCodecSpec& spec, std::byte* out) {
  switch (spec.codec) {
    case ValueCodec::kBF16:
      for (int t = 0; t < C; ++t) {
        std::memcpy(out + size_t(t) * d * sizeof(bf16), v + t * token_stride, d * sizeof(bf16));
      }
      return;
    case ValueCodec::kFP8: {
      float amax = 0.0f;
      for (int t = 0; t < C; ++t) {
        for (int c = 0; c < d; ++c) amax = std::max(amax, std::fabs(Bf16ToFloat(v[t * token_stride + c])));
      }
      const float scale = amax / kFp8E4M3Max;
      std::memcpy(out, &scale, sizeof(float));
      uint8_t* codes = reinterpret_cast<uint8_t*>(out + sizeof(float));
      for (int t = 0; t < C; ++t) {
        for (int c = 0; c < d; ++c) {
          codes[t * d + c] =
              scale == 0.0f ? 0 : FloatToFp8E4M3(Bf16ToFloat(v[t * token_stride + c]) / scale);
        }
      }
      return;
    }
    case ValueCodec::kINT4:
    case ValueCodec::kINT2: {
      const int bits = CodecBits(spec.codec);
      const int G = spec.group;
      const int groups = d / G;
      const int wpg = G * bits / 32;
      std::byte* scale_base = out + size_t(C) * groups * wpg * sizeof(uint32_t);
      std::byte* mn_base = scale_base + size_t(C) * groups * sizeof(fp16);
      float xs[256];
      uint32_t words[32];
      std::vector<float> big_x;
      std::vector<uint32_t> big_w;
      float* x = xs;
      uint32_t* w = words;
      if (G > 256) {  // unusual groups: heap scratch
        big_x.resize(G);
        big_w.resize(wpg);
        x = big_x.data();
        w = big_w.data();
      }
      for (int t = 0; t < C; ++t) {
        for (int gi = 0; gi < groups; ++gi) {
          for (int i = 0; i < G; ++i) x[i] = Bf16ToFloat(v[t * token_stride + gi * G + i]);
          fp16 s, m;
          KiviQuantizeGroupReference(x, G, bits, w, &s, &m);
          const size_t gidx = size_t(t) * groups + gi;
          std::memcpy(out + gidx * wpg * sizeof(uint32_t), w, wpg * sizeof(uint32_t));
          std::memcpy(scale_base + gidx * sizeof(fp16), &s, sizeof(fp16));
          std::memcpy(mn_base + gidx * sizeof(fp16), &m, sizeof(fp16));
        }
      }
      return;
    }
  }
}

void DecodeValueChunk(const std::byte* encoded, int C, int d, const ValueCodecSpec& spec,
                      bf16* out) {
  DecodeValueRows(encoded, C, d, spec, 0, C, out);
}

void DecodeValueRows(const std::byte* encoded, int C, int d, const ValueCodecSpec& spec, int t0,
                     int n, bf16* out) {
  switch (spec.codec) {
    case ValueCodec::kBF16:
      std::memcpy(out, encoded + size_t(t0) * d * sizeof(bf16), size_t(n) * d * sizeof(bf16));
      return;
    case ValueCodec::kFP8: {
      float scale;
      std::memcpy(&scale, encoded, sizeof(float));
      const uint8_t* codes =
          reinterpret_cast<const uint8_t*>(encoded + sizeof(float)) + size_t(t0) * d;
      for (int64_t i = 0; i < int64_t(n) * d; ++i) {
        out[i] = FloatToBf16(Fp8E4M3ToFloat(codes[i]) * scale);
      }
      return;
    }
    case ValueCodec::kINT4:
    case ValueCodec::kINT2: {
      const int bits = CodecBits(spec.codec);
      const int G = spec.group;
      const int groups = d / G;
      const int wpg = G * bits / 32;
      const int per_word = 32 / bits;
      const uint32_t mask = (1u << bits) - 1;
      const std::byte* scale_base = encoded + size_t(C) * groups * wpg * sizeof(uint32_t);
      const std::byte* mn_base = scale_base + size_t(C) * groups * sizeof(fp16);
      for (int t = t0; t < t0 + n; ++t) {
        for (int gi = 0; gi < groups; ++gi) {
          const size_t gidx = size_t(t) * groups + gi;
          fp16 s, m;
          std::memcpy(&s, scale_base + gidx * sizeof(fp16), sizeof(fp16));
          std::memcpy(&m, mn_base + gidx * sizeof(fp16), sizeof(fp16));
          const float sf = Fp16ToFloat(s), mf = Fp16ToFloat(m);
          bf16* o = out + size_t(t - t0) * d + gi * G;
          for (int wi = 0; wi < wpg; ++wi) {
            uint32_t word;
            std::memcpy(&word, encoded + (gidx * wpg + wi) * sizeof(uint32_t), sizeof(word));
            for (int j = 0; j < per_word; ++j) {
              o[wi * per_word + j] = FloatToBf16(DecodeKivi((word >> (bits * j)) & mask, sf, mf));
            }
          }
        }
      }
      return;
    }
  }
}

}  // namespace cpu_internal

absl::Status CpuBackend::EncodeValueChunks(absl::Span<const bf16> v, int n, int h, int d, int C,
                                           int n_chunks, const ValueCodecSpec& spec,
                                           absl::Span<std::byte> out, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::EncodeValueChunks(v.size(), n, h, d, C, n_chunks, spec, out.size()));
  KVSHADE_ASSIGN_OR_RETURN(const size_t chunk_bytes, ValueChunkBytes(spec, C, d));
  const int64_t total = int64_t(h) * n_chunks;
  const bf16* src = v.data();
  std::byte* dst = out.data();
#pragma omp parallel for schedule(static) if (total * C * d >= kParallelMinElements)
  for (int64_t i = 0; i < total; ++i) {
    const int64_t hh = i / n_chunks, j = i % n_chunks;
    // v [n, h, d]: token j*C of head hh, tokens h*d apart.
    cpu_internal::EncodeValueChunk(src + (j * C * h + hh) * d, int64_t(h) * d, C, d, spec,
                                   dst + i * chunk_bytes);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DecodeValueChunks(absl::Span<const std::byte> encoded, int m, int C,
                                           int d, const ValueCodecSpec& spec,
                                           absl::Span<bf16> out, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::DecodeValueChunks(encoded.size(), m, C, d, spec, out.size()));
  KVSHADE_ASSIGN_OR_RETURN(const size_t chunk_bytes, ValueChunkBytes(spec, C, d));
  const std::byte* src = encoded.data();
  bf16* dst = out.data();
#pragma omp parallel for schedule(static) if (int64_t(m) * C * d >= kParallelMinElements)
  for (int i = 0; i < m; ++i) {
    cpu_internal::DecodeValueChunk(src + size_t(i) * chunk_bytes, C, d, spec,
                                   dst + size_t(i) * C * d);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::KiviQuantize(absl::Span<const bf16> x, const KiviLayout& layout,
                                      absl::Span<uint32_t> codes, absl::Span<fp16> scale,
                                      absl::Span<fp16> mn, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Kivi(x.size(), layout, codes.size(), scale.size(), mn.size()));
  const int G = layout.group, bits = layout.bits, wpg = layout.words_per_group();
  const int64_t inner = layout.inner();
  const int64_t n_groups = int64_t(layout.n_groups());
  const int64_t cols = layout.cols;
  const bool per_token = layout.axis == KiviAxis::kPerToken;
  const bf16* src = x.data();
  uint32_t* codes_out = codes.data();
  fp16* scale_out = scale.data();
  fp16* mn_out = mn.data();
#pragma omp parallel if (n_groups * G >= kParallelMinElements)
  {
    std::vector<float> buf(G);  // once per thread; this is the ingest path
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < n_groups; ++gi) {
      const int64_t o = gi / inner, in = gi % inner;
      if (per_token) {  // row o, columns in*G + [0, G)
        for (int i = 0; i < G; ++i) buf[i] = Bf16ToFloat(src[o * cols + in * G + i]);
      } else {  // column in, rows o*G + [0, G)
        for (int i = 0; i < G; ++i) buf[i] = Bf16ToFloat(src[(o * G + i) * cols + in]);
      }
      KiviQuantizeGroupReference(buf.data(), G, bits, codes_out + gi * wpg, &scale_out[gi],
                                 &mn_out[gi]);
    }
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::KiviDequantize(absl::Span<const uint32_t> codes,
                                        absl::Span<const fp16> scale, absl::Span<const fp16> mn,
                                        const KiviLayout& layout, absl::Span<bf16> x, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Kivi(x.size(), layout, codes.size(), scale.size(), mn.size()));
  const int G = layout.group, bits = layout.bits, wpg = layout.words_per_group();
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const int64_t inner = layout.inner();
  const int64_t n_groups = int64_t(layout.n_groups());
  const int64_t cols = layout.cols;
  const bool per_token = layout.axis == KiviAxis::kPerToken;
  const uint32_t* codes_in = codes.data();
  const fp16* scale_in = scale.data();
  const fp16* mn_in = mn.data();
  bf16* dst = x.data();
#pragma omp parallel for schedule(static) if (n_groups * G >= kParallelMinElements)
  for (int64_t gi = 0; gi < n_groups; ++gi) {
    const int64_t o = gi / inner, in = gi % inner;
    const float sf = Fp16ToFloat(scale_in[gi]), mf = Fp16ToFloat(mn_in[gi]);
    for (int i = 0; i < G; ++i) {
      const uint32_t word = codes_in[gi * wpg + i / per_word];
      const uint32_t q = (word >> (bits * (i % per_word))) & mask;
      const bf16 val = FloatToBf16(DecodeKivi(q, sf, mf));
      if (per_token) {
        dst[o * cols + in * G + i] = val;
      } else {
        dst[(o * G + i) * cols + in] = val;
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// Value and KIVI codecs: the docs/ALGORITHM.md T4 vectors, byte layouts of codec.h, round trips
// of every codec on random data with per-element error bounds, constant and zero-range
// groups, both KIVI axes, and rejection of bad layouts and sizes.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace codec_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::RandomBf16;
using testing::ToFloat;

uint32_t Pack2(const std::vector<int>& codes) {
  uint32_t w = 0;
  for (size_t i = 0; i < codes.size(); ++i) w |= uint32_t(codes[i]) << (2 * i);
  return w;
}

std::vector<int> Unpack(uint32_t w, int bits) {
  std::vector<int> out;
  for (int i = 0; i < 32 / bits; ++i) out.push_back(int((w >> (bits * i)) & ((1u << bits) - 1)));
  return out;
}

struct GroupResult {
  uint32_t word = 0;
  float scale = 0, mn = 0;
};

GroupResult QuantizeInt2(const std::vector<float>& x) {
  GroupResult r;
  fp16 s, m;
  KiviQuantizeGroupReference(x.data(), 16, 2, &r.word, &s, &m);
  r.scale = Fp16ToFloat(s);
  r.mn = Fp16ToFloat(m);
  return r;
}

// ------------------------------------------------------------------ T4 vectors
TEST(AlgorithmVectors, T4HalfToEven) {
  std::vector<float> x = {0, .5f, 1.5f, 2.5f, 3};
  x.resize(16, 3.0f);
  const GroupResult r = QuantizeInt2(x);
  EXPECT_EQ(r.mn, 0.0f);
  EXPECT_EQ(r.scale, 1.0f);
  std::vector<int> want = {0, 0, 2, 2, 3};
  want.resize(16, 3);
  EXPECT_EQ(Unpack(r.word, 2), want);
  EXPECT_EQ(r.word, Pack2(want));
}

TEST(AlgorithmVectors, T4Ramp) {
  std::vector<float> x(16);
  for (int i = 0; i < 16; ++i) x[i] = float(i);
  const GroupResult r = QuantizeInt2(x);
  EXPECT_EQ(r.mn, 0.0f);
  EXPECT_EQ(r.scale, 5.0f);
  EXPECT_EQ(Unpack(r.word, 2), (std::vector<int>{0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3}));
  EXPECT_EQ(r.word, 0xFEAA5540u);
}

TEST(AlgorithmVectors, T4Repeating) {
  std::vector<float> x;
  for (int rep = 0; rep < 4; ++rep) x.insert(x.end(), {0, 1, 2, 3});
  EXPECT_EQ(QuantizeInt2(x).word, 0xE4E4E4E4u);
}

TEST(AlgorithmVectors, T4LastOnly) {
  std::vector<float> x(15, 0.0f);
  x.push_back(3.0f);
  EXPECT_EQ(QuantizeInt2(x).word, 0xC0000000u);
}

TEST(AlgorithmVectors, T4ConstantGroupDecodesToItself) {
  auto be = Cpu();
  for (float c : {0.0f, 1.0f, -2.5f, 0.7f, -1000.0f, 3e-3f}) {
    const bf16 cb = FloatToBf16(c);
    for (int bits : {2, 4}) {
      KiviLayout l{.rows = 1, .cols = 32, .bits = bits, .group = 16, .axis = KiviAxis::kPerToken};
      std::vector<bf16> x(32, cb);
      std::vector<uint32_t> codes(l.code_words());
      std::vector<fp16> scale(l.n_groups()), mn(l.n_groups());
      ASSERT_TRUE(be->KiviQuantize(x, l, absl::MakeSpan(codes), absl::MakeSpan(scale),
                                   absl::MakeSpan(mn), {}).ok());
      std::vector<bf16> y(32);
      ASSERT_TRUE(be->KiviDequantize(codes, scale, mn, l, absl::MakeSpan(y), {}).ok());
      for (int i = 0; i < 32; ++i) {
        EXPECT_EQ(y[i].bits, cb.bits) << "c=" << c << " bits=" << bits;
      }
      for (uint32_t w : codes) EXPECT_EQ(w, 0u);
    }
  }
}

TEST(AlgorithmVectors, T4ZeroScaleNeverNaN) {
  // A range too small for fp16: scale rounds to 0, codes are 0, decode is mn.
  std::vector<float> x(16, 0.0f);
  x[3] = 1e-8f;
  const GroupResult r = QuantizeInt2(x);
  EXPECT_EQ(r.scale, 0.0f);
  EXPECT_EQ(r.word, 0u);
  auto be = Cpu();
  KiviLayout l{.rows = 1, .cols = 16, .bits = 2, .group = 16, .axis = KiviAxis::kPerToken};
  std::vector<uint32_t> codes = {0x12345678u};
  std::vector<fp16> scale = {fp16{0}}, mn = {FloatToFp16(0.25f)};
  std::vector<bf16> y(16);
  ASSERT_TRUE(be->KiviDequantize(codes, scale, mn, l, absl::MakeSpan(y), {}).ok());
  for (bf16 v : y) EXPECT_EQ(Bf16ToFloat(v), 0.25f);
}

// ------------------------------------------------------------------ names and sizes
TEST(Codec, NamesParseAndBits) {
  for (ValueCodec c : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4, ValueCodec::kINT2}) {
    auto parsed = ParseValueCodec(ValueCodecName(c));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, c);
  }
  EXPECT_EQ(ValueCodecName(ValueCodec::kFP8), "fp8");
  EXPECT_EQ(ParseValueCodec("INT2").value(), ValueCodec::kINT2);
  EXPECT_EQ(ParseValueCodec("int3").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseValueCodec("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodecBits(ValueCodec::kINT4), 4);
  EXPECT_EQ(CodecBits(ValueCodec::kINT2), 2);
  EXPECT_EQ(CodecBits(ValueCodec::kBF16), 0);
  EXPECT_EQ(CodecBits(ValueCodec::kFP8), 0);
}

TEST(Codec, ChunkBytes) {
  EXPECT_EQ(ValueChunkBytes({ValueCodec::kBF16}, 8, 128).value(), 2048u);
  EXPECT_EQ(ValueChunkBytes({ValueCodec::kFP8}, 8, 128).value(), 4u + 1024u);
  // int4, G=16: codes 8*8*2 words, scale + min 8*8 fp16 each.
  EXPECT_EQ(ValueChunkBytes({ValueCodec::kINT4, 16}, 8, 128).value(), 512u + 256u);
  // int2, G=16: 4 bits per element (2 + 32/16), a quarter of bf16.
  EXPECT_EQ(ValueChunkBytes({ValueCodec::kINT2, 16}, 8, 128).value(), 2048u / 4);
  EXPECT_EQ(ValueChunkBytes({ValueCodec::kINT2, 32}, 8, 64).value(), 8 * 2 * 2 * 4u + 2 * 8 * 2 * 2u);
  // Bad groups, sizes and codec ids.
  EXPECT_FALSE(ValueChunkBytes({ValueCodec::kINT2, 8}, 8, 128).ok());   // not a multiple of 16
  EXPECT_FALSE(ValueChunkBytes({ValueCodec::kINT4, 24}, 8, 64).ok());   // does not divide d
  EXPECT_FALSE(ValueChunkBytes({ValueCodec::kINT4, 0}, 8, 64).ok());
  EXPECT_FALSE(ValueChunkBytes({ValueCodec::kBF16}, 0, 64).ok());
  EXPECT_FALSE(ValueChunkBytes({ValueCodec::kBF16}, 8, -1).ok());
  EXPECT_FALSE(ValueChunkBytes({static_cast<ValueCodec>(9)}, 8, 64).ok());
}

TEST(Codec, BadKiviLayoutsRejected) {
  auto ok = [](KiviLayout l) { return ValidateKiviLayout(l).ok(); };
  EXPECT_TRUE(ok({.rows = 16, .cols = 32, .bits = 2, .group = 16, .axis = KiviAxis::kPerToken}));
  EXPECT_TRUE(ok({.rows = 32, .cols = 8, .bits = 4, .group = 8, .axis = KiviAxis::kPerChannel}));
  EXPECT_FALSE(ok({.rows = 16, .cols = 32, .bits = 3, .group = 16}));
  EXPECT_FALSE(ok({.rows = 16, .cols = 32, .bits = 2, .group = 8}));
  EXPECT_FALSE(ok({.rows = 16, .cols = 40, .bits = 2, .group = 16}));
  EXPECT_FALSE(ok({.rows = 24, .cols = 32, .bits = 2, .group = 16, .axis = KiviAxis::kPerChannel}));
  EXPECT_FALSE(ok({.rows = 0, .cols = 32, .bits = 2, .group = 16}));
  EXPECT_FALSE(ok({.rows = 16, .cols = 32, .bits = 2, .group = -16}));

  auto be = Cpu();
  KiviLayout l{.rows = 4, .cols = 32, .bits = 2, .group = 16, .axis = KiviAxis::kPerToken};
  std::vector<bf16> x(4 * 32);
  std::vector<uint32_t> codes(l.code_words());
  std::vector<fp16> scale(l.n_groups()), mn(l.n_groups());
  std::vector<uint32_t> short_codes(l.code_words() - 1);
  auto st = be->KiviQuantize(x, l, absl::MakeSpan(short_codes), absl::MakeSpan(scale),
                             absl::MakeSpan(mn), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  KiviLayout bad = l;
  bad.group = 12;
  st = be->KiviQuantize(x, bad, absl::MakeSpan(codes), absl::MakeSpan(scale), absl::MakeSpan(mn),
                        {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  std::vector<bf16> y(4 * 32 + 1);
  st = be->KiviDequantize(codes, scale, mn, l, absl::MakeSpan(y), {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

// ------------------------------------------------------------------ KIVI, both axes
// Per-element bound of a KIVI round trip from the group's stored scale and min: half a
// step, plus the fp16 rounding of scale and min (clamping at the ends), plus bf16 output
// rounding.
double KiviBound(float scale, float mn, int bits, float decoded) {
  const int levels = (1 << bits) - 1;
  return 0.5 * scale + 0x1p-10 * (levels * scale + std::fabs(mn)) +
         0x1p-8 * std::fabs(decoded) + 1e-30;
}

class KiviAxes : public ::testing::TestWithParam<std::tuple<KiviAxis, int, int>> {};

TEST_P(KiviAxes, MatchesReferenceAndRoundTrips) {
  const auto [axis, bits, group] = GetParam();
  auto be = Cpu();
  auto rng = MakeRng(10 + bits + group);
  KiviLayout l{.rows = 64, .cols = 96, .bits = bits, .group = group, .axis = axis};
  if (axis == KiviAxis::kPerToken) l.cols = 4 * group;
  const int rows = l.rows, cols = l.cols;
  const std::vector<bf16> xb = RandomBf16(size_t(rows) * cols, rng, 2.0f);
  const std::vector<float> x = ToFloat(xb);
  auto xbuf = testing::Upload(*be, xb);
  auto codes = testing::Scratch<uint32_t>(*be, l.code_words());
  auto scale = testing::Scratch<fp16>(*be, l.n_groups());
  auto mn = testing::Scratch<fp16>(*be, l.n_groups());
  ASSERT_TRUE(be->KiviQuantize(xbuf.span<const bf16>(), l, codes.span<uint32_t>(),
                               scale.span<fp16>(), mn.span<fp16>(), {}).ok());
  auto got_codes = testing::Download<uint32_t>(*be, codes.data(), l.code_words());
  auto got_scale = testing::Download<fp16>(*be, scale.data(), l.n_groups());
  auto got_mn = testing::Download<fp16>(*be, mn.data(), l.n_groups());

  // Every group equals the reference quantizer on the gathered elements.
  const int wpg = l.words_per_group();
  for (int o = 0; o < l.outer(); ++o) {
    for (int in = 0; in < l.inner(); ++in) {
      std::vector<float> g(group);
      for (int i = 0; i < group; ++i) {
        g[i] = axis == KiviAxis::kPerToken ? x[size_t(o) * cols + in * group + i]
                                           : x[size_t(o * group + i) * cols + in];
      }
      std::vector<uint32_t> w(wpg);
      fp16 s, m;
      KiviQuantizeGroupReference(g.data(), group, bits, w.data(), &s, &m);
      const size_t gi = size_t(o) * l.inner() + in;
      ASSERT_EQ(got_scale[gi].bits, s.bits) << o << "," << in;
      ASSERT_EQ(got_mn[gi].bits, m.bits) << o << "," << in;
      for (int j = 0; j < wpg; ++j) ASSERT_EQ(got_codes[gi * wpg + j], w[j]);
    }
  }

  auto ybuf = testing::Scratch<bf16>(*be, size_t(rows) * cols);
  ASSERT_TRUE(be->KiviDequantize(codes.span<const uint32_t>(), scale.span<const fp16>(),
                                 mn.span<const fp16>(), l, ybuf.span<bf16>(), {}).ok());
  const auto y = ToFloat(testing::Download<bf16>(*be, ybuf.data(), size_t(rows) * cols));
  for (int rr = 0; rr < rows; ++rr) {
    for (int c = 0; c < cols; ++c) {
      const size_t gi = axis == KiviAxis::kPerToken ? size_t(rr) * l.inner() + c / group
                                                    : size_t(rr / group) * l.inner() + c;
      const size_t e = size_t(rr) * cols + c;
      const float sc = Fp16ToFloat(got_scale[gi]), m = Fp16ToFloat(got_mn[gi]);
      ASSERT_LE(std::fabs(double(y[e]) - x[e]), KiviBound(sc, m, bits, y[e]))
          << "row " << rr << " col " << c;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, KiviAxes,
    ::testing::Combine(::testing::Values(KiviAxis::kPerToken, KiviAxis::kPerChannel),
                       ::testing::Values(2, 4), ::testing::Values(16, 32)));

// ------------------------------------------------------------------ value chunks
struct ChunkCase {
  ValueCodecSpec spec;
  const char* name;
};

class ValueChunks : public ::testing::TestWithParam<ChunkCase> {};

TEST_P(ValueChunks, LayoutAndRoundTrip) {
  const ValueCodecSpec spec = GetParam().spec;
  auto be = Cpu();
  auto rng = MakeRng(20 + int(spec.codec));
  const int n = 8 * 12 + 5, h = 3, d = 64, C = 8, n_chunks = 12;
  const std::vector<bf16> vb = RandomBf16(size_t(n) * h * d, rng, 1.5f);
  const std::vector<float> v = ToFloat(vb);
  const size_t chunk_bytes = ValueChunkBytes(spec, C, d).value();
  auto vbuf = testing::Upload(*be, vb);
  auto enc = testing::Scratch<std::byte>(*be, h * n_chunks * chunk_bytes);
  ASSERT_TRUE(be->EncodeValueChunks(vbuf.span<const bf16>(), n, h, d, C, n_chunks, spec,
                                    enc.span<std::byte>(), {}).ok());
  const auto bytes = testing::Download<std::byte>(*be, enc.data(), h * n_chunks * chunk_bytes);
  auto dec = testing::Scratch<bf16>(*be, size_t(h) * n_chunks * C * d);
  ASSERT_TRUE(be->DecodeValueChunks(enc.span<const std::byte>(), h * n_chunks, C, d, spec,
                                    dec.span<bf16>(), {}).ok());
  const auto y = ToFloat(testing::Download<bf16>(*be, dec.data(), size_t(h) * n_chunks * C * d));

  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < n_chunks; ++j) {
      const std::byte* chunk = bytes.data() + (size_t(hh) * n_chunks + j) * chunk_bytes;
      std::vector<float> x(size_t(C) * d);  // the chunk, [C, d]
      float amax = 0;
      for (int t = 0; t < C; ++t) {
        for (int c = 0; c < d; ++c) {
          x[t * d + c] = v[(size_t(j * C + t) * h + hh) * d + c];
          amax = std::max(amax, std::fabs(x[t * d + c]));
        }
      }
      const float* yc = y.data() + (size_t(hh) * n_chunks + j) * C * d;
      switch (spec.codec) {
        case ValueCodec::kBF16:
          for (int e = 0; e < C * d; ++e) ASSERT_EQ(yc[e], x[e]);
          break;
        case ValueCodec::kFP8: {
          float scale;
          std::memcpy(&scale, chunk, 4);
          ASSERT_EQ(scale, amax / 448.0f);
          for (int e = 0; e < C * d; ++e) {
            ASSERT_EQ(uint8_t(chunk[4 + e]), FloatToFp8E4M3(x[e] / scale)) << e;
            // 3 mantissa bits: half an ulp is 1/16 relative for normals, 2^-10 * scale
            // absolute for subnormals; plus the bf16 rounding of the output.
            const double bound = std::fabs(x[e]) / 16.0 + scale * 0x1p-10 +
                                 0x1p-8 * std::fabs(yc[e]);
            ASSERT_LE(std::fabs(double(yc[e]) - x[e]), bound) << e;
          }
          break;
        }
        case ValueCodec::kINT4:
        case ValueCodec::kINT2: {
          const int bits = CodecBits(spec.codec), G = spec.group, groups = d / G;
          const int wpg = G * bits / 32;
          const std::byte* scales = chunk + size_t(C) * groups * wpg * 4;
          const std::byte* mins = scales + size_t(C) * groups * 2;
          for (int t = 0; t < C; ++t) {
            for (int gi = 0; gi < groups; ++gi) {
              std::vector<uint32_t> w(wpg);
              fp16 s, m;
              KiviQuantizeGroupReference(&x[t * d + gi * G], G, bits, w.data(), &s, &m);
              const size_t g = size_t(t) * groups + gi;
              ASSERT_EQ(std::memcmp(chunk + g * wpg * 4, w.data(), wpg * 4), 0) << t << "," << gi;
              ASSERT_EQ(std::memcmp(scales + g * 2, &s, 2), 0);
              ASSERT_EQ(std::memcmp(mins + g * 2, &m, 2), 0);
              for (int i = 0; i < G; ++i) {
                const int e = t * d + gi * G + i;
                ASSERT_LE(std::fabs(double(yc[e]) - x[e]),
                          KiviBound(Fp16ToFloat(s), Fp16ToFloat(m), bits, yc[e]));
              }
            }
          }
          break;
        }
      }
    }
  }
  // Aggregate accuracy on Gaussian data, per codec (relative Frobenius error).
  std::vector<float> xs;
  for (int hh = 0; hh < h; ++hh)
    for (int j = 0; j < n_chunks; ++j)
      for (int t = 0; t < C; ++t)
        for (int c = 0; c < d; ++c) xs.push_back(v[(size_t(j * C + t) * h + hh) * d + c]);
  const double rel = testing::RelativeError(y, xs);
  const double limit = spec.codec == ValueCodec::kBF16  ? 0.0
                       : spec.codec == ValueCodec::kFP8 ? 0.05
                       : spec.codec == ValueCodec::kINT4 ? 0.12
                                                         : 0.6;
  EXPECT_LE(rel, limit) << GetParam().name;
}

INSTANTIATE_TEST_SUITE_P(
    All, ValueChunks,
    ::testing::Values(ChunkCase{{ValueCodec::kBF16}, "bf16"}, ChunkCase{{ValueCodec::kFP8}, "fp8"},
                      ChunkCase{{ValueCodec::kINT4, 16}, "int4"},
                      ChunkCase{{ValueCodec::kINT4, 32}, "int4g32"},
                      ChunkCase{{ValueCodec::kINT2, 16}, "int2"},
                      ChunkCase{{ValueCodec::kINT2, 64}, "int2g64"}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(ValueChunks, ZeroChunkFp8IsZeroNotNaN) {
  auto be = Cpu();
  const int C = 8, d = 64;
  std::vector<bf16> v(size_t(C) * d);  // all zeros (deliberately)
  const size_t bytes = ValueChunkBytes({ValueCodec::kFP8}, C, d).value();
  std::vector<std::byte> enc(bytes, std::byte{0xAB});
  ASSERT_TRUE(be->EncodeValueChunks(v, C, 1, d, C, 1, {ValueCodec::kFP8}, absl::MakeSpan(enc), {})
                  .ok());
  float scale;
  std::memcpy(&scale, enc.data(), 4);
  EXPECT_EQ(scale, 0.0f);
  std::vector<bf16> y(size_t(C) * d, FloatToBf16(7.0f));
  ASSERT_TRUE(be->DecodeValueChunks(enc, 1, C, d, {ValueCodec::kFP8}, absl::MakeSpan(y), {}).ok());
  for (bf16 b : y) EXPECT_EQ(Bf16ToFloat(b), 0.0f);
}

TEST(ValueChunks, BadArgumentsRejected) {
  auto be = Cpu();
  const int n = 40, h = 2, d = 64, C = 8;
  std::vector<bf16> v(size_t(n) * h * d);
  const ValueCodecSpec spec{ValueCodec::kINT2, 16};
  const size_t bytes = ValueChunkBytes(spec, C, d).value();
  std::vector<std::byte> out(h * 5 * bytes);
  EXPECT_TRUE(be->EncodeValueChunks(v, n, h, d, C, 5, spec, absl::MakeSpan(out), {}).ok());
  // n_chunks * C > n.
  std::vector<std::byte> out6(h * 6 * bytes);
  EXPECT_EQ(be->EncodeValueChunks(v, n, h, d, C, 6, spec, absl::MakeSpan(out6), {}).code(),
            absl::StatusCode::kInvalidArgument);
  // Output too small, v of the wrong size, bad group.
  EXPECT_EQ(be->EncodeValueChunks(v, n, h, d, C, 5, spec,
                                  absl::MakeSpan(out).subspan(0, out.size() - 1), {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->EncodeValueChunks(absl::MakeSpan(v).subspan(1), n, h, d, C, 5, spec,
                                  absl::MakeSpan(out), {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->EncodeValueChunks(v, n, h, d, C, 5, {ValueCodec::kINT2, 24}, absl::MakeSpan(out),
                                  {}).code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<bf16> y(size_t(h) * 5 * C * d);
  EXPECT_EQ(be->DecodeValueChunks(out, h * 5 + 1, C, d, spec, absl::MakeSpan(y), {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->DecodeValueChunks(out, -1, C, d, spec, absl::MakeSpan(y), {}).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace codec_test
}  // namespace kvshade::kernels

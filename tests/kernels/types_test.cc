// fp16 and fp8 (e4m3fn) conversions of types.h: exhaustive decode/encode round trips,
// known encodings, round-to-nearest-even ties, subnormals, saturation and NaN, and random
// inputs against a brute-force nearest-value search that shares no code with types.cc.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/types.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace types_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

uint16_t H(float f) { return FloatToFp16(f).bits; }
float HF(uint16_t bits) { return Fp16ToFloat(fp16{bits}); }

bool IsNegativeZero(float f) { return f == 0.0f && std::signbit(f); }

// Brute force: the value of `codes` (ascending, same sign, finite) nearest to |x|, ties to
// the even code. `value(code)` decodes.
template <typename Code, typename Decode>
Code NearestCode(double ax, const std::vector<Code>& codes, Decode value) {
  Code best = codes[0];
  double best_err = std::fabs(ax - double(value(best)));
  for (Code c : codes) {
    const double err = std::fabs(ax - double(value(c)));
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) != 0)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

// A random float with a log-uniform magnitude in [2^lo, 2^hi] and random mantissa bits.
float RandomFloat(std::mt19937_64& rng, int lo, int hi) {
  std::uniform_int_distribution<int> e(lo, hi);
  std::uniform_int_distribution<uint32_t> m(0, 0x7fffff);
  std::bernoulli_distribution neg(0.5);
  float f = std::ldexp(1.0f + float(m(rng)) * 0x1p-23f, e(rng));
  return neg(rng) ? -f : f;
}

// ---------------------------------------------------------------- fp16
TEST(Fp16, EveryCodeRoundTrips) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const float f = HF(uint16_t(bits));
    const bool nan = (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << bits;
      EXPECT_EQ(H(f), 0x7fff) << std::hex << bits;
    } else {
      EXPECT_EQ(H(f), bits) << std::hex << bits << " -> " << f;
    }
  }
}

TEST(Fp16, DecodesKnownValues) {
  EXPECT_EQ(HF(0x3c00), 1.0f);
  EXPECT_EQ(HF(0xc000), -2.0f);
  EXPECT_EQ(HF(0x7bff), 65504.0f);
  EXPECT_EQ(HF(0x0400), 0x1p-14f);
  EXPECT_EQ(HF(0x0001), 0x1p-24f);
  EXPECT_EQ(HF(0x03ff), 1023 * 0x1p-24f);
  EXPECT_EQ(HF(0x7c00), kInf);
  EXPECT_EQ(HF(0xfc00), -kInf);
  EXPECT_TRUE(IsNegativeZero(HF(0x8000)));
  EXPECT_EQ(HF(0x3555), 0x1.554p-2f);  // 0.333251953125
}

TEST(Fp16, EncodesKnownValuesTiesAndLimits) {
  EXPECT_EQ(H(1.0f), 0x3c00);
  EXPECT_EQ(H(-0.0f), 0x8000);
  EXPECT_EQ(H(0.0f), 0x0000);
  // Ties to even: 1 + 2^-11 is halfway between 0x3c00 and 0x3c01.
  EXPECT_EQ(H(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(H(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(H(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
  // Subnormals and underflow: 2^-25 is halfway between 0 and the smallest subnormal.
  EXPECT_EQ(H(0x1p-24f), 0x0001);
  EXPECT_EQ(H(0x1p-25f), 0x0000);
  EXPECT_EQ(H(-0x1p-25f), 0x8000);
  EXPECT_EQ(H(0x1.000002p-25f), 0x0001);
  EXPECT_EQ(H(3 * 0x1p-25f), 0x0002);  // 1.5 subnormal ulps: tie -> 2
  EXPECT_EQ(H(5 * 0x1p-25f), 0x0002);  // 2.5 -> 2
  EXPECT_EQ(H(1e-30f), 0x0000);
  EXPECT_EQ(H(0x1.ff8p-15f), 0x03ff);  // largest subnormal
  EXPECT_EQ(H(0x1.ffcp-15f), 0x0400);  // halfway to 2^-14: ties to even, the normal 0x0400
  // Overflow: 65520 is halfway between 65504 and 65536 (inf): ties to even -> inf.
  EXPECT_EQ(H(65504.0f), 0x7bff);
  EXPECT_EQ(H(65519.996f), 0x7bff);
  EXPECT_EQ(H(65520.0f), 0x7c00);
  EXPECT_EQ(H(-1e10f), 0xfc00);
  EXPECT_EQ(H(kInf), 0x7c00);
  EXPECT_EQ(H(-kInf), 0xfc00);
  EXPECT_EQ(H(kNaN), 0x7fff);
  EXPECT_EQ(H(-kNaN), 0x7fff);
}

TEST(Fp16, RandomFloatsRoundToNearestEven) {
  // Positive finite fp16 values are monotone in their bits: 0x0000 .. 0x7bff.
  std::vector<float> table(0x7c00);
  for (uint32_t b = 0; b < 0x7c00; ++b) table[b] = HF(uint16_t(b));
  auto rng = testing::MakeRng(1);
  for (int i = 0; i < 200000; ++i) {
    const float x = RandomFloat(rng, -27, 16);
    const double ax = std::fabs(double(x));
    uint16_t want;
    if (ax >= 65520.0) {
      want = 0x7c00;
    } else {
      // Bracket by binary search, then pick the nearer (ties to the even code).
      const auto it = std::upper_bound(table.begin(), table.end(), float(ax));
      const uint16_t hi = uint16_t(std::min<ptrdiff_t>(it - table.begin(), 0x7bff));
      const uint16_t lo = hi == 0 ? 0 : uint16_t(hi - 1);
      want = NearestCode<uint16_t>(ax, {lo, hi}, HF);
    }
    if (std::signbit(x)) want |= 0x8000;
    ASSERT_EQ(H(x), want) << "x = " << x;
  }
}

// ---------------------------------------------------------------- fp8 e4m3fn
TEST(Fp8E4M3, EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float f = Fp8E4M3ToFloat(uint8_t(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << code;
      EXPECT_EQ(FloatToFp8E4M3(f), 0x7f) << code;
      continue;
    }
    EXPECT_TRUE(std::isfinite(f)) << code;
    EXPECT_EQ(FloatToFp8E4M3(f), code) << code << " -> " << f;
    // Formula check: bias 7, 3 mantissa bits, subnormals at exponent field 0.
    const int e = (code >> 3) & 0xf, m = code & 7;
    const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    EXPECT_EQ(double(f), (code & 0x80) ? -mag : mag) << code;
  }
}

TEST(Fp8E4M3, EncodesKnownValuesTiesAndLimits) {
  EXPECT_EQ(FloatToFp8E4M3(1.0f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(-1.0f), 0xb8);
  EXPECT_EQ(FloatToFp8E4M3(0.5f), 0x30);
  EXPECT_EQ(FloatToFp8E4M3(448.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-448.0f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(0x1p-6f), 0x08);  // smallest normal
  EXPECT_EQ(FloatToFp8E4M3(0x1p-9f), 0x01);  // smallest subnormal
  EXPECT_EQ(FloatToFp8E4M3(7 * 0x1p-9f), 0x07);
  EXPECT_EQ(FloatToFp8E4M3(0.0f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0.0f), 0x80);
  // Ties to even between 1.0 (0x38) and 1.125 (0x39), and 1.125 and 1.25 (0x3a).
  EXPECT_EQ(FloatToFp8E4M3(1.0625f), 0x38);
  EXPECT_EQ(FloatToFp8E4M3(1.1875f), 0x3a);
  EXPECT_EQ(FloatToFp8E4M3(1.0625001f), 0x39);
  // Subnormal ties: 0.5, 1.5, 2.5 ulps of 2^-9.
  EXPECT_EQ(FloatToFp8E4M3(0x1p-10f), 0x00);
  EXPECT_EQ(FloatToFp8E4M3(-0x1p-10f), 0x80);
  EXPECT_EQ(FloatToFp8E4M3(3 * 0x1p-10f), 0x02);
  EXPECT_EQ(FloatToFp8E4M3(5 * 0x1p-10f), 0x02);
  EXPECT_EQ(FloatToFp8E4M3(0x1.000002p-10f), 0x01);
  EXPECT_EQ(FloatToFp8E4M3(15 * 0x1p-10f), 0x08);  // 7.5 ulps -> 8 = 2^-6 (normal)
  EXPECT_EQ(FloatToFp8E4M3(1e-20f), 0x00);
  // Saturation to +-448 (SATFINITE): values past the largest finite and infinities.
  EXPECT_EQ(FloatToFp8E4M3(449.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(464.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(500.0f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(1e30f), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-1e30f), 0xfe);
  EXPECT_EQ(FloatToFp8E4M3(kInf), 0x7e);
  EXPECT_EQ(FloatToFp8E4M3(-kInf), 0xfe);
  // NaN: the canonical 0x7f whatever the sign.
  EXPECT_EQ(FloatToFp8E4M3(kNaN), 0x7f);
  EXPECT_EQ(FloatToFp8E4M3(-kNaN), 0x7f);
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4M3ToFloat(0xff)));
  EXPECT_EQ(Fp8E4M3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(kFp8E4M3Max, 448.0f);
}

TEST(Fp8E4M3, RandomFloatsRoundToNearestEven) {
  std::vector<uint8_t> positive;  // finite, non-negative codes
  for (int c = 0; c < 0x7f; ++c) positive.push_back(uint8_t(c));
  auto rng = testing::MakeRng(2);
  for (int i = 0; i < 50000; ++i) {
    const float x = RandomFloat(rng, -12, 9);
    const double ax = std::fabs(double(x));
    uint8_t want = ax >= 448.0 ? uint8_t{0x7e} : NearestCode<uint8_t>(ax, positive, Fp8E4M3ToFloat);
    if (std::signbit(x)) want |= 0x80;
    ASSERT_EQ(FloatToFp8E4M3(x), want) << "x = " << x;
  }
}

}  // namespace
}  // namespace types_test
}  // namespace kvshade::kernels

// RoPE tables and rotation: identity at position 0, hand-computed rotations in both
// pairings, partial rotary dims, linear/llama3/yarn scaling against independently coded
// formulas, invalid specs, and the CPU backend against ApplyRopeReference (bit-exact).
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/rope.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace rope_test {
namespace {

using testing::Cpu;
using testing::Download;
using testing::MakeRng;
using testing::RandomBf16;
using testing::ToFloat;
using testing::Upload;

constexpr double kPi = std::numbers::pi;

RopeTable Table(const RopeSpec& spec, int d) {
  auto t = MakeRopeTable(spec, d);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *t : RopeTable{};
}

// Runs the CPU backend's ApplyRope on x [n, heads, d] and returns the result.
std::vector<bf16> CpuRope(const RopeSpec& spec, const std::vector<int64_t>& pos, int heads,
                          int d, const std::vector<bf16>& x) {
  auto cpu = Cpu();
  Buffer buf = Upload(*cpu, x);
  absl::Status st = cpu->ApplyRope(spec, pos, heads, d, buf.span<bf16>().subspan(0, x.size()));
  EXPECT_TRUE(st.ok()) << st;
  return Download<bf16>(*cpu, buf.data(), x.size());
}

TEST(Rope, PositionZeroIsIdentity) {
  auto rng = MakeRng(1);
  const int n = 5, heads = 3, d = 64;
  std::vector<bf16> x = RandomBf16(size_t(n) * heads * d, rng);
  for (RopePairing pairing : {RopePairing::kHalfSplit, RopePairing::kInterleaved}) {
    RopeSpec spec;
    spec.pairing = pairing;
    std::vector<bf16> y = CpuRope(spec, std::vector<int64_t>(n, 0), heads, d, x);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i].bits, y[i].bits) << i;
  }
}

TEST(Rope, HandComputedRotationSmallD) {
  // d = 4, theta = 100: inv_freq = [1, 100^(-1/2) = 0.1]; position 3 -> angles 3 and 0.3.
  RopeSpec spec;
  spec.theta = 100.0f;
  RopeTable t = Table(spec, 4);
  ASSERT_EQ(t.inv_freq.size(), 2u);
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(t.inv_freq[1], 0.1f);
  const double c0 = std::cos(3.0), s0 = std::sin(3.0), c1 = std::cos(0.3), s1 = std::sin(0.3);
  {
    // Half-split: pairs (0, 2) and (1, 3).
    float x[4] = {1, 2, 3, 4};
    ApplyRopeReference(t, RopePairing::kHalfSplit, 3, x, 4);
    EXPECT_NEAR(x[0], 1 * c0 - 3 * s0, 1e-6);
    EXPECT_NEAR(x[2], 3 * c0 + 1 * s0, 1e-6);
    EXPECT_NEAR(x[1], 2 * c1 - 4 * s1, 1e-6);
    EXPECT_NEAR(x[3], 4 * c1 + 2 * s1, 1e-6);
  }
  {
    // Interleaved: pairs (0, 1) and (2, 3).
    float x[4] = {1, 2, 3, 4};
    ApplyRopeReference(t, RopePairing::kInterleaved, 3, x, 4);
    EXPECT_NEAR(x[0], 1 * c0 - 2 * s0, 1e-6);
    EXPECT_NEAR(x[1], 2 * c0 + 1 * s0, 1e-6);
    EXPECT_NEAR(x[2], 3 * c1 - 4 * s1, 1e-6);
    EXPECT_NEAR(x[3], 4 * c1 + 3 * s1, 1e-6);
  }
}

TEST(Rope, PartialRotaryDimLeavesTailUntouched) {
  auto rng = MakeRng(2);
  const int n = 7, heads = 2, d = 16;
  std::vector<bf16> x = RandomBf16(size_t(n) * heads * d, rng);
  std::vector<int64_t> pos = {0, 1, 5, 100, 1000, 77777, 123456};
  for (RopePairing pairing : {RopePairing::kHalfSplit, RopePairing::kInterleaved}) {
    RopeSpec spec;
    spec.rotary_dim = 8;
    spec.pairing = pairing;
    std::vector<bf16> y = CpuRope(spec, pos, heads, d, x);
    RopeSpec head_spec = spec;
    head_spec.rotary_dim = 0;  // full rotation of an 8-dim vector: same frequencies
    RopeTable t8 = Table(head_spec, 8);
    for (int t = 0; t < n; ++t) {
      for (int hh = 0; hh < heads; ++hh) {
        const size_t base = (size_t(t) * heads + hh) * d;
        for (int c = 8; c < d; ++c) ASSERT_EQ(y[base + c].bits, x[base + c].bits);
        float v[8];
        for (int c = 0; c < 8; ++c) v[c] = Bf16ToFloat(x[base + c]);
        ApplyRopeReference(t8, pairing, pos[t], v, 8);
        for (int c = 0; c < 8; ++c) ASSERT_EQ(y[base + c].bits, FloatToBf16(v[c]).bits);
      }
    }
  }
}

TEST(Rope, LinearScalingDividesPositions) {
  RopeSpec none;
  none.theta = 10000.0f;
  RopeSpec linear = none;
  linear.scaling = RopeScaling::kLinear;
  auto rng = MakeRng(3);
  for (float factor : {2.0f, 4.0f}) {
    linear.factor = factor;
    RopeTable tl = Table(linear, 64), tn = Table(none, 64);
    EXPECT_FLOAT_EQ(tl.position_scale, 1.0f / factor);
    EXPECT_EQ(tl.inv_freq, tn.inv_freq);
    std::vector<float> x = testing::RandomFloats(64, rng);
    for (long long p : {0LL, 12LL, 4096LL, 131072LL}) {
      std::vector<float> a = x, b = x;
      ApplyRopeReference(tl, RopePairing::kHalfSplit, p, a.data(), 64);
      ApplyRopeReference(tn, RopePairing::kHalfSplit, p / static_cast<long long>(factor),
                         b.data(), 64);
      EXPECT_EQ(a, b) << "position " << p << " factor " << factor;
    }
  }
}

// Llama-3.1 frequency scaling coded independently of the library: per frequency, by its
// wavelength relative to the original context.
double Llama3Expected(int i, int dim, double theta, double factor, double low, double high,
                      double orig) {
  const double f = std::pow(theta, -2.0 * i / dim);
  const double wavelen = 2 * kPi / f;
  if (wavelen < orig / high) return f;  // high frequency: unchanged
  if (wavelen > orig / low) return f / factor;  // low frequency: interpolated
  const double ratio = orig / wavelen;          // rotations over the original context
  const double s = (ratio - low) / (high - low);
  return f * (s + (1 - s) / factor);
}

TEST(Rope, Llama3MatchesLlama31Formula) {
  // Llama-3.1-8B: theta 500000, head dim 128, factor 8, low 1, high 4, original 8192.
  RopeSpec spec;
  spec.theta = 500000.0f;
  spec.scaling = RopeScaling::kLlama3;
  spec.factor = 8.0f;
  spec.low_freq_factor = 1.0f;
  spec.high_freq_factor = 4.0f;
  spec.original_max_position = 8192;
  RopeTable t = Table(spec, 128);
  ASSERT_EQ(t.inv_freq.size(), 64u);
  EXPECT_EQ(t.magnitude, 1.0f);
  EXPECT_EQ(t.position_scale, 1.0f);
  int unchanged = 0, divided = 0, smoothed = 0;
  for (int i = 0; i < 64; ++i) {
    const double want = Llama3Expected(i, 128, 500000.0, 8, 1, 4, 8192);
    EXPECT_NEAR(t.inv_freq[i], want, 1e-6 * want) << "pair " << i;
    const double base = std::pow(500000.0, -2.0 * i / 128);
    if (std::fabs(want - base) < 1e-12 * base) ++unchanged;
    else if (std::fabs(want - base / 8) < 1e-12 * base) ++divided;
    else ++smoothed;
  }
  // All three bands are present for this configuration.
  EXPECT_GT(unchanged, 0);
  EXPECT_GT(divided, 0);
  EXPECT_GT(smoothed, 0);
  EXPECT_FLOAT_EQ(t.inv_freq[0], 1.0f);
  EXPECT_NEAR(t.inv_freq[63], std::pow(500000.0, -126.0 / 128) / 8, 1e-12);
}

TEST(Rope, YarnMatchesNtkByPartsFormula) {
  // A YaRN config: theta 10000, head dim 128, factor 4, original 4096, beta 32 / 1.
  RopeSpec spec;
  spec.theta = 10000.0f;
  spec.scaling = RopeScaling::kYarn;
  spec.factor = 4.0f;
  spec.original_max_position = 4096;
  spec.beta_fast = 32.0f;
  spec.beta_slow = 1.0f;
  RopeTable t = Table(spec, 128);
  ASSERT_EQ(t.inv_freq.size(), 64u);
  EXPECT_NEAR(t.magnitude, 0.1 * std::log(4.0) + 1.0, 1e-6);
  // Pair index at which a frequency completes `rot` rotations over the original context:
  // theta^(-2i/dim) * orig = 2*pi*rot  =>  i = (dim/2) * ln(orig / (2*pi*rot)) / ln(theta).
  auto pair_for = [](double rot) { return 64.0 * std::log(4096.0 / (2 * kPi * rot)) / std::log(10000.0); };
  const double lo = std::floor(pair_for(32.0));  // 20
  const double hi = std::ceil(pair_for(1.0));    // 46
  ASSERT_EQ(lo, 20.0);
  ASSERT_EQ(hi, 46.0);
  for (int i = 0; i < 64; ++i) {
    const double f = std::pow(10000.0, -2.0 * i / 128);
    double want;
    if (i <= lo) {
      want = f;  // extrapolation: unchanged
    } else if (i >= hi) {
      want = f / 4;  // interpolation
    } else {
      const double ramp = (i - lo) / (hi - lo);  // 0 -> keep, 1 -> divide by factor
      want = f * (1 - ramp) + (f / 4) * ramp;
    }
    EXPECT_NEAR(t.inv_freq[i], want, 1e-6 * want) << "pair " << i;
  }
  // cos and sin carry mscale: at position 0, x -> mscale * x.
  float x[4] = {1, 2, 3, 4};
  RopeTable small = Table(spec, 4);
  ApplyRopeReference(small, RopePairing::kHalfSplit, 0, x, 4);
  EXPECT_NEAR(x[3], 4 * (0.1 * std::log(4.0) + 1.0), 1e-5);
}

TEST(Rope, InvalidSpecsRejected) {
  auto bad = [](RopeSpec s, int d, const char* what) {
    auto t = MakeRopeTable(s, d);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << what;
  };
  RopeSpec ok;
  ASSERT_TRUE(MakeRopeTable(ok, 128).ok());
  RopeSpec s = ok;
  s.theta = 0;
  bad(s, 128, "theta 0");
  s.theta = -1;
  bad(s, 128, "theta < 0");
  s.theta = NAN;
  bad(s, 128, "theta NaN");
  s = ok;
  s.rotary_dim = 7;
  bad(s, 128, "odd rotary_dim");
  s.rotary_dim = 130;
  bad(s, 128, "rotary_dim > d");
  s.rotary_dim = -2;
  bad(s, 128, "negative rotary_dim");
  bad(ok, 7, "odd d with rotary_dim 0");
  bad(ok, 0, "d 0");
  s = ok;
  s.scaling = RopeScaling::kLinear;
  s.factor = 0.5f;
  bad(s, 128, "linear factor < 1");
  s = ok;
  s.scaling = RopeScaling::kLlama3;
  s.factor = 8;
  ASSERT_TRUE(MakeRopeTable(s, 128).ok());
  RopeSpec l = s;
  l.high_freq_factor = l.low_freq_factor;
  bad(l, 128, "llama3 high == low");
  l = s;
  l.low_freq_factor = 0;
  bad(l, 128, "llama3 low 0");
  l = s;
  l.original_max_position = 0;
  bad(l, 128, "llama3 original 0");
  l = s;
  l.factor = 0.9f;
  bad(l, 128, "llama3 factor < 1");
  s = ok;
  s.scaling = RopeScaling::kYarn;
  s.factor = 4;
  ASSERT_TRUE(MakeRopeTable(s, 128).ok());
  RopeSpec y = s;
  y.beta_fast = y.beta_slow;
  bad(y, 128, "yarn beta_fast == beta_slow");
  y = s;
  y.factor = 0.5f;
  bad(y, 128, "yarn factor < 1");
  y = s;
  y.original_max_position = -1;
  bad(y, 128, "yarn original < 0");

  // The backend op rejects the same specs and mismatched sizes.
  auto cpu = Cpu();
  std::vector<bf16> x(2 * 4 * 8);
  std::vector<int64_t> pos = {0, 1};
  s = ok;
  s.theta = 0;
  EXPECT_EQ(cpu->ApplyRope(s, pos, 4, 8, absl::MakeSpan(x)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->ApplyRope(ok, pos, 4, 8, absl::MakeSpan(x).subspan(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->ApplyRope(ok, pos, 0, 8, absl::MakeSpan(x)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(cpu->ApplyRope(ok, pos, 4, 8, absl::MakeSpan(x)).ok());
}

TEST(Rope, CpuApplyRopeEqualsReference) {
  auto rng = MakeRng(4);
  const int n = 48, heads = 4, d = 128;
  std::vector<bf16> x = RandomBf16(size_t(n) * heads * d, rng, 2.0f);
  std::vector<int64_t> pos(n);
  std::uniform_int_distribution<int64_t> pd(0, 200000);
  for (auto& p : pos) p = pd(rng);
  pos[0] = 0;
  std::vector<RopeSpec> specs(4);
  specs[1].scaling = RopeScaling::kLinear;
  specs[1].factor = 3.0f;
  specs[2].theta = 500000.0f;
  specs[2].scaling = RopeScaling::kLlama3;
  specs[2].factor = 8.0f;
  specs[3].scaling = RopeScaling::kYarn;
  specs[3].factor = 4.0f;
  specs[3].rotary_dim = 64;
  for (const RopeSpec& base : specs) {
    for (RopePairing pairing : {RopePairing::kHalfSplit, RopePairing::kInterleaved}) {
      RopeSpec spec = base;
      spec.pairing = pairing;
      std::vector<bf16> y = CpuRope(spec, pos, heads, d, x);
      RopeTable t = Table(spec, d);
      std::vector<float> xf = ToFloat(x);
      for (int tok = 0; tok < n; ++tok) {
        for (int hh = 0; hh < heads; ++hh) {
          float* v = xf.data() + (size_t(tok) * heads + hh) * d;
          ApplyRopeReference(t, pairing, pos[tok], v, d);
        }
      }
      for (size_t i = 0; i < y.size(); ++i) {
        ASSERT_EQ(y[i].bits, FloatToBf16(xf[i]).bits)
            << "element " << i << " scaling " << int(spec.scaling) << " pairing "
            << int(pairing);
      }
    }
  }
}

}  // namespace
}  // namespace rope_test
}  // namespace kvshade::kernels

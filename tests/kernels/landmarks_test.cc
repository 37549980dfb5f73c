// BuildLandmarks (docs/ALGORITHM.md shadow steps 4-5) on the CPU backend: fp32 chunk means
// rounded once to bf16, min cosines against a double-precision loop, the zero-vector
// conventions, channel/token tiling, and argument checks.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace landmarks_test {
namespace {

using testing::Cpu;
using testing::MakeRng;

struct Out {
  absl::Status status;
  std::vector<bf16> landmarks;
  std::vector<float> min_cos;
};

Out RunLandmarks(const std::vector<bf16>& kr, int n, int h, int d, int C, int n_chunks) {
  auto cpu = Cpu();
  Out o;
  o.landmarks.assign(size_t(n_chunks) * h * d, bf16{0xFFFF});
  o.min_cos.assign(size_t(h) * n_chunks, NAN);
  o.status = cpu->BuildLandmarks(kr, n, h, d, C, n_chunks, absl::MakeSpan(o.landmarks),
                                 absl::MakeSpan(o.min_cos));
  return o;
}

void CheckAgainstNaive(const std::vector<bf16>& kr, int n, int h, int d, int C, int n_chunks) {
  Out o = RunLandmarks(kr, n, h, d, C, n_chunks);
  ASSERT_TRUE(o.status.ok()) << o.status;
  for (int j = 0; j < n_chunks; ++j) {
    for (int hh = 0; hh < h; ++hh) {
      std::vector<float> mean(d, 0.0f);  // fp32, token order, then / C
      for (int t = 0; t < C; ++t)
        for (int c = 0; c < d; ++c)
          mean[c] += Bf16ToFloat(kr[(size_t(j * C + t) * h + hh) * d + c]);
      for (auto& m : mean) m /= float(C);
      double worst = 2;
      for (int t = 0; t < C; ++t) {
        double dot = 0, mm = 0, kk = 0;
        for (int c = 0; c < d; ++c) {
          const double x = Bf16ToFloat(kr[(size_t(j * C + t) * h + hh) * d + c]);
          dot += mean[c] * x;
          mm += double(mean[c]) * mean[c];
          kk += x * x;
        }
        const double cs = (mm == 0 && kk == 0) ? 1.0 : (mm == 0 || kk == 0) ? 0.0 : dot / std::sqrt(mm * kk);
        worst = std::min(worst, cs);
      }
      for (int c = 0; c < d; ++c) {
        ASSERT_EQ(o.landmarks[(size_t(j) * h + hh) * d + c].bits, FloatToBf16(mean[c]).bits)
            << "chunk " << j << " head " << hh << " channel " << c;
      }
      EXPECT_NEAR(o.min_cos[size_t(hh) * n_chunks + j], worst, 1e-6)
          << "chunk " << j << " head " << hh;
    }
  }
}

TEST(Landmarks, MatchesNaiveLoop) {
  auto rng = MakeRng(20);
  const int n = 100, h = 3, d = 40, C = 8, n_chunks = 11;  // 12 tokens of tail ignored
  CheckAgainstNaive(testing::RandomBf16(size_t(n) * h * d, rng), n, h, d, C, n_chunks);
}

TEST(Landmarks, WideHeadsAndLongChunks) {
  // d > the channel tile and C > the token group of the implementation.
  auto rng = MakeRng(21);
  const int n = 150, h = 2, d = 300, C = 70, n_chunks = 2;
  CheckAgainstNaive(testing::RandomBf16(size_t(n) * h * d, rng, 0.5f), n, h, d, C, n_chunks);
}

TEST(Landmarks, ZeroVectorConventions) {
  const int h = 1, d = 4, C = 2, n_chunks = 3, n = 6;
  std::vector<float> k(size_t(n) * h * d, 0.0f);
  // Chunk 0: both keys zero -> mean zero, cosine 1.
  // Chunk 1: x and -x -> mean zero, keys nonzero -> cosine 0.
  k[8] = 1, k[9] = 2, k[12] = -1, k[13] = -2;
  // Chunk 2: one zero key and one nonzero -> the zero key has cosine 0 with the mean.
  k[16] = 3;
  Out o = RunLandmarks(testing::ToBf16(k), n, h, d, C, n_chunks);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.min_cos[0], 1.0f);
  EXPECT_EQ(o.min_cos[1], 0.0f);
  EXPECT_EQ(o.min_cos[2], 0.0f);
  for (int c = 0; c < 8; ++c) EXPECT_EQ(Bf16ToFloat(o.landmarks[c]), 0.0f);
  EXPECT_EQ(Bf16ToFloat(o.landmarks[8]), 1.5f);
}

TEST(Landmarks, IdenticalKeysHaveCosineOne) {
  const int h = 2, d = 16, C = 8, n = 8;
  auto rng = MakeRng(22);
  std::vector<bf16> one = testing::RandomBf16(size_t(h) * d, rng);
  std::vector<bf16> k;
  for (int t = 0; t < C; ++t) k.insert(k.end(), one.begin(), one.end());
  Out o = RunLandmarks(k, n, h, d, C, 1);
  ASSERT_TRUE(o.status.ok());
  for (float c : o.min_cos) EXPECT_NEAR(c, 1.0f, 1e-6);
  for (size_t i = 0; i < one.size(); ++i) EXPECT_EQ(o.landmarks[i].bits, one[i].bits);
}

TEST(Landmarks, BadArgumentsRejected) {
  const int h = 2, d = 8, C = 8, n = 40;
  std::vector<bf16> k(size_t(n) * h * d);
  auto code = [&](int nn, int hh, int dd, int cc, int chunks, size_t lm, size_t mc, size_t ks) {
    auto cpu = Cpu();
    std::vector<bf16> l(lm);
    std::vector<float> m(mc);
    return cpu->BuildLandmarks(absl::MakeSpan(k.data(), ks), nn, hh, dd, cc, chunks,
                               absl::MakeSpan(l), absl::MakeSpan(m))
        .code();
  };
  EXPECT_EQ(code(n, h, d, C, 5, 5 * h * d, h * 5, k.size()), absl::StatusCode::kOk);
  EXPECT_EQ(code(n, h, d, C, 0, 0, 0, k.size()), absl::StatusCode::kOk);
  EXPECT_EQ(code(n, h, d, C, 6, 6 * h * d, h * 6, k.size()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(n, h, d, C, 5, 5 * h * d - 1, h * 5, k.size()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(n, h, d, C, 5, 5 * h * d, h * 5 + 1, k.size()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(n, h, d, C, 5, 5 * h * d, h * 5, k.size() - 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(n, h, d, 0, 5, 5 * h * d, h * 5, k.size()), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(n, h, d, C, -1, 0, 0, k.size()), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace landmarks_test
}  // namespace kvshade::kernels

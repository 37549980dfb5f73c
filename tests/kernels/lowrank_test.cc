// Low-rank keys (docs/ALGORITHM.md shadow step 1, T2): Factorize and ProjectKeys on the CPU
// backend. Exact-rank reconstruction with bf16 storage, optimality against the
// Eckart-Young bound, orthonormal basis, adaptive rank, the eigenvector sign convention,
// projection residuals, determinism and argument checks.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace lowrank_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::ToBf16;
using testing::ToFloat;

// K = X Y (+ noise) with X [n, r0] ~ N(0, 1), Y [r0, D] ~ N(0, 1/r0): exact rank r0 before
// bf16 rounding, entries of RMS `scale`.
std::vector<float> LowRankKeys(int n, int D, int r0, std::mt19937_64& rng, float scale = 1.0f,
                               float noise = 0.0f, std::vector<float>* y_out = nullptr) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(size_t(n) * r0), y(size_t(r0) * D);
  for (auto& v : x) v = nd(rng);
  for (auto& v : y) v = nd(rng) * scale / std::sqrt(float(r0));
  std::vector<float> k(size_t(n) * D, 0.0f);
  for (int t = 0; t < n; ++t) {
    float* row = k.data() + size_t(t) * D;
    for (int i = 0; i < r0; ++i) {
      const float a = x[size_t(t) * r0 + i];
      const float* yr = y.data() + size_t(i) * D;
      for (int c = 0; c < D; ++c) row[c] += a * yr[c];
    }
    if (noise > 0) {
      for (int c = 0; c < D; ++c) row[c] += noise * nd(rng);
    }
  }
  if (y_out) *y_out = std::move(y);
  return k;
}

struct Factors {
  absl::Status status;
  FactorizeResult result;
  std::vector<bf16> a, b;  // sized for options.rank
  std::vector<float> eig;
};

Factors RunFactorize(Backend& be, const std::vector<bf16>& k, int n, const LayerShape& shape,
                     const FactorizeOptions& opt) {
  Factors f;
  const size_t r = size_t(opt.rank);
  f.a.assign(size_t(n) * r, bf16{0xFFFF});
  f.b.assign(size_t(shape.h) * r * shape.d, bf16{0xFFFF});
  f.eig.assign(size_t(shape.D()), NAN);
  auto ws = be.Allocate(be.FactorizeWorkspaceBytes(n, shape, opt));
  EXPECT_TRUE(ws.ok());
  auto res = be.Factorize(k, n, shape, opt, absl::MakeSpan(f.a), absl::MakeSpan(f.b),
                          absl::MakeSpan(f.eig), ws->workspace());
  f.status = res.status();
  if (res.ok()) f.result = *res;
  return f;
}

// The full solve and 4 steps of subspace iteration at rank r on the same keys.
std::pair<Factors, Factors> FullAndSubspace(Backend& be, const std::vector<bf16>& k, int n,
                                            const LayerShape& shape, int r) {
  FactorizeOptions full;
  full.rank = r;
  FactorizeOptions sub = full;
  sub.subspace_iterations = 4;
  return {RunFactorize(be, k, n, shape, full), RunFactorize(be, k, n, shape, sub)};
}

// W^T [r, D] from b [h, r, d] (bf16 -> fp32).
std::vector<float> BasisRows(const std::vector<bf16>& b, const LayerShape& s, int r) {
  const int D = s.D();
  std::vector<float> wt(size_t(r) * D);
  for (int hh = 0; hh < s.h; ++hh)
    for (int i = 0; i < r; ++i)
      for (int c = 0; c < s.d; ++c)
        wt[size_t(i) * D + size_t(hh) * s.d + c] = Bf16ToFloat(b[(size_t(hh) * r + i) * s.d + c]);
  return wt;
}

// A [n, r] . W^T [r, D] in fp32.
std::vector<float> Reconstruct(const std::vector<bf16>& a, const std::vector<float>& wt, int n,
                               int r, int D) {
  std::vector<float> out(size_t(n) * D, 0.0f);
  for (int t = 0; t < n; ++t) {
    float* row = out.data() + size_t(t) * D;
    for (int i = 0; i < r; ++i) {
      const float av = Bf16ToFloat(a[size_t(t) * r + i]);
      const float* w = wt.data() + size_t(i) * D;
      for (int c = 0; c < D; ++c) row[c] += av * w[c];
    }
  }
  return out;
}

double SumSquares(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += double(v) * v;
  return s;
}

TEST(AlgorithmVectors, T2LowRankExactRank) {
  auto rng = MakeRng(10);
  const LayerShape shape{8, 4, 128};  // D = 1024
  const int n = 2048, r = 160, D = shape.D();
  std::vector<bf16> k = ToBf16(LowRankKeys(n, D, r, rng));
  auto cpu = Cpu();
  Factors f = RunFactorize(*cpu, k, n, shape, FactorizeOptions{r, 0});
  ASSERT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.result.rank, r);
  EXPECT_GT(f.result.captured_energy, 0.9999);
  EXPECT_LE(f.result.captured_energy, 1.0);
  for (int i = 1; i < D; ++i) ASSERT_GE(f.eig[i - 1], f.eig[i]) << i;
  // Beyond the rank only bf16 rounding of K remains.
  EXPECT_LT(f.eig[r], 1e-4 * f.eig[r - 1]);
  const std::vector<float> kf = ToFloat(k);
  const double rel = testing::RelativeError(Reconstruct(f.a, BasisRows(f.b, shape, r), n, r, D), kf);
  EXPECT_LT(rel, 5e-3) << "relative Frobenius error of A*B";
  std::printf("T2 exact rank: relative error %.3g (eig[r]/eig[r-1] = %.3g)\n", rel,
              f.eig[r] / f.eig[r - 1]);
  // The eigenvalues sum to ||K||^2.
  const double trace = std::accumulate(f.eig.begin(), f.eig.end(), 0.0);
  EXPECT_NEAR(trace, SumSquares(kf), 1e-4 * SumSquares(kf));
}

TEST(AlgorithmVectors, T2LowRankNoisyEckartYoung) {
  // Rank-160 signal of RMS 0.05 plus N(0, 1e-3) noise (2% of the signal): the noise, not
  // bf16 storage of A and B (~2e-3 relative), sets the optimal error, so the test measures
  // whether the factorization finds the optimal subspace.
  auto rng = MakeRng(11);
  const LayerShape shape{4, 2, 128};  // D = 512
  const int n = 2048, r = 160, D = shape.D();
  std::vector<bf16> k = ToBf16(LowRankKeys(n, D, r, rng, 0.05f, 1e-3f));
  auto cpu = Cpu();
  Factors f = RunFactorize(*cpu, k, n, shape, FactorizeOptions{r, 0});
  ASSERT_TRUE(f.status.ok()) << f.status;
  const std::vector<float> kf = ToFloat(k);
  const double total = SumSquares(kf);
  double tail = 0;
  for (int i = r; i < D; ++i) tail += std::max(0.0f, f.eig[i]);
  const double bound = std::sqrt(tail / total);  // Eckart-Young: best rank-r error
  const double err = testing::RelativeError(Reconstruct(f.a, BasisRows(f.b, shape, r), n, r, D), kf);
  std::printf("T2 noisy: error %.5g, Eckart-Young bound %.5g (ratio %.4f)\n", err, bound,
              err / bound);
  EXPECT_GT(bound, 0.01);
  EXPECT_LT(err, 1.05 * bound) << "bound " << bound;
  EXPECT_GT(err, 0.99 * bound) << "below the optimum: eigenvalues are wrong";
  EXPECT_NEAR(f.result.captured_energy, 1.0 - tail / total, 1e-4);
}

TEST(LowRank, BasisRowsOrthonormal) {
  auto rng = MakeRng(12);
  const LayerShape shape{2, 2, 64};
  const int n = 512, r = 64, D = shape.D();
  std::vector<bf16> k = testing::RandomBf16(size_t(n) * D, rng);
  auto cpu = Cpu();
  Factors f = RunFactorize(*cpu, k, n, shape, FactorizeOptions{r, 0});
  ASSERT_TRUE(f.status.ok()) << f.status;
  std::vector<float> wt = BasisRows(f.b, shape, r);
  double worst = 0;
  for (int i = 0; i < r; ++i) {
    for (int j = 0; j <= i; ++j) {
      double dot = 0;
      for (int c = 0; c < D; ++c) dot += double(wt[size_t(i) * D + c]) * wt[size_t(j) * D + c];
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  }
  EXPECT_LT(worst, 1e-2);
}

TEST(LowRank, AdaptiveRank) {
  auto rng = MakeRng(13);
  const LayerShape shape{2, 1, 64};
  const int n = 1024, D = shape.D();
  std::vector<bf16> k = ToBf16(LowRankKeys(n, D, 40, rng));
  auto cpu = Cpu();
  // Rank 40 holds all but bf16 rounding; 32 misses a real part of the signal.
  Factors f = RunFactorize(*cpu, k, n, shape, FactorizeOptions{96, 0.999});
  ASSERT_TRUE(f.status.ok()) << f.status;
  EXPECT_EQ(f.result.rank, 40);
  EXPECT_GE(f.result.captured_energy, 0.999);
  // Dense at the chosen rank; the rest of the spans untouched.
  const size_t used_a = size_t(n) * 40, used_b = size_t(shape.h) * 40 * shape.d;
  for (size_t i = used_a; i < f.a.size(); ++i) ASSERT_EQ(f.a[i].bits, 0xFFFF) << i;
  for (size_t i = used_b; i < f.b.size(); ++i) ASSERT_EQ(f.b[i].bits, 0xFFFF) << i;
  std::vector<bf16> a40(f.a.begin(), f.a.begin() + used_a), b40(f.b.begin(), f.b.begin() + used_b);
  EXPECT_LT(testing::RelativeError(Reconstruct(a40, BasisRows(b40, shape, 40), n, 40, D), ToFloat(k)),
            5e-3);
  // Same keys at fixed rank 40: identical factors.
  Factors fixed = RunFactorize(*cpu, k, n, shape, FactorizeOptions{40, 0});
  ASSERT_TRUE(fixed.status.ok());
  for (size_t i = 0; i < used_a; ++i) ASSERT_EQ(fixed.a[i].bits, f.a[i].bits);
  for (size_t i = 0; i < used_b; ++i) ASSERT_EQ(fixed.b[i].bits, f.b[i].bits);
  // The target is capped at options.rank.
  Factors capped = RunFactorize(*cpu, k, n, shape, FactorizeOptions{32, 0.999});
  ASSERT_TRUE(capped.status.ok());
  EXPECT_EQ(capped.result.rank, 32);
  EXPECT_LT(capped.result.captured_energy, 0.999);
}

TEST(LowRank, SignConvention) {
  auto rng = MakeRng(14);
  const LayerShape shape{2, 1, 32};
  const int n = 256, D = shape.D();
  // Rank 1: K = x v^T with v's largest entry (index 5) negative -> the basis row is +-v/|v|
  // with entry 5 positive.
  std::vector<float> v(D);
  std::normal_distribution<float> nd;
  for (auto& e : v) e = 0.1f * nd(rng);
  v[5] = -1.0f;
  std::vector<float> kf(size_t(n) * D);
  for (int t = 0; t < n; ++t) {
    const float x = nd(rng);
    for (int c = 0; c < D; ++c) kf[size_t(t) * D + c] = x * v[c];
  }
  auto cpu = Cpu();
  Factors f = RunFactorize(*cpu, ToBf16(kf), n, shape, FactorizeOptions{8, 0});
  ASSERT_TRUE(f.status.ok()) << f.status;
  std::vector<float> wt = BasisRows(f.b, shape, 8);
  const double norm = std::sqrt(SumSquares(v));
  EXPECT_GT(wt[5], 0.0f);
  for (int c = 0; c < D; ++c) EXPECT_NEAR(wt[c], -v[c] / norm, 1e-2) << c;
  // Every row: an entry of the largest magnitude is positive (bf16 rounding may tie the
  // fp32 maximum with another entry, so any of the tied entries may be the positive one).
  Factors g = RunFactorize(*cpu, testing::RandomBf16(size_t(n) * D, rng), n, shape,
                           FactorizeOptions{32, 0});
  ASSERT_TRUE(g.status.ok());
  std::vector<float> w2 = BasisRows(g.b, shape, 32);
  for (int i = 0; i < 32; ++i) {
    const float* row = w2.data() + size_t(i) * D;
    float mx = 0;
    for (int c = 0; c < D; ++c) mx = std::max(mx, std::fabs(row[c]));
    bool positive = false;
    for (int c = 0; c < D; ++c) positive |= row[c] == mx;
    EXPECT_TRUE(positive) << "row " << i;
  }
}

TEST(LowRank, DeterministicAndUnalignedWorkspace) {
  auto rng = MakeRng(15);
  const LayerShape shape{2, 1, 64};
  const int n = 300, r = 24, D = shape.D();
  std::vector<bf16> k = testing::RandomBf16(size_t(n) * D, rng);
  auto cpu = Cpu();
  Factors f1 = RunFactorize(*cpu, k, n, shape, FactorizeOptions{r, 0});
  ASSERT_TRUE(f1.status.ok());
  // Same call with a workspace of exactly the reported size at an odd-aligned address.
  const FactorizeOptions opt{r, 0};
  const size_t need = cpu->FactorizeWorkspaceBytes(n, shape, opt);
  auto ws = cpu->Allocate(need + 4);
  ASSERT_TRUE(ws.ok());
  Factors f2;
  f2.a.assign(size_t(n) * r, bf16{});
  f2.b.assign(size_t(shape.h) * r * shape.d, bf16{});
  f2.eig.assign(D, 0);
  auto res = cpu->Factorize(k, n, shape, opt, absl::MakeSpan(f2.a), absl::MakeSpan(f2.b),
                            absl::MakeSpan(f2.eig),
                            Workspace{static_cast<std::byte*>(ws->data()) + 4, need});
  ASSERT_TRUE(res.ok()) << res.status();
  for (size_t i = 0; i < f1.a.size(); ++i) ASSERT_EQ(f1.a[i].bits, f2.a[i].bits);
  for (size_t i = 0; i < f1.b.size(); ++i) ASSERT_EQ(f1.b[i].bits, f2.b[i].bits);
  EXPECT_EQ(f1.eig, f2.eig);
  EXPECT_EQ(f1.result.captured_energy, res->captured_energy);
}

struct Projection {
  absl::Status status;
  ProjectionResult result;
  std::vector<bf16> a;
};

Projection RunProject(Backend& be, const std::vector<bf16>& k, int n, const LayerShape& shape,
                      const std::vector<bf16>& b, int r) {
  Projection p;
  p.a.assign(size_t(n) * r, bf16{0xFFFF});
  auto ws = be.Allocate(be.ProjectWorkspaceBytes(n, shape, r));
  EXPECT_TRUE(ws.ok());
  auto res = be.ProjectKeys(k, n, shape, b, r, absl::MakeSpan(p.a), ws->workspace());
  p.status = res.status();
  if (res.ok()) p.result = *res;
  return p;
}

TEST(LowRank, ProjectionResiduals) {
  auto rng = MakeRng(16);
  const LayerShape shape{4, 1, 64};  // D = 256
  const int n = 512, r = 64, D = shape.D();
  std::vector<float> y;
  std::vector<bf16> k1 = ToBf16(LowRankKeys(n, D, r, rng, 1.0f, 0.0f, &y));
  auto cpu = Cpu();
  Factors f = RunFactorize(*cpu, k1, n, shape, FactorizeOptions{r, 0});
  ASSERT_TRUE(f.status.ok());

  // The factorized keys themselves: a close to Factorize's a (fp32 vs bf16 basis).
  Projection self = RunProject(*cpu, k1, n, shape, f.b, r);
  ASSERT_TRUE(self.status.ok()) << self.status;
  EXPECT_LT(testing::RelativeError(ToFloat(self.a), ToFloat(f.a)), 5e-3);
  EXPECT_NEAR(self.result.key_energy, SumSquares(ToFloat(k1)), 1e-9 * SumSquares(ToFloat(k1)));

  // New keys in the same span: residual ~0 (bf16 rounding only).
  const int n2 = 100;
  std::normal_distribution<float> nd;
  std::vector<float> k2f(size_t(n2) * D, 0.0f);
  for (int t = 0; t < n2; ++t)
    for (int i = 0; i < r; ++i) {
      const float x = nd(rng);
      for (int c = 0; c < D; ++c) k2f[size_t(t) * D + c] += x * y[size_t(i) * D + c];
    }
  Projection in_span = RunProject(*cpu, ToBf16(k2f), n2, shape, f.b, r);
  ASSERT_TRUE(in_span.status.ok());
  EXPECT_LT(in_span.result.residual_energy, 1e-3);
  EXPECT_GE(in_span.result.residual_energy, 0.0);

  // Random keys: the basis catches about r/D of their energy.
  Projection random = RunProject(*cpu, testing::RandomBf16(size_t(n2) * D, rng), n2, shape, f.b, r);
  ASSERT_TRUE(random.status.ok());
  EXPECT_NEAR(random.result.residual_energy, 1.0 - double(r) / D, 0.03);

  // Zero keys: zero energy, residual 0, zero coordinates.
  Projection zero = RunProject(*cpu, std::vector<bf16>(size_t(8) * D), 8, shape, f.b, r);
  ASSERT_TRUE(zero.status.ok());
  EXPECT_EQ(zero.result.key_energy, 0.0);
  EXPECT_EQ(zero.result.residual_energy, 0.0);
  for (bf16 v : zero.a) ASSERT_EQ(Bf16ToFloat(v), 0.0f);
}

// Keys with a decaying spectrum like real attention keys: K = sum_i z_i s_i y_i with
// s_i = (i+1)^-decay over `modes` random directions, plus small noise.
std::vector<bf16> SpectrumKeys(int n, int D, int modes, double decay, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> y(size_t(modes) * D);
  for (auto& v : y) v = nd(rng) / std::sqrt(float(D));
  std::vector<float> k(size_t(n) * D, 0.0f);
  for (int t = 0; t < n; ++t) {
    float* row = k.data() + size_t(t) * D;
    for (int i = 0; i < modes; ++i) {
      const float a = nd(rng) * float(std::pow(i + 1.0, -decay));
      const float* yr = y.data() + size_t(i) * D;
      for (int c = 0; c < D; ++c) row[c] += a * yr[c];
    }
    for (int c = 0; c < D; ++c) row[c] += 1e-3f * nd(rng);
  }
  return ToBf16(k);
}

// Subspace iteration (FactorizeOptions::subspace_iterations) against the full solve. The
// captured energy of the top-r subspace can only be lower than the optimum (Ky Fan); at 4
// iterations with 32 extra columns it must stay within 0.5% of it on a realistic spectrum
// (energy ~ i^-1.2; the H200 measurement on 1024 x 1024 Grams gave 0.9995, and 0.986 on a
// much flatter i^-0.6), and the reconstruction error may grow by at most the energy lost.
TEST(LowRank, SubspaceIterationMatchesTheFullSolve) {
  auto cpu = Cpu();
  auto rng = MakeRng(41);
  const LayerShape s{4, 1, 64};  // D = 256
  const int n = 2048, D = s.D(), r = 64;
  const std::vector<bf16> k = SpectrumKeys(n, D, D, 0.6, rng);
  FactorizeOptions full;
  full.rank = r;
  FactorizeOptions sub = full;
  sub.subspace_iterations = 4;
  Factors f = RunFactorize(*cpu, k, n, s, full), g = RunFactorize(*cpu, k, n, s, sub);
  ASSERT_TRUE(f.status.ok()) << f.status;
  ASSERT_TRUE(g.status.ok()) << g.status;
  const double ratio = g.result.captured_energy / f.result.captured_energy;
  std::printf("[lowrank] subspace q=4 captured %.6f vs full %.6f (ratio %.6f)\n",
              g.result.captured_energy, f.result.captured_energy, ratio);
  EXPECT_LE(ratio, 1.0 + 1e-5);
  EXPECT_GE(ratio, 0.995);
  // Eigenvalues: the top r are Ritz values (each <= the true one, within 1% for the top 8),
  // the rest are reported as 0.
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(g.eig[i], f.eig[i], 0.01 * f.eig[i]) << i;
  for (int i = r; i < D; ++i) EXPECT_EQ(g.eig[i], 0.0f) << i;
  // Reconstruction error of K from A B^T, relative to ||K||^2.
  const std::vector<float> kf = ToFloat(k);
  auto rel_err = [&](const Factors& x) {
    std::vector<float> rec = Reconstruct(x.a, BasisRows(x.b, s, r), n, r, D);
    for (size_t e = 0; e < rec.size(); ++e) rec[e] -= kf[e];
    return SumSquares(rec) / SumSquares(kf);
  };
  const double ef = rel_err(f), eg = rel_err(g);
  std::printf("[lowrank] relative reconstruction error: subspace %.6f, full %.6f\n", eg, ef);
  EXPECT_LE(eg, ef + (f.result.captured_energy - g.result.captured_energy) + 2e-3);
  // Fewer iterations capture less: the option really changes the solver.
  FactorizeOptions one = full;
  one.subspace_iterations = 1;
  Factors h = RunFactorize(*cpu, k, n, s, one);
  ASSERT_TRUE(h.status.ok());
  EXPECT_LT(h.result.captured_energy, g.result.captured_energy);
}

// Keys with a steep spectrum: 12 strong directions over a weak noise floor (the shape of
// real pre-RoPE keys, whose energy sits in few directions). After a product with G the
// block's columns differ in scale by ~1e4, so plain CholQR's Gram matrix (condition ~1e8)
// cannot be factored in fp32 and the op used to fall back to the full solve, several times
// slower. The shifted first pass orthonormalizes it: no fallback, and the top-r subspace
// captures what the full solve does.
TEST(LowRank, SubspaceHandlesASteepSpectrumWithoutTheFullSolve) {
  auto cpu = Cpu();
  auto rng = MakeRng(44);
  // D = 256 with 12 strong directions; D = 1024 (Llama-3-8B's 8 KV heads x 128) with 24.
  for (const auto& [s, strong] : {std::pair{LayerShape{4, 1, 64}, 12}, std::pair{LayerShape{8, 1, 128}, 24}}) {
  SCOPED_TRACE(s.D());
  const int n = 2048, D = s.D(), r = 64;
  const std::vector<bf16> k = ToBf16(LowRankKeys(n, D, strong, rng, 1.0f, 0.05f));
  const auto [f, g] = FullAndSubspace(*cpu, k, n, s, r);
  ASSERT_TRUE(f.status.ok() && g.status.ok()) << f.status << g.status;
  EXPECT_FALSE(f.result.subspace_fallback);  // not asked for
  EXPECT_FALSE(g.result.subspace_fallback);
  std::printf("[lowrank] steep spectrum: subspace captured %.8f vs full %.8f\n",
              g.result.captured_energy, f.result.captured_energy);
  EXPECT_LE(g.result.captured_energy, f.result.captured_energy + 1e-6);
  EXPECT_GE(g.result.captured_energy, f.result.captured_energy - 1e-4);
  // The strong eigenvalues are found to 0.1%.
  for (int i = 0; i < strong; ++i) EXPECT_NEAR(g.eig[i], f.eig[i], 1e-3 * f.eig[i]) << i;
  }
}

// A rank-deficient block cannot be orthonormalized even with the shifted passes: K whose
// tokens repeat 40 distinct keys (exactly rank 40 < P = 96 columns, even in bf16), and
// K = 0. The op falls back to the full solve, says so, and gives exactly its result.
TEST(LowRank, SubspaceFallsBackToTheFullSolveOnDeficientKeys) {
  auto cpu = Cpu();
  auto rng = MakeRng(43);
  const LayerShape s{4, 1, 64};
  const int n = 1024, D = s.D(), r = 64;
  for (int modes : {40, 0}) {
    std::vector<bf16> k(size_t(n) * D);
    if (modes > 0) {
      const std::vector<bf16> keys = testing::RandomBf16(size_t(modes) * D, rng);
      for (int t = 0; t < n; ++t) {
        std::copy_n(keys.begin() + size_t(t % modes) * D, D, k.begin() + size_t(t) * D);
      }
    }
    const auto [f, g] = FullAndSubspace(*cpu, k, n, s, r);
    ASSERT_TRUE(f.status.ok() && g.status.ok()) << f.status << g.status;
    EXPECT_TRUE(g.result.subspace_fallback) << "modes " << modes;
    EXPECT_EQ(g.result.captured_energy, f.result.captured_energy) << "modes " << modes;
    size_t diff = 0;
    for (size_t e = 0; e < f.a.size(); ++e) diff += f.a[e].bits != g.a[e].bits;
    for (size_t e = 0; e < f.b.size(); ++e) diff += f.b[e].bits != g.b[e].bits;
    EXPECT_EQ(diff, 0u) << "modes " << modes;
  }
  FactorizeOptions bad;
  bad.rank = r;
  bad.subspace_iterations = -1;
  EXPECT_EQ(RunFactorize(*cpu, std::vector<bf16>(size_t(n) * D), n, s, bad).status.code(),
            absl::StatusCode::kInvalidArgument);
  bad.subspace_iterations = 4;
  bad.host_subspace_min_tokens = -1;
  EXPECT_EQ(RunFactorize(*cpu, std::vector<bf16>(size_t(n) * D), n, s, bad).status.code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LowRank, BadInputsRejected) {
  const LayerShape shape{2, 1, 32};  // D = 64
  const int n = 64, D = shape.D();
  std::vector<bf16> k(size_t(n) * D, bf16{0x3f80});
  auto cpu = Cpu();
  auto expect_invalid = [&](const Factors& f, const char* what) {
    EXPECT_EQ(f.status.code(), absl::StatusCode::kInvalidArgument) << what << ": " << f.status;
  };
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{72, 0}), "rank > D");
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{12, 0}), "rank % 8");
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{0, 0}), "rank 0");
  expect_invalid(RunFactorize(*cpu, std::vector<bf16>(size_t(16) * D, bf16{0x3f80}), 16, shape,
                              FactorizeOptions{24, 0}),
                 "rank > n");
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{16, 1.5}), "target > 1");
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{16, -0.1}), "target < 0");
  expect_invalid(RunFactorize(*cpu, k, n, shape, FactorizeOptions{16, NAN}), "target NaN");
  expect_invalid(RunFactorize(*cpu, k, n - 1, shape, FactorizeOptions{16, 0}), "k size");
  expect_invalid(RunFactorize(*cpu, k, n, LayerShape{0, 1, 32}, FactorizeOptions{16, 0}), "h 0");

  const FactorizeOptions opt{16, 0};
  const size_t need = cpu->FactorizeWorkspaceBytes(n, shape, opt);
  auto ws = cpu->Allocate(need);
  ASSERT_TRUE(ws.ok());
  std::vector<bf16> a(size_t(n) * 16), b(size_t(shape.h) * 16 * shape.d);
  std::vector<float> eig(D);
  auto run = [&](size_t a_size, size_t b_size, size_t e_size, size_t ws_bytes) {
    return cpu->Factorize(k, n, shape, opt, absl::MakeSpan(a.data(), a_size),
                          absl::MakeSpan(b.data(), b_size), absl::MakeSpan(eig.data(), e_size),
                          Workspace{ws->data(), ws_bytes})
        .status()
        .code();
  };
  EXPECT_EQ(run(a.size(), b.size(), eig.size(), need), absl::StatusCode::kOk);
  EXPECT_EQ(run(a.size() - 1, b.size(), eig.size(), need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(a.size(), b.size() - 1, eig.size(), need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(a.size(), b.size(), eig.size() - 1, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(a.size(), b.size(), eig.size(), need - 1), absl::StatusCode::kInvalidArgument);

  // ProjectKeys.
  const int r = 16;
  std::vector<bf16> basis(size_t(shape.h) * r * shape.d, bf16{0x3f80});
  EXPECT_TRUE(RunProject(*cpu, k, n, shape, basis, r).status.ok());
  EXPECT_EQ(RunProject(*cpu, k, n, shape, basis, 12).status.code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunProject(*cpu, k, n, shape, std::vector<bf16>(basis.size() - 1), r).status.code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RunProject(*cpu, k, n + 1, shape, basis, r).status.code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<bf16> pa(size_t(n) * r);
  const size_t pneed = cpu->ProjectWorkspaceBytes(n, shape, r);
  auto pws = cpu->Allocate(pneed);
  EXPECT_EQ(cpu->ProjectKeys(k, n, shape, basis, r, absl::MakeSpan(pa), Workspace{pws->data(), pneed - 1})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->ProjectKeys(k, n, shape, basis, r, absl::MakeSpan(pa).subspan(1), pws->workspace())
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace lowrank_test
}  // namespace kvshade::kernels

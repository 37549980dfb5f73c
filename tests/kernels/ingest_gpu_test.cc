// CUDA parity tests of the ingest-side ops (ApplyRope, Factorize, ProjectKeys,
// BuildLandmarks, TopK, ObservationMass, ChunkSum) against the CPU backend, on fresh
// random inputs (seed logged) at the shapes of a 128K-token Llama-3-8B layer (h = 8,
// g = 4, d = 128). Each test prints one summary line "[ingest-gpu] <op> ..." with its
// worst error beside the tolerance (and the warm GPU time, for orientation only: the
// benchmarks are the timing reference). Skipped when no CUDA device is visible.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace ingest_gpu_test {
namespace {

using testing::MakeRng;
using testing::ToBf16;
using testing::ToFloat;

using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

void Summary(const std::string& op, const std::string& text) {
  std::printf("[ingest-gpu] %-15s %s\n", op.c_str(), text.c_str());
  std::fflush(stdout);
}

// Runs fn(begin, end) over [0, n) on all hardware threads (test-side data generation and
// error metrics at 128K-token shapes).
void ParallelFor(size_t n, const std::function<void(size_t, size_t)>& fn) {
  const size_t threads = std::max<size_t>(1, std::min<size_t>(std::thread::hardware_concurrency(), 64));
  const size_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (size_t b = 0; b < n; b += per) pool.emplace_back(fn, b, std::min(n, b + per));
  for (auto& t : pool) t.join();
}

template <typename T>
absl::Span<T> SpanOf(const Buffer& b, size_t count) {
  return absl::Span<T>(static_cast<T*>(b.data()), count);
}
template <typename T>
absl::Span<const T> CSpanOf(const Buffer& b, size_t count) {
  return absl::Span<const T>(static_cast<const T*>(b.data()), count);
}

// Buffers of one backend holding the same host inputs.
template <typename T>
Buffer Up(Backend& be, const std::vector<T>& host) {
  return testing::Upload(be, host);
}
template <typename T>
std::vector<T> Down(Backend& be, const Buffer& b, size_t count) {
  return testing::Download<T>(be, b.data(), count);
}

Buffer Ws(Backend& be, size_t bytes) {
  auto b = be.Allocate(bytes);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(b).value() : Buffer();
}

// Distance in units in the last place between two bf16 values (sign-magnitude order).
int Bf16Ulps(bf16 a, bf16 b) {
  auto ord = [](uint16_t x) { return (x & 0x8000) ? -int(x & 0x7fff) : int(x); };
  return std::abs(ord(a.bits) - ord(b.bits));
}

// Low-rank keys with a decaying spectrum, like real pre-RoPE keys: K = X diag(s) Y + noise
// with X [n, r0] ~ N(0, 1), s_i = exp(-i/64), Y [r0, D] ~ N(0, 16/D), noise N(0, 1e-3).
// Consecutive eigenvalues are ~3% apart (well above the 1/sqrt(n) sampling jitter), so
// the top eigenvectors are well defined and comparable across backends.
std::vector<bf16> SpectralKeys(int n, int D, int r0, const std::vector<float>& y,
                               std::mt19937_64& rng) {
  std::vector<bf16> k(size_t(n) * D);
  std::vector<uint64_t> seeds(64);
  for (auto& s : seeds) s = rng();
  const size_t blocks = seeds.size();
  ParallelFor(blocks, [&](size_t b0, size_t b1) {
    std::vector<float> row(D), x(r0);
    for (size_t blk = b0; blk < b1; ++blk) {
      std::mt19937_64 local(seeds[blk]);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      const size_t t0 = size_t(n) * blk / blocks, t1 = size_t(n) * (blk + 1) / blocks;
      for (size_t t = t0; t < t1; ++t) {
        for (int i = 0; i < r0; ++i) x[i] = nd(local) * std::exp(-float(i) / 64.0f);
        for (int c = 0; c < D; ++c) row[c] = 1e-3f * nd(local);
        for (int i = 0; i < r0; ++i) {
          const float a = x[i];
          const float* yr = y.data() + size_t(i) * D;
          for (int c = 0; c < D; ++c) row[c] += a * yr[c];
        }
        for (int c = 0; c < D; ++c) k[t * D + c] = FloatToBf16(row[c]);
      }
    }
  });
  return k;
}

std::vector<float> SpectralBasis(int r0, int D, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, 4.0f / std::sqrt(float(D)));
  std::vector<float> y(size_t(r0) * D);
  for (auto& v : y) v = nd(rng);
  return y;
}

// W^T [r, D] fp32 from b [h, r, d] bf16.
std::vector<float> BasisRows(const std::vector<bf16>& b, const LayerShape& s, int r) {
  const int D = s.D();
  std::vector<float> wt(size_t(r) * D);
  for (int hh = 0; hh < s.h; ++hh)
    for (int i = 0; i < r; ++i)
      for (int c = 0; c < s.d; ++c)
        wt[size_t(i) * D + size_t(hh) * s.d + c] = Bf16ToFloat(b[(size_t(hh) * r + i) * s.d + c]);
  return wt;
}

// Relative Frobenius error ||A W^T - K|| / ||K|| over every `stride`-th row.
double ReconstructionError(const std::vector<bf16>& k, const std::vector<bf16>& a,
                           const std::vector<float>& wt, int n, int r, int D, int stride) {
  const size_t rows = size_t(n + stride - 1) / stride;
  std::vector<double> num(rows), den(rows);
  ParallelFor(rows, [&](size_t b0, size_t b1) {
    std::vector<float> rec(D);
    for (size_t q = b0; q < b1; ++q) {
      const size_t t = q * stride;
      std::fill(rec.begin(), rec.end(), 0.0f);
      for (int i = 0; i < r; ++i) {
        const float av = Bf16ToFloat(a[t * r + i]);
        const float* w = wt.data() + size_t(i) * D;
        for (int c = 0; c < D; ++c) rec[c] += av * w[c];
      }
      double nn = 0, dd = 0;
      for (int c = 0; c < D; ++c) {
        const double kv = Bf16ToFloat(k[t * D + c]);
        nn += (rec[c] - kv) * (rec[c] - kv);
        dd += kv * kv;
      }
      num[q] = nn;
      den[q] = dd;
    }
  });
  double nn = 0, dd = 0;
  for (size_t q = 0; q < rows; ++q) {
    nn += num[q];
    dd += den[q];
  }
  return std::sqrt(nn / dd);
}

struct Factors {
  absl::Status status;
  FactorizeResult result;
  std::vector<bf16> a, b;
  std::vector<float> eig;
  double ms = 0;
};

Factors RunFactorize(Backend& be, const std::vector<bf16>& k, int n, const LayerShape& shape,
                     const FactorizeOptions& opt, int warm_runs = 0) {
  Factors f;
  const size_t asz = size_t(n) * opt.rank, bsz = size_t(shape.h) * opt.rank * shape.d;
  Buffer kb = Up(be, k);
  Buffer ab = testing::Scratch<bf16>(be, asz), bb = testing::Scratch<bf16>(be, bsz);
  Buffer ws = Ws(be, be.FactorizeWorkspaceBytes(n, shape, opt));
  f.eig.assign(size_t(shape.D()), NAN);
  for (int run = 0; run <= warm_runs; ++run) {
    const auto t0 = Clock::now();
    auto res = be.Factorize(CSpanOf<bf16>(kb, k.size()), n, shape, opt, SpanOf<bf16>(ab, asz),
                            SpanOf<bf16>(bb, bsz), absl::MakeSpan(f.eig), ws.workspace());
    f.ms = MsSince(t0);
    f.status = res.status();
    if (!res.ok()) return f;
    f.result = *res;
  }
  f.a = Down<bf16>(be, ab, asz);
  f.b = Down<bf16>(be, bb, bsz);
  return f;
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, ApplyRopeMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(100);
  const int n = 32768, heads = 8, d = 128;
  std::vector<int64_t> pos(n);
  // Positions up to 256K (beyond the 128K context: large angles stress the range
  // reduction), in random order.
  std::uniform_int_distribution<int64_t> pd(0, 262143);
  for (auto& p : pos) p = pd(rng);
  const std::vector<bf16> x = testing::RandomBf16(size_t(n) * heads * d, rng, 2.0f);

  struct Case {
    const char* name;
    RopeSpec spec;
  };
  std::vector<Case> cases;
  for (RopePairing pairing : {RopePairing::kHalfSplit, RopePairing::kInterleaved}) {
    const bool half = pairing == RopePairing::kHalfSplit;
    RopeSpec none;
    none.pairing = pairing;
    cases.push_back({half ? "none/half" : "none/inter", none});
    RopeSpec lin = none;
    lin.scaling = RopeScaling::kLinear;
    lin.factor = 4.0f;
    cases.push_back({half ? "linear/half" : "linear/inter", lin});
    RopeSpec l3 = none;  // Llama-3.1-8B
    l3.theta = 500000.0f;
    l3.scaling = RopeScaling::kLlama3;
    l3.factor = 8.0f;
    l3.low_freq_factor = 1.0f;
    l3.high_freq_factor = 4.0f;
    l3.original_max_position = 8192;
    cases.push_back({half ? "llama3/half" : "llama3/inter", l3});
    RopeSpec yarn = none;  // Qwen2-style YaRN x4
    yarn.theta = 1000000.0f;
    yarn.scaling = RopeScaling::kYarn;
    yarn.factor = 4.0f;
    yarn.original_max_position = 32768;
    cases.push_back({half ? "yarn/half" : "yarn/inter", yarn});
    RopeSpec partial = none;  // partial rotary (GPT-J/NeoX style): dims >= 64 untouched
    partial.rotary_dim = 64;
    cases.push_back({half ? "partial64/half" : "partial64/inter", partial});
  }

  Buffer pos_c = Up(*cpu, pos), pos_g = Up(*gpu, pos);
  int worst_ulps = 0;
  double worst_frac = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Buffer xc = Up(*cpu, x), xg = Up(*gpu, x);
    ASSERT_TRUE(cpu->ApplyRope(c.spec, CSpanOf<int64_t>(pos_c, n), heads, d,
                               SpanOf<bf16>(xc, x.size()))
                    .ok());
    ASSERT_TRUE(gpu->ApplyRope(c.spec, CSpanOf<int64_t>(pos_g, n), heads, d,
                               SpanOf<bf16>(xg, x.size()))
                    .ok());
    const auto rc = Down<bf16>(*cpu, xc, x.size()), rg = Down<bf16>(*gpu, xg, x.size());
    size_t mismatches = 0;
    int ulps = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      if (rc[i].bits != rg[i].bits) {
        ++mismatches;
        ulps = std::max(ulps, Bf16Ulps(rc[i], rg[i]));
      }
    }
    const double frac = double(mismatches) / x.size();
    // Same arithmetic as the CPU (double angles, no FMA); only CUDA's double sincos may
    // differ from glibc's in the last place, which rarely moves a float cos/sin and then
    // the bf16 result by at most 1 ulp.
    EXPECT_LE(ulps, 1);
    EXPECT_LE(frac, 1e-3);
    worst_ulps = std::max(worst_ulps, ulps);
    worst_frac = std::max(worst_frac, frac);
  }
  Summary("ApplyRope", absl::StrFormat("n=%d heads=%d d=%d, %zu configs: max %d bf16 ulp "
                                       "(tol 1), mismatched fraction %.2e (tol 1e-3)",
                                       n, heads, d, cases.size(), worst_ulps, worst_frac));
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, FactorizeMatchesCpu128K) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(200);
  const LayerShape shape{8, 4, 128};
  const int n = 131072, D = shape.D(), r = 160, r0 = 192;
  const std::vector<float> y = SpectralBasis(r0, D, rng);
  const std::vector<bf16> k = SpectralKeys(n, D, r0, y, rng);
  const FactorizeOptions opt{r, 0};

  Factors fc = RunFactorize(*cpu, k, n, shape, opt);
  ASSERT_TRUE(fc.status.ok()) << fc.status;
  Factors fg = RunFactorize(*gpu, k, n, shape, opt, /*warm_runs=*/1);
  ASSERT_TRUE(fg.status.ok()) << fg.status;
  EXPECT_EQ(fg.result.rank, r);

  // Eigenvalues: the top r relative 1e-3 each (fp32 Gram accumulation in a different
  // order perturbs G by ~1e-6 of its norm, i.e. ~2e-4 relative at lambda_160); the whole
  // spectrum within 1e-4 of lambda_max (the tail sits at the fp32 noise floor of G).
  double eig_rel = 0, eig_abs = 0;
  for (int i = 0; i < D; ++i) {
    const double dv = std::fabs(double(fg.eig[i]) - fc.eig[i]);
    if (i < r) eig_rel = std::max(eig_rel, dv / std::fabs(fc.eig[i]));
    eig_abs = std::max(eig_abs, dv / fc.eig[0]);
  }
  for (int i = 1; i < D; ++i) ASSERT_GE(fg.eig[i - 1], fg.eig[i]) << "not descending at " << i;
  EXPECT_LE(eig_rel, 1e-3);
  EXPECT_LE(eig_abs, 1e-4);

  // Captured energy: a ratio of sums of the eigenvalues above, 1e-4 absolute.
  const double energy_diff = std::fabs(fg.result.captured_energy - fc.result.captured_energy);
  EXPECT_LE(energy_diff, 1e-4);

  // Reconstruction A*B vs K (every 8th row): both backends must be equally good; 1e-3
  // absolute on the relative Frobenius error (bf16 storage alone contributes ~2e-3).
  const std::vector<float> wtc = BasisRows(fc.b, shape, r), wtg = BasisRows(fg.b, shape, r);
  const double err_c = ReconstructionError(k, fc.a, wtc, n, r, D, 8);
  const double err_g = ReconstructionError(k, fg.a, wtg, n, r, D, 8);
  EXPECT_LE(std::fabs(err_g - err_c), 1e-3) << "gpu " << err_g << " cpu " << err_c;

  // Subspace agreement ||Wc^T Wg||_F^2 / r (1 = same span): individual eigenvectors may
  // legitimately rotate where eigenvalues are close, the span of the top r may not
  // (gap lambda_160 / lambda_161 ~ 3%). Tolerance 1e-3 covers bf16 rounding of B (~1e-5)
  // and the fp32 Gram perturbation.
  double overlap = 0;
  std::vector<double> dots(size_t(r) * r);
  ParallelFor(r, [&](size_t i0, size_t i1) {
    for (size_t i = i0; i < i1; ++i)
      for (int j = 0; j < r; ++j) {
        double s = 0;
        for (int c = 0; c < D; ++c) s += double(wtc[i * D + c]) * wtg[size_t(j) * D + c];
        dots[i * r + j] = s;
      }
  });
  for (double v : dots) overlap += v * v;
  const double subspace = overlap / r;
  EXPECT_GE(subspace, 1.0 - 1e-3);

  // Per-vector agreement (and the sign convention) where an eigenvalue is isolated: its
  // nearest neighbour >= 1% away relative. There the vectors must match,
  // |1 - |<wc_i, wg_i>|| <= 1e-2, with the same sign unless the sign rule itself is
  // ambiguous for that vector (its two largest |entries| within 2% of each other and of
  // opposite signs: then a legitimate ~1e-4 perturbation may pick the other entry).
  int isolated = 0, vector_bad = 0, sign_bad = 0, sign_ambiguous = 0;
  double worst_vec = 0;
  for (int i = 0; i < r; ++i) {
    const double gap_prev = i > 0 ? fc.eig[i - 1] - fc.eig[i] : INFINITY;
    const double gap_next = fc.eig[i] - fc.eig[i + 1];
    if (std::min(gap_prev, gap_next) < 0.01 * fc.eig[i]) continue;
    ++isolated;
    const double dot = dots[size_t(i) * r + i];
    const double dev = std::fabs(1.0 - std::fabs(dot));
    worst_vec = std::max(worst_vec, dev);
    if (dev > 1e-2) ++vector_bad;
    if (dot < 0) {
      const float* v = wtc.data() + size_t(i) * D;
      int i1 = 0;
      for (int c = 1; c < D; ++c)
        if (std::fabs(v[c]) > std::fabs(v[i1])) i1 = c;
      int i2 = i1 == 0 ? 1 : 0;
      for (int c = 0; c < D; ++c)
        if (c != i1 && std::fabs(v[c]) > std::fabs(v[i2])) i2 = c;
      const bool ambiguous = std::fabs(v[i2]) >= 0.98f * std::fabs(v[i1]) &&
                             (v[i1] < 0) != (v[i2] < 0);
      (ambiguous ? sign_ambiguous : sign_bad) += 1;
    }
  }
  EXPECT_EQ(vector_bad, 0) << "of " << isolated << " isolated eigenvectors";
  EXPECT_EQ(sign_bad, 0) << "sign convention differs (" << sign_ambiguous << " ambiguous)";
  EXPECT_GT(isolated, 0);

  // A on the 32 leading (well separated) columns: relative Frobenius 1e-2 (bf16 storage
  // of A is 2^-9 relative per element; the product is fp32-accurate on both sides).
  const int lead = 32;
  double an = 0, ad = 0;
  for (size_t t = 0; t < size_t(n); t += 4) {
    for (int i = 0; i < lead; ++i) {
      const double c = Bf16ToFloat(fc.a[t * r + i]), g = Bf16ToFloat(fg.a[t * r + i]);
      an += (c - g) * (c - g);
      ad += c * c;
    }
  }
  const double a_rel = std::sqrt(an / ad);
  EXPECT_LE(a_rel, 1e-2);

  // Determinism (T8): a second run on the GPU is bit-identical.
  Factors fg2 = RunFactorize(*gpu, k, n, shape, opt);
  ASSERT_TRUE(fg2.status.ok()) << fg2.status;
  EXPECT_TRUE(std::memcmp(fg2.a.data(), fg.a.data(), fg.a.size() * sizeof(bf16)) == 0);
  EXPECT_TRUE(std::memcmp(fg2.b.data(), fg.b.data(), fg.b.size() * sizeof(bf16)) == 0);
  EXPECT_TRUE(std::memcmp(fg2.eig.data(), fg.eig.data(), fg.eig.size() * sizeof(float)) == 0);

  Summary("Factorize",
          absl::StrFormat("n=%d D=%d r=%d: eig top-r rel %.1e (tol 1e-3), all abs/lmax %.1e "
                          "(tol 1e-4), energy diff %.1e (tol 1e-4), recon err gpu %.5f cpu %.5f "
                          "(tol |diff| 1e-3), subspace %.6f (tol >= 0.999), %d isolated vecs "
                          "worst |1-|dot|| %.1e (tol 1e-2), sign flips %d (+%d ambiguous, tol "
                          "0), A[:, :32] rel %.1e (tol 1e-2); gpu %.2f ms (warm, incl. host "
                          "sync), cpu %.0f ms",
                          n, D, r, eig_rel, eig_abs, energy_diff, err_g, err_c, subspace,
                          isolated, worst_vec, sign_bad, sign_ambiguous, a_rel, fg.ms, fc.ms));
}

TEST(IngestGpu, FactorizeAdaptiveRankMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(210);
  const LayerShape shape{8, 4, 128};
  const int n = 16384, D = shape.D(), r0 = 192;
  const std::vector<float> y = SpectralBasis(r0, D, rng);
  const std::vector<bf16> k = SpectralKeys(n, D, r0, y, rng);
  const FactorizeOptions opt{160, 0.95};
  Factors fc = RunFactorize(*cpu, k, n, shape, opt);
  Factors fg = RunFactorize(*gpu, k, n, shape, opt);
  ASSERT_TRUE(fc.status.ok()) << fc.status;
  ASSERT_TRUE(fg.status.ok()) << fg.status;
  // exp(-i/64) spectrum: 95% of the energy needs ~96 components, well inside the cap.
  EXPECT_EQ(fg.result.rank, fc.result.rank);
  EXPECT_LT(fg.result.rank, 160);
  EXPECT_GE(fg.result.captured_energy, 0.95);
  EXPECT_NEAR(fg.result.captured_energy, fc.result.captured_energy, 1e-4);
  const int rp = fg.result.rank;
  // Dense at r'; the rest of a and b untouched (0xFFFF from Scratch).
  for (size_t i = size_t(n) * rp; i < fg.a.size(); ++i) ASSERT_EQ(fg.a[i].bits, 0xFFFF) << i;
  for (size_t i = size_t(shape.h) * rp * shape.d; i < fg.b.size(); ++i)
    ASSERT_EQ(fg.b[i].bits, 0xFFFF) << i;
  const std::vector<bf16> bc(fc.b.begin(), fc.b.begin() + size_t(shape.h) * rp * shape.d);
  const std::vector<bf16> bg(fg.b.begin(), fg.b.begin() + size_t(shape.h) * rp * shape.d);
  const double err_c = ReconstructionError(k, fc.a, BasisRows(bc, shape, rp), n, rp, D, 1);
  const double err_g = ReconstructionError(k, fg.a, BasisRows(bg, shape, rp), n, rp, D, 1);
  EXPECT_LE(std::fabs(err_g - err_c), 1e-3);
  Summary("Factorize/adapt",
          absl::StrFormat("n=%d target 0.95: rank gpu %d cpu %d, energy diff %.1e (tol 1e-4), "
                          "recon err diff %.1e (tol 1e-3)",
                          n, fg.result.rank, fc.result.rank,
                          std::fabs(fg.result.captured_energy - fc.result.captured_energy),
                          std::fabs(err_g - err_c)));
}

// ---------------------------------------------------------------------------------------
// Subspace iteration (FactorizeOptions::subspace_iterations = 4) at the 128K-token layer
// shape: the CUDA result against the CPU's subspace result (same start block, so the same
// subspace up to fp32 rounding) and against the full solve (captured energy within 0.5% of
// the optimum), and its time against the full solve's (the target is <= 10 ms per layer).
TEST(IngestGpu, FactorizeSubspaceMatchesCpuAndTheFullSolve128K) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(214);
  const LayerShape shape{8, 4, 128};
  const int n = 131072, D = shape.D(), r0 = 384, r = 160;
  const std::vector<float> y = SpectralBasis(r0, D, rng);
  const std::vector<bf16> k = SpectralKeys(n, D, r0, y, rng);
  FactorizeOptions full;
  full.rank = r;
  FactorizeOptions sub = full;
  sub.subspace_iterations = 4;
  Factors gf = RunFactorize(*gpu, k, n, shape, full, /*warm_runs=*/3);
  Factors cs = RunFactorize(*cpu, k, n, shape, sub);
  ASSERT_TRUE(gf.status.ok()) << gf.status;
  ASSERT_TRUE(cs.status.ok()) << cs.status;
  // The iteration on the device (below host_subspace_min_tokens), then on the host.
  for (int host_from : {0, n}) {
    SCOPED_TRACE(host_from == 0 ? "on the device" : "on the host");
    sub.host_subspace_min_tokens = host_from;
    Factors gs = RunFactorize(*gpu, k, n, shape, sub, /*warm_runs=*/3);
    ASSERT_TRUE(gs.status.ok()) << gs.status;
    const double ratio = gs.result.captured_energy / gf.result.captured_energy;
    EXPECT_GE(ratio, 0.995);
    EXPECT_LE(ratio, 1.0 + 1e-5);
    EXPECT_NEAR(gs.result.captured_energy, cs.result.captured_energy, 1e-4);
    const double err_s = ReconstructionError(k, gs.a, BasisRows(gs.b, shape, r), n, r, D, 1);
    const double err_c = ReconstructionError(k, cs.a, BasisRows(cs.b, shape, r), n, r, D, 1);
    const double err_f = ReconstructionError(k, gf.a, BasisRows(gf.b, shape, r), n, r, D, 1);
    EXPECT_LE(std::fabs(err_s - err_c), 1e-3);
    EXPECT_LE(err_s, err_f + 1e-2);
    for (int i = r; i < D; ++i) EXPECT_EQ(gs.eig[i], 0.0f) << i;
    Summary("Factorize/subspace",
            absl::StrFormat("n=%d r=%d q=4 %s: %.2f ms (full solve %.2f ms); energy %.6f vs "
                            "full %.6f (ratio %.6f, tol >= 0.995), cpu subspace %.6f; recon err "
                            "%.4f (cpu %.4f, full %.4f)",
                            n, r, host_from == 0 ? "on the device" : "on the host", gs.ms, gf.ms,
                            gs.result.captured_energy, gf.result.captured_energy, ratio,
                            cs.result.captured_energy, err_s, err_c, err_f));
  }
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, ProjectKeysMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(300);
  const LayerShape shape{8, 4, 128};
  const int D = shape.D(), r = 160, r0 = 192;
  const std::vector<float> y = SpectralBasis(r0, D, rng);
  // The basis: the CPU's factorization of a first turn from the same model.
  const int n0 = 16384;
  Factors base = RunFactorize(*cpu, SpectralKeys(n0, D, r0, y, rng), n0, shape, {r, 0});
  ASSERT_TRUE(base.status.ok()) << base.status;

  struct Case {
    const char* name;
    std::vector<bf16> k;
  };
  const int n = 131072;
  std::vector<Case> cases;
  cases.push_back({"same-model", SpectralKeys(n, D, r0, y, rng)});      // small residual
  cases.push_back({"unrelated", testing::RandomBf16(size_t(n) * D, rng)});  // large residual
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ProjectionResult res[2];
    std::vector<bf16> a[2];
    double ms = 0;
    Backend* bes[2] = {cpu.get(), gpu.get()};
    for (int bi = 0; bi < 2; ++bi) {
      Backend& be = *bes[bi];
      Buffer kb = Up(be, c.k), bb = Up(be, base.b);
      Buffer ab = testing::Scratch<bf16>(be, size_t(n) * r);
      Buffer ws = Ws(be, be.ProjectWorkspaceBytes(n, shape, r));
      for (int run = 0; run < (bi == 1 ? 2 : 1); ++run) {  // GPU: second run is warm
        const auto t0 = Clock::now();
        auto pr = be.ProjectKeys(CSpanOf<bf16>(kb, c.k.size()), n, shape,
                                 CSpanOf<bf16>(bb, base.b.size()), r,
                                 SpanOf<bf16>(ab, size_t(n) * r), ws.workspace());
        ms = MsSince(t0);
        ASSERT_TRUE(pr.ok()) << pr.status();
        res[bi] = *pr;
      }
      a[bi] = Down<bf16>(be, ab, size_t(n) * r);
    }
    // key energy: exact squares summed in double on both sides, 1e-9 relative.
    const double ke = std::fabs(res[1].key_energy - res[0].key_energy) / res[0].key_energy;
    // residual: from fp32 products summed in a different order, 1e-5 absolute.
    const double rd = std::fabs(res[1].residual_energy - res[0].residual_energy);
    // a: same fp32 products up to summation order, rounded once to bf16: relative
    // Frobenius 2e-3 (an occasional 1-ulp rounding flip is 2^-8 of that element).
    const double arel = testing::RelativeError(ToFloat(a[1]), ToFloat(a[0]));
    EXPECT_LE(ke, 1e-9);
    EXPECT_LE(rd, 1e-5);
    EXPECT_LE(arel, 2e-3);
    Summary("ProjectKeys",
            absl::StrFormat("%s n=%d r=%d: residual gpu %.6f cpu %.6f diff %.1e (tol 1e-5), "
                            "key energy rel %.1e (tol 1e-9), a rel %.1e (tol 2e-3); gpu %.2f ms",
                            c.name, n, r, res[1].residual_energy, res[0].residual_energy, rd, ke,
                            arel, ms));
  }
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, BuildLandmarksMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(400);
  const int n = 131072, h = 8, d = 128, C = 8, n_chunks = (n - 32) / C;
  std::vector<bf16> kr = testing::RandomBf16(size_t(n) * h * d, rng, 1.5f);
  // Zero-vector rules: chunk 5 of head 2 entirely zero (cosine 1), one zero key in chunk 9
  // of head 0 (cosine 0 for it).
  for (int t = 5 * C; t < 6 * C; ++t)
    for (int c = 0; c < d; ++c) kr[(size_t(t) * h + 2) * d + c] = bf16{0};
  for (int c = 0; c < d; ++c) kr[(size_t(9 * C + 3) * h + 0) * d + c] = bf16{0};

  std::vector<bf16> lm[2];
  std::vector<float> mc[2];
  double ms = 0;
  Backend* bes[2] = {cpu.get(), gpu.get()};
  for (int bi = 0; bi < 2; ++bi) {
    Backend& be = *bes[bi];
    Buffer kb = Up(be, kr);
    Buffer lb = testing::Scratch<bf16>(be, size_t(n_chunks) * h * d);
    Buffer mb = testing::Scratch<float>(be, size_t(h) * n_chunks);
    for (int run = 0; run < (bi == 1 ? 2 : 1); ++run) {
      ASSERT_TRUE(be.Synchronize().ok());
      const auto t0 = Clock::now();
      ASSERT_TRUE(be.BuildLandmarks(CSpanOf<bf16>(kb, kr.size()), n, h, d, C, n_chunks,
                                    SpanOf<bf16>(lb, size_t(n_chunks) * h * d),
                                    SpanOf<float>(mb, size_t(h) * n_chunks))
                      .ok());
      ASSERT_TRUE(be.Synchronize().ok());
      ms = MsSince(t0);
    }
    lm[bi] = Down<bf16>(be, lb, size_t(n_chunks) * h * d);
    mc[bi] = Down<float>(be, mb, size_t(h) * n_chunks);
  }
  // Landmarks: same fp32 sums in the same order and one IEEE division: bit-identical.
  size_t lm_diff = 0;
  for (size_t i = 0; i < lm[0].size(); ++i) lm_diff += lm[0][i].bits != lm[1][i].bits;
  EXPECT_EQ(lm_diff, 0u);
  // min_cos: double dot products summed in another order, rounded to float: 1e-6.
  const double mc_err = testing::MaxAbsError(mc[1], mc[0]);
  EXPECT_LE(mc_err, 1e-6);
  EXPECT_EQ(mc[1][size_t(2) * n_chunks + 5], 1.0f);
  EXPECT_EQ(mc[1][size_t(0) * n_chunks + 9], 0.0f);
  Summary("BuildLandmarks",
          absl::StrFormat("n=%d h=%d d=%d C=%d: landmarks differing %zu (tol 0), min_cos max "
                          "abs %.1e (tol 1e-6); gpu %.3f ms (incl. launch+sync)",
                          n, h, d, C, lm_diff, mc_err, ms));
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, TopKMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(500);
  struct Case {
    const char* name;
    int rows, cols, k;
    bool largest, masked, ties, specials;
  };
  // Outliers (smallest min_cos, 48 per head), heavy chunks (largest mass, masked by the
  // static set), with ties and with NaN / +-0 / +-inf, and a large-k case.
  const std::vector<Case> cases = {
      {"outliers", 8, 16380, 48, false, false, false, false},
      {"heavy+mask", 8, 16380, 512, true, true, false, false},
      {"ties", 8, 16380, 300, true, true, true, false},
      {"specials", 8, 4096, 200, false, true, true, true},
      {"wide-k", 32, 2048, 2000, true, false, true, true},
  };
  size_t total_diff = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const size_t cells = size_t(c.rows) * c.cols;
    std::vector<float> s = testing::RandomFloats(cells, rng, 1.0f);
    if (c.ties)
      for (auto& v : s) v = std::round(v * 16.0f) / 16.0f;  // 33 distinct values
    if (c.specials) {
      std::uniform_int_distribution<size_t> pick(0, cells - 1);
      const float sp[] = {NAN, -NAN, 0.0f, -0.0f, INFINITY, -INFINITY};
      for (int i = 0; i < 600; ++i) s[pick(rng)] = sp[i % 6];
    }
    std::vector<uint8_t> mask;
    if (c.masked) {
      mask.assign(cells, 0);
      std::bernoulli_distribution bd(0.3);
      for (auto& m : mask) m = bd(rng) ? 1 : 0;
    }
    std::vector<int32_t> out[2];
    Backend* bes[2] = {cpu.get(), gpu.get()};
    for (int bi = 0; bi < 2; ++bi) {
      Backend& be = *bes[bi];
      Buffer sb = Up(be, s), mb = Up(be, mask);
      Buffer ob = testing::Scratch<int32_t>(be, size_t(c.rows) * c.k);
      Buffer ws = Ws(be, be.TopKWorkspaceBytes(c.rows, c.cols, c.k));
      ASSERT_TRUE(be.TopK(CSpanOf<float>(sb, cells), CSpanOf<uint8_t>(mb, mask.size()), c.rows,
                          c.cols, c.k, c.largest, SpanOf<int32_t>(ob, size_t(c.rows) * c.k),
                          ws.workspace())
                      .ok());
      out[bi] = Down<int32_t>(be, ob, size_t(c.rows) * c.k);
    }
    size_t diff = 0;
    for (size_t i = 0; i < out[0].size(); ++i) diff += out[0][i] != out[1][i];
    EXPECT_EQ(diff, 0u);  // a strict total order: the answer is unique
    total_diff += diff;
  }

  // Fewer than k eligible columns: the CPU rejects the call; the GPU (which cannot see the
  // data without a sync) returns the eligible ones and -1 for the rest.
  const int rows = 2, cols = 64, k = 16;
  std::vector<float> s = testing::RandomFloats(size_t(rows) * cols, rng);
  std::vector<uint8_t> mask(size_t(rows) * cols, 0);
  for (int c = 0; c < cols; ++c) mask[size_t(cols) + c] = c >= 10;  // row 1: 10 eligible
  Buffer sb = Up(*gpu, s), mb = Up(*gpu, mask), ob = testing::Scratch<int32_t>(*gpu, rows * k);
  Buffer ws = Ws(*gpu, gpu->TopKWorkspaceBytes(rows, cols, k));
  ASSERT_TRUE(gpu->TopK(CSpanOf<float>(sb, s.size()), CSpanOf<uint8_t>(mb, mask.size()), rows,
                        cols, k, true, SpanOf<int32_t>(ob, rows * k), ws.workspace())
                  .ok());
  const auto o = Down<int32_t>(*gpu, ob, rows * k);
  for (int i = 0; i < k; ++i) {
    EXPECT_GE(o[i], 0);
    if (i < 10) {
      EXPECT_GE(o[k + i], 0);
      EXPECT_LT(o[k + i], 10);
    } else {
      EXPECT_EQ(o[k + i], -1);
    }
  }
  Summary("TopK", absl::StrFormat("%zu cases up to 8x16380 (k 48..2000, ties, NaN/+-0/+-inf, "
                                  "masks): %zu differing indices (tol 0); short rows -> -1 ok",
                                  cases.size(), total_diff));
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, ObservationMassMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(600);
  const LayerShape shape{8, 4, 128};
  const int w = 64, n = 32768, hg = shape.query_heads();
  // Queries of stddev 2 against keys of stddev 1: logits ~ N(0, 4), a realistically
  // peaked softmax. The last w prompt tokens observe (causal inside the window).
  const std::vector<bf16> q = testing::RandomBf16(size_t(w) * hg * shape.d, rng, 2.0f);
  const std::vector<bf16> kr = testing::RandomBf16(size_t(n) * shape.h * shape.d, rng, 1.0f);
  std::vector<int64_t> qpos(w), kpos(n);
  for (int j = 0; j < n; ++j) kpos[j] = j;
  for (int t = 0; t < w; ++t) qpos[t] = n - w + t;

  std::vector<float> mass[2];
  double ms = 0;
  Backend* bes[2] = {cpu.get(), gpu.get()};
  for (int bi = 0; bi < 2; ++bi) {
    Backend& be = *bes[bi];
    Buffer qb = Up(be, q), kb = Up(be, kr), qpb = Up(be, qpos), kpb = Up(be, kpos);
    Buffer mb = testing::Scratch<float>(be, size_t(shape.h) * n);
    Buffer ws = Ws(be, be.ObservationWorkspaceBytes(w, n, shape));
    for (int run = 0; run < (bi == 1 ? 2 : 1); ++run) {
      ASSERT_TRUE(be.Synchronize().ok());
      const auto t0 = Clock::now();
      ASSERT_TRUE(be.ObservationMass(CSpanOf<bf16>(qb, q.size()), CSpanOf<int64_t>(qpb, w), w,
                                     CSpanOf<bf16>(kb, kr.size()), CSpanOf<int64_t>(kpb, n), n,
                                     shape, SpanOf<float>(mb, size_t(shape.h) * n),
                                     ws.workspace())
                      .ok());
      ASSERT_TRUE(be.Synchronize().ok());
      ms = MsSince(t0);
    }
    mass[bi] = Down<float>(be, mb, size_t(shape.h) * n);
  }
  // Logits differ only by fp32 dot-product order (~1e-6 relative); probabilities and
  // their double sums follow: 1e-4 of the largest mass, and 1e-5 relative Frobenius.
  double mx = 0;
  for (float v : mass[0]) mx = std::max(mx, double(v));
  const double max_err = testing::MaxAbsError(mass[1], mass[0]) / mx;
  const double rel = testing::RelativeError(mass[1], mass[0]);
  EXPECT_LE(max_err, 1e-4);
  EXPECT_LE(rel, 1e-5);
  // Total mass = number of (row, query head) pairs: each softmax sums to 1.
  double total = 0;
  for (float v : mass[1]) total += v;
  EXPECT_NEAR(total, double(w) * hg, 1e-3 * w * hg);
  Summary("ObservationMass",
          absl::StrFormat("w=%d n=%d h=%d g=%d d=%d: max err / max mass %.1e (tol 1e-4), rel "
                          "Frobenius %.1e (tol 1e-5); gpu %.2f ms",
                          w, n, shape.h, shape.g, shape.d, max_err, rel, ms));
}

TEST(IngestGpu, ChunkSumMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = testing::Cpu();
  auto rng = MakeRng(700);
  const int h = 8, n = 131072, C = 8, n_chunks = (n - 32) / C;
  std::vector<float> m = testing::RandomFloats(size_t(h) * n, rng, 1.0f);
  for (auto& v : m) v = std::fabs(v);
  std::vector<float> out[2];
  Backend* bes[2] = {cpu.get(), gpu.get()};
  for (int bi = 0; bi < 2; ++bi) {
    Backend& be = *bes[bi];
    Buffer mb = Up(be, m), ob = testing::Scratch<float>(be, size_t(h) * n_chunks);
    ASSERT_TRUE(be.ChunkSum(CSpanOf<float>(mb, m.size()), h, n, C, n_chunks,
                            SpanOf<float>(ob, size_t(h) * n_chunks))
                    .ok());
    out[bi] = Down<float>(be, ob, size_t(h) * n_chunks);
  }
  // Same double sums in token order, one rounding: bit-identical.
  size_t diff = 0;
  for (size_t i = 0; i < out[0].size(); ++i) diff += std::memcmp(&out[0][i], &out[1][i], 4) != 0;
  EXPECT_EQ(diff, 0u);
  Summary("ChunkSum", absl::StrFormat("h=%d n=%d C=%d: %zu differing (tol 0)", h, n, C, diff));
}

// ---------------------------------------------------------------------------------------
TEST(IngestGpu, BadInputsAreInvalidArgument) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  const LayerShape shape{8, 4, 128};
  const int n = 256, D = shape.D();
  Buffer k = gpu->Allocate(size_t(n) * D * sizeof(bf16)).value();
  Buffer a = gpu->Allocate(size_t(n) * 160 * sizeof(bf16)).value();
  Buffer b = gpu->Allocate(size_t(shape.h) * 160 * shape.d * sizeof(bf16)).value();
  std::vector<float> eig(D);
  int checked = 0;
  auto expect_invalid = [&](const absl::Status& st, const char* what) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << what << ": " << st;
    ++checked;
  };
  {  // rank not a multiple of 8
    FactorizeOptions opt{100, 0};
    Buffer ws = Ws(*gpu, gpu->FactorizeWorkspaceBytes(n, shape, {160, 0}));
    expect_invalid(gpu->Factorize(CSpanOf<bf16>(k, size_t(n) * D), n, shape, opt,
                                  SpanOf<bf16>(a, size_t(n) * 100),
                                  SpanOf<bf16>(b, size_t(shape.h) * 100 * shape.d),
                                  absl::MakeSpan(eig), ws.workspace())
                       .status(),
                   "Factorize rank 100");
  }
  {  // workspace too small
    FactorizeOptions opt{160, 0};
    expect_invalid(gpu->Factorize(CSpanOf<bf16>(k, size_t(n) * D), n, shape, opt,
                                  SpanOf<bf16>(a, size_t(n) * 160),
                                  SpanOf<bf16>(b, size_t(shape.h) * 160 * shape.d),
                                  absl::MakeSpan(eig), Workspace{k.data(), 16})
                       .status(),
                   "Factorize small workspace");
    expect_invalid(gpu->ProjectKeys(CSpanOf<bf16>(k, size_t(n) * D), n, shape,
                                    CSpanOf<bf16>(b, size_t(shape.h) * 160 * shape.d), 160,
                                    SpanOf<bf16>(a, size_t(n) * 160), Workspace{k.data(), 16})
                       .status(),
                   "ProjectKeys small workspace");
  }
  {  // odd rotary dim; wrong x size
    RopeSpec spec;
    spec.rotary_dim = 63;
    Buffer pos = gpu->Allocate(n * sizeof(int64_t)).value();
    expect_invalid(gpu->ApplyRope(spec, CSpanOf<int64_t>(pos, n), shape.h, shape.d,
                                  SpanOf<bf16>(k, size_t(n) * D)),
                   "ApplyRope rotary_dim 63");
    expect_invalid(gpu->ApplyRope(RopeSpec{}, CSpanOf<int64_t>(pos, n), shape.h, shape.d,
                                  SpanOf<bf16>(k, size_t(n) * D - 1)),
                   "ApplyRope x size");
  }
  {  // landmarks: n_chunks*C > n
    Buffer lm = gpu->Allocate(size_t(40) * D * sizeof(bf16)).value();
    Buffer mc = gpu->Allocate(size_t(shape.h) * 40 * sizeof(float)).value();
    expect_invalid(gpu->BuildLandmarks(CSpanOf<bf16>(k, size_t(n) * D), n, shape.h, shape.d, 8,
                                       40, SpanOf<bf16>(lm, size_t(40) * D),
                                       SpanOf<float>(mc, size_t(shape.h) * 40)),
                   "BuildLandmarks n_chunks*C > n");
  }
  {  // top-k: k > cols; mask of the wrong size
    Buffer s = gpu->Allocate(size_t(8) * 100 * sizeof(float)).value();
    Buffer o = gpu->Allocate(size_t(8) * 200 * sizeof(int32_t)).value();
    Buffer ws = Ws(*gpu, gpu->TopKWorkspaceBytes(8, 100, 200));
    expect_invalid(gpu->TopK(CSpanOf<float>(s, 800), {}, 8, 100, 200, true,
                             SpanOf<int32_t>(o, 1600), ws.workspace()),
                   "TopK k > cols");
    expect_invalid(gpu->TopK(CSpanOf<float>(s, 800), CSpanOf<uint8_t>(s, 799), 8, 100, 10, true,
                             SpanOf<int32_t>(o, 80), ws.workspace()),
                   "TopK mask size");
  }
  {  // observation: mass of the wrong size; chunk sums: C = 0
    Buffer q = gpu->Allocate(size_t(16) * shape.query_heads() * shape.d * sizeof(bf16)).value();
    Buffer pos = gpu->Allocate(size_t(n) * sizeof(int64_t)).value();
    Buffer m = gpu->Allocate(size_t(shape.h) * n * sizeof(float)).value();
    Buffer ws = Ws(*gpu, gpu->ObservationWorkspaceBytes(16, n, shape));
    expect_invalid(gpu->ObservationMass(
                       CSpanOf<bf16>(q, size_t(16) * shape.query_heads() * shape.d),
                       CSpanOf<int64_t>(pos, 16), 16,
                       CSpanOf<bf16>(k, size_t(n) * shape.h * shape.d), CSpanOf<int64_t>(pos, n),
                       n, shape, SpanOf<float>(m, size_t(shape.h) * n - 8), ws.workspace()),
                   "ObservationMass mass size");
    expect_invalid(gpu->ChunkSum(CSpanOf<float>(m, size_t(shape.h) * n), shape.h, n, 0, 10,
                                 SpanOf<float>(m, size_t(shape.h) * 10)),
                   "ChunkSum C = 0");
  }
  // Nothing above touched the device: the stream is clean.
  EXPECT_TRUE(gpu->Synchronize().ok());
  Summary("BadInputs", absl::StrFormat("%d malformed calls -> InvalidArgument", checked));
}

TEST(IngestGpu, DestroyingTheDefaultStreamIsRejected) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  EXPECT_EQ(gpu->DestroyStream(Stream{}).code(), absl::StatusCode::kInvalidArgument);
  auto s = gpu->CreateStream();
  ASSERT_TRUE(s.ok()) << s.status();
  // An op on a created stream, then its own synchronization.
  std::vector<float> m(8 * 64, 1.0f);
  Buffer mb = Up(*gpu, m), ob = testing::Scratch<float>(*gpu, 8 * 8);
  ASSERT_TRUE(gpu->Synchronize().ok());
  ASSERT_TRUE(gpu->ChunkSum(CSpanOf<float>(mb, m.size()), 8, 64, 8, 8, SpanOf<float>(ob, 64), *s)
                  .ok());
  ASSERT_TRUE(gpu->Synchronize(*s).ok());
  const auto o = Down<float>(*gpu, ob, 64);
  for (float v : o) EXPECT_EQ(v, 8.0f);
  EXPECT_TRUE(gpu->DestroyStream(*s).ok());
}

}  // namespace
}  // namespace ingest_gpu_test
}  // namespace kvshade::kernels

// Ingest per profile: what a committed session holds and how closely Attend over it
// matches exact attention over the same tokens.
#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <numeric>
#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "ingest_test_util.h"

namespace kvshade::service::testing {
namespace ingest_test {
namespace {

constexpr int kG = 2;  // query heads per KV head of TestModel()

// The tokens [from, to) of `s` as an ingest stream in the order a chunked prefill sends
// them (IngestStreamOf with `chunk`), committed.
std::vector<v1::IngestRequest> ChunkedIngestStreamOf(const std::string& session_id, const Stream& s,
                                                     int from, int to, int chunk,
                                                     const std::vector<std::vector<bf16>>* qobs = nullptr,
                                                     int w = 0) {
  return IngestStreamOf(session_id, s, from, to, qobs, w, chunk);
}

TEST(IngestTest, ExactProfileAttendMatchesReference) {
  Harness hx;
  Stream s = MakeStream(300, hx.model, 1);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  for (int l = 0; l < 2; ++l) {
    auto q = hx.Query(10 + l);
    auto out = hx.Attend(o.attachment, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LT(RelErr(*out, ExactAttend(s, l, kG, q)), 1e-2);
  }
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state(), "ready");
  EXPECT_EQ(info->tokens(), 300u);
  EXPECT_EQ(info->profile(), v1::PROFILE_KIND_EXACT);
}

TEST(IngestTest, ShadowFullRankFullBudgetIsExact) {
  // T1 through the service: r = D and a budget covering every chunk -> exact attention.
  Harness hx;
  Stream s = MakeStream(512, hx.model, 2);
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_sparse_budget(256);
  auto o = hx.Open(s, p);
  ASSERT_EQ(o.ingest.captured_energy_size(), 2);
  for (float e : o.ingest.captured_energy()) EXPECT_GT(e, 0.999f);
  for (int l = 0; l < 2; ++l) {
    auto q = hx.Query(20 + l);
    auto out = hx.Attend(o.attachment, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LT(RelErr(*out, ExactAttend(s, l, kG, q)), 2e-2);
  }
}

// Subspace iteration's fallback to the full eigensolver is counted
// (kvshade_factorize_fallbacks_total): keys of rank 16 and 32 over a 1% noise floor (a steep
// spectrum, like a trained model's) take the fast path; all-zero keys leave the block rank
// deficient and fall back, on each of the two layers. Keys of rank 16 with no floor but
// bf16 rounding are left out: their block sits at the edge of what the shifted passes can
// orthonormalize in fp32, and whether it falls back depends on the BLAS's rounding (it does
// on one layer of two with OpenBLAS on an AVX-512 AMD EPYC, not on other machines).
TEST(IngestTest, FactorizeFallbacksAreCounted) {
  Harness hx;
  const v1::Profile p = SmallShadowProfile();  // rank 64: 96 columns of D = 128
  hx.Open(MakeStream(512, hx.model, 3), p);
  hx.Open(MakeStream(512, hx.model, 4, /*key_rank=*/32, /*token_base=*/5000), p);
  EXPECT_EQ(MetricValue(hx, "kvshade_factorize_fallbacks_total"), 0);
  hx.Open(MakeStream(512, hx.model, 5, /*key_rank=*/0, /*token_base=*/9000, /*noise=*/0.0f), p);
  EXPECT_EQ(MetricValue(hx, "kvshade_factorize_fallbacks_total"), 2);
}

// Sets the key of token t (position t), head hh at `layer` so that its post-RoPE value is x.
void SetPostRopeKey(Stream& s, int layer, int t, int hh, std::vector<float> x) {
  auto table = kernels::MakeRopeTable(kernels::RopeSpec{}, s.d);
  ASSERT_TRUE(table.ok());
  kernels::ApplyRopeReference(*table, kernels::RopePairing::kHalfSplit, -t, x.data(), s.d);
  for (int c = 0; c < s.d; ++c) s.k[layer][(size_t(t) * s.h + hh) * s.d + c] = kernels::FloatToBf16(x[c]);
}

TEST(IngestTest, ShadowStaticSetHoldsSinkOutliersAndTail) {
  Harness hx;
  Stream s = MakeStream(400, hx.model, 3);
  const int layer = 1, C = 8, h = 2, d = 64;
  // Planted outliers, different per head: in chunk c every token's post-RoPE key is u except
  // the last, which is -u. The landmark is (7u - u) / 8 = 0.75u, so that token's cosine to
  // it is -1: the smallest minimum cosine any chunk can have. The other chunks hold
  // low-rank random keys, whose tokens agree with their own mean far better.
  const std::vector<std::vector<int>> outliers = {{7, 19, 33}, {12, 25, 40}};
  auto rng = kernels::testing::MakeRng(33);
  std::normal_distribution<float> nd;
  for (int hh = 0; hh < h; ++hh) {
    for (int chunk : outliers[hh]) {
      std::vector<float> u(d);
      for (auto& x : u) x = nd(rng);  // norm ~8, like the stream's keys
      for (int i = 0; i < C; ++i) {
        std::vector<float> x = u;
        if (i == C - 1)
          for (auto& e : x) e = -e;
        SetPostRopeKey(s, layer, chunk * C + i, hh, x);
      }
    }
  }
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(32);
  p.set_outliers(3);
  p.set_local_window(32);
  auto o = hx.Open(s, p);
  v1::GetStaticSetRequest r;
  r.set_attachment_id(o.attachment);
  r.set_layer(layer);
  auto st = hx.engine->GetStaticSet(hx.tenant, r);
  ASSERT_TRUE(st.ok()) << st.status();
  // (400 - 32) / 8 = 46 chunks; tail 400 - 368 = 32 tokens; sink + 3 outliers per head.
  ASSERT_EQ(st->lengths_size(), h);
  for (uint32_t len : st->lengths()) EXPECT_EQ(len, 4u * C);
  ASSERT_EQ(st->k().shape_size(), 3);
  ASSERT_GE(st->k().shape(1), 4 * C);
  ASSERT_EQ(st->tail_k().shape(0), 32);
  ASSERT_EQ(st->tail_k().shape(1), h);
  // Which rows: head hh holds the sink chunk's tokens 0..7, then its own outlier chunks in
  // ascending order, 8 tokens each; the tail holds tokens 368..399. Values are copied, so
  // each row's value must be the input's bits; keys are the input rotated at the token's
  // position (fp32) and rounded to bf16 once: within half an ulp, 2^-8 |x|, plus 1e-4 for
  // the fp32 rotation; a row of another token differs by O(1).
  const std::vector<float> ref = PostRope(s, layer);
  const std::vector<bf16> sk = TensorBf16(st->k()), sv = TensorBf16(st->v());
  const std::vector<bf16> tk = TensorBf16(st->tail_k()), tv = TensorBf16(st->tail_v());
  const int64_t srows = st->k().shape(1);
  auto expect_row = [&](const bf16* k, const bf16* v, int token, int hh, const std::string& what) {
    const size_t src = (size_t(token) * h + hh) * d;
    int kbad = 0, vdiff = 0;
    for (int c = 0; c < d; ++c) {
      const double err = std::abs(double(kernels::Bf16ToFloat(k[c])) - ref[src + c]);
      kbad += err > std::ldexp(std::abs(ref[src + c]), -8) + 1e-4;
      vdiff += std::memcmp(&v[c], &s.v[layer][src + c], sizeof(bf16)) != 0;
    }
    EXPECT_EQ(kbad, 0) << what << ": key of token " << token << ", head " << hh;
    EXPECT_EQ(vdiff, 0) << what << ": value of token " << token << ", head " << hh;
  };
  for (int hh = 0; hh < h; ++hh) {
    std::vector<int> chunks = {0};
    chunks.insert(chunks.end(), outliers[hh].begin(), outliers[hh].end());
    for (size_t j = 0; j < chunks.size(); ++j) {
      for (int i = 0; i < C; ++i) {
        const size_t row = (size_t(hh) * srows + j * C + i) * d;
        expect_row(&sk[row], &sv[row], chunks[j] * C + i, hh,
                   j == 0 ? "sink" : "outlier chunk " + std::to_string(chunks[j]));
      }
    }
    for (int t = 0; t < 32; ++t) {
      const size_t row = (size_t(t) * h + hh) * d;
      expect_row(&tk[row], &tv[row], 368 + t, hh, "tail");
    }
  }
}

// Plants, for every layer and KV head, keys at `positions` whose post-RoPE value is
// `scale` times the head's first query head of q.
void PlantNeedles(Stream& s, const std::vector<std::vector<bf16>>& q, int g,
                  const std::vector<int>& positions, float scale) {
  auto table = kernels::MakeRopeTable(kernels::RopeSpec{}, s.d);
  ASSERT_TRUE(table.ok());
  for (int l = 0; l < s.L; ++l) {
    for (int t : positions) {
      for (int hh = 0; hh < s.h; ++hh) {
        std::vector<float> x(s.d);
        for (int c = 0; c < s.d; ++c) x[c] = scale * kernels::Bf16ToFloat(q[l][size_t(hh * g) * s.d + c]);
        kernels::ApplyRopeReference(*table, kernels::RopePairing::kHalfSplit, -t, x.data(), s.d);
        for (int c = 0; c < s.d; ++c) s.k[l][(size_t(t) * s.h + hh) * s.d + c] = kernels::FloatToBf16(x[c]);
      }
    }
  }
}

double Cosine(const bf16* a, const bf16* b, int d) {
  double ab = 0, aa = 0, bb = 0;
  for (int i = 0; i < d; ++i) {
    const double x = kernels::Bf16ToFloat(a[i]), y = kernels::Bf16ToFloat(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
  return ab / std::sqrt(std::max(aa * bb, 1e-30));
}

// The tokens a mini layer must keep per KV head, in the order it stores them: the
// `heavy` tokens before the recent window with the most observation mass (ascending), then
// the window's `window` tokens. The mass of token t for head hh is the softmax weight the
// observation query (w = 1, at the last position: it sees every token) of each query head
// of hh's group puts on t, summed over the group; computed here in double from the
// post-RoPE keys `kpost` [n, h, d].
std::vector<std::vector<int>> MiniKeptTokens(const Stream& s, const std::vector<float>& kpost, int g,
                                             const std::vector<bf16>& qobs, int window, int heavy) {
  const int n = s.n(), h = s.h, d = s.d;
  std::vector<std::vector<int>> kept(h);
  for (int hh = 0; hh < h; ++hh) {
    std::vector<double> mass(n, 0.0);
    for (int gi = 0; gi < g; ++gi) {
      const bf16* q = qobs.data() + size_t(hh * g + gi) * d;
      std::vector<double> z(n);
      double mx = -1e300, sum = 0;
      for (int t = 0; t < n; ++t) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(kernels::Bf16ToFloat(q[c])) * kpost[(size_t(t) * h + hh) * d + c];
        z[t] = dot / std::sqrt(double(d));
        mx = std::max(mx, z[t]);
      }
      for (int t = 0; t < n; ++t) sum += std::exp(z[t] - mx);
      for (int t = 0; t < n; ++t) mass[t] += std::exp(z[t] - mx) / sum;
    }
    std::vector<int> cand(n - window);
    std::iota(cand.begin(), cand.end(), 0);
    std::stable_sort(cand.begin(), cand.end(), [&](int a, int b) { return mass[a] > mass[b]; });
    kept[hh].assign(cand.begin(), cand.begin() + heavy);
    std::sort(kept[hh].begin(), kept[hh].end());
    for (int t = n - window; t < n; ++t) kept[hh].push_back(t);
  }
  return kept;
}

// Attention of q [h*g, d] over exactly the tokens `kept` (per KV head, in storage order)
// with their unquantized post-RoPE keys and input values, in double; and the expected
// squared error of what a mini layer returns instead, E||out - ref||^2, from its KIVI INT2
// quantization of the first floor(|kept| / G) * G rows (docs/ALGORITHM.md, "INT2 / INT4
// codec"). Derivation: a quantized element x is stored as min + code * scale with
// scale = (max - min) / 3 of its group (keys: G rows of one channel; values: G channels of
// one row) and code = round((x - min) / scale), so its error e lies in [-scale/2, scale/2];
// rounding errors of distinct elements are modelled as independent, zero mean, uniform:
// Var(e) <= scale^2 / 12. Every stored element is also rounded to bf16: uniform within half
// an ulp <= 2^-8 |x|, Var <= (2^-8 x)^2 / 3. To first order in the key errors eps_i and
// value errors eta_i, with p = softmax(q.k / sqrt(d)) and o = sum_i p_i v_i,
//   out_c - o_c = sum_i p_i eta_ic + sum_i p_i (v_ic - o_c) delta_i,  delta_i = q.eps_i / sqrt(d),
// so E(out_c - o_c)^2 = sum_i p_i^2 [Var(eta_ic) + (v_ic - o_c)^2 sum_c' q_c'^2 Var(eps_ic') / d].
struct MiniReference {
  std::vector<double> out;
  double expected_sq_err = 0;
};

MiniReference MiniAttendReference(const Stream& s, int layer, const std::vector<float>& kpost, int g,
                                  const std::vector<std::vector<int>>& kept, int G,
                                  const std::vector<bf16>& q) {
  const int h = s.h, d = s.d;
  MiniReference r;
  r.out.assign(size_t(h) * g * d, 0.0);
  auto bf16_var = [](double x) { return std::pow(std::ldexp(x, -8), 2) / 3; };
  for (int hh = 0; hh < h; ++hh) {
    const int keep = static_cast<int>(kept[hh].size()), mq = keep / G * G;
    std::vector<double> k(size_t(keep) * d), v(size_t(keep) * d);
    for (int i = 0; i < keep; ++i) {
      for (int c = 0; c < d; ++c) {
        const size_t src = (size_t(kept[hh][i]) * h + hh) * d + c;
        k[size_t(i) * d + c] = kpost[src];
        v[size_t(i) * d + c] = kernels::Bf16ToFloat(s.v[layer][src]);
      }
    }
    // Per-element error variances of the stored rows.
    std::vector<double> vk(size_t(keep) * d), vv(size_t(keep) * d);
    for (int i = 0; i < keep; ++i) {
      for (int c = 0; c < d; ++c) {
        double ks = 0, vs = 0;
        if (i < mq) {
          double kmin = 1e300, kmax = -1e300, vmin = 1e300, vmax = -1e300;
          for (int j = i / G * G; j < i / G * G + G; ++j) {
            kmin = std::min(kmin, k[size_t(j) * d + c]);
            kmax = std::max(kmax, k[size_t(j) * d + c]);
          }
          for (int cc = c / G * G; cc < c / G * G + G; ++cc) {
            vmin = std::min(vmin, v[size_t(i) * d + cc]);
            vmax = std::max(vmax, v[size_t(i) * d + cc]);
          }
          ks = (kmax - kmin) / 3;
          vs = (vmax - vmin) / 3;
        }
        vk[size_t(i) * d + c] = ks * ks / 12 + bf16_var(k[size_t(i) * d + c]);
        vv[size_t(i) * d + c] = vs * vs / 12 + bf16_var(v[size_t(i) * d + c]);
      }
    }
    for (int gi = 0; gi < g; ++gi) {
      const int hq = hh * g + gi;
      std::vector<double> qd(d), z(keep), p(keep), dvar(keep, 0.0);
      for (int c = 0; c < d; ++c) qd[c] = kernels::Bf16ToFloat(q[size_t(hq) * d + c]);
      double mx = -1e300, sum = 0;
      for (int i = 0; i < keep; ++i) {
        double dot = 0;
        for (int c = 0; c < d; ++c) {
          dot += qd[c] * k[size_t(i) * d + c];
          dvar[i] += qd[c] * qd[c] * vk[size_t(i) * d + c] / d;
        }
        z[i] = dot / std::sqrt(double(d));
        mx = std::max(mx, z[i]);
      }
      for (int i = 0; i < keep; ++i) sum += (p[i] = std::exp(z[i] - mx));
      for (int i = 0; i < keep; ++i) p[i] /= sum;
      double* o = &r.out[size_t(hq) * d];
      for (int i = 0; i < keep; ++i)
        for (int c = 0; c < d; ++c) o[c] += p[i] * v[size_t(i) * d + c];
      for (int i = 0; i < keep; ++i) {
        for (int c = 0; c < d; ++c) {
          const double dv = v[size_t(i) * d + c] - o[c];
          r.expected_sq_err += p[i] * p[i] * (vv[size_t(i) * d + c] + dv * dv * dvar[i]);
        }
      }
    }
  }
  return r;
}

double L2Dist(const std::vector<float>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

TEST(IngestTest, MiniKeepsRecentWindowAndHeavyHittersInt2) {
  Harness hx;
  const int n = 200, G = 16, d = 64;  // G: the KIVI group of a mini profile that names none
  Stream s = MakeStream(n, hx.model, 4);
  // Values that differ mostly between tokens and between groups of G channels (a per
  // (token, group) level plus 0.1 noise): INT2's error, 1/6 of a group's range, is then
  // small against the differences between tokens, so attending over other tokens than the
  // kept ones shows (checked below), while the quantization itself is still exercised.
  {
    auto vr = kernels::testing::MakeRng(44);
    std::normal_distribution<float> nd;
    for (auto& lv : s.v) {
      for (size_t i = 0; i < lv.size(); i += G) {
        const float level = nd(vr);
        for (int c = 0; c < G; ++c) lv[i + c] = kernels::FloatToBf16(level + 0.1f * nd(vr));
      }
    }
  }
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_MINI);
  p.set_mini_recent_ratio(0.2f);
  p.set_mini_heavy_ratio(0.2f);
  std::vector<std::vector<bf16>> qobs;  // one observation query per layer (w = 1)
  for (int l = 0; l < 2; ++l) qobs.push_back(hx.Query(30 + l));
  const std::vector<int> needles = {10, 55, 101};  // outside the recent window [160, 200)
  PlantNeedles(s, qobs, kG, needles, 3.0f);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = p;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->effective_profile(), v1::PROFILE_KIND_MINI);
  auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 0, n, &qobs, 1));
  ASSERT_TRUE(ing.ok()) << ing.status();
  const std::string a = hx.AttachTo(c->session_id());
  v1::GetStaticSetRequest r;
  r.set_attachment_id(a);
  // Window ceil(0.2 * 200) = 40 tokens. Pyramid over 2 layers, mean 0.2: layer 0 keeps
  // floor(0.3714 * 200) = 74 heavy tokens, layer 1 floor(0.0286 * 200) = 5.
  const int window = 40, heavy[2] = {74, 5};
  for (int l = 0; l < 2; ++l) {
    r.set_layer(l);
    auto st = hx.engine->GetStaticSet(hx.tenant, r);
    ASSERT_TRUE(st.ok()) << st.status();
    for (uint32_t len : st->lengths()) EXPECT_EQ(len, uint32_t(window + heavy[l])) << "layer " << l;
    // Every head kept the needles (as INT2: direction preserved, not bits).
    const std::vector<bf16> k = TensorBf16(st->k());
    const int srows = static_cast<int>(st->k().shape(1));
    for (int hh = 0; hh < 2; ++hh) {
      const bf16* target = qobs[l].data() + size_t(hh * kG) * d;
      int found = 0;
      for (uint32_t row = 0; row < st->lengths(hh); ++row) {
        found += Cosine(k.data() + (size_t(hh) * srows + row) * d, target, d) > 0.8;
      }
      EXPECT_GE(found, 3) << "layer " << l << " head " << hh;
    }
    auto dsel = hx.Select(a, l, hx.Query(40));
    ASSERT_TRUE(dsel.ok()) << dsel.status();
    EXPECT_EQ(dsel->selected(), 0u);  // mini: no per-query selection

    // Attend against attention over exactly the tokens mini must keep (reference above),
    // from the keys it holds before quantizing: post-RoPE, rounded to bf16.
    std::vector<float> kpost = PostRope(s, l);
    for (float& x : kpost) x = kernels::Bf16ToFloat(kernels::FloatToBf16(x));
    const auto kept = MiniKeptTokens(s, kpost, kG, qobs[l], window, heavy[l]);
    for (int hh = 0; hh < 2; ++hh)
      for (int t : needles)
        ASSERT_TRUE(std::binary_search(kept[hh].begin(), kept[hh].end() - window, t)) << "needle " << t;
    std::vector<std::vector<int>> window_only(2);
    for (int hh = 0; hh < 2; ++hh) window_only[hh].assign(kept[hh].end() - window, kept[hh].end());
    // Two queries: a random one (scale 0.1: attention spread over the kept tokens, key
    // errors small enough for the first-order model), and the observation query scaled to
    // 0.05 (the needles carry a good part of the mass, not all of it).
    std::vector<bf16> q_needle(qobs[l].size());
    for (size_t i = 0; i < q_needle.size(); ++i)
      q_needle[i] = kernels::FloatToBf16(0.05f * kernels::Bf16ToFloat(qobs[l][i]));
    for (const bool needle_query : {false, true}) {
      const std::vector<bf16> q = needle_query ? q_needle : hx.Query(50 + l, 0.1f);
      auto out = hx.Attend(a, l, q);
      ASSERT_TRUE(out.ok()) << out.status();
      const MiniReference ref = MiniAttendReference(s, l, kpost, kG, kept, G, q);
      // The error's norm against 3x its expected RMS: ||out - ref||^2 sums hundreds of
      // terms (4 query heads x 64 channels over 45-114 tokens' independent roundings), so
      // it concentrates near its mean (the model's Var is an upper estimate: a group's
      // extremes round exactly); over KVSHADE_TEST_SEED 1..100 err stays below 0.45 bounds.
      const double bound = 3 * std::sqrt(ref.expected_sq_err);
      const double err = L2Dist(*out, ref.out);
      EXPECT_LE(err, bound) << "layer " << l << ": |out - ref| " << err << ", expected RMS "
                            << std::sqrt(ref.expected_sq_err);
      // The bound tells the kept tokens from others. Exact attention over every token
      // (nothing dropped, nothing quantized) lies beyond it, so would fail the check above.
      // For the needle query, attention over the window alone (no heavy hitters) lies 1.5
      // bounds from ref: an Attend over those tokens, off by an error like err (a third of
      // the bound here), would fail it too.
      const std::vector<float> all = ExactAttend(s, l, kG, q);
      const MiniReference win = MiniAttendReference(s, l, kpost, kG, window_only, G, q);
      std::vector<float> win_f(win.out.begin(), win.out.end());
      EXPECT_GT(L2Dist(all, ref.out), bound) << "layer " << l;
      if (needle_query) EXPECT_GT(L2Dist(win_f, ref.out), 1.5 * bound) << "layer " << l;
      std::cout << "mini layer " << l << ": |out - ref| " << err << " (bound " << bound
                << "); all tokens " << L2Dist(all, ref.out) << ", window only "
                << L2Dist(win_f, ref.out) << "\n";
    }
  }
}

TEST(IngestTest, AutoPicksMiniBelowMinTokensAndShadowAbove) {
  Harness hx;  // min_tokens = 256 in the harness
  for (auto [n, want] : {std::pair{100, v1::PROFILE_KIND_MINI}, {300, v1::PROFILE_KIND_SHADOW}}) {
    Stream s = MakeStream(n, hx.model, 5 + n, 16, 7 * n);
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    auto c = hx.engine->CreateSession(hx.tenant, cr);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->effective_profile(), want);
  }
}

TEST(IngestTest, AbandonedStreamLeavesSessionIngestingAndRetryable) {
  Harness hx;
  Stream s = MakeStream(120, hx.model, 6);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_EXACT);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok());
  auto msgs = IngestStreamOf(c->session_id(), s, 0, 120);
  {
    auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE((*st)->Add(msgs[1]).ok());
    // A second stream while the first is open is refused.
    auto second = hx.engine->BeginIngest(hx.tenant, msgs[0]);
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  }  // abandoned
  v1::GetSessionRequest gr;
  gr.set_session_id(c->session_id());
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->state(), "ingesting");
  auto ing = hx.engine->Ingest(hx.tenant, msgs);
  ASSERT_TRUE(ing.ok()) << ing.status();
  EXPECT_EQ(ing->tokens(), 120u);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->state(), "ready");
  // Committed: a further ingest is refused.
  EXPECT_EQ(hx.engine->Ingest(hx.tenant, msgs).status().code(), absl::StatusCode::kFailedPrecondition);
}


// Engine::IngestStream::AddLayer (layer parts as views, what the UCX data plane hands the
// engine from its receive buffers) gives the session a stream of v1 layer messages gives,
// and follows the same rules.
TEST(IngestTest, LayerPartsAsViewsGiveTheSameSessionAsLayerMessages) {
  Harness hx;
  Stream s = MakeStream(120, hx.model, 9);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_SHADOW);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  // Both created before either is committed: no prefix reuse between them.
  auto a = hx.engine->CreateSession(hx.tenant, cr);
  auto b = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(a.ok() && b.ok());
  auto ra = hx.engine->Ingest(hx.tenant, IngestStreamOf(a->session_id(), s, 0, 120));
  ASSERT_TRUE(ra.ok()) << ra.status();

  auto msgs = IngestStreamOf(b->session_id(), s, 0, 120);
  auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
  ASSERT_TRUE(st.ok()) << st.status();
  for (size_t i = 1; i < msgs.size(); ++i) {
    if (!msgs[i].has_layer()) {
      ASSERT_TRUE((*st)->Add(msgs[i]).ok()) << i;
      continue;
    }
    const v1::IngestLayer& l = msgs[i].layer();
    IngestLayerView part;
    part.layer = l.layer();
    part.token_offset = l.token_offset();
    part.last_part = l.last_part();
    part.k = ViewOf(l.k());
    part.v = ViewOf(l.v());
    if (l.has_observation_queries()) part.observation_queries = ViewOf(l.observation_queries());
    ASSERT_TRUE((*st)->AddLayer(part).ok()) << i;
  }
  auto rb = (*st)->Finish();
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(ra->SerializeAsString(), rb->SerializeAsString());

  // The static sets the two sessions serve are the same, bit for bit.
  std::vector<std::string> sets;
  for (const auto* id : {&a->session_id(), &b->session_id()}) {
    v1::AttachRequest ar;
    ar.set_session_id(*id);
    auto att = hx.engine->Attach(hx.tenant, ar);
    ASSERT_TRUE(att.ok()) << att.status();
    v1::GetStaticSetRequest gr;
    gr.set_attachment_id(att->attachment_id());
    gr.set_layer(1);
    auto set = hx.engine->GetStaticSet(hx.tenant, gr);
    ASSERT_TRUE(set.ok()) << set.status();
    sets.push_back(set->SerializeAsString());
  }
  EXPECT_EQ(sets[0], sets[1]);

  // A part after the commit, or a malformed one, fails the stream like a message does.
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok());
  auto cm = IngestStreamOf(c->session_id(), s, 0, 120);
  auto sc = hx.engine->BeginIngest(hx.tenant, cm[0]);
  ASSERT_TRUE(sc.ok());
  IngestLayerView bad;
  bad.layer = 0;
  bad.k = ViewOf(cm[1].layer().k());
  bad.v = ViewOf(cm[1].layer().v());
  bad.k.shape[2] /= 2;  // [n, h, d/2]
  const absl::Status refused = (*sc)->AddLayer(bad);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("k.shape"), std::string::npos) << refused;
  EXPECT_EQ((*sc)->Add(cm[1]).code(), absl::StatusCode::kFailedPrecondition);  // the stream failed
}

// A chunked prefill's order (every layer incomplete until the last chunk, so all but one
// wait in host memory: "Overlap" in service/ingest.cc) gives the session that the same K/V
// sent layer by layer gives, bit for bit: the same IngestResponse, and on every layer the
// same static set, Attend output and Select delta. Per profile: shadow, exact (on this
// host-memory backend its keys are rotated part by part, in a layer's host copy too) and
// mini; observation queries come with the final parts. 400 tokens over 4 layers, in
// chunks of 96 (the last one 16).
TEST(IngestTest, AChunkedPrefillGivesTheSameSessionAsLayerByLayer) {
  const int n = 400, chunk = 96;
  for (const v1::ProfileKind kind :
       {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_EXACT, v1::PROFILE_KIND_MINI}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    Harness hx;
    hx.model = TestModel(4);
    Stream s = MakeStream(n, hx.model, 31);
    std::vector<std::vector<bf16>> qobs;  // one observation query per layer (w = 1)
    for (int l = 0; l < s.L; ++l) qobs.push_back(hx.Query(60 + l));
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = kind == v1::PROFILE_KIND_SHADOW ? SmallShadowProfile() : ProfileOf(kind);
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    // Both created before either is committed: no prefix reuse between them.
    auto a = hx.engine->CreateSession(hx.tenant, cr);
    auto b = hx.engine->CreateSession(hx.tenant, cr);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->effective_profile(), kind);
    auto ra = hx.engine->Ingest(hx.tenant, IngestStreamOf(a->session_id(), s, 0, n, &qobs, 1));
    ASSERT_TRUE(ra.ok()) << ra.status();
    auto rb = hx.engine->Ingest(hx.tenant, ChunkedIngestStreamOf(b->session_id(), s, 0, n, chunk, &qobs, 1));
    ASSERT_TRUE(rb.ok()) << rb.status();
    EXPECT_EQ(ra->SerializeAsString(), rb->SerializeAsString());

    const std::string att_a = hx.AttachTo(a->session_id()), att_b = hx.AttachTo(b->session_id());
    for (int l = 0; l < s.L; ++l) {
      SCOPED_TRACE(absl::StrCat("layer ", l));
      EXPECT_EQ(hx.StaticSet(att_a, l).SerializeAsString(), hx.StaticSet(att_b, l).SerializeAsString());
      const std::vector<bf16> q = hx.Query(70 + l);
      auto oa = hx.Attend(att_a, l, q), ob = hx.Attend(att_b, l, q);
      ASSERT_TRUE(oa.ok() && ob.ok()) << oa.status() << " " << ob.status();
      ASSERT_EQ(oa->size(), ob->size());
      EXPECT_EQ(std::memcmp(oa->data(), ob->data(), oa->size() * sizeof(float)), 0);
      auto da = hx.Select(att_a, l, q), db = hx.Select(att_b, l, q);
      ASSERT_TRUE(da.ok() && db.ok()) << da.status() << " " << db.status();
      da->clear_attachment_id();
      db->clear_attachment_id();
      EXPECT_EQ(da->SerializeAsString(), db->SerializeAsString());
    }
  }
}

// A layer message whose tensor has more dimensions than a view holds is refused with the
// shape it sent.
TEST(IngestTest, AFiveDimensionalLayerTensorIsRefusedNamingItsShape) {
  Harness hx;
  Stream s = MakeStream(64, hx.model, 3);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_EXACT);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok());
  auto msgs = IngestStreamOf(c->session_id(), s, 0, 64);
  auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
  ASSERT_TRUE(st.ok());
  v1::IngestRequest m = msgs[1];
  m.mutable_layer()->mutable_v()->clear_shape();
  for (int64_t x : {2, 3, 4, 5, 6}) m.mutable_layer()->mutable_v()->add_shape(x);
  const absl::Status refused = (*st)->Add(m);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("v.shape must have 3 dimensions, got [2, 3, 4, 5, 6]"), std::string::npos)
      << refused;
}

// A shadow session over `s`'s tokens (not yet ingested).
absl::StatusOr<v1::CreateSessionResponse> CreateShadow(Harness& hx, const Stream& s) {
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_SHADOW);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  return hx.engine->CreateSession(hx.tenant, cr);
}

TEST(IngestTest, CommitTakesEffectOnlyWhenTheStreamEndsCleanly) {
  // The defect this guards: [header, layer 0 (last), layer 1 (last), commit, layer 0]
  // answered INVALID_ARGUMENT yet left the session ready, so a retry was refused.
  Harness hx;
  Stream s = MakeStream(512, hx.model, 10);
  auto c = CreateShadow(hx, s);
  ASSERT_TRUE(c.ok()) << c.status();
  v1::GetSessionRequest gr;
  gr.set_session_id(c->session_id());
  auto expect_nothing_committed = [&](const char* what) {
    auto info = hx.engine->GetSession(hx.tenant, gr);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state(), "ingesting") << what;
    EXPECT_EQ(info->tokens(), 0u) << what;
  };
  const auto msgs = IngestStreamOf(c->session_id(), s, 0, 512);

  auto trailing = msgs;
  trailing.push_back(msgs[1]);  // a layer-0 part after the commit
  auto bad = hx.engine->Ingest(hx.tenant, trailing);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("IngestCommit"), std::string_view::npos) << bad.status();
  expect_nothing_committed("a message after the commit");

  // A stream whose commit was accepted but that never ended (the transport saw no clean
  // end) commits nothing either.
  {
    auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
    ASSERT_TRUE(st.ok()) << st.status();
    for (size_t i = 1; i < msgs.size(); ++i) ASSERT_TRUE((*st)->Add(msgs[i]).ok()) << i;
    expect_nothing_committed("commit accepted, stream open");
  }  // dropped without an end
  expect_nothing_committed("commit accepted, stream dropped");

  auto ing = hx.engine->Ingest(hx.tenant, msgs);
  ASSERT_TRUE(ing.ok()) << ing.status();
  EXPECT_EQ(ing->tokens(), 512u);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->state(), "ready");
  EXPECT_EQ(info->tokens(), 512u);
}

TEST(IngestTest, ShadowLayersAreAllocatedFromTheDeviceBudget) {
  // A shadow layer's factors, landmarks and static set come from the device arena: a
  // budget too small for them fails the ingest with RESOURCE_EXHAUSTED (it does not
  // allocate behind the budget's back), and a fitting one shows them in device_bytes_used.
  const v1::Profile p = [] {
    v1::Profile x = ProfileOf(v1::PROFILE_KIND_SHADOW);
    x.set_rank(64);
    return x;
  }();
  {
    Harness hx;
    Stream s = MakeStream(2048, hx.model, 7);
    const v1::StatsRequest sreq;
    auto before = hx.engine->Stats(hx.tenant, sreq);
    ASSERT_TRUE(before.ok()) << before.status();
    hx.Open(s, p);
    auto after = hx.engine->Stats(hx.tenant, sreq);
    ASSERT_TRUE(after.ok()) << after.status();
    // At least A [n, r] and the landmarks [n/C, h, d] (bf16) of both layers.
    const uint64_t lower = 2ull * (2048 * 64 * 2 + 2048 / 8 * hx.model.num_kv_heads() *
                                   hx.model.head_dim() * 2);
    EXPECT_GE(after->device_bytes_used() - before->device_bytes_used(), lower);
  }
  {
    Harness hx;
    hx.config.device_budget_bytes = 64 << 10;  // far below one layer's factors
    hx.Restart();
    Stream s = MakeStream(2048, hx.model, 8);
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = p;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    auto c = hx.engine->CreateSession(hx.tenant, cr);
    ASSERT_TRUE(c.ok()) << c.status();
    auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 0, s.n()));
    EXPECT_EQ(ing.status().code(), absl::StatusCode::kResourceExhausted) << ing.status();
  }
}

}  // namespace
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVSHADE_TEST_SANITIZED 1
#endif
#endif

// Bytes the process's allocator has handed out and not taken back (glibc: the main
// arena's chunks in use plus mmapped ones; the calling thread allocates from the main arena
// when it is the main thread), or nothing where that is not known: other C libraries, and
// sanitizer builds, whose allocator replaces malloc's.
std::optional<size_t> HeapBytesInUse() {
#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && \
    !defined(KVSHADE_TEST_SANITIZED)
  const struct mallinfo2 mi = mallinfo2();
  return mi.uordblks + mi.hblkhd;
#else
  return std::nullopt;
#endif
}

TEST(IngestTest, AStreamDroppedAtAnyPartLeavesNoBytesBehind) {
  // Issue: an ingest cancelled at any layer leaves nothing behind. For every cut point
  // (after the header, after each layer part, after the commit of a stream that never
  // ends) the dropped stream leaves the session ingesting with 0 tokens and the device
  // and host tiers exactly as before it; then the whole stream still commits. Both orders
  // of the parts: layer by layer, and a chunked prefill's (every layer incomplete until the
  // last chunk), whose incomplete layers wait in host memory outside the tiers: those host
  // copies go back to the engine's staging pool with the stream (its leased bytes), and
  // nothing else stays on the heap (measured where the allocator tells, see HeapBytesInUse).
  Harness hx;
  Stream s = MakeStream(512, hx.model, 12);
  auto c = CreateShadow(hx, s);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto layer_by_layer = IngestStreamOf(c->session_id(), s, 0, 512);
  const auto chunked = ChunkedIngestStreamOf(c->session_id(), s, 0, 512, 128);
  ASSERT_GE(layer_by_layer.size(), 4u);  // header, at least one part per layer, commit
  ASSERT_EQ(chunked.size(), 2u + 4 * 2);  // header, 4 chunks of 2 layers, commit
  // One layer's K and V in host memory: 512 tokens x h x d bf16, twice.
  const size_t host_copy = 2 * size_t(512) * hx.model.num_kv_heads() * hx.model.head_dim() * sizeof(bf16);
  const double device0 = TierTotal(hx, "device"), host0 = TierTotal(hx, "host");
  // The heap is compared from the second whole stream of each order on: the first
  // layer-by-layer one leaves allocations that the process keeps for good (about 270 KiB
  // here) and that no later stream repeats.
  for (const auto* msgs : {&layer_by_layer, &chunked}) {
    auto st = hx.engine->BeginIngest(hx.tenant, (*msgs)[0]);
    ASSERT_TRUE(st.ok()) << st.status();
    for (size_t i = 1; i < msgs->size(); ++i) ASSERT_TRUE((*st)->Add((*msgs)[i]).ok()) << i;
  }
  for (const auto* msgs : {&layer_by_layer, &chunked}) {
    const bool is_chunked = msgs == &chunked;
    SCOPED_TRACE(is_chunked ? "chunked" : "layer by layer");
    bool held_bytes_while_open = false, held_host_copy_while_open = false;
    for (size_t cut = 1; cut <= msgs->size(); ++cut) {
      const std::optional<size_t> heap0 = HeapBytesInUse();
      {
        auto st = hx.engine->BeginIngest(hx.tenant, (*msgs)[0]);
        ASSERT_TRUE(st.ok()) << "cut " << cut << ": " << st.status();
        for (size_t i = 1; i < cut; ++i) ASSERT_TRUE((*st)->Add((*msgs)[i]).ok()) << cut << " " << i;
        // While open, the layers compressed so far hold memory (so the check below has
        // something to find when a dropped stream leaks), and so do the host copies of
        // a chunked stream's incomplete layers.
        held_bytes_while_open |= TierTotal(hx, "device") > device0;
        held_host_copy_while_open |= EngineInternals(*hx.engine).staging().leased_bytes() >= host_copy;
      }  // dropped without an end
      ExpectDroppedStreamLeftNothing(hx, c->session_id(), device0, host0, absl::StrCat("cut ", cut));
      // (A quarter of one layer's host copy: anything the process keeps on the way is far
      // smaller.)
      if (heap0) EXPECT_LT(*HeapBytesInUse(), *heap0 + host_copy / 4) << "cut " << cut;
      EXPECT_LE(EngineInternals(*hx.engine).staging().kept_bytes(), hx.config.host_budget_bytes / 8)
          << "cut " << cut;
    }
    EXPECT_TRUE(held_bytes_while_open);
    EXPECT_EQ(held_host_copy_while_open, is_chunked);
  }
  auto ing = hx.engine->Ingest(hx.tenant, chunked);
  ASSERT_TRUE(ing.ok()) << ing.status();
  EXPECT_EQ(ing->tokens(), 512u);
  EXPECT_GT(TierTotal(hx, "device"), device0);
  EXPECT_GT(TierTotal(hx, "host"), host0);
}

}  // namespace ingest_test
}  // namespace kvshade::service::testing

namespace kvshade::service::testing {
namespace ingest_test {
namespace {

// Bytes of one layer's raw K (or V) in the test model: n tokens x h x d bf16.
size_t RawTensorBytes(const Harness& hx, int n) {
  return size_t(n) * hx.model.num_kv_heads() * hx.model.head_dim() * sizeof(bf16);
}

TEST(IngestTest, ALayerThatFailsToCompressFailsTheStreamNamingIt) {
  // Layers are compressed on the stream's compression thread while the next layer's parts
  // arrive; an error there must still fail the stream (at its next message), name the
  // layer, keep its status code, and commit nothing. The budget holds one layer's raw K
  // and V but not the compression's working copy of the keys.
  const int n = 2048;
  Harness hx;
  hx.config.device_budget_bytes = 2 * RawTensorBytes(hx, n) + RawTensorBytes(hx, n) / 4;
  hx.Restart();
  Stream s = MakeStream(n, hx.model, 21);
  auto c = CreateShadow(hx, s);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto msgs = IngestStreamOf(c->session_id(), s, 0, n);
  ASSERT_EQ(msgs.size(), 6u);  // header, two parts per layer, commit
  const double device0 = TierTotal(hx, "device");
  {
    auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*st)->Add(msgs[1]).ok());
    ASSERT_TRUE((*st)->Add(msgs[2]).ok());  // layer 0 complete: handed to the compressor
    // Layer 1's first part needs layer 0's raw blocks back, so it waits for the compressor
    // and reports its failure.
    absl::Status failed = (*st)->Add(msgs[3]);
    EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
    EXPECT_TRUE(absl::StartsWith(failed.message(), "layer 0: ")) << failed;
    EXPECT_FALSE((*st)->Add(msgs[4]).ok());
    EXPECT_FALSE((*st)->Add(msgs[5]).ok());
    EXPECT_FALSE((*st)->Finish().ok());
  }
  v1::GetSessionRequest gr;
  gr.set_session_id(c->session_id());
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), "ingesting");
  EXPECT_EQ(info->tokens(), 0u);
  EXPECT_EQ(TierTotal(hx, "device"), device0);
}

TEST(IngestTest, ABudgetForOneLayerAtATimeStillIngests) {
  // A layer's parts arrive while the previous layer compresses, which holds two layers of
  // raw K/V at once; when the device budget cannot hold both plus the compression's
  // working memory, the arriving layer waits for the compressing one instead of failing
  // or starving it. So a two-layer prompt ingests in any budget that holds a one-layer
  // prompt plus what one compressed layer keeps: the smallest such budgets are compared.
  const int n = 2048;
  const size_t u = [&] { Harness h0; return RawTensorBytes(h0, n); }();
  auto ingests = [&](int layers, size_t budget) {
    Harness hx;
    hx.model = TestModel(layers);
    hx.config.device_budget_bytes = budget;
    hx.Restart();
    Stream s = MakeStream(n, hx.model, 22);
    auto c = CreateShadow(hx, s);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() && hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 0, n)).ok();
  };
  // The smallest budget of the grid 2u, 2u + u/8, ..., 16u that holds the prompt, by
  // bisection (a budget that holds a prompt holds it in any larger budget: about 9 ingests
  // instead of up to 113); 0 when none does.
  auto smallest_budget = [&](int layers) {
    auto at = [&](int i) { return 2 * u + size_t(i) * (u / 8); };
    int lo = 0, hi = 112;
    if (!ingests(layers, at(hi))) return size_t{0};
    if (ingests(layers, at(lo))) return at(lo);
    while (hi - lo > 1) {  // lo refused, hi held
      const int mid = (lo + hi) / 2;
      (ingests(layers, at(mid)) ? hi : lo) = mid;
    }
    return at(hi);
  };
  // What one compressed layer keeps on the device.
  Harness hx;
  hx.model = TestModel(1);
  hx.Restart();
  const double device0 = TierTotal(hx, "device");
  hx.Open(MakeStream(n, hx.model, 22), ProfileOf(v1::PROFILE_KIND_SHADOW));
  const double kept = TierTotal(hx, "device") - device0;
  ASSERT_GT(kept, 0.0);

  const size_t one = smallest_budget(1), two = smallest_budget(2);
  ASSERT_GT(one, 0u);
  ASSERT_GT(two, 0u);
  EXPECT_LE(double(two), double(one) + kept + double(u / 8))
      << "one layer: " << one << " bytes, two layers: " << two << " bytes, one compressed layer: "
      << kept << " bytes (raw K of a layer: " << u << ")";
  // (Overlapping without the wait needs two more raw tensors: the bound above is below that.)
  EXPECT_LT(kept + double(u / 8), 2.0 * u);
}

// A chunked prefill (every layer incomplete until the last chunk) holds at most one
// incomplete layer's raw K/V in the device arena: the others' rows wait in host memory,
// and go up one layer at a time as the last chunk completes them, as in layer-by-layer
// order. So it ingests in a device budget of what its compressed layers keep plus a few
// layers' raw K/V, far below the whole prompt's raw K/V (what the arena would hold if
// every layer kept its blocks from its first part on). Measured between parts before the
// last chunk, the arena holds at most one layer's raw K and V beyond what it held at the
// start.
TEST(IngestTest, AChunkedPrefillHoldsOneIncompleteLayerInDeviceMemory) {
  const int n = 1024, L = 16, chunk = 256;
  const v1::Profile p = SmallShadowProfile();
  const size_t u = [&] { Harness h0; return RawTensorBytes(h0, n); }();
  // What one compressed layer keeps on the device.
  const double kept = [&] {
    Harness h1;
    h1.model = TestModel(1);
    const double d0 = TierTotal(h1, "device");
    h1.Open(MakeStream(n, h1.model, 41), p);
    return TierTotal(h1, "device") - d0;
  }();
  ASSERT_GT(kept, 0.0);
  Harness hx;
  hx.model = TestModel(L);
  // Every compressed layer plus four layers' raw K/V: the layer that completes, the one
  // compressing and the compression's working memory. (This prompt ingests, in this order
  // and layer by layer alike, with 2.5 to 3.5 layers' raw K/V above what the compressed
  // layers keep, depending on the compression thread's timing, which shapes the arena's
  // free ranges.)
  const size_t budget = size_t(L * kept) + 8 * u;
  ASSERT_LT(budget, 2 * u * L) << "the whole prompt's raw K/V fits; the test shows nothing";
  hx.config.device_budget_bytes = budget;
  hx.Restart();
  Stream s = MakeStream(n, hx.model, 42);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = p;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto msgs = ChunkedIngestStreamOf(c->session_id(), s, 0, n, chunk);
  ASSERT_EQ(msgs.size(), size_t(2 + n / chunk * L));
  const double device0 = TierTotal(hx, "device");
  auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
  ASSERT_TRUE(st.ok()) << st.status();
  double most = 0;  // beyond device0, after any part before the last chunk
  for (size_t i = 1; i < msgs.size(); ++i) {
    const absl::Status added = (*st)->Add(msgs[i]);
    ASSERT_TRUE(added.ok()) << "message " << i << ": " << added;
    if (i <= size_t(n / chunk - 1) * L) most = std::max(most, TierTotal(hx, "device") - device0);
  }
  auto r = (*st)->Finish();
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens(), uint64_t(n));
  EXPECT_EQ(most, 2.0 * u) << "raw K of a layer: " << u << " bytes";
  std::cout << "chunked prefill of " << L << " layers x " << n << " tokens: budget " << budget
            << " bytes (" << double(budget) / u << " raw tensors of a layer; the prompt's raw K/V: "
            << 2 * L << "), one compressed layer keeps " << kept << "\n";
}

}  // namespace
}  // namespace ingest_test
}  // namespace kvshade::service::testing

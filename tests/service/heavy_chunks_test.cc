// Heavy chunks (docs/ALGORITHM.md "Prefill / ingest" step 6) through the service: with
// observation queries, a shadow session keeps per head and layer the chunks those queries
// attend most, as many as the pyramid gives the layer, INT2-quantized in the static set;
// select never hands them out again.
#include <set>

#include "codec_bounds.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace heavy_chunks_test {
namespace {

constexpr int kL = 4, kH = 2, kG = 2, kD = 64;
constexpr int kN = 512, kC = 8, kLocal = 32, kOutliers = 2;
constexpr int kChunks = (kN - kLocal) / kC;  // 60
constexpr int kExact = 1 + kOutliers;        // sink + outliers: exact static chunks per head
constexpr int kMeanHeavy = 4;
const int kGroup = int(ProfileDefaults().kivi_group);  // the profiles leave kivi_group at the default

// The pyramid of docs/ALGORITHM.md ("Pyramid budget", depth 7) scaled to a mean of `mean`
// chunks: layer 0 gets mean * (2 - 1/7), the last layer mean / 7, linear in between,
// rounded to the nearest count.
std::vector<int> PyramidCounts(int layers, int mean) {
  std::vector<int> out(layers);
  const double first = 2.0 - 1.0 / 7.0, last = 1.0 / 7.0;
  for (int l = 0; l < layers; ++l) {
    out[l] = int(std::lround(mean * (first + (last - first) * l / (layers - 1))));
  }
  return out;
}

v1::Profile HeavyProfile(int heavy) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_chunk_size(kC);
  p.set_local_window(kLocal);
  p.set_outliers(kOutliers);
  p.set_sparse_budget(kChunks);  // every selectable chunk
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  p.set_heavy_chunks(uint32_t(heavy));
  return p;
}

// Sets the keys of chunk `chunk` of head `hh` so that their post-RoPE value is a*u plus
// Gaussian noise (so that the chunk's tokens differ).
void PlantChunk(Stream& s, int layer, int hh, int chunk, const std::vector<float>& u, float a,
                std::mt19937_64& rng) {
  auto table = kernels::MakeRopeTable(kernels::RopeSpec{}, s.d);
  ASSERT_TRUE(table.ok());
  std::normal_distribution<float> noise(0.0f, 0.5f);
  for (int r = 0; r < kC; ++r) {
    const int t = chunk * kC + r;
    std::vector<float> x(s.d);
    for (int c = 0; c < s.d; ++c) x[c] = a * u[c] + noise(rng);
    kernels::ApplyRopeReference(*table, kernels::RopePairing::kHalfSplit, -t, x.data(), s.d);
    for (int c = 0; c < s.d; ++c) s.k[layer][(size_t(t) * s.h + hh) * s.d + c] = kernels::FloatToBf16(x[c]);
  }
}

struct Planted {
  Stream s;
  std::vector<std::vector<bf16>> qobs;           // [L][w, h*g, d]
  std::vector<std::vector<std::set<int>>> heavy;  // [L][h]: the chunks to be kept
  int w = 0;
};

// Per layer l and head hh, want[l] chunks ("strong") each the target of one observation
// query (post-RoPE keys 3x the query: nearly all of its mass), and as many "decoys" each
// 2.5x the same query (e^-4 of the strong chunk's logit: a few percent of its mass, still
// far above the other chunks): the decoys are the next best, so that too many heavy chunks
// per layer would take them. Queries past want[l] are small and random (near-uniform mass).
Planted Plant(const v1::ModelSpec& m, const std::vector<int>& want) {
  Planted p;
  p.s = MakeStream(kN, m, 61);
  p.w = *std::max_element(want.begin(), want.end());
  auto rng = kernels::testing::MakeRng(62);
  for (int l = 0; l < kL; ++l) {
    std::vector<bf16> q(size_t(p.w) * kH * kG * kD);
    p.heavy.emplace_back(kH);
    for (int i = 0; i < p.w; ++i) {
      for (int hh = 0; hh < kH; ++hh) {
        const bool strong = i < want[l];
        std::vector<bf16> u = kernels::testing::RandomBf16(kD, rng, strong ? 1.0f : 0.1f);
        for (int g = 0; g < kG; ++g) {
          std::copy(u.begin(), u.end(), q.begin() + (size_t(i) * kH * kG + hh * kG + g) * kD);
        }
        if (!strong) continue;
        const std::vector<float> uf = kernels::testing::ToFloat(u);
        const int chunk = 3 + 8 * i + hh + l % 2;  // 3..53: never the sink, never the tail
        PlantChunk(p.s, l, hh, chunk, uf, 3.0f, rng);
        PlantChunk(p.s, l, hh, chunk + 4, uf, 2.5f, rng);  // its decoy
        p.heavy[l][hh].insert(chunk);
      }
    }
    p.qobs.push_back(std::move(q));
  }
  return p;
}

struct Ingested {
  std::string session, attachment;
};

Ingested IngestPlanted(Harness& hx, const Planted& p, int heavy, bool with_obs) {
  Ingested out;
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = HeavyProfile(heavy);
  cr.mutable_token_ids()->Add(p.s.tokens.begin(), p.s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return out;
  EXPECT_EQ(c->reused_tokens(), 0u);
  auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), p.s, 0, kN,
                                                         with_obs ? &p.qobs : nullptr, p.w));
  EXPECT_TRUE(ing.ok()) << ing.status();
  out.session = c->session_id();
  out.attachment = hx.AttachTo(out.session);
  return out;
}

std::vector<float> RowOf(const std::vector<bf16>& x, size_t row, int d) {
  std::vector<float> out(d);
  for (int c = 0; c < d; ++c) out[c] = kernels::Bf16ToFloat(x[row * d + c]);
  return out;
}

TEST(HeavyChunksService, PlantedChunksJoinTheStaticSetAsInt2PerThePyramid) {
  Harness hx;
  hx.model = TestModel(kL, kH, kG, kD);
  const std::vector<int> want = PyramidCounts(kL, kMeanHeavy);
  ASSERT_EQ(want, (std::vector<int>{7, 5, 3, 1}));  // mean 4 over 4 layers
  const Planted p = Plant(hx.model, want);

  const Ingested base = IngestPlanted(hx, p, 0, true);  // heavy_chunks 0: no heavy chunks
  const Ingested heavy = IngestPlanted(hx, p, kMeanHeavy, true);
  // Without observation queries there are no heavy chunks (its own engine: the same
  // tokens and profile would reuse the prefix ingested above).
  Harness hx_no_obs;
  hx_no_obs.model = hx.model;
  const Ingested no_obs = IngestPlanted(hx_no_obs, p, kMeanHeavy, false);
  ASSERT_FALSE(base.attachment.empty());
  ASSERT_FALSE(heavy.attachment.empty());
  ASSERT_FALSE(no_obs.attachment.empty());

  for (int l = 0; l < kL; ++l) {
    SCOPED_TRACE(absl::StrCat("layer ", l));
    const v1::GetStaticSetResponse b = hx.StaticSet(base.attachment, l);
    const v1::GetStaticSetResponse st = hx.StaticSet(heavy.attachment, l);
    const v1::GetStaticSetResponse nb = hx_no_obs.StaticSet(no_obs.attachment, l);
    ASSERT_EQ(b.lengths_size(), kH);
    ASSERT_EQ(st.lengths_size(), kH);
    ASSERT_EQ(nb.lengths_size(), kH);
    // Static rows per head: the exact chunks, plus want[l] heavy chunks of C rows.
    for (int hh = 0; hh < kH; ++hh) {
      EXPECT_EQ(b.lengths(hh), uint32_t(kExact * kC));
      EXPECT_EQ(nb.lengths(hh), uint32_t(kExact * kC));
      ASSERT_EQ(st.lengths(hh), uint32_t((kExact + want[l]) * kC)) << "head " << hh;
    }

    const std::vector<bf16> bk = TensorBf16(b.k()), bv = TensorBf16(b.v());
    const std::vector<bf16> sk = TensorBf16(st.k()), sv = TensorBf16(st.v());
    const size_t bmax = b.k().shape(1), smax = st.k().shape(1);
    // Exact post-RoPE keys as the backend computes them (bit-identical: cpu_rope.cc).
    std::vector<float> kr = PostRope(p.s, l);
    for (float& x : kr) x = kernels::RoundToBf16(x);
    const auto exact_v = [&](int hh, int t) {
      std::vector<float> out(kD);
      for (int c = 0; c < kD; ++c) out[c] = kernels::Bf16ToFloat(p.s.v[l][(size_t(t) * kH + hh) * kD + c]);
      return out;
    };
    const auto exact_k = [&](int hh, int t) {
      return std::vector<float>(kr.begin() + (size_t(t) * kH + hh) * kD, kr.begin() + (size_t(t) * kH + hh + 1) * kD);
    };

    std::vector<std::vector<int>> found_of(kH);  // per head: the chunk of each heavy block
    for (int hh = 0; hh < kH; ++hh) {
      SCOPED_TRACE(absl::StrCat("head ", hh));
      // The exact part is the one a session without heavy chunks holds, bit for bit.
      for (size_t r = 0; r < size_t(kExact) * kC; ++r) {
        ASSERT_EQ(RowOf(sk, hh * smax + r, kD), RowOf(bk, hh * bmax + r, kD)) << "row " << r;
        ASSERT_EQ(RowOf(sv, hh * smax + r, kD), RowOf(bv, hh * bmax + r, kD)) << "row " << r;
      }
      // Each heavy block of C rows is some chunk's values, INT2 within the bound: find which
      // (the chunk whose exact values are nearest).
      std::vector<int>& found = found_of[hh];
      for (int j = 0; j < want[l]; ++j) {
        const size_t row0 = hh * smax + size_t(kExact + j) * kC;
        int best = -1;
        double best_dist = 1e300;
        for (int chunk = 0; chunk < kChunks; ++chunk) {
          double dist = 0;
          for (int r = 0; r < kC; ++r) {
            const std::vector<float> got = RowOf(sv, row0 + r, kD), ex = exact_v(hh, chunk * kC + r);
            for (int c = 0; c < kD; ++c) dist += double(got[c] - ex[c]) * (got[c] - ex[c]);
          }
          if (dist < best_dist) best_dist = dist, best = chunk;
        }
        found.push_back(best);
      }
      // They are the planted chunks (the ones the observation queries attend most), in
      // ascending order.
      EXPECT_EQ(std::set<int>(found.begin(), found.end()), p.heavy[l][hh]);
      EXPECT_TRUE(std::is_sorted(found.begin(), found.end()));
      ASSERT_EQ(std::set<int>(found.begin(), found.end()).size(), found.size());

      // Values: per-token groups of G channels, INT2 (codec_bounds.h); not exact, and not
      // within int4's bound (2 bits, not 4).
      double worst2 = 0, worst4 = 0, worst_exact = 0;
      for (int j = 0; j < want[l]; ++j) {
        for (int r = 0; r < kC; ++r) {
          const std::vector<float> got = RowOf(sv, hh * smax + size_t(kExact + j) * kC + r, kD);
          const std::vector<float> ex = exact_v(hh, found[j] * kC + r);
          worst2 = std::max(worst2, WorstRatio(got, ex, ValueChunkBounds(kernels::ValueCodec::kINT2, ex, 1, kD, kGroup)));
          worst4 = std::max(worst4, WorstRatio(got, ex, ValueChunkBounds(kernels::ValueCodec::kINT4, ex, 1, kD, kGroup)));
          worst_exact = std::max(worst_exact, WorstRatio(got, ex, std::vector<double>(kD, 0.0)));
        }
      }
      EXPECT_LE(worst2, 1.0) << "heavy values outside the INT2 bound";
      EXPECT_GE(worst2, 0.5) << "the INT2 bound is loose";
      EXPECT_GT(worst4, 1.0) << "heavy values within the int4 bound: not INT2";
      EXPECT_GT(worst_exact, 1.0) << "heavy values exact: not quantized";

      // Keys: per-channel groups of G rows over the head's heavy rows in their order, the last
      // group padded with copies of the last heavy row.
      const int heavy_rows = want[l] * kC;
      const int padded = (heavy_rows + kGroup - 1) / kGroup * kGroup;
      std::vector<std::vector<float>> ex_rows;
      for (int r = 0; r < padded; ++r) {
        const int rr = std::min(r, heavy_rows - 1);
        ex_rows.push_back(exact_k(hh, found[rr / kC] * kC + rr % kC));
      }
      double kworst2 = 0, kworst4 = 0;
      for (int g0 = 0; g0 < padded; g0 += kGroup) {
        for (int c = 0; c < kD; ++c) {
          std::vector<float> x(kGroup);
          for (int i = 0; i < kGroup; ++i) x[i] = ex_rows[g0 + i][c];
          const double b2 = KiviGroupBound(x.data(), kGroup, 2), b4 = KiviGroupBound(x.data(), kGroup, 4);
          for (int i = 0; i < kGroup && g0 + i < heavy_rows; ++i) {
            const float got = kernels::Bf16ToFloat(sk[(hh * smax + size_t(kExact) * kC + g0 + i) * kD + c]);
            const double err = std::fabs(double(got) - x[i]);
            kworst2 = std::max(kworst2, err / b2);
            kworst4 = std::max(kworst4, err / b4);
          }
        }
      }
      EXPECT_LE(kworst2, 1.0) << "heavy keys outside the INT2 bound";
      EXPECT_GE(kworst2, 0.5) << "the INT2 key bound is loose";
      EXPECT_GT(kworst4, 1.0) << "heavy keys within the int4 bound: not INT2";
    }

    // Select never hands a heavy chunk out: at a budget covering every chunk it returns
    // exactly the non-static ones, and the query aimed at the first planted chunk of each
    // head does not bring it back.
    std::vector<bf16> q(size_t(kH) * kG * kD);
    std::copy(p.qobs[l].begin(), p.qobs[l].begin() + q.size(), q.begin());
    auto delta = hx.Select(heavy.attachment, l, q);
    ASSERT_TRUE(delta.ok()) << delta.status();
    EXPECT_EQ(delta->head_size(), kH * (kChunks - kExact - want[l]));
    std::vector<std::set<int>> served(kH);
    for (int i = 0; i < delta->head_size(); ++i) {
      EXPECT_EQ(p.heavy[l][delta->head(i)].count(delta->chunk(i)), 0u)
          << "heavy chunk " << delta->chunk(i) << " of head " << delta->head(i) << " selected";
      served[delta->head(i)].insert(delta->chunk(i));
    }
    for (int hh = 0; hh < kH; ++hh) {
      for (int chunk : p.heavy[l][hh]) EXPECT_EQ(served[hh].count(chunk + 4), 1u) << "decoy of " << chunk;
    }
    // Attend attends the heavy chunks as the static set holds them (INT2): it matches
    // attention over the static rows, the selected chunks and the tail, and not attention
    // with the heavy chunks' exact values instead.
    auto out = hx.Attend(heavy.attachment, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<bf16> dk = TensorBf16(delta->keys()), dv = TensorBf16(delta->values());
    const std::vector<bf16> tk = TensorBf16(st.tail_k()), tv = TensorBf16(st.tail_v());
    const int tail = int(st.tail_k().shape(0));
    std::vector<float> ref(q.size()), ref_exact(q.size());
    for (int qh = 0; qh < kH * kG; ++qh) {
      const int hh = qh / kG;
      std::vector<std::vector<float>> keys, vals, vals_exact;
      for (uint32_t r = 0; r < st.lengths(hh); ++r) {
        keys.push_back(RowOf(sk, hh * smax + r, kD));
        vals.push_back(RowOf(sv, hh * smax + r, kD));
        const int j = int(r) / kC - kExact;  // heavy block j, or an exact row
        vals_exact.push_back(j < 0 ? vals.back() : exact_v(hh, found_of[hh][j] * kC + int(r) % kC));
      }
      for (int i = 0; i < delta->head_size(); ++i) {
        if (int(delta->head(i)) != hh) continue;
        for (int r = 0; r < kC; ++r) {
          keys.push_back(RowOf(dk, size_t(i) * kC + r, kD));
          vals.push_back(RowOf(dv, size_t(i) * kC + r, kD));
          vals_exact.push_back(vals.back());
        }
      }
      for (int t = 0; t < tail; ++t) {
        keys.push_back(RowOf(tk, size_t(t) * kH + hh, kD));
        vals.push_back(RowOf(tv, size_t(t) * kH + hh, kD));
        vals_exact.push_back(vals.back());
      }
      std::vector<double> logit(keys.size());
      double mx = -1e300, z = 0;
      for (size_t i = 0; i < keys.size(); ++i) {
        double dot = 0;
        for (int c = 0; c < kD; ++c) dot += double(kernels::Bf16ToFloat(q[size_t(qh) * kD + c])) * keys[i][c];
        mx = std::max(mx, logit[i] = dot / std::sqrt(double(kD)));
      }
      for (double& x : logit) z += (x = std::exp(x - mx));
      for (int c = 0; c < kD; ++c) {
        double a = 0, e = 0;
        for (size_t i = 0; i < keys.size(); ++i) a += logit[i] * vals[i][c], e += logit[i] * vals_exact[i][c];
        ref[size_t(qh) * kD + c] = float(a / z);
        ref_exact[size_t(qh) * kD + c] = float(e / z);
      }
    }
    EXPECT_LT(RelErr(*out, ref), 1e-2);
    EXPECT_GT(RelErr(*out, ref_exact), 5e-2);
  }
}

// Heavy chunks are INT2 whatever the value codec, so their group must suit 2-bit codes (a
// multiple of 16) also when the values are int4, whose own groups need only a multiple of
// 8: CreateSession refuses such a profile, instead of the ingest failing once observation
// queries arrive.
TEST(HeavyChunksService, HeavyChunksNeedInt2GroupsWithInt4Values) {
  Harness hx;
  const Stream s = MakeStream(kN, hx.model, 63);
  auto create = [&](int group, int heavy) {
    v1::Profile p = HeavyProfile(heavy);
    p.set_value_codec(v1::VALUE_CODEC_INT4);
    p.set_kivi_group(uint32_t(group));
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = p;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    return hx.engine->CreateSession(hx.tenant, cr);
  };
  auto bad = create(8, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("profile.kivi_group"), std::string_view::npos) << bad.status();
  EXPECT_TRUE(create(8, 0).ok());  // int4 values alone: groups of 8 are fine
  // Groups of 16 with heavy chunks ingest with observation queries.
  auto good = create(16, 2);
  ASSERT_TRUE(good.ok()) << good.status();
  std::vector<std::vector<bf16>> qobs;
  for (int l = 0; l < hx.model.num_layers(); ++l) qobs.push_back(hx.Query(64 + l));
  auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(good->session_id(), s, 0, kN, &qobs, 1));
  EXPECT_TRUE(ing.ok()) << ing.status();
}

}  // namespace
}  // namespace heavy_chunks_test
}  // namespace kvshade::service::testing

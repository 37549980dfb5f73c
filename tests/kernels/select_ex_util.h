// Inputs for the SelectEx / AssignSlots tests (CPU and CUDA parity): a one-segment session
// layer in low-rank form whose landmarks are the chunk means of its reconstructed keys, so
// that two-stage selection has real keys to re-rank with, a runner that copies everything
// into a backend's memory, and a double-precision reference of the stage-2 scores.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"
#include "test_util.h"

namespace kvshade::kernels::testing {

struct LowRankCase {
  LayerShape shape{1, 1, 16};
  int C = 4, r = 16, n_chunks = 0;
  int64_t first_position = 0;
  RopeSpec rope;
  std::vector<bf16> a;          // [n_chunks*C, r]
  std::vector<bf16> b;          // [h, r, d]
  std::vector<bf16> landmarks;  // [n_chunks, h, d]
  std::vector<uint8_t> excluded;  // [h, n_chunks]
  std::vector<bf16> q;          // [h*g, d]
  int sig_bits = 0;             // key signatures (BuildSignatures), uploaded by RunEx
  std::vector<std::byte> sig;   // [n_chunks*C, h, SignatureRecordBytes]
};

// Post-RoPE key of token t (chunk-local index over the segment) of head hh, fp32, as
// Reconstruct computes it before rounding.
inline std::vector<float> KeyOf(const LowRankCase& c, int hh, int t) {
  const int d = c.shape.d, r = c.r;
  std::vector<float> k(d, 0.0f);
  for (int x = 0; x < r; ++x) {
    const float ax = Bf16ToFloat(c.a[size_t(t) * r + x]);
    for (int ch = 0; ch < d; ++ch) k[ch] += ax * Bf16ToFloat(c.b[(size_t(hh) * r + x) * d + ch]);
  }
  const RopeTable table = MakeRopeTable(c.rope, d).value();
  ApplyRopeReference(table, c.rope.pairing, c.first_position + t, k.data(), d);
  return k;
}

// Fills landmarks from the keys (fp32 chunk means, one rounding).
inline void BuildLandmarks(LowRankCase& c) {
  const int h = c.shape.h, d = c.shape.d;
  c.landmarks.assign(size_t(c.n_chunks) * h * d, bf16{});
  for (int j = 0; j < c.n_chunks; ++j) {
    for (int hh = 0; hh < h; ++hh) {
      std::vector<float> mean(d, 0.0f);
      for (int t = 0; t < c.C; ++t) {
        const std::vector<float> k = KeyOf(c, hh, j * c.C + t);
        for (int ch = 0; ch < d; ++ch) mean[ch] += k[ch];
      }
      for (int ch = 0; ch < d; ++ch) {
        c.landmarks[(size_t(j) * h + hh) * d + ch] = FloatToBf16(mean[ch] / float(c.C));
      }
    }
  }
}

// Key signatures of every token from its bf16-rounded post-RoPE key and its chunk's
// landmark (the reference encoder).
inline void BuildSignatures(LowRankCase& c, int bits) {
  const int h = c.shape.h, d = c.shape.d;
  const size_t rec = SignatureRecordBytes(bits, d);
  c.sig_bits = bits;
  c.sig.assign(size_t(c.n_chunks) * c.C * h * rec, std::byte{});
  std::vector<bf16> key(d);
  for (int t = 0; t < c.n_chunks * c.C; ++t) {
    for (int hh = 0; hh < h; ++hh) {
      const std::vector<float> k = KeyOf(c, hh, t);
      for (int ch = 0; ch < d; ++ch) key[ch] = FloatToBf16(k[ch]);
      SignatureEncodeReference(key.data(), c.landmarks.data() + (size_t(t / c.C) * h + hh) * d,
                               d, bits, c.sig.data() + (size_t(t) * h + hh) * rec);
    }
  }
}

// q_n . k_t as stage 2 from signatures defines it (SelectOptions::signatures), in double:
// q_n . L[c] + scale_t * q_scale_n * sum_i q8_n[i] * (code_t[i] - half), with the int8 query
// row q8_n and its scale (SignatureQueryReference).
inline double SignatureDotOf(const LowRankCase& c, int hh, int n, int t) {
  const int h = c.shape.h, g = c.shape.g, d = c.shape.d, bits = c.sig_bits;
  const size_t rec = SignatureRecordBytes(bits, d);
  const bf16* q = c.q.data() + size_t(hh * g + n) * d;
  const bf16* lm = c.landmarks.data() + (size_t(t / c.C) * h + hh) * d;
  std::vector<int8_t> q8(d);
  const double q_scale = SignatureQueryReference(q, d, q8.data());
  std::vector<uint8_t> codes(d);
  float scale = 0.0f;
  SignatureUnpackReference(c.sig.data() + (size_t(t) * h + hh) * rec, d, bits, codes.data(),
                           &scale);
  double base = 0, res = 0;
  for (int ch = 0; ch < d; ++ch) {
    base += double(Bf16ToFloat(q[ch])) * double(Bf16ToFloat(lm[ch]));
    res += double(q8[ch]) * (double(codes[ch]) - ((1 << bits) - 1) / 2.0);
  }
  return base + double(scale) * q_scale * res;
}

// A random case: Gaussian factors and query, no static chunks unless `static_every` > 0
// (then every static_every-th chunk of each head is static, offset by the head).
inline LowRankCase RandomLowRank(std::mt19937_64& rng, LayerShape shape, int C, int r,
                                 int n_chunks, int static_every = 0, int64_t first_position = 3) {
  LowRankCase c;
  c.shape = shape;
  c.C = C;
  c.r = r;
  c.n_chunks = n_chunks;
  c.first_position = first_position;
  c.rope.theta = 10000.0f;
  c.a = RandomBf16(size_t(n_chunks) * C * r, rng, 1.0f);
  c.b = RandomBf16(size_t(shape.h) * r * shape.d, rng, 0.3f);
  c.q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng, 1.0f);
  c.excluded.assign(size_t(shape.h) * n_chunks, 0);
  if (static_every > 0) {
    for (int hh = 0; hh < shape.h; ++hh)
      for (int j = hh % static_every; j < n_chunks; j += static_every)
        c.excluded[size_t(hh) * n_chunks + j] = 1;
  }
  BuildLandmarks(c);
  return c;
}

// Keys given exactly: one KV head of g query heads, d = r = 16, B = I and RoPE on channels
// 0..7 only, so that keys[t] and q[n] (channels 8..15, values exact in bf16) reach the
// logits unrotated and unrounded. keys [n_chunks*C][8], q [g][8].
inline LowRankCase ExactKeys(int g, int C, int n_chunks, const std::vector<std::vector<float>>& keys,
                      const std::vector<std::vector<float>>& q) {
  LowRankCase c;
  const int d = 16;
  c.shape = {1, g, d};
  c.C = C;
  c.r = d;
  c.n_chunks = n_chunks;
  c.first_position = 5;
  c.rope.theta = 10000.0f;
  c.rope.rotary_dim = 8;
  c.b.assign(size_t(d) * d, bf16{});
  for (int x = 0; x < d; ++x) c.b[size_t(x) * d + x] = FloatToBf16(1.0f);
  c.a.assign(size_t(n_chunks) * C * d, bf16{});
  for (size_t t = 0; t < keys.size(); ++t)
    for (int x = 0; x < 8; ++x) c.a[t * d + 8 + x] = FloatToBf16(keys[t][x]);
  c.q.assign(size_t(g) * d, bf16{});
  for (int n = 0; n < g; ++n)
    for (int x = 0; x < 8; ++x) c.q[size_t(n) * d + 8 + x] = FloatToBf16(q[n][x]);
  c.excluded.assign(n_chunks, 0);
  BuildLandmarks(c);
  return c;
}

// A group of 2 query heads over 8 chunks of 4 tokens (ExactKeys): query head 0 has a large
// norm and near-equal logits on every token (10, and 11.25 on one token of chunk kY), so its
// softmax is nearly flat; head 1 puts almost all of its attention on one token of chunk kX,
// whose logit (8) is below every one of head 0's. The raw group maximum ranks kY first, then
// the other chunks tied at 10; per query head probabilities rank kX first (0.99 under head
// 1), then kY (0.10 under head 0).
struct FlatHeadCase {
  static constexpr int kC = 4, kChunks = 8, kX = 5, kY = 2;
  static LowRankCase Make() {
    std::vector<std::vector<float>> keys(kChunks * kC, std::vector<float>(8, 0.0f));
    for (auto& k : keys) k[0] = 1.0f;
    keys[kY * kC + 1][0] = 1.125f;
    keys[kX * kC + 2][1] = 4.0f;
    std::vector<std::vector<float>> q(2, std::vector<float>(8, 0.0f));
    q[0][0] = 40.0f;  // logits 40 * 1 / sqrt(16) = 10 everywhere, 11.25 on kY's token
    q[1][1] = 8.0f;   // logit 8 on kX's token, 0 elsewhere
    return ExactKeys(2, kC, kChunks, keys, q);
  }
};

struct ExOut {
  std::vector<int32_t> slots, selected, miss_slot, miss_chunk, miss_count;
};

// Runs SelectEx (assign = false) or AssignSlots (assign = true, `given` the [h, k] ids) on
// `be` for one item, from the slot table `slots`.
inline ExOut RunEx(Backend& be, const LowRankCase& c, int k, const SelectOptions* opt,
                   const std::vector<int32_t>& slots, const std::vector<int32_t>* given = nullptr,
                   absl::Status* status = nullptr) {
  const int h = c.shape.h;
  const size_t hk = size_t(h) * k;
  std::vector<Buffer> keep;
  SelectItem it;
  it.view.n_segments = 1;
  keep.push_back(Upload(be, c.b));
  it.view.b = static_cast<const bf16*>(keep.back().data());
  it.view.r = c.r;
  SegmentView& v = it.view.segments[0];
  v.n_chunks = c.n_chunks;
  v.first_position = c.first_position;
  keep.push_back(Upload(be, c.landmarks));
  v.landmarks = static_cast<const bf16*>(keep.back().data());
  keep.push_back(Upload(be, c.excluded));
  v.excluded = static_cast<const uint8_t*>(keep.back().data());
  keep.push_back(Upload(be, c.a));
  v.a = static_cast<const bf16*>(keep.back().data());
  if (!c.sig.empty()) {
    keep.push_back(Upload(be, c.sig));
    v.sig = static_cast<const std::byte*>(keep.back().data());
    it.view.sig_bits = c.sig_bits;
  }
  keep.push_back(Upload(be, c.q));
  it.q = static_cast<const bf16*>(keep.back().data());
  keep.push_back(Upload(be, slots));
  it.slots = static_cast<int32_t*>(keep.back().data());
  if (given != nullptr) {
    keep.push_back(Upload(be, *given));
  } else {
    keep.push_back(Scratch<int32_t>(be, hk));
  }
  it.selected = static_cast<int32_t*>(keep.back().data());
  keep.push_back(Scratch<int32_t>(be, hk));
  it.miss_slot = static_cast<int32_t*>(keep.back().data());
  keep.push_back(Scratch<int32_t>(be, hk));
  it.miss_chunk = static_cast<int32_t*>(keep.back().data());
  keep.push_back(Scratch<int32_t>(be, size_t(h)));
  it.miss_count = static_cast<int32_t*>(keep.back().data());
  std::vector<SelectItem> items = {it};
  absl::Status st;
  if (given != nullptr) {
    auto ws = be.Allocate(std::max<size_t>(be.AssignSlotsWorkspaceBytes(c.shape, k, items), 1));
    st = be.AssignSlots(c.shape, k, items, ws->workspace());
  } else {
    SelectOptions o = opt != nullptr ? *opt : SelectOptions{};
    auto ws = be.Allocate(std::max<size_t>(be.SelectExWorkspaceBytes(c.shape, k, o, items), 1));
    st = be.SelectEx(c.shape, k, o, items, ws->workspace());
  }
  if (status != nullptr) *status = st;
  ExOut out;
  if (!st.ok()) return out;
  EXPECT_TRUE(be.Synchronize().ok());
  out.slots = Download<int32_t>(be, it.slots, hk);
  out.selected = Download<int32_t>(be, it.selected, hk);
  out.miss_slot = Download<int32_t>(be, it.miss_slot, hk);
  out.miss_chunk = Download<int32_t>(be, it.miss_chunk, hk);
  out.miss_count = Download<int32_t>(be, it.miss_count, size_t(h));
  return out;
}

// Double-precision stage-2 scores of the candidate chunks `cands` of head hh (SelectOptions
// in backend.h), in the log domain: for each query head n of the group, its softmax over
// every token of every candidate of the logits l_n(t) = q_n . bf16(k_t) / sqrt(d); a chunk's
// log m is max_n log max_{t in c} p_n(t) and its log w is max_n log sum_{t in c} p_n(t).
struct OracleScores {
  std::vector<int32_t> ids;
  std::vector<double> log_m, log_w;
  // log m of chunk id c (which must be a candidate).
  double LogM(int32_t c) const {
    return log_m[std::find(ids.begin(), ids.end(), c) - ids.begin()];
  }
};

// With `signatures` the dots are the ones the signatures stand for (SignatureDotOf).
inline OracleScores ScoreCandidates(const LowRankCase& c, int hh,
                                    const std::vector<int32_t>& cands, bool signatures = false) {
  const int g = c.shape.g, d = c.shape.d;
  const size_t n_cand = cands.size();
  // l[i][t][n]: logits of candidate i's tokens.
  std::vector<std::vector<std::vector<double>>> l(n_cand);
  std::vector<double> mx(g, -INFINITY);
  for (size_t i = 0; i < n_cand; ++i) {
    l[i].assign(c.C, std::vector<double>(g));
    for (int t = 0; t < c.C; ++t) {
      const int token = cands[i] * c.C + t;
      std::vector<double> k(d);
      if (!signatures) {
        const std::vector<float> kf = KeyOf(c, hh, token);
        for (int ch = 0; ch < d; ++ch) k[ch] = Bf16ToFloat(FloatToBf16(kf[ch]));
      }
      for (int n = 0; n < g; ++n) {
        double dot = 0;
        if (signatures) {
          dot = SignatureDotOf(c, hh, n, token);
        } else {
          for (int ch = 0; ch < d; ++ch) {
            dot += double(Bf16ToFloat(c.q[size_t(hh * g + n) * d + ch])) * k[ch];
          }
        }
        l[i][t][n] = dot / std::sqrt(double(d));
        mx[n] = std::max(mx[n], l[i][t][n]);
      }
    }
  }
  std::vector<double> lse(g, 0.0);
  for (int n = 0; n < g; ++n) {
    double z = 0;
    for (size_t i = 0; i < n_cand; ++i)
      for (int t = 0; t < c.C; ++t) z += std::exp(l[i][t][n] - mx[n]);
    lse[n] = mx[n] + std::log(z);
  }
  OracleScores o;
  o.ids = cands;
  for (size_t i = 0; i < n_cand; ++i) {
    double best = -INFINITY, mass = -INFINITY;
    for (int n = 0; n < g; ++n) {
      double cm = -INFINITY, z = 0;
      for (int t = 0; t < c.C; ++t) cm = std::max(cm, l[i][t][n]);
      for (int t = 0; t < c.C; ++t) z += std::exp(l[i][t][n] - cm);
      best = std::max(best, cm - lse[n]);
      mass = std::max(mass, cm + std::log(z) - lse[n]);
    }
    o.log_m.push_back(best);
    o.log_w.push_back(mass);
  }
  return o;
}

// The selectable chunks of head hh, ascending.
inline std::vector<int32_t> SelectableChunks(const LowRankCase& c, int hh) {
  std::vector<int32_t> out;
  for (int j = 0; j < c.n_chunks; ++j)
    if (!c.excluded[size_t(hh) * c.n_chunks + j]) out.push_back(j);
  return out;
}

// Stage 1's candidates per head on `be` for two-stage options `o` at width k: Select's top
// max(candidates, k), or every selectable chunk when that covers them all.
inline std::vector<std::vector<int32_t>> StageOneCandidates(Backend& be, const LowRankCase& c,
                                                            int k, const SelectOptions& o) {
  const int h = c.shape.h, k1 = std::max(o.candidates, k);
  std::vector<std::vector<int32_t>> out(h);
  if (k1 >= c.n_chunks) {
    for (int hh = 0; hh < h; ++hh) out[hh] = SelectableChunks(c, hh);
    return out;
  }
  const ExOut s1 = RunEx(be, c, k1, nullptr, std::vector<int32_t>(size_t(h) * k1, -1));
  for (int hh = 0; hh < h; ++hh) {
    for (int i = 0; i < k1; ++i) {
      if (s1.selected[size_t(hh) * k1 + i] >= 0) out[hh].push_back(s1.selected[size_t(hh) * k1 + i]);
    }
  }
  return out;
}

// The candidates' ids ranked by stage 2 (log m desc, id asc), with their log w.
inline std::vector<std::pair<int32_t, double>> RankCandidates(const LowRankCase& c, int hh,
                                                              const std::vector<int32_t>& cands,
                                                              bool signatures = false) {
  const OracleScores o = ScoreCandidates(c, hh, cands, signatures);
  std::vector<size_t> order(cands.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (o.log_m[a] != o.log_m[b]) return o.log_m[a] > o.log_m[b];
    return o.ids[a] < o.ids[b];
  });
  std::vector<std::pair<int32_t, double>> out;
  for (size_t i : order) out.push_back({o.ids[i], o.log_w[i]});
  return out;
}

// The oracle's top-k selectable chunks of head hh: two stages with every selectable chunk a
// candidate (score desc, id asc).
// `signatures`: of the keys the signatures stand for.
inline std::vector<int32_t> OracleTopK(const LowRankCase& c, int hh, int k,
                                       bool signatures = false) {
  std::vector<int32_t> out;
  for (const auto& [id, log_w] : RankCandidates(c, hh, SelectableChunks(c, hh), signatures)) {
    if (int(out.size()) == k) break;
    out.push_back(id);
  }
  return out;
}

}  // namespace kvshade::kernels::testing

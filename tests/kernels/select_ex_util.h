// Inputs for the SelectEx / AssignSlots tests (CPU and CUDA parity): a one-segment session
// layer in low-rank form whose landmarks are the chunk means of its reconstructed keys, so
// that two-stage selection has real keys to re-rank with, plus a runner that copies
// everything into a backend's memory.
#pragma once

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "kvshade/kernels/backend.h"
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

// Double-precision oracle score of chunk j of head hh: max over tokens and the group of
// q . bf16(k) / sqrt(d).
inline double OracleScore(const LowRankCase& c, int hh, int j) {
  const int g = c.shape.g, d = c.shape.d;
  double best = -INFINITY;
  for (int t = 0; t < c.C; ++t) {
    const std::vector<float> k = KeyOf(c, hh, j * c.C + t);
    for (int n = 0; n < g; ++n) {
      double dot = 0;
      for (int ch = 0; ch < d; ++ch) {
        dot += double(Bf16ToFloat(c.q[size_t(hh * g + n) * d + ch])) *
               double(Bf16ToFloat(FloatToBf16(k[ch])));
      }
      best = std::max(best, dot / std::sqrt(double(d)));
    }
  }
  return best;
}

// The oracle's top-k selectable chunks of head hh (score desc, id asc).
inline std::vector<int32_t> OracleTopK(const LowRankCase& c, int hh, int k) {
  std::vector<std::pair<double, int>> s;
  for (int j = 0; j < c.n_chunks; ++j) {
    if (c.excluded[size_t(hh) * c.n_chunks + j]) continue;
    s.push_back({-OracleScore(c, hh, j), j});
  }
  std::sort(s.begin(), s.end());
  std::vector<int32_t> out;
  for (int i = 0; i < k && i < int(s.size()); ++i) out.push_back(s[i].second);
  return out;
}

}  // namespace kvshade::kernels::testing

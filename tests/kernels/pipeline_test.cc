// End-to-end shadow pipeline on the CPU backend: CompressShadowLayer, then per decode step
// Select -> Reconstruct -> scatter misses into slot buffers -> Attend over
// [static set; slots; tail]. docs/ALGORITHM.md T1 (exactness, slot-order invariance), T7
// (needle), T8 (determinism); plus the static set, heavy chunks and argument checks of
// the composite.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/reference.h"
#include "kvshade/kernels/rope.h"
#include "kvshade/kernels/shadow_layer.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace pipeline_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::RandomBf16;
using testing::ToFloat;

// Post-RoPE keys in fp32 (no bf16 rounding): the exact keys of the reference attention.
std::vector<float> RopedKeys(const LayerShape& s, const RopeSpec& rope,
                             const std::vector<bf16>& k_pre, int n, int64_t first_position) {
  const RopeTable table = MakeRopeTable(rope, s.d).value();
  std::vector<float> kr = ToFloat(k_pre);
  for (int t = 0; t < n; ++t)
    for (int hh = 0; hh < s.h; ++hh)
      ApplyRopeReference(table, rope.pairing, first_position + t,
                         kr.data() + (size_t(t) * s.h + hh) * s.d, s.d);
  return kr;
}

std::vector<float> Exact(const LayerShape& s, const std::vector<bf16>& q,
                         const std::vector<float>& kr, const std::vector<bf16>& v, int n) {
  std::vector<float> out(size_t(s.query_heads()) * s.d);
  reference::ExactAttention(s, ToFloat(q).data(), kr.data(), ToFloat(v).data(), n,
                            1.0f / std::sqrt(float(s.d)), out.data());
  return out;
}

// Keys with a low-rank structure (rank `signal` over D) plus small noise, pre-RoPE.
std::vector<bf16> LowRankKeys(const LayerShape& s, int n, int signal, std::mt19937_64& rng) {
  const int D = s.D();
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> m(size_t(signal) * D);
  for (auto& x : m) x = nd(rng) / std::sqrt(float(signal));
  std::vector<bf16> k(size_t(n) * D);
  std::vector<float> z(signal);
  for (int t = 0; t < n; ++t) {
    for (auto& x : z) x = nd(rng);
    for (int c = 0; c < D; ++c) {
      float acc = 0.05f * nd(rng);
      for (int i = 0; i < signal; ++i) acc += z[i] * m[size_t(i) * D + c];
      k[size_t(t) * D + c] = FloatToBf16(acc);
    }
  }
  return k;
}

// Decode-side state of one attachment: slot table and slot buffers [h, k*C, d], driven
// through Select -> Reconstruct -> scatter -> Attend.
class SparseDecoder {
 public:
  SparseDecoder(Backend& be, const ShadowLayer& layer, const RopeSpec& rope, int k)
      : be_(be), layer_(layer), rope_(rope), k_(k) {
    const int h = layer.shape.h, C = layer.C, d = layer.shape.d;
    slots_.assign(size_t(h) * k, -1);
    selected_.assign(size_t(h) * k, 0);
    miss_slot_ = miss_chunk_ = selected_;
    miss_count_.assign(h, 0);
    slot_k_.assign(size_t(h) * k * C * d, bf16{});
    slot_v_ = slot_k_;
    rk_ = slot_k_;
    rv_ = slot_k_;
    out_.assign(size_t(layer.shape.query_heads()) * d, 0.0f);
  }

  // Pre-fills slot s of every head with chunk order[s] (buffers reconstructed directly).
  void Prefill(const std::vector<int32_t>& order_per_head) {
    const int h = layer_.shape.h;
    ASSERT_EQ(order_per_head.size(), size_t(h) * k_);
    std::vector<int32_t> counts(h, k_);
    Reconstruct(order_per_head, counts);
    for (int hh = 0; hh < h; ++hh)
      for (int j = 0; j < k_; ++j) Scatter(hh, j, j);
    slots_ = order_per_head;
  }

  void Step(const std::vector<bf16>& q) {
    SelectItem si;
    si.view = layer_.View();
    si.q = q.data();
    si.slots = slots_.data();
    si.selected = selected_.data();
    si.miss_slot = miss_slot_.data();
    si.miss_chunk = miss_chunk_.data();
    si.miss_count = miss_count_.data();
    std::vector<SelectItem> items = {si};
    auto ws = be_.Allocate(be_.SelectWorkspaceBytes(layer_.shape, k_, items)).value();
    ASSERT_TRUE(be_.Select(layer_.shape, k_, items, ws.workspace()).ok());
    Reconstruct(miss_chunk_, miss_count_);
    for (int hh = 0; hh < layer_.shape.h; ++hh)
      for (int j = 0; j < miss_count_[hh]; ++j) Scatter(hh, j, miss_slot_[size_t(hh) * k_ + j]);
    // Filled slots form a prefix when the table started empty (see SlotBlock).
    std::vector<int32_t> lens(layer_.shape.h);
    for (int hh = 0; hh < layer_.shape.h; ++hh) {
      int filled = 0;
      while (filled < k_ && slots_[size_t(hh) * k_ + filled] >= 0) ++filled;
      for (int s = filled; s < k_; ++s) ASSERT_EQ(slots_[size_t(hh) * k_ + s], -1);
      lens[hh] = filled * layer_.C;
    }
    const KvBlock slots = layer_.SlotBlock(slot_k_.data(), slot_v_.data(), k_, lens.data());
    std::vector<AttendItem> att = {layer_.MakeAttendItem(q.data(), slots, out_.data())};
    const float scale = 1.0f / std::sqrt(float(layer_.shape.d));
    auto aws = be_.Allocate(be_.AttendWorkspaceBytes(layer_.shape, att)).value();
    const absl::Status st = be_.Attend(layer_.shape, scale, att, aws.workspace());
    ASSERT_TRUE(st.ok()) << st;
  }

  const std::vector<float>& out() const { return out_; }
  const std::vector<int32_t>& selected() const { return selected_; }
  const std::vector<int32_t>& slots() const { return slots_; }
  const std::vector<int32_t>& miss_count() const { return miss_count_; }

 private:
  void Reconstruct(const std::vector<int32_t>& chunks, const std::vector<int32_t>& counts) {
    ReconstructItem ri;
    ri.view = layer_.View();
    ri.miss_chunk = chunks.data();
    ri.miss_count = counts.data();
    ri.keys = rk_.data();
    ri.values = rv_.data();
    std::vector<ReconstructItem> items = {ri};
    auto ws = be_.Allocate(be_.ReconstructWorkspaceBytes(layer_.shape, k_, items)).value();
    const absl::Status st =
        be_.Reconstruct(layer_.shape, layer_.C, k_, rope_, layer_.codec, items, ws.workspace());
    ASSERT_TRUE(st.ok()) << st;
  }
  void Scatter(int hh, int j, int slot) {
    const size_t cd = size_t(layer_.C) * layer_.shape.d;
    std::memcpy(&slot_k_[(size_t(hh) * k_ + slot) * cd], &rk_[(size_t(hh) * k_ + j) * cd], cd * 2);
    std::memcpy(&slot_v_[(size_t(hh) * k_ + slot) * cd], &rv_[(size_t(hh) * k_ + j) * cd], cd * 2);
  }

  Backend& be_;
  const ShadowLayer& layer_;
  RopeSpec rope_;
  int k_;
  std::vector<int32_t> slots_, selected_, miss_slot_, miss_chunk_, miss_count_;
  std::vector<bf16> slot_k_, slot_v_, rk_, rv_;
  std::vector<float> out_;
};

// ------------------------------------------------------------------------- T1
TEST(AlgorithmVectors, T1Exactness) {
  auto be = Cpu();
  auto rng = MakeRng(50);
  const LayerShape shape{2, 4, 64};
  const int n = 1061;  // 128 chunks + a 37-token tail
  const int64_t first = 5000;
  RopeSpec rope;
  rope.theta = 500000.0f;
  const auto k_pre = RandomBf16(size_t(n) * shape.D(), rng, 1.0f);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng, 1.0f);
  ShadowParams p;
  p.rank = shape.D();
  p.outliers = 0;
  p.keep_sink = false;
  p.codec = {ValueCodec::kBF16};
  auto layer = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ASSERT_EQ(layer->n_chunks, 128);
  ASSERT_EQ(layer->n_tail, 37);
  ASSERT_EQ(layer->static_capacity, 0);
  const int k = layer->n_chunks;
  const auto kr = RopedKeys(shape, rope, k_pre, n, first);

  SparseDecoder dec(*be, *layer, rope, k);
  std::vector<float> first_out;
  for (int step = 0; step < 2; ++step) {
    const auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng, 2.0f);
    dec.Step(q);
    const auto want = Exact(shape, q, kr, v, n);
    EXPECT_LT(testing::RelativeError(dec.out(), want), 1e-2) << "step " << step;
    if (step == 1) {
      // Every chunk is selected every step: the second step moves nothing.
      for (int c : dec.miss_count()) EXPECT_EQ(c, 0);
    }
    // Slot order invariance: a table holding the same chunks in a shuffled order.
    std::vector<int32_t> order(size_t(shape.h) * k);
    for (int hh = 0; hh < shape.h; ++hh) {
      std::iota(order.begin() + size_t(hh) * k, order.begin() + size_t(hh + 1) * k, 0);
      std::shuffle(order.begin() + size_t(hh) * k, order.begin() + size_t(hh + 1) * k, rng);
    }
    SparseDecoder shuffled(*be, *layer, rope, k);
    shuffled.Prefill(order);
    shuffled.Step(q);
    for (int c : shuffled.miss_count()) EXPECT_EQ(c, 0);
    EXPECT_EQ(shuffled.slots(), order);
    EXPECT_LT(testing::RelativeError(shuffled.out(), dec.out()), 1e-5);
  }
}

// ------------------------------------------------------------------------- T7
struct NeedleResult {
  bool selected_or_static = true;
  double margin_min = 0, margin_max = 0;  // needle logit - strongest distractor, over heads
  double rel_error = 0;  // against exact attention over the attended tokens
};

// Query norm and needle margin of the T7 cases. Keys are LowRankKeys (unit variance in any
// direction), so a query of norm 2.4 gives distractor logits q.k / sqrt(64) of standard
// deviation sigma = 0.3. Each needle's logit is kNeedleMargin above the strongest
// distractor of its head (a realistic margin, not a key many times the others' norm).
constexpr float kQueryNorm = 2.4f;
constexpr double kNeedleMargin = 3.0;

// Plants, for every KV head, a needle at `positions[hh]`: its post-RoPE key is alpha*u_hh,
// u_hh a random unit vector, and every query head of hh asks q = kQueryNorm*u_hh; alpha
// puts the needle's logit kNeedleMargin above the largest logit of any other token of that
// head. Returns whether each needle's chunk was selected (or static, or in the tail), the
// margins as planted (after bf16 rounding), and the error against exact attention over
// the tokens the step attended (static chunks, selected chunks, tail).
NeedleResult RunNeedle(Backend& be, const ShadowParams& p, const std::vector<int>& positions,
                       int n, int k, std::mt19937_64& rng, bool* was_selected) {
  const LayerShape shape{2, 2, 64};
  const int d = shape.d;
  const int64_t first = 123;
  RopeSpec rope;
  const RopeTable table = MakeRopeTable(rope, d).value();
  auto k_pre = LowRankKeys(shape, n, 16, rng);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng, 1.0f);
  std::normal_distribution<float> nd;
  std::vector<bf16> q(size_t(shape.query_heads()) * d);
  std::vector<std::vector<float>> us(shape.h, std::vector<float>(d));
  for (int hh = 0; hh < shape.h; ++hh) {
    std::vector<float>& u = us[hh];
    double norm = 0;
    for (auto& x : u) {
      x = nd(rng);
      norm += double(x) * x;
    }
    for (auto& x : u) x = float(x / std::sqrt(norm));
    for (int gi = 0; gi < shape.g; ++gi)
      for (int c = 0; c < d; ++c) q[(size_t(hh) * shape.g + gi) * d + c] = FloatToBf16(kQueryNorm * u[c]);
  }
  auto logit = [&](const std::vector<float>& kr, int t, int hh) {
    double dot = 0;  // every query head of hh asks the same q
    for (int c = 0; c < d; ++c)
      dot += double(Bf16ToFloat(q[size_t(hh) * shape.g * d + c])) * kr[(size_t(t) * shape.h + hh) * d + c];
    return dot / std::sqrt(double(d));
  };
  auto max_distractor = [&](const std::vector<float>& kr, int hh) {
    double mx = -1e300;
    for (int t = 0; t < n; ++t)
      if (t != positions[hh]) mx = std::max(mx, logit(kr, t, hh));
    return mx;
  };
  {
    const auto kr = RopedKeys(shape, rope, k_pre, n, first);
    for (int hh = 0; hh < shape.h; ++hh) {
      double qu = 0;
      for (int c = 0; c < d; ++c) qu += double(Bf16ToFloat(q[size_t(hh) * shape.g * d + c])) * us[hh][c];
      const double alpha = (max_distractor(kr, hh) + kNeedleMargin) * std::sqrt(double(d)) / qu;
      std::vector<float> key(d);
      for (int c = 0; c < d; ++c) key[c] = float(alpha * us[hh][c]);
      ApplyRopeReference(table, rope.pairing, -(first + positions[hh]), key.data(), d);
      for (int c = 0; c < d; ++c) k_pre[(size_t(positions[hh]) * shape.h + hh) * d + c] = FloatToBf16(key[c]);
    }
  }
  const auto kr = RopedKeys(shape, rope, k_pre, n, first);
  NeedleResult res;
  res.margin_min = 1e300;
  res.margin_max = -1e300;
  for (int hh = 0; hh < shape.h; ++hh) {
    const double m = logit(kr, positions[hh], hh) - max_distractor(kr, hh);
    res.margin_min = std::min(res.margin_min, m);
    res.margin_max = std::max(res.margin_max, m);
  }
  auto layer = CompressShadowLayer(be, shape, rope, p, k_pre, v, n, first);
  EXPECT_TRUE(layer.ok()) << layer.status();
  if (!layer.ok()) return {false, 0, 0, 1.0};
  SparseDecoder dec(be, *layer, rope, k);
  dec.Step(q);
  *was_selected = true;
  std::vector<std::vector<int>> attended(shape.h);  // tokens per KV head
  for (int hh = 0; hh < shape.h; ++hh) {
    const int32_t* row = layer->static_chunks.data() + size_t(hh) * layer->static_capacity;
    const auto* sel = &dec.selected()[size_t(hh) * k];
    for (int i = 0; i < layer->static_capacity; ++i)
      for (int t = 0; t < p.C; ++t) attended[hh].push_back(row[i] * p.C + t);
    for (int i = 0; i < k; ++i)
      for (int t = 0; t < p.C; ++t) attended[hh].push_back(sel[i] * p.C + t);
    for (int t = layer->n_chunks * p.C; t < n; ++t) attended[hh].push_back(t);
    const int chunk = positions[hh] / p.C;
    if (chunk >= layer->n_chunks) continue;  // in the exact tail
    const bool is_static = std::find(row, row + layer->static_capacity, chunk) !=
                           row + layer->static_capacity;
    const bool is_selected = std::find(sel, sel + k, chunk) != sel + k;
    EXPECT_FALSE(is_static && is_selected);
    if (!is_selected) *was_selected = false;
    res.selected_or_static &= is_selected || is_static;
  }
  // Exact attention (double) over exactly the attended tokens.
  std::vector<float> ref(size_t(shape.query_heads()) * d);
  for (int hq = 0; hq < shape.query_heads(); ++hq) {
    const int hh = hq / shape.g;
    std::vector<double> z;
    double mx = -1e300, sum = 0;
    for (int t : attended[hh]) {
      z.push_back(logit(kr, t, hh));
      mx = std::max(mx, z.back());
    }
    std::vector<double> o(d, 0.0);
    for (size_t i = 0; i < z.size(); ++i) {
      const double w = std::exp(z[i] - mx);
      sum += w;
      for (int c = 0; c < d; ++c) o[c] += w * Bf16ToFloat(v[(size_t(attended[hh][i]) * shape.h + hh) * d + c]);
    }
    for (int c = 0; c < d; ++c) ref[size_t(hq) * d + c] = float(o[c] / sum);
  }
  res.rel_error = testing::RelativeError(dec.out(), ref);
  return res;
}

// The planted margin is what the test means: bf16 rounding of the needle's key moves its
// logit (about 4) by at most 2^-8 relative, far inside 0.1.
void ExpectPlantedMargin(const NeedleResult& r) {
  EXPECT_NEAR(r.margin_min, kNeedleMargin, 0.1);
  EXPECT_NEAR(r.margin_max, kNeedleMargin, 0.1);
}

// Against exact attention over the attended tokens, the only errors are the slots'
// reconstructed keys: rank 48 keeps the 16 signal dimensions and 32 of the 112 dimensions of
// the 0.05 noise, so |dk| ~ 0.05 sqrt(80 / 2) ~ 0.32 per head, and a logit moves by
// delta ~ |q| |dk| / d ~ 0.012 (bf16 rounding adds far less). To first order
// out_c - o_c = sum_i p_i delta_i (v_ic - o_c): with the needle holding about a fifth of the
// mass (e^4.2 against ~300 tokens near e^0) the relative error is ~0.012 * 0.05 / 0.2 ~ 3e-3.
// 1e-2 leaves 3x; a wrong key, value or slot moves attention by O(1).
constexpr double kNeedleRelError = 1e-2;

TEST(AlgorithmVectors, T7NeedleIsSelected) {
  // Why a margin of 3 gets the needle's chunk selected (k = 32 of 508 chunks): a chunk's
  // score is its landmark's logit, the mean of its 8 tokens' logits. Distractors have
  // sigma = 0.3; the strongest of 4099 is about 3.5 sigma = 1.05, so the needle's chunk
  // scores (1.05 + 3) / 8 = 0.51 plus the mean of 7 distractors, sd 0.3 sqrt(7) / 8 = 0.1,
  // while the 32nd best of the other chunks (sd 0.3 / sqrt(8)) is near 1.53 sd = 0.16: 3.5 sd
  // below the needle's. With a margin of 0 (the needle one distractor among others) it is
  // not selected: the test fails then.
  auto be = Cpu();
  auto rng = MakeRng(51);
  const int n = 4099, C = 8;
  const int n_chunks = (n - 32) / C;
  ShadowParams p;
  p.rank = 48;
  p.outliers = 0;
  p.keep_sink = false;
  std::uniform_int_distribution<int> anywhere(0, n_chunks * C - 1);
  for (int trial = 0; trial < 3; ++trial) {
    const std::vector<int> positions = {anywhere(rng), anywhere(rng)};
    bool selected = false;
    const NeedleResult r = RunNeedle(*be, p, positions, n, 32, rng, &selected);
    ExpectPlantedMargin(r);
    EXPECT_TRUE(selected) << "needles at " << positions[0] << ", " << positions[1];
    EXPECT_LT(r.rel_error, kNeedleRelError) << "needles at " << positions[0] << ", " << positions[1];
    std::cout << "needles at " << positions[0] << ", " << positions[1] << ": rel error " << r.rel_error << "\n";
  }
}

TEST(AlgorithmVectors, T7NeedleWithStaticSetAndTail) {
  auto be = Cpu();
  auto rng = MakeRng(52);
  const int n = 4099;
  ShadowParams p;  // defaults: sink on, 48 outliers
  p.rank = 48;
  p.outliers = 16;
  // Needles in the sink chunk, anywhere, and at the newest token (always in the tail).
  std::uniform_int_distribution<int> anywhere(8, n - 40);
  std::uniform_int_distribution<int> in_sink(0, 7);
  const std::vector<std::vector<int>> cases = {
      {in_sink(rng), anywhere(rng)}, {anywhere(rng), n - 1}, {n - 1, n - 1}};
  for (const auto& positions : cases) {
    bool selected = false;
    const NeedleResult r = RunNeedle(*be, p, positions, n, 32, rng, &selected);
    ExpectPlantedMargin(r);
    EXPECT_TRUE(r.selected_or_static) << positions[0] << ", " << positions[1];
    EXPECT_LT(r.rel_error, kNeedleRelError) << positions[0] << ", " << positions[1];
    std::cout << "needles at " << positions[0] << ", " << positions[1] << ": rel error " << r.rel_error << "\n";
  }
}

// ------------------------------------------------------------------------- T8
TEST(AlgorithmVectors, T8Determinism) {
  auto be = Cpu();
  auto rng = MakeRng(53);
  const LayerShape shape{4, 2, 64};
  const int n = 2100;
  RopeSpec rope;
  const auto k_pre = LowRankKeys(shape, n, 24, rng);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng);
  std::vector<std::vector<bf16>> queries;
  for (int s = 0; s < 3; ++s) queries.push_back(RandomBf16(size_t(shape.query_heads()) * shape.d, rng));
  const auto qobs = RandomBf16(size_t(8) * shape.query_heads() * shape.d, rng);
  std::vector<int64_t> qpos(8);
  std::iota(qpos.begin(), qpos.end(), int64_t(n - 8));
  ShadowObservation obs{qobs, qpos, 8};
  ShadowParams p;
  p.rank = 64;
  p.outliers = 8;
  p.heavy_chunks = 4;
  p.codec = {ValueCodec::kINT4, 16};

  struct Run {
    std::vector<std::vector<int32_t>> selected, slots;
    std::vector<std::vector<float>> out;
  };
  auto run = [&]() {
    Run r;
    auto layer = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, 0, &obs);
    EXPECT_TRUE(layer.ok()) << layer.status();
    SparseDecoder dec(*be, *layer, rope, 24);
    for (const auto& q : queries) {
      dec.Step(q);
      r.selected.push_back(dec.selected());
      r.slots.push_back(dec.slots());
      r.out.push_back(dec.out());
    }
    return r;
  };
  const Run a = run(), b = run();
  for (size_t s = 0; s < queries.size(); ++s) {
    EXPECT_EQ(a.selected[s], b.selected[s]) << "step " << s;
    EXPECT_EQ(a.slots[s], b.slots[s]) << "step " << s;
    ASSERT_EQ(a.out[s].size(), b.out[s].size());
    EXPECT_EQ(std::memcmp(a.out[s].data(), b.out[s].data(), a.out[s].size() * sizeof(float)), 0)
        << "step " << s;
  }
}

// ------------------------------------------------------------------------- composite
// d = 64: the static set is gathered with CopyRows (rows of 128 bytes); d = 12: rows of 24
// bytes, which CopyRows does not take, are copied one by one. Both must give the same layout.
class ShadowLayerHeadDim : public ::testing::TestWithParam<int> {};
INSTANTIATE_TEST_SUITE_P(GatherPaths, ShadowLayerHeadDim, ::testing::Values(64, 12));

TEST_P(ShadowLayerHeadDim, StaticSetTailAndStoreLayout) {
  auto be = Cpu();
  auto rng = MakeRng(54);
  const LayerShape shape{3, 2, GetParam()};
  const int n = 700;
  const int64_t first = 40;
  RopeSpec rope;
  const auto k_pre = LowRankKeys(shape, n, 24, rng);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng);
  ShadowParams p;
  p.rank = std::min(64, shape.D() / 8 * 8);
  p.outliers = 5;
  p.local_min = 40;
  p.codec = {ValueCodec::kFP8};
  auto layer = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int C = 8, d = shape.d, D = shape.D();
  EXPECT_EQ(layer->n_chunks, (n - 40) / C);
  EXPECT_EQ(layer->n_tail, n - layer->n_chunks * C);
  EXPECT_GE(layer->n_tail, 40);
  EXPECT_EQ(layer->r, p.rank);
  EXPECT_EQ(layer->static_capacity, 6);

  // Post-RoPE keys as the backend computes them (bf16), for bitwise comparisons.
  std::vector<bf16> kr = k_pre;
  std::vector<int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), first);
  ASSERT_TRUE(be->ApplyRope(rope, pos, shape.h, d, absl::MakeSpan(kr), {}).ok());

  const auto* excluded = static_cast<const uint8_t*>(layer->excluded.data());
  const auto* sk = static_cast<const bf16*>(layer->static_k.data());
  const auto* sv = static_cast<const bf16*>(layer->static_v.data());
  const auto* lens = static_cast<const int32_t*>(layer->static_len.data());
  for (int hh = 0; hh < shape.h; ++hh) {
    EXPECT_EQ(lens[hh], 6 * C);
    const int32_t* row = &layer->static_chunks[size_t(hh) * 6];
    EXPECT_EQ(row[0], 0);  // the sink
    EXPECT_TRUE(std::is_sorted(row, row + 6));
    int n_excluded = 0;
    for (int c = 0; c < layer->n_chunks; ++c) n_excluded += excluded[size_t(hh) * layer->n_chunks + c];
    EXPECT_EQ(n_excluded, 6);
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(excluded[size_t(hh) * layer->n_chunks + row[i]], 1);
      for (int t = 0; t < C; ++t) {
        const size_t src = (size_t(row[i]) * C + t) * D + size_t(hh) * d;
        const size_t dst = (size_t(hh) * 6 * C + size_t(i) * C + t) * d;
        ASSERT_EQ(std::memcmp(sk + dst, &kr[src], d * 2), 0);
        ASSERT_EQ(std::memcmp(sv + dst, &v[src], d * 2), 0);
      }
    }
  }
  // The outliers are the chunks with the smallest min-cosine (sink excluded): recompute.
  std::vector<bf16> lm(size_t(layer->n_chunks) * shape.h * d);
  std::vector<float> min_cos(size_t(shape.h) * layer->n_chunks);
  ASSERT_TRUE(be->BuildLandmarks(kr, n, shape.h, d, C, layer->n_chunks, absl::MakeSpan(lm),
                                 absl::MakeSpan(min_cos), {}).ok());
  EXPECT_EQ(std::memcmp(lm.data(), layer->landmarks.data(), lm.size() * 2), 0);
  for (int hh = 0; hh < shape.h; ++hh) {
    float worst_outlier = -INFINITY, best_other = INFINITY;
    for (int c = 1; c < layer->n_chunks; ++c) {
      const float m = min_cos[size_t(hh) * layer->n_chunks + c];
      if (excluded[size_t(hh) * layer->n_chunks + c]) worst_outlier = std::max(worst_outlier, m);
      else best_other = std::min(best_other, m);
    }
    EXPECT_LE(worst_outlier, best_other) << "head " << hh;
  }
  // Tail: exact post-RoPE keys and values of the last n_tail tokens.
  const size_t tail_off = size_t(layer->n_chunks) * C * D;
  EXPECT_EQ(std::memcmp(layer->tail_k.data(), &kr[tail_off], size_t(layer->n_tail) * D * 2), 0);
  EXPECT_EQ(std::memcmp(layer->tail_v.data(), &v[tail_off], size_t(layer->n_tail) * D * 2), 0);
  // Value store: chunk j of head hh where the view says it is.
  const SegmentView seg = layer->Segment();
  std::vector<std::byte> enc(size_t(shape.h) * layer->n_chunks * layer->value_chunk_bytes);
  ASSERT_TRUE(be->EncodeValueChunks(v, n, shape.h, d, C, layer->n_chunks, p.codec,
                                    absl::MakeSpan(enc), {}).ok());
  for (int hh = 0; hh < shape.h; ++hh)
    for (int j = 0; j < layer->n_chunks; j += 17)
      ASSERT_EQ(std::memcmp(seg.values + hh * seg.value_head_stride + j * seg.value_chunk_stride,
                            &enc[(size_t(hh) * layer->n_chunks + j) * layer->value_chunk_bytes],
                            layer->value_chunk_bytes), 0);
  EXPECT_GT(layer->ResidentBytes(), 0u);
}

// Naive chunk mass (double) for heavy-chunk checks.
std::vector<double> NaiveChunkMass(const LayerShape& s, const std::vector<bf16>& qobs,
                                   const std::vector<int64_t>& qpos, const std::vector<float>& kr,
                                   int n, int64_t first, int C, int n_chunks) {
  std::vector<double> mass(size_t(s.h) * n_chunks, 0.0);
  const auto qf = ToFloat(qobs);
  for (size_t t = 0; t < qpos.size(); ++t) {
    for (int qh = 0; qh < s.query_heads(); ++qh) {
      const int hh = qh / s.g;
      std::vector<double> logit;
      for (int j = 0; j < n && first + j <= qpos[t]; ++j) {
        double dot = 0;
        for (int c = 0; c < s.d; ++c)
          dot += double(qf[(t * s.query_heads() + qh) * s.d + c]) * kr[(size_t(j) * s.h + hh) * s.d + c];
        logit.push_back(dot / std::sqrt(double(s.d)));
      }
      const double mx = *std::max_element(logit.begin(), logit.end());
      double sum = 0;
      for (double l : logit) sum += std::exp(l - mx);
      for (size_t j = 0; j < logit.size() && int(j) < n_chunks * C; ++j)
        mass[size_t(hh) * n_chunks + j / C] += std::exp(logit[j] - mx) / sum;
    }
  }
  return mass;
}

TEST(ShadowLayer, HeavyChunksAreInt2StaticAndNeverSelected) {
  auto be = Cpu();
  auto rng = MakeRng(55);
  const LayerShape shape{2, 2, 64};
  const int n = 640, w = 6, H = 5;
  const int64_t first = 0;
  RopeSpec rope;
  const auto k_pre = LowRankKeys(shape, n, 16, rng);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng);
  const auto qobs = RandomBf16(size_t(w) * shape.query_heads() * shape.d, rng, 3.0f);
  std::vector<int64_t> qpos(w);
  std::iota(qpos.begin(), qpos.end(), int64_t(n - 200));  // causal: later keys invisible
  ShadowObservation obs{qobs, qpos, w};
  ShadowParams p;
  p.rank = 64;
  p.outliers = 4;
  p.heavy_chunks = H;
  auto layer = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first, &obs);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const int C = 8, d = shape.d, nc = layer->n_chunks;
  ASSERT_EQ(layer->n_heavy, H);
  ASSERT_EQ(layer->static_capacity, 1 + 4 + H);
  // The observation mass is computed over the post-RoPE keys as the layer stores them
  // (bf16), so the reference rounds them the same way; what remains between the two is
  // fp32 against double accumulation (the 1e-4 below). Unrounded keys differ by up to half
  // a bf16 step (2^-9 relative), which these queries' large logits turn into a mass
  // difference of about 0.5% (seeds 9 and 16 of the seed sweep).
  const auto kr = ToFloat(testing::ToBf16(RopedKeys(shape, rope, k_pre, n, first)));
  const auto mass = NaiveChunkMass(shape, qobs, qpos, kr, n, first, C, nc);
  const auto* excluded = static_cast<const uint8_t*>(layer->excluded.data());
  const auto* sk = static_cast<const bf16*>(layer->static_k.data());
  const auto* sv = static_cast<const bf16*>(layer->static_v.data());
  const auto vf = ToFloat(v);
  for (int hh = 0; hh < shape.h; ++hh) {
    const int32_t* heavy = &layer->heavy_chunks[size_t(hh) * H];
    const int32_t* outl = &layer->outlier_chunks[size_t(hh) * 4];
    std::set<int> exact_set(outl, outl + 4);
    exact_set.insert(0);
    double weakest = INFINITY;
    for (int i = 0; i < H; ++i) {
      EXPECT_FALSE(exact_set.count(heavy[i])) << "heavy chunk is already static";
      EXPECT_EQ(excluded[size_t(hh) * nc + heavy[i]], 1);
      EXPECT_EQ(layer->static_chunks[size_t(hh) * layer->static_capacity + 5 + i], heavy[i]);
      weakest = std::min(weakest, mass[size_t(hh) * nc + heavy[i]]);
    }
    // Heavy = top chunk mass among the non-static chunks (tolerance for fp32 vs double).
    for (int c = 0; c < nc; ++c) {
      if (excluded[size_t(hh) * nc + c]) continue;
      EXPECT_LE(mass[size_t(hh) * nc + c], weakest * (1 + 1e-4) + 1e-7) << "chunk " << c;
    }
    // INT2 rows in the static set: close to the exact keys and values (2-bit accuracy).
    std::vector<float> got_k, want_k, got_v, want_v;
    for (int i = 0; i < H; ++i)
      for (int t = 0; t < C; ++t)
        for (int c = 0; c < d; ++c) {
          const size_t dst = (size_t(hh) * 10 * C + size_t(5 + i) * C + t) * d + c;
          const size_t src = ((size_t(heavy[i]) * C + t) * shape.h + hh) * d + c;
          got_k.push_back(Bf16ToFloat(sk[dst]));
          want_k.push_back(kr[src]);
          got_v.push_back(Bf16ToFloat(sv[dst]));
          want_v.push_back(vf[src]);
        }
    EXPECT_LT(testing::RelativeError(got_k, want_k), 0.45);
    EXPECT_LT(testing::RelativeError(got_v, want_v), 0.45);
    EXPECT_GT(testing::RelativeError(got_v, want_v), 0.0);  // really quantized
  }
  // Heavy chunks are never selected, even with k = all selectable chunks.
  const int k = nc - layer->static_capacity;
  SparseDecoder dec(*be, *layer, rope, k);
  dec.Step(RandomBf16(size_t(shape.query_heads()) * d, rng));
  for (int hh = 0; hh < shape.h; ++hh)
    for (int i = 0; i < k; ++i) {
      const int c = dec.selected()[size_t(hh) * k + i];
      ASSERT_GE(c, 0);
      EXPECT_EQ(excluded[size_t(hh) * nc + c], 0);
    }
  // Codes are kept in the KIVI layouts (per-channel keys, per-token values).
  EXPECT_EQ(layer->heavy_k_layout.axis, KiviAxis::kPerChannel);
  EXPECT_EQ(layer->heavy_v_layout.axis, KiviAxis::kPerToken);
  EXPECT_EQ(layer->heavy_rows_per_head % p.heavy_group, 0);
  EXPECT_EQ(layer->heavy_k_codes.bytes(), layer->heavy_k_layout.code_words() * 4);
}

// Key signatures at ingest: the layer's records are EncodeSignatures of its post-RoPE keys
// against its landmarks, and its view carries them.
// A 300-token layer of rank-16 keys (h 2, g 2, d 64) from `first` on, and rank 32 with 2
// outliers per head.
struct SmallLayer {
  LayerShape shape{2, 2, 64};
  int n = 300;
  int64_t first = 0;
  RopeSpec rope;
  std::vector<bf16> k_pre, v;
  ShadowParams p;
};

SmallLayer MakeSmallLayer(uint64_t seed, int64_t first) {
  auto rng = MakeRng(seed);
  SmallLayer c;
  c.first = first;
  c.k_pre = LowRankKeys(c.shape, c.n, 16, rng);
  c.v = RandomBf16(size_t(c.n) * c.shape.D(), rng);
  c.p.rank = 32;
  c.p.outliers = 2;
  return c;
}

TEST(ShadowLayer, KeySignaturesOfEveryChunkedToken) {
  auto be = Cpu();
  SmallLayer c = MakeSmallLayer(57, 11);
  const LayerShape shape = c.shape;
  const int n = c.n;
  const int64_t first = c.first;
  const RopeSpec rope = c.rope;
  const auto& k_pre = c.k_pre;
  const auto& v = c.v;
  ShadowParams p = c.p;
  p.signature_bits = 2;
  auto layer = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first);
  ASSERT_TRUE(layer.ok()) << layer.status();
  std::vector<bf16> kr = k_pre;
  std::vector<int64_t> pos(n);
  std::iota(pos.begin(), pos.end(), first);
  ASSERT_TRUE(be->ApplyRope(rope, pos, shape.h, shape.d, absl::MakeSpan(kr), {}).ok());
  const int nc = layer->n_chunks, C = 8;
  const size_t bytes = size_t(nc) * C * shape.h * SignatureRecordBytes(2, shape.d);
  std::vector<std::byte> want(bytes);
  ASSERT_TRUE(be->EncodeSignatures(
                    kr, absl::MakeConstSpan(static_cast<const bf16*>(layer->landmarks.data()),
                                            size_t(nc) * shape.D()),
                    shape.h, shape.d, C, nc, 2, absl::MakeSpan(want))
                  .ok());
  ASSERT_GE(layer->sig.bytes(), bytes);
  EXPECT_EQ(std::memcmp(layer->sig.data(), want.data(), bytes), 0);
  const SessionLayerView view = layer->View();
  EXPECT_EQ(view.sig_bits, 2);
  EXPECT_EQ(view.segments[0].sig, static_cast<const std::byte*>(layer->sig.data()));
  p.signature_bits = 3;
  EXPECT_EQ(CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first).status().code(),
            absl::StatusCode::kInvalidArgument);
  p.signature_bits = 0;
  auto plain = CompressShadowLayer(*be, shape, rope, p, k_pre, v, n, first);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->View().sig_bits, 0);
  EXPECT_EQ(plain->View().segments[0].sig, nullptr);
}

// factorize = false (a range the caller projects onto a basis it has): no factors, and
// everything else (landmarks, static set, tail, values) as with the factorization.
TEST(ShadowLayer, WithoutFactorizationTheRestIsTheSame) {
  auto be = Cpu();
  const SmallLayer c = MakeSmallLayer(58, 40);
  ShadowParams p = c.p;
  auto full = CompressShadowLayer(*be, c.shape, c.rope, p, c.k_pre, c.v, c.n, c.first);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->r, 32);
  p.factorize = false;
  auto bare = CompressShadowLayer(*be, c.shape, c.rope, p, c.k_pre, c.v, c.n, c.first);
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->r, 0);
  EXPECT_EQ(bare->a.data(), nullptr);
  EXPECT_EQ(bare->b.data(), nullptr);
  ASSERT_EQ(bare->n_chunks, full->n_chunks);
  ASSERT_EQ(bare->n_tail, full->n_tail);
  auto same = [](const Buffer& x, const Buffer& y) {
    return x.bytes() == y.bytes() && std::memcmp(x.data(), y.data(), x.bytes()) == 0;
  };
  EXPECT_TRUE(same(bare->landmarks, full->landmarks));
  EXPECT_TRUE(same(bare->values, full->values));
  EXPECT_TRUE(same(bare->static_k, full->static_k));
  EXPECT_TRUE(same(bare->static_v, full->static_v));
  EXPECT_EQ(bare->static_chunks, full->static_chunks);
}

TEST(ShadowLayer, BadArgumentsRejected) {
  auto be = Cpu();
  auto rng = MakeRng(56);
  const LayerShape shape{2, 2, 64};
  const int n = 200;
  RopeSpec rope;
  const auto k_pre = RandomBf16(size_t(n) * shape.D(), rng);
  const auto v = RandomBf16(size_t(n) * shape.D(), rng);
  ShadowParams p;
  p.rank = 64;
  p.outliers = 4;
  auto code = [&](const ShadowParams& pp, int nn = -1, absl::Span<const bf16> kk = {},
                  const ShadowObservation* obs = nullptr) {
    if (nn < 0) nn = n;
    if (kk.empty()) kk = k_pre;
    return CompressShadowLayer(*be, shape, rope, pp, kk, v, nn, 0, obs).status().code();
  };
  EXPECT_EQ(code(p), absl::StatusCode::kOk);
  ShadowParams bad = p;
  bad.rank = 60;  // not a multiple of 8
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = p;
  bad.C = 0;
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = p;
  bad.local_min = 195;  // n < local_min + C
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  bad = p;
  bad.codec = {ValueCodec::kINT2, 24};
  EXPECT_EQ(code(bad), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(p, n, absl::MakeConstSpan(k_pre).subspan(1)), absl::StatusCode::kInvalidArgument);
  // Heavy chunks: observation sizes and the INT2 group are checked.
  const auto qobs = RandomBf16(size_t(4) * shape.query_heads() * shape.d, rng);
  std::vector<int64_t> qpos = {196, 197, 198, 199};
  bad = p;
  bad.heavy_chunks = 2;
  ShadowObservation obs{qobs, qpos, 4};
  EXPECT_EQ(code(bad, n, {}, &obs), absl::StatusCode::kOk);
  ShadowObservation short_obs{qobs, absl::MakeConstSpan(qpos).subspan(1), 4};
  EXPECT_EQ(code(bad, n, {}, &short_obs), absl::StatusCode::kInvalidArgument);
  bad.heavy_group = 24;
  EXPECT_EQ(code(bad, n, {}, &obs), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pipeline_test
}  // namespace kvshade::kernels

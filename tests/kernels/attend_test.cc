// Attend: matches reference::ExactAttention (fp32 online softmax vs double), is invariant
// to block order and layout, honours len_per_head and GQA head mapping, and rejects bad
// arguments.
#include <algorithm>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/reference.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace attend_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::RandomBf16;
using testing::ToFloat;

std::vector<float> RunAttend(Backend& be, const LayerShape& shape, const std::vector<bf16>& q,
                             const std::vector<KvBlock>& blocks, float scale) {
  std::vector<float> out(size_t(shape.query_heads()) * shape.d, NAN);
  AttendItem item;
  item.q = q.data();
  item.n_blocks = int(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) item.blocks[i] = blocks[i];
  item.out = out.data();
  std::vector<AttendItem> items = {item};
  auto ws = be.Allocate(be.AttendWorkspaceBytes(shape, items)).value();
  const absl::Status st = be.Attend(shape, scale, items, ws.workspace());
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Block over tokens [t0, t1) of k, v [n, h, d].
KvBlock TokenMajorBlock(const LayerShape& s, const std::vector<bf16>& k,
                        const std::vector<bf16>& v, int t0, int t1) {
  KvBlock b;
  b.k = k.data() + size_t(t0) * s.h * s.d;
  b.v = v.data() + size_t(t0) * s.h * s.d;
  b.len = t1 - t0;
  b.head_stride = s.d;
  b.token_stride = int64_t(s.h) * s.d;
  return b;
}

// Copies tokens [t0, t1) of [n, h, d] into head-major [h, len, d] storage.
std::vector<bf16> HeadMajor(const LayerShape& s, const std::vector<bf16>& x, int t0, int t1) {
  const int len = t1 - t0;
  std::vector<bf16> out(size_t(s.h) * len * s.d);
  for (int hh = 0; hh < s.h; ++hh)
    for (int t = 0; t < len; ++t)
      for (int c = 0; c < s.d; ++c)
        out[(size_t(hh) * len + t) * s.d + c] = x[(size_t(t0 + t) * s.h + hh) * s.d + c];
  return out;
}

TEST(Attend, MatchesExactAttention) {
  auto be = Cpu();
  auto rng = MakeRng(40);
  for (const LayerShape shape : {LayerShape{2, 4, 64}, LayerShape{4, 1, 128}, LayerShape{8, 2, 96}}) {
    const int n = 1500;
    const auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng, 1.0f);
    const auto k = RandomBf16(size_t(n) * shape.h * shape.d, rng, 1.0f);
    const auto v = RandomBf16(size_t(n) * shape.h * shape.d, rng, 1.0f);
    const float scale = 1.0f / std::sqrt(float(shape.d));
    const auto got = RunAttend(*be, shape, q, {TokenMajorBlock(shape, k, v, 0, n)}, scale);
    std::vector<float> want(got.size());
    reference::ExactAttention(shape, ToFloat(q).data(), ToFloat(k).data(), ToFloat(v).data(), n,
                              scale, want.data());
    EXPECT_LT(testing::RelativeError(got, want), 1e-5) << shape.h << "x" << shape.g;
  }
}

TEST(Attend, PeakedScoresStayStable) {
  // Large logits (a key aligned with a scaled query) exercise the max subtraction.
  auto be = Cpu();
  auto rng = MakeRng(41);
  const LayerShape shape{2, 2, 64};
  const int n = 300;
  auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng, 4.0f);
  auto k = RandomBf16(size_t(n) * shape.h * shape.d, rng, 4.0f);
  const auto v = RandomBf16(size_t(n) * shape.h * shape.d, rng, 1.0f);
  for (int c = 0; c < shape.d; ++c) k[(size_t(200) * shape.h + 0) * shape.d + c] = q[c];
  const float scale = 1.0f / 8.0f;
  const auto got = RunAttend(*be, shape, q, {TokenMajorBlock(shape, k, v, 0, n)}, scale);
  std::vector<float> want(got.size());
  reference::ExactAttention(shape, ToFloat(q).data(), ToFloat(k).data(), ToFloat(v).data(), n,
                            scale, want.data());
  for (float x : got) ASSERT_TRUE(std::isfinite(x));
  EXPECT_LT(testing::RelativeError(got, want), 1e-5);
}

TEST(Attend, BlockOrderAndLayoutInvariance) {
  auto be = Cpu();
  auto rng = MakeRng(42);
  const LayerShape shape{3, 2, 64};
  const int n = 700;
  const auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng);
  const auto k = RandomBf16(size_t(n) * shape.h * shape.d, rng);
  const auto v = RandomBf16(size_t(n) * shape.h * shape.d, rng);
  const float scale = 0.125f;
  const auto whole = RunAttend(*be, shape, q, {TokenMajorBlock(shape, k, v, 0, n)}, scale);
  // Middle part stored head-major ([h, len, d]).
  const int a = 130, b = 451;
  const auto km = HeadMajor(shape, k, a, b), vm = HeadMajor(shape, v, a, b);
  KvBlock mid;
  mid.k = km.data();
  mid.v = vm.data();
  mid.len = b - a;
  mid.head_stride = int64_t(b - a) * shape.d;
  mid.token_stride = shape.d;
  const KvBlock first = TokenMajorBlock(shape, k, v, 0, a);
  const KvBlock last = TokenMajorBlock(shape, k, v, b, n);
  KvBlock empty;  // len 0: ignored
  const auto p1 = RunAttend(*be, shape, q, {first, mid, last}, scale);
  const auto p2 = RunAttend(*be, shape, q, {last, empty, first, mid}, scale);
  const auto p3 = RunAttend(*be, shape, q, {mid, last, first}, scale);
  EXPECT_LT(testing::RelativeError(p1, whole), 1e-5);
  EXPECT_LT(testing::RelativeError(p2, whole), 1e-5);
  EXPECT_LT(testing::RelativeError(p3, whole), 1e-5);
  // Same call twice: bit-identical.
  const auto p3b = RunAttend(*be, shape, q, {mid, last, first}, scale);
  EXPECT_EQ(p3, p3b);
}

TEST(Attend, LenPerHead) {
  auto be = Cpu();
  auto rng = MakeRng(43);
  const LayerShape shape{3, 2, 64};
  const int n = 200;
  const auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng);
  const auto k = RandomBf16(size_t(n) * shape.h * shape.d, rng);
  const auto v = RandomBf16(size_t(n) * shape.h * shape.d, rng);
  // A second block, attended in full by every head.
  const int n2 = 50;
  const auto k2 = RandomBf16(size_t(n2) * shape.h * shape.d, rng);
  const auto v2 = RandomBf16(size_t(n2) * shape.h * shape.d, rng);
  const std::vector<int32_t> lens = {200, 17, 0};
  KvBlock blk = TokenMajorBlock(shape, k, v, 0, n);
  blk.len_per_head = lens.data();
  const float scale = 0.125f;
  const auto got = RunAttend(*be, shape, q, {blk, TokenMajorBlock(shape, k2, v2, 0, n2)}, scale);
  for (int hh = 0; hh < shape.h; ++hh) {
    // Reference for this head alone: its first lens[hh] tokens of block 1, then block 2.
    const LayerShape one{1, shape.g, shape.d};
    std::vector<float> kk, vv;
    for (int t = 0; t < lens[hh]; ++t)
      for (int c = 0; c < shape.d; ++c) {
        kk.push_back(Bf16ToFloat(k[(size_t(t) * shape.h + hh) * shape.d + c]));
        vv.push_back(Bf16ToFloat(v[(size_t(t) * shape.h + hh) * shape.d + c]));
      }
    for (int t = 0; t < n2; ++t)
      for (int c = 0; c < shape.d; ++c) {
        kk.push_back(Bf16ToFloat(k2[(size_t(t) * shape.h + hh) * shape.d + c]));
        vv.push_back(Bf16ToFloat(v2[(size_t(t) * shape.h + hh) * shape.d + c]));
      }
    const auto qf = ToFloat(q);
    std::vector<float> want(size_t(shape.g) * shape.d);
    reference::ExactAttention(one, qf.data() + size_t(hh) * shape.g * shape.d, kk.data(),
                              vv.data(), lens[hh] + n2, scale, want.data());
    std::vector<float> mine(got.begin() + size_t(hh) * shape.g * shape.d,
                            got.begin() + size_t(hh + 1) * shape.g * shape.d);
    EXPECT_LT(testing::RelativeError(mine, want), 1e-5) << "head " << hh;
  }
}

TEST(Attend, NoTokensGivesZeros) {
  auto be = Cpu();
  const LayerShape shape{2, 2, 64};
  std::vector<bf16> q(size_t(shape.query_heads()) * shape.d, FloatToBf16(1.0f));
  KvBlock empty;
  const auto out = RunAttend(*be, shape, q, {empty}, 0.125f);
  for (float x : out) EXPECT_EQ(x, 0.0f);
}

TEST(Attend, BadArgumentsRejected) {
  auto be = Cpu();
  auto rng = MakeRng(44);
  const LayerShape shape{2, 2, 64};
  const auto q = RandomBf16(size_t(shape.query_heads()) * shape.d, rng);
  const auto k = RandomBf16(size_t(10) * shape.h * shape.d, rng);
  std::vector<float> out(size_t(shape.query_heads()) * shape.d);
  AttendItem item;
  item.q = q.data();
  item.out = out.data();
  item.n_blocks = 1;
  item.blocks[0] = TokenMajorBlock(shape, k, k, 0, 10);
  auto run = [&](const AttendItem& it, float scale = 0.125f, LayerShape s = {2, 2, 64}) {
    std::vector<AttendItem> items = {it};
    return be->Attend(s, scale, items, Workspace{}).code();
  };
  EXPECT_EQ(run(item), absl::StatusCode::kOk);
  EXPECT_EQ(run(item, 0.0f), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(item, -1.0f), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(item, NAN), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(item, INFINITY), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(item, 0.125f, LayerShape{2, 0, 64}), absl::StatusCode::kInvalidArgument);
  AttendItem bad = item;
  bad.n_blocks = 0;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad.n_blocks = kMaxKvBlocks + 1;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.out = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.q = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.blocks[0].v = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.blocks[0].len = -1;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = item;
  bad.blocks[0].token_stride = 8;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
}

TEST(Reference, ExactAttentionSmallCase) {
  // Two tokens, one head, d = 2: weights softmax([1, 0]) over v = [[1, 0], [0, 1]].
  const LayerShape shape{1, 1, 2};
  const float q[2] = {1, 0}, k[4] = {1, 0, 0, 0}, v[4] = {1, 0, 0, 1};
  float out[2];
  reference::ExactAttention(shape, q, k, v, 2, 1.0f, out);
  const double w = std::exp(1.0) / (std::exp(1.0) + 1.0);
  EXPECT_NEAR(out[0], w, 1e-7);
  EXPECT_NEAR(out[1], 1 - w, 1e-7);
}

}  // namespace
}  // namespace attend_test
}  // namespace kvshade::kernels

namespace kvshade::kernels {
namespace attend_test {
namespace {

// AttendItem.lse: log(sum_j exp(q.k_j * scale)) per query head against a double reference;
// -inf for a head with no tokens. With it, attention over two halves merges into attention
// over the whole (what a caller does with tokens the backend did not see).
TEST(Attend, LogSumExpMatchesReferenceAndMerges) {
  auto be = testing::Cpu();
  LayerShape shape{2, 3, 64};
  auto rng = testing::MakeRng(77);
  const int n = 300, hq = shape.query_heads(), d = shape.d;
  auto q = testing::RandomBf16(size_t(hq) * d, rng, 1.0f);
  auto k = testing::RandomBf16(size_t(n) * shape.h * d, rng, 1.0f);
  auto v = testing::RandomBf16(size_t(n) * shape.h * d, rng, 1.0f);
  const float scale = 1.0f / std::sqrt(float(d));
  auto run = [&](int t0, int t1, std::vector<float>* out, std::vector<float>* lse) {
    out->assign(size_t(hq) * d, NAN);
    lse->assign(hq, NAN);
    AttendItem item;
    item.q = q.data();
    item.n_blocks = 1;
    item.blocks[0] = TokenMajorBlock(shape, k, v, t0, t1);
    item.out = out->data();
    item.lse = lse->data();
    std::vector<AttendItem> items = {item};
    ASSERT_TRUE(be->Attend(shape, scale, items, Workspace{}).ok());
  };
  std::vector<float> o, l, o1, l1, o2, l2;
  run(0, n, &o, &l);
  for (int qh = 0; qh < hq; ++qh) {
    const int hh = qh / shape.g;
    double mx = -INFINITY;
    std::vector<double> s(n);
    for (int t = 0; t < n; ++t) {
      double dot = 0;
      for (int c = 0; c < d; ++c) {
        dot += double(Bf16ToFloat(q[size_t(qh) * d + c])) * Bf16ToFloat(k[(size_t(t) * shape.h + hh) * d + c]);
      }
      s[t] = dot * scale;
      mx = std::max(mx, s[t]);
    }
    double sum = 0;
    for (double x : s) sum += std::exp(x - mx);
    // fp32 scores of 64 products and an fp32 running sum: 1e-5 absolute on values ~ 6.
    EXPECT_NEAR(l[qh], mx + std::log(sum), 1e-5) << "head " << qh;
  }
  run(0, 120, &o1, &l1);
  run(120, n, &o2, &l2);
  for (int qh = 0; qh < hq; ++qh) {
    const double w1 = std::exp(double(l1[qh]) - l[qh]), w2 = std::exp(double(l2[qh]) - l[qh]);
    EXPECT_NEAR(w1 + w2, 1.0, 1e-5);
    for (int c = 0; c < d; ++c) {
      const size_t i = size_t(qh) * d + c;
      EXPECT_NEAR(w1 * o1[i] + w2 * o2[i], o[i], 1e-5) << "head " << qh << " channel " << c;
    }
  }
  std::vector<float> oe, le;
  run(5, 5, &oe, &le);
  for (float x : le) EXPECT_EQ(x, -INFINITY);
}

}  // namespace
}  // namespace attend_test
}  // namespace kvshade::kernels

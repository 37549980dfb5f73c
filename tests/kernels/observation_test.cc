// ObservationMass and ChunkSum (docs/ALGORITHM.md shadow step 6) on the CPU backend, against a
// naive double-precision loop: causal masking by absolute positions, GQA grouping (query
// head qh reads KV head qh / g), rows that see no key, and argument checks.
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace observation_test {
namespace {

using testing::Cpu;
using testing::MakeRng;

std::vector<double> NaiveMass(const std::vector<bf16>& q, const std::vector<int64_t>& qpos,
                              const std::vector<bf16>& k, const std::vector<int64_t>& kpos,
                              const LayerShape& s) {
  const int w = int(qpos.size()), n = int(kpos.size()), hg = s.query_heads();
  std::vector<double> mass(size_t(s.h) * n, 0.0);
  for (int t = 0; t < w; ++t) {
    for (int qh = 0; qh < hg; ++qh) {
      const int hh = qh / s.g;
      std::vector<double> logit(n, -INFINITY);
      double mx = -INFINITY;
      for (int j = 0; j < n; ++j) {
        if (kpos[j] > qpos[t]) continue;
        double dot = 0;
        for (int c = 0; c < s.d; ++c)
          dot += double(Bf16ToFloat(q[(size_t(t) * hg + qh) * s.d + c])) *
                 Bf16ToFloat(k[(size_t(j) * s.h + hh) * s.d + c]);
        logit[j] = dot / std::sqrt(double(s.d));
        mx = std::max(mx, logit[j]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (int j = 0; j < n; ++j) sum += std::exp(logit[j] - mx);
      for (int j = 0; j < n; ++j) mass[size_t(hh) * n + j] += std::exp(logit[j] - mx) / sum;
    }
  }
  return mass;
}

struct Case {
  LayerShape shape;
  std::vector<bf16> q, k;
  std::vector<int64_t> qpos, kpos;
};

std::vector<float> RunMass(const Case& c, absl::Status* status) {
  auto cpu = Cpu();
  const int w = int(c.qpos.size()), n = int(c.kpos.size());
  std::vector<float> mass(size_t(c.shape.h) * n, NAN);
  auto ws = cpu->Allocate(cpu->ObservationWorkspaceBytes(w, n, c.shape));
  EXPECT_TRUE(ws.ok());
  *status = cpu->ObservationMass(c.q, c.qpos, w, c.k, c.kpos, n, c.shape, absl::MakeSpan(mass),
                                 ws->workspace());
  return mass;
}

TEST(Observation, MatchesNaiveWithCausalMaskAndGqa) {
  auto rng = MakeRng(40);
  Case c;
  c.shape = LayerShape{2, 3, 64};
  const int w = 6, n = 300, first = 1000;
  c.k = testing::RandomBf16(size_t(n) * c.shape.h * c.shape.d, rng);
  c.q = testing::RandomBf16(size_t(w) * c.shape.query_heads() * c.shape.d, rng, 2.0f);
  for (int j = 0; j < n; ++j) c.kpos.push_back(first + j);
  // The last prompt rows, two rows in the middle, and a row before every key.
  c.qpos = {first + n - 1, first + n - 2, first + n - 3, first + 150, first + 10, first - 5};
  absl::Status st;
  std::vector<float> mass = RunMass(c, &st);
  ASSERT_TRUE(st.ok()) << st;
  std::vector<double> want = NaiveMass(c.q, c.qpos, c.k, c.kpos, c.shape);
  for (size_t i = 0; i < mass.size(); ++i) {
    ASSERT_NEAR(mass[i], want[i], 1e-5 + 1e-4 * want[i]) << "head " << i / n << " key " << i % n;
  }
  // Each KV head's mass totals g per row that sees at least one key (5 of the 6 rows).
  for (int hh = 0; hh < c.shape.h; ++hh) {
    double total = 0;
    for (int j = 0; j < n; ++j) total += mass[size_t(hh) * n + j];
    EXPECT_NEAR(total, 5.0 * c.shape.g, 1e-4);
  }
  // Keys after position first + n - 1 - ... : key n-1 is seen only by row 0.
  EXPECT_GT(mass[n - 1], 0.0f);
  // Keys beyond every row's position get nothing: row 5 sees none, others see <= first+n-1.
}

TEST(Observation, GroupUsesItsOwnKvHead) {
  // h = 2, g = 2: query heads 0,1 -> KV head 0; 2,3 -> KV head 1. Each query head points at
  // one key of its own KV head; the mass lands there.
  const LayerShape s{2, 2, 8};
  const int n = 4;
  Case c;
  c.shape = s;
  c.kpos = {0, 1, 2, 3};
  c.qpos = {3};
  std::vector<float> k(size_t(n) * s.h * s.d, 0.0f), q(size_t(s.query_heads()) * s.d, 0.0f);
  // KV head 0: key j has channel j set; KV head 1: key j has channel 4 + j set.
  for (int j = 0; j < n; ++j) {
    k[(size_t(j) * s.h + 0) * s.d + j] = 1.0f;
    k[(size_t(j) * s.h + 1) * s.d + 4 + j] = 1.0f;
  }
  q[0 * s.d + 2] = 40.0f;      // qh 0 -> key 2 of head 0
  q[1 * s.d + 2] = 40.0f;      // qh 1 -> key 2 of head 0
  q[2 * s.d + 4 + 1] = 40.0f;  // qh 2 -> key 1 of head 1
  q[3 * s.d + 4 + 3] = 40.0f;  // qh 3 -> key 3 of head 1
  c.k = testing::ToBf16(k);
  c.q = testing::ToBf16(q);
  absl::Status st;
  std::vector<float> mass = RunMass(c, &st);
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_NEAR(mass[0 * n + 2], 2.0f, 1e-4);
  EXPECT_NEAR(mass[1 * n + 1], 1.0f, 1e-4);
  EXPECT_NEAR(mass[1 * n + 3], 1.0f, 1e-4);
  std::vector<double> want = NaiveMass(c.q, c.qpos, c.k, c.kpos, s);
  for (size_t i = 0; i < mass.size(); ++i) EXPECT_NEAR(mass[i], want[i], 1e-6);
}

TEST(Observation, ChunkSumMatchesNaive) {
  auto rng = MakeRng(41);
  const int h = 3, n = 53, C = 8, n_chunks = 6;
  std::vector<float> mass = testing::RandomFloats(size_t(h) * n, rng);
  auto cpu = Cpu();
  std::vector<float> out(size_t(h) * n_chunks, NAN);
  ASSERT_TRUE(cpu->ChunkSum(mass, h, n, C, n_chunks, absl::MakeSpan(out)).ok());
  for (int hh = 0; hh < h; ++hh)
    for (int j = 0; j < n_chunks; ++j) {
      double s = 0;
      for (int c = 0; c < C; ++c) s += mass[size_t(hh) * n + j * C + c];
      EXPECT_NEAR(out[size_t(hh) * n_chunks + j], s, 1e-6);
    }
  EXPECT_EQ(cpu->ChunkSum(mass, h, n, C, 7, absl::MakeSpan(out.data(), size_t(h) * 7)).code(),
            absl::StatusCode::kInvalidArgument);  // 7*8 > 53
  EXPECT_EQ(cpu->ChunkSum(mass, h, n, C, n_chunks, absl::MakeSpan(out).subspan(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->ChunkSum(absl::MakeSpan(mass).subspan(1), h, n, C, n_chunks, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->ChunkSum(mass, h, n, 0, n_chunks, absl::MakeSpan(out)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Observation, BadArgumentsRejected) {
  const LayerShape s{2, 2, 16};
  const int w = 3, n = 20;
  std::vector<bf16> q(size_t(w) * s.query_heads() * s.d), k(size_t(n) * s.h * s.d);
  std::vector<int64_t> qp(w, 100), kp(n, 0);
  std::vector<float> mass(size_t(s.h) * n);
  auto cpu = Cpu();
  const size_t need = cpu->ObservationWorkspaceBytes(w, n, s);
  auto ws = cpu->Allocate(need);
  auto run = [&](absl::Span<const bf16> qq, absl::Span<const int64_t> qpp, int ww,
                 absl::Span<const bf16> kk, absl::Span<const int64_t> kpp, int nn,
                 const LayerShape& shape, absl::Span<float> m, size_t ws_bytes) {
    return cpu->ObservationMass(qq, qpp, ww, kk, kpp, nn, shape, m, Workspace{ws->data(), ws_bytes})
        .code();
  };
  auto Q = absl::MakeConstSpan(q);
  auto K = absl::MakeConstSpan(k);
  auto QP = absl::MakeConstSpan(qp);
  auto KP = absl::MakeConstSpan(kp);
  auto M = absl::MakeSpan(mass);
  EXPECT_EQ(run(Q, QP, w, K, KP, n, s, M, need), absl::StatusCode::kOk);
  EXPECT_EQ(run(Q.subspan(1), QP, w, K, KP, n, s, M, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP.subspan(1), w, K, KP, n, s, M, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, w, K.subspan(1), KP, n, s, M, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, w, K, KP.subspan(1), n, s, M, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, w, K, KP, n, s, M.subspan(1), need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, w, K, KP, n, s, M, need - 1), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, w, K, KP, n, LayerShape{2, 0, 16}, M, need),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Q, QP, 0, K, KP, n, s, M, need), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace observation_test
}  // namespace kvshade::kernels

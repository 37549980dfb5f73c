// TopK on the CPU backend: ties by lower column, masks, smallest-first, NaN ordering,
// rows with too few eligible columns, a randomized comparison with a stable sort, and
// argument checks.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace topk_test {
namespace {

using testing::Cpu;
using testing::MakeRng;

struct Result {
  absl::Status status;
  std::vector<int32_t> out;
};

Result RunTopK(const std::vector<float>& scores, const std::vector<uint8_t>& mask, int rows, int cols,
           int k, bool largest) {
  auto cpu = Cpu();
  Result r;
  r.out.assign(size_t(rows) * k, -7);
  auto ws = cpu->Allocate(cpu->TopKWorkspaceBytes(rows, cols, k));
  EXPECT_TRUE(ws.ok());
  r.status = cpu->TopK(scores, mask, rows, cols, k, largest, absl::MakeSpan(r.out), ws->workspace());
  return r;
}

TEST(TopK, TiesByLowerColumn) {
  Result r = RunTopK({3, 1, 3, 2, 3}, {}, 1, 5, 3, true);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, (std::vector<int32_t>{0, 2, 4}));
  r = RunTopK({3, 1, 3, 2, 3, 1}, {}, 1, 6, 3, false);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.out, (std::vector<int32_t>{1, 5, 3}));
  // +0 and -0 tie.
  r = RunTopK({-0.0f, 0.0f, -1.0f}, {}, 1, 3, 2, true);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.out, (std::vector<int32_t>{0, 1}));
}

TEST(TopK, MaskedColumnsNeverChosen) {
  // Two rows; the best columns are masked.
  std::vector<float> s = {9, 1, 8, 7, 0, /**/ 5, 6, 7, 8, 9};
  std::vector<uint8_t> m = {1, 0, 0, 1, 0, /**/ 0, 0, 0, 0, 2};
  Result r = RunTopK(s, m, 2, 5, 2, true);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.out, (std::vector<int32_t>{2, 1, 3, 2}));
  r = RunTopK(s, m, 2, 5, 3, false);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.out, (std::vector<int32_t>{4, 1, 2, 0, 1, 2}));
}

TEST(TopK, NanIsWorseThanAnyNumber) {
  const float inf = INFINITY;
  std::vector<float> s = {NAN, 1, NAN, -inf, inf};
  Result r = RunTopK(s, {}, 1, 5, 5, true);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.out, (std::vector<int32_t>{4, 1, 3, 0, 2}));
  r = RunTopK(s, {}, 1, 5, 5, false);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.out, (std::vector<int32_t>{3, 1, 4, 0, 2}));
}

TEST(TopK, TooFewEligibleColumns) {
  std::vector<float> s = {1, 2, 3, 4, 5, 6};
  std::vector<uint8_t> m = {0, 0, 0, 1, 1, 0};  // row 1 has one eligible column
  Result r = RunTopK(s, m, 2, 3, 2, true);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("row 1"), std::string_view::npos) << r.status;
  for (int32_t v : r.out) EXPECT_EQ(v, -7);  // nothing written
}

TEST(TopK, RandomAgainstStableSort) {
  auto rng = MakeRng(30);
  const int rows = 37, cols = 1000, k = 50;
  std::uniform_int_distribution<int> q(0, 40);  // many ties
  std::bernoulli_distribution masked(0.3), nan(0.02);
  std::vector<float> s(size_t(rows) * cols);
  std::vector<uint8_t> m(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    s[i] = nan(rng) ? NAN : q(rng) * 0.25f - 5;
    m[i] = masked(rng);
  }
  for (bool largest : {true, false}) {
    Result r = RunTopK(s, m, rows, cols, k, largest);
    ASSERT_TRUE(r.status.ok()) << r.status;
    for (int row = 0; row < rows; ++row) {
      std::vector<int32_t> idx;
      for (int c = 0; c < cols; ++c)
        if (!m[size_t(row) * cols + c]) idx.push_back(c);
      const float* sr = s.data() + size_t(row) * cols;
      auto key = [&](int32_t c) {
        // NaN last; otherwise by value in the requested direction.
        return std::isnan(sr[c]) ? INFINITY : (largest ? -sr[c] : sr[c]);
      };
      std::stable_sort(idx.begin(), idx.end(),
                       [&](int32_t a, int32_t b) {
                         const bool na = std::isnan(sr[a]), nb = std::isnan(sr[b]);
                         if (na != nb) return nb;
                         return key(a) < key(b);
                       });
      for (int i = 0; i < k; ++i) ASSERT_EQ(r.out[size_t(row) * k + i], idx[i]) << row << " " << i;
    }
  }
}

TEST(TopK, BadArgumentsRejected) {
  std::vector<float> s(12, 1.0f);
  auto code = [&](size_t ss, size_t ms, int rows, int cols, int k, size_t os, size_t ws_bytes) {
    auto cpu = Cpu();
    std::vector<uint8_t> m(ms);
    std::vector<int32_t> o(os);
    auto ws = cpu->Allocate(std::max<size_t>(ws_bytes, 1));
    return cpu->TopK(absl::MakeSpan(s.data(), ss), m, rows, cols, k, true, absl::MakeSpan(o),
                     Workspace{ws->data(), ws_bytes})
        .code();
  };
  auto cpu = Cpu();
  const size_t need = cpu->TopKWorkspaceBytes(3, 4, 2);
  EXPECT_EQ(code(12, 0, 3, 4, 2, 6, need), absl::StatusCode::kOk);
  EXPECT_EQ(code(12, 12, 3, 4, 2, 6, need), absl::StatusCode::kOk);
  EXPECT_EQ(code(12, 11, 3, 4, 2, 6, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(11, 0, 3, 4, 2, 6, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(12, 0, 3, 4, 2, 5, need), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(12, 0, 3, 4, 5, 15, need), absl::StatusCode::kInvalidArgument);  // k > cols
  EXPECT_EQ(code(12, 0, 3, 4, 0, 0, need), absl::StatusCode::kInvalidArgument);   // k = 0
  EXPECT_EQ(code(12, 0, 3, 4, 2, 6, need - 1), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace topk_test
}  // namespace kvshade::kernels

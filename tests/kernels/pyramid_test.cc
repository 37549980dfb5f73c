// MiniKV pyramid budgets: the T5 vector and argument checks.
#include <numeric>

#include "gtest/gtest.h"
#include "kvshade/kernels/pyramid.h"

namespace kvshade::kernels {
namespace pyramid_test {
namespace {

TEST(AlgorithmVectors, T5Pyramid) {
  auto b = PyramidBudgets(32, 0.25);
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_EQ(b->size(), 32u);
  EXPECT_NEAR((*b)[0], 0.464286, 1e-6);
  EXPECT_NEAR((*b)[15], 0.256912, 1e-6);
  EXPECT_NEAR((*b)[31], 0.035714, 1e-6);
  EXPECT_NEAR(std::accumulate(b->begin(), b->end(), 0.0) / 32, 0.25, 1e-12);
  for (int l = 1; l < 32; ++l) EXPECT_LT((*b)[l], (*b)[l - 1]);  // lower layers keep more
}

TEST(Pyramid, OtherDepthsAndOneLayer) {
  auto flat = PyramidBudgets(4, 0.3, 1.0);  // delta 1: 2x - x = x = x/1, flat
  ASSERT_TRUE(flat.ok());
  for (double v : *flat) EXPECT_NEAR(v, 0.3, 1e-12);
  auto one = PyramidBudgets(1, 0.4);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, std::vector<double>{0.4});
}

TEST(Pyramid, BadArgumentsRejected) {
  const auto bad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(PyramidBudgets(0, 0.25).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, 0.0).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, -0.1).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, 1.5).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, NAN).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, 0.25, 0.5).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, 0.25, NAN).status().code(), bad);
  EXPECT_EQ(PyramidBudgets(32, 0.9).status().code(), bad);  // layer 0 would get 1.67
}

}  // namespace
}  // namespace pyramid_test
}  // namespace kvshade::kernels

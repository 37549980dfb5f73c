// Shadow-profile memory footprint: the T6 vector and argument checks.
#include "gtest/gtest.h"
#include "kvshade/kernels/footprint.h"

namespace kvshade::kernels {
namespace footprint_test {
namespace {

TEST(AlgorithmVectors, T6Memory) {
  const LayerShape shape{8, 4, 128};
  auto shadow = ShadowGpuBytesPerToken(shape, 160, 8);
  auto full = FullKvBytesPerToken(shape);
  auto ratio = ShadowCompressionRatio(shape, 160, 8);
  ASSERT_TRUE(shadow.ok() && full.ok() && ratio.ok());
  EXPECT_EQ(*shadow, 576.0);  // 2*160 + 2*1024/8
  EXPECT_EQ(*full, 4096.0);   // 4*1024
  EXPECT_NEAR(*ratio, 4096.0 / 576.0, 1e-12);
  EXPECT_NEAR(*ratio, 7.1, 0.05);
}

TEST(Footprint, KeySignatures) {
  // Llama-3-8B: h = 8, d = 128: 8 * (128*bits/8 + 4) bytes per token and layer.
  const LayerShape shape{8, 4, 128};
  auto two = ShadowGpuBytesPerToken(shape, 160, 8, 2);
  auto four = ShadowGpuBytesPerToken(shape, 160, 8, 4);
  auto eight = ShadowGpuBytesPerToken(shape, 160, 8, 8);
  ASSERT_TRUE(two.ok() && four.ok() && eight.ok());
  EXPECT_EQ(*two, 576.0 + 288.0);
  EXPECT_EQ(*four, 576.0 + 544.0);
  EXPECT_EQ(*eight, 576.0 + 1056.0);
  auto ratio = ShadowCompressionRatio(shape, 160, 8, 2);
  ASSERT_TRUE(ratio.ok());
  EXPECT_NEAR(*ratio, 4096.0 / 864.0, 1e-12);
  for (int bad : {1, 3, 5, 16, -2}) {
    EXPECT_EQ(ShadowGpuBytesPerToken(shape, 160, 8, bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(Footprint, FractionalLandmarkShareAndBadArguments) {
  auto s = ShadowGpuBytesPerToken(LayerShape{1, 1, 12}, 8, 8);  // 16 + 24/8
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, 19.0);
  auto f = ShadowGpuBytesPerToken(LayerShape{1, 1, 10}, 8, 8);  // 16 + 20/8
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(*f, 18.5);
  const auto bad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(ShadowGpuBytesPerToken(LayerShape{8, 4, 128}, 0, 8).status().code(), bad);
  EXPECT_EQ(ShadowGpuBytesPerToken(LayerShape{8, 4, 128}, 160, 0).status().code(), bad);
  EXPECT_EQ(FullKvBytesPerToken(LayerShape{0, 4, 128}).status().code(), bad);
  EXPECT_EQ(ShadowCompressionRatio(LayerShape{8, 4, -1}, 160, 8).status().code(), bad);
}

}  // namespace
}  // namespace footprint_test
}  // namespace kvshade::kernels

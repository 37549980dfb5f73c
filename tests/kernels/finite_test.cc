// Backend::FirstNonFinite on the CPU backend and the bf16 scan it shares with the daemon's
// tensor checks (base/bf16.h): the first NaN or infinity anywhere in an array, blocks and
// tails included, against a plain element-by-element search.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/base/bf16.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace finite_test {
namespace {

using testing::Cpu;

size_t Plain(const std::vector<bf16>& x) {
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(Bf16ToFloat(x[i]))) return i;
  }
  return x.size();
}

TEST(FirstNonFinite, FindsTheFirstNanOrInfinityAnywhere) {
  auto cpu = Cpu();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
  for (size_t n : {size_t{0}, size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{4099}}) {
    std::vector<bf16> x(n);
    for (auto& v : x) v = FloatToBf16(normal(rng));
    // Large finite values (the largest bf16 below infinity) are finite.
    if (n > 3) x[n / 2] = bf16{0x7f7f};
    std::vector<size_t> plant = {n};  // none
    if (n > 0) plant.insert(plant.end(), {0, n - 1, n / 3, n / 2 + 1});
    for (size_t p : plant) {
      for (float s : specials) {
        std::vector<bf16> y = x;
        if (p < n) y[p] = FloatToBf16(s);
        if (p < n && p + 7 < n) y[p + 7] = FloatToBf16(s);  // a later one does not count
        const size_t want = Plain(y);
        ASSERT_EQ(want, p < n ? p : n);
        EXPECT_EQ(base::FirstNonFiniteBf16Bits(reinterpret_cast<const uint16_t*>(y.data()), n), want)
            << "n " << n << " at " << p;
        int64_t first = -1;
        ASSERT_TRUE(cpu->FirstNonFinite(y, absl::MakeSpan(&first, 1)).ok());
        EXPECT_EQ(first, static_cast<int64_t>(want)) << "n " << n << " at " << p;
      }
    }
  }
}

TEST(FirstNonFinite, RefusesAResultThatIsNotOneValue) {
  auto cpu = Cpu();
  std::vector<bf16> x(4);
  int64_t two[2];
  EXPECT_EQ(cpu->FirstNonFinite(x, absl::MakeSpan(two, 2)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cpu->FirstNonFinite(absl::Span<const bf16>(nullptr, 3), absl::MakeSpan(two, 1)).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace finite_test
}  // namespace kvshade::kernels

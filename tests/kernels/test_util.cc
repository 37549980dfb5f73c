#include "test_util.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace kvshade::kernels::testing {

uint64_t TestSeed() {
  static const uint64_t seed = []() -> uint64_t {
    if (const char* env = std::getenv("KVSHADE_TEST_SEED"); env != nullptr && *env != '\0') {
      return std::strtoull(env, nullptr, 10);
    }
    return kDefaultTestSeed;
  }();
  static std::once_flag logged;
  std::call_once(logged, [] {
    std::printf("kvshade test seed: KVSHADE_TEST_SEED=%llu\n", (unsigned long long)seed);
  });
  ::testing::Test::RecordProperty("kvshade_test_seed", std::to_string(seed));
  return seed;
}

std::mt19937_64 MakeRng(uint64_t stream) {
  std::seed_seq seq{TestSeed(), stream, uint64_t{0x6b767368616465}};
  return std::mt19937_64(seq);
}

std::vector<float> RandomFloats(size_t n, std::mt19937_64& rng, float scale) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> out(n);
  bool any_nonzero = false;
  for (auto& x : out) {
    x = dist(rng);
    any_nonzero |= x != 0.0f;
  }
  if (!any_nonzero && n > 0) out[0] = scale;
  return out;
}

std::vector<bf16> RandomBf16(size_t n, std::mt19937_64& rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<bf16> out(n);
  for (auto& x : out) x = FloatToBf16(dist(rng));
  if (n > 0) out[0] = FloatToBf16(stddev);  // never all zeros
  return out;
}

std::vector<float> ToFloat(const std::vector<bf16>& x) {
  std::vector<float> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = Bf16ToFloat(x[i]);
  return out;
}

std::vector<bf16> ToBf16(const std::vector<float>& x) {
  std::vector<bf16> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FloatToBf16(x[i]);
  return out;
}

std::unique_ptr<Backend> Cpu() {
  auto b = CreateBackend("cpu");
  EXPECT_TRUE(b.ok()) << b.status();
  return std::move(b).value();
}

bool GpuRequired() {
  const char* v = std::getenv("KVSHADE_REQUIRE_GPU");
  return v != nullptr && *v != 0 && std::strcmp(v, "0") != 0;
}

std::unique_ptr<Backend> CudaOrNull(std::string* why) {
  auto b = CreateBackend("cuda");
  if (!b.ok()) {
    const std::string reason = b.status().ToString();
    if (why != nullptr) *why = reason;
    if (GpuRequired()) ADD_FAILURE() << "KVSHADE_REQUIRE_GPU=1 but the CUDA backend did not start: " << reason;
    return nullptr;
  }
  return std::move(b).value();
}

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

double MaxAbsError(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

}  // namespace kvshade::kernels::testing

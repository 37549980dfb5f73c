// The CPU backend's cached cos/sin tables (kernels/cpu/cpu_rope.cc): calls large enough
// to build cache blocks, calls that reuse them (same and other positions, small calls),
// and calls alternating between frequency tables must all stay bit-identical to
// ApplyRopeReference followed by one bf16 rounding, as the uncached path is.
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/rope.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace rope_cache_test {
namespace {

using testing::Cpu;
using testing::Download;
using testing::MakeRng;
using testing::RandomBf16;
using testing::ToFloat;
using testing::Upload;

// ApplyRope of x [n, heads, d] at pos on the CPU backend against the reference; returns
// the number of mismatching elements.
size_t Mismatches(Backend& cpu, const RopeSpec& spec, const std::vector<int64_t>& pos, int heads,
                  int d, const std::vector<bf16>& x) {
  Buffer buf = Upload(cpu, x);
  absl::Status st = cpu.ApplyRope(spec, pos, heads, d, buf.span<bf16>().subspan(0, x.size()));
  EXPECT_TRUE(st.ok()) << st;
  const std::vector<bf16> y = Download<bf16>(cpu, buf.data(), x.size());
  auto t = MakeRopeTable(spec, d);
  EXPECT_TRUE(t.ok()) << t.status();
  std::vector<float> xf = ToFloat(x);
  for (size_t tok = 0; tok < pos.size(); ++tok) {
    for (int hh = 0; hh < heads; ++hh) {
      ApplyRopeReference(*t, spec.pairing, pos[tok], xf.data() + (tok * heads + hh) * d, d);
    }
  }
  size_t bad = 0;
  for (size_t i = 0; i < y.size(); ++i) bad += y[i].bits != FloatToBf16(xf[i]).bits;
  return bad;
}

std::vector<int64_t> Range(int64_t first, int64_t n) {
  std::vector<int64_t> p(n);
  for (int64_t i = 0; i < n; ++i) p[i] = first + i;
  return p;
}

TEST(RopeCache, CachedAndUncachedCallsMatchReference) {
  auto cpu = Cpu();
  auto rng = MakeRng(21);
  const int heads = 2, d = 64;
  RopeSpec llama3;
  llama3.theta = 500000.0f;
  llama3.scaling = RopeScaling::kLlama3;
  llama3.factor = 8.0f;
  RopeSpec yarn;
  yarn.scaling = RopeScaling::kYarn;
  yarn.factor = 4.0f;
  yarn.rotary_dim = 32;
  yarn.pairing = RopePairing::kInterleaved;
  for (const RopeSpec& spec : {llama3, yarn, llama3}) {  // the third call finds llama3 evicted
    // Builds blocks (>= 256 tokens, crossing block boundaries at 1024 and 2048).
    const std::vector<int64_t> big = Range(700, 1500);
    EXPECT_EQ(Mismatches(*cpu, spec, big, heads, d, RandomBf16(big.size() * heads * d, rng, 2.0f)), 0u);
    // The same positions again (all cached), a small call inside them (cached, builds
    // nothing), a small call outside (computed per token) and a big one partly cached.
    for (const std::vector<int64_t>& pos :
         {big, Range(1000, 40), Range(90000, 3), Range(2000, 600)}) {
      EXPECT_EQ(Mismatches(*cpu, spec, pos, heads, d, RandomBf16(pos.size() * heads * d, rng, 2.0f)), 0u)
          << "first position " << pos[0] << ", " << pos.size() << " tokens";
    }
  }
}

TEST(RopeCache, ScatteredAndHugePositionsMatchReference) {
  auto cpu = Cpu();
  auto rng = MakeRng(22);
  RopeSpec spec;
  // Scattered positions (computed per token), and a run past the cache's capacity.
  std::vector<int64_t> scattered = Range(0, 300);
  for (size_t i = 0; i < scattered.size(); i += 7) scattered[i] = 3000000 + int64_t(i) * 977;
  for (const std::vector<int64_t>& pos : {scattered, Range(5000000, 300)}) {
    EXPECT_EQ(Mismatches(*cpu, spec, pos, 2, 128, RandomBf16(pos.size() * 2 * 128, rng, 2.0f)), 0u);
  }
}

}  // namespace
}  // namespace rope_cache_test
}  // namespace kvshade::kernels

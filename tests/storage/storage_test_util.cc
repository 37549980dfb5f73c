#include "storage_test_util.h"

#include <cstdlib>
#include <filesystem>

#include "gtest/gtest.h"
#include "kernels/test_util.h"

namespace kvshade::storage::testing {

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "kvshade-storage-XXXXXX").string();
  char* made = mkdtemp(tmpl.data());
  EXPECT_NE(made, nullptr) << "mkdtemp(" << tmpl << ") failed";
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void FillBytes(uint64_t seed, absl::Span<std::byte> out) {
  uint64_t x = seed ^ 0x9E3779B97F4A7C15ull;
  size_t i = 0;
  while (i < out.size()) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    for (int b = 0; b < 8 && i < out.size(); ++b, ++i) out[i] = std::byte((z >> (8 * b)) & 0xff);
  }
  if (!out.empty()) out[0] |= std::byte{1};
}

std::vector<std::byte> Bytes(uint64_t seed, size_t n) {
  std::vector<std::byte> v(n);
  FillBytes(seed, absl::MakeSpan(v));
  return v;
}

SegmentId RandomId(std::mt19937_64& rng) { return SegmentId{rng(), rng()}; }

std::mt19937_64 Rng(uint64_t stream) { return kernels::testing::MakeRng(stream); }

}  // namespace kvshade::storage::testing

// Helpers shared by the storage tests: temporary directories under $TMPDIR (removed at
// the end), deterministic byte patterns, random ids, and a seeded RNG (the kernels tests'
// KVSHADE_TEST_SEED applies here too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "kvshade/storage/types.h"

namespace kvshade::storage::testing {

// A fresh directory "$TMPDIR/kvshade-storage-XXXXXX" (TMPDIR defaults to /tmp), removed
// recursively on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Fills `out` with a pattern determined by `seed` (splitmix64 words); never all zeros.
void FillBytes(uint64_t seed, absl::Span<std::byte> out);
std::vector<std::byte> Bytes(uint64_t seed, size_t n);
SegmentId RandomId(std::mt19937_64& rng);
std::mt19937_64 Rng(uint64_t stream);

}  // namespace kvshade::storage::testing

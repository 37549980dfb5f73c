// StagingPool over the CPU backend (AllocateStaging is plain host memory there; on CUDA it
// is page-locked, which is why the pool exists): reuse by size class, the cap on kept
// bytes, leases outliving the pool, and a two-thread stress that checks leases never share
// memory.
#include "kvshade/storage/staging_pool.h"

#include <atomic>
#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/test_util.h"

namespace kvshade::storage {
namespace staging_pool_test {
namespace {

constexpr size_t kMiB = size_t(1) << 20;

TEST(StagingPool, ReusesAGivenBackBufferOfTheSameSizeClass) {
  auto cpu = kernels::testing::Cpu();
  StagingPool pool(*cpu, 64 * kMiB);
  auto a = pool.Take(3 * kMiB);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->bytes(), 4 * kMiB);  // rounded up to the 2 MiB size class
  EXPECT_EQ(pool.leased_bytes(), 4 * kMiB);
  std::memset(a->get(), 7, a->bytes());  // writable, every byte
  std::byte* const first = a->get();
  a->reset();
  EXPECT_FALSE(*a);
  EXPECT_EQ(pool.kept_bytes(), 4 * kMiB);
  EXPECT_EQ(pool.leased_bytes(), 0u);
  auto b = pool.Take(4 * kMiB);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->get(), first);
  EXPECT_EQ(pool.kept_bytes(), 0u);
}

TEST(StagingPool, NeverHandsOutABufferTooSmallOrMoreThanTwiceTheSize) {
  auto cpu = kernels::testing::Cpu();
  StagingPool pool(*cpu, 256 * kMiB);
  std::byte* big_ptr = nullptr;
  {
    auto big = pool.Take(40 * kMiB);
    ASSERT_TRUE(big.ok());
    big_ptr = big->get();
  }
  EXPECT_EQ(pool.kept_bytes(), 40 * kMiB);
  auto small = pool.Take(2 * kMiB);  // 40 MiB is more than twice 2 MiB: a new buffer
  ASSERT_TRUE(small.ok());
  EXPECT_NE(small->get(), big_ptr);
  EXPECT_EQ(small->bytes(), 2 * kMiB);
  auto larger = pool.Take(41 * kMiB);  // the kept 40 MiB is too small
  ASSERT_TRUE(larger.ok());
  EXPECT_NE(larger->get(), big_ptr);
  EXPECT_GE(larger->bytes(), 41 * kMiB);
  auto close = pool.Take(30 * kMiB);  // 40 MiB is within twice 30 MiB: reused
  ASSERT_TRUE(close.ok());
  EXPECT_EQ(close->get(), big_ptr);
  EXPECT_EQ(close->bytes(), 40 * kMiB);
}

TEST(StagingPool, KeepsNoMoreThanItsCapAndTrimFreesTheRest) {
  auto cpu = kernels::testing::Cpu();
  StagingPool pool(*cpu, 6 * kMiB);
  {
    auto a = pool.Take(4 * kMiB);
    auto b = pool.Take(4 * kMiB);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(pool.leased_bytes(), 8 * kMiB);
  }
  EXPECT_EQ(pool.kept_bytes(), 4 * kMiB);  // the second one given back would pass 6 MiB
  EXPECT_EQ(pool.leased_bytes(), 0u);
  pool.Trim();
  EXPECT_EQ(pool.kept_bytes(), 0u);
  StagingPool none(*cpu, 0);  // keeps nothing: every lease frees its buffer
  { ASSERT_TRUE(none.Take(1).ok()); }
  EXPECT_EQ(none.kept_bytes(), 0u);
}

TEST(StagingPool, ALeaseMayOutliveThePool) {
  auto cpu = kernels::testing::Cpu();
  StagingPool::Lease kept;
  {
    StagingPool pool(*cpu, 64 * kMiB);
    auto a = pool.Take(kMiB);
    ASSERT_TRUE(a.ok());
    kept = *std::move(a);
    EXPECT_FALSE(*a);  // moved from: nothing to give back
  }
  std::memset(kept.get(), 1, kept.bytes());
  kept.reset();  // back to the pool's state, which the lease kept alive; then freed
  EXPECT_FALSE(kept);
}

TEST(StagingPool, ConcurrentLeasesNeverShareMemory) {
  auto cpu = kernels::testing::Cpu();
  StagingPool pool(*cpu, 16 * kMiB);
  std::atomic<int> bad{0};
  auto worker = [&](uint8_t tag) {
    for (int i = 0; i < 200; ++i) {
      auto l = pool.Take(size_t(1 + (i % 3)) * kMiB);
      if (!l.ok()) {
        ++bad;
        continue;
      }
      std::memset(l->get(), tag, l->bytes());
      std::this_thread::yield();
      for (size_t j = 0; j < l->bytes(); j += 4096) {
        if (static_cast<uint8_t>(l->get()[j]) != tag) {
          ++bad;
          break;
        }
      }
    }
  };
  std::thread t1(worker, 0x11), t2(worker, 0x22);
  t1.join();
  t2.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(pool.leased_bytes(), 0u);
  EXPECT_LE(pool.kept_bytes(), 16 * kMiB);
}

}  // namespace
}  // namespace staging_pool_test
}  // namespace kvshade::storage

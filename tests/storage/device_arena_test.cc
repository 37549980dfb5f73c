// DeviceArena over the CPU backend (the host-memory arena; the CUDA pool is the same class
// over device memory): sub-allocation, alignment, coalescing, accounting by kind,
// ResourceExhausted when full, and a two-thread stress that checks blocks never overlap.
#include "kvshade/storage/device_arena.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace {

TEST(DeviceArena, RejectsBadOptions) {
  auto cpu = kernels::testing::Cpu();
  EXPECT_EQ(DeviceArena::Create(*cpu, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceArena::Create(*cpu, 1 << 20, 100).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceArena::Create(*cpu, 100, 256).status().code(), absl::StatusCode::kInvalidArgument);
  auto arena = DeviceArena::Create(*cpu, 1 << 20);
  ASSERT_TRUE(arena.ok()) << arena.status();
  EXPECT_EQ((*arena)->Allocate(0, ArenaKind::kA).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DeviceArena, AllocatesAlignedAndAccountsByKind) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::Create(*cpu, 1 << 20, 256);
  ASSERT_TRUE(arena.ok()) << arena.status();
  DeviceArena& a = **arena;
  EXPECT_EQ(a.space(), kernels::MemorySpace::kHost);
  EXPECT_EQ(a.capacity(), size_t{1} << 20);

  auto b1 = a.Allocate(1000, ArenaKind::kA);
  auto b2 = a.Allocate(256, ArenaKind::kB);
  auto b3 = a.Allocate(1, ArenaKind::kSlots);
  ASSERT_TRUE(b1.ok() && b2.ok() && b3.ok());
  for (auto* b : {&*b1, &*b2, &*b3}) {
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 256, 0u);
    std::memset(b->data(), 0xAB, b->bytes());  // the memory is really ours
  }
  ArenaStats s = a.Stats();
  EXPECT_EQ(s.used, 1024u + 256u + 256u);
  EXPECT_EQ(s.used_by_kind[int(ArenaKind::kA)], 1024u);
  EXPECT_EQ(s.used_by_kind[int(ArenaKind::kB)], 256u);
  EXPECT_EQ(s.used_by_kind[int(ArenaKind::kSlots)], 256u);
  EXPECT_EQ(s.blocks_by_kind[int(ArenaKind::kA)], 1u);
  EXPECT_EQ(s.used_by_kind[int(ArenaKind::kLandmarks)], 0u);

  b2->Reset();
  s = a.Stats();
  EXPECT_EQ(s.used, 1024u + 256u);
  EXPECT_EQ(s.used_by_kind[int(ArenaKind::kB)], 0u);
  EXPECT_EQ(s.blocks_by_kind[int(ArenaKind::kB)], 0u);
  EXPECT_EQ(s.peak_used, 1024u + 512u);
}

TEST(DeviceArena, FullArenaIsResourceExhaustedAndFreeCoalesces) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::Create(*cpu, 64 * 1024, 1024);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  std::vector<ArenaBlock> blocks;
  for (int i = 0; i < 64; ++i) {
    auto b = a.Allocate(1024, ArenaKind::kStatic);
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    blocks.push_back(std::move(b).value());
  }
  auto full = a.Allocate(1, ArenaKind::kStatic);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("largest free range 0"), std::string::npos) << full.status();
  EXPECT_EQ(a.Stats().failed_allocations, 1u);

  // Free every other block: 32 KiB free but fragmented into 1 KiB holes.
  for (int i = 0; i < 64; i += 2) blocks[i].Reset();
  EXPECT_EQ(a.Stats().largest_free, 1024u);
  EXPECT_EQ(a.Allocate(2048, ArenaKind::kA).status().code(), absl::StatusCode::kResourceExhausted);
  // Free the rest: neighbours coalesce back into one range.
  for (int i = 1; i < 64; i += 2) blocks[i].Reset();
  ArenaStats s = a.Stats();
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(s.free_ranges, 1u);
  EXPECT_EQ(s.largest_free, 64u * 1024);
  EXPECT_TRUE(a.Allocate(64 * 1024, ArenaKind::kA).ok());
}

TEST(DeviceArena, BestFitPicksTheSmallestHole) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::Create(*cpu, 16 * 1024, 1024);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  auto b0 = a.Allocate(3 * 1024, ArenaKind::kOther);  // [0, 3K)
  auto b1 = a.Allocate(1024, ArenaKind::kOther);      // [3K, 4K)
  auto b2 = a.Allocate(1024, ArenaKind::kOther);      // [4K, 5K)
  auto b3 = a.Allocate(1024, ArenaKind::kOther);      // [5K, 6K)
  ASSERT_TRUE(b0.ok() && b1.ok() && b2.ok() && b3.ok());
  std::byte* hole_small = static_cast<std::byte*>(b2->data());
  b0->Reset();  // 3K hole at 0
  b2->Reset();  // 1K hole at 4K (and 10K free at the end)
  auto c = a.Allocate(1000, ArenaKind::kOther);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), hole_small);
}

TEST(DeviceArena, BlocksOutliveTheArenaObject) {
  auto cpu = kernels::testing::Cpu();
  ArenaBlock kept;
  {
    auto arena = DeviceArena::Create(*cpu, 4096, 64);
    ASSERT_TRUE(arena.ok());
    auto b = (*arena)->Allocate(100, ArenaKind::kA);
    ASSERT_TRUE(b.ok());
    kept = std::move(b).value();
  }
  std::memset(kept.data(), 1, kept.bytes());  // still valid (ASan would catch a use after free)
  kept.Reset();
}

// Two threads allocate and free random sizes; every live block carries its owner's
// pattern, checked before release, so any overlap between blocks is caught.
TEST(DeviceArena, ConcurrentAllocationsNeverOverlap) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::Create(*cpu, 4 << 20, 256);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  auto worker = [&](int tid) {
    auto rng = testing::Rng(100 + tid);
    std::vector<std::pair<ArenaBlock, uint8_t>> live;
    for (int op = 0; op < 4000; ++op) {
      if (live.empty() || rng() % 3 != 0) {
        const size_t bytes = 1 + rng() % 20000;
        auto b = a.Allocate(bytes, ArenaKind(rng() % kArenaKinds));
        if (!b.ok()) {
          EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
          continue;
        }
        const uint8_t tag = uint8_t(tid * 100 + op % 97 + 1);
        std::memset(b->data(), tag, b->bytes());
        live.emplace_back(std::move(b).value(), tag);
      } else {
        const size_t i = rng() % live.size();
        const auto& [blk, tag] = live[i];
        const auto* p = static_cast<const uint8_t*>(blk.data());
        for (size_t k = 0; k < blk.bytes(); k += 61) ASSERT_EQ(p[k], tag);
        ASSERT_EQ(p[blk.bytes() - 1], tag);
        live.erase(live.begin() + long(i));
      }
    }
  };
  std::thread t0(worker, 0), t1(worker, 1);
  t0.join();
  t1.join();
  ArenaStats s = a.Stats();
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(s.free_ranges, 1u);
  for (size_t v : s.used_by_kind) EXPECT_EQ(v, 0u);
}

}  // namespace
}  // namespace kvshade::storage

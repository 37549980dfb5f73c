// DeviceArena over the CPU backend (the host-memory arena; the CUDA pool is the same class
// over device memory): sub-allocation, alignment, coalescing, accounting by kind,
// ResourceExhausted when full, and a two-thread stress that checks blocks never overlap.
#include "kvshade/storage/device_arena.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace device_arena_test {
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

// On demand: nothing is held at first; steps of growth_bytes (or a larger request) are
// allocated as blocks need them, never past the budget; Trim returns the steps no block
// uses beyond the headroom asked for; blocks keep their bytes across other steps' release.
TEST(DeviceArenaOnDemand, GrowsInStepsUpToTheBudgetAndTrimsEmptySteps) {
  auto cpu = kernels::testing::Cpu();
  EXPECT_EQ(DeviceArena::CreateOnDemand(*cpu, 1 << 20, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceArena::CreateOnDemand(*cpu, 1 << 20, 1000).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceArena::CreateOnDemand(*cpu, 1 << 20, 2 << 20).status().code(), absl::StatusCode::kInvalidArgument);
  auto arena = DeviceArena::CreateOnDemand(*cpu, 64 * 1024, 16 * 1024, 256);
  ASSERT_TRUE(arena.ok()) << arena.status();
  DeviceArena& a = **arena;
  EXPECT_TRUE(a.on_demand());
  EXPECT_EQ(a.capacity(), 0u);
  EXPECT_EQ(a.Stats().budget, 64u * 1024);
  EXPECT_EQ(a.Stats().largest_free, 64u * 1024);  // a new step may take the whole budget

  auto b1 = a.Allocate(10 * 1024, ArenaKind::kA);  // step 1 (16 KiB)
  ASSERT_TRUE(b1.ok()) << b1.status();
  EXPECT_EQ(a.capacity(), 16u * 1024);
  auto b2 = a.Allocate(4 * 1024, ArenaKind::kB);   // fits step 1
  ASSERT_TRUE(b2.ok());
  EXPECT_EQ(a.Stats().pools, 1u);
  auto b3 = a.Allocate(20 * 1024, ArenaKind::kStatic);  // larger than a step: its own 20 KiB
  ASSERT_TRUE(b3.ok());
  EXPECT_EQ(a.capacity(), 36u * 1024);
  auto b4 = a.Allocate(16 * 1024, ArenaKind::kSlots);  // step 3
  ASSERT_TRUE(b4.ok());
  EXPECT_EQ(a.capacity(), 52u * 1024);
  EXPECT_EQ(a.Stats().pools, 3u);
  // 12 KiB of the budget are left: a 13 KiB block does not fit anywhere.
  auto over = a.Allocate(13 * 1024, ArenaKind::kOther);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("budget"), std::string::npos) << over.status();
  EXPECT_EQ(a.Stats().failed_allocations, 1u);
  auto last = a.Allocate(12 * 1024, ArenaKind::kOther);  // the rest of the budget
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(a.capacity(), 64u * 1024);
  std::memset(b1->data(), 0x11, b1->bytes());
  std::memset(b4->data(), 0x44, b4->bytes());

  // Nothing to trim while every step is in use.
  EXPECT_EQ(a.Trim(), 0u);
  b3->Reset();    // its step is now empty
  last->Reset();  // so is the last one
  ArenaStats s = a.Stats();
  EXPECT_EQ(s.used, (10u + 4u + 16u) * 1024);
  EXPECT_EQ(s.peak_used, 62u * 1024);
  // Keep 12 KiB of empty steps as headroom: the newest (the last, 12 KiB) stays.
  EXPECT_EQ(a.Trim(12 * 1024), 20u * 1024);
  EXPECT_EQ(a.capacity(), 44u * 1024);
  EXPECT_EQ(a.Trim(), 12u * 1024);
  EXPECT_EQ(a.capacity(), 32u * 1024);
  EXPECT_EQ(a.Stats().pools, 2u);
  // Live blocks kept their bytes.
  EXPECT_EQ(static_cast<unsigned char*>(b1->data())[b1->bytes() - 1], 0x11);
  EXPECT_EQ(static_cast<unsigned char*>(b4->data())[0], 0x44);
  // Freed room is used again, then new steps.
  auto again = a.Allocate(30 * 1024, ArenaKind::kA);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(a.capacity(), 62u * 1024);
  b1->Reset();
  b2->Reset();
  b4->Reset();
  again->Reset();
  EXPECT_EQ(a.Trim(), 62u * 1024);
  EXPECT_EQ(a.capacity(), 0u);
  EXPECT_EQ(a.Stats().used, 0u);
}

// A reserved arena (growth 0) holds its whole budget from the start and never trims.
TEST(DeviceArenaOnDemand, ReservedArenaHoldsTheBudgetAndTrimIsANoOp) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::Create(*cpu, 64 * 1024, 256);
  ASSERT_TRUE(arena.ok());
  EXPECT_FALSE((*arena)->on_demand());
  EXPECT_EQ((*arena)->capacity(), 64u * 1024);
  EXPECT_EQ((*arena)->Trim(), 0u);
  EXPECT_EQ((*arena)->Stats().budget, 64u * 1024);
  EXPECT_EQ((*arena)->Stats().pools, 1u);
}

// Threads allocating and freeing across steps while another trims: blocks never overlap
// and every byte written is read back.
TEST(DeviceArenaOnDemand, ConcurrentAllocateFreeAndTrim) {
  auto cpu = kernels::testing::Cpu();
  auto arena = DeviceArena::CreateOnDemand(*cpu, 4 << 20, 64 * 1024, 256);
  ASSERT_TRUE(arena.ok());
  DeviceArena& a = **arena;
  std::atomic<bool> stop{false};
  std::thread trimmer([&] {
    while (!stop) a.Trim(64 * 1024);
  });
  std::vector<std::thread> workers;
  std::atomic<int> errors{0};
  for (int t = 0; t < 2; ++t) {
    workers.emplace_back([&, t] {
      std::vector<std::pair<ArenaBlock, unsigned char>> held;
      for (int i = 0; i < 400; ++i) {
        const size_t bytes = 1024 + size_t((i * 7919 + t * 131) % 40000);
        auto b = a.Allocate(bytes, ArenaKind::kOther);
        if (!b.ok()) continue;  // the budget may be full for a moment
        const auto fill = static_cast<unsigned char>(t * 16 + i % 16);
        std::memset(b->data(), fill, b->bytes());
        held.emplace_back(std::move(*b), fill);
        if (held.size() > 20) {
          const ArenaBlock& old = held.front().first;
          const auto* p = static_cast<const unsigned char*>(old.data());
          for (size_t x = 0; x < old.bytes(); x += 97) errors += p[x] != held.front().second;
          held.erase(held.begin());
        }
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  trimmer.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(a.Stats().used, 0u);
  a.Trim();
  EXPECT_EQ(a.capacity(), 0u);
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
}  // namespace device_arena_test
}  // namespace kvshade::storage

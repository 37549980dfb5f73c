// FaultInjectingSpillTier: deterministic from its seed; with read and write failures
// injected under a host store that spills and pages in, operations return errors (never
// wrong bytes), and once faults stop every committed segment is intact on the store and
// on disk.
#include "kvshade/storage/fault_injection.h"

#include <cstring>
#include <map>
#include <set>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/storage/host_value_store.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace fault_injection_test {
namespace {

using kernels::ValueCodec;
using testing::Bytes;
using testing::TempDir;

std::vector<bool> FailurePattern(SpillTier& base, uint64_t seed) {
  FaultInjectingSpillTier f(base, FaultOptions{.read_failure_probability = 0.5, .seed = seed});
  std::vector<bool> failed;
  // The id is unknown: an uninjected call answers NotFound, an injected one Unavailable.
  for (int i = 0; i < 64; ++i) {
    failed.push_back(f.ReadMeta(SegmentId{1, 1}).status().code() == absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(f.injected_read_failures(), uint64_t(std::count(failed.begin(), failed.end(), true)));
  return failed;
}

TEST(FaultInjection, DeterministicFromTheSeed) {
  TempDir dir;
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db")});
  ASSERT_TRUE(tier.ok());
  const auto a = FailurePattern(**tier, 42), b = FailurePattern(**tier, 42), c = FailurePattern(**tier, 43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  const auto n = std::count(a.begin(), a.end(), true);
  EXPECT_GT(n, 10);
  EXPECT_LT(n, 54);
  // Probability 1 fails every call with Unavailable naming the injection; 0 never fails.
  FaultInjectingSpillTier always(**tier, FaultOptions{.read_failure_probability = 1,
                                                      .write_failure_probability = 1});
  absl::Status s = always.DeleteSegment(SegmentId{1, 1});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(s.message().find("injected"), std::string::npos);
  EXPECT_EQ(always.ListSegments().status().code(), absl::StatusCode::kUnavailable);
  always.SetOptions(FaultOptions{});
  EXPECT_TRUE(always.ListSegments().ok());
}

struct Seg {
  SegmentId id;
  SegmentValueLayout layout;
  std::vector<std::vector<std::byte>> dense;
  bool durable = false;
};

TEST(FaultInjection, ErrorsNeverCorruptCommittedData) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto base = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db"), .piece_bytes = 8192});
  ASSERT_TRUE(base.ok());
  auto rng = testing::Rng(5);
  FaultInjectingSpillTier faulty(**base, FaultOptions{.read_failure_probability = 0.3,
                                                      .write_failure_probability = 0.3,
                                                      .seed = rng()});
  const SegmentValueLayout layout =
      *SegmentValueLayout::Make(2, 2, 24, 8, 64, kernels::ValueCodecSpec{ValueCodec::kINT4, 16});
  HostValueStoreOptions o;
  o.budget_bytes = 3 * layout.total_bytes();
  o.slab_bytes = 64 * 1024;
  auto store = HostValueStore::Create(*cpu, o, &faulty);
  ASSERT_TRUE(store.ok());
  HostValueStore& s = **store;

  std::map<SegmentId, Seg> live;  // sealed segments the store must hold intact
  uint64_t next = 1;
  int errors = 0, checks = 0;
  auto verify = [&](const Seg& g, std::string_view where) {
    auto pin = s.Pin(g.id);
    if (!pin.ok()) {
      // Page-in failed: an error, never wrong bytes; the segment stays known and spilled.
      EXPECT_EQ(pin.status().code(), absl::StatusCode::kUnavailable) << where << pin.status();
      EXPECT_EQ(s.Usage(g.id)->state, SegmentState::kSpilled);
      ++errors;
      return;
    }
    ++checks;
    for (int l = 0; l < g.layout.n_layers; ++l) {
      for (int hh = 0; hh < g.layout.h; ++hh) {
        for (int j = 0; j < g.layout.n_chunks; ++j) {
          ASSERT_EQ(std::memcmp(pin->layer(l).chunk(hh, j),
                                g.dense[l].data() + (size_t(hh) * g.layout.n_chunks + j) * g.layout.chunk_bytes,
                                g.layout.chunk_bytes), 0) << where;
        }
      }
    }
  };
  for (int op = 0; op < 300; ++op) {
    const int kind = int(rng() % 10);
    if (kind < 4 || live.size() < 2) {
      Seg g;
      g.id = SegmentId{next, next * 3};
      ++next;
      g.layout = layout;
      g.durable = rng() % 3 == 0;
      for (int l = 0; l < 2; ++l) g.dense.push_back(Bytes(g.id.lo + l, layout.dense_layer_bytes()));
      absl::Status st = s.Create(g.id, layout);
      if (!st.ok()) {
        // Room could only be made by a spill write, which failed.
        EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
        EXPECT_EQ(s.Usage(g.id).status().code(), absl::StatusCode::kNotFound);
        ++errors;
        continue;
      }
      for (int l = 0; l < 2; ++l) ASSERT_TRUE(s.WriteLayer(g.id, l, g.dense[l]).ok());
      SealOptions seal;
      seal.durable = g.durable;
      seal.user_metadata = "fault test";
      st = s.Seal(g.id, seal);
      while (!st.ok()) {
        // A failed durable write-through leaves the segment building; retry.
        EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
        EXPECT_EQ(s.Usage(g.id)->state, SegmentState::kBuilding);
        ++errors;
        st = s.Seal(g.id, seal);
      }
      live.emplace(g.id, std::move(g));
    } else if (kind < 8) {
      auto it = live.begin();
      std::advance(it, long(rng() % live.size()));
      verify(it->second, "pin");
    } else if (kind == 8) {
      auto it = live.begin();
      std::advance(it, long(rng() % live.size()));
      const SegmentId id = it->first;
      absl::Status st = s.Erase(id);
      // Memory is released first; only the tier delete can fail (Unavailable).
      EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kUnavailable) << st;
      EXPECT_EQ(s.Usage(id).status().code(), absl::StatusCode::kNotFound);
      if (!st.ok()) ++errors;
      live.erase(it);
    } else {
      auto it = live.begin();
      std::advance(it, long(rng() % live.size()));
      absl::Status st = s.Spill(it->first);
      if (!st.ok()) {
        EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
        EXPECT_EQ(s.Usage(it->first)->state, SegmentState::kResident);
        ++errors;
      }
    }
  }
  EXPECT_GT(errors, 10);
  EXPECT_GT(checks, 10);
  EXPECT_GT(faulty.injected_read_failures(), 0u);
  EXPECT_GT(faulty.injected_write_failures(), 0u);

  // Faults off: everything committed is intact, in the store and on disk.
  faulty.SetOptions(FaultOptions{});
  for (const auto& [id, g] : live) {
    verify(g, "after faults");
    if (g.durable) {
      absl::Status v = VerifySegment(**base, id);
      EXPECT_TRUE(v.ok()) << v;
    }
  }
  auto report = (*base)->CheckConsistency();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->bad_records, 0u);
  EXPECT_EQ(report->incomplete_segments, 0u);
  EXPECT_EQ(report->orphan_pieces, 0u);
  // Every durable segment still live is listed (erased ones whose delete failed may
  // linger on disk; they are harmless and verify too).
  std::set<SegmentId> listed;
  auto all = (*base)->ListSegments();
  ASSERT_TRUE(all.ok());
  for (const SegmentMeta& m : *all) {
    listed.insert(m.id);
    absl::Status v = VerifySegment(**base, m.id);
    EXPECT_TRUE(v.ok()) << v;
  }
  for (const auto& [id, g] : live) if (g.durable) EXPECT_TRUE(listed.contains(id));
}

}  // namespace
}  // namespace fault_injection_test
}  // namespace kvshade::storage

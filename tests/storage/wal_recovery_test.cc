// WAL recovery (storage/README.md "WAL recovery"). A crash image is a copy of the database
// directory taken while the tier is open: every acknowledged durable write is fsynced by
// then, so the copy is what a kill -9 leaves. Damaging the copy's WAL must never lose an
// acknowledged durable segment (they are flushed into table files before they are
// acknowledged), and whatever the WAL reader drops is reported, never silent; a segment is
// either intact or absent, never wrong.
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/storage/spill_tier.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace wal_recovery_test {
namespace {

using kernels::ValueCodec;
using testing::Bytes;
using testing::TempDir;
namespace fs = std::filesystem;

struct Seg {
  SegmentId id;
  SegmentValueLayout layout;
  std::vector<std::vector<std::byte>> values;

  SegmentWrite Write() const {
    SegmentWrite w;
    w.id = id;
    w.layout = layout;
    w.durability = Durability::kDurable;
    for (const auto& v : values) w.values.push_back(v);
    w.user_metadata = "session record";
    return w;
  }
};

Seg MakeSeg(uint64_t seed) {
  Seg s;
  s.id = SegmentId{seed * 13 + 5, seed};
  s.layout = *SegmentValueLayout::Make(2, 2, 16, 8, 64, {ValueCodec::kBF16, 16});
  for (int l = 0; l < 2; ++l) s.values.push_back(Bytes(seed * 10 + l, s.layout.layer_bytes()));
  return s;
}

// OK when intact, NotFound when absent; anything else (wrong bytes included) fails.
absl::Status Check(SpillTier& tier, const Seg& s) {
  auto meta = tier.ReadMeta(s.id);
  if (!meta.ok()) return meta.status();
  for (int l = 0; l < 2; ++l) {
    std::vector<std::byte> got(s.layout.layer_bytes());
    if (absl::Status st = tier.ReadValues(s.id, l, absl::MakeSpan(got)); !st.ok()) return st;
    if (got != s.values[l]) return absl::InternalError("wrong bytes");
  }
  return absl::OkStatus();
}

// A crash image of a live database: what a kill -9 would leave on disk. A plain copy of the
// directory is not always one: a background flush or compaction that writes a table file
// and records it in the MANIFEST while the copy runs can leave the copied MANIFEST naming a
// file the copy lacks, which no crash produces (a file is on disk before the MANIFEST names
// it). So the copy is taken again until the directory (names and sizes) did not change
// while it was copied.
std::map<std::string, uintmax_t> Listing(const std::string& dir) {
  std::map<std::string, uintmax_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code size_ec;
    const uintmax_t size = fs::file_size(e.path(), size_ec);
    out[e.path().filename().string()] = size_ec ? uintmax_t(-1) : size;
  }
  return out;
}

void CopyDir(const std::string& from, const std::string& to) {
  for (int attempt = 0; attempt < 200; ++attempt) {
    fs::remove_all(to);
    fs::create_directories(to);
    const auto before = Listing(from);
    bool copied = true;
    for (const auto& [name, size] : before) {
      std::error_code ec;
      fs::copy_file(fs::path(from) / name, fs::path(to) / name, ec);
      copied = copied && !ec;
    }
    if (copied && Listing(from) == before) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  FAIL() << from << " kept changing: no consistent copy in 200 attempts";
}

std::vector<fs::path> WalFiles(const std::string& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".log") out.push_back(e.path());
  }
  return out;
}

void FlipByte(const fs::path& file, uint64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f.good());
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.get(c);
  f.seekp(std::streamoff(offset));
  f.put(char(c ^ 0x20));
}

struct Events {
  std::mutex mu;
  std::vector<SpillEvent> all;
  SpillEventSink Sink() {
    return [this](const SpillEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      all.push_back(e);
    };
  }
  std::vector<SpillEvent> Of(SpillEvent::Kind kind) {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<SpillEvent> out;
    for (const auto& e : all) {
      if (e.kind == kind) out.push_back(e);
    }
    return out;
  }
};

// The defect as reported: four durable writes, a crash, one flipped byte in the largest
// WAL, and three of the four were gone without a word. Now no acknowledged durable record
// lives in the WAL alone: even losing every WAL file loses nothing.
TEST(SpillTierWal, DamagedOrLostWalsLoseNoAcknowledgedDurableSegment) {
  TempDir dir;
  const std::vector<Seg> segs = {MakeSeg(1), MakeSeg(2), MakeSeg(3), MakeSeg(4)};
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = dir.Sub("db"), .piece_bytes = 4096});
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (const Seg& s : segs) ASSERT_TRUE((*tier)->WriteSegment(s.Write()).ok());
  CopyDir(dir.Sub("db"), dir.Sub("flipped"));
  CopyDir(dir.Sub("db"), dir.Sub("no-wal"));
  tier->reset();

  // One flipped byte in the largest WAL (when there is anything in it), at several places.
  std::vector<fs::path> wals = WalFiles(dir.Sub("flipped"));
  ASSERT_FALSE(wals.empty());
  std::sort(wals.begin(), wals.end(), [](const fs::path& a, const fs::path& b) {
    return fs::file_size(a) > fs::file_size(b);
  });
  const uint64_t size = fs::file_size(wals[0]);
  for (uint64_t at : {uint64_t{7}, size / 3, size / 2, size - 1}) {
    if (at < size) FlipByte(wals[0], at);
  }
  // Every WAL gone.
  for (const fs::path& w : WalFiles(dir.Sub("no-wal"))) fs::resize_file(w, 0);

  for (const char* copy : {"flipped", "no-wal"}) {
    SCOPED_TRACE(copy);
    Events events;
    auto reopened = RocksSpillTier::Open(
        RocksSpillOptions{.path = dir.Sub(copy), .piece_bytes = 4096, .event_sink = events.Sink()});
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    for (const Seg& s : segs) {
      absl::Status st = Check(**reopened, s);
      EXPECT_TRUE(st.ok()) << st;
    }
    auto list = (*reopened)->ListSegments();
    ASSERT_TRUE(list.ok());
    EXPECT_EQ(list->size(), segs.size());
    EXPECT_EQ((*reopened)->Stats().wal_damage_at_open, events.Of(SpillEvent::Kind::kWalDamaged).size());
  }
}

// With the WAL holding acknowledged records (flush_durable_writes off: the old behaviour),
// a flipped byte loses the records from the damage on: every segment is intact or absent,
// and the loss is reported at error level, naming the WAL file.
TEST(SpillTierWal, DroppedWalRecordsAreReportedAndNeverServedWrong) {
  TempDir dir;
  std::vector<Seg> segs;
  for (uint64_t i = 1; i <= 4; ++i) segs.push_back(MakeSeg(i));
  RocksSpillOptions o{.path = dir.Sub("db"), .piece_bytes = 4096};
  o.flush_durable_writes = false;
  auto tier = RocksSpillTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (const Seg& s : segs) ASSERT_TRUE((*tier)->WriteSegment(s.Write()).ok());
  CopyDir(dir.Sub("db"), dir.Sub("crash"));
  tier->reset();
  std::vector<fs::path> wals = WalFiles(dir.Sub("crash"));
  std::sort(wals.begin(), wals.end(), [](const fs::path& a, const fs::path& b) {
    return fs::file_size(a) > fs::file_size(b);
  });
  ASSERT_FALSE(wals.empty());
  const uint64_t size = fs::file_size(wals[0]);
  ASSERT_GT(size, 4 * segs[0].layout.total_bytes());  // the four records are in it
  FlipByte(wals[0], size / 2);

  Events events;
  auto reopened = RocksSpillTier::Open(
      RocksSpillOptions{.path = dir.Sub("crash"), .piece_bytes = 4096, .event_sink = events.Sink()});
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  int intact = 0, absent = 0;
  for (const Seg& s : segs) {
    absl::Status st = Check(**reopened, s);
    if (st.ok()) {
      ++intact;
    } else {
      EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
      ++absent;
    }
  }
  EXPECT_GE(intact, 1);  // point in time: the records before the damage
  EXPECT_GE(absent, 1);
  const SpillStats stats = (*reopened)->Stats();
  EXPECT_GE(stats.wal_damage_at_open, 1u);
  EXPECT_GT(stats.wal_bytes_dropped_at_open, 0u);
  const auto damaged = events.Of(SpillEvent::Kind::kWalDamaged);
  ASSERT_EQ(damaged.size(), 1u);
  EXPECT_TRUE(damaged[0].error);
  EXPECT_TRUE(damaged[0].log);
  EXPECT_NE(damaged[0].message.find(wals[0].filename().string()), std::string::npos)
      << damaged[0].message;
  auto report = (*reopened)->CheckConsistency();
  ASSERT_TRUE(report.ok());
  EXPECT_EQ(report->bad_records, 0u);
  EXPECT_EQ(report->incomplete_segments, 0u);
}

}  // namespace
}  // namespace wal_recovery_test
}  // namespace kvshade::storage

// The real spill tier over a failing disk. DiskFaults (fault_injection.h) sits under
// RocksDB's own file I/O, so a full disk (ENOSPC) or EIO hits the WAL, table and MANIFEST
// files where a real file system would fail them. Whatever fails: no abort, the failed
// write answers RESOURCE_EXHAUSTED (full) or UNAVAILABLE (I/O error) and leaves nothing
// behind, reads keep working, and everything acknowledged is intact afterwards, also
// after a reopen.
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/storage/fault_injection.h"
#include "kvshade/storage/host_value_store.h"
#include "kvshade/storage/spill_tier.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace spill_faults_test {
namespace {

using kernels::ValueCodec;
using testing::Bytes;
using testing::TempDir;

struct Seg {
  SegmentId id;
  SegmentValueLayout layout;
  std::vector<std::vector<std::byte>> values;
  std::vector<std::byte> factor;

  SegmentWrite Write(Durability d) const {
    SegmentWrite w;
    w.id = id;
    w.layout = layout;
    w.durability = d;
    for (const auto& v : values) w.values.push_back(v);
    w.factors.push_back({0, FactorKind::kA, factor});
    w.user_metadata = "fault test";
    return w;
  }
};

Seg MakeSeg(uint64_t seed) {
  Seg s;
  s.id = SegmentId{seed * 11 + 3, seed};
  s.layout = *SegmentValueLayout::Make(2, 2, 32, 8, 64, {ValueCodec::kBF16, 16});
  for (int l = 0; l < 2; ++l) s.values.push_back(Bytes(seed * 10 + l, s.layout.layer_bytes()));
  s.factor = Bytes(seed * 10 + 9, 5000);
  return s;
}

void ExpectIntact(SpillTier& tier, const Seg& s) {
  auto meta = tier.ReadMeta(s.id);
  ASSERT_TRUE(meta.ok()) << meta.status();
  for (int l = 0; l < 2; ++l) {
    std::vector<std::byte> got(s.layout.layer_bytes());
    absl::Status st = tier.ReadValues(s.id, l, absl::MakeSpan(got));
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(got, s.values[l]);
  }
  std::vector<std::byte> f(s.factor.size());
  ASSERT_TRUE(tier.ReadFactor(s.id, 0, FactorKind::kA, absl::MakeSpan(f)).ok());
  EXPECT_EQ(f, s.factor);
}

RocksSpillOptions FaultyOptions(const std::string& path, std::shared_ptr<DiskFaults> faults) {
  RocksSpillOptions o;
  o.path = path;
  o.piece_bytes = 4096;
  o.disk_faults = std::move(faults);
  return o;
}

// Retries `write` until it succeeds or `seconds` pass; returns the last status.
template <typename F>
absl::Status RetryUntilOk(F&& write, double seconds = 30) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  absl::Status st;
  do {
    st = write();
    if (st.ok()) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  return st;
}

void ExpectConsistent(const std::string& path, const std::vector<const Seg*>& present,
                      const std::vector<const Seg*>& absent) {
  auto tier = RocksSpillTier::Open(RocksSpillOptions{.path = path, .piece_bytes = 4096});
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (const Seg* s : present) ExpectIntact(**tier, *s);
  for (const Seg* s : absent) {
    EXPECT_EQ((*tier)->ReadMeta(s->id).status().code(), absl::StatusCode::kNotFound);
  }
  auto report = (*tier)->CheckConsistency();
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->bad_records, 0u);
  EXPECT_EQ(report->incomplete_segments, 0u);
  EXPECT_EQ(report->orphan_pieces, 0u);
}

// Collects a tier's events (RocksSpillOptions::event_sink).
struct Events {
  std::mutex mu;
  std::vector<SpillEvent> all;
  SpillEventSink Sink() {
    return [this](const SpillEvent& e) {
      std::lock_guard<std::mutex> lock(mu);
      all.push_back(e);
    };
  }
  int Count(SpillEvent::Kind kind, absl::StatusCode code = absl::StatusCode::kOk) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (const SpillEvent& e : all) {
      n += e.kind == kind && (code == absl::StatusCode::kOk || e.code == code);
    }
    return n;
  }
  // Every event, one per line (for a failure's message).
  std::string Dump() {
    std::lock_guard<std::mutex> lock(mu);
    std::string out;
    for (const SpillEvent& e : all) {
      absl::StrAppend(&out, "\n  ", std::string(SpillEventKindName(e.kind)), ": ", e.message);
    }
    return out;
  }
};

TEST(SpillTierFaults, FullDiskAnswersResourceExhaustedAndRecoversWhenSpaceReturns) {
  TempDir dir;
  auto faults = std::make_shared<DiskFaults>();
  Events events;
  RocksSpillOptions o = FaultyOptions(dir.Sub("db"), faults);
  o.resume_interval_ms = 50;
  o.event_sink = events.Sink();
  auto tier = RocksSpillTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const Seg a = MakeSeg(1), b = MakeSeg(2), c = MakeSeg(3), d = MakeSeg(4);
  ASSERT_TRUE((*tier)->WriteSegment(a.Write(Durability::kDurable)).ok());
  ASSERT_TRUE((*tier)->WriteSegment(c.Write(Durability::kCache)).ok());

  // Rounds 0-2: the disk says it is full, and the tier refuses writes before RocksDB meets
  // it. Round 3: the file system claims room that is not there, so RocksDB's own write
  // fails and stops RocksDB; the next write after space returns resumes it (back-to-back
  // resumes: AFailedWalWriteWithEmptyMemtablesResumesOnANewWal).
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    const bool lying = round >= 3;
    // No flush still running when the disk fills: one failing would need a restart.
    if (lying) ASSERT_TRUE((*tier)->Flush().ok());
    const Seg cached = MakeSeg(100 + round);  // in the memtable only (cache: no WAL)
    ASSERT_TRUE((*tier)->WriteSegment(cached.Write(Durability::kCache)).ok());
    // A compaction of the earlier rounds' table files still running when the disk fills
    // fails too, and its error is not the one this test is about.
    ASSERT_TRUE((*tier)->WaitForBackgroundWork(30000));
    faults->SetFreeBytes(16 << 10);  // less than one segment
    if (lying) faults->ReportFreeBytes(uint64_t{1} << 40);
    absl::Status st;
    if (!lying) {
      // Before the fix RocksDB's log file, on the same disk, failed too and its next line
      // aborted the process.
      st = (*tier)->Flush();
      EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    }
    st = (*tier)->WriteSegment(b.Write(Durability::kDurable));
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_NE(st.message().find("No space left on device"), std::string::npos) << st;
    // (Were the file system to go on claiming room, the next write's resume would fail
    // too, and RocksDB could only be resumed by a restart.)
    faults->ReportTruly();
    // The tier stays usable: more writes fail the same way, reads are served.
    st = (*tier)->WriteSegment(d.Write(Durability::kCache));
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    st = (*tier)->DeleteSegment(c.id);
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_TRUE((*tier)->Stats().writes_stopped);
    ExpectIntact(**tier, a);
    ExpectIntact(**tier, c);
    ExpectIntact(**tier, cached);
    EXPECT_EQ((*tier)->ReadMeta(b.id).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ((*tier)->Stats().background_errors > 0, lying);
    // Space returns: writes are accepted again.
    faults->SetUnlimited();
    st = RetryUntilOk([&] { return (*tier)->WriteSegment(b.Write(Durability::kDurable)); });
    ASSERT_TRUE(st.ok()) << st << "\nevents:" << events.Dump();
    EXPECT_FALSE((*tier)->Stats().writes_stopped);
    ExpectIntact(**tier, a);
    ExpectIntact(**tier, b);
    ExpectIntact(**tier, cached);
    ASSERT_TRUE((*tier)->DeleteSegment(b.id).ok());
  }
  ASSERT_TRUE((*tier)->WriteSegment(b.Write(Durability::kDurable)).ok());
  const SpillStats stats = (*tier)->Stats();
  EXPECT_GE(stats.write_failures, 12u);
  EXPECT_EQ(stats.no_space_failures, stats.write_failures);
  EXPECT_GE(stats.background_errors, 1u);
  EXPECT_EQ(stats.resumes, 4u);
  EXPECT_FALSE(stats.writes_stopped);
  EXPECT_GE(events.Count(SpillEvent::Kind::kWriteFailed, absl::StatusCode::kResourceExhausted), 12);
  EXPECT_EQ(events.Count(SpillEvent::Kind::kWritesStopped), 4);
  EXPECT_EQ(events.Count(SpillEvent::Kind::kWritesResumed), 4);
  tier->reset();
  ExpectConsistent(dir.Sub("db"), {&a, &b}, {&d});
}

// RocksDB 7.8's resume re-used the WAL writer of a failed write when the memtables were
// empty (a durable write flushes them), and that writer aborted the next write.
TEST(SpillTierFaults, AFailedWalWriteWithEmptyMemtablesResumesOnANewWal) {
  TempDir dir;
  auto faults = std::make_shared<DiskFaults>();
  RocksSpillOptions o = FaultyOptions(dir.Sub("db"), faults);
  o.resume_interval_ms = 0;
  auto tier = RocksSpillTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const Seg a = MakeSeg(1), b = MakeSeg(2), c = MakeSeg(3);
  ASSERT_TRUE((*tier)->WriteSegment(a.Write(Durability::kDurable)).ok());  // flushed
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE((*tier)->Flush().ok());  // every memtable empty
    faults->SetFreeBytes(round * 2000);  // the WAL record of b fails part way (or at once)
    faults->ReportFreeBytes(uint64_t{1} << 40);  // past the tier's own free-space check
    absl::Status st = (*tier)->WriteSegment(b.Write(Durability::kDurable));
    EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
    EXPECT_GT((*tier)->Stats().background_errors, 0u);
    faults->SetUnlimited();
    faults->ReportTruly();
    st = RetryUntilOk([&] { return (*tier)->WriteSegment(b.Write(Durability::kDurable)); });
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_TRUE((*tier)->WriteSegment(c.Write(Durability::kDurable)).ok());
    ASSERT_TRUE((*tier)->DeleteSegment(b.id).ok());
    ASSERT_TRUE((*tier)->DeleteSegment(c.id).ok());
  }
  ASSERT_TRUE((*tier)->WriteSegment(c.Write(Durability::kDurable)).ok());
  tier->reset();
  ExpectConsistent(dir.Sub("db"), {&a, &c}, {&b});
}

TEST(SpillTierFaults, IoErrorAnswersUnavailableKeepsReadsAndLosesNothingAcknowledged) {
  TempDir dir;
  auto faults = std::make_shared<DiskFaults>();
  Events events;
  RocksSpillOptions o = FaultyOptions(dir.Sub("db"), faults);
  o.event_sink = events.Sink();
  auto tier = RocksSpillTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const Seg a = MakeSeg(1), b = MakeSeg(2), c = MakeSeg(3);
  ASSERT_TRUE((*tier)->WriteSegment(a.Write(Durability::kDurable)).ok());
  ASSERT_TRUE((*tier)->WriteSegment(c.Write(Durability::kCache)).ok());  // memtable only
  faults->SetIoError(true);
  absl::Status st = (*tier)->WriteSegment(b.Write(Durability::kDurable));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  faults->SetIoError(false);
  ExpectIntact(**tier, a);
  ExpectIntact(**tier, c);
  // An I/O error other than a full disk leaves RocksDB read-only until it is reopened.
  st = (*tier)->WriteSegment(b.Write(Durability::kDurable));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_EQ((*tier)->ReadMeta(b.id).status().code(), absl::StatusCode::kNotFound);
  const SpillStats stats = (*tier)->Stats();
  EXPECT_EQ(stats.write_failures, 2u);
  EXPECT_EQ(stats.no_space_failures, 0u);
  EXPECT_TRUE(stats.writes_stopped);
  EXPECT_EQ(events.Count(SpillEvent::Kind::kWritesStopped, absl::StatusCode::kUnavailable), 1);
  EXPECT_EQ(events.Count(SpillEvent::Kind::kWriteFailed, absl::StatusCode::kUnavailable), 2);
  tier->reset();  // closing after the error must not abort either
  ExpectConsistent(dir.Sub("db"), {&a}, {&b, &c});
}

// The host value store over a full spill disk: what needs a spill or a durable seal fails
// with RESOURCE_EXHAUSTED, everything resident is still served, and once space returns
// spills and page-ins work again.
TEST(SpillTierFaults, HostStoreKeepsServingWhileTheSpillDiskIsFull) {
  auto cpu = kernels::testing::Cpu();
  TempDir dir;
  auto faults = std::make_shared<DiskFaults>();
  RocksSpillOptions o = FaultyOptions(dir.Sub("db"), faults);
  o.resume_interval_ms = 0;
  auto tier = RocksSpillTier::Open(o);
  ASSERT_TRUE(tier.ok()) << tier.status();
  const SegmentValueLayout layout =
      *SegmentValueLayout::Make(2, 2, 32, 8, 64, kernels::ValueCodecSpec{ValueCodec::kBF16, 16});
  HostValueStoreOptions ho;
  ho.budget_bytes = 2 * layout.total_bytes();
  ho.slab_bytes = 64 << 10;
  auto store = HostValueStore::Create(*cpu, ho, tier->get());
  ASSERT_TRUE(store.ok()) << store.status();
  HostValueStore& s = **store;
  auto add = [&](uint64_t n, bool durable) -> absl::Status {
    const SegmentId id{n, n};
    if (absl::Status st = s.Create(id, layout); !st.ok()) return st;
    for (int l = 0; l < 2; ++l) {
      EXPECT_TRUE(s.WriteLayer(id, l, Bytes(n * 10 + l, layout.dense_layer_bytes())).ok());
    }
    SealOptions seal;
    seal.durable = durable;
    absl::Status st = s.Seal(id, seal);
    if (!st.ok()) EXPECT_TRUE(s.Erase(id).ok());
    return st;
  };
  auto check = [&](uint64_t n) -> absl::Status {
    auto pin = s.Pin(SegmentId{n, n});
    if (!pin.ok()) return pin.status();
    for (int l = 0; l < 2; ++l) {
      const auto want = Bytes(n * 10 + l, layout.dense_layer_bytes());
      for (int hh = 0; hh < layout.h; ++hh) {
        for (int j = 0; j < layout.n_chunks; ++j) {
          EXPECT_EQ(std::memcmp(pin->layer(l).chunk(hh, j),
                                want.data() + (size_t(hh) * layout.n_chunks + j) * layout.chunk_bytes,
                                layout.chunk_bytes), 0);
        }
      }
    }
    return absl::OkStatus();
  };
  ASSERT_TRUE(add(1, false).ok());
  ASSERT_TRUE(add(2, false).ok());
  faults->SetFreeBytes(0);
  absl::Status st = add(3, /*durable=*/true);  // needs a spill of 1
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  st = add(4, false);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(check(1).ok());  // resident: served
  EXPECT_TRUE(check(2).ok());
  faults->SetUnlimited();
  st = RetryUntilOk([&] { return add(4, false); });
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(add(3, true).ok());
  for (uint64_t n = 1; n <= 4; ++n) EXPECT_TRUE(check(n).ok()) << n;  // spilled ones page in
}

}  // namespace
}  // namespace spill_faults_test
}  // namespace kvshade::storage

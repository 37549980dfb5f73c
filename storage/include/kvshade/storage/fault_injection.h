// FaultInjectingSpillTier: wraps a real SpillTier and fails reads and writes at set
// probabilities, deterministically from a seed (like RocksDB's fault-injection secondary
// cache). For tests: with faults on, operations return errors; committed data must never
// be corrupted and the caller's state must stay consistent.
//
// An injected write failure happens before the wrapped write (nothing is written); an
// injected read failure happens after the wrapped read when `fail_after_read` (dst may then
// hold the bytes, but the caller must not use them), else before. Injected errors are
// Unavailable and their message contains "injected".
//
// DiskFaults works one level lower: RocksSpillOptions::disk_faults puts it under RocksDB
// itself (RocksDB's FileSystem), so that the real tier meets a full disk or EIO in its WAL,
// table, MANIFEST and blob files exactly where a real file system would fail them.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <random>

#include <mutex>

#include "kvshade/storage/spill_tier.h"

namespace kvshade::storage {

// Simulated disk faults under a RocksSpillTier (RocksSpillOptions::disk_faults). Thread-safe;
// shared by the test and the tier's file system. Only writes are affected: reads, file
// creation, renames and deletes always pass through.
class DiskFaults {
 public:
  enum class Result { kOk, kNoSpace, kIoError };

  // The disk takes `bytes` more bytes, then every write fails with ENOSPC (RocksDB's
  // IOStatus::NoSpace) until more space is given; GetFreeSpace reports what is left.
  void SetFreeBytes(uint64_t bytes) { free_.store(bytes); }
  void SetUnlimited() { free_.store(kUnlimited); }
  // While on, every write and sync fails with EIO (IOStatus::IOError).
  void SetIoError(bool on) { io_error_.store(on); }
  // GetFreeSpace reports `bytes` whatever is left (a file system whose free-space figure
  // is wrong: quotas, thin provisioning), so that writes reach the failure; ReportTruly()
  // undoes it.
  void ReportFreeBytes(uint64_t bytes) { reported_.store(bytes); }
  void ReportTruly() { reported_.store(kUnlimited); }
  // What GetFreeSpace reports when the real file system has `real` bytes free.
  uint64_t ReportedFree(uint64_t real) const {
    const uint64_t r = reported_.load();
    if (r != kUnlimited) return r;
    return std::min(real, free_.load());
  }

  uint64_t free_bytes() const { return free_.load(); }
  bool unlimited() const { return free_.load() == kUnlimited; }
  uint64_t failed_writes() const { return failures_.load(); }

  // Charges a write of `bytes` bytes: kOk (and the space is used), or the failure.
  Result Write(uint64_t bytes);
  // A sync, flush or close: fails only while SetIoError is on.
  Result Sync();

 private:
  static constexpr uint64_t kUnlimited = std::numeric_limits<uint64_t>::max();
  std::atomic<uint64_t> free_{kUnlimited};
  std::atomic<uint64_t> reported_{kUnlimited};
  std::atomic<bool> io_error_{false};
  std::atomic<uint64_t> failures_{0};
};

struct FaultOptions {
  double read_failure_probability = 0;   // ReadMeta, ReadValues, ReadFactor, ListSegments
  double write_failure_probability = 0;  // WriteSegment, AddFactors, DeleteSegment
  uint64_t seed = 1;
  bool fail_after_read = true;
};

class FaultInjectingSpillTier final : public SpillTier {
 public:
  // `base` is not owned and must outlive the wrapper.
  FaultInjectingSpillTier(SpillTier& base, const FaultOptions& options);

  // Changes the probabilities (and reseeds) at run time, e.g. to switch faults off.
  void SetOptions(const FaultOptions& options);
  uint64_t injected_read_failures() const { return read_failures_.load(); }
  uint64_t injected_write_failures() const { return write_failures_.load(); }

  absl::Status WriteSegment(const SegmentWrite& segment) override;
  absl::Status AddFactors(const SegmentId& id, absl::Span<const FactorBlob> factors) override;
  absl::StatusOr<SegmentMeta> ReadMeta(const SegmentId& id) override;
  absl::Status ReadValues(const SegmentId& id, int layer, absl::Span<std::byte> dst) override;
  absl::Status ReadFactor(const SegmentId& id, int layer, FactorKind kind,
                          absl::Span<std::byte> dst) override;
  absl::Status DeleteSegment(const SegmentId& id) override;
  absl::Status SyncWal() override;
  absl::StatusOr<std::vector<SegmentMeta>> ListSegments() override;
  SpillStats Stats() const override { return base_.Stats(); }
  SpillDamage Damage() const override { return base_.Damage(); }

 private:
  bool Roll(bool write);
  absl::Status Injected(bool write, std::string_view op);

  SpillTier& base_;
  std::mutex mu_;  // guards options_ and rng_
  FaultOptions options_;
  std::mt19937_64 rng_;
  std::atomic<uint64_t> read_failures_{0}, write_failures_{0};
};

}  // namespace kvshade::storage

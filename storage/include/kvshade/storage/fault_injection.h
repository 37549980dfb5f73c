// FaultInjectingSpillTier: wraps a real SpillTier and fails reads and writes at set
// probabilities, deterministically from a seed (like RocksDB's fault-injection secondary
// cache). For tests: with faults on, operations return errors; committed data must never
// be corrupted and the caller's state must stay consistent.
//
// An injected write failure happens before the wrapped write (nothing is written); an
// injected read failure happens after the wrapped read when `fail_after_read` (dst may then
// hold the bytes, but the caller must not use them), else before. Injected errors are
// Unavailable and their message contains "injected".
#pragma once

#include <atomic>
#include <cstdint>
#include <random>

#include <mutex>

#include "kvshade/storage/spill_tier.h"

namespace kvshade::storage {

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
  absl::StatusOr<std::vector<SegmentMeta>> ListSegments() override;
  SpillStats Stats() const override { return base_.Stats(); }

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

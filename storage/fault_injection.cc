// FaultInjectingSpillTier: seeded failure injection in front of a real spill tier.
#include "kvshade/storage/fault_injection.h"

#include "absl/strings/str_cat.h"

namespace kvshade::storage {

DiskFaults::Result DiskFaults::Write(uint64_t bytes) {
  if (io_error_.load()) {
    failures_.fetch_add(1);
    return Result::kIoError;
  }
  uint64_t free = free_.load();
  while (free != kUnlimited) {
    if (free < bytes) {
      failures_.fetch_add(1);
      return Result::kNoSpace;
    }
    if (free_.compare_exchange_weak(free, free - bytes)) break;
  }
  return Result::kOk;
}

DiskFaults::Result DiskFaults::Sync() {
  if (!io_error_.load()) return Result::kOk;
  failures_.fetch_add(1);
  return Result::kIoError;
}

FaultInjectingSpillTier::FaultInjectingSpillTier(SpillTier& base, const FaultOptions& options)
    : base_(base), options_(options), rng_(options.seed) {}

void FaultInjectingSpillTier::SetOptions(const FaultOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  options_ = options;
  rng_.seed(options.seed);
}

bool FaultInjectingSpillTier::Roll(bool write) {
  std::lock_guard<std::mutex> lock(mu_);
  const double p = write ? options_.write_failure_probability : options_.read_failure_probability;
  // Always draw, so the sequence of decisions depends only on the seed and the call order.
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  return u < p;
}

absl::Status FaultInjectingSpillTier::Injected(bool write, std::string_view op) {
  (write ? write_failures_ : read_failures_).fetch_add(1);
  return absl::UnavailableError(absl::StrCat("injected ", write ? "write" : "read",
                                             " failure in ", std::string(op)));
}

absl::Status FaultInjectingSpillTier::WriteSegment(const SegmentWrite& segment) {
  if (Roll(true)) return Injected(true, "WriteSegment");
  return base_.WriteSegment(segment);
}

absl::Status FaultInjectingSpillTier::AddFactors(const SegmentId& id,
                                                 absl::Span<const FactorBlob> factors) {
  if (Roll(true)) return Injected(true, "AddFactors");
  return base_.AddFactors(id, factors);
}

absl::Status FaultInjectingSpillTier::DeleteSegment(const SegmentId& id) {
  if (Roll(true)) return Injected(true, "DeleteSegment");
  return base_.DeleteSegment(id);
}

absl::Status FaultInjectingSpillTier::SyncWal() {
  if (Roll(true)) return Injected(true, "SyncWal");
  return base_.SyncWal();
}

absl::StatusOr<SegmentMeta> FaultInjectingSpillTier::ReadMeta(const SegmentId& id) {
  if (Roll(false)) return Injected(false, "ReadMeta");
  return base_.ReadMeta(id);
}

absl::Status FaultInjectingSpillTier::ReadValues(const SegmentId& id, int layer,
                                                 absl::Span<std::byte> dst) {
  bool after;
  {
    std::lock_guard<std::mutex> lock(mu_);
    after = options_.fail_after_read;
  }
  const bool fail = Roll(false);
  if (fail && !after) return Injected(false, "ReadValues");
  absl::Status s = base_.ReadValues(id, layer, dst);
  if (fail) return Injected(false, "ReadValues");
  return s;
}

absl::Status FaultInjectingSpillTier::ReadFactor(const SegmentId& id, int layer, FactorKind kind,
                                                 absl::Span<std::byte> dst) {
  if (Roll(false)) return Injected(false, "ReadFactor");
  return base_.ReadFactor(id, layer, kind, dst);
}

absl::StatusOr<std::vector<SegmentMeta>> FaultInjectingSpillTier::ListSegments() {
  if (Roll(false)) return Injected(false, "ListSegments");
  return base_.ListSegments();
}

}  // namespace kvshade::storage

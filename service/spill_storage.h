// The spill tier of a kvshade-server process: the Server opens it and hands it to the engine
// (EngineOptions::spill_tier), which only ever speaks the SpillTier interface. Normally a
// RocksSpillTier on spill_path; for tests, a FaultInjectingSpillTier in front of it.
//
// Fault injection for tests (docs/OPERATIONS.md "Storage faults"): when
// KVSHADE_FAILPOINT_SPILL_FAULTS is set, e.g. "seed=7,write=0.05,read=0.02", every spill
// tier write (segment, factors, delete, WAL sync) fails with probability `write` and every
// read (metadata, values, factors, listing) with probability `read`, deterministically
// from `seed`, with UNAVAILABLE "injected ... failure" (storage/fault_injection.h). The
// faults start once the durable sessions are restored (ArmFaults), so that a start always
// comes up on what is stored. Unset in production; a malformed value fails the start.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvshade/service/config.h"
#include "kvshade/storage/fault_injection.h"
#include "kvshade/storage/spill_tier.h"

namespace kvshade::service {

class SpillStorage {
 public:
  // Opens the RocksSpillTier on config.spill_path (and the test fault tier when
  // KVSHADE_FAILPOINT_SPILL_FAULTS is set); null when spill_path is empty.
  static absl::StatusOr<std::unique_ptr<SpillStorage>> Open(const ServerConfig& config);

  // What the engine uses: the fault tier when there is one, else the RocksDB tier.
  storage::SpillTier* tier() const;
  // Starts the injected faults (no-op without KVSHADE_FAILPOINT_SPILL_FAULTS).
  void ArmFaults();

 private:
  SpillStorage() = default;
  std::unique_ptr<storage::RocksSpillTier> rocks_;
  std::unique_ptr<storage::FaultInjectingSpillTier> faults_;  // tests only
  storage::FaultOptions fault_options_;
};

// Parses a KVSHADE_FAILPOINT_SPILL_FAULTS value ("seed=S,write=P,read=P"; any subset, in
// any order; probabilities in [0, 1]).
absl::StatusOr<storage::FaultOptions> ParseSpillFaults(const std::string& spec);

}  // namespace kvshade::service

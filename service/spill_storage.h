// The spill tier of a kvshade-server process: the Server opens it and hands it to the engine
// (EngineOptions::spill_tier), which only ever speaks the SpillTier interface: a
// RocksSpillTier on spill_path.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kvshade/service/config.h"
#include "kvshade/storage/spill_tier.h"

namespace kvshade::service {

class SpillStorage {
 public:
  // Opens the RocksSpillTier on config.spill_path; null when spill_path is empty.
  static absl::StatusOr<std::unique_ptr<SpillStorage>> Open(const ServerConfig& config);

  // What the engine uses.
  storage::SpillTier* tier() const;

 private:
  SpillStorage() = default;
  std::unique_ptr<storage::RocksSpillTier> rocks_;
};

}  // namespace kvshade::service

#include "spill_storage.h"

#include "kvshade/base/status_macros.h"

namespace kvshade::service {

absl::StatusOr<std::unique_ptr<SpillStorage>> SpillStorage::Open(const ServerConfig& config) {
  if (config.spill_path.empty()) return std::unique_ptr<SpillStorage>();
  std::unique_ptr<SpillStorage> s(new SpillStorage());
  storage::RocksSpillOptions o;
  o.path = config.spill_path;
  KVSHADE_ASSIGN_OR_RETURN(s->rocks_, storage::RocksSpillTier::Open(o));
  return s;
}

storage::SpillTier* SpillStorage::tier() const { return rocks_.get(); }

}  // namespace kvshade::service

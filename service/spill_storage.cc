#include "spill_storage.h"

#include <cstdlib>

#include <spdlog/spdlog.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

constexpr char kFaultsEnv[] = "KVSHADE_FAILPOINT_SPILL_FAULTS";

absl::StatusOr<storage::FaultOptions> ParseSpillFaults(const std::string& spec) {
  storage::FaultOptions o;
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(kFaultsEnv, "='", spec, "': ", why,
                                                   " (expected e.g. seed=7,write=0.05,read=0.02)"));
  };
  for (absl::string_view item : absl::StrSplit(spec, ',', absl::SkipWhitespace())) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    if (kv.first == "seed") {
      if (!absl::SimpleAtoi(kv.second, &o.seed)) return bad("seed is not an unsigned integer");
    } else if (kv.first == "write" || kv.first == "read") {
      double p = 0;
      if (!absl::SimpleAtod(kv.second, &p) || !(p >= 0 && p <= 1)) {
        return bad(absl::StrCat(kv.first, " is not a probability in [0, 1]"));
      }
      (kv.first == "write" ? o.write_failure_probability : o.read_failure_probability) = p;
    } else {
      return bad(absl::StrCat("unknown key '", kv.first, "'"));
    }
  }
  return o;
}

absl::StatusOr<std::unique_ptr<SpillStorage>> SpillStorage::Open(const ServerConfig& config) {
  if (config.spill_path.empty()) return std::unique_ptr<SpillStorage>();
  std::unique_ptr<SpillStorage> s(new SpillStorage());
  const char* faults = std::getenv(kFaultsEnv);
  if (faults != nullptr && *faults != '\0') {
    KVSHADE_ASSIGN_OR_RETURN(s->fault_options_, ParseSpillFaults(faults));
  }
  storage::RocksSpillOptions o;
  o.path = config.spill_path;
  o.on_damage = config.spill_on_damage == "refuse" ? storage::DamagePolicy::kRefuse
                                                   : storage::DamagePolicy::kServeRest;
  o.repair = config.spill_repair;
  KVSHADE_ASSIGN_OR_RETURN(s->rocks_, storage::RocksSpillTier::Open(o));
  if (faults != nullptr && *faults != '\0') {
    // Off until ArmFaults: the restore reads what is stored.
    s->faults_ = std::make_unique<storage::FaultInjectingSpillTier>(*s->rocks_, storage::FaultOptions{});
    spdlog::warn("{}={}: the spill tier injects storage faults (seed {}, write {}, read {}); "
                 "for tests only",
                 kFaultsEnv, faults, s->fault_options_.seed,
                 s->fault_options_.write_failure_probability,
                 s->fault_options_.read_failure_probability);
  }
  return s;
}

storage::SpillTier* SpillStorage::tier() const {
  if (faults_) return faults_.get();
  return rocks_.get();
}

void SpillStorage::ArmFaults() {
  if (faults_) faults_->SetOptions(fault_options_);
}

}  // namespace kvshade::service

// EngineInternals: what the engine's tests and the durable-record fuzzer
// (fuzz/durable_fuzzer.cc) read of an Engine beyond its API: its sessions, its host value
// store, its staging pool and a layer's decode view; and the restore step the fuzzer drives with records of
// its own. Not for the service: the adapters and the server speak Engine (engine.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine_impl.h"

namespace kvshade::service {

class EngineInternals {
 public:
  using FactorReader = EngineImpl::FactorReader;

  explicit EngineInternals(Engine& engine) : e_(*engine.impl_) {}

  absl::StatusOr<std::shared_ptr<Session>> FindSession(const std::string& tenant,
                                                       const std::string& id) const {
    return e_.sessions_.FindSession(tenant, id);
  }
  std::vector<std::shared_ptr<Session>> AllSessions() const { return e_.sessions_.AllSessions(); }
  SessionCounts Counts() const { return e_.sessions_.Counts(); }
  storage::HostValueStore& store() const { return e_.store(); }
  storage::StagingPool& staging() const { return e_.staging(); }
  // The decode view of `layer` (caller holds the session lock, shared at least).
  absl::StatusOr<LayerViewHold> BuildView(const Session& s, int layer) const {
    return e_.BuildView(s, layer);
  }
  // EngineImpl::RestoreRecords: rebuilds the sessions of `metas` as a start does.
  absl::Status RestoreRecords(const std::vector<storage::SegmentMeta>& metas,
                              const FactorReader& read_factor) const {
    return e_.RestoreRecords(metas, read_factor);
  }

 private:
  EngineImpl& e_;
};

}  // namespace kvshade::service

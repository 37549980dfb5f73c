// Prometheus metrics of the daemon (prometheus-cpp). Every name, type and label is listed
// in docs/OPERATIONS.md ("Metrics"); labels are low-cardinality only (method, code, stage,
// tier, kind, result, reason, source, gpu). Thread-safe: every method may be called from
// any RPC thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <vector>

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "absl/status/statusor.h"

namespace httplib {
class Server;
}  // namespace httplib

namespace kvshade::service {

// Where CreateSession's prefix reuse stopped (the `reason` of
// kvshade_prefix_lookups_total; docs/OPERATIONS.md "Metrics" says when each is counted).
enum class PrefixStop {
  kFull,            // the whole prompt was reused
  kAbsent,          // nothing is cached for the rest of the prompt
  kEvicted,         // the rest's next block was cached, and its segment was evicted
  kPartialSegment,  // the next cached segment runs past the prompt or differs from it
  kNotDurable,      // a durable session: the next cached segment is not durable
  kQuota,           // the cap on reused segments per session (kMaxReusedSegments)
  kReadFailure,     // the next cached segment's values could not be read back from spill
};
inline constexpr int kPrefixStops = 7;
std::string_view PrefixStopName(PrefixStop stop);

class Metrics {
 public:
  Metrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One finished RPC (method = the proto method name, e.g. "CreateSession"). A non-OK code
  // is also counted in kvshade_errors_total; call Error() only for failures that are not
  // reported through ObserveRpc.
  void ObserveRpc(std::string_view method, int grpc_code, double seconds);
  // stages: KnownStages() in metrics.cc (docs/OPERATIONS.md "Metrics"); any other is "other"
  void ObserveStage(std::string_view stage, double seconds);
  // A daemon with several devices (docs/OPERATIONS.md "Devices"): the gauges of a device's
  // state (kvshade_tier_bytes, kvshade_tier_budget_bytes, kvshade_device_held_bytes,
  // kvshade_device_allocations, kvshade_sessions, kvshade_attachments,
  // kvshade_export_generations, kvshade_segments) are kept per device, labelled
  // gpu="<label>" (the device's ordinal: "1" for cuda:1 or cpu:1); their unlabelled series
  // go, and each label's exist from now on (0). Their setters below then take the device's
  // label as `gpu`; "" (the default) is the unlabelled series of a daemon with one device.
  // Call once, before any engine runs.
  void UseDeviceLabels(const std::vector<std::string>& gpus);
  // tier: device|host|spill. kind="total" of a tier is kept here, the sum of its other
  // kinds (a call with kind "total" is ignored); every tier has one from the start (0).
  void SetTierBytes(std::string_view tier, std::string_view kind, double bytes,
                    std::string_view gpu = "");
  // The configured budget of a tier (+Inf: unbounded; 0: no such tier).
  void SetTierBudget(std::string_view tier, double bytes, std::string_view gpu = "");
  // The device memory the daemon holds (kvshade_device_held_bytes) in `pools` allocations.
  void SetDeviceHeld(double bytes, double pools, std::string_view gpu = "");
  // kvshade_build_info{version,commit,backend} 1 (set once at start-up; a later call
  // replaces the series).
  void SetBuildInfo(std::string_view version, std::string_view commit, std::string_view backend);
  void SetSessions(double n, std::string_view gpu = "");
  void SetAttachments(double n, std::string_view gpu = "");
  void SetExportGenerations(double n, std::string_view gpu = "");  // same-node generations held
  void SetSegments(double n, std::string_view gpu = "");
  // One CreateSession prefix lookup: kvshade_prefix_lookups_total{result,reason} (result
  // "hit" when reused_tokens > 0), kvshade_prefix_tokens_total{kind="requested"} +=
  // requested_tokens (the prompt's length) and {kind="reused"} += reused_tokens, and
  // kvshade_prefix_reused_segments_total{source="resident"|"spilled_and_paged_in"}.
  void PrefixLookup(PrefixStop stop, uint64_t requested_tokens, uint64_t reused_tokens,
                    uint64_t resident_segments, uint64_t paged_in_segments);
  // One LookupPrefix call: kvshade_prefix_probes_total{result="hit"|"miss"}.
  void PrefixProbe(bool hit);
  // A CreateSession that cuts its ingest at segment ends ("Segment ends"):
  // kvshade_prefix_splits_total{source="hint"} += hinted ends kept,
  // {source="automatic"} += 1 for an automatic end.
  void PrefixSplits(uint64_t hinted, bool automatic);
  void ChunkSelection(uint64_t selected, uint64_t hits);
  // One query of a select that succeeded, by the worker's purpose:
  // kvshade_decode_selects_total{purpose="synchronous|speculative|correction"}.
  void DecodeSelect(int purpose);  // a v1::SelectPurpose value
  void ReconstructionEnergy(double captured_energy);
  void ProjectionResidual(double residual_energy);
  void Spill(uint64_t bytes);
  void PageIn(uint64_t bytes);
  void Eviction();
  void IngestedTokens(uint64_t n);
  void SessionsExpired(uint64_t n);  // closed by idle expiry (limits.session_idle_ttl_s)
  void SessionDamaged(std::string_view cause);  // "wal", "record" or "read"
  // UCX rendezvous payloads (ingest parts, large appends) received outside the receive
  // pool (none free, or larger than a buffer).
  void UcxReceivePoolMisses(uint64_t n);
  // Shadow layers whose factorization fell back from subspace iteration to the full solve.
  void FactorizeFallback();
  void Error(int grpc_code);

 private:
  // Label children are created lazily; prometheus-cpp's Family::Add is thread-safe and
  // returns the same child for the same labels, so no cache of ours is needed.
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* rpc_seconds_;
  prometheus::Family<prometheus::Counter>* rpc_total_;
  prometheus::Family<prometheus::Histogram>* stage_seconds_;
  prometheus::Family<prometheus::Gauge>* tier_bytes_;
  prometheus::Family<prometheus::Gauge>* tier_budget_;
  // A per-device gauge: the family, and its unlabelled series (null once device labels are
  // in use).
  struct DeviceGauge {
    prometheus::Family<prometheus::Gauge>* family = nullptr;
    prometheus::Gauge* unlabelled = nullptr;
    void Set(std::string_view gpu, double v);
  };
  DeviceGauge device_held_, device_pools_, sessions_, attachments_, export_generations_, segments_;
  prometheus::Family<prometheus::Gauge>* build_info_;
  std::mutex tier_mu_;
  // (gpu, tier, kind) -> bytes; gpu "" without device labels.
  std::map<std::tuple<std::string, std::string, std::string>, double> tier_kinds_;
  std::vector<std::string> gpus_;  // UseDeviceLabels
  std::mutex build_info_mu_;
  prometheus::Gauge* build_info_series_ = nullptr;
  prometheus::Counter* prefix_lookups_[2][kPrefixStops] = {};  // [hit][stop]; null: impossible
  prometheus::Counter* prefix_requested_tokens_;
  prometheus::Counter* prefix_reused_tokens_;
  prometheus::Counter* prefix_resident_segments_;
  prometheus::Counter* prefix_paged_in_segments_;
  prometheus::Counter* prefix_probes_[2];  // [hit]
  prometheus::Counter* prefix_splits_[2];  // [automatic]
  prometheus::Counter* decode_selects_[3];  // by v1::SelectPurpose
  prometheus::Counter* chunks_selected_;
  prometheus::Counter* chunk_hits_;
  prometheus::Histogram* reconstruction_energy_;
  prometheus::Histogram* projection_residual_;
  prometheus::Counter* spill_bytes_;
  prometheus::Counter* spills_;
  prometheus::Counter* page_in_bytes_;
  prometheus::Counter* page_ins_;
  prometheus::Counter* evictions_;
  prometheus::Counter* ingested_tokens_;
  prometheus::Counter* sessions_expired_;
  prometheus::Family<prometheus::Counter>* sessions_damaged_;
  prometheus::Counter* ucx_pool_misses_;
  prometheus::Counter* factorize_fallbacks_;
  prometheus::Family<prometheus::Counter>* errors_;
};

// The standard process metrics of this process, read from /proc/self when collected (on
// each scrape): process_resident_memory_bytes, process_virtual_memory_bytes,
// process_cpu_seconds_total, process_open_fds, process_max_fds, process_start_time_seconds.
// A figure that cannot be read is left out of that scrape.
class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

// Serves the registry, and the process metrics (ProcessCollector), in the Prometheus text
// format on GET /metrics, with cpp-httplib (Debian's libcpp-httplib) on one serving
// thread of the default stack size. Not prometheus::Exposer: Debian's civetweb runs
// handlers on 100 KiB thread stacks, and in this process (which loads libquadmath through
// OpenBLAS/LAPACKE, registering printf hooks that send glibc's printf down its
// stack-hungry positional path) every scrape overflowed that stack and killed the daemon.
class MetricsEndpoint {
 public:
  // Binds host:port (port 0 picks a free one) and starts the serving thread.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(
      const std::string& host, uint16_t port, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsEndpoint();  // stops the thread and closes the socket
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;
  int port() const { return port_; }

 private:
  MetricsEndpoint() = default;
  std::string Scrape() const;
  std::shared_ptr<prometheus::Registry> registry_;
  ProcessCollector process_;
  std::unique_ptr<httplib::Server> server_;
  int port_ = 0;
  std::thread thread_;
};

// The canonical name of a gRPC status code ("OK", "INVALID_ARGUMENT", ...), used as the
// `code` label.
std::string_view GrpcCodeName(int grpc_code);

}  // namespace kvshade::service

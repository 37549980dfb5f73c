// DeviceRouter: the devices of one daemon (docs/OPERATIONS.md "Devices"). `backend` names one
// device ("cpu", "cuda:1") or several ("cuda:0,cuda:1", "cuda:all", "cpu:0,cpu:1"); each
// device gets an Engine of its own (its device tier, host value store, prefix index, spill
// tier and sessions), and the router is what the transports (the gRPC service, the UCX data
// plane) call: the Engine's operations, each sent to the engine of the session it names.
//
// Placement: CreateSession and LookupPrefix go to the device the request names
// (CreateSessionRequest.device: the worker's GPU by daemon name or PCI bus id; empty = the
// first device); a fork stays on its parent's device. Routing: on a daemon with several
// devices every session and attachment id carries its device's index in its first two hex
// digits (SessionManager::NewId(device)), so a call finds its engine from the id alone, in
// O(1), with no table to keep in step with closes, expiry or restores. A daemon with one
// device creates untagged ids as before and sends everything to its one engine.
// ListSessions and Stats gather every device's; Drain drains them all.
//
// Storage per device: the device budget is each device's; the host and spill budgets are
// the daemon's, divided evenly between its devices; with several devices each keeps its
// spill tier (and durable sessions) in spill_path/device-<i>, restored onto device i.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/base/sync.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/config.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"

namespace kvshade::service {

class SpillStorage;

struct DeviceRouterOptions {
  Clock clock;                    // default: system clock
  bool background_thread = true;  // as EngineOptions (off: RunMaintenance, tests)
};

class DeviceRouter {
 public:
  // One device of the daemon.
  struct Device {
    std::string name;        // as configured: "cpu", "cuda", "cuda:1", "cpu:0"
    std::string kind;        // the backend's: "cpu" or "cuda" ("auto" resolved)
    int ordinal = 0;         // N of cuda:N / cpu:N (0 for "cpu", "cuda")
    std::string gpu;         // label of its gauges: "" alone, else the ordinal
    std::string pci_bus_id;  // CUDA: "0000:3b:00.0"; else empty
    std::unique_ptr<kernels::Backend> backend;
    std::unique_ptr<ServerConfig> config;  // the daemon's, with this device's budgets, spill path
    std::unique_ptr<SpillStorage> spill;   // null without spill_path
    std::unique_ptr<Engine> engine;
  };

  // Opens every device of config.backend (ValidateConfig first): its backend, its spill tier
  // and its engine, which restores the device's durable sessions. Fails with the cause: a
  // backend that cannot be created, a spill_path laid out for another number of devices (a
  // daemon restarted with fewer devices than hold durable sessions), a restore error.
  // `metrics` must outlive the router.
  static absl::StatusOr<std::unique_ptr<DeviceRouter>> Open(const ServerConfig& config,
                                                            Metrics* metrics,
                                                            DeviceRouterOptions options = {});
  ~DeviceRouter();
  DeviceRouter(const DeviceRouter&) = delete;
  DeviceRouter& operator=(const DeviceRouter&) = delete;

  size_t size() const { return devices_.size(); }
  const Device& device(size_t i) const { return devices_[i]; }
  // "cpu:0, cpu:1": the devices' names, for messages and the start-up log.
  std::string DeviceNames() const;

  // The index of the device a request names: "" = 0; the daemon's name of a device
  // ("cuda:1", "cpu:0"; "cuda:0"/"cpu:0" also name a daemon's lone "cuda"/"cpu" device); a
  // CUDA device's PCI bus id (any case; a domain of 4 or 8 hex digits). INVALID_ARGUMENT
  // naming the daemon's devices otherwise.
  absl::StatusOr<int> Resolve(std::string_view device) const;
  // The device a session or attachment id belongs to (0 for an id of another form: its
  // engine then answers as for any unknown id).
  int DeviceOf(std::string_view id) const;
  Engine& EngineFor(std::string_view id) const { return *devices_[DeviceOf(id)].engine; }

  // The Engine's operations (engine.h), routed.
  //
  // Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions"; tensor_parallel.cc):
  // the router keeps each logical session (its ranks, their shards' ids and devices) and
  // checks the ranks against each other; each shard is an engine session on its rank's
  // device. CreateSession with tensor_parallel creates or joins; GetSession, ListSessions,
  // ForkSession and CloseSession take the logical id (and refuse a shard's own fork and
  // close); Ingest, AppendTokens and Attach of a logical id are FAILED_PRECONDITION naming
  // the shards. Open rebuilds the logical sessions of restored shards; one missing a rank
  // (or holding a damaged shard) is damaged as a whole.
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const Tenant& t,
                                                          const v1::CreateSessionRequest& r);
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const Tenant& t,
                                                      const v1::ForkSessionRequest& r);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const Tenant& t,
                                                        const v1::LookupPrefixRequest& r);
  absl::StatusOr<v1::SessionInfo> GetSession(const Tenant& t, const v1::GetSessionRequest& r);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const Tenant& t,
                                                        const v1::ListSessionsRequest& r);
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const Tenant& t,
                                                        const v1::CloseSessionRequest& r);
  absl::StatusOr<std::unique_ptr<Engine::IngestStream>> BeginIngest(const Tenant& t,
                                                                    const v1::IngestRequest& header);
  absl::StatusOr<v1::IngestResponse> Ingest(const Tenant& t,
                                            absl::Span<const v1::IngestRequest> stream);
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const Tenant& t,
                                                        const v1::AppendTokensRequest& r);
  // With AttachRequest.device set, a session on another device is FAILED_PRECONDITION.
  absl::StatusOr<v1::AttachResponse> Attach(const Tenant& t, const v1::AttachRequest& r);
  absl::StatusOr<v1::DetachResponse> Detach(const Tenant& t, const v1::DetachRequest& r);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const Tenant& t,
                                                        const v1::GetStaticSetRequest& r);
  absl::StatusOr<v1::SlotTableResponse> SlotTable(const Tenant& t, const v1::SlotTableRequest& r);
  absl::StatusOr<v1::CommitStagedResponse> CommitStaged(const Tenant& t,
                                                        const v1::CommitStagedRequest& r);
  // A batch is served by one device: queries whose attachments are on different devices
  // are INVALID_ARGUMENT naming the first that differs.
  absl::Status Select(const Tenant& t, const SelectRequestView& r, SelectResult* out);
  absl::Status Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out);
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const Tenant& t, const v1::SelectAndReconstructRequest& r);
  absl::StatusOr<v1::AttendResponse> Attend(const Tenant& t, const v1::AttendRequest& r);
  absl::StatusOr<v1::SessionExport> ExportSession(const Tenant& t,
                                                  const v1::ExportSessionRequest& r);
  absl::StatusOr<Engine::SlotGeometry> AttachmentSlots(const Tenant& t,
                                                       const std::string& attachment_id);
  // Totals over the devices (budgets: each device's, as configured), and one
  // StatsResponse.devices entry per device.
  absl::StatusOr<v1::StatsResponse> Stats(const Tenant& t, const v1::StatsRequest& r);

  // Every device: the first error is returned, every device is drained.
  absl::Status Drain();
  bool draining() const;
  uint64_t LiveAttachments();
  int RunMaintenance();
  // The first device fault (Backend::DeviceFault, or the test failpoint of device_fault.h),
  // named by device; OK when none. A fault on any device stops the daemon.
  absl::Status DeviceFault() const;
  // Starts the injected spill faults of every device (SpillStorage::ArmFaults).
  void ArmFaults();

  // A tensor-parallel logical session (tensor_parallel.cc).
  struct TpRank {
    std::string session_id;  // the shard; empty: not joined
    bool joining = false;    // a create for this rank is under way
    int device = -1;
    uint32_t kv_begin = 0, kv_end = 0;
  };
  // What every rank of a logical session sends alike (CreateSessionRequest less device
  // and tensor_parallel's own range).
  struct TpCommon {
    std::string model, profile, label;
    uint64_t tokens_hash = 0;
    size_t tokens = 0;
    bool durable = false;
    int append_fsync = 0;
    std::vector<uint64_t> segment_ends;
  };
  struct TpGroup {
    std::string id, tenant;
    uint32_t ranks = 0, kv_heads = 0, query_heads = 0;
    std::optional<TpCommon> common;  // unset for a restored or forked group (complete)
    std::vector<TpRank> rank;
    std::string damage;  // found at restore: the group is not whole
    bool closing = false;
  };
 private:
  DeviceRouter() = default;
  // --- tensor_parallel.cc ---

  absl::StatusOr<v1::CreateSessionResponse> CreateTensorParallel(const Tenant& t,
                                                                 const v1::CreateSessionRequest& r);
  // A copy of the tenant's logical session `id`; nullopt when there is none.
  std::optional<TpGroup> FindGroup(const Tenant& t, const std::string& id) const;
  // FAILED_PRECONDITION when `id` is one of the tenant's logical sessions (`call` is a
  // per-shard call); OK otherwise.
  absl::Status CheckNotLogical(const Tenant& t, std::string_view id, std::string_view call) const;
  // The logical SessionInfo; NOT_FOUND when every shard is gone (e.g. idle expiry) and no
  // rank is joining, after which the caller forgets it (ForgetGoneGroup).
  absl::StatusOr<v1::SessionInfo> LogicalInfo(const Tenant& t, const TpGroup& g);
  void ForgetGoneGroup(const std::string& id);
  absl::StatusOr<v1::ForkSessionResponse> ForkLogical(const Tenant& t, const TpGroup& g,
                                                      const v1::ForkSessionRequest& r);
  absl::StatusOr<v1::CloseSessionResponse> CloseLogical(const Tenant& t, const std::string& id);
  // At Open: the logical sessions of the shards the engines restored.
  void RestoreTensorParallel();

  mutable base::Mutex tp_mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<TpGroup>> tp_groups_ ABSL_GUARDED_BY(tp_mu_);
  // The device of a batch's attachments, or INVALID_ARGUMENT for a mixed batch.
  template <typename Ids>
  absl::StatusOr<int> BatchDevice(const Ids& ids) const;
  std::vector<Device> devices_;
};

}  // namespace kvshade::service

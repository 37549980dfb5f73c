// Engine: everything the kvshade.v1.KvShade service does, without the transport. Each
// operation takes the authenticated Tenant and returns an absl::Status whose code is the
// gRPC code to answer with (validation in model.h; rules in docs/DESIGN.md "Sessions"
// and docs/API.md "Workers"). The decode path (Select, Attend) speaks the domain types of
// decode.h, views over the caller's bytes, so that the UCX data plane's binary frames
// reach it without a message in between; the control calls take and return v1 messages.
//
// Storage it creates from the ServerConfig: the DeviceArena (device_budget_bytes; factors,
// landmarks, static sets, slot tables, per-call scratch), the HostValueStore
// (host_budget_bytes; sealed segments' values, LRU spill) and the prefix index. The spill
// tier (spill target and durable sessions) it is given: whoever composes the engine opens
// it (the Server: a RocksSpillTier on spill_path) and hands it over as
// EngineOptions::spill_tier, so that a test can put a FaultInjectingSpillTier in front.
//
// Threading: every operation may be called from any thread. No global lock on the decode
// path: SelectAndReconstruct and Attend take the registry lock briefly to resolve ids, then
// each session's lock shared (appends take it exclusively) and each attachment's own lock.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/decode.h"
#include "kvshade/service/metrics.h"
#include "kvshade/service/session_manager.h"
#include "kvshade/service/slot_layout.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::storage {
class SpillTier;
}

namespace kvshade::service {

struct EngineOptions {
  Clock clock;                   // default: system clock (leases)
  bool background_thread = true; // lease reaper + background refactorization; when off,
                                 // RunMaintenance() does that work (tests)
  // The spill tier: LRU spill target of the host value store and home of durable sessions
  // (restored from it by Create). Not owned; must outlive the engine. Null: no spill tier,
  // and durable sessions are refused (FAILED_PRECONDITION).
  storage::SpillTier* spill_tier = nullptr;
  // The device this engine serves (docs/OPERATIONS.md "Devices"): its name as the daemon
  // reports it (SessionInfo.device, StatsResponse.devices; default "cpu"/"cuda" from the
  // backend) and its PCI bus id (CUDA; may be empty).
  std::string device_name;
  std::string device_pci_bus_id;
  // Its index in a daemon with several devices (DeviceRouter): the session and attachment
  // ids it creates carry it (SessionManager::NewId(device)), so that a call is routed to
  // this engine from its id alone. -1: the daemon's only device; ids are untagged.
  int device_index = -1;
  // The gpu label of this engine's gauges (Metrics::UseDeviceLabels); "" unlabelled.
  std::string metrics_gpu;
};

class EngineImpl;
class EngineInternals;

class Engine {
 public:
  // backend, config and metrics must outlive the engine. Restores durable sessions from
  // the spill tier (options.spill_tier).
  static absl::StatusOr<std::unique_ptr<Engine>> Create(kernels::Backend* backend,
                                                        const ServerConfig* config,
                                                        Metrics* metrics,
                                                        EngineOptions options = {});
  ~Engine();

  // With r.tensor_parallel, the session is a tensor-parallel shard: rank
  // tensor_parallel.rank's slice of r.model (SliceModel) in logical session
  // tensor_parallel.session_id, which must be set (DeviceRouter assigns it and checks the
  // ranks against each other).
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const Tenant& t,
                                                          const v1::CreateSessionRequest& r);
  // A shard as the parent is FAILED_PRECONDITION: ForkShard forks it.
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const Tenant& t,
                                                      const v1::ForkSessionRequest& r);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const Tenant& t,
                                                        const v1::LookupPrefixRequest& r);
  absl::StatusOr<v1::SessionInfo> GetSession(const Tenant& t, const v1::GetSessionRequest& r);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const Tenant& t,
                                                        const v1::ListSessionsRequest& r);
  // A shard is FAILED_PRECONDITION: CloseShard closes it.
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const Tenant& t,
                                                        const v1::CloseSessionRequest& r);

  // Tensor-parallel shards (docs/DESIGN.md "Tensor-parallel sessions"), for DeviceRouter,
  // which keeps the logical sessions. ForkShard forks the shard parent_session_id (the
  // rules of ForkSession) into a shard of the same rank and heads of logical session
  // `logical_id`; CloseShard closes a shard (or any session) as CloseSession does.
  absl::StatusOr<v1::ForkSessionResponse> ForkShard(const Tenant& t, const v1::ForkSessionRequest& r,
                                                    const std::string& logical_id);
  absl::StatusOr<v1::CloseSessionResponse> CloseShard(const Tenant& t,
                                                      const v1::CloseSessionRequest& r);
  // Every tenant's shards, as restored or created.
  struct ShardRecord {
    std::string tenant, session_id, logical_id;
    int ranks = 0, rank = 0;
    int kv_head_begin = 0, kv_head_end = 0, kv_heads = 0;
    int query_heads = 0;  // the whole model's
    std::string damage;   // non-empty: the shard is damaged (what it lost)
  };
  std::vector<ShardRecord> TensorParallelShards();
  // Marks a shard damaged (not served from then on; DATA_LOSS naming `what`): its logical
  // session is not whole. Not written to the spill tier (every start finds it again).
  absl::Status MarkShardDamaged(const Tenant& t, const std::string& session_id,
                                const std::string& what);

  // One Ingest stream: Begin with the header, Add each following message (layer parts,
  // then the commit), then Finish once the stream has ended cleanly (gRPC: the client
  // half-closed after the commit; UCX: the commit message ends the stream). The commit
  // takes effect only in Finish: a stream that fails (any Add error, a message after the
  // commit) or is destroyed before Finish commits nothing and discards everything it
  // received (the session stays "ingesting" and may be ingested again).
  class IngestStream {
   public:
    virtual ~IngestStream() = default;
    // A layer part or the commit (checked: every layer complete). A message after the
    // commit is INVALID_ARGUMENT; after any error the stream is failed.
    virtual absl::Status Add(const v1::IngestRequest& msg) = 0;
    // A layer part as views (decode.h), the same rules as a layer message to Add; the
    // views need to stay valid for the call only.
    virtual absl::Status AddLayer(const IngestLayerView& part) = 0;
    // Applies the accepted commit (the session becomes ready) and returns the response.
    // INVALID_ARGUMENT without a commit; FAILED_PRECONDITION after a failure or a Finish.
    virtual absl::StatusOr<v1::IngestResponse> Finish() = 0;
  };
  absl::StatusOr<std::unique_ptr<IngestStream>> BeginIngest(const Tenant& t,
                                                            const v1::IngestRequest& header);
  // The whole stream at once (header first, commit last), finished when it is all added.
  absl::StatusOr<v1::IngestResponse> Ingest(const Tenant& t,
                                            absl::Span<const v1::IngestRequest> stream);

  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const Tenant& t,
                                                        const v1::AppendTokensRequest& r);
  absl::StatusOr<v1::AttachResponse> Attach(const Tenant& t, const v1::AttachRequest& r);
  absl::StatusOr<v1::DetachResponse> Detach(const Tenant& t, const v1::DetachRequest& r);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const Tenant& t,
                                                        const v1::GetStaticSetRequest& r);
  // Reads back (and with `reset`, empties) an attachment's slot tables (slot_table.cc).
  absl::StatusOr<v1::SlotTableResponse> SlotTable(const Tenant& t, const v1::SlotTableRequest& r);
  // Appends or discards an attachment's held staged token (stage_hold).
  absl::StatusOr<v1::CommitStagedResponse> CommitStaged(const Tenant& t, const v1::CommitStagedRequest& r);
  // The decode path in domain types (decode.h): the data planes' entry points. `out` is
  // reset and filled; on error its contents are unspecified. Rules as the v1 RPCs.
  absl::Status Select(const Tenant& t, const SelectRequestView& r, SelectResult* out);
  absl::Status Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out);
  // The same for v1 messages (wire.cc translates both ways; the gRPC service's form).
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const Tenant& t, const v1::SelectAndReconstructRequest& r);
  absl::StatusOr<v1::AttendResponse> Attend(const Tenant& t, const v1::AttendRequest& r);
  // Same-node decode: a generation of the attachment's session state, named by shared
  // memory regions a worker on this node maps (docs/DESIGN.md "Same-node decode").
  absl::StatusOr<v1::SessionExport> ExportSession(const Tenant& t,
                                                  const v1::ExportSessionRequest& r);

  // The slot-buffer geometry of an attachment the tenant owns, for data planes that write
  // into a worker's registered slot buffers (v1.CudaIpcSlotBuffers has the layout).
  struct SlotGeometry : SlotLayout {
    v1::DeliveryMode delivery = v1::DELIVERY_MODE_INLINE;
  };
  absl::StatusOr<SlotGeometry> AttachmentSlots(const Tenant& t, const std::string& attachment_id);
  absl::StatusOr<v1::StatsResponse> Stats(const Tenant& t, const v1::StatsRequest& r);

  // Stops new sessions, ingests, attachments and appends (UNAVAILABLE), finishes
  // background work, and writes durable sessions' state through. Idempotent.
  absl::Status Drain();
  bool draining() const;
  // Live attachments of every tenant (a drain serves reads while there are any).
  uint64_t LiveAttachments();

  // Reaps expired leases and runs pending refactorizations now (what the background
  // thread does). Returns the number of refactorizations completed.
  int RunMaintenance();

 private:
  friend class EngineInternals;  // the engine's tests and fuzzer (service/engine_internals.h)
  explicit Engine(std::unique_ptr<EngineImpl> impl);
  std::unique_ptr<EngineImpl> impl_;
};

}  // namespace kvshade::service

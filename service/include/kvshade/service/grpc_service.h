// KvShadeService: the kvshade.v1.KvShade gRPC service. A thin shell over the Engine
// (engine.h): it authenticates the caller (the tenant comes from the Authenticator, never
// from a request), admits the call under its tenant's limits, runs the engine operation,
// records per-RPC latency and error metrics, and turns absl::Status into grpc::Status
// (status_util.h). All behaviour (sessions, ingest, select, attend, validation) lives in
// the Engine so that it can be tested without a transport.
//
// Threads (docs/OPERATIONS.md "Limits on streams and calls"): the service is a gRPC
// callback service. Its handlers run on gRPC's threads and never block: they authenticate
// and admit the call (TenantAdmission: a tenant at limits.max_calls_per_tenant or
// limits.max_streams_per_tenant is refused by name before it takes any thread), then hand
// the work to the daemon's own threads (CallExecutor, worker_threads of them), in turns
// between tenants. An Ingest stream takes a thread only while one of its messages is
// processed: waiting for the client it holds none, and its waits are bounded by the idle
// timeout and the minimum-progress rule (StreamPace).
//
// Life cycle: the Server builds the engine (which restores durable sessions) and lends it
// to Create(); the Server registers the service; Drain() stops new sessions and flushes
// durable state before the server stops. The
// service must outlive the grpc::Server it is registered with (its threads finish the
// calls the server waits for when it shuts down).
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <string_view>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/metrics.h"
#include "kvshade/v1/kvshade.grpc.pb.h"

namespace kvshade::storage {
class SpillTier;
}

namespace kvshade::service {

class CallExecutor;
class DeviceRouter;
class StreamWatchdog;
class TenantAdmission;
class UcxServer;

// What the service borrows from its owner (the Server). All must outlive the service;
// none but ucx may be null.
struct ServiceDeps {
  // The daemon's devices and their engines, which the calls are routed to (the UCX data
  // plane borrows the same); a fault of any device refuses calls.
  DeviceRouter* engine = nullptr;
  const ServerConfig* config = nullptr;
  Metrics* metrics = nullptr;
  const Authenticator* auth = nullptr;
  // The daemon's one admission per tenant (limits.max_calls_per_tenant,
  // max_streams_per_tenant): the UCX data plane admits its calls and streams into the same
  // counts, so that a tenant's caps hold across both transports.
  TenantAdmission* admission = nullptr;
  // Optional: the UCX data plane. When set, Attach hands out its worker address and a
  // one-time admission token; when null (ucx.enable off), Attach leaves them empty.
  UcxServer* ucx = nullptr;
};

class KvShadeService final : public kvshade::v1::KvShade::CallbackService {
 public:
  static absl::StatusOr<std::unique_ptr<KvShadeService>> Create(const ServiceDeps& deps);
  ~KvShadeService() override;

  // Stops accepting new sessions, forks, ingests, attachments and appends (UNAVAILABLE),
  // ends every open Ingest stream with UNAVAILABLE (nothing of it is committed; an idle
  // stream must not hold the shutdown), waits for background refactorizations, and
  // flushes durable sessions to the spill tier. Reads keep being served. Idempotent.
  absl::Status Drain();

  grpc::ServerUnaryReactor* CreateSession(grpc::CallbackServerContext* ctx,
                                          const v1::CreateSessionRequest* req,
                                          v1::CreateSessionResponse* resp) override;
  grpc::ServerUnaryReactor* ForkSession(grpc::CallbackServerContext* ctx,
                                        const v1::ForkSessionRequest* req,
                                        v1::ForkSessionResponse* resp) override;
  grpc::ServerUnaryReactor* LookupPrefix(grpc::CallbackServerContext* ctx,
                                         const v1::LookupPrefixRequest* req,
                                         v1::LookupPrefixResponse* resp) override;
  grpc::ServerUnaryReactor* GetSession(grpc::CallbackServerContext* ctx,
                                       const v1::GetSessionRequest* req,
                                       v1::SessionInfo* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* ctx,
                                         const v1::CloseSessionRequest* req,
                                         v1::CloseSessionResponse* resp) override;
  grpc::ServerReadReactor<v1::IngestRequest>* Ingest(grpc::CallbackServerContext* ctx,
                                                     v1::IngestResponse* resp) override;
  grpc::ServerUnaryReactor* AppendTokens(grpc::CallbackServerContext* ctx,
                                         const v1::AppendTokensRequest* req,
                                         v1::AppendTokensResponse* resp) override;
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* ctx, const v1::AttachRequest* req,
                                   v1::AttachResponse* resp) override;
  grpc::ServerUnaryReactor* Detach(grpc::CallbackServerContext* ctx, const v1::DetachRequest* req,
                                   v1::DetachResponse* resp) override;
  grpc::ServerUnaryReactor* GetStaticSet(grpc::CallbackServerContext* ctx,
                                         const v1::GetStaticSetRequest* req,
                                         v1::GetStaticSetResponse* resp) override;
  grpc::ServerUnaryReactor* SlotTable(grpc::CallbackServerContext* ctx,
                                      const v1::SlotTableRequest* req,
                                      v1::SlotTableResponse* resp) override;
  grpc::ServerUnaryReactor* CommitStaged(grpc::CallbackServerContext* ctx,
                                         const v1::CommitStagedRequest* req,
                                         v1::CommitStagedResponse* resp) override;
  grpc::ServerUnaryReactor* SelectAndReconstruct(grpc::CallbackServerContext* ctx,
                                                 const v1::SelectAndReconstructRequest* req,
                                                 v1::SelectAndReconstructResponse* resp) override;
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* ctx, const v1::AttendRequest* req,
                                   v1::AttendResponse* resp) override;
  grpc::ServerUnaryReactor* ExportSession(grpc::CallbackServerContext* ctx,
                                          const v1::ExportSessionRequest* req,
                                          v1::SessionExport* resp) override;
  grpc::ServerUnaryReactor* Stats(grpc::CallbackServerContext* ctx, const v1::StatsRequest* req,
                                  v1::StatsResponse* resp) override;

 private:
  class IngestCall;

  explicit KvShadeService(const ServiceDeps& deps);

  // A unary call: authenticate and admit it here (on gRPC's thread), run `op` (Tenant ->
  // StatusOr<Resp>) on a call thread, fill `resp` and finish.
  template <typename Resp, typename Op>
  grpc::ServerUnaryReactor* Unary(std::string_view method, grpc::CallbackServerContext* ctx,
                                  Resp* resp, Op op);
  // Latency and error metrics and the log line of a call that ends with `st`.
  void Record(std::string_view method, std::chrono::steady_clock::time_point start,
              const absl::Status& st, std::string_view tenant) const;
  bool draining() const;

  ServiceDeps deps_;
  DeviceRouter* const engine_;  // deps_.engine
  std::unique_ptr<StreamWatchdog> watchdog_;
  // Open Ingest calls, so that Drain can end them.
  mutable std::mutex streams_mu_;
  std::set<grpc::CallbackServerContext*> ingest_calls_;
  bool draining_ = false;
  // Last: destroyed first, after running what is still queued (nothing, once the server
  // has shut down), while everything its jobs use is still there.
  std::unique_ptr<CallExecutor> executor_;
};

}  // namespace kvshade::service

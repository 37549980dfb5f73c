// KvShadeService: the kvshade.v1.KvShade gRPC service. A thin shell over the Engine
// (engine.h): it authenticates the caller (the tenant comes from the Authenticator, never
// from a request), runs the engine operation, records per-RPC latency and error metrics,
// and turns absl::Status into grpc::Status (status_util.h). All behaviour (sessions,
// ingest, select, attend, validation) lives in the Engine so that it can be tested
// without a transport.
//
// Life cycle: Create() builds the engine on the spill tier it is given (and its memory
// tiers from the config) and restores durable sessions; the Server registers the service; Drain() stops new
// sessions and flushes durable state before the server stops.
#pragma once

#include <memory>
#include <mutex>
#include <set>

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

class Engine;
class UcxServer;

// What the service borrows from its owner (the Server). All must outlive the service;
// none but spill_tier and ucx may be null. The memory tiers (device arena, host value
// store) and the prefix index are created by the engine itself from `config`.
struct ServiceDeps {
  kernels::Backend* backend = nullptr;
  const ServerConfig* config = nullptr;
  Metrics* metrics = nullptr;
  const Authenticator* auth = nullptr;
  // The spill tier the engine spills to and keeps durable sessions in (the Server opens it
  // on spill_path); null: none (no spill, no durable sessions).
  storage::SpillTier* spill_tier = nullptr;
  // Optional: the UCX data plane. When set, Attach hands out its worker address and a
  // one-time admission token; when null (ucx.enable off), Attach leaves them empty.
  UcxServer* ucx = nullptr;
};

class KvShadeService final : public kvshade::v1::KvShade::Service {
 public:
  static absl::StatusOr<std::unique_ptr<KvShadeService>> Create(const ServiceDeps& deps);
  ~KvShadeService() override;

  // Stops accepting new sessions, forks, ingests, attachments and appends (UNAVAILABLE),
  // ends every open Ingest stream with UNAVAILABLE (nothing of it is committed; an idle
  // stream must not hold the shutdown), waits for background refactorizations, and
  // flushes durable sessions to the spill tier. Reads keep being served. Idempotent.
  absl::Status Drain();

  Engine& engine() { return *engine_; }

  grpc::Status CreateSession(grpc::ServerContext* ctx, const v1::CreateSessionRequest* req,
                             v1::CreateSessionResponse* resp) override;
  grpc::Status ForkSession(grpc::ServerContext* ctx, const v1::ForkSessionRequest* req,
                           v1::ForkSessionResponse* resp) override;
  grpc::Status LookupPrefix(grpc::ServerContext* ctx, const v1::LookupPrefixRequest* req,
                            v1::LookupPrefixResponse* resp) override;
  grpc::Status GetSession(grpc::ServerContext* ctx, const v1::GetSessionRequest* req,
                          v1::SessionInfo* resp) override;
  grpc::Status ListSessions(grpc::ServerContext* ctx, const v1::ListSessionsRequest* req,
                            v1::ListSessionsResponse* resp) override;
  grpc::Status CloseSession(grpc::ServerContext* ctx, const v1::CloseSessionRequest* req,
                            v1::CloseSessionResponse* resp) override;
  grpc::Status Ingest(grpc::ServerContext* ctx,
                      grpc::ServerReader<v1::IngestRequest>* reader,
                      v1::IngestResponse* resp) override;
  grpc::Status AppendTokens(grpc::ServerContext* ctx, const v1::AppendTokensRequest* req,
                            v1::AppendTokensResponse* resp) override;
  grpc::Status Attach(grpc::ServerContext* ctx, const v1::AttachRequest* req,
                      v1::AttachResponse* resp) override;
  grpc::Status Detach(grpc::ServerContext* ctx, const v1::DetachRequest* req,
                      v1::DetachResponse* resp) override;
  grpc::Status GetStaticSet(grpc::ServerContext* ctx, const v1::GetStaticSetRequest* req,
                            v1::GetStaticSetResponse* resp) override;
  grpc::Status SlotTable(grpc::ServerContext* ctx, const v1::SlotTableRequest* req,
                         v1::SlotTableResponse* resp) override;
  grpc::Status CommitStaged(grpc::ServerContext* ctx, const v1::CommitStagedRequest* req,
                            v1::CommitStagedResponse* resp) override;
  grpc::Status SelectAndReconstruct(grpc::ServerContext* ctx,
                                    const v1::SelectAndReconstructRequest* req,
                                    v1::SelectAndReconstructResponse* resp) override;
  grpc::Status Attend(grpc::ServerContext* ctx, const v1::AttendRequest* req,
                      v1::AttendResponse* resp) override;
  grpc::Status ExportSession(grpc::ServerContext* ctx, const v1::ExportSessionRequest* req,
                             v1::SessionExport* resp) override;
  grpc::Status Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req,
                     v1::StatsResponse* resp) override;

 private:
  KvShadeService(const ServiceDeps& deps, std::unique_ptr<Engine> engine);

  ServiceDeps deps_;
  std::unique_ptr<Engine> engine_;
  // Open Ingest calls, so that Drain can end them.
  std::mutex streams_mu_;
  std::set<grpc::ServerContext*> ingest_calls_;
  bool draining_ = false;
};

}  // namespace kvshade::service

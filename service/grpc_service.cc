// KvShadeService: authenticate, run the engine operation, record metrics, convert the
// status. Nothing else happens here (see grpc_service.h).
#include "kvshade/service/grpc_service.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/ucx_server.h"
#include "status_util.h"

namespace kvshade::service {
namespace {

// Runs one unary RPC: authenticate, call `op` (Tenant -> StatusOr<Resp>), fill `out`,
// observe latency and errors.
template <typename Resp, typename Op>
grpc::Status Run(const ServiceDeps& deps, std::string_view method, grpc::ServerContext* ctx,
                 Resp* out, Op&& op) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status st;
  absl::StatusOr<Tenant> tenant = deps.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    st = tenant.status();
  } else {
    absl::StatusOr<Resp> r = op(*tenant);
    if (r.ok()) {
      *out = std::move(r).value();
    } else {
      st = r.status();
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int code = static_cast<int>(st.code());
  deps.metrics->ObserveRpc(method, code, secs);
  if (!st.ok()) deps.metrics->Error(code);
  return ToGrpcStatus(st);
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvShadeService>> KvShadeService::Create(const ServiceDeps& deps) {
  if (deps.backend == nullptr || deps.config == nullptr || deps.metrics == nullptr ||
      deps.auth == nullptr) {
    return absl::InvalidArgumentError(
        "KvShadeService::Create: backend, config, metrics and auth must all be set");
  }
  auto engine = Engine::Create(deps.backend, deps.config, deps.metrics);
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<KvShadeService>(new KvShadeService(deps, std::move(engine).value()));
}

KvShadeService::KvShadeService(const ServiceDeps& deps, std::unique_ptr<Engine> engine)
    : deps_(deps), engine_(std::move(engine)) {}

KvShadeService::~KvShadeService() = default;

absl::Status KvShadeService::Drain() { return engine_->Drain(); }

grpc::Status KvShadeService::CreateSession(grpc::ServerContext* ctx,
                                           const v1::CreateSessionRequest* req,
                                           v1::CreateSessionResponse* resp) {
  return Run(deps_, "CreateSession", ctx, resp,
             [&](const Tenant& t) { return engine_->CreateSession(t, *req); });
}

grpc::Status KvShadeService::ForkSession(grpc::ServerContext* ctx,
                                         const v1::ForkSessionRequest* req,
                                         v1::ForkSessionResponse* resp) {
  return Run(deps_, "ForkSession", ctx, resp,
             [&](const Tenant& t) { return engine_->ForkSession(t, *req); });
}

grpc::Status KvShadeService::LookupPrefix(grpc::ServerContext* ctx,
                                          const v1::LookupPrefixRequest* req,
                                          v1::LookupPrefixResponse* resp) {
  return Run(deps_, "LookupPrefix", ctx, resp,
             [&](const Tenant& t) { return engine_->LookupPrefix(t, *req); });
}

grpc::Status KvShadeService::GetSession(grpc::ServerContext* ctx,
                                        const v1::GetSessionRequest* req,
                                        v1::SessionInfo* resp) {
  return Run(deps_, "GetSession", ctx, resp,
             [&](const Tenant& t) { return engine_->GetSession(t, *req); });
}

grpc::Status KvShadeService::ListSessions(grpc::ServerContext* ctx,
                                          const v1::ListSessionsRequest* req,
                                          v1::ListSessionsResponse* resp) {
  return Run(deps_, "ListSessions", ctx, resp,
             [&](const Tenant& t) { return engine_->ListSessions(t, *req); });
}

grpc::Status KvShadeService::CloseSession(grpc::ServerContext* ctx,
                                          const v1::CloseSessionRequest* req,
                                          v1::CloseSessionResponse* resp) {
  return Run(deps_, "CloseSession", ctx, resp,
             [&](const Tenant& t) { return engine_->CloseSession(t, *req); });
}

grpc::Status KvShadeService::Ingest(grpc::ServerContext* ctx,
                                    grpc::ServerReader<v1::IngestRequest>* reader,
                                    v1::IngestResponse* resp) {
  return Run(deps_, "Ingest", ctx, resp,
             [&](const Tenant& t) -> absl::StatusOr<v1::IngestResponse> {
               v1::IngestRequest msg;
               if (!reader->Read(&msg)) {
                 return absl::InvalidArgumentError(
                     "Ingest: the stream is empty; the first message must be the header");
               }
               auto stream = engine_->BeginIngest(t, msg);
               if (!stream.ok()) return stream.status();
               // Every message up to the client's half-close: one after the commit fails
               // the stream (and so the commit) like any other bad message.
               while (reader->Read(&msg)) {
                 if (absl::Status st = (*stream)->Add(msg); !st.ok()) return st;
               }
               if (ctx->IsCancelled()) {
                 return absl::CancelledError(
                     "Ingest: the client cancelled the stream; nothing was committed");
               }
               // The stream ended cleanly: its commit takes effect now.
               return (*stream)->Finish();
             });
}

grpc::Status KvShadeService::AppendTokens(grpc::ServerContext* ctx,
                                          const v1::AppendTokensRequest* req,
                                          v1::AppendTokensResponse* resp) {
  return Run(deps_, "AppendTokens", ctx, resp,
             [&](const Tenant& t) { return engine_->AppendTokens(t, *req); });
}

grpc::Status KvShadeService::Attach(grpc::ServerContext* ctx, const v1::AttachRequest* req,
                                    v1::AttachResponse* resp) {
  return Run(deps_, "Attach", ctx, resp,
             [&](const Tenant& t) -> absl::StatusOr<v1::AttachResponse> {
               auto r = engine_->Attach(t, *req);
               if (r.ok() && deps_.ucx != nullptr) {
                 // The token is bound to this caller's tenant and admits one UCX client.
                 r->set_data_plane_address(deps_.ucx->address());
                 r->set_data_plane_token(deps_.ucx->IssueToken(t));
               }
               return r;
             });
}

grpc::Status KvShadeService::Detach(grpc::ServerContext* ctx, const v1::DetachRequest* req,
                                    v1::DetachResponse* resp) {
  return Run(deps_, "Detach", ctx, resp,
             [&](const Tenant& t) { return engine_->Detach(t, *req); });
}

grpc::Status KvShadeService::GetStaticSet(grpc::ServerContext* ctx,
                                          const v1::GetStaticSetRequest* req,
                                          v1::GetStaticSetResponse* resp) {
  return Run(deps_, "GetStaticSet", ctx, resp,
             [&](const Tenant& t) { return engine_->GetStaticSet(t, *req); });
}

grpc::Status KvShadeService::SelectAndReconstruct(grpc::ServerContext* ctx,
                                                  const v1::SelectAndReconstructRequest* req,
                                                  v1::SelectAndReconstructResponse* resp) {
  return Run(deps_, "SelectAndReconstruct", ctx, resp,
             [&](const Tenant& t) { return engine_->SelectAndReconstruct(t, *req); });
}

grpc::Status KvShadeService::Attend(grpc::ServerContext* ctx, const v1::AttendRequest* req,
                                    v1::AttendResponse* resp) {
  return Run(deps_, "Attend", ctx, resp,
             [&](const Tenant& t) { return engine_->Attend(t, *req); });
}

grpc::Status KvShadeService::ExportSession(grpc::ServerContext* ctx,
                                           const v1::ExportSessionRequest* req,
                                           v1::SessionExport* resp) {
  return Run(deps_, "ExportSession", ctx, resp,
             [&](const Tenant& t) { return engine_->ExportSession(t, *req); });
}

grpc::Status KvShadeService::Stats(grpc::ServerContext* ctx, const v1::StatsRequest* req,
                                   v1::StatsResponse* resp) {
  return Run(deps_, "Stats", ctx, resp,
             [&](const Tenant& t) { return engine_->Stats(t, *req); });
}

}  // namespace kvshade::service

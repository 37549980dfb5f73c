// KvShadeService: authenticate, run the engine operation, record metrics, convert the
// status. Nothing else happens here (see grpc_service.h).
#include "kvshade/service/grpc_service.h"

#include <grpc/grpc.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/log.h"
#include "kvshade/service/ucx_server.h"
#include "device_fault.h"
#include "status_util.h"

namespace kvshade::service {
namespace {

// A tenant's share of a counted resource of one service (`owner`): its calls in flight
// (limits.max_calls_per_tenant) or its open Ingest streams (limits.max_streams_per_tenant).
// Held from construction while under `cap`; released by the destructor.
class TenantSlot {
 public:
  TenantSlot(const void* owner, std::string tenant, uint32_t cap)
      : key_(owner, std::move(tenant)) {
    std::lock_guard<std::mutex> lock(Mu());
    uint32_t& open = Open()[key_];
    held_ = open < cap;
    if (held_) ++open;
    if (open == 0) Open().erase(key_);
  }
  ~TenantSlot() {
    if (!held_) return;
    std::lock_guard<std::mutex> lock(Mu());
    auto it = Open().find(key_);
    if (it != Open().end() && --it->second == 0) Open().erase(it);
  }
  TenantSlot(const TenantSlot&) = delete;
  TenantSlot& operator=(const TenantSlot&) = delete;
  bool held() const { return held_; }

 private:
  using Key = std::pair<const void*, std::string>;
  static std::mutex& Mu() {
    static std::mutex* mu = new std::mutex();
    return *mu;
  }
  static std::map<Key, uint32_t>& Open() {
    static auto* open = new std::map<Key, uint32_t>();
    return *open;
  }
  Key key_;
  bool held_ = false;
};

// Runs one RPC: authenticate, take one of the tenant's call slots, call `op` (Tenant ->
// StatusOr<Resp>), fill `out`, observe latency and errors.
template <typename Resp, typename Op>
grpc::Status Run(const ServiceDeps& deps, std::string_view method, grpc::ServerContext* ctx,
                 Resp* out, Op&& op) {
  const auto start = std::chrono::steady_clock::now();
  absl::Status st;
  absl::StatusOr<Tenant> tenant = deps.auth->Authenticate(*ctx);
  // Calls in flight per tenant (service/README.md "Limits on streams and calls"): each
  // holds a sync-server thread, so one tenant must not be able to take them all.
  const uint32_t call_cap = EffectiveMaxCallsPerTenant(*deps.config);
  std::optional<TenantSlot> call;
  if (tenant.ok() && call_cap != 0) call.emplace(&deps, tenant->name, call_cap);
  if (!tenant.ok()) {
    st = tenant.status();
  } else if (call && !call->held()) {
    st = absl::ResourceExhaustedError(absl::StrCat(
        std::string(method), ": tenant '", tenant->name, "' already has ", call_cap,
        " calls in flight (limits.max_calls_per_tenant); retry when one has ended"));
  } else if (absl::Status fault = DeviceFault(*deps.backend); !fault.ok()) {
    // The device is gone for this process: nothing can be served; the server is exiting.
    st = absl::UnavailableError(absl::StrCat(
        std::string(method), ": this daemon's device failed (", fault.message(),
        "); it is restarting, and its durable sessions come back with it: retry after the "
        "restart or on another replica"));
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
  log::Rpc(method, st, secs, tenant.ok() ? std::string_view(tenant->name) : std::string_view());
  return ToGrpcStatus(st);
}

// Limits on Ingest streams (service/README.md "Limits on streams and calls"). A gRPC Ingest
// stream holds a sync-server thread for as long as it is open, so a client that opens streams and
// sends nothing could take the whole pool (worker_threads) from everyone.

// Ends idle streams: while a handler waits for the next message its call is armed with a
// deadline, and one thread cancels the calls whose deadline passes with DEADLINE_EXCEEDED
// and a message. A server-side cancel that carries a status goes to the client as the
// call's status (like a server-side deadline); the blocked Read returns at once and the
// thread goes back to the pool. Process-wide: one thread serves every service.
class IdleStreamWatchdog {
 public:
  using Clock = std::chrono::steady_clock;

  static IdleStreamWatchdog& Get() {
    static IdleStreamWatchdog* w = new IdleStreamWatchdog();  // never destroyed: detached thread
    return *w;
  }

  // Cancels `ctx`'s call at `deadline` with `message` unless disarmed first. `ctx` must stay
  // valid until Disarm.
  uint64_t Arm(grpc::ServerContext* ctx, Clock::time_point deadline, std::string message) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    armed_.emplace(id, Entry{ctx, deadline, std::move(message), false});
    cv_.notify_one();
    return id;
  }

  // True when the deadline had passed and the call was cancelled.
  bool Disarm(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = armed_.find(id);
    if (it == armed_.end()) return false;
    const bool fired = it->second.fired;
    armed_.erase(it);
    return fired;
  }

 private:
  struct Entry {
    grpc::ServerContext* ctx;
    Clock::time_point deadline;
    std::string message;
    bool fired;
  };

  IdleStreamWatchdog() { std::thread([this] { Loop(); }).detach(); }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      auto earliest = Clock::time_point::max();
      for (const auto& [id, e] : armed_) {
        if (!e.fired) earliest = std::min(earliest, e.deadline);
      }
      if (earliest == Clock::time_point::max()) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, earliest);
      }
      const auto now = Clock::now();
      for (auto& [id, e] : armed_) {
        if (e.fired || e.deadline > now) continue;
        e.fired = true;
        // Under mu_: Disarm (and so the handler's return) waits for this call.
        grpc_call_cancel_with_status(e.ctx->c_call(), GRPC_STATUS_DEADLINE_EXCEEDED,
                                     e.message.c_str(), nullptr);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> armed_;
  uint64_t next_id_ = 1;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvShadeService>> KvShadeService::Create(const ServiceDeps& deps) {
  if (deps.backend == nullptr || deps.config == nullptr || deps.metrics == nullptr ||
      deps.auth == nullptr) {
    return absl::InvalidArgumentError(
        "KvShadeService::Create: backend, config, metrics and auth must all be set");
  }
  EngineOptions options;
  options.spill_tier = deps.spill_tier;
  auto engine = Engine::Create(deps.backend, deps.config, deps.metrics, std::move(options));
  if (!engine.ok()) return engine.status();
  return std::unique_ptr<KvShadeService>(new KvShadeService(deps, std::move(engine).value()));
}

KvShadeService::KvShadeService(const ServiceDeps& deps, std::unique_ptr<Engine> engine)
    : deps_(deps), engine_(std::move(engine)) {}

KvShadeService::~KvShadeService() = default;

constexpr char kDrainingIngest[] =
    "Ingest: the server is draining (shutting down); the stream is ended and nothing was "
    "committed; retry on another replica";

absl::Status KvShadeService::Drain() {
  {
    // Under streams_mu_: a handler unregisters (and so returns) only after this.
    std::lock_guard<std::mutex> lock(streams_mu_);
    draining_ = true;
    for (grpc::ServerContext* ctx : ingest_calls_) {
      grpc_call_cancel_with_status(ctx->c_call(), GRPC_STATUS_UNAVAILABLE, kDrainingIngest,
                                   nullptr);
    }
  }
  return engine_->Drain();
}

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
               // Limits on streams (above): a slot of the tenant's, and an idle timeout on
               // every wait for the next message.
               const uint32_t cap = EffectiveMaxStreamsPerTenant(*deps_.config);
               TenantSlot slot(this, t.name, cap);
               if (!slot.held()) {
                 return absl::ResourceExhaustedError(absl::StrCat(
                     "Ingest: tenant '", t.name, "' already has ", cap,
                     " open Ingest streams (limits.max_streams_per_tenant); finish or cancel "
                     "one, or retry later"));
               }
               // Drain ends open streams (they would hold the shutdown).
               struct Registration {
                 KvShadeService* self;
                 grpc::ServerContext* ctx;
                 bool added = false;
                 ~Registration() {
                   if (!added) return;
                   std::lock_guard<std::mutex> lock(self->streams_mu_);
                   self->ingest_calls_.erase(ctx);
                 }
               } registration{this, ctx};
               {
                 std::lock_guard<std::mutex> lock(streams_mu_);
                 if (draining_) return absl::UnavailableError(kDrainingIngest);
                 ingest_calls_.insert(ctx);
                 registration.added = true;
               }
               auto drained = [&] {
                 std::lock_guard<std::mutex> lock(streams_mu_);
                 return draining_;
               };
               const uint32_t idle_ms = deps_.config->limits.stream_idle_timeout_ms;
               const std::string idle_message = absl::StrCat(
                   "Ingest: no message for ", idle_ms,
                   " ms (limits.stream_idle_timeout_ms); the stream is ended and nothing "
                   "was committed");
               bool idle = false;
               auto read = [&](v1::IngestRequest* msg) {
                 if (idle_ms == 0) return reader->Read(msg);
                 auto& watchdog = IdleStreamWatchdog::Get();
                 const uint64_t armed = watchdog.Arm(
                     ctx, IdleStreamWatchdog::Clock::now() + std::chrono::milliseconds(idle_ms),
                     idle_message);
                 const bool got = reader->Read(msg);
                 idle = watchdog.Disarm(armed);
                 return got && !idle;
               };
               v1::IngestRequest msg;
               if (!read(&msg)) {
                 if (idle) return absl::DeadlineExceededError(idle_message);
                 if (drained()) return absl::UnavailableError(kDrainingIngest);
                 return absl::InvalidArgumentError(
                     "Ingest: the stream is empty; the first message must be the header");
               }
               auto stream = engine_->BeginIngest(t, msg);
               if (!stream.ok()) return stream.status();
               // Every message up to the client's half-close: one after the commit fails
               // the stream (and so the commit) like any other bad message.
               while (read(&msg)) {
                 if (absl::Status st = (*stream)->Add(msg); !st.ok()) return st;
               }
               if (idle) return absl::DeadlineExceededError(idle_message);
               if (ctx->IsCancelled() && drained()) return absl::UnavailableError(kDrainingIngest);
               if (ctx->IsCancelled()) {
                 return absl::CancelledError(
                     "Ingest: the client cancelled the stream; nothing was committed");
               }
               // The stream ended cleanly: its commit takes effect now (not once the drain
               // has ended the call: the client is told UNAVAILABLE).
               if (drained()) return absl::UnavailableError(kDrainingIngest);
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

grpc::Status KvShadeService::CommitStaged(grpc::ServerContext* ctx, const v1::CommitStagedRequest* req,
                                          v1::CommitStagedResponse* resp) {
  return Run(deps_, "CommitStaged", ctx, resp,
             [&](const Tenant& t) { return engine_->CommitStaged(t, *req); });
}

grpc::Status KvShadeService::SlotTable(grpc::ServerContext* ctx, const v1::SlotTableRequest* req,
                                       v1::SlotTableResponse* resp) {
  return Run(deps_, "SlotTable", ctx, resp,
             [&](const Tenant& t) { return engine_->SlotTable(t, *req); });
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

// KvShadeService: authenticate, admit, run the engine operation on a call thread, record
// metrics, convert the status. Nothing else happens here (see grpc_service.h).
#include "kvshade/service/grpc_service.h"

#include <grpc/grpc.h>

#include <condition_variable>
#include <map>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "admission.h"
#include "call_executor.h"
#include "device_fault.h"
#include "kvshade/service/device_router.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/log.h"
#include "kvshade/service/ucx_server.h"
#include "status_util.h"
#include "stream_pace.h"

namespace kvshade::service {

using SteadyClock = std::chrono::steady_clock;

// Ends Ingest streams that wait too long or too slowly for their client (StreamPace):
// while a stream waits for its next message it is armed here, and one thread looks at each
// armed stream at its pace's deadline. When the pace says the stream is over, the call is
// cancelled with that status and message: a server-side cancel that carries a status goes
// to the client as the call's status (like a server-side deadline), and the pending read
// completes at once. Disarm happens-after anything the watchdog did with the pace.
class StreamWatchdog {
 public:
  StreamWatchdog() : thread_([this] { Loop(); }) {}
  ~StreamWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      cv_.notify_one();
    }
    thread_.join();
  }

  // Watches `call`'s wait paced by `pace` (waiting) until Disarm; both must stay valid
  // until then.
  uint64_t Arm(grpc_call* call, StreamPace* pace) {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t id = next_id_++;
    armed_.emplace(id, Entry{call, pace, pace->Deadline(), std::nullopt});
    cv_.notify_one();
    return id;
  }

  // Stops watching; the status the call was cancelled with, if it was.
  std::optional<absl::Status> Disarm(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = armed_.find(id);
    if (it == armed_.end()) return std::nullopt;
    std::optional<absl::Status> cut = std::move(it->second.cut);
    armed_.erase(it);
    return cut;
  }

 private:
  struct Entry {
    grpc_call* call;
    StreamPace* pace;
    SteadyClock::time_point deadline;
    std::optional<absl::Status> cut;
  };

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      auto earliest = SteadyClock::time_point::max();
      for (const auto& [id, e] : armed_) {
        if (!e.cut) earliest = std::min(earliest, e.deadline);
      }
      if (earliest == SteadyClock::time_point::max()) {
        cv_.wait(lock);
      } else {
        cv_.wait_until(lock, earliest);
      }
      const auto now = SteadyClock::now();
      for (auto& [id, e] : armed_) {
        if (e.cut || e.deadline > now) continue;
        absl::Status st = e.pace->Expire(now);
        if (st.ok()) {
          e.deadline = e.pace->Deadline();  // a progress window closed with enough bytes
          continue;
        }
        // Under mu_: Disarm (and so the end of the call) waits for this.
        const grpc::Status g = ToGrpcStatus(st);
        grpc_call_cancel_with_status(e.call, static_cast<grpc_status_code>(g.error_code()),
                                     g.error_message().c_str(), nullptr);
        e.cut = std::move(st);
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, Entry> armed_;
  uint64_t next_id_ = 1;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

namespace {

absl::Status DeviceFailed(std::string_view method, const absl::Status& fault) {
  // The device is gone for this process: nothing can be served; the server is exiting.
  return absl::UnavailableError(absl::StrCat(
      std::string(method), ": this daemon's device failed (", fault.message(),
      "); it is restarting, and its durable sessions come back with it: retry after the "
      "restart or on another replica"));
}

constexpr char kDrainingIngest[] =
    "Ingest: the server is draining (shutting down); the stream is ended and nothing was "
    "committed; retry on another replica";

}  // namespace

absl::StatusOr<std::unique_ptr<KvShadeService>> KvShadeService::Create(const ServiceDeps& deps) {
  if (deps.engine == nullptr || deps.config == nullptr ||
      deps.metrics == nullptr || deps.auth == nullptr || deps.admission == nullptr) {
    return absl::InvalidArgumentError(
        "KvShadeService::Create: engine, config, metrics, auth and admission must all "
        "be set");
  }
  return std::unique_ptr<KvShadeService>(new KvShadeService(deps));
}

KvShadeService::KvShadeService(const ServiceDeps& deps)
    : deps_(deps),
      engine_(deps.engine),
      watchdog_(std::make_unique<StreamWatchdog>()) {
  CallExecutor::Options options;
  options.max_threads = CallThreadCap(*deps.config);
  // Capped: the threads, once started, stay. Uncapped: as many as cores stay; the rest of
  // a burst's threads end after 30 s idle.
  options.keep_threads = options.max_threads != 0
                             ? options.max_threads
                             : std::max<uint32_t>(4, std::thread::hardware_concurrency());
  executor_ = std::make_unique<CallExecutor>(options);
}

KvShadeService::~KvShadeService() = default;

void KvShadeService::Record(std::string_view method, SteadyClock::time_point start,
                            const absl::Status& st, std::string_view tenant) const {
  const double secs = std::chrono::duration<double>(SteadyClock::now() - start).count();
  const int code = static_cast<int>(st.code());
  deps_.metrics->ObserveRpc(method, code, secs);
  if (!st.ok()) deps_.metrics->Error(code);
  log::Rpc(method, st, secs, tenant);
}

bool KvShadeService::draining() const {
  std::lock_guard<std::mutex> lock(streams_mu_);
  return draining_;
}

template <typename Resp, typename Op>
grpc::ServerUnaryReactor* KvShadeService::Unary(std::string_view method,
                                                grpc::CallbackServerContext* ctx, Resp* resp,
                                                Op op) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  const auto start = SteadyClock::now();
  absl::StatusOr<Tenant> tenant = deps_.auth->Authenticate(*ctx);
  if (!tenant.ok()) {
    Record(method, start, tenant.status(), {});
    reactor->Finish(ToGrpcStatus(tenant.status()));
    return reactor;
  }
  // Calls in flight per tenant (docs/OPERATIONS.md "Limits on streams and calls"): refused
  // here, before the call is queued for a thread.
  absl::StatusOr<TenantAdmission::Ticket> ticket =
      deps_.admission->Admit(method, tenant->name, false);
  if (!ticket.ok()) {
    Record(method, start, ticket.status(), tenant->name);
    reactor->Finish(ToGrpcStatus(ticket.status()));
    return reactor;
  }
  const std::string name = tenant->name;
  executor_->Submit(name, [this, method, ctx, resp, reactor, start, tenant = *std::move(tenant),
                           ticket = *std::move(ticket), op = std::move(op)]() mutable {
    absl::Status st;
    if (ctx->IsCancelled()) {
      st = absl::CancelledError(absl::StrCat(
          std::string(method),
          ": the call was cancelled (by the client, or its deadline passed) before it ran"));
    } else if (absl::Status fault = deps_.engine->DeviceFault(); !fault.ok()) {
      st = DeviceFailed(method, fault);
    } else {
      absl::StatusOr<Resp> r = op(tenant);
      if (r.ok()) {
        *resp = *std::move(r);
      } else {
        st = r.status();
      }
    }
    // The slot is free before the client hears the answer: its next call is admitted.
    ticket.Reset();
    Record(method, start, st, tenant.name);
    reactor->Finish(ToGrpcStatus(st));
  });
  return reactor;
}

// One Ingest stream. Start authenticates and admits it (a call and a stream slot of its
// tenant) and starts the first read; every message read is processed on a call thread
// (the header begins the engine's IngestStream, the rest are added to it), and only then is
// the next one read. The client's half-close commits (IngestStream::Finish) on a call
// thread; every other end (an error, the idle timeout or minimum progress, a cancel, the
// drain) commits nothing. While a read is pending the stream is armed in the watchdog.
//
// Threads: Start runs in the handler, OnReadDone on gRPC's threads, the jobs on the
// executor's; at most one of them acts at a time (a read is started only when the job
// before it is done; a job is submitted only from OnReadDone). End is the last thing any
// of them does: once Finish is called, OnDone may delete the call.
class KvShadeService::IngestCall final : public grpc::ServerReadReactor<v1::IngestRequest> {
 public:
  IngestCall(KvShadeService* service, grpc::CallbackServerContext* ctx, v1::IngestResponse* resp)
      : service_(service),
        ctx_(ctx),
        resp_(resp),
        start_(SteadyClock::now()),
        pace_(PaceLimits(service->deps_.config->limits)) {}

  void Start() {
    absl::StatusOr<Tenant> tenant = service_->deps_.auth->Authenticate(*ctx_);
    if (!tenant.ok()) return End(tenant.status());
    tenant_ = *std::move(tenant);
    // Limits on streams (docs/OPERATIONS.md "Limits on streams and calls"): a call slot and
    // a stream slot of the tenant's, taken before anything is read.
    absl::StatusOr<TenantAdmission::Ticket> ticket =
        service_->deps_.admission->Admit("Ingest", tenant_->name, /*stream=*/true);
    if (!ticket.ok()) return End(ticket.status());
    ticket_ = *std::move(ticket);
    if (absl::Status fault = service_->deps_.engine->DeviceFault(); !fault.ok()) {
      return End(DeviceFailed("Ingest", fault));
    }
    {
      // Drain ends open streams (they would hold the shutdown).
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      if (!service_->draining_) {
        service_->ingest_calls_.insert(ctx_);
        registered_ = true;
      }
    }
    if (!registered_) return End(absl::UnavailableError(kDrainingIngest));
    Wait();
  }

  void OnReadDone(bool ok) override {
    if (armed_ != 0) {
      if (std::optional<absl::Status> cut = service_->watchdog_->Disarm(std::exchange(armed_, 0))) {
        return End(*std::move(cut));
      }
    }
    if (!ok) {
      if (service_->draining()) return End(absl::UnavailableError(kDrainingIngest));
      if (Cancelled()) return End(CancelledByClient());
      if (!stream_) {
        return End(absl::InvalidArgumentError(
            "Ingest: the stream is empty; the first message must be the header"));
      }
      // The client half-closed: the stream ended cleanly, and its commit takes effect now.
      return service_->executor_->Submit(tenant_->name, [this] { Commit(); });
    }
    if (absl::Status st = pace_.Received(SteadyClock::now(), msg_.ByteSizeLong()); !st.ok()) {
      return End(std::move(st));
    }
    service_->executor_->Submit(tenant_->name, [this] { Process(); });
  }

  void OnCancel() override { cancelled_.store(true, std::memory_order_relaxed); }

  void OnDone() override { delete this; }

 private:
  // On a call thread: the message just read.
  void Process() {
    absl::Status st;
    if (!stream_) {
      auto begun = service_->engine_->BeginIngest(*tenant_, msg_);
      if (begun.ok()) {
        stream_ = *std::move(begun);
      } else {
        st = begun.status();
      }
    } else {
      // Every message up to the client's half-close: one after the commit fails the stream
      // (and so the commit) like any other bad message.
      st = stream_->Add(msg_);
    }
    v1::IngestRequest().Swap(&msg_);  // what it held is not kept while the stream waits
    if (!st.ok()) return End(std::move(st));
    Wait();
  }

  // On a call thread, after the client's half-close. A cancelled or drained stream
  // commits nothing (the client is told CANCELLED or UNAVAILABLE).
  void Commit() {
    if (service_->draining()) return End(absl::UnavailableError(kDrainingIngest));
    if (Cancelled()) return End(CancelledByClient());
    absl::StatusOr<v1::IngestResponse> r = stream_->Finish();
    if (!r.ok()) return End(r.status());
    *resp_ = *std::move(r);
    End(absl::OkStatus());
  }

  // Waits for the next message (no thread is held meanwhile), watched by the watchdog.
  void Wait() {
    pace_.StartWait(SteadyClock::now());
    if (pace_.Deadline() != SteadyClock::time_point::max()) {
      armed_ = service_->watchdog_->Arm(ctx_->c_call(), &pace_);
    }
    StartRead(&msg_);
  }

  bool Cancelled() const {
    return cancelled_.load(std::memory_order_relaxed) || ctx_->IsCancelled();
  }
  static absl::Status CancelledByClient() {
    return absl::CancelledError("Ingest: the client cancelled the stream; nothing was committed");
  }

  // Gives everything back (a stream not finished commits nothing), records the call and
  // finishes it: the last thing done with this call.
  void End(absl::Status st) {
    stream_.reset();
    ticket_.Reset();
    if (registered_) {
      std::lock_guard<std::mutex> lock(service_->streams_mu_);
      service_->ingest_calls_.erase(ctx_);
      registered_ = false;
    }
    service_->Record("Ingest", start_, st,
                     tenant_ ? std::string_view(tenant_->name) : std::string_view());
    Finish(ToGrpcStatus(st));
  }

  KvShadeService* const service_;
  grpc::CallbackServerContext* const ctx_;
  v1::IngestResponse* const resp_;
  const SteadyClock::time_point start_;
  std::optional<Tenant> tenant_;
  TenantAdmission::Ticket ticket_;
  bool registered_ = false;
  StreamPace pace_;
  uint64_t armed_ = 0;  // the watchdog's id while a read is pending
  v1::IngestRequest msg_;
  std::unique_ptr<Engine::IngestStream> stream_;
  std::atomic<bool> cancelled_{false};
};

absl::Status KvShadeService::Drain() {
  {
    // Under streams_mu_: a stream unregisters (and so finishes) only after this.
    std::lock_guard<std::mutex> lock(streams_mu_);
    draining_ = true;
    for (grpc::CallbackServerContext* ctx : ingest_calls_) {
      grpc_call_cancel_with_status(ctx->c_call(), GRPC_STATUS_UNAVAILABLE, kDrainingIngest,
                                   nullptr);
    }
  }
  return engine_->Drain();
}

grpc::ServerReadReactor<v1::IngestRequest>* KvShadeService::Ingest(grpc::CallbackServerContext* ctx,
                                                                   v1::IngestResponse* resp) {
  auto* call = new IngestCall(this, ctx, resp);
  // What Start asks of the reactor (a read, or Finish) waits until this handler has
  // returned it: the call cannot end (and delete itself) before.
  call->Start();
  return call;
}

grpc::ServerUnaryReactor* KvShadeService::CreateSession(grpc::CallbackServerContext* ctx,
                                                        const v1::CreateSessionRequest* req,
                                                        v1::CreateSessionResponse* resp) {
  return Unary("CreateSession", ctx, resp,
               [this, req](const Tenant& t) { return engine_->CreateSession(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::ForkSession(grpc::CallbackServerContext* ctx,
                                                      const v1::ForkSessionRequest* req,
                                                      v1::ForkSessionResponse* resp) {
  return Unary("ForkSession", ctx, resp,
               [this, req](const Tenant& t) { return engine_->ForkSession(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::LookupPrefix(grpc::CallbackServerContext* ctx,
                                                       const v1::LookupPrefixRequest* req,
                                                       v1::LookupPrefixResponse* resp) {
  return Unary("LookupPrefix", ctx, resp,
               [this, req](const Tenant& t) { return engine_->LookupPrefix(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::GetSession(grpc::CallbackServerContext* ctx,
                                                     const v1::GetSessionRequest* req,
                                                     v1::SessionInfo* resp) {
  return Unary("GetSession", ctx, resp,
               [this, req](const Tenant& t) { return engine_->GetSession(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::ListSessions(grpc::CallbackServerContext* ctx,
                                                       const v1::ListSessionsRequest* req,
                                                       v1::ListSessionsResponse* resp) {
  return Unary("ListSessions", ctx, resp,
               [this, req](const Tenant& t) { return engine_->ListSessions(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::CloseSession(grpc::CallbackServerContext* ctx,
                                                       const v1::CloseSessionRequest* req,
                                                       v1::CloseSessionResponse* resp) {
  return Unary("CloseSession", ctx, resp,
               [this, req](const Tenant& t) { return engine_->CloseSession(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::AppendTokens(grpc::CallbackServerContext* ctx,
                                                       const v1::AppendTokensRequest* req,
                                                       v1::AppendTokensResponse* resp) {
  return Unary("AppendTokens", ctx, resp,
               [this, req](const Tenant& t) { return engine_->AppendTokens(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::Attach(grpc::CallbackServerContext* ctx,
                                                 const v1::AttachRequest* req,
                                                 v1::AttachResponse* resp) {
  return Unary("Attach", ctx, resp,
               [this, req](const Tenant& t) -> absl::StatusOr<v1::AttachResponse> {
                 auto r = engine_->Attach(t, *req);
                 if (r.ok() && deps_.ucx != nullptr) {
                   // The token is bound to this caller's tenant and admits one UCX client.
                   r->set_data_plane_address(deps_.ucx->address());
                   r->set_data_plane_token(deps_.ucx->IssueToken(t));
                 }
                 return r;
               });
}

grpc::ServerUnaryReactor* KvShadeService::Detach(grpc::CallbackServerContext* ctx,
                                                 const v1::DetachRequest* req,
                                                 v1::DetachResponse* resp) {
  return Unary("Detach", ctx, resp,
               [this, req](const Tenant& t) { return engine_->Detach(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::GetStaticSet(grpc::CallbackServerContext* ctx,
                                                       const v1::GetStaticSetRequest* req,
                                                       v1::GetStaticSetResponse* resp) {
  return Unary("GetStaticSet", ctx, resp,
               [this, req](const Tenant& t) { return engine_->GetStaticSet(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::CommitStaged(grpc::CallbackServerContext* ctx,
                                                       const v1::CommitStagedRequest* req,
                                                       v1::CommitStagedResponse* resp) {
  return Unary("CommitStaged", ctx, resp,
               [this, req](const Tenant& t) { return engine_->CommitStaged(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::SlotTable(grpc::CallbackServerContext* ctx,
                                                    const v1::SlotTableRequest* req,
                                                    v1::SlotTableResponse* resp) {
  return Unary("SlotTable", ctx, resp,
               [this, req](const Tenant& t) { return engine_->SlotTable(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::SelectAndReconstruct(
    grpc::CallbackServerContext* ctx, const v1::SelectAndReconstructRequest* req,
    v1::SelectAndReconstructResponse* resp) {
  return Unary("SelectAndReconstruct", ctx, resp,
               [this, req](const Tenant& t) { return engine_->SelectAndReconstruct(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::Attend(grpc::CallbackServerContext* ctx,
                                                 const v1::AttendRequest* req,
                                                 v1::AttendResponse* resp) {
  return Unary("Attend", ctx, resp,
               [this, req](const Tenant& t) { return engine_->Attend(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::ExportSession(grpc::CallbackServerContext* ctx,
                                                        const v1::ExportSessionRequest* req,
                                                        v1::SessionExport* resp) {
  return Unary("ExportSession", ctx, resp,
               [this, req](const Tenant& t) { return engine_->ExportSession(t, *req); });
}

grpc::ServerUnaryReactor* KvShadeService::Stats(grpc::CallbackServerContext* ctx,
                                                const v1::StatsRequest* req,
                                                v1::StatsResponse* resp) {
  return Unary("Stats", ctx, resp,
               [this, req](const Tenant& t) { return engine_->Stats(t, *req); });
}

}  // namespace kvshade::service

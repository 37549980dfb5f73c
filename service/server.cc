// kvshade-server's process shell: gRPC server construction (credentials, limits, health,
// reflection), the Prometheus exposer, graceful shutdown, the spill tier the engine runs on
// (spill_storage.h) and where its storage faults go (log and metrics). The service logic itself is KvShadeService
// (grpc_service.h); this file never looks inside a request.
#include "kvshade/service/server.h"

#include <signal.h>

#include <cerrno>
#include <cmath>
#include <fstream>
#include <sstream>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <spdlog/spdlog.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kvshade/base/file.h"
#include "kvshade/service/device_router.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/grpc_service.h"
#include "kvshade/service/ucx_server.h"
#include "kvshade/storage/spill_tier.h"
#include "kvshade/version.h"
#include "admission.h"
#include "device_fault.h"
#include "spill_storage.h"

namespace kvshade::service {
namespace {

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeCredentials(const TlsConfig& tls) {
  if (tls.cert_file.empty()) return grpc::InsecureServerCredentials();
  auto cert = base::ReadFile(tls.cert_file, "tls.cert_file");
  if (!cert.ok()) return cert.status();
  auto key = base::ReadFile(tls.key_file, "tls.key_file");
  if (!key.ok()) return key.status();
  grpc_ssl_client_certificate_request_type request = GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE;
  std::string client_ca;
  if (!tls.client_ca_file.empty()) {
    auto ca = base::ReadFile(tls.client_ca_file, "tls.client_ca_file");
    if (!ca.ok()) return ca.status();
    client_ca = *std::move(ca);
    // With a CA configured a presented client certificate is always verified; mTLS
    // proper (require_client_cert) also rejects clients that present none.
    request = tls.require_client_cert ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                      : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  grpc::SslServerCredentialsOptions options(request);
  options.pem_root_certs = client_ca;
  options.pem_key_cert_pairs.push_back({*key, *cert});
  return grpc::SslServerCredentials(options);
}

constexpr char kServiceName[] = "kvshade.v1.KvShade";

// The spill tier's storage faults (storage/README.md "Storage faults"; docs/OPERATIONS.md
// "Storage faults"): every event is counted, and logged unless it repeats within 10 s.
// The sink holds the registry, so its counters outlive a Server that is gone.
storage::SpillEventSink SpillEventsToLogAndMetrics(std::shared_ptr<prometheus::Registry> registry) {
  auto& failures = prometheus::BuildCounter()
                       .Name("kvshade_spill_write_failures_total")
                       .Help("Spill tier writes refused by a storage fault: reason no_space (disk "
                             "full, RESOURCE_EXHAUSTED) or io_error (UNAVAILABLE)")
                       .Register(*registry);
  auto& errors = prometheus::BuildCounter()
                     .Name("kvshade_spill_background_errors_total")
                     .Help("Errors RocksDB reported inside the spill tier (WAL, flush, compaction)")
                     .Register(*registry);
  auto& stopped = prometheus::BuildGauge()
                      .Name("kvshade_spill_writes_stopped")
                      .Help("1 while the spill tier refuses writes after a storage fault")
                      .Register(*registry);
  auto& damage = prometheus::BuildCounter()
                     .Name("kvshade_spill_recovery_losses_total")
                     .Help("At start: damaged write-ahead-log regions (records from the damage on "
                           "were dropped) and damaged records never served, by kind")
                     .Register(*registry);
  struct Families {
    std::shared_ptr<prometheus::Registry> registry;
    prometheus::Counter* no_space;
    prometheus::Counter* io_error;
    prometheus::Counter* background;
    prometheus::Gauge* stopped;
    prometheus::Counter* wal;
    prometheus::Counter* record;
  };
  auto f = std::make_shared<Families>(Families{
      registry, &failures.Add({{"reason", "no_space"}}), &failures.Add({{"reason", "io_error"}}),
      &errors.Add({}), &stopped.Add({}), &damage.Add({{"kind", "wal"}}),
      &damage.Add({{"kind", "record"}})});
  return [f](const storage::SpillEvent& e) {
    using Kind = storage::SpillEvent::Kind;
    switch (e.kind) {
      case Kind::kWriteFailed:
        (e.code == absl::StatusCode::kResourceExhausted ? f->no_space : f->io_error)->Increment();
        break;
      case Kind::kBackgroundError: f->background->Increment(); break;
      case Kind::kWritesStopped: f->stopped->Set(1); break;
      case Kind::kWritesResumed: f->stopped->Set(0); break;
      case Kind::kWalDamaged: f->wal->Increment(); break;
      case Kind::kCorruptRecord: f->record->Increment(); break;
      case Kind::kRocksLog: break;
    }
    if (!e.log) return;
    const std::string_view kind = storage::SpillEventKindName(e.kind);
    if (e.error) {
      spdlog::error("storage fault ({}): {}", kind, e.message);
    } else if (e.kind == Kind::kWritesResumed) {
      spdlog::info("storage ({}): {}", kind, e.message);
    } else {
      spdlog::warn("storage ({}): {}", kind, e.message);
    }
  };
}

}  // namespace

Server::Server() = default;

Server::~Server() {
  absl::Status s = Shutdown(absl::Seconds(5));
  if (!s.ok()) spdlog::warn("shutdown: {}", std::string(s.message()));
  // (The spill event sink keeps the metrics registry alive; it stays installed so that the
  // engine's last events while it is destroyed are still logged.)
}

std::string_view Server::backend_name() const {
  return router_ ? router_->device(0).backend->name() : "";
}

void Server::BlockSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerConfig& config) {
  absl::Status valid = ValidateConfig(config);
  if (!valid.ok()) return valid;
  std::unique_ptr<Server> s(new Server());
  s->config_ = config;

  s->metrics_ = std::make_unique<Metrics>();
  s->auth_ = std::make_unique<Authenticator>(s->config_);
  // Before the spill tier opens: what the open finds (a damaged WAL) is reported too. A
  // file-size limit (RLIMIT_FSIZE) must fail a write (EFBIG), not kill the daemon.
  storage::SetDefaultSpillEventSink(SpillEventsToLogAndMetrics(s->metrics_->registry()));
  signal(SIGXFSZ, SIG_IGN);
  s->admission_ = std::make_unique<TenantAdmission>(EffectiveMaxCallsPerTenant(s->config_),
                                                    EffectiveMaxStreamsPerTenant(s->config_));

  // The devices: per device a backend, a spill tier and an engine on them (its memory
  // tiers from the config), which restores the device's durable sessions; both transports
  // borrow the router.
  auto router = DeviceRouter::Open(s->config_, s->metrics_.get());
  if (!router.ok()) return router.status();
  s->router_ = *std::move(router);
  // Test fault injection (KVSHADE_FAILPOINT_SPILL_FAULTS) starts after the restore.
  s->router_->ArmFaults();
  kernels::Backend* const first_backend = s->router_->device(0).backend.get();

  ServiceDeps deps;
  deps.engine = s->router_.get();
  deps.config = &s->config_;
  deps.metrics = s->metrics_.get();
  deps.auth = s->auth_.get();
  deps.admission = s->admission_.get();
  if (config.ucx.enable) {
    auto ucx = UcxServer::Start(s->config_, s->router_.get(), s->metrics_.get(),
                                s->admission_.get(), first_backend);
    if (!ucx.ok()) return ucx.status();
    s->ucx_ = *std::move(ucx);
    deps.ucx = s->ucx_.get();
  }
  auto service = KvShadeService::Create(deps);
  if (!service.ok()) return service.status();
  s->service_ = *std::move(service);

  auto creds = MakeCredentials(config.tls);
  if (!creds.ok()) return creds.status();

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second server silently share the
  // port; a daemon must fail loudly instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Idle clients are pinged so that dead workers' connections are noticed; leases, not
  // connections, decide when an attachment dies.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  const int max_msg = static_cast<int>(config.limits.max_message_bytes);
  builder.SetMaxReceiveMessageSize(max_msg);
  builder.SetMaxSendMessageSize(max_msg);
  if (CallThreadCap(config) > 0) {
    // The kvshade service and health checks are callback services: their calls run on
    // gRPC's event threads and the service's own call threads (worker_threads, capped in
    // KvShadeService), never on gRPC's synchronous-server pool. That pool serves only the
    // reflection service now; the same cap bounds it.
    grpc::ResourceQuota quota("kvshade");
    quota.SetMaxThreads(static_cast<int>(CallThreadCap(config)));
    builder.SetResourceQuota(quota);
  }
  builder.AddListeningPort(config.listen, *creds, &s->port_);
  builder.RegisterService(s->service_.get());
  s->server_ = builder.BuildAndStart();
  if (!s->server_ || (s->port_ == 0 && !absl::StartsWith(config.listen, "unix:"))) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on '", config.listen, "' (address in use or not local?)"));
  }
  auto* health = s->server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);

  // What an operator reads first on /metrics: the build, and each tier's budget (the spill
  // tier: +Inf without spill_budget, 0 without spill_path).
  // With several devices, each device's (labelled gpu): the device budget as configured,
  // its share of the host and spill budgets.
  s->metrics_->SetBuildInfo(KVSHADE_VERSION, KVSHADE_GIT_COMMIT, first_backend->name());
  for (size_t i = 0; i < s->router_->size(); ++i) {
    const DeviceRouter::Device& d = s->router_->device(i);
    const ServerConfig& dc = *d.config;
    s->metrics_->SetTierBudget("device", static_cast<double>(dc.device_budget_bytes), d.gpu);
    s->metrics_->SetTierBudget("host", static_cast<double>(dc.host_budget_bytes), d.gpu);
    s->metrics_->SetTierBudget("spill", dc.spill_path.empty()          ? 0.0
                                        : dc.spill_budget_bytes == 0 ? HUGE_VAL
                                                                     : static_cast<double>(dc.spill_budget_bytes),
                               d.gpu);
  }
  if (config.metrics_port != 0) {
    auto endpoint = MetricsEndpoint::Start(config.metrics_listen, config.metrics_port,
                                           s->metrics_->registry());
    if (!endpoint.ok()) {
      s->server_->Shutdown(std::chrono::system_clock::now());
      return endpoint.status();
    }
    s->exposer_ = *std::move(endpoint);
    s->metrics_port_ = s->exposer_->port();
  }
  if (const std::string w = InsecureListenWarning(config); !w.empty()) spdlog::warn("{}", w);
  spdlog::info("kvshade-server {} serving on {} (port {}), backend {}{}, metrics {}", KVSHADE_VERSION,
               config.listen, s->port_, std::string(first_backend->name()),
               s->router_->size() > 1 ? absl::StrCat(" (devices ", s->router_->DeviceNames(), ")")
                                      : std::string(),
               s->metrics_port_ ? absl::StrCat(config.metrics_listen, ":", s->metrics_port_, "/metrics")
                                : std::string("off"));
  return s;
}

absl::Status Server::RunUntilSignal(absl::Duration grace) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  // A signal, or a device fault (checked once a second): after one nothing can be served,
  // so the server drains and exits with an error for its supervisor to start a new process.
  const timespec tick{1, 0};
  while (true) {
    const int sig = sigtimedwait(&set, nullptr, &tick);
    if (sig == SIGTERM || sig == SIGINT) {
      spdlog::info("received {}, draining", sig == SIGTERM ? "SIGTERM" : "SIGINT");
      return Shutdown(grace);
    }
    if (sig < 0 && errno != EAGAIN && errno != EINTR) return absl::InternalError("sigtimedwait failed");
    if (absl::Status fault = router_->DeviceFault(); !fault.ok()) {
      spdlog::error("device fault, draining and exiting (a new process restores the durable "
                    "sessions): {}", std::string(fault.message()));
      Shutdown(grace).IgnoreError();
      return absl::UnavailableError(absl::StrCat("stopped on a device fault: ", fault.message()));
    }
  }
}

absl::Status Server::Shutdown(absl::Duration grace) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_ || !server_) return absl::OkStatus();
  shut_down_ = true;
  const absl::Time t0 = absl::Now();
  const absl::Time end = t0 + grace;
  // 1. Tell load balancers and clients to go elsewhere.
  auto* health = server_->GetHealthCheckService();
  health->SetServingStatus(kServiceName, false);
  health->SetServingStatus(false);
  // 2. Drain: refuse new writes (UNAVAILABLE), end open Ingest streams, flush durable
  // sessions.
  absl::Status drained = service_ ? service_->Drain() : absl::OkStatus();
  if (!drained.ok()) spdlog::error("drain: {}", std::string(drained.message()));
  const absl::Time t1 = absl::Now();
  // 3. Reads keep being served (the gRPC server still accepts calls) until the grace ends,
  // or earlier once no attachment is live (no worker is decoding any more).
  int64_t attachments = -1;
  while (absl::Now() < end) {
    attachments = router_ ? static_cast<int64_t>(router_->LiveAttachments()) : 0;
    if (attachments == 0) break;
    absl::SleepFor(std::min(absl::Milliseconds(50), end - absl::Now()));
  }
  const absl::Time t2 = absl::Now();
  // 4. Stop: calls still in flight get what is left of the grace (at least 1 s), then are
  // cancelled. With none in flight the stop is not held to the grace: gRPC's own stop also
  // waits for every connected client to acknowledge its GOAWAY, which an idle client (one
  // that holds a channel but makes no call) does only when its channel is next polled,
  // seconds later, or once the deadline closes its connection: a daemon with idle clients
  // took up to its whole grace to exit. A call that gRPC accepted in this very instant,
  // before it was admitted, still gets kStopSlack.
  constexpr absl::Duration kStopSlack = absl::Milliseconds(200);
  const uint32_t calls = admission_ ? admission_->calls() : 0;
  const absl::Duration left =
      calls > 0 ? std::max(end - absl::Now(), absl::Seconds(1)) : kStopSlack;
  server_->Shutdown(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(left));
  server_->Wait();
  if (ucx_) ucx_->Stop();  // data-plane requests in flight finish; new ones are dropped
  exposer_.reset();
  spdlog::info("kvshade-server stopped (drain {}, reads served {}{}, gRPC stop {}, {} calls in flight)",
               absl::FormatDuration(t1 - t0), absl::FormatDuration(t2 - t1),
               attachments > 0 ? " until the grace ended" : "", absl::FormatDuration(absl::Now() - t2),
               calls);
  return drained;
}

}  // namespace kvshade::service

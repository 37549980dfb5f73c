// kvshade-server: the KV-cache daemon's entry point. Reads the YAML config (--config),
// the KVSHADE_* environment over it, command-line flags on top (a flag given always wins), starts the
// Server and runs until SIGTERM/SIGINT, then drains and exits 0. Exit codes: 0 clean
// shutdown, 1 start-up failure (bad config, port in use, backend unavailable), 2 bad flags.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "kvshade/service/config.h"
#include "kvshade/service/log.h"
#include "kvshade/service/server.h"
#include "kvshade/version.h"

namespace {

using kvshade::service::ServerConfig;

struct Flags {
  std::string config_file;
  std::string listen, backend, device_budget, device_growth, host_budget, spill_budget, spill_path;
  std::string append_fsync, spill_on_damage;
  bool spill_repair = false;
  int metrics_port = -1;
  std::string metrics_listen;
  std::string tls_cert, tls_key, tls_client_ca;
  bool require_client_cert = false;
  std::vector<std::string> tenant_tokens;
  std::string tokens_file;
  std::string prefix_secret_file;
  uint64_t max_tokens_per_session = 0;
  uint32_t max_sessions_per_tenant = 0;
  std::string max_message_bytes;
  uint32_t max_batch = 0, default_lease_ms = 0, max_lease_ms = 0;
  uint32_t worker_threads = 0;
  int64_t session_idle_ttl_s = -1;  // -1: not given
  std::string kv_events_endpoint, kv_events_topic;
  std::string log_level, log_format;  // "": not given (the config file's, else info / text)
  double grace_s = 10;
  bool check_config = false;
  std::string port_file;
};

int Fail(const std::string& what) {
  spdlog::error("{}", what);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists, so that every thread inherits the mask and only
  // RunUntilSignal's sigwait sees SIGTERM/SIGINT.
  kvshade::service::Server::BlockSignals();

  Flags f;
  CLI::App app{"kvshade-server: KV-cache daemon for long-context LLM inference"};
  app.set_version_flag("--version", kvshade::VersionLine("kvshade-server"));
  app.add_option("-c,--config", f.config_file, "YAML config file (deploy/kvshade.yaml documents every key)")
      ->envname("KVSHADE_CONFIG")
      ->check(CLI::ExistingFile);
  app.add_option("--listen", f.listen, "gRPC address HOST:PORT (port 0 picks a free one)");
  app.add_option("--backend", f.backend,
                 "Kernel backend: cpu, cuda, cuda:N or auto; several devices: cuda:0,cuda:1, "
                 "cuda:all or cpu:0,cpu:1");
  app.add_option("--device-budget", f.device_budget, "Device tier budget, e.g. 8GiB");
  app.add_option("--device-growth", f.device_growth,
                 "Device memory is held on demand in steps of this size (0: the whole budget at start)");
  app.add_option("--host-budget", f.host_budget, "Host tier budget, e.g. 32GiB");
  app.add_option("--spill-budget", f.spill_budget, "Spill tier budget (0 = unbounded)");
  app.add_option("--spill-path", f.spill_path, "RocksDB directory for spill and durable sessions");
  app.add_option("--append-fsync", f.append_fsync,
                 "When appends of durable sessions reach the disk: no (next commit or drain), "
                 "everysec (written at once, synced once a second), always (synced before the "
                 "acknowledgement)")
      ->check(CLI::IsMember({"no", "everysec", "always"}));
  app.add_option("--spill-on-damage", f.spill_on_damage,
                 "Damaged spill data at start: serve_rest (start without it; the sessions that "
                 "lost data are reported damaged) or refuse (fail the start)")
      ->check(CLI::IsMember({"serve_rest", "refuse"}));
  app.add_flag("--spill-repair", f.spill_repair,
               "Run RocksDB's RepairDB on the spill path before opening it (a damaged MANIFEST or "
               "CURRENT): what cannot be read is dropped");
  app.add_option("--metrics-port", f.metrics_port, "Prometheus /metrics port (0 = off)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--metrics-listen", f.metrics_listen, "Address /metrics binds to");
  app.add_option("--tls-cert", f.tls_cert, "PEM server certificate (enables TLS)");
  app.add_option("--tls-key", f.tls_key, "PEM server private key");
  app.add_option("--tls-client-ca", f.tls_client_ca, "PEM CA that verifies client certificates");
  app.add_flag("--require-client-cert", f.require_client_cert, "mTLS: reject clients without a certificate");
  app.add_option("--tenant-token", f.tenant_tokens, "NAME:TOKEN (repeatable); adds to the file's tenants");
  app.add_option("--tokens-file", f.tokens_file, "File of NAME:TOKEN lines")->check(CLI::ExistingFile);
  app.add_option("--prefix-secret-file", f.prefix_secret_file,
                 "File whose first line is the prefix secret (mixed into tenant salts)")
      ->envname("KVSHADE_PREFIX_SECRET_FILE")
      ->check(CLI::ExistingFile);
  app.add_option("--max-tokens-per-session", f.max_tokens_per_session, "Limit");
  app.add_option("--max-sessions-per-tenant", f.max_sessions_per_tenant, "Limit");
  app.add_option("--max-message-bytes", f.max_message_bytes, "gRPC message size limit, e.g. 512MiB");
  app.add_option("--max-batch", f.max_batch, "Queries per SelectAndReconstruct/Attend call");
  app.add_option("--default-lease-ms", f.default_lease_ms, "Attachment lease when the request says 0");
  app.add_option("--max-lease-ms", f.max_lease_ms, "Longest lease a worker may ask for");
  app.add_option("--worker-threads", f.worker_threads,
                 "Threads that run the work of gRPC calls (0 = no cap; else at least 4)");
  app.add_option("--session-idle-ttl-s", f.session_idle_ttl_s,
                 "Close sessions no call has touched for this many seconds and with no live "
                 "attachment (0 = never)")
      ->check(CLI::Range(int64_t{0}, int64_t{UINT32_MAX}));
  app.add_option("--log-level", f.log_level, "trace, debug, info (default), warn, error, critical, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}));
  app.add_option("--kv-events-endpoint", f.kv_events_endpoint,
                 "Publish the prefix index as KV-events (ZMQ PUB, vLLM format) on this endpoint, e.g. "
                 "tcp://*:5557 (bind) or tcp://indexer:5557 (connect)");
  app.add_option("--kv-events-topic", f.kv_events_topic, "Topic frame of each KV-events message");
  app.add_option("--log-format", f.log_format, "text (default) or json (one JSON object per line)")
      ->check(CLI::IsMember({"text", "json"}));
  app.add_option("--grace", f.grace_s, "Seconds in-flight calls get at shutdown")->envname("KVSHADE_GRACE")->check(CLI::Range(0.0, 3600.0));
  app.add_flag("--check-config", f.check_config, "Validate the configuration and exit");
  app.add_flag_callback(
      "--list-env",
      [] {
        for (const auto& [key, name] : kvshade::service::ConfigEnvironmentVariables()) {
          std::cout << name << " " << key << "\n";
        }
        std::cout << std::flush;
        std::exit(0);
      },
      "Print every KVSHADE_* variable the daemon reads, with its config key, and exit");
  app.add_option("--port-file", f.port_file,
                 "Write the bound gRPC port here once listening (useful with --listen HOST:0)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  namespace klog = kvshade::service::log;
  // Flags first (errors in the config file are logged in the format asked for), the file's
  // log settings once it is read.
  auto configure_log = [&](const std::string& level, const std::string& format) {
    klog::Configure(spdlog::level::from_str(level.empty() ? "info" : level),
                    format == "json" ? klog::Format::kJson : klog::Format::kText, "kvshade-server");
  };
  configure_log(f.log_level, f.log_format);

  // Defaults < the YAML file < KVSHADE_* variables < flags (deploy/README.md "Environment").
  ServerConfig config;
  {
    auto loaded = kvshade::service::LoadConfig(f.config_file, kvshade::service::ProcessEnvironment());
    if (!loaded.ok()) return Fail(std::string(loaded.status().message()));
    config = *std::move(loaded);
  }
  auto bytes = [&](const std::string& flag, const std::string& text, uint64_t* out) -> bool {
    if (text.empty()) return true;
    auto v = kvshade::service::ParseByteSize(text);
    if (!v.ok()) {
      spdlog::error("{}: {}", flag, std::string(v.status().message()));
      return false;
    }
    *out = *v;
    return true;
  };
  if (!f.listen.empty()) config.listen = f.listen;
  if (!f.backend.empty()) config.backend = f.backend;
  if (!bytes("--device-budget", f.device_budget, &config.device_budget_bytes) ||
      !bytes("--device-growth", f.device_growth, &config.device_growth_bytes) ||
      !bytes("--host-budget", f.host_budget, &config.host_budget_bytes) ||
      !bytes("--spill-budget", f.spill_budget, &config.spill_budget_bytes) ||
      !bytes("--max-message-bytes", f.max_message_bytes, &config.limits.max_message_bytes)) {
    return 2;
  }
  if (!f.spill_path.empty()) config.spill_path = f.spill_path;
  if (!f.append_fsync.empty()) config.append_fsync = f.append_fsync;
  if (!f.spill_on_damage.empty()) config.spill_on_damage = f.spill_on_damage;
  if (f.spill_repair) config.spill_repair = true;
  if (f.metrics_port >= 0) config.metrics_port = static_cast<uint16_t>(f.metrics_port);
  if (!f.metrics_listen.empty()) config.metrics_listen = f.metrics_listen;
  if (!f.tls_cert.empty()) config.tls.cert_file = f.tls_cert;
  if (!f.tls_key.empty()) config.tls.key_file = f.tls_key;
  if (!f.tls_client_ca.empty()) config.tls.client_ca_file = f.tls_client_ca;
  if (f.require_client_cert) config.tls.require_client_cert = true;
  for (const auto& t : f.tenant_tokens) {
    absl::Status s = kvshade::service::AddTenantToken(t, &config);
    if (!s.ok()) return Fail(absl::StrCat("--tenant-token: ", s.message()));
  }
  if (!f.tokens_file.empty()) {
    absl::Status s = kvshade::service::LoadTokensFile(f.tokens_file, &config);
    if (!s.ok()) return Fail(std::string(s.message()));
  }
  if (!f.prefix_secret_file.empty()) {
    std::ifstream in(f.prefix_secret_file);
    std::getline(in, config.prefix_secret);
  }
  if (f.max_tokens_per_session) config.limits.max_tokens_per_session = f.max_tokens_per_session;
  if (f.max_sessions_per_tenant) config.limits.max_sessions_per_tenant = f.max_sessions_per_tenant;
  if (f.max_batch) config.limits.max_batch = f.max_batch;
  if (f.default_lease_ms) config.limits.default_lease_ms = f.default_lease_ms;
  if (f.max_lease_ms) config.limits.max_lease_ms = f.max_lease_ms;
  if (f.worker_threads) config.worker_threads = f.worker_threads;
  if (f.session_idle_ttl_s >= 0) config.limits.session_idle_ttl_s = static_cast<uint32_t>(f.session_idle_ttl_s);

  if (!f.kv_events_endpoint.empty()) config.kv_events.endpoint = f.kv_events_endpoint;
  if (!f.kv_events_topic.empty()) config.kv_events.topic = f.kv_events_topic;
  if (!f.log_level.empty()) config.log.level = f.log_level;
  if (!f.log_format.empty()) config.log.format = f.log_format;
  absl::Status valid = kvshade::service::ValidateConfig(config);
  if (!valid.ok()) return Fail(absl::StrCat("invalid configuration: ", valid.message()));
  configure_log(config.log.level, config.log.format);
  klog::InstallUcxLogHandler();
  klog::InstallGrpcLogHandler();
  spdlog::info("config: {}", kvshade::service::DescribeConfig(config));
  if (f.check_config) {
    if (const std::string w = kvshade::service::InsecureListenWarning(config); !w.empty()) {
      spdlog::warn("{}", w);
    }
    std::cout << "configuration OK" << std::endl;
    return 0;
  }

  auto server = kvshade::service::Server::Start(config);
  if (!server.ok()) return Fail(absl::StrCat("start-up failed: ", server.status().ToString()));
  if (!f.port_file.empty()) {
    // Write then rename, so a reader never sees a partial file.
    const std::string tmp = f.port_file + ".tmp";
    std::ofstream(tmp) << (*server)->port() << "\n";
    if (std::rename(tmp.c_str(), f.port_file.c_str()) != 0) {
      return Fail(absl::StrCat("cannot write --port-file ", f.port_file));
    }
  }
  absl::Status s = (*server)->RunUntilSignal(absl::Milliseconds(static_cast<int64_t>(f.grace_s * 1000)));
  if (!s.ok()) {
    spdlog::error("shutdown: {}", std::string(s.message()));
    return 1;
  }
  return 0;
}

// The kvshade-server process around the KvShade gRPC service: builds the grpc::Server
// (plaintext, TLS or mTLS; message size limits; grpc.health.v1; proto reflection),
// registers the KvShadeService, serves Prometheus /metrics (MetricsEndpoint), and shuts
// down gracefully.
//
// Life cycle: Start() -> SERVING. Shutdown() (or a SIGTERM/SIGINT or a device fault seen
// by RunUntilSignal()) sets health NOT_SERVING, drains the service (no new sessions; durable
// state flushed), then stops the gRPC server with a deadline for in-flight calls.
// The Server opens the daemon's devices (DeviceRouter: per device a backend, a spill tier
// and an engine on it, which restores the device's durable sessions at start) and owns
// them; the gRPC service and the UCX data plane borrow the router.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/metrics.h"

namespace kvshade::service {

class DeviceRouter;
class KvShadeService;
class TenantAdmission;
class UcxServer;

class Server {
 public:
  // Validates `config`, creates the backend, the engine (which restores durable sessions)
  // and the transports over it, and starts listening. Fails with the cause (bad config, port in use, unreadable TLS
  // files, backend unavailable).
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerConfig& config);
  ~Server();

  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The bound gRPC port (useful with listen "host:0") and the metrics port (0 = none).
  int port() const { return port_; }
  int metrics_port() const { return metrics_port_; }
  std::string_view backend_name() const;

  // Waits for SIGTERM or SIGINT, then Shutdown(grace) and its status. A device fault
  // (docs/OPERATIONS.md "Device faults", checked once a second) also ends the wait: then
  // Shutdown(grace) and UNAVAILABLE naming the fault, for main to exit with an error. The
  // signals must be blocked in every thread: call BlockSignals() first thing in main,
  // before any thread exists.
  absl::Status RunUntilSignal(absl::Duration grace);

  // Health NOT_SERVING, Drain(), stop the server (in-flight calls get `grace` to finish).
  // Idempotent.
  absl::Status Shutdown(absl::Duration grace);

  // Blocks SIGTERM and SIGINT in the calling thread (and so in threads it creates later).
  static void BlockSignals();

 private:
  Server();

  ServerConfig config_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Authenticator> auth_;
  // One per daemon, shared by both transports (a tenant's caps count its gRPC and UCX calls
  // and streams together); before service_ and ucx_ so that it outlives every ticket.
  std::unique_ptr<TenantAdmission> admission_;
  // Before service_ and ucx_, which borrow it, so that it outlives them.
  std::unique_ptr<DeviceRouter> router_;  // the devices: backends, spill tiers, engines
  std::unique_ptr<KvShadeService> service_;
  std::unique_ptr<UcxServer> ucx_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsEndpoint> exposer_;  // /metrics
  int port_ = 0;
  int metrics_port_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;
};

}  // namespace kvshade::service

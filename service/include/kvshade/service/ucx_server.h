// UcxServer: the daemon's UCX data plane (service/README.md "UCX data plane"). One UCP
// worker on a progress thread; its address is handed out by Attach together with a
// one-time admission token bound to the caller's tenant. A client's first active message
// (HELLO) must carry such a token; it is consumed and the client gets a connection key
// that every later request carries. Requests without a valid key are refused
// (PERMISSION_DENIED reply) and never reach the engine.
//
// INGEST messages (one per gRPC IngestRequest; tensor bytes as the payload) drive one
// Engine::IngestStream per connection; a connection dropped by BYE or by its client's
// worker vanishing discards that stream.
//
// Requests run on a small pool of engine threads, never on the progress thread; the reply
// (an active message: header DataPlaneHeader, payload the serialized v1 response or the
// error message) is sent from the progress thread.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"
#include "kvshade/service/ucx_core.h"

namespace kvshade::service {

class UcxServer {
 public:
  // Starts the worker and its progress thread (config.ucx.transports). `metrics` must
  // outlive the server. Requests are refused until SetEngine.
  static absl::StatusOr<std::unique_ptr<UcxServer>> Start(const ServerConfig& config,
                                                          Metrics* metrics);
  ~UcxServer();  // Stop()
  void Stop();

  // The engine that serves requests; must outlive the server (or Stop() first).
  void SetEngine(Engine* engine);

  // The worker address for AttachResponse.data_plane_address ("ucx-worker:<base64>").
  const std::string& address() const { return address_; }
  // A fresh one-time admission token for `tenant` (AttachResponse.data_plane_token).
  std::string IssueToken(const Tenant& tenant);

  // Counters for tests and /metrics-free diagnosis.
  uint64_t refused() const;
  uint64_t connections() const;

 private:
  UcxServer(const ServerConfig& config, Metrics* metrics) : config_(config), metrics_(metrics) {}
  void OnHello(ucx::AmMessage&& m);
  void OnSelect(ucx::AmMessage&& m);
  void OnBye(ucx::AmMessage&& m);
  // Loop thread: sends a reply (code 0 = payload is the response).
  void Reply(ucp_ep_h ep, uint64_t request_id, int code, std::string payload,
             std::string connection_key = "");
  void WorkerMain();

  ServerConfig config_;
  Metrics* metrics_;
  std::unique_ptr<ucx::UcxLoop> loop_;
  std::string address_;
  Engine* engine_ = nullptr;

  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Tenant> tokens_;       // one-time admission tokens
  // One admitted client. `ingest` is its open Ingest stream (one at a time); dropping the
  // connection (BYE, or the watched endpoint failing) destroys it, which discards
  // everything it received: a vanished client never leaves a partial segment.
  struct Conn {
    Tenant tenant;
    std::mutex mu;
    std::unique_ptr<Engine::IngestStream> ingest;
  };
  absl::flat_hash_map<std::string, std::shared_ptr<Conn>> connections_;  // by key
  // Loop thread only: endpoints to clients' workers, watched for failure.
  std::map<std::string, std::unique_ptr<ucx::UcxEndpoint>> watch_;
  void DropConnection(const std::string& key);
  void OnIngest(ucx::AmMessage&& m);
  void Enqueue(std::function<void()> job);
  uint64_t refused_ = 0;

  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::deque<std::function<void()>> work_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvshade::service

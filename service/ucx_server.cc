// UcxServer (ucx_server.h): admission by one-time token, SelectAndReconstruct over UCX
// active messages, engine work on its own threads.
#include "kvshade/service/ucx_server.h"

#include <openssl/rand.h>

#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "kvshade/service/engine.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {
namespace {

constexpr size_t kMaxOutstandingTokens = 1 << 16;
constexpr size_t kMaxConnections = 1 << 16;

std::string RandomKey() {
  std::string k(16, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(k.data()), static_cast<int>(k.size())) != 1) {
    return "";  // callers treat an empty key as "cannot issue"
  }
  return k;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Start(const ServerConfig& config,
                                                            Metrics* metrics) {
  std::unique_ptr<UcxServer> s(new UcxServer(config, metrics));
  UcxServer* self = s.get();
  std::map<unsigned, ucx::UcxLoop::Handler> handlers;
  handlers[ucx::kHello] = [self](ucx::AmMessage&& m) { self->OnHello(std::move(m)); };
  handlers[ucx::kSelect] = [self](ucx::AmMessage&& m) { self->OnSelect(std::move(m)); };
  handlers[ucx::kBye] = [self](ucx::AmMessage&& m) { self->OnBye(std::move(m)); };
  handlers[ucx::kIngest] = [self](ucx::AmMessage&& m) { self->OnIngest(std::move(m)); };
  auto loop = ucx::UcxLoop::Start(config.ucx.transports, std::move(handlers));
  if (!loop.ok()) {
    return absl::Status(loop.status().code(),
                        absl::StrCat("ucx data plane: ", loop.status().message()));
  }
  s->loop_ = *std::move(loop);
  s->address_ = ucx::EncodeWorkerAddress(s->loop_->address());
  s->loop_->set_max_payload(config.limits.max_message_bytes);
  const int threads = std::max<uint32_t>(1, config.ucx.engine_threads);
  for (int i = 0; i < threads; ++i) s->workers_.emplace_back([self] { self->WorkerMain(); });
  spdlog::info("ucx data plane: worker address {} bytes, transports '{}', {} engine threads",
               s->loop_->address().size(),
               config.ucx.transports.empty() ? std::string("auto") : config.ucx.transports,
               threads);
  return s;
}

UcxServer::~UcxServer() { Stop(); }

void UcxServer::Stop() {
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (stop_) return;
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  if (loop_) loop_->Stop([this] { watch_.clear(); });
  std::lock_guard<std::mutex> lock(mu_);
  connections_.clear();  // discards open ingest streams
  engine_ = nullptr;
}

void UcxServer::SetEngine(Engine* engine) {
  std::lock_guard<std::mutex> lock(mu_);
  engine_ = engine;
}

std::string UcxServer::IssueToken(const Tenant& tenant) {
  std::string token = RandomKey();
  if (token.empty()) return "";
  std::lock_guard<std::mutex> lock(mu_);
  // Tokens of workers that never connect are dropped oldest-unknown first (bounded map).
  if (tokens_.size() >= kMaxOutstandingTokens) tokens_.erase(tokens_.begin());
  tokens_[token] = tenant;
  return token;
}

uint64_t UcxServer::refused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

uint64_t UcxServer::connections() const {
  std::lock_guard<std::mutex> lock(mu_);
  return connections_.size();
}

void UcxServer::Reply(ucp_ep_h ep, uint64_t request_id, int code, std::string payload,
                      std::string connection_key) {
  if (ep == nullptr) return;  // the peer sent without the reply flag: nowhere to answer
  v1::DataPlaneHeader h;
  h.set_request_id(request_id);
  h.set_code(code);
  if (!connection_key.empty()) h.set_connection_key(std::move(connection_key));
  absl::Status st = loop_->Send(ep, ucx::kReply, h.SerializeAsString(), std::move(payload));
  if (!st.ok()) spdlog::warn("ucx data plane: reply failed: {}", std::string(st.message()));
}

void UcxServer::OnHello(ucx::AmMessage&& m) {
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(m.header)) {
    Reply(m.reply_ep, 0, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "ucx HELLO: the header is not a DataPlaneHeader");
    return;
  }
  std::string key;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tokens_.find(h.admission_token());
    if (h.admission_token().empty() || it == tokens_.end() ||
        connections_.size() >= kMaxConnections) {
      ++refused_;
    } else {
      key = RandomKey();
      if (!key.empty()) {
        auto conn = std::make_shared<Conn>();
        conn->tenant = it->second;
        connections_[key] = std::move(conn);
      }
      tokens_.erase(it);  // one-time
    }
  }
  if (!key.empty() && !h.worker_address().empty()) {
    // Watch the client's worker: when it goes away without BYE, drop its connection (and
    // any open ingest). Transports without peer-failure support (shm) are not watched.
    // Endpoints are made and closed in posted tasks, never inside a UCX callback (closing
    // progresses the worker).
    loop_->Post([this, key, addr = h.worker_address()] {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!connections_.contains(key)) return;  // BYE came first
      }
      auto ep = ucx::UcxEndpoint::Connect(loop_->worker(), addr, [this, key] {
        loop_->Post([this, key] { DropConnection(key); });
      });
      if (!ep.ok()) return;
      if ((*ep)->peer_failure_detection()) {
        watch_[key] = *std::move(ep);
      } else {
        std::shared_ptr<ucx::UcxEndpoint> unused(std::move(*ep));
        loop_->Post([unused] {});
      }
    });
  }
  if (key.empty()) {
    metrics_->Error(static_cast<int>(absl::StatusCode::kPermissionDenied));
    Reply(m.reply_ep, h.request_id(), static_cast<int>(absl::StatusCode::kPermissionDenied),
          "ucx HELLO: the admission token is missing, unknown or already used (get one "
          "from Attach)");
    return;
  }
  Reply(m.reply_ep, h.request_id(), 0, "", key);
}

void UcxServer::OnBye(ucx::AmMessage&& m) {
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(m.header)) return;
  DropConnection(h.connection_key());
}

void UcxServer::DropConnection(const std::string& key) {
  std::shared_ptr<Conn> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = connections_.find(key);
    if (it != connections_.end()) {
      conn = std::move(it->second);
      connections_.erase(it);
    }
  }
  auto w = watch_.find(key);
  if (w != watch_.end()) {
    // Closed later, outside the endpoint's own error callback.
    std::shared_ptr<ucx::UcxEndpoint> ep(std::move(w->second));
    watch_.erase(w);
    loop_->Post([ep] {});
  }
  if (conn != nullptr) {
    // Discard an open ingest now unless an engine thread is using it (it then notices the
    // dropped connection and lets go when done).
    std::unique_lock<std::mutex> lock(conn->mu, std::try_to_lock);
    if (lock.owns_lock()) conn->ingest.reset();
  }
}

void UcxServer::Enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (stop_) return;
    work_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void UcxServer::OnIngest(ucx::AmMessage&& m) {
  const auto start = std::chrono::steady_clock::now();
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(m.header)) {
    Reply(m.reply_ep, 0, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "ucx request: the header is not a DataPlaneHeader");
    return;
  }
  std::shared_ptr<Conn> conn;
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = connections_.find(h.connection_key());
    if (it != connections_.end()) {
      conn = it->second;
      engine = engine_;
    } else {
      ++refused_;
    }
  }
  if (conn == nullptr || engine == nullptr) {
    const auto code = conn == nullptr ? absl::StatusCode::kPermissionDenied
                                      : absl::StatusCode::kUnavailable;
    metrics_->Error(static_cast<int>(code));
    Reply(m.reply_ep, h.request_id(), static_cast<int>(code),
          "ucx Ingest: not admitted (send HELLO with an admission token from Attach)");
    return;
  }
  Enqueue([this, engine, conn = std::move(conn), key = h.connection_key(), h = std::move(h),
           ep = m.reply_ep, payload = std::move(m.payload), start]() mutable {
    absl::Status st;
    std::string out;
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      v1::IngestRequest req;
      if (!req.ParseFromString(h.body())) {
        st = absl::InvalidArgumentError("ucx Ingest: the body is not an IngestRequest");
      } else if (req.has_header()) {
        if (conn->ingest != nullptr) {
          st = absl::FailedPreconditionError(
              "ucx Ingest: this connection already has an open Ingest; commit it first");
        } else {
          auto s = engine->BeginIngest(conn->tenant, req);
          if (s.ok()) {
            conn->ingest = *std::move(s);
          } else {
            st = s.status();
          }
        }
      } else if (conn->ingest == nullptr) {
        st = absl::FailedPreconditionError(
            "ucx Ingest: no open Ingest on this connection (send the header first)");
      } else {
        if (req.has_layer()) {
          // Re-attach the tensor bytes from the payload.
          v1::IngestLayer* l = req.mutable_layer();
          std::vector<v1::Tensor*> parts;
          if (l->has_k()) parts.push_back(l->mutable_k());
          if (l->has_v()) parts.push_back(l->mutable_v());
          if (l->has_observation_queries()) parts.push_back(l->mutable_observation_queries());
          uint64_t total = 0;
          for (uint64_t b : h.part_bytes()) total += b;
          if (static_cast<size_t>(h.part_bytes_size()) != parts.size() || total != payload.size()) {
            st = absl::InvalidArgumentError(absl::StrCat(
                "ucx Ingest: part_bytes (", h.part_bytes_size(), " parts, ", total,
                " bytes) does not describe the payload (", parts.size(), " tensors, ",
                payload.size(), " bytes)"));
          } else {
            size_t off = 0;
            for (size_t i = 0; i < parts.size(); ++i) {
              parts[i]->set_data(payload.substr(off, h.part_bytes(static_cast<int>(i))));
              off += h.part_bytes(static_cast<int>(i));
            }
          }
        }
        if (st.ok()) st = conn->ingest->Add(req);
        if (st.ok() && conn->ingest->committed()) {
          out = conn->ingest->response().SerializeAsString();
          conn->ingest.reset();
        } else if (!st.ok()) {
          conn->ingest.reset();  // like a failed gRPC stream: nothing is kept
        }
      }
      // The connection may have been dropped while this ran: let go of its stream.
      std::lock_guard<std::mutex> reg(mu_);
      if (!connections_.contains(key)) conn->ingest.reset();
    }
    const int code = static_cast<int>(st.code());
    metrics_->ObserveRpc("ucx/Ingest", code,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (!st.ok()) {
      metrics_->Error(code);
      out = std::string(st.message());
    }
    loop_->Post([this, ep, id = h.request_id(), code, out = std::move(out)]() mutable {
      Reply(ep, id, code, std::move(out));
    });
  });
}

void UcxServer::OnSelect(ucx::AmMessage&& m) {
  const auto start = std::chrono::steady_clock::now();
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(m.header)) {
    Reply(m.reply_ep, 0, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "ucx request: the header is not a DataPlaneHeader");
    return;
  }
  Tenant tenant;
  Engine* engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = connections_.find(h.connection_key());
    if (it != connections_.end()) {
      tenant = it->second->tenant;
      engine = engine_;
    } else {
      ++refused_;
    }
  }
  if (engine == nullptr) {
    const auto code = tenant.name.empty() ? absl::StatusCode::kPermissionDenied
                                          : absl::StatusCode::kUnavailable;
    metrics_->Error(static_cast<int>(code));
    Reply(m.reply_ep, h.request_id(), static_cast<int>(code),
          code == absl::StatusCode::kPermissionDenied
              ? "ucx request: not admitted (send HELLO with an admission token from Attach)"
              : "ucx request: the server is stopping");
    return;
  }
  // Engine work leaves the progress thread; the reply comes back to it.
  auto job = [this, engine, tenant = std::move(tenant), id = h.request_id(), ep = m.reply_ep,
              payload = std::move(m.payload), start]() mutable {
    absl::Status st;
    std::string out;
    v1::SelectAndReconstructRequest req;
    if (!req.ParseFromString(payload)) {
      st = absl::InvalidArgumentError(
          "ucx SelectAndReconstruct: the payload is not a SelectAndReconstructRequest");
    } else {
      auto r = engine->SelectAndReconstruct(tenant, req);
      if (r.ok()) {
        out = r->SerializeAsString();
      } else {
        st = r.status();
      }
    }
    const int code = static_cast<int>(st.code());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics_->ObserveRpc("ucx/SelectAndReconstruct", code, secs);
    if (!st.ok()) {
      metrics_->Error(code);
      out = std::string(st.message());
    }
    loop_->Post([this, ep, id, code, out = std::move(out)]() mutable {
      Reply(ep, id, code, std::move(out));
    });
  };
  Enqueue(std::move(job));
}

void UcxServer::WorkerMain() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(work_mu_);
      work_cv_.wait(lock, [&] { return stop_ || !work_.empty(); });
      if (stop_) return;
      job = std::move(work_.front());
      work_.pop_front();
    }
    job();
  }
}

}  // namespace kvshade::service

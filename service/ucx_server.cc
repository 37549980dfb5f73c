// UcxServer (ucx_server.h): admission by one-time token; SelectAndReconstruct (with RMA
// delivery into registered slot buffers), Attend, AppendTokens and pipelined Ingest over
// UCX active messages; engine work on its own threads, replies from the progress thread.
#include "kvshade/service/ucx_server.h"

#include <openssl/rand.h>

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "admission.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/model.h"
#include "kvshade/service/log.h"
#include "delivery.h"
#include "stream_pace.h"
#include "kvshade/transport/frame.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {
namespace {

constexpr size_t kMaxOutstandingTokens = 1 << 16;
constexpr size_t kMaxConnections = 1 << 16;
constexpr size_t kMaxStreamsPerConnection = 64;        // open or failed ingest streams
constexpr uint64_t kMaxIngestAhead = 64;  // messages of a stream waiting for an earlier one
constexpr size_t kMaxRegistrationsPerConnection = 4096;  // slot-buffer registrations

using SteadyClock = std::chrono::steady_clock;

constexpr std::string_view kSelectMethod = "ucx/SelectAndReconstruct";
constexpr std::string_view kAttendMethod = "ucx/Attend";

std::string RandomKey() {
  std::string k(16, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(k.data()), static_cast<int>(k.size())) != 1) {
    return "";  // callers treat an empty key as "cannot issue"
  }
  return k;
}

absl::Status ValidateSlotBuffers(const v1::UcxSlotBuffers& b) {
  if (b.attachment_id().empty()) {
    return absl::InvalidArgumentError("ucx REGISTER: attachment_id is empty");
  }
  if (b.k_address() == 0 || b.v_address() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx REGISTER: k_address and v_address must be non-zero, got ", b.k_address(), " and ",
        b.v_address()));
  }
  if (b.bytes() == 0 || b.k_address() + b.bytes() < b.k_address() ||
      b.v_address() + b.bytes() < b.v_address()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx REGISTER: bytes must be > 0 and fit the address space, got ", b.bytes()));
  }
  for (const auto* rkey : {&b.k_rkey(), &b.v_rkey()}) {
    if (rkey->empty() || rkey->size() > ucx::UcxRemoteKey::kMaxPackedRkeyBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ucx REGISTER: k_rkey and v_rkey must hold 1..", ucx::UcxRemoteKey::kMaxPackedRkeyBytes,
          " bytes, got ", b.k_rkey().size(), " and ", b.v_rkey().size()));
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct UcxServer::CallSlot {
  TenantAdmission::Ticket ticket;
};

struct UcxServer::IngestPace {
  IngestPace(StreamPaceLimits limits, std::weak_ptr<Conn> conn, uint64_t sid)
      : pace(limits), conn(std::move(conn)), sid(sid), start(SteadyClock::now()) {}
  PipelinedPace pace;
  const std::weak_ptr<Conn> conn;  // not owned: a dropped connection's streams are gone
  const uint64_t sid;
  const SteadyClock::time_point start;
  bool over = false;  // ended (commit or cancel received), failed or cut: no longer paced
};

UcxServer::UcxServer(const ServerConfig& config, DeviceRouter* engine, Metrics* metrics,
                     TenantAdmission* admission)
    : config_(config), metrics_(metrics), admission_(admission), engine_(engine) {}

absl::StatusOr<std::unique_ptr<UcxServer>> UcxServer::Start(const ServerConfig& config,
                                                            DeviceRouter* engine, Metrics* metrics,
                                                            TenantAdmission* admission,
                                                            kernels::DeviceRuntime* backend) {
  if (engine == nullptr || metrics == nullptr || admission == nullptr) {
    return absl::InvalidArgumentError("ucx data plane: engine, metrics and admission must be set");
  }
  std::unique_ptr<UcxServer> s(new UcxServer(config, engine, metrics, admission));
  UcxServer* self = s.get();
  std::map<unsigned, ucx::UcxLoop::Handler> handlers;
  handlers[ucx::kHello] = [self](ucx::AmMessage&& m) { self->OnHello(std::move(m)); };
  handlers[ucx::kSelectFrame] = [self](ucx::AmMessage&& m) {
    self->OnDecodeFrame(std::move(m), frame::kSelect);
  };
  handlers[ucx::kBye] = [self](ucx::AmMessage&& m) { self->OnBye(std::move(m)); };
  handlers[ucx::kIngest] = [self](ucx::AmMessage&& m) { self->OnIngest(std::move(m)); };
  handlers[ucx::kRegister] = [self](ucx::AmMessage&& m) { self->OnRegister(std::move(m)); };
  handlers[ucx::kAppend] = [self](ucx::AmMessage&& m) { self->OnAppend(std::move(m)); };
  handlers[ucx::kAttendFrame] = [self](ucx::AmMessage&& m) {
    self->OnDecodeFrame(std::move(m), frame::kAttend);
  };
  handlers[ucx::kUnregister] = [self](ucx::AmMessage&& m) { self->OnUnregister(std::move(m)); };
  // The tick looks at the paced ingest streams (at most 50 ms late on a deadline).
  std::function<void()> tick;
  if (PaceLimits(config.limits).any()) tick = [self] { self->PaceTick(); };
  auto loop = ucx::UcxLoop::Start(config.ucx.transports, std::move(handlers), std::move(tick));
  if (!loop.ok()) {
    return absl::Status(loop.status().code(),
                        absl::StrCat("ucx data plane: ", loop.status().message()));
  }
  s->loop_ = *std::move(loop);
  s->address_ = ucx::EncodeWorkerAddress(s->loop_->address());
  if (config.ucx.receive_buffers > 0) {
    ucx::ReceivePool::Allocator alloc;
    if (backend != nullptr) {
      alloc = [backend](size_t bytes) -> absl::StatusOr<std::shared_ptr<void>> {
        KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer buf, backend->AllocateStaging(bytes));
        auto holder = std::make_shared<kernels::Buffer>(std::move(buf));
        return std::shared_ptr<void>(holder, holder->data());
      };
    }
    auto pool = ucx::ReceivePool::Create(config.ucx.receive_buffers, config.ucx.receive_buffer_bytes,
                                         std::move(alloc));
    if (!pool.ok()) {
      return absl::Status(pool.status().code(),
                          absl::StrCat("ucx data plane: ", pool.status().message(),
                                       " (ucx.receive_buffers x ucx.receive_buffer_bytes)"));
    }
    s->pool_ = *std::move(pool);
    // Set on the loop thread, which reads it; no peer can have connected yet.
    (void)s->loop_->CallStatus([self] {
      self->loop_->set_receive_pool(self->pool_);
      return absl::OkStatus();
    });
  }
  s->loop_->set_max_payload(config.limits.max_message_bytes);
  s->loop_->set_busy_poll(std::chrono::microseconds(config.ucx.busy_poll_us));
  const int threads = std::max<uint32_t>(1, config.ucx.engine_threads);
  for (int i = 0; i < threads; ++i) s->workers_.emplace_back([self] { self->WorkerMain(); });
  spdlog::info("ucx data plane: worker address {} bytes, transports '{}', {} engine threads, "
               "{} receive buffers of {} bytes",
               s->loop_->address().size(),
               config.ucx.transports.empty() ? std::string("auto") : config.ucx.transports,
               threads, config.ucx.receive_buffers, config.ucx.receive_buffer_bytes);
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
  {
    // Jobs that never ran go now, while the engine is still there.
    std::deque<std::function<void()>> dropped;
    std::lock_guard<std::mutex> lock(work_mu_);
    dropped.swap(work_);
  }
  if (loop_) {
    loop_->Stop([this] {
      std::vector<std::shared_ptr<Conn>> all;
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& [key, c] : connections_) all.push_back(c);
      }
      for (auto& c : all) {
        c->closed = true;
        c->regs.clear();  // rkeys before their endpoint
        c->num_regs.store(0);
        c->ep.reset();
      }
    });
  }
  std::vector<std::shared_ptr<Conn>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, c] : connections_) all.push_back(std::move(c));
    connections_.clear();
  }
  // Open ingest streams (nothing of them is kept) and ingest messages that never ran go
  // now, with the tenant slots they hold, while the engine is still there.
  for (auto& c : all) {
    absl::flat_hash_map<uint64_t, IngestState> streams;
    std::deque<std::function<void()>> queued;
    {
      std::lock_guard<std::mutex> lock(c->mu);
      c->dropped = true;
      streams.swap(c->streams);
      queued.swap(c->ingest_queue);
    }
  }
  paced_.clear();  // the loop thread is gone
  std::lock_guard<std::mutex> lock(mu_);
  engine_ = nullptr;
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

absl::StatusOr<std::shared_ptr<UcxServer::CallSlot>> UcxServer::AdmitCall(const Conn& conn,
                                                                           std::string_view what,
                                                                           bool stream) {
  KVSHADE_ASSIGN_OR_RETURN(TenantAdmission::Ticket ticket,
                           admission_->Admit(what, conn.tenant.name, stream));
  auto slot = std::make_shared<CallSlot>();
  slot->ticket = std::move(ticket);
  return slot;
}

void UcxServer::Finish(const std::shared_ptr<Conn>& conn, ucp_ep_h ep, uint64_t request_id,
                       std::string_view method, SteadyClock::time_point start, Outcome out,
                       const std::shared_ptr<CallSlot>& slot) {
  // The slot is free before the client hears the answer: its next call is admitted.
  if (slot != nullptr) slot->ticket.Reset();
  const int code = static_cast<int>(out.status.code());
  const double secs = std::chrono::duration<double>(SteadyClock::now() - start).count();
  metrics_->ObserveRpc(method, code, secs);
  log::Rpc(method, out.status, secs, conn->tenant.name);
  // (ObserveRpc counts the error too.)
  if (!out.status.ok()) out.payload = std::string(out.status.message());
  auto send = [this, conn, ep, request_id, code, frame = out.frame, count = out.count,
               payload = std::move(out.payload)]() mutable {
    // A closed connection's endpoint (often the very reply endpoint) is gone.
    if (conn->closed) return;
    if (frame) {
      ReplyFrame(ep, request_id, code, code == 0 ? count : 0, std::move(payload));
    } else {
      Reply(ep, request_id, code, std::move(payload));
    }
  };
  if (loop_->on_loop_thread()) {
    send();
  } else {
    loop_->Post(std::move(send));
  }
}

absl::Status UcxServer::Lookup(const std::string& key, size_t oversize, bool oversize_ok,
                               std::string_view what, std::shared_ptr<Conn>* conn,
                               DeviceRouter** engine) {
  *engine = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = connections_.find(key);
    if (it != connections_.end()) {
      *conn = it->second;
      *engine = engine_;
    } else {
      ++refused_;
    }
  }
  absl::Status st;
  if (*conn == nullptr) {
    st = absl::PermissionDeniedError(absl::StrCat(
        "ucx ", std::string(what),
        ": not admitted (send HELLO with an admission token from Attach)"));
  } else if (*engine == nullptr) {
    st = absl::UnavailableError(absl::StrCat("ucx ", std::string(what), ": the server is stopping"));
  } else if (oversize > 0 && !oversize_ok) {
    st = absl::ResourceExhaustedError(absl::StrCat(
        "ucx ", std::string(what), ": the ", oversize,
        "-byte payload exceeds limits.max_message_bytes (", config_.limits.max_message_bytes,
        "); send smaller parts"));
  }
  if (!st.ok()) metrics_->Error(static_cast<int>(st.code()));
  return st;
}

std::shared_ptr<UcxServer::Conn> UcxServer::Admit(const ucx::AmMessage& m, v1::DataPlaneHeader* h,
                                                  DeviceRouter** engine, std::string_view what) {
  if (!h->ParseFromString(m.header)) {
    Reply(m.reply_ep, 0, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "ucx request: the header is not a DataPlaneHeader");
    return nullptr;
  }
  std::shared_ptr<Conn> conn;
  // Ingest fails an oversize message in stream order instead.
  absl::Status st = Lookup(h->connection_key(), m.oversize, what == "Ingest", what, &conn, engine);
  if (!st.ok()) {
    Reply(m.reply_ep, h->request_id(), static_cast<int>(st.code()), std::string(st.message()));
    return nullptr;
  }
  return conn;
}

void UcxServer::OnHello(ucx::AmMessage&& m) {
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(m.header)) {
    Reply(m.reply_ep, 0, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "ucx HELLO: the header is not a DataPlaneHeader");
    return;
  }
  std::shared_ptr<Conn> conn;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tokens_.find(h.admission_token());
    if (h.admission_token().empty() || it == tokens_.end() ||
        connections_.size() >= kMaxConnections) {
      ++refused_;
    } else {
      std::string key = RandomKey();
      if (!key.empty()) {
        conn = std::make_shared<Conn>();
        conn->key = key;
        conn->tenant = it->second;
        connections_[key] = conn;
      }
      tokens_.erase(it);  // one-time
    }
  }
  if (conn == nullptr) {
    metrics_->Error(static_cast<int>(absl::StatusCode::kPermissionDenied));
    Reply(m.reply_ep, h.request_id(), static_cast<int>(absl::StatusCode::kPermissionDenied),
          "ucx HELLO: the admission token is missing, unknown or already used (get one "
          "from Attach)");
    return;
  }
  if (h.worker_address().empty()) {
    Reply(m.reply_ep, h.request_id(), 0, "", conn->key);
    return;
  }
  // Connect back to the client's worker (RMA puts; a watch where the transports detect a
  // dead peer), in a posted task: creating an endpoint progresses the worker, which must
  // not happen inside this callback. HELLO is answered only then, so the endpoint exists
  // before any REGISTER of this client can arrive.
  loop_->Post([this, conn, ep = m.reply_ep, id = h.request_id(), addr = h.worker_address(),
               peer = h.peer_failure_detection()] {
    if (conn->closed) return;
    auto back = ucx::UcxEndpoint::Connect(
        loop_->worker(), addr,
        [this, key = conn->key] { loop_->Post([this, key] { DropConnection(key); }); }, peer);
    if (!back.ok()) {
      if (back.status().code() == absl::StatusCode::kUnimplemented) {
        // UCX paired our endpoint with the client's and found different error modes
        // (peer_failure_detection was wrong): it destroyed that endpoint, the client's
        // reply path included, so nobody is left to answer.
        spdlog::warn("ucx data plane: a client's HELLO misstated its error mode; dropped");
        DropConnection(conn->key);
        return;
      }
      spdlog::warn("ucx data plane: cannot connect back to a client's worker ({}); no RMA "
                   "delivery or disconnect watch for it",
                   std::string(back.status().message()));
    } else {
      conn->ep = *std::move(back);
    }
    Reply(ep, id, 0, "", conn->key);
  });
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
    if (it == connections_.end()) return;
    conn = std::move(it->second);
    connections_.erase(it);
  }
  // Open ingest streams are discarded (nothing of them is kept) on an engine thread; a
  // message being processed right now discards its own stream when it sees `dropped`.
  auto streams = std::make_shared<absl::flat_hash_map<uint64_t, IngestState>>();
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    conn->dropped = true;
    streams->swap(conn->streams);
    conn->ingest_queue.clear();
  }
  // The tenant's slots are free now; the engine's streams go on an engine thread.
  for (auto& [sid, state] : *streams) state.slot.reset();
  if (!streams->empty()) Enqueue([streams] { streams->clear(); });
  for (auto& [sid, order] : conn->reorder) {
    if (order.pace != nullptr) order.pace->over = true;
  }
  conn->reorder.clear();
  if (conn->closed) return;
  conn->closed = true;
  // The endpoint closes in a later task (never inside its own error callback), after a
  // flush of the puts in flight, which may still use the rkeys.
  loop_->Post([this, conn] {
    if (conn->ep == nullptr || conn->regs.empty()) {
      conn->regs.clear();
      conn->ep.reset();
      return;
    }
    ucx::Flush(conn->ep->get(), [this, conn](absl::Status) {
      loop_->Post([conn] {
        conn->regs.clear();
        conn->num_regs.store(0);
        conn->ep.reset();
      });
    });
  });
}

void UcxServer::RetireRegistrations(const std::shared_ptr<Conn>& conn,
                                    std::vector<Registration> regs,
                                    std::function<void(absl::Status)> then) {
  auto held = std::make_shared<std::vector<Registration>>(std::move(regs));
  if (conn->ep == nullptr) {
    held->clear();
    if (then) then(absl::OkStatus());
    return;
  }
  ucx::Flush(conn->ep->get(), [this, held, then = std::move(then)](absl::Status st) {
    loop_->Post([held, then, st] {
      held->clear();
      if (then) then(st);
    });
  });
}

void UcxServer::Enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(work_mu_);
    if (stop_) return;
    work_.push_back(std::move(job));
  }
  work_cv_.notify_one();
}

void UcxServer::RunInOrder(const std::shared_ptr<Conn>& conn, std::function<void()> job) {
  bool start = false;
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    conn->ingest_queue.push_back(std::move(job));
    if (!conn->ingest_running) conn->ingest_running = start = true;
  }
  if (!start) return;
  // One engine thread drains the connection's queue; messages that arrive meanwhile join
  // the queue, so receiving part i+1 overlaps processing part i.
  Enqueue([conn] {
    for (;;) {
      std::function<void()> next;
      {
        std::lock_guard<std::mutex> lock(conn->mu);
        if (conn->ingest_queue.empty()) {
          conn->ingest_running = false;
          return;
        }
        next = std::move(conn->ingest_queue.front());
        conn->ingest_queue.pop_front();
      }
      next();
    }
  });
}

// --- Ingest -------------------------------------------------------------------------------

void UcxServer::ReportPoolMisses() {
  if (pool_ == nullptr) return;
  const uint64_t misses = pool_->misses();
  if (misses > pool_misses_reported_) metrics_->UcxReceivePoolMisses(misses - pool_misses_reported_);
  pool_misses_reported_ = misses;
}

void UcxServer::OnIngest(ucx::AmMessage&& m) {
  const auto start = SteadyClock::now();
  ReportPoolMisses();
  v1::DataPlaneHeader h;
  DeviceRouter* engine = nullptr;
  std::shared_ptr<Conn> conn = Admit(m, &h, &engine, "Ingest");
  if (conn == nullptr) return;
  const uint64_t sid = h.stream_id(), seq = h.sequence();
  // A commit or cancel ends the stream's numbering, a header opens a stream (the body has
  // no tensor bytes: cheap).
  v1::IngestRequest body;
  const bool parsed = body.ParseFromString(h.body());
  const bool ends = h.cancel() || (parsed && body.has_commit());
  const bool opens = !h.cancel() && parsed && body.has_header();
  auto it = conn->reorder.find(sid);
  if (it == conn->reorder.end()) {
    if (conn->reorder.size() >= kMaxStreamsPerConnection) {
      Finish(conn, m.reply_ep, h.request_id(), "ucx/Ingest", start,
             {absl::ResourceExhaustedError(absl::StrCat(
                  "ucx Ingest: this connection has ", conn->reorder.size(),
                  " ingest streams in flight (limit ", kMaxStreamsPerConnection, ")")),
              ""});
      return;
    }
    it = conn->reorder.emplace(sid, Conn::Reorder{}).first;
    if (const StreamPaceLimits limits = PaceLimits(config_.limits); limits.any()) {
      it->second.pace = std::make_shared<IngestPace>(limits, conn, sid);
      paced_.push_back(it->second.pace);
    }
  }
  Conn::Reorder& order = it->second;
  if (seq < order.next || order.waiting.contains(seq) ||
      seq - order.next > kMaxIngestAhead) {
    Finish(conn, m.reply_ep, h.request_id(), "ucx/Ingest", start,
           {absl::InvalidArgumentError(absl::StrCat(
                "ucx Ingest: sequence ", seq, " of stream ", sid, " is a duplicate or too far ahead (next ",
                order.next, ")")),
            ""});
    return;
  }
  // Limits per tenant: a header takes a call and a stream slot of the tenant's, counted
  // with its gRPC calls and streams, for the stream it opens; a refusal fails the stream in
  // order (its parts on their way fail with it). The stream's other messages take none.
  absl::StatusOr<std::shared_ptr<CallSlot>> admitted = std::shared_ptr<CallSlot>();
  if (opens) admitted = AdmitCall(*conn, "ucx Ingest", /*stream=*/true);
  const uint64_t bytes = h.body().size() + std::max<uint64_t>(m.payload.size(), m.oversize);
  order.waiting[seq] = {[this, conn, engine, h = std::move(h), ep = m.reply_ep,
                         payload = std::move(m.payload), oversize = m.oversize, start,
                         admitted = std::move(admitted), pace = order.pace]() mutable {
                          IngestJob(conn, engine, std::move(h), ep, std::move(payload), oversize,
                                    start, std::move(admitted), std::move(pace));
                        },
                        ends, bytes};
  // Hand over every message that is now next in line; a stream's end resets its count.
  while (!order.waiting.empty() && order.waiting.begin()->first == order.next) {
    Conn::Reorder::Message next = std::move(order.waiting.begin()->second);
    order.waiting.erase(order.waiting.begin());
    ++order.next;
    if (order.pace != nullptr && !order.pace->over) {
      // The client's message is in: the wait for it ends (a progress window that closed
      // short cuts the stream before this message runs).
      if (absl::Status st = order.pace->pace.Received(start, next.bytes); !st.ok()) {
        CutStream(conn, *order.pace, std::move(st));
      }
    }
    RunInOrder(conn, std::move(next.job));
    if (next.ends) {
      // The client has sent the whole stream: it no longer waits for it.
      if (order.pace != nullptr) order.pace->over = true;
      // Messages numbered after the end belong to no open stream: they run after it and
      // are answered as such (FAILED_PRECONDITION) rather than never.
      for (auto& [later_seq, later] : order.waiting) RunInOrder(conn, std::move(later.job));
      conn->reorder.erase(it);
      return;
    }
  }
}

namespace {

TensorView ViewOfMeta(const v1::Tensor& t, std::string_view bytes) {
  TensorView v = ViewOf(t);  // shape and dtype; the body carries no bytes
  v.data = bytes;
  return v;
}

}  // namespace

absl::Status UcxServer::AddLayerPart(Engine::IngestStream& stream, const v1::DataPlaneHeader& h,
                                     const v1::IngestLayer& layer, std::string_view payload) {
  // The body's tensors in wire order (transport/frame.h BodyTensors): k, v, observation
  // queries, those present.
  const size_t n = size_t{layer.has_k()} + size_t{layer.has_v()} +
                  size_t{layer.has_observation_queries()};
  KVSHADE_ASSIGN_OR_RETURN(std::vector<std::string_view> bytes,
                           transport::SplitParts(h, payload, n, "Ingest"));
  if (layer.k().has_cuda_ipc() || layer.v().has_cuda_ipc()) {
    // A part in the worker's GPU memory: the message carries where it is (cuda_ipc), read
    // by the message path as on gRPC; inline bytes beside it are refused there.
    v1::IngestRequest msg;
    *msg.mutable_layer() = layer;
    size_t j = 0;
    for (v1::Tensor* t : transport::BodyTensors(&msg)) {
      t->set_data(bytes[j].data(), bytes[j].size());
      ++j;
    }
    return stream.Add(msg);
  }
  IngestLayerView part;
  part.layer = layer.layer();
  part.token_offset = layer.token_offset();
  part.last_part = layer.last_part();
  size_t i = 0;
  if (layer.has_k()) part.k = ViewOfMeta(layer.k(), bytes[i++]);
  if (layer.has_v()) part.v = ViewOfMeta(layer.v(), bytes[i++]);
  if (layer.has_observation_queries()) {
    part.observation_queries = ViewOfMeta(layer.observation_queries(), bytes[i++]);
  }
  return stream.AddLayer(part);
}

void UcxServer::IngestJob(const std::shared_ptr<Conn>& conn, DeviceRouter* engine,
                          v1::DataPlaneHeader h, ucp_ep_h ep, ucx::Payload payload,
                          size_t oversize, SteadyClock::time_point start,
                          absl::StatusOr<std::shared_ptr<CallSlot>> admitted,
                          std::shared_ptr<IngestPace> pace) {
  const uint64_t sid = h.stream_id();
  Outcome out;
  std::unique_ptr<Engine::IngestStream> stream, discard;  // destroyed outside conn->mu
  // A header's slots, until the stream it opens holds them (IngestState::slot); every
  // other end of the stream (commit, failure, cancel, cut, the connection's drop) gives
  // them back where it removes or fails the stream.
  const absl::Status refused = admitted.status();
  std::shared_ptr<CallSlot> slot = admitted.ok() ? *std::move(admitted) : nullptr;
  const auto finish = [&] {
    slot.reset();  // a header that opened no stream gives its slots back before the reply
    discard.reset();
    if (pace != nullptr) {
      // Loop thread: with none of its messages left in hand, the stream waits for its
      // client. A message that failed ended the stream (or belonged to none).
      loop_->Post([pace, failed = !out.status.ok(), now = SteadyClock::now()] {
        if (failed) pace->over = true;
        pace->pace.Processed(now);
      });
    }
    Finish(conn, ep, h.request_id(), "ucx/Ingest", start, std::move(out));
  };
  if (h.cancel()) {
    std::lock_guard<std::mutex> lock(conn->mu);
    auto it = conn->streams.find(sid);
    if (it != conn->streams.end()) {
      discard = std::move(it->second.stream);
      conn->streams.erase(it);
    }
  } else {
    v1::IngestRequest req;
    const bool parsed = req.ParseFromString(h.body());
    if (oversize > 0) {
      out.status = absl::ResourceExhaustedError(absl::StrCat(
          "ucx Ingest: the ", oversize, "-byte payload exceeds limits.max_message_bytes (",
          config_.limits.max_message_bytes, "); send smaller parts"));
    } else if (!parsed) {
      out.status = absl::InvalidArgumentError("ucx Ingest: the body is not an IngestRequest");
    } else if (!req.has_layer() && !payload.empty()) {
      out.status = absl::InvalidArgumentError(absl::StrCat(
          "ucx Ingest: only layer parts carry a payload, got ", payload.size(), " bytes"));
    }
    // Take the stream (or check that a header may open one).
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      auto it = conn->streams.find(sid);
      if (conn->dropped) {
        out.status = absl::UnavailableError("ucx Ingest: the connection was dropped");
      } else if (parsed && req.has_header()) {
        if (it != conn->streams.end()) {
          out.status = absl::FailedPreconditionError(absl::StrCat(
              "ucx Ingest: stream ", sid, " is already open on this connection (commit or cancel it)"));
        } else if (conn->streams.size() >= kMaxStreamsPerConnection) {
          out.status = absl::ResourceExhaustedError(absl::StrCat(
              "ucx Ingest: this connection has ", conn->streams.size(),
              " open ingest streams (limit ", kMaxStreamsPerConnection, "); commit or cancel one"));
        }
      } else if (it == conn->streams.end()) {
        if (out.status.ok()) {
          out.status = absl::FailedPreconditionError(absl::StrCat(
              "ucx Ingest: no open ingest stream ", sid, " on this connection (send the header first)"));
        }
      } else if (!it->second.failed.ok()) {
        // A stream cut by its pace tells the client why, as over gRPC (no message of it
        // carried the error yet); any other failure was the answer to its own message.
        out.status = it->second.cut ? it->second.failed
                                    : absl::AbortedError(absl::StrCat(
                                          "ucx Ingest: an earlier message of stream ", sid,
                                          " failed, so the stream was discarded: ",
                                          it->second.failed.message()));
      } else if (!out.status.ok()) {
        // A malformed message fails its stream like a rejected part does.
        discard = std::move(it->second.stream);
        it->second.failed = out.status;
        it->second.slot.reset();
      } else if (it->second.stream == nullptr) {
        out.status = absl::InternalError(absl::StrCat("ucx Ingest: stream ", sid, " has no state"));
        it->second.failed = out.status;
        it->second.slot.reset();
      } else {
        stream = std::move(it->second.stream);
      }
    }
    if (out.status.ok() && req.has_header()) {
      using Begun = absl::StatusOr<std::unique_ptr<Engine::IngestStream>>;
      Begun begun = refused.ok() ? engine->BeginIngest(conn->tenant, req) : Begun(refused);
      std::lock_guard<std::mutex> lock(conn->mu);
      IngestState& state = conn->streams[sid];
      if (begun.ok()) {
        state.stream = *std::move(begun);
        state.slot = std::move(slot);
      } else {
        out.status = begun.status();
        state.failed = out.status;  // the parts already on their way fail with it
      }
      if (conn->dropped) {
        discard = std::move(state.stream);
        conn->streams.erase(sid);
      }
    } else if (out.status.ok()) {
      if (req.has_layer()) {
        // The part's bytes are used where they landed (a receive-pool buffer): views, no copy.
        out.status = AddLayerPart(*stream, h, req.layer(), payload.view());
      } else {
        out.status = stream->Add(req);
      }
      // Over UCX the commit message is the stream's end (its numbering restarts after it),
      // so an accepted commit is applied now; a failure of either commits nothing.
      bool committed = false;
      if (out.status.ok() && req.has_commit()) {
        absl::StatusOr<v1::IngestResponse> r = stream->Finish();
        if (r.ok()) {
          out.payload = r->SerializeAsString();
          committed = true;
        } else {
          out.status = r.status();
        }
      }
      std::lock_guard<std::mutex> lock(conn->mu);
      auto it = conn->streams.find(sid);
      if (conn->dropped || it == conn->streams.end()) {
        discard = std::move(stream);
      } else if (committed) {
        discard = std::move(stream);
        conn->streams.erase(it);  // with its slots
      } else if (!out.status.ok()) {
        discard = std::move(stream);  // like a failed gRPC stream: nothing is kept
        it->second.failed = out.status;
        it->second.slot.reset();
      } else {
        it->second.stream = std::move(stream);
      }
    }
  }
  finish();
}

void UcxServer::PaceTick() {
  const auto now = SteadyClock::now();
  for (size_t i = 0; i < paced_.size();) {
    IngestPace& p = *paced_[i];
    std::shared_ptr<Conn> conn = p.conn.lock();
    absl::Status st;
    if (!p.over && conn != nullptr && !conn->closed) {
      if (now < p.pace.Deadline()) {
        ++i;
        continue;
      }
      st = p.pace.Expire(now);
      if (st.ok()) {
        ++i;  // a progress window closed with enough bytes
        continue;
      }
      CutStream(conn, p, std::move(st));
    }
    paced_[i] = std::move(paced_.back());
    paced_.pop_back();
  }
}

void UcxServer::CutStream(const std::shared_ptr<Conn>& conn, IngestPace& pace, absl::Status why) {
  pace.over = true;
  // The stream was waiting: none of its messages is in hand, so no engine thread works on
  // it, and those that arrive from now on see it failed. Its slots are free at once (the
  // client's next stream is admitted on arrival); the engine's stream is discarded in the
  // connection's ingest order (so before any later message of the connection runs: the
  // session may be ingested again right away).
  std::shared_ptr<Engine::IngestStream> discard;
  std::shared_ptr<CallSlot> slot;
  {
    std::lock_guard<std::mutex> lock(conn->mu);
    auto it = conn->streams.find(pace.sid);
    if (it != conn->streams.end() && it->second.failed.ok()) {
      discard = std::move(it->second.stream);
      slot = std::move(it->second.slot);
      it->second.failed = why;
      it->second.cut = true;
    }
  }
  slot.reset();
  if (discard != nullptr) {
    RunInOrder(conn, [discard = std::move(discard)]() mutable { discard.reset(); });
  }
  // Counted and logged like a gRPC stream the pace ends (the stream's own messages are
  // counted as they are answered).
  const double secs = std::chrono::duration<double>(SteadyClock::now() - pace.start).count();
  metrics_->ObserveRpc("ucx/Ingest", static_cast<int>(why.code()), secs);
  log::Rpc("ucx/Ingest", why, secs, conn->tenant.name);
}

// --- Select, Attend, Append ---------------------------------------------------------------

namespace {

TensorView ViewOf(const frame::TensorRef& t) {
  TensorView v;
  if (!t.present()) return v;
  v.dtype = static_cast<v1::DType>(t.dtype);
  v.rank = 2;
  v.shape[0] = t.rows;
  v.shape[1] = t.cols;
  v.data = t.data;
  return v;
}

std::string_view Bytes(const std::vector<kernels::bf16>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(kernels::bf16)};
}

std::string EncodeDeltas(const SelectResult& r) {
  size_t bytes = 0;
  for (const SlotDeltaResult& d : r.deltas) bytes += 24 + 12 * d.head.size() + 2 * Bytes(d.keys).size();
  std::string body;
  body.reserve(bytes);
  for (const SlotDeltaResult& d : r.deltas) {
    frame::DeltaRef ref;
    ref.chunk_size = d.chunk_size;
    ref.head_dim = d.head_dim;
    ref.selected = d.selected;
    ref.hits = d.hits;
    ref.delivered = d.delivered;
    ref.fallback = d.fallback;
    ref.tokens = d.tokens;
    ref.misses = d.misses();
    ref.head = d.head.data();
    ref.slot = d.slot.data();
    ref.chunk = d.chunk.data();
    ref.position = d.position.data();
    if (!d.delivered) {
      ref.keys = Bytes(d.keys);
      ref.values = Bytes(d.values);
    }
    frame::AppendDelta(ref, &body);
  }
  return body;
}

std::string EncodeOutputs(const AttendResult& r) {
  std::string body;
  for (size_t i = 0; i < r.outputs.size(); ++i) {
    frame::OutputRef o;
    o.query_heads = static_cast<uint32_t>(r.lse[i].size());
    o.head_dim = o.query_heads == 0 ? 0 : static_cast<uint32_t>(r.outputs[i].size() / o.query_heads);
    o.output = {reinterpret_cast<const char*>(r.outputs[i].data()), r.outputs[i].size() * 4};
    o.lse = {reinterpret_cast<const char*>(r.lse[i].data()), r.lse[i].size() * 4};
    o.tokens = r.tokens[i];
    frame::AppendOutput(o, &body);
  }
  return body;
}

}  // namespace

void UcxServer::ReplyFrame(ucp_ep_h ep, uint64_t request_id, int code, uint32_t count,
                           std::string payload) {
  if (ep == nullptr) return;
  frame::FrameHeader h;
  h.kind = frame::kReply;
  h.request_id = request_id;
  h.code = code;
  h.count = count;
  absl::Status st = loop_->Send(ep, ucx::kFrameReply, frame::EncodeHeader(h), std::move(payload));
  if (!st.ok()) spdlog::warn("ucx data plane: reply failed: {}", std::string(st.message()));
}

void UcxServer::OnDecodeFrame(ucx::AmMessage&& m, frame::Kind kind) {
  const auto start = SteadyClock::now();
  const std::string_view method = kind == frame::kSelect ? kSelectMethod : kAttendMethod;
  absl::StatusOr<frame::FrameHeader> h = frame::DecodeHeader(m.header);
  if (h.ok() && h->kind != kind) {
    h = absl::InvalidArgumentError("ucx frame: the header's kind does not match the message");
  }
  if (!h.ok()) {
    metrics_->Error(static_cast<int>(h.status().code()));
    ReplyFrame(m.reply_ep, 0, static_cast<int>(h.status().code()), 0, std::string(h.status().message()));
    return;
  }
  std::shared_ptr<Conn> conn;
  DeviceRouter* engine = nullptr;
  // (Batch and shape limits are the engine's; the parse refuses counts the payload cannot
  // hold.)
  if (absl::Status st = Lookup(h->key, m.oversize, false, method, &conn, &engine); !st.ok()) {
    ReplyFrame(m.reply_ep, h->request_id, static_cast<int>(st.code()), 0, std::string(st.message()));
    return;
  }
  // Calls in flight per tenant, counted with the tenant's gRPC calls: refused here, before
  // the frame is parsed or queued.
  absl::StatusOr<std::shared_ptr<CallSlot>> admitted = AdmitCall(
      *conn, kind == frame::kSelect ? "ucx SelectAndReconstruct" : "ucx Attend", false);
  if (!admitted.ok()) {
    Finish(conn, m.reply_ep, h->request_id, method, start, {admitted.status(), "", true, 0});
    return;
  }
  // Small batches run on the progress thread (no hand-off to an engine thread and back),
  // unless a query stages a token: the call that completes one appends it (a durable
  // session may sync its log), which must not hold up every connection's progress.
  bool run_here = h->count <= config_.ucx.inline_max_batch;
  if (run_here) {
    auto qs = frame::ParseQueries(m.payload.view(), h->count, kind);
    run_here = !qs.ok() || std::none_of(qs->begin(), qs->end(), [](const frame::QueryRef& q) { return q.stage; });
  }
  auto job = [this, engine, conn, kind, method, layer = h->layer, count = h->count,
              id = h->request_id, ep = m.reply_ep, payload = std::move(m.payload), start,
              slot = *std::move(admitted)]() {
    absl::StatusOr<std::vector<frame::QueryRef>> qs = frame::ParseQueries(payload.view(), count, kind);
    if (!qs.ok()) {
      Finish(conn, ep, id, method, start, {qs.status(), "", true, 0}, slot);
      return;
    }
    if (kind == frame::kAttend) {
      std::vector<AttendQueryView> views(qs->size());
      for (size_t i = 0; i < qs->size(); ++i) {
        const frame::QueryRef& q = (*qs)[i];
        views[i] = {q.attachment_id, ViewOf(q.q), ViewOf(q.k_new), ViewOf(q.v_new), q.stage,
                    q.stage_token_id, q.hold};
      }
      AttendResult res;
      absl::Status st = engine->Attend(conn->tenant, AttendRequestView{layer, views}, &res);
      Finish(conn, ep, id, method, start,
             {st, st.ok() ? EncodeOutputs(res) : "", true, static_cast<uint32_t>(views.size())},
             slot);
      return;
    }
    std::vector<SelectQueryView> views(qs->size());
    for (size_t i = 0; i < qs->size(); ++i) {
      const frame::QueryRef& q = (*qs)[i];
      views[i] = {q.attachment_id, ViewOf(q.q), ViewOf(q.chunks), ViewOf(q.k_new), ViewOf(q.v_new),
                  q.stage, q.stage_token_id, static_cast<v1::SelectPurpose>(q.purpose), q.hold};
    }
    auto res = std::make_shared<SelectResult>();
    absl::Status st = engine->Select(conn->tenant, SelectRequestView{layer, views}, res.get());
    if (!st.ok()) {
      Finish(conn, ep, id, method, start, {st, "", true, 0}, slot);
      return;
    }
    if (conn->num_regs.load() > 0) {
      std::vector<std::string> ids;
      for (const SelectQueryView& v : views) ids.emplace_back(v.attachment_id);
      auto deliver = [this, conn, ep, id, layer, res, ids = std::move(ids), start,
                      slot]() mutable {
        DeliverSelect(conn, ep, id, layer, std::move(ids), res, start, std::move(slot));
      };
      if (loop_->on_loop_thread()) {
        deliver();
      } else {
        loop_->Post(std::move(deliver));
      }
      return;
    }
    Finish(conn, ep, id, method, start,
           {absl::OkStatus(), EncodeDeltas(*res), true, static_cast<uint32_t>(res->deltas.size())},
           slot);
  };
  if (run_here) {
    job();
  } else {
    Enqueue(std::move(job));
  }
}

void UcxServer::DeliverSelect(std::shared_ptr<Conn> conn, ucp_ep_h ep, uint64_t request_id,
                              uint32_t layer, std::vector<std::string> ids,
                              std::shared_ptr<SelectResult> res, SteadyClock::time_point start,
                              std::shared_ptr<CallSlot> slot) {
  if (conn->closed) return;  // (the slot goes with the last of its holders)
  std::vector<size_t> registered;  // deltas whose misses go by RMA
  absl::Status st;
  bool any_put = false;
  for (size_t i = 0; i < res->deltas.size() && st.ok(); ++i) {
    const SlotDeltaResult& d = res->deltas[i];
    if (d.delivered) continue;  // already in the worker's buffers (CUDA IPC)
    auto it = conn->regs.find(ids[i]);
    if (it == conn->regs.end() || conn->ep == nullptr) continue;
    const Registration& r = it->second;
    const SlotLayout& g = r.geometry;
    const uint64_t row_bytes = g.RowBytes();
    const uint64_t m = d.misses();
    // The engine's delta must match the geometry the buffers were registered with; a
    // mismatch is our bug, never a reason to write outside the buffers.
    if (d.chunk_size != g.slot_tokens || d.head_dim != g.head_dim ||
        Bytes(d.keys).size() != m * row_bytes || Bytes(d.values).size() != m * row_bytes) {
      st = absl::InternalError(absl::StrCat(
          "ucx SelectAndReconstruct: the delta of attachment ", ids[i],
          " does not match its registered slot-buffer geometry (", m, " misses; ",
          g.slot_tokens, " tokens per slot, d ", g.head_dim, ")"));
      break;
    }
    const char* kdata = Bytes(d.keys).data();
    const char* vdata = Bytes(d.values).data();
    const bool inside = ForEachRowRun(g, layer, d, [&](uint32_t first, uint32_t n, uint64_t row) {
      if ((row + n) * row_bytes > r.bytes) return false;
      st = ucx::Put(conn->ep->get(), kdata + first * row_bytes, n * row_bytes,
                    r.k_address + row * row_bytes, r.k_rkey->get());
      if (st.ok()) {
        st = ucx::Put(conn->ep->get(), vdata + first * row_bytes, n * row_bytes,
                      r.v_address + row * row_bytes, r.v_rkey->get());
      }
      any_put = true;
      return st.ok();
    });
    if (!inside && st.ok()) {
      st = absl::InternalError(absl::StrCat(
          "ucx SelectAndReconstruct: a miss of attachment ", ids[i],
          " falls outside its registered slot buffers (", r.bytes, " bytes, layer ", layer, ")"));
    }
    if (st.ok()) registered.push_back(i);
  }
  auto reply = [this, conn, ep, request_id, res, registered, start, slot](absl::Status st) {
    if (st.ok()) {
      for (size_t i : registered) {
        SlotDeltaResult& d = res->deltas[i];
        d.keys.clear();
        d.values.clear();
        d.delivered = true;
      }
      Finish(conn, ep, request_id, kSelectMethod, start,
             {absl::OkStatus(), EncodeDeltas(*res), true, static_cast<uint32_t>(res->deltas.size())},
             slot);
    } else {
      Finish(conn, ep, request_id, kSelectMethod, start, {st, "", true, 0}, slot);
    }
  };
  if (!any_put) {
    reply(st);
    return;
  }
  // The result holds the puts' source bytes: it lives in this callback until the flush
  // says they have landed (or failed).
  ucx::Flush(conn->ep->get(), [this, reply, st](absl::Status flushed) {
    absl::Status result = st;
    if (result.ok() && !flushed.ok()) {
      result = absl::UnavailableError(absl::StrCat(
          "ucx SelectAndReconstruct: RMA delivery into the slot buffers failed: ",
          flushed.message()));
    }
    loop_->Post([reply, result] { reply(result); });
  });
}

void UcxServer::OnAppend(ucx::AmMessage&& m) {
  const auto start = SteadyClock::now();
  ReportPoolMisses();
  v1::DataPlaneHeader h;
  DeviceRouter* engine = nullptr;
  std::shared_ptr<Conn> conn = Admit(m, &h, &engine, "AppendTokens");
  if (conn == nullptr) return;
  absl::StatusOr<std::shared_ptr<CallSlot>> admitted = AdmitCall(*conn, "ucx AppendTokens", false);
  if (!admitted.ok()) {
    Finish(conn, m.reply_ep, h.request_id(), "ucx/AppendTokens", start, {admitted.status(), ""});
    return;
  }
  Enqueue([this, engine, conn, h = std::move(h), ep = m.reply_ep, payload = std::move(m.payload),
           start, slot = *std::move(admitted)]() mutable {
    v1::AppendTokensRequest req;
    Outcome out;
    if (!req.ParseFromString(h.body())) {
      out.status = absl::InvalidArgumentError("ucx AppendTokens: the body is not an AppendTokensRequest");
    } else {
      std::string bytes = std::move(payload).TakeString();
      out.status = transport::AttachParts(h, bytes, transport::BodyTensors(&req), "AppendTokens");
      if (out.status.ok()) {
        auto r = engine->AppendTokens(conn->tenant, req);
        if (r.ok()) {
          out.payload = r->SerializeAsString();
        } else {
          out.status = r.status();
        }
      }
    }
    Finish(conn, ep, h.request_id(), "ucx/AppendTokens", start, std::move(out), slot);
  });
}

// --- Slot-buffer registration -------------------------------------------------------------

void UcxServer::OnRegister(ucx::AmMessage&& m) {
  const auto start = SteadyClock::now();
  v1::DataPlaneHeader h;
  DeviceRouter* engine = nullptr;
  std::shared_ptr<Conn> conn = Admit(m, &h, &engine, "REGISTER");
  if (conn == nullptr) return;
  absl::StatusOr<std::shared_ptr<CallSlot>> admitted = AdmitCall(*conn, "ucx REGISTER", false);
  if (!admitted.ok()) {
    Finish(conn, m.reply_ep, h.request_id(), "ucx/Register", start, {admitted.status(), ""});
    return;
  }
  std::shared_ptr<CallSlot> slot = *std::move(admitted);
  auto bufs = std::make_shared<v1::UcxSlotBuffers>();
  absl::Status st = bufs->ParseFromArray(m.payload.data(), static_cast<int>(m.payload.size()))
                        ? ValidateSlotBuffers(*bufs)
                        : absl::InvalidArgumentError("ucx REGISTER: the payload is not a UcxSlotBuffers");
  if (!st.ok()) {
    Finish(conn, m.reply_ep, h.request_id(), "ucx/Register", start, {st, ""}, slot);
    return;
  }
  // The attachment's owner, mode and geometry come from the engine (an engine thread);
  // the rkeys are unpacked on the loop thread, which alone uses them.
  Enqueue([this, engine, conn, bufs, id = h.request_id(), ep = m.reply_ep, start, slot] {
    auto g = engine->AttachmentSlots(conn->tenant, bufs->attachment_id());
    absl::Status st = g.status();
    if (st.ok() && g->delivery != v1::DELIVERY_MODE_UCX_RMA) {
      st = absl::FailedPreconditionError(absl::StrCat(
          "ucx REGISTER: attachment ", bufs->attachment_id(), " was attached with delivery ",
          v1::DeliveryMode_Name(g->delivery), "; slot buffers need DELIVERY_MODE_UCX_RMA"));
    } else if (st.ok() && g->slots_per_head == 0) {
      st = absl::FailedPreconditionError(absl::StrCat(
          "ucx REGISTER: the session of attachment ", bufs->attachment_id(),
          " selects no chunks (its profile is not shadow): there is nothing to deliver"));
    } else if (st.ok() && bufs->bytes() < g->BufferBytes()) {
      st = absl::InvalidArgumentError(absl::StrCat(
          "ucx REGISTER: bytes must be >= slot_buffer_bytes ", g->BufferBytes(),
          " (L*h*slots_per_head*slot_tokens*d bf16) for attachment ", bufs->attachment_id(), ", got ",
          bufs->bytes()));
    }
    if (!st.ok()) {
      Finish(conn, ep, id, "ucx/Register", start, {st, ""}, slot);
      return;
    }
    loop_->Post([this, conn, bufs, geometry = *g, id, ep, start, slot] {
      if (conn->closed) return;
      absl::Status st;
      const bool replaces = conn->regs.contains(bufs->attachment_id());
      if (conn->ep == nullptr) {
        st = absl::FailedPreconditionError(
            "ucx REGISTER: the daemon has no endpoint to this client's worker (HELLO carried "
            "no worker_address, or connecting back failed), so RMA delivery is unavailable");
      } else if (!replaces && conn->regs.size() >= kMaxRegistrationsPerConnection) {
        st = absl::ResourceExhaustedError(absl::StrCat(
            "ucx REGISTER: this connection already has ", conn->regs.size(),
            " registered attachments (limit ", kMaxRegistrationsPerConnection, ")"));
      }
      Registration reg;
      if (st.ok()) {
        reg.geometry = geometry;
        reg.k_address = bufs->k_address();
        reg.v_address = bufs->v_address();
        reg.bytes = bufs->bytes();
        auto k = ucx::UcxRemoteKey::Unpack(*conn->ep, bufs->k_rkey());
        auto v = ucx::UcxRemoteKey::Unpack(*conn->ep, bufs->v_rkey());
        if (!k.ok() || !v.ok()) {
          st = absl::InvalidArgumentError(absl::StrCat(
              "ucx REGISTER: ", !k.ok() ? "k_rkey" : "v_rkey", " does not unpack: ",
              (!k.ok() ? k.status() : v.status()).message()));
        } else {
          reg.k_rkey = *std::move(k);
          reg.v_rkey = *std::move(v);
        }
      }
      if (st.ok()) {
        std::vector<Registration> old;
        if (replaces) old.push_back(std::move(conn->regs[bufs->attachment_id()]));
        conn->regs[bufs->attachment_id()] = std::move(reg);
        conn->num_regs.store(static_cast<int>(conn->regs.size()));
        if (!old.empty()) {
          // Answered once no put into the replaced buffers is in flight (the client may
          // free them then).
          RetireRegistrations(conn, std::move(old),
                              [this, conn, ep, id, start, slot](absl::Status s) {
                                Finish(conn, ep, id, "ucx/Register", start, {s, ""}, slot);
                              });
          return;
        }
      }
      Finish(conn, ep, id, "ucx/Register", start, {st, ""}, slot);
    });
  });
}

void UcxServer::OnUnregister(ucx::AmMessage&& m) {
  const auto start = SteadyClock::now();
  v1::DataPlaneHeader h;
  DeviceRouter* engine = nullptr;
  std::shared_ptr<Conn> conn = Admit(m, &h, &engine, "UNREGISTER");
  if (conn == nullptr) return;
  v1::UcxSlotBuffers bufs;
  if (!bufs.ParseFromArray(m.payload.data(), static_cast<int>(m.payload.size())) || bufs.attachment_id().empty()) {
    Finish(conn, m.reply_ep, h.request_id(), "ucx/Unregister", start,
           {absl::InvalidArgumentError(
                "ucx UNREGISTER: the payload must be a UcxSlotBuffers naming attachment_id"),
            ""});
    return;
  }
  auto it = conn->regs.find(bufs.attachment_id());
  if (it == conn->regs.end()) {  // idempotent
    Finish(conn, m.reply_ep, h.request_id(), "ucx/Unregister", start, {absl::OkStatus(), ""});
    return;
  }
  std::vector<Registration> old;
  old.push_back(std::move(it->second));
  conn->regs.erase(it);
  conn->num_regs.store(static_cast<int>(conn->regs.size()));
  // Answered after the flush: once the client has the reply, no put into those buffers
  // is in flight, and it may unmap and free them.
  RetireRegistrations(conn, std::move(old),
                      [this, conn, ep = m.reply_ep, id = h.request_id(), start](absl::Status st) {
                        Finish(conn, ep, id, "ucx/Unregister", start, {st, ""});
                      });
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

// UCX building blocks (see ucx_core.h): RAII owners, status conversion, the progress
// thread and active-message assembly. Every ucs_status_t becomes an absl::Status here; no
// exception leaves a UCX callback (handlers run inside try/catch).
#include "kvshade/transport/ucx_core.h"

#include <poll.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace kvshade::transport::ucx {
namespace {

absl::StatusCode CodeOf(ucs_status_t s) {
  switch (s) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_NO_RESOURCE:
      return absl::StatusCode::kResourceExhausted;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return absl::StatusCode::kInvalidArgument;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case UCS_ERR_CANCELED:
      return absl::StatusCode::kCancelled;
    case UCS_ERR_UNSUPPORTED:
      return absl::StatusCode::kUnimplemented;
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SHMEM_SEGMENT:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

// Bounded progress of a request on the current thread (close and flush paths).
constexpr auto kCloseTimeout = std::chrono::seconds(2);

}  // namespace

absl::Status FromUcs(ucs_status_t s, std::string_view what) {
  if (s == UCS_OK) return absl::OkStatus();
  return absl::Status(CodeOf(s), absl::StrCat("UCX ", std::string(what), ": ",
                                              ucs_status_string(s)));
}

constexpr char kAddressPrefix[] = "ucx-worker:";

std::string EncodeWorkerAddress(const std::string& raw) {
  return absl::StrCat(kAddressPrefix, absl::Base64Escape(raw));
}

absl::StatusOr<std::string> DecodeWorkerAddress(const std::string& text) {
  std::string raw;
  if (!absl::StartsWith(text, kAddressPrefix) ||
      !absl::Base64Unescape(text.substr(sizeof(kAddressPrefix) - 1), &raw) || raw.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data_plane_address must be '", kAddressPrefix, "<base64>', got '", text.substr(0, 64), "'"));
  }
  return raw;
}

// --- UcxContext ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create(const std::string& transports) {
  ucp_config_t* config = nullptr;
  if (absl::Status st = FromUcs(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
      !st.ok()) {
    return st;
  }
  if (!transports.empty()) {
    const ucs_status_t s = ucp_config_modify(config, "TLS", transports.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat("ucx.transports '", transports, "' rejected by UCX: ", ucs_status_string(s)));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
  ucp_context_h h = nullptr;
  const ucs_status_t s = ucp_init(&params, config, &h);
  ucp_config_release(config);
  if (s != UCS_OK) return FromUcs(s, "ucp_init");
  return std::unique_ptr<UcxContext>(new UcxContext(h));
}

UcxContext::~UcxContext() { ucp_cleanup(h_); }

// --- UcxWorker ----------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(UcxContext& ctx) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h h = nullptr;
  if (absl::Status st = FromUcs(ucp_worker_create(ctx.get(), &params, &h), "ucp_worker_create");
      !st.ok()) {
    return st;
  }
  return std::unique_ptr<UcxWorker>(new UcxWorker(h));
}

UcxWorker::~UcxWorker() { ucp_worker_destroy(h_); }

absl::StatusOr<std::string> UcxWorker::Address() const {
  ucp_address_t* addr = nullptr;
  size_t len = 0;
  if (absl::Status st = FromUcs(ucp_worker_get_address(h_, &addr, &len), "ucp_worker_get_address");
      !st.ok()) {
    return st;
  }
  std::string out(reinterpret_cast<const char*>(addr), len);
  ucp_worker_release_address(h_, addr);
  return out;
}

// --- UcxEndpoint --------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Connect(
    UcxWorker& worker, const std::string& address, std::function<void()> on_error,
    bool peer_failure) {
  if (address.empty()) {
    return absl::InvalidArgumentError("UCX connect: the data-plane address is empty");
  }
  std::unique_ptr<UcxEndpoint> ep(new UcxEndpoint(worker.get()));
  ep->on_error_ = std::move(on_error);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  params.err_handler.cb = &UcxEndpoint::OnError;
  params.err_handler.arg = ep.get();
  ep->peer_failure_detection_ = peer_failure;
  ucs_status_t s = ucp_ep_create(worker.get(), &params, &ep->h_);
  if (s == UCS_ERR_UNREACHABLE && peer_failure) {
    // UCX 1.13's shared-memory transports have no peer-failure support; such an endpoint
    // (same host only) runs without failure detection: calls then time out instead.
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    s = ucp_ep_create(worker.get(), &params, &ep->h_);
    ep->peer_failure_detection_ = false;
  }
  if (absl::Status st = FromUcs(s, "ucp_ep_create"); !st.ok()) {
    ep->h_ = nullptr;
    return st;
  }
  return ep;
}

void UcxEndpoint::OnError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* self = static_cast<UcxEndpoint*>(arg);
  self->error_status_.store(status);
  self->failed_.store(true);
  if (self->on_error_) {
    try {
      self->on_error_();
    } catch (...) {
      std::fprintf(stderr, "kvshade ucx: endpoint error handler threw; ignored\n");
    }
  }
}

absl::Status UcxEndpoint::error() const {
  if (!failed_.load()) return absl::OkStatus();
  return FromUcs(static_cast<ucs_status_t>(error_status_.load()), "endpoint");
}

UcxEndpoint::~UcxEndpoint() {
  if (h_ == nullptr) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = failed_.load() ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(h_, &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const auto deadline = std::chrono::steady_clock::now() + kCloseTimeout;
  while (ucp_request_check_status(req) == UCS_INPROGRESS &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker_);
  }
  if (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_request_cancel(worker_, req);
  ucp_request_free(req);
}

// --- UcxMemHandle / UcxRemoteKey ----------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxMemHandle>> UcxMemHandle::Map(UcxContext& ctx, void* data,
                                                                size_t bytes) {
  if (data == nullptr || bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX mem map: need a non-null buffer of > 0 bytes, got ", bytes, " bytes"));
  }
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = data;
  p.length = bytes;
  ucp_mem_h h = nullptr;
  if (absl::Status st = FromUcs(ucp_mem_map(ctx.get(), &p, &h), "ucp_mem_map"); !st.ok()) return st;
  return std::unique_ptr<UcxMemHandle>(new UcxMemHandle(ctx.get(), h, data, bytes));
}

UcxMemHandle::~UcxMemHandle() { ucp_mem_unmap(ctx_, h_); }

absl::StatusOr<std::string> UcxMemHandle::PackRkey() const {
  void* buf = nullptr;
  size_t len = 0;
  if (absl::Status st = FromUcs(ucp_rkey_pack(ctx_, h_, &buf, &len), "ucp_rkey_pack"); !st.ok()) {
    return st;
  }
  std::string out(static_cast<const char*>(buf), len);
  ucp_rkey_buffer_release(buf);
  return out;
}

absl::StatusOr<std::unique_ptr<UcxRemoteKey>> UcxRemoteKey::Unpack(UcxEndpoint& ep,
                                                                  const std::string& packed) {
  if (packed.empty()) return absl::InvalidArgumentError("UCX rkey: the packed key is empty");
  if (packed.size() > kMaxPackedRkeyBytes) {
    return absl::InvalidArgumentError(absl::StrCat("UCX rkey: a packed key must be <= ",
                                                   kMaxPackedRkeyBytes, " bytes, got ",
                                                   packed.size()));
  }
  // The packed form (UCX 1.13 ucp_rkey_pack) is a 64-bit md map, a memory-type byte, then
  // per md in the map one length byte and that many bytes, then (device memory only) a
  // small trailer. ucp_ep_rkey_unpack trusts all of it, and UCX 1.13 crashes cleaning up
  // a key whose transport part fails to unpack, so the framing is checked here first.
  uint64_t md_map = 0;
  if (packed.size() < sizeof(md_map) + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX rkey: a packed key has at least 9 bytes, got ", packed.size()));
  }
  std::memcpy(&md_map, packed.data(), sizeof(md_map));
  const auto mem_type = static_cast<uint8_t>(packed[sizeof(md_map)]);
  if (mem_type != UCS_MEMORY_TYPE_HOST) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX rkey: only host memory can be registered, got memory type ", mem_type));
  }
  size_t off = sizeof(md_map) + 1;
  for (int bit = 0; bit < 64; ++bit) {
    if (((md_map >> bit) & 1u) == 0) continue;
    if (off >= packed.size()) {
      return absl::InvalidArgumentError("UCX rkey: the key ends inside its md list");
    }
    off += 1 + static_cast<uint8_t>(packed[off]);
  }
  if (off != packed.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UCX rkey: the md list of a host-memory key spans ", off, " bytes, the key has ",
        packed.size()));
  }
  // Insurance: parse from a copy padded with zeros past anything the framing allows.
  std::string padded = packed;
  padded.resize(packed.size() + 8 + 1 + 64 * 256, '\0');
  ucp_rkey_h h = nullptr;
  if (absl::Status st = FromUcs(ucp_ep_rkey_unpack(ep.get(), padded.data(), &h), "ucp_ep_rkey_unpack");
      !st.ok()) {
    return st;
  }
  return std::unique_ptr<UcxRemoteKey>(new UcxRemoteKey(h));
}

UcxRemoteKey::~UcxRemoteKey() { ucp_rkey_destroy(h_); }

absl::Status WaitRequest(ucp_worker_h worker, ucs_status_ptr_t req, std::string_view what) {
  if (req == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(req)) return FromUcs(UCS_PTR_STATUS(req), what);
  ucs_status_t s;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) ucp_worker_progress(worker);
  ucp_request_free(req);
  return FromUcs(s, what);
}

absl::Status Put(ucp_ep_h ep, const void* src, size_t bytes, uint64_t remote, ucp_rkey_h rkey) {
  ucp_request_param_t p{};
  ucs_status_ptr_t req = ucp_put_nbx(ep, src, bytes, remote, rkey, &p);
  if (req == nullptr) return absl::OkStatus();
  if (UCS_PTR_IS_ERR(req)) return FromUcs(UCS_PTR_STATUS(req), "ucp_put_nbx");
  // Released now, completed later: the flush that follows reports the outcome.
  ucp_request_free(req);
  return absl::OkStatus();
}

namespace {

// Runs a flush's completion exactly once and frees it; nothing escapes into UCX.
void FinishFlush(std::function<void(absl::Status)>* done, absl::Status st) {
  try {
    (*done)(std::move(st));
  } catch (...) {
    std::fprintf(stderr, "kvshade ucx: flush completion threw; ignored\n");
  }
  delete done;
}

}  // namespace

void Flush(ucp_ep_h ep, std::function<void(absl::Status)> done) {
  auto* ctx = new std::function<void(absl::Status)>(std::move(done));
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.user_data = ctx;
  p.cb.send = [](void* req, ucs_status_t status, void* user_data) {
    FinishFlush(static_cast<std::function<void(absl::Status)>*>(user_data),
                FromUcs(status, "ucp_ep_flush_nbx"));
    ucp_request_free(req);
  };
  ucs_status_ptr_t req = ucp_ep_flush_nbx(ep, &p);
  if (req == nullptr) {
    FinishFlush(ctx, absl::OkStatus());
  } else if (UCS_PTR_IS_ERR(req)) {
    FinishFlush(ctx, FromUcs(UCS_PTR_STATUS(req), "ucp_ep_flush_nbx"));
  }
}

// --- UcxLoop ------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<UcxLoop>> UcxLoop::Start(const std::string& transports,
                                                        std::map<unsigned, Handler> handlers,
                                                        std::function<void()> tick,
                                                        std::chrono::milliseconds tick_every) {
  std::unique_ptr<UcxLoop> loop(new UcxLoop());
  loop->tick_ = std::move(tick);
  loop->tick_every_ = std::max(tick_every, std::chrono::milliseconds(1));
  auto ctx = UcxContext::Create(transports);
  if (!ctx.ok()) return ctx.status();
  loop->context_ = *std::move(ctx);
  auto worker = UcxWorker::Create(*loop->context_);
  if (!worker.ok()) return worker.status();
  loop->worker_ = *std::move(worker);
  auto addr = loop->worker_->Address();
  if (!addr.ok()) return addr.status();
  loop->address_ = *std::move(addr);
  if (loop->tick_) {
    if (absl::Status st = FromUcs(ucp_worker_get_efd(loop->worker_->get(), &loop->efd_),
                                  "ucp_worker_get_efd");
        !st.ok()) {
      return st;
    }
  }
  loop->handlers_ = std::move(handlers);
  for (const auto& [id, h] : loop->handlers_) {
    loop->am_args_.push_back(AmArg{loop.get(), id});
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = id;
    p.cb = &UcxLoop::OnAm;
    p.arg = &loop->am_args_.back();
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    if (absl::Status st = FromUcs(ucp_worker_set_am_recv_handler(loop->worker_->get(), &p),
                                  "ucp_worker_set_am_recv_handler");
        !st.ok()) {
      return st;
    }
  }
  loop->thread_ = std::thread([l = loop.get()] { l->Run(); });
  return loop;
}

UcxLoop::~UcxLoop() { Stop(); }

void UcxLoop::Stop(std::function<void()> cleanup) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      // Already stopping: only join below.
    } else {
      stopping_ = true;
      if (cleanup) tasks_.push_back(std::move(cleanup));
    }
  }
  if (worker_) ucp_worker_signal(worker_->get());
  if (thread_.joinable()) thread_.join();
  stopped_.store(true);
}

bool UcxLoop::Post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    tasks_.push_back(std::move(task));
    has_tasks_.store(true, std::memory_order_release);
  }
  ucp_worker_signal(worker_->get());
  return true;
}

absl::Status UcxLoop::CallStatus(std::function<absl::Status()> fn) {
  auto r = Call<bool>([fn = std::move(fn)]() -> absl::StatusOr<bool> {
    absl::Status st = fn();
    if (!st.ok()) return st;
    return true;
  });
  return r.status();
}

void UcxLoop::Run() {
  ucp_worker_h w = worker_->get();
  auto next_tick = std::chrono::steady_clock::now() + tick_every_;
  auto last_progress = std::chrono::steady_clock::now();
  for (;;) {
    while (ucp_worker_progress(w) != 0) {
      last_progress = std::chrono::steady_clock::now();
    }
    if (tick_ && std::chrono::steady_clock::now() >= next_tick) {
      next_tick = std::chrono::steady_clock::now() + tick_every_;
      try {
        tick_();
      } catch (...) {
        std::fprintf(stderr, "kvshade ucx: the tick threw; ignored\n");
      }
    }
    std::deque<std::function<void()>> tasks;
    bool stopping;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(tasks_);
      has_tasks_.store(false, std::memory_order_relaxed);
      stopping = stopping_;
    }
    if (!tasks.empty()) last_progress = std::chrono::steady_clock::now();
    for (auto& t : tasks) {
      try {
        t();
      } catch (...) {
        std::fprintf(stderr, "kvshade ucx: a task threw; ignored\n");
      }
    }
    if (!tasks.empty()) continue;
    if (stopping) break;
    // Transfers in flight (a rendezvous is several round trips, over shared memory many
    // fragments): keep progressing, yielding the core between polls, rather than sleep;
    // a wake-up per step costs more than the step. Bounded, in case a peer went silent.
    if (in_flight_ > 0) {
      if (ucp_worker_progress(w) != 0) {
        last_progress = std::chrono::steady_clock::now();
        continue;
      }
      if (std::chrono::steady_clock::now() - last_progress < std::chrono::milliseconds(20)) {
        std::this_thread::yield();
        continue;
      }
    }
    // Spin before sleeping (set_busy_poll): a decode loop sends its next request within
    // microseconds, and waking from epoll costs more than that. The spin runs from the last
    // activity, so a busy worker never sleeps between messages.
    const auto spin_until = last_progress + std::chrono::microseconds(busy_poll_us_.load());
    bool busy = false;
    while (std::chrono::steady_clock::now() < spin_until) {
      if (ucp_worker_progress(w) != 0) {
        busy = true;
        last_progress = std::chrono::steady_clock::now();
        break;
      }
      if (has_tasks_.load(std::memory_order_acquire)) break;  // a posted task: run it now
    }
    if (busy) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!tasks_.empty() || stopping_) continue;
    }
    const ucs_status_t armed = ucp_worker_arm(w);
    if (armed == UCS_ERR_BUSY) continue;
    if (armed != UCS_OK) continue;
    if (tick_) {
      // Sleep on the worker's event fd, but no longer than the next tick.
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          next_tick - std::chrono::steady_clock::now());
      pollfd pfd{efd_, POLLIN, 0};
      (void)poll(&pfd, 1, static_cast<int>(std::max<int64_t>(0, left.count()) + 1));
    } else {
      ucp_worker_wait(w);
    }
  }
  // Let queued sends finish before the worker goes away (bounded).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  while (std::chrono::steady_clock::now() < deadline && ucp_worker_progress(w) != 0) {
  }
}

// --- ReceivePool, Payload ---------------------------------------------------------------

struct ReceivePool::State {
  std::mutex mu;
  std::vector<char*> free;
};

absl::StatusOr<std::shared_ptr<ReceivePool>> ReceivePool::Create(size_t buffers,
                                                                 size_t buffer_bytes,
                                                                 Allocator alloc) {
  if (buffers == 0 || buffer_bytes == 0) {
    return absl::InvalidArgumentError("UCX receive pool: buffers and buffer_bytes must be > 0");
  }
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t stride = (buffer_bytes + page - 1) / page * page;
  if (buffers > SIZE_MAX / stride) {
    return absl::InvalidArgumentError("UCX receive pool: size overflows");
  }
  const size_t total = buffers * stride;
  std::shared_ptr<void> memory;
  if (alloc) {
    absl::StatusOr<std::shared_ptr<void>> m = alloc(total);
    if (!m.ok()) {
      return absl::Status(m.status().code(), absl::StrCat("UCX receive pool of ", buffers, " x ",
                                                          buffer_bytes, " bytes: ", m.status().message()));
    }
    memory = *std::move(m);
  } else {
    // MAP_POPULATE faults every page in now, once, instead of on each message.
    void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (base == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("UCX receive pool: cannot map ", buffers, " x ",
                                                       buffer_bytes, " bytes: ", std::strerror(errno)));
    }
    memory = std::shared_ptr<void>(base, [total](void* p) { munmap(p, total); });
  }
  if (memory == nullptr) return absl::InternalError("UCX receive pool: the allocator gave no memory");
  return std::shared_ptr<ReceivePool>(new ReceivePool(std::move(memory), buffers, buffer_bytes, stride));
}

ReceivePool::ReceivePool(std::shared_ptr<void> memory, size_t buffers, size_t buffer_bytes,
                         size_t stride)
    : buffers_(buffers),
      buffer_bytes_(buffer_bytes),
      state_(std::make_shared<State>()),
      memory_(std::move(memory)) {
  char* base = static_cast<char*>(memory_.get());
  state_->free.reserve(buffers);
  for (size_t i = buffers; i-- > 0;) state_->free.push_back(base + i * stride);
}

ReceivePool::~ReceivePool() = default;

std::shared_ptr<char> ReceivePool::Acquire() {
  char* buf = nullptr;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->free.empty()) {
      buf = state_->free.back();
      state_->free.pop_back();
    }
  }
  if (buf == nullptr) {
    CountMiss();
    return nullptr;
  }
  return std::shared_ptr<char>(buf, [state = state_, memory = memory_](char* p) {
    std::lock_guard<std::mutex> lock(state->mu);
    state->free.push_back(p);
  });
}

size_t ReceivePool::free_buffers() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->free.size();
}

std::string Payload::TakeString() && {
  if (!pooled_) return std::move(owned_);
  std::string out(pooled_.get(), pooled_size_);
  pooled_.reset();
  pooled_size_ = 0;
  return out;
}

namespace {

struct RndvRecv {
  UcxLoop* loop;
  AmMessage msg;
  std::function<void(AmMessage&&)> deliver;
};

struct SendCtx {
  std::string header, payload;
  std::vector<ucp_dt_iov_t> iov;
  int* in_flight = nullptr;  // the loop's count, while the send is pending
};

void OnSendDone(void* req, ucs_status_t status, void* user_data) {
  if (status != UCS_OK && status != UCS_ERR_CANCELED) {
    std::fprintf(stderr, "kvshade ucx: send failed: %s\n", ucs_status_string(status));
  }
  auto* ctx = static_cast<SendCtx*>(user_data);
  if (ctx->in_flight != nullptr) --*ctx->in_flight;
  delete ctx;
  ucp_request_free(req);
}

}  // namespace

ucs_status_t UcxLoop::OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
  try {
    auto* a = static_cast<AmArg*>(arg);
    AmMessage m;
    m.id = a->id;
    m.header.assign(static_cast<const char*>(header), header_length);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) m.reply_ep = param->reply_ep;
    if (length > a->loop->max_payload_.load()) {
      // Unread (a rendezvous payload is released when the callback returns UCS_OK); the
      // handler still sees the header, so that the sender gets an answer.
      m.oversize = length;
      a->loop->Deliver(std::move(m));
      return UCS_OK;
    }
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0) {
      m.payload = Payload(std::string(static_cast<const char*>(data), length));
      a->loop->Deliver(std::move(m));
      return UCS_OK;
    }
    // Rendezvous: pull the payload straight into a pool buffer, or the message's own.
    auto* r = new RndvRecv{a->loop, std::move(m), nullptr};
    void* dst = nullptr;
    if (ReceivePool* pool = a->loop->pool_.get(); pool != nullptr) {
      std::shared_ptr<char> buf = length <= pool->buffer_bytes() ? pool->Acquire() : nullptr;
      if (buf == nullptr) {
        if (length > pool->buffer_bytes()) pool->CountMiss();
      } else {
        dst = buf.get();
        r->msg.payload = Payload(std::move(buf), length);
      }
    }
    if (dst == nullptr) {
      std::string own(length, '\0');
      dst = own.data();
      r->msg.payload = Payload(std::move(own));
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.user_data = r;
    p.cb.recv_am = [](void* req, ucs_status_t status, size_t, void* user_data) {
      auto* rr = static_cast<RndvRecv*>(user_data);
      --rr->loop->in_flight_;
      if (status == UCS_OK) rr->loop->Deliver(std::move(rr->msg));
      delete rr;
      ucp_request_free(req);
    };
    ucs_status_ptr_t req = ucp_am_recv_data_nbx(a->loop->worker_->get(), data, dst, length, &p);
    if (req == nullptr) {
      a->loop->Deliver(std::move(r->msg));
      delete r;
    } else if (UCS_PTR_IS_ERR(req)) {
      std::fprintf(stderr, "kvshade ucx: rendezvous receive failed: %s\n",
                   ucs_status_string(UCS_PTR_STATUS(req)));
      delete r;
    } else {
      ++a->loop->in_flight_;
    }
    return UCS_OK;
  } catch (...) {
    std::fprintf(stderr, "kvshade ucx: active-message handler threw; message dropped\n");
    return UCS_OK;
  }
}

void UcxLoop::Deliver(AmMessage&& m) {
  auto it = handlers_.find(m.id);
  if (it == handlers_.end()) return;
  try {
    it->second(std::move(m));
  } catch (...) {
    std::fprintf(stderr, "kvshade ucx: handler for message %u threw; ignored\n", m.id);
  }
}

namespace {

// Starts one active-message send whose buffers `ctx` owns (or points to); `ctx` is freed
// when the send completes, at once when it completes immediately or fails.
absl::Status StartSend(ucp_ep_h ep, unsigned id, SendCtx* ctx, const void* data, size_t count,
                       ucp_request_param_t p, int* in_flight) {
  p.op_attr_mask |= UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                    UCP_OP_ATTR_FIELD_FLAGS;
  p.flags |= UCP_AM_SEND_FLAG_REPLY;
  p.user_data = ctx;
  p.cb.send = &OnSendDone;
  ucs_status_ptr_t req =
      ucp_am_send_nbx(ep, id, ctx->header.data(), ctx->header.size(), data, count, &p);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) {
    delete ctx;
    return req == nullptr ? absl::OkStatus() : FromUcs(UCS_PTR_STATUS(req), "ucp_am_send_nbx");
  }
  ctx->in_flight = in_flight;
  ++*in_flight;
  return absl::OkStatus();
}

}  // namespace

absl::Status UcxLoop::SendIov(ucp_ep_h ep, unsigned id, std::string header,
                              std::vector<std::pair<const void*, size_t>> parts) {
  if (ep == nullptr) return absl::FailedPreconditionError("UCX send: no endpoint");
  auto* ctx = new SendCtx{std::move(header), "", {}};
  size_t total = 0;
  for (const auto& [ptr, len] : parts) {
    if (len == 0) continue;
    ctx->iov.push_back(ucp_dt_iov_t{const_cast<void*>(ptr), len});
    total += len;
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE;
  p.flags = total > (64u << 10) ? UCP_AM_SEND_FLAG_RNDV : 0;
  p.datatype = ucp_dt_make_iov();
  return StartSend(ep, id, ctx, ctx->iov.data(), ctx->iov.size(), p, &in_flight_);
}

absl::Status UcxLoop::Send(ucp_ep_h ep, unsigned id, std::string header, std::string payload) {
  if (ep == nullptr) return absl::FailedPreconditionError("UCX send: no endpoint");
  auto* ctx = new SendCtx{std::move(header), std::move(payload), {}};
  return StartSend(ep, id, ctx, ctx->payload.data(), ctx->payload.size(), ucp_request_param_t{},
                   &in_flight_);
}

}  // namespace kvshade::transport::ucx

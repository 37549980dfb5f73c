// UCX building blocks shared by the daemon (ucx_server.h) and the client
// (kvshade/client/ucx_data_plane.h): RAII owners for every UCP handle, ucs_status_t ->
// absl::Status at the lowest wrapper, a progress thread that owns one worker, a
// messenger that turns UCX active messages (eager or rendezvous) into whole
// (header, payload) messages, and RMA put + flush for writing into a peer's registered
// memory.
//
// Threading: a ucp_worker_h is used only by its UcxLoop's thread (the worker is created
// UCS_THREAD_MODE_SINGLE). Other threads hand work to that thread with UcxLoop::Post or
// UcxLoop::Call; ucp_worker_signal wakes it. Callbacks that UCX invokes never throw: they
// only copy bytes and queue work.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvshade::transport::ucx {

// ucs_status_t -> absl::Status; `what` names the failed call.
absl::Status FromUcs(ucs_status_t s, std::string_view what);

// AttachResponse.data_plane_address is a proto string (UTF-8), so the worker's binary
// address travels as "ucx-worker:<base64>".
std::string EncodeWorkerAddress(const std::string& raw);
absl::StatusOr<std::string> DecodeWorkerAddress(const std::string& text);

// Active-message ids of the kvshade data plane (requests client -> daemon; replies
// daemon -> client carry kReply).
enum AmId : unsigned {
  kHello = 1,      // header: admission_token; reply payload: "" (key in the reply header)
  kBye = 3,        // forget the connection key; no reply
  kIngest = 4,     // header.body: IngestRequest without tensor data; payload: the data
  kRegister = 5,   // payload: UcxSlotBuffers (RMA slot buffers of one attachment)
  kAppend = 6,     // header.body: AppendTokensRequest without tensor data; payload: the data
  kUnregister = 8, // payload: UcxSlotBuffers with only attachment_id; reply after a flush
  // Binary decode frames (decode_frame.h): header and payload carry no protobuf; the
  // reply comes as kFrameReply. (Ids 2 and 7, the protobuf SELECT and ATTEND of earlier
  // releases, are not served.)
  kSelectFrame = 9,
  kAttendFrame = 10,
  kReply = 100,       // header: DataPlaneHeader (request_id, code); payload: response or error
  kFrameReply = 101,  // header: frame::FrameHeader (kind REPLY); payload: entries or error
};

class UcxContext {
 public:
  // `transports`: UCX_TLS value ("" = UCX's choice, e.g. "tcp,self" or "shm,self").
  // Features: active messages, RMA, wakeup.
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create(const std::string& transports);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;
  ucp_context_h get() const { return h_; }

 private:
  explicit UcxContext(ucp_context_h h) : h_(h) {}
  ucp_context_h h_;
};

class UcxWorker {
 public:
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(UcxContext& ctx);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;
  ucp_worker_h get() const { return h_; }
  // The worker's address as an opaque byte string (what Attach hands out).
  absl::StatusOr<std::string> Address() const;

 private:
  explicit UcxWorker(ucp_worker_h h) : h_(h) {}
  ucp_worker_h h_;
};

// An endpoint to a remote worker address, error mode PEER where the transports support
// it (a dead peer fails requests instead of hanging). Must be created and destroyed on the
// worker's thread; the destructor closes it (flush, bounded by progress).
//
// Two workers that connect to each other get ONE endpoint pair: UCX matches an endpoint
// created to a peer's address with the internal endpoint that peer's connection made here
// (the "reply endpoint" of its active messages). The two sides must then use the same
// error mode, or UCX destroys the matched endpoint; hence `peer_failure`.
class UcxEndpoint {
 public:
  // `on_error` (may be null) runs on the worker's thread when the peer fails.
  // `peer_failure`: ask for error mode PEER (falling back to NONE where the transports
  // cannot detect a dead peer); false: mode NONE from the start (the peer's endpoint to
  // us runs without detection, e.g. over UCX 1.13 shm).
  static absl::StatusOr<std::unique_ptr<UcxEndpoint>> Connect(
      UcxWorker& worker, const std::string& address, std::function<void()> on_error = nullptr,
      bool peer_failure = true);
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;
  ucp_ep_h get() const { return h_; }
  // Set (from the error callback) when the peer failed; later sends fail fast.
  bool failed() const { return failed_.load(); }
  absl::Status error() const;
  // False when the transports in use cannot detect a dead peer (UCX 1.13 shm): the
  // endpoint then runs in error mode NONE.
  bool peer_failure_detection() const { return peer_failure_detection_; }

 private:
  UcxEndpoint(ucp_worker_h w) : worker_(w) {}
  static void OnError(void* arg, ucp_ep_h ep, ucs_status_t status);
  ucp_worker_h worker_;
  ucp_ep_h h_ = nullptr;
  std::atomic<bool> failed_{false};
  std::atomic<int> error_status_{UCS_OK};
  bool peer_failure_detection_ = true;
  std::function<void()> on_error_;
};

// Registered memory (host). Maps `bytes` at `data` for RMA; Pack() gives the rkey buffer a
// peer unpacks into a UcxRemoteKey.
class UcxMemHandle {
 public:
  static absl::StatusOr<std::unique_ptr<UcxMemHandle>> Map(UcxContext& ctx, void* data,
                                                           size_t bytes);
  ~UcxMemHandle();
  UcxMemHandle(const UcxMemHandle&) = delete;
  UcxMemHandle& operator=(const UcxMemHandle&) = delete;
  ucp_mem_h get() const { return h_; }
  absl::StatusOr<std::string> PackRkey() const;
  uint64_t address() const { return reinterpret_cast<uint64_t>(data_); }
  size_t bytes() const { return bytes_; }

 private:
  UcxMemHandle(ucp_context_h c, ucp_mem_h h, void* data, size_t bytes)
      : ctx_(c), h_(h), data_(data), bytes_(bytes) {}
  ucp_context_h ctx_;
  ucp_mem_h h_;
  void* data_;
  size_t bytes_;
};

// A peer's memory, unpacked from its packed rkey on one endpoint. Destroy it before the
// endpoint.
class UcxRemoteKey {
 public:
  // `packed` comes from a peer: its size (kMaxPackedRkeyBytes), framing and memory type
  // (host) are checked before UCX sees it, because ucp_ep_rkey_unpack takes no length
  // and trusts the md map it finds. Not covered: a well-framed key whose transport part
  // UCX 1.13 cannot unpack (e.g. a shared-memory segment id that does not attach) crashes
  // inside UCX's own cleanup; only admitted (token-holding) clients can send one.
  static constexpr size_t kMaxPackedRkeyBytes = 4096;
  static absl::StatusOr<std::unique_ptr<UcxRemoteKey>> Unpack(UcxEndpoint& ep,
                                                              const std::string& packed);
  ~UcxRemoteKey();
  UcxRemoteKey(const UcxRemoteKey&) = delete;
  UcxRemoteKey& operator=(const UcxRemoteKey&) = delete;
  ucp_rkey_h get() const { return h_; }

 private:
  explicit UcxRemoteKey(ucp_rkey_h h) : h_(h) {}
  ucp_rkey_h h_;
};

// Waits for a UCP request (ucs_status_ptr_t) by progressing `worker` on the calling
// thread (which must be the worker's thread); frees the request.
absl::Status WaitRequest(ucp_worker_h worker, ucs_status_ptr_t req, std::string_view what);

// Starts an RMA put of `bytes` from local `src` to `remote` (an address in `rkey`'s
// memory) without waiting; the source must stay valid until a later Flush of `ep`
// completes. Loop thread only.
absl::Status Put(ucp_ep_h ep, const void* src, size_t bytes, uint64_t remote, ucp_rkey_h rkey);
// Flushes `ep`: `done` runs once every operation started on it before has completed at
// the peer (for puts: the data is in the peer's memory). `done` runs on the loop thread,
// possibly inside a UCX callback (keep it short; Post real work); it is called exactly
// once, also on failure.
void Flush(ucp_ep_h ep, std::function<void(absl::Status)> done);

// Pre-faulted buffers that rendezvous payloads are received into, so that a large message
// costs the transfer alone: no allocation, no zero fill and no first-touch page faults on
// the receive path (these made the receive 3x slower than the copy itself). Fixed-size
// buffers, taken by the progress thread and returned, from any thread, when the message
// that holds one is destroyed. Thread-safe.
class ReceivePool {
 public:
  // Where the buffers' memory comes from: `bytes` bytes, resident (faulted in), freed with
  // the returned pointer; e.g. a backend's page-locked staging memory, from which copies
  // to the device need no bounce.
  using Allocator = std::function<absl::StatusOr<std::shared_ptr<void>>(size_t bytes)>;
  // `buffers` buffers of `buffer_bytes` each, from `alloc` (null: anonymous memory mapped
  // and faulted in now).
  static absl::StatusOr<std::shared_ptr<ReceivePool>> Create(size_t buffers, size_t buffer_bytes,
                                                             Allocator alloc = nullptr);
  ~ReceivePool();
  ReceivePool(const ReceivePool&) = delete;
  ReceivePool& operator=(const ReceivePool&) = delete;

  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t buffers() const { return buffers_; }
  // A free buffer (returned to the pool when the last copy of the pointer goes), or null
  // when every buffer is in use; counts a miss then.
  std::shared_ptr<char> Acquire();
  size_t free_buffers() const;
  // Rendezvous payloads that found no free buffer, or were larger than one, and were
  // received into an allocation of their own.
  uint64_t misses() const { return misses_.load(); }
  void CountMiss() { misses_.fetch_add(1); }

 private:
  ReceivePool(std::shared_ptr<void> memory, size_t buffers, size_t buffer_bytes, size_t stride);
  struct State;
  size_t buffers_, buffer_bytes_;
  std::shared_ptr<State> state_;     // the free list
  std::shared_ptr<void> memory_;     // freed when the pool and every held buffer are gone
  std::atomic<uint64_t> misses_{0};
};

// The bytes of a received message: a string of its own, or a slice of a receive-pool
// buffer that it holds until destroyed.
class Payload {
 public:
  Payload() = default;
  Payload(std::string s) : owned_(std::move(s)) {}  // NOLINT: a string is a payload
  Payload(std::shared_ptr<char> pooled, size_t size)
      : pooled_(std::move(pooled)), pooled_size_(size) {}
  const char* data() const { return pooled_ ? pooled_.get() : owned_.data(); }
  size_t size() const { return pooled_ ? pooled_size_ : owned_.size(); }
  bool empty() const { return size() == 0; }
  std::string_view view() const { return {data(), size()}; }
  bool pooled() const { return pooled_ != nullptr; }
  // The bytes as a string: moved out when owned, copied from a pool buffer (which then
  // goes back to the pool).
  std::string TakeString() &&;

 private:
  std::string owned_;
  std::shared_ptr<char> pooled_;
  size_t pooled_size_ = 0;
};

// A whole received active message.
struct AmMessage {
  unsigned id = 0;
  std::string header;
  Payload payload;
  ucp_ep_h reply_ep = nullptr;  // valid while the peer is connected
  // > 0: the payload (this many bytes) was over the loop's max_payload and was dropped
  // unread; `payload` is empty. Handlers answer RESOURCE_EXHAUSTED.
  size_t oversize = 0;
};

// The progress thread: owns the context and worker, progresses the worker, runs posted
// tasks, assembles active messages (eager and rendezvous) and hands each whole message to
// the handler of its id (on this thread: handlers must be quick; hand heavy work off).
class UcxLoop {
 public:
  using Handler = std::function<void(AmMessage&&)>;
  // Creates context + worker and starts the thread. `handlers`: AM id -> handler.
  // `tick` (may be null) runs on the loop thread about every `tick_every`, also while the
  // worker is idle (deadlines of outstanding calls).
  static absl::StatusOr<std::unique_ptr<UcxLoop>> Start(
      const std::string& transports, std::map<unsigned, Handler> handlers,
      std::function<void()> tick = nullptr,
      std::chrono::milliseconds tick_every = std::chrono::milliseconds(50));
  ~UcxLoop();  // Stop()
  // Runs `cleanup` (may be null) on the loop thread, then stops and joins it. Idempotent.
  void Stop(std::function<void()> cleanup = nullptr);

  // Runs `task` on the loop thread (asynchronously). False once stopped.
  bool Post(std::function<void()> task);
  // Runs `fn` on the loop thread and waits for its result.
  template <typename T>
  absl::StatusOr<T> Call(std::function<absl::StatusOr<T>()> fn) {
    auto p = std::make_shared<std::promise<absl::StatusOr<T>>>();
    auto f = p->get_future();
    if (!Post([p, fn = std::move(fn)] { p->set_value(fn()); })) {
      return absl::UnavailableError("UCX progress thread stopped");
    }
    return f.get();
  }
  absl::Status CallStatus(std::function<absl::Status()> fn);

  // Sends an active message (loop thread only). Buffers are owned until completion;
  // failures are returned (immediate) or logged to `on_error` (asynchronous; may be null).
  absl::Status Send(ucp_ep_h ep, unsigned id, std::string header, std::string payload);
  // Same with the payload gathered from caller buffers (zero-copy; rendezvous above
  // 64 KiB). The buffers must stay valid until the peer has replied to this message.
  absl::Status SendIov(ucp_ep_h ep, unsigned id, std::string header,
                       std::vector<std::pair<const void*, size_t>> parts);

  // Rendezvous payloads of at most the pool's buffer size are received into its buffers
  // while one is free (else into a string of their own). Set before peers connect.
  void set_receive_pool(std::shared_ptr<ReceivePool> pool) { pool_ = std::move(pool); }
  // Larger payloads are dropped unread and the message is delivered with `oversize` set
  // (default 512 MiB). Set before peers connect.
  void set_max_payload(size_t bytes) { max_payload_ = bytes; }
  // How long the loop keeps polling the worker after its last activity before it sleeps
  // on the worker's event fd (default 50 us). Longer keeps a decode loop's next message
  // from paying a wake-up (tens of microseconds) at the price of a busy core.
  void set_busy_poll(std::chrono::microseconds d) { busy_poll_us_ = d.count(); }

  UcxContext& context() { return *context_; }
  UcxWorker& worker() { return *worker_; }
  const std::string& address() const { return address_; }
  bool on_loop_thread() const { return std::this_thread::get_id() == thread_.get_id(); }

 private:
  UcxLoop() = default;
  void Run();
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  void Deliver(AmMessage&& m);

  std::unique_ptr<UcxContext> context_;
  std::unique_ptr<UcxWorker> worker_;
  std::string address_;
  std::map<unsigned, Handler> handlers_;
  std::function<void()> tick_;
  std::chrono::milliseconds tick_every_{50};
  int efd_ = -1;  // the worker's event fd (ticking loops wait on it with a timeout)
  std::atomic<size_t> max_payload_{size_t{512} << 20};
  std::shared_ptr<ReceivePool> pool_;
  std::atomic<int64_t> busy_poll_us_{50};
  struct AmArg {
    UcxLoop* loop;
    unsigned id;
  };
  std::deque<AmArg> am_args_;  // stable addresses for the AM callbacks
  int in_flight_ = 0;  // loop thread: sends and rendezvous receives not yet complete
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  std::atomic<bool> has_tasks_{false};  // tasks_ is not empty (read while spinning)
  bool stopping_ = false;
  std::atomic<bool> stopped_{false};
  std::thread thread_;
};

}  // namespace kvshade::transport::ucx

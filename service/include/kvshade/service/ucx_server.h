// UcxServer: the daemon's UCX data plane (docs/API.md "UCX data plane"). One UCP
// worker on a progress thread; its address is handed out by Attach together with a
// one-time admission token bound to the caller's tenant. A client's first active message
// (HELLO) must carry such a token; it is consumed and the client gets a connection key
// that every later request carries. Requests without a valid key are refused
// (PERMISSION_DENIED reply) and never reach the engine.
//
// HELLO also carries the client's worker address: the daemon connects back to it (one
// endpoint per connection) for RMA puts into registered slot buffers and, where the
// transports detect a dead peer, to notice a client that vanishes.
//
// Messages (ucx_core.h AmId): SELECT_FRAME, ATTEND_FRAME, APPEND, INGEST, REGISTER,
// UNREGISTER, BYE.
// - SELECT_FRAME and ATTEND_FRAME are binary (transport/decode_frame.h): the payload is
//   parsed into views the engine's decode API (decode.h) takes as they are, and the reply
//   is a binary frame. A frame of at most ucx.inline_max_batch queries runs on the
//   progress thread itself; larger ones on the engine threads.
// - INGEST messages (one per gRPC IngestRequest; tensor bytes as the payload) of one
//   connection run one at a time, in arrival order, on the engine threads, so a client
//   may send several ahead (compressing layer l overlaps receiving layer l+1). Each
//   stream (DataPlaneHeader.stream_id) drives one Engine::IngestStream; its first error
//   discards it and fails its later messages. A connection dropped by BYE or by its
//   client's worker vanishing discards its streams. A part's payload lands in a buffer
//   of the receive pool (ucx.receive_buffers, resident from start-up) and the engine
//   takes it from there as views (IngestLayerView): one copy, into the layer.
// - REGISTER (UcxSlotBuffers) binds an attachment of this connection's tenant, attached
//   with DELIVERY_MODE_UCX_RMA, to the client's K and V slot buffers. A SELECT whose
//   delta names a registered attachment puts each miss's K and V rows into those buffers
//   (service/delivery.h), flushes, and replies with the delta's rows dropped and
//   `delivered` set.
//
// Other requests run on a small pool of engine threads; every reply (and any RMA) is sent
// from the progress thread.
//
// Limits per tenant (docs/OPERATIONS.md "Limits on streams and calls"): the daemon's one
// TenantAdmission, shared with the gRPC service. A SELECT, ATTEND, APPEND or REGISTER holds
// a call slot of its connection's tenant from when it is accepted until its reply is
// sent (given back just before); an ingest stream holds a call and a stream slot from its
// header until it commits, fails, is cancelled or cut, or its connection goes. A request
// over a cap gets RESOURCE_EXHAUSTED naming the limit and the tenant, as over gRPC. HELLO,
// BYE, UNREGISTER and an ingest cancel take none: they only give things back. An open
// ingest stream is paced like a gRPC one (stream_pace.h PipelinedPace, looked at by the
// progress thread's tick): one that stalls or trickles is cut with the same
// DEADLINE_EXCEEDED, commits nothing and gives its slots back.
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
#include "kvshade/service/device_router.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"
#include "kvshade/transport/decode_frame.h"
#include "kvshade/transport/ucx_core.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service {

namespace ucx = ::kvshade::transport::ucx;
namespace frame = ::kvshade::transport::frame;

class TenantAdmission;

class UcxServer {
 public:
  // Starts the worker and its progress thread (config.ucx.transports). `engine` (the
  // daemon's devices, which the gRPC service borrows too; calls are routed as there), `metrics` and `admission` (the daemon's, shared with the
  // gRPC service) must outlive the server, or Stop() first; `backend` (may be null: plain
  // memory) gives the receive pool its staging memory (page-locked on CUDA; the first
  // device's on a daemon with several).
  static absl::StatusOr<std::unique_ptr<UcxServer>> Start(const ServerConfig& config,
                                                          DeviceRouter* engine, Metrics* metrics,
                                                          TenantAdmission* admission,
                                                          kernels::DeviceRuntime* backend = nullptr);
  ~UcxServer();  // Stop()
  void Stop();

  // The worker address for AttachResponse.data_plane_address ("ucx-worker:<base64>").
  const std::string& address() const { return address_; }
  // A fresh one-time admission token for `tenant` (AttachResponse.data_plane_token).
  std::string IssueToken(const Tenant& tenant);

  // Counters for tests and /metrics-free diagnosis.
  uint64_t refused() const;
  uint64_t connections() const;

 private:
  // Slot buffers of one attachment registered on a connection (loop thread only).
  struct Registration {
    Engine::SlotGeometry geometry;
    uint64_t k_address = 0;
    uint64_t v_address = 0;
    uint64_t bytes = 0;
    std::unique_ptr<ucx::UcxRemoteKey> k_rkey, v_rkey;  // destroyed before the endpoint
  };
  // A call's (or an open ingest stream's) slots of its tenant (a TenantAdmission::Ticket),
  // shared by the callbacks the call passes through; given back by Finish, or when the
  // last of them is gone.
  struct CallSlot;
  // The pace of one ingest stream (loop thread only); defined in ucx_server.cc.
  struct IngestPace;
  // One ingest stream of a connection. `stream` is null while an engine thread works on
  // it (the connection's ingest messages run one at a time), or after a failure.
  struct IngestState {
    std::unique_ptr<Engine::IngestStream> stream;
    std::shared_ptr<CallSlot> slot;  // while open: held until the commit or the failure
    absl::Status failed;  // the stream's first error; later messages fail with it
    bool cut = false;     // `failed` is the pace's cut: later messages get it as it is
  };
  // One admitted client.
  struct Conn {
    std::string key;
    Tenant tenant;
    std::mutex mu;  // guards the fields below it up to "loop thread only"
    std::deque<std::function<void()>> ingest_queue;  // this connection's INGEST messages
    bool ingest_running = false;  // an engine thread is draining ingest_queue
    bool dropped = false;         // BYE or peer failure: streams discarded, replies dropped
    absl::flat_hash_map<uint64_t, IngestState> streams;
    // Loop thread only.
    std::unique_ptr<ucx::UcxEndpoint> ep;  // to the client's worker (may stay null)
    std::map<std::string, Registration> regs;  // by attachment id
    // Per ingest stream: the next sequence number to run and the messages that arrived
    // ahead of it (a later message's payload can land first).
    struct Reorder {
      struct Message {
        std::function<void()> job;
        bool ends = false;   // commit or cancel
        uint64_t bytes = 0;  // what it brought (its pace counts it when it is next in line)
      };
      uint64_t next = 0;
      std::map<uint64_t, Message> waiting;  // by sequence
      std::shared_ptr<IngestPace> pace;     // null: no pace limits configured
    };
    std::map<uint64_t, Reorder> reorder;  // by stream id
    bool closed = false;  // ep closed (or being closed): nothing more is sent to the client
    std::atomic<int> num_regs{0};  // regs.size(), readable by engine threads
  };
  // A reply in the making, for the loop thread.
  struct Outcome {
    absl::Status status;
    std::string payload;
    bool frame = false;  // a binary decode frame's reply (kFrameReply, `count` entries)
    uint32_t count = 0;
  };

  UcxServer(const ServerConfig& config, DeviceRouter* engine, Metrics* metrics, TenantAdmission* admission);
  void OnHello(ucx::AmMessage&& m);
  void OnBye(ucx::AmMessage&& m);
  // SELECT_FRAME and ATTEND_FRAME (transport/decode_frame.h): parsed into decode.h views
  // over the payload; run inline when the batch is at most ucx.inline_max_batch.
  void OnDecodeFrame(ucx::AmMessage&& m, frame::Kind kind);
  void OnAppend(ucx::AmMessage&& m);
  void OnIngest(ucx::AmMessage&& m);
  void OnRegister(ucx::AmMessage&& m);
  void OnUnregister(ucx::AmMessage&& m);

  // Finds the connection `key` names and the engine; otherwise (unknown key, stopping, an
  // oversize payload unless `oversize_ok`) counts the error and returns it, naming `what`.
  absl::Status Lookup(const std::string& key, size_t oversize, bool oversize_ok,
                      std::string_view what, std::shared_ptr<Conn>* conn, DeviceRouter** engine);
  // Loop thread: parses the header and finds the connection its key names; otherwise
  // replies (INVALID_ARGUMENT, PERMISSION_DENIED or UNAVAILABLE) and returns null.
  std::shared_ptr<Conn> Admit(const ucx::AmMessage& m, v1::DataPlaneHeader* h, DeviceRouter** engine,
                              std::string_view what);
  // Loop thread: sends a reply (code 0 = payload is the response).
  void Reply(ucp_ep_h ep, uint64_t request_id, int code, std::string payload,
             std::string connection_key = "");
  // Loop thread: sends a frame reply (code 0: `count` entries in `payload`).
  void ReplyFrame(ucp_ep_h ep, uint64_t request_id, int code, uint32_t count, std::string payload);
  // A call slot of `conn`'s tenant for `what` (the name its refusal starts with), and a
  // stream slot too when `stream`; RESOURCE_EXHAUSTED naming the limit when over a cap.
  absl::StatusOr<std::shared_ptr<CallSlot>> AdmitCall(const Conn& conn, std::string_view what,
                                                      bool stream);
  // Any thread: gives `slot` back (before the client can hear the answer, so that its next
  // call is admitted), records the call's metrics and has the loop thread reply to an
  // admitted connection (dropped when the connection has gone meanwhile).
  void Finish(const std::shared_ptr<Conn>& conn, ucp_ep_h ep, uint64_t request_id,
              std::string_view method, std::chrono::steady_clock::time_point start,
              Outcome out, const std::shared_ptr<CallSlot>& slot = nullptr);
  // Loop thread: puts the misses of the registered deltas of `res` (attachments `ids`, in
  // order; for `layer`) into the client's slot buffers (delivery.h ForEachRowRun),
  // flushes, then replies with those deltas' rows dropped and `delivered` set.
  void DeliverSelect(std::shared_ptr<Conn> conn, ucp_ep_h ep, uint64_t request_id,
                     uint32_t layer, std::vector<std::string> ids,
                     std::shared_ptr<SelectResult> res,
                     std::chrono::steady_clock::time_point start,
                     std::shared_ptr<CallSlot> slot);
  void DropConnection(const std::string& key);
  // Loop thread: flushes the connection's endpoint, then destroys `regs` (rkeys that
  // puts in flight may still use) and runs `then` (may be null).
  void RetireRegistrations(const std::shared_ptr<Conn>& conn, std::vector<Registration> regs,
                           std::function<void(absl::Status)> then);
  // Runs `job` on an engine thread after every earlier ingest job of `conn`.
  void RunInOrder(const std::shared_ptr<Conn>& conn, std::function<void()> job);
  // `admitted`: for a header, its slots (or why it was refused); `pace`: the stream's
  // (null without pace limits), told when the message has been processed.
  void IngestJob(const std::shared_ptr<Conn>& conn, DeviceRouter* engine, v1::DataPlaneHeader h,
                 ucp_ep_h ep, ucx::Payload payload, size_t oversize,
                 std::chrono::steady_clock::time_point start,
                 absl::StatusOr<std::shared_ptr<CallSlot>> admitted,
                 std::shared_ptr<IngestPace> pace);
  // Loop thread (the tick): ends the paced streams whose client waited too long or sent
  // too little (PipelinedPace).
  void PaceTick();
  // Loop thread: ends ingest stream `pace` with `why` (the pace's DEADLINE_EXCEEDED): its
  // slots are given back at once, the engine's stream is discarded (nothing committed) in
  // the connection's ingest order, and its later messages are answered `why`.
  void CutStream(const std::shared_ptr<Conn>& conn, IngestPace& pace, absl::Status why);
  // Hands a layer part's bytes (in `payload`, as the header's part_bytes split them) to
  // the stream as views.
  static absl::Status AddLayerPart(Engine::IngestStream& stream, const v1::DataPlaneHeader& h,
                                   const v1::IngestLayer& layer, std::string_view payload);
  void Enqueue(std::function<void()> job);
  void WorkerMain();
  // Loop thread: adds the receive pool's misses since the last call to the metric.
  void ReportPoolMisses();

  ServerConfig config_;
  Metrics* metrics_;
  TenantAdmission* const admission_;
  std::unique_ptr<ucx::UcxLoop> loop_;
  std::string address_;
  DeviceRouter* engine_ = nullptr;  // borrowed (guarded by mu_); null once stopped

  mutable std::mutex mu_;
  absl::flat_hash_map<std::string, Tenant> tokens_;  // one-time admission tokens
  absl::flat_hash_map<std::string, std::shared_ptr<Conn>> connections_;  // by key
  uint64_t refused_ = 0;
  std::shared_ptr<ucx::ReceivePool> pool_;  // null: ucx.receive_buffers is 0
  uint64_t pool_misses_reported_ = 0;       // loop thread
  // Ingest streams under a pace limit (loop thread; PaceTick drops those that ended).
  std::vector<std::shared_ptr<IngestPace>> paced_;

  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::deque<std::function<void()>> work_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvshade::service

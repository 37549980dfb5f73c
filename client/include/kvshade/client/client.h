// The kvshade C++ client: one connection to one kvshade-server endpoint (plaintext, TLS or
// mTLS; optional bearer token), typed wrappers for every RPC of kvshade.v1.KvShade that
// return absl::Status / absl::StatusOr (gRPC codes map one to one onto absl codes), a
// grpc.health.v1 check, an Ingest writer that streams a session's layers, and async
// variants of the decode-path calls.
//
// With ClientOptions::use_ucx, the data calls (Ingest, IngestWriter, AppendTokens,
// SelectAndReconstruct, Attend and their async variants) go over the daemon's UCX data
// plane (ucx_data_plane.h) once it is connected; everything else stays on gRPC. If UCX
// cannot connect or its endpoint dies, the client falls back to gRPC inline: a line on
// stderr each time and ucx_fallbacks() counts it, never silently.
//
// Thread safety: a Client may be shared by many threads; every call makes its own
// grpc::ClientContext. An IngestWriter belongs to one thread. Destroying a Client waits
// for its outstanding async calls (UCX ones complete with CANCELLED).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvshade/client/ucx_data_plane.h"
#include "kvshade/v1/kvshade.grpc.pb.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::client {

struct ClientOptions {
  std::string target = "127.0.0.1:50551";  // HOST:PORT or unix:PATH
  std::string bearer_token;                // sent as "authorization: Bearer <token>"
  bool tls = false;
  std::string ca_file;          // PEM roots that verify the server (empty: system roots)
  std::string cert_file;        // PEM client certificate (mTLS)
  std::string key_file;         // PEM client key (mTLS)
  std::string tls_server_name;  // expected name in the server certificate (overrides target)
  absl::Duration timeout = absl::Seconds(60);  // deadline of each call
  uint64_t max_message_bytes = 512ull << 20;
  // UCX data plane: when set and the daemon's Attach hands out a data-plane address, the
  // client connects over UCX (once, with the first token) and the data calls go over it.
  // Ingest and AppendTokens before any Attach connect through a throwaway attachment of
  // their session (Attach is the only source of admission tokens). If UCX cannot
  // connect, or the connection dies, calls fall back to gRPC inline with a log line on
  // stderr and ucx_fallbacks() counts it.
  bool use_ucx = false;
  std::string ucx_transports;  // UCX_TLS value for the client's worker ("" = UCX's choice)
  int ucx_ingest_window = 4;   // ingest messages in flight per stream over UCX
  // UcxOptions::busy_poll in microseconds: polling after the last message, and spinning on
  // a decode call's reply, before sleeping (more: lower latency, a busy core).
  int ucx_busy_poll_us = 50;
};

// grpc.health.v1 ServingStatus.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
std::string_view HealthStatusName(HealthStatus s);

absl::Status FromGrpc(const grpc::Status& s);

class IngestWriter;

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // --- Sessions ---
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& req);
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const std::string& parent_session_id,
                                                      uint64_t at_token);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::LookupPrefixRequest& req);
  // include_selection: with the recall guard's figures per layer (SessionInfo.selection).
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id,
                                             bool include_selection = false);
  absl::StatusOr<v1::SessionInfo> GetSession(const v1::GetSessionRequest& req);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  absl::Status CloseSession(const std::string& session_id);

  // Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions"). CreateSession of
  // `req` (the whole model's geometry, req.device the rank's GPU) as rank `rank` of `ranks`
  // holding KV heads [kv_head_begin, kv_head_end), joining logical session `join` (empty:
  // create a new one). The response's session_id is the rank's shard (every per-session
  // call takes it, with the rank's heads only); tensor_parallel().session_id() the logical
  // session (GetSession, ForkSession, CloseSession).
  absl::StatusOr<v1::CreateSessionResponse> CreateTensorParallelRank(
      v1::CreateSessionRequest req, uint32_t ranks, uint32_t rank, uint32_t kv_head_begin,
      uint32_t kv_head_end, const std::string& join = "");
  // The shards of logical session `session_id`, in rank order; INVALID_ARGUMENT for a
  // session that is no logical session.
  absl::StatusOr<std::vector<v1::TensorParallelShard>> TensorParallelShards(
      const std::string& session_id);

  // --- Data ---
  // Raw stream: sends every message in order, then closes the stream. Over UCX the
  // messages are pipelined (ucx_ingest_window ahead) and their tensors go by rendezvous
  // straight from `messages`; a stream cut by a dead UCX endpoint is sent again over gRPC.
  absl::StatusOr<v1::IngestResponse> Ingest(absl::Span<const v1::IngestRequest> messages);
  // Incremental stream (one layer at a time; see IngestWriter).
  absl::StatusOr<std::unique_ptr<IngestWriter>> StartIngest(const std::string& session_id);
  // Over UCX the tensors go by rendezvous straight from `req`. Appends are not
  // idempotent, so one cut by a dead UCX endpoint returns UNAVAILABLE (later calls use
  // gRPC) instead of being sent twice.
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const v1::AppendTokensRequest& req);

  // --- Workers ---
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& req);
  // Unregisters the attachment's RMA slot buffers first (if any): once Detach returns, the
  // daemon writes nothing more into them.
  absl::Status Detach(const std::string& attachment_id);
  // RMA slot buffers (DELIVERY_MODE_UCX_RMA; needs the UCX data plane): host K and V
  // buffers of `bytes` each (>= AttachResponse.slot_buffer_bytes), laid out as
  // v1.CudaIpcSlotBuffers says: [L, h, slots_per_head, C, d] bf16. Select calls over UCX
  // then write the attachment's misses straight into them and answer with `delivered`
  // deltas (head/slot/chunk lists, no data). The buffers must stay valid until Detach or
  // the Client's destruction. A call that falls back to gRPC gets inline deltas: apply
  // those whose `delivered` is false as usual.
  absl::Status RegisterSlotBuffers(const std::string& attachment_id, void* k, void* v,
                                   size_t bytes);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const std::string& attachment_id,
                                                        uint32_t layer);
  // The attachment's slot tables as the daemon holds them; `reset` empties them afterwards
  // (the next select delivers every selected chunk again): resynchronisation after a lost
  // SelectAndReconstruct response.
  absl::StatusOr<v1::SlotTableResponse> SlotTable(const std::string& attachment_id,
                                                  bool reset = false);
  // Appends the attachment's held staged token `stage_token_id` (staged with stage_hold)
  // to the session, or with `discard` drops it; returns the session's length.
  absl::StatusOr<uint64_t> CommitStaged(const std::string& attachment_id, int32_t stage_token_id,
                                        bool discard = false);

  // --- Decode ---
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const v1::SelectAndReconstructRequest& req);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& req);
  // Async variants for the decode loop (e.g. issue layer l+1 while applying layer l).
  // Over UCX no thread is used per call (replies are matched by request id on the data
  // plane's progress thread); over gRPC they use gRPC's callback API. `req` is copied.
  std::future<absl::StatusOr<v1::SelectAndReconstructResponse>> SelectAndReconstructAsync(
      const v1::SelectAndReconstructRequest& req);
  std::future<absl::StatusOr<v1::AttendResponse>> AttendAsync(const v1::AttendRequest& req);

  // --- Operations ---
  absl::StatusOr<v1::StatsResponse> Stats();
  // Same-node decode: a generation of an attachment's session state (LocalDecoder uses it).
  absl::StatusOr<v1::SessionExport> ExportSession(const v1::ExportSessionRequest& req);
  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<HealthStatus> CheckHealth(const std::string& service = "");
  // Polls CheckHealth with backoff (10 ms .. 200 ms) until SERVING or `deadline` passes;
  // DeadlineExceeded names the last status or error seen.
  absl::Status WaitForServing(absl::Duration deadline);

  // --- UCX data plane (see ClientOptions::use_ucx) ---
  bool ucx_connected() const;
  uint64_t ucx_fallbacks() const { return ucx_fallbacks_.load(); }
  // The live data plane (null when not connected); for callers that need its own calls.
  std::shared_ptr<UcxDataPlane> ucx_data_plane() { return Ucx(); }

  // The underlying stub and channel, for callers that need what the wrappers do not cover.
  v1::KvShade::Stub* stub() { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }
  const ClientOptions& options() const { return options_; }
  // A context with the deadline and bearer token of these options.
  std::unique_ptr<grpc::ClientContext> NewContext(absl::Duration timeout = absl::ZeroDuration()) const;

 private:
  Client() = default;
  template <typename Req, typename Resp, typename Method>
  absl::StatusOr<Resp> Unary(Method method, const Req& req);

  template <typename Req, typename Resp>
  struct AsyncCall;
  // Starts `req` over gRPC's callback API; the result goes to `call`'s promise.
  template <typename Req, typename Resp, typename Start>
  void GrpcAsync(std::shared_ptr<AsyncCall<Req, Resp>> call, Start start);
  // Over UCX when connected (falling back on a dead endpoint), else gRPC.
  template <typename Req, typename Resp, typename UcxStart, typename GrpcStart>
  std::future<absl::StatusOr<Resp>> DecodeAsync(const Req& req, UcxStart ucx_start,
                                                GrpcStart grpc_start);
  void BeginAsync();
  void EndAsync();

  // The live data plane, or null; a failed one is dropped (loudly) here.
  std::shared_ptr<UcxDataPlane> Ucx();
  // Same, first connecting through a throwaway attachment of `session_id` when use_ucx
  // is on and no connection was tried yet.
  std::shared_ptr<UcxDataPlane> UcxForSession(const std::string& session_id);
  // Drops `dp` (if it is still the live one) after a transport failure: counted, logged.
  // Safe on the data plane's own progress thread (it is destroyed later, elsewhere).
  void DropUcx(const UcxDataPlane* dp, const absl::Status& why);
  void UcxFallback(const absl::Status& why);

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvShade::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;
  mutable std::mutex ucx_mu_;
  std::shared_ptr<UcxDataPlane> ucx_;  // null: gRPC inline
  // Dropped data planes, destroyed by the next caller thread (never on their own thread).
  std::vector<std::shared_ptr<UcxDataPlane>> ucx_retired_;
  bool ucx_tried_ = false;
  std::atomic<uint64_t> ucx_fallbacks_{0};
  std::atomic<bool> closing_{false};
  std::mutex async_mu_;
  std::condition_variable async_cv_;
  int async_inflight_ = 0;  // async calls not yet completed (the destructor waits)
};

// One client stream of Ingest: the header is sent by Client::StartIngest; then any number
// of layer parts; Commit() sends the commit marker and returns the server's response.
// Destroying a writer without Commit() cancels the stream (nothing is committed).
//
// Over UCX the writer keeps up to ClientOptions::ucx_ingest_window parts in flight (each
// a copy it owns until the daemon's reply), so the daemon compresses one part while the
// next arrives. A part the daemon rejects therefore fails a later Write or the Commit;
// the first error of the stream is the one returned.
class IngestWriter {
 public:
  ~IngestWriter();

  // Sends one part as is (over UCX: a copy).
  absl::Status Write(const v1::IngestLayer& part);
  // Sends one whole layer, split by token range into parts of at most `max_part_bytes`
  // (K and V together), the last one marked last_part and carrying the observation
  // queries.
  //   k, v                : [n, h, d] bf16 bits, pre-RoPE keys and values, host
  //   observation_queries : [w, hq, d] bf16 bits (post-RoPE) or empty
  absl::Status WriteLayer(uint32_t layer, int64_t n, int h, int d, absl::Span<const uint16_t> k,
                          absl::Span<const uint16_t> v,
                          absl::Span<const uint16_t> observation_queries = {}, int64_t w = 0,
                          int hq = 0, size_t max_part_bytes = 8u << 20);
  absl::StatusOr<v1::IngestResponse> Commit();
  uint64_t bytes_sent() const { return bytes_sent_; }

 private:
  friend class Client;
  IngestWriter() = default;
  absl::Status Send(std::shared_ptr<v1::IngestRequest> msg);
  // UCX: waits until at most `keep` messages are in flight, recording the first error.
  void Drain(size_t keep);

  // gRPC stream.
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<v1::IngestResponse> response_;
  std::unique_ptr<grpc::ClientWriter<v1::IngestRequest>> writer_;
  // UCX stream (ucx_ set): messages in flight, each alive until its reply.
  struct InFlight {
    std::shared_ptr<v1::IngestRequest> msg;
    std::future<absl::StatusOr<std::string>> reply;
  };
  std::shared_ptr<UcxDataPlane> ucx_;
  uint64_t stream_ = 0;
  size_t window_ = 4;
  std::deque<InFlight> inflight_;
  absl::Status failed_;     // the stream's first error
  std::string last_reply_;  // payload of the newest reply (the IngestResponse at the end)
  bool done_ = false;
  uint64_t bytes_sent_ = 0;
};

}  // namespace kvshade::client

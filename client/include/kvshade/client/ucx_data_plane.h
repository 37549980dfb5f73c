// UcxDataPlane: the client side of kvshade's UCX data plane (docs/API.md "UCX data
// plane"). Connect() opens an endpoint to the daemon's worker address (from
// AttachResponse.data_plane_address), presents the one-time admission token
// (data_plane_token) in a HELLO active message, with this client's worker address so the
// daemon can connect back (RMA puts), and keeps the connection key the daemon answers
// with. Every call is then one active message and one reply, and returns the same v1
// response the gRPC call returns:
//   SelectAndReconstruct, Attend    request as the payload (sync and async)
//   AppendTokens, Ingest            tensors by rendezvous straight from the caller's
//                                   buffers; Ingest pipelined (`ingest_window` ahead)
//   RegisterSlotBuffers             K and V slot buffers for DELIVERY_MODE_UCX_RMA: the
//                                   daemon puts each miss into them before replying
//
// Threading: one progress thread per UcxDataPlane; calls may come from any thread and may
// overlap (replies are matched by request id). Async callbacks run on the progress thread:
// they must be short and must not call back into this object synchronously (no sync call,
// no destruction). Every call completes exactly once: with the reply, the daemon's error,
// UNAVAILABLE when the endpoint fails, DEADLINE_EXCEEDED after `timeout`, or CANCELLED
// when the data plane is destroyed first. A call that times out marks the data plane
// failed (failed() is true, later calls fail UNAVAILABLE at once): a daemon that left one
// reply unanswered is not trusted with the next (e.g. its worker cannot reach ours back
// over the transports we offered), and callers fall back to gRPC.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvshade/transport/decode_frame.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::transport::ucx {
class UcxLoop;
class UcxEndpoint;
class UcxMemHandle;
}  // namespace kvshade::transport::ucx

namespace kvshade::client {

struct UcxOptions {
  std::string transports;                       // UCX_TLS value; "" = UCX's choice
  absl::Duration timeout = absl::Seconds(30);   // per call
  // HELLO (at most `timeout`): it takes milliseconds when the two workers reach each
  // other, so a daemon that cannot answer fails Connect fast (UNAVAILABLE).
  absl::Duration connect_timeout = absl::Seconds(3);
  int ingest_window = 4;                        // INGEST messages in flight per stream
  uint64_t max_reply_bytes = 512ull << 20;      // larger replies fail RESOURCE_EXHAUSTED
  // The progress thread polls this long after its last message before it sleeps, and a
  // synchronous decode call spins this long on its reply before it blocks: a decode loop
  // then pays no wake-up per call, at the price of a busy core while it runs.
  absl::Duration busy_poll = absl::Microseconds(50);
};

class UcxDataPlane {
 public:
  template <typename T>
  using Callback = std::function<void(absl::StatusOr<T>)>;

  // Fails when the daemon cannot be reached (UNAVAILABLE, also when HELLO gets no reply
  // within `connect_timeout`: the message names this side's transports) or refuses the
  // token (PERMISSION_DENIED).
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Connect(const std::string& address,
                                                               const std::string& token,
                                                               const UcxOptions& options = {});
  // Completes outstanding calls with CANCELLED, says BYE, releases registered memory,
  // closes the endpoint and stops the progress thread.
  ~UcxDataPlane();
  UcxDataPlane(const UcxDataPlane&) = delete;
  UcxDataPlane& operator=(const UcxDataPlane&) = delete;

  // --- Decode ---
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const v1::SelectAndReconstructRequest& req);
  void SelectAndReconstructAsync(const v1::SelectAndReconstructRequest& req,
                                 Callback<v1::SelectAndReconstructResponse> done);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& req);
  void AttendAsync(const v1::AttendRequest& req, Callback<v1::AttendResponse> done);

  // --- Append --- The tensors' bytes go by rendezvous straight from `req`.
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const v1::AppendTokensRequest& req);

  // --- Ingest ---
  // One whole Ingest stream (header first, commit last) on a fresh stream id, up to
  // `ingest_window` messages in flight: the daemon works on message i while message i+1
  // arrives. The tensors' bytes go by rendezvous straight from `messages`. Same rules and
  // response as the gRPC Ingest; the first error (in stream order) discards the stream
  // and is returned (nothing committed).
  absl::StatusOr<v1::IngestResponse> Ingest(absl::Span<const v1::IngestRequest> messages);
  // The building blocks: a fresh stream id; one message of stream `stream` (the reply
  // payload: the serialized IngestResponse after the commit, else empty; `msg` and its
  // tensor bytes must stay valid until `done` has run); and discarding a stream.
  uint64_t NewIngestStream() { return next_stream_.fetch_add(1); }
  void IngestMessageAsync(uint64_t stream, const v1::IngestRequest& msg, Callback<std::string> done);
  absl::StatusOr<std::string> IngestMessage(const v1::IngestRequest& msg, uint64_t stream = 0);
  absl::Status CancelIngest(uint64_t stream);

  // --- RMA slot buffers (DELIVERY_MODE_UCX_RMA) ---
  // Registers host K and V slot buffers of `bytes` each (>= AttachResponse
  // .slot_buffer_bytes; layout in CudaIpcSlotBuffers) for `attachment_id` and sends
  // REGISTER. From then on, SelectAndReconstruct writes that attachment's misses into
  // them and answers with `delivered` deltas. The buffers must stay valid until
  // UnregisterSlotBuffers (or destruction) returns. Registering again replaces.
  absl::Status RegisterSlotBuffers(const std::string& attachment_id, void* k, void* v,
                                   size_t bytes);
  // Tells the daemon to stop (its reply comes after any put in flight has landed), then
  // releases the memory handles. Unknown ids are fine.
  absl::Status UnregisterSlotBuffers(const std::string& attachment_id);
  bool HasSlotBuffers(const std::string& attachment_id) const;

  // Whether the endpoint has failed (peer gone) or a call timed out; calls then fail
  // with UNAVAILABLE.
  bool failed() const;
  // Why failed() is true ("" while it is not).
  std::string failure() const;
  // Whether the endpoint to the daemon detects a dead peer (not over UCX 1.13 shm).
  bool peer_failure_detection() const;

  // Test hook: forget the connection key so that destruction sends no BYE (a client that
  // vanishes).
  void AbandonForTest() { key_.clear(); }
  // Test hook: sends a request with an arbitrary connection key (an unadmitted client).
  absl::StatusOr<std::string> RawRequest(unsigned am_id, const std::string& connection_key,
                                         const std::string& payload);
  // Test hook: sends a request with this connection's key (hand-made payloads).
  absl::StatusOr<std::string> RawAdmittedRequest(unsigned am_id, const std::string& payload) {
    return RawRequest(am_id, key_, payload);
  }
  // Test hook: sends a decode frame (transport/decode_frame.h) with an arbitrary key,
  // layer, query count and body (hand-made or malformed frames); returns the reply's
  // entries.
  absl::StatusOr<std::string> RawFrameRequest(transport::frame::Kind kind, const std::string& key,
                                              uint32_t layer, uint32_t count, std::string body);
  absl::StatusOr<std::string> RawAdmittedFrameRequest(transport::frame::Kind kind, uint32_t layer,
                                                      uint32_t count, std::string body) {
    return RawFrameRequest(kind, key_, layer, count, std::move(body));
  }
  // Test hook: connects without HELLO (no connection key).
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> ConnectWithoutHello(
      const std::string& address, const UcxOptions& options = {});

  // A daemon's answer to one call: its status code and payload (a serialized response, a
  // frame's entries, or the error message).
  struct Reply {
    int code = 0;
    std::string payload;
    std::string connection_key;
    uint32_t count = 0;  // frame replies: entries in `payload`
  };

 private:
  struct Pending {
    Callback<Reply> done;
    std::chrono::steady_clock::time_point deadline;
  };
  struct SlotBuffers;
  UcxDataPlane() = default;
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Open(const std::string& address,
                                                            const UcxOptions& options);
  // Registers `done` under a fresh request id and sends (am_id, header(id), payload or the
  // `iov` buffers) from the progress thread; `done` gets the reply, the transport's
  // failure, or the failure that kept the message from being sent.
  void Dispatch(unsigned am_id, const std::function<std::string(uint64_t)>& header,
                std::string payload, std::vector<std::pair<const void*, size_t>> iov,
                absl::Duration timeout, Callback<Reply> done);
  // Sends (am_id, header with request id + `key`/`token` + `extra`, payload or the `iov`
  // buffers) and calls `done` with the reply (or the transport's failure).
  void CallAsync(unsigned am_id, const std::string& token, const std::string& key,
                 std::string payload, const v1::DataPlaneHeader* extra,
                 std::vector<std::pair<const void*, size_t>> iov, Callback<Reply> done);
  absl::StatusOr<Reply> Call(unsigned am_id, const std::string& token, const std::string& key,
                             std::string payload, const v1::DataPlaneHeader* extra = nullptr,
                             std::vector<std::pair<const void*, size_t>> iov = {});
  // Completes pending call `id` (if still pending) with `r`.
  void Complete(uint64_t id, absl::StatusOr<Reply> r);
  // Completes every pending call (`only_expired`: those past their deadline) with `why`.
  void FailPending(const absl::Status& why, bool only_expired);
  void OnReply(std::string header, std::string payload, size_t oversize);
  // Binary decode frames (transport/decode_frame.h): SELECT_FRAME / ATTEND_FRAME out,
  // FRAME_REPLY back, matched by request id in `pending_` like every other call.
  void CallFrameAsync(transport::frame::Kind kind, const std::string& key, uint32_t layer,
                      uint32_t count, std::string body, Callback<Reply> done);
  // A decode call: its frame body (or the reason there is none), sent; `parse` turns the
  // reply into the v1 response.
  template <typename Req, typename Resp>
  void DecodeAsync(transport::frame::Kind kind, const Req& req, absl::StatusOr<std::string> body,
                   absl::StatusOr<Resp> (*parse)(const absl::StatusOr<Reply>&, const Req&),
                   Callback<Resp> done);
  // Runs `start` and waits for the callback it was given, spinning up to busy_poll first.
  template <typename T>
  absl::StatusOr<T> Await(const std::function<void(Callback<T>)>& start);
  void OnFrameReply(std::string header, std::string payload, size_t oversize);
  // The next sequence number of ingest stream `stream`; `ends` (commit, cancel) restarts
  // its count.
  uint64_t NextSequence(uint64_t stream, bool ends);
  void OnTick();

  UcxOptions options_;
  std::unique_ptr<transport::ucx::UcxLoop> loop_;
  std::unique_ptr<transport::ucx::UcxEndpoint> ep_;  // created/destroyed on the loop thread
  std::string key_;
  mutable std::mutex mu_;
  std::map<uint64_t, Pending> pending_;
  std::map<std::string, std::unique_ptr<SlotBuffers>> slot_buffers_;  // loop thread only
  std::map<std::string, bool> registered_;  // attachment ids with slot buffers (mu_)
  std::map<uint64_t, uint64_t> ingest_sequence_;  // stream -> next sequence number (mu_)
  std::atomic<bool> timed_out_{false};
  std::string timed_out_why_;  // set once, before timed_out_ (mu_)
  std::atomic<uint64_t> next_id_{1};
  std::atomic<uint64_t> next_stream_{1};
};

}  // namespace kvshade::client

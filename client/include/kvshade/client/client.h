// The kvshade C++ client: one connection to one kvshade-server endpoint (plaintext, TLS or
// mTLS; optional bearer token), typed wrappers for every RPC of kvshade.v1.KvShade that
// return absl::Status / absl::StatusOr (gRPC codes map one to one onto absl codes), a
// grpc.health.v1 check, and an Ingest writer that streams a session's layers.
//
// Thread safety: a Client may be shared by many threads; every call makes its own
// grpc::ClientContext. An IngestWriter belongs to one thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
  // client connects over UCX (once, with the first token) and SelectAndReconstruct goes
  // over it. If UCX cannot connect, or the connection dies, calls fall back to gRPC
  // inline with a log line on stderr and ucx_fallbacks() counts it.
  bool use_ucx = false;
  std::string ucx_transports;  // UCX_TLS value for the client's worker ("" = UCX's choice)
};

// grpc.health.v1 ServingStatus.
enum class HealthStatus { kUnknown = 0, kServing = 1, kNotServing = 2, kServiceUnknown = 3 };
std::string_view HealthStatusName(HealthStatus s);

absl::Status FromGrpc(const grpc::Status& s);

class IngestWriter;

class Client {
 public:
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  // --- Sessions ---
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& req);
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const std::string& parent_session_id,
                                                      uint64_t at_token);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::LookupPrefixRequest& req);
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  absl::Status CloseSession(const std::string& session_id);

  // --- Data ---
  // Raw stream: sends every message in order, then closes the stream.
  absl::StatusOr<v1::IngestResponse> Ingest(absl::Span<const v1::IngestRequest> messages);
  // Incremental stream (one layer at a time; see IngestWriter).
  absl::StatusOr<std::unique_ptr<IngestWriter>> StartIngest(const std::string& session_id);
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const v1::AppendTokensRequest& req);

  // --- Workers ---
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& req);
  absl::Status Detach(const std::string& attachment_id);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const std::string& attachment_id,
                                                        uint32_t layer);

  // --- Decode ---
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const v1::SelectAndReconstructRequest& req);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& req);

  // --- Operations ---
  absl::StatusOr<v1::StatsResponse> Stats();
  // grpc.health.v1.Health/Check for `service` ("" = the whole server).
  absl::StatusOr<HealthStatus> CheckHealth(const std::string& service = "");
  // Polls CheckHealth with backoff (10 ms .. 200 ms) until SERVING or `deadline` passes;
  // DeadlineExceeded names the last status or error seen.
  absl::Status WaitForServing(absl::Duration deadline);

  // --- UCX data plane (see ClientOptions::use_ucx) ---
  bool ucx_connected() const;
  uint64_t ucx_fallbacks() const { return ucx_fallbacks_.load(); }

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

  ClientOptions options_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::KvShade::Stub> stub_;
  std::unique_ptr<grpc::GenericStub> generic_;
  void UcxFallback(const absl::Status& why);
  mutable std::mutex ucx_mu_;
  std::shared_ptr<UcxDataPlane> ucx_;  // null: gRPC inline
  bool ucx_tried_ = false;
  std::atomic<uint64_t> ucx_fallbacks_{0};
};

// One client stream of Ingest: the header is sent by Client::StartIngest; then any number
// of layer parts; Commit() sends the commit marker and returns the server's response.
// Destroying a writer without Commit() cancels the stream (nothing is committed).
class IngestWriter {
 public:
  ~IngestWriter();

  // Sends one part as is.
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
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<v1::IngestResponse> response_;
  std::unique_ptr<grpc::ClientWriter<v1::IngestRequest>> writer_;
  bool done_ = false;
  uint64_t bytes_sent_ = 0;
};

}  // namespace kvshade::client

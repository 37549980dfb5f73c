// UcxDataPlane: the client side of kvshade's UCX data plane (service/README.md "UCX data
// plane"). Connect() opens an endpoint to the daemon's worker address (from
// AttachResponse.data_plane_address), presents the one-time admission token
// (data_plane_token) in a HELLO active message and keeps the connection key the daemon
// answers with. SelectAndReconstruct() then sends the request as an active message and
// waits for the reply; the result is the same v1 response the gRPC call returns.
//
// Threading: one progress thread per UcxDataPlane; calls may come from any thread and
// may overlap (replies are matched by request id).
#pragma once

#include <atomic>
#include <cstdint>
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
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::service::ucx {
class UcxLoop;
class UcxEndpoint;
}  // namespace kvshade::service::ucx

namespace kvshade::client {

struct UcxOptions {
  std::string transports;                       // UCX_TLS value; "" = UCX's choice
  absl::Duration timeout = absl::Seconds(30);   // per call (and for the HELLO)
};

class UcxDataPlane {
 public:
  // Fails (UNAVAILABLE, PERMISSION_DENIED for a bad token, DEADLINE_EXCEEDED) when the
  // daemon cannot be reached or refuses the token.
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Connect(const std::string& address,
                                                               const std::string& token,
                                                               const UcxOptions& options = {});
  ~UcxDataPlane();  // says BYE, closes the endpoint, stops the progress thread
  UcxDataPlane(const UcxDataPlane&) = delete;
  UcxDataPlane& operator=(const UcxDataPlane&) = delete;

  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const v1::SelectAndReconstructRequest& req);

  // One whole Ingest stream over UCX, in order (header first, commit last), each message
  // acknowledged before the next: the tensors' bytes go by rendezvous straight from
  // `messages` (no copy into a protobuf payload). Same rules and response as the gRPC
  // Ingest; an error discards the stream (nothing committed).
  absl::StatusOr<v1::IngestResponse> Ingest(absl::Span<const v1::IngestRequest> messages);
  // Sends one message of an Ingest stream (the building block of Ingest()).
  absl::StatusOr<std::string> IngestMessage(const v1::IngestRequest& msg);

  // Test hook: forget the connection key so that destruction sends no BYE (a client that
  // vanishes).
  void AbandonForTest() { key_.clear(); }

  // Whether the endpoint has failed (peer gone); calls then fail with UNAVAILABLE.
  bool failed() const;

  // Test hook: sends a request with an arbitrary connection key (an unadmitted client).
  absl::StatusOr<std::string> RawRequest(unsigned am_id, const std::string& connection_key,
                                         const std::string& payload);
  // Test hook: connects without HELLO (no connection key).
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> ConnectWithoutHello(
      const std::string& address, const UcxOptions& options = {});

 private:
  struct Reply {
    int code = 0;
    std::string payload;
    std::string connection_key;
  };
  struct Pending;
  UcxDataPlane() = default;
  static absl::StatusOr<std::unique_ptr<UcxDataPlane>> Open(const std::string& address,
                                                            const UcxOptions& options);
  // Sends (am_id, header with request id + `key`/`token`, payload) and waits for the reply.
  absl::StatusOr<Reply> Call(unsigned am_id, const std::string& token, const std::string& key,
                             std::string payload, const v1::DataPlaneHeader* extra = nullptr,
                             std::vector<std::pair<const void*, size_t>> iov = {});
  void OnReply(std::string header, std::string payload);

  UcxOptions options_;
  std::unique_ptr<service::ucx::UcxLoop> loop_;
  std::unique_ptr<service::ucx::UcxEndpoint> ep_;  // created/destroyed on the loop thread
  std::string key_;
  std::mutex mu_;
  std::map<uint64_t, std::shared_ptr<Pending>> pending_;
  std::atomic<uint64_t> next_id_{1};
};

}  // namespace kvshade::client

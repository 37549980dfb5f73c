// Router: the kvshade client over a static list of endpoints (one kvshade-server per GPU
// node), each call sent to the endpoint that holds what it is about.
//
// Placement (rendezvous, i.e. highest-random-weight, hashing; the bytes are fixed so any
// process or language recomputes them):
//   prefix key  = XXH3-64, seed kRouteSeed, over the model id's bytes, one 0x00 byte, then
//                 the first min(n, route_prefix_tokens) token ids as int32 little-endian;
//   weight(e,k) = XXH3-64, seed XXH3-64(endpoint name, seed kRouteSeed), over k as 8 bytes
//                 little-endian;
//   owner(k)    = the endpoint of highest weight (ties: lower name). Rank(k) orders all.
// CreateSession and LookupPrefix go to the owner of the request's prefix key, so every
// question and fork of a document lands where the document (and its cached prefix) is.
// Removing an endpoint moves only the keys it owned (each to its next-ranked endpoint);
// adding one takes keys only for itself. An endpoint's name defaults to its target; give
// stable names (e.g. the StatefulSet pod name) when addresses can change.
//
// Ownership: the router remembers which endpoint created each session and attachment it
// saw. Calls by session id (fork, get, close, ingest, append, attach) go to the owner;
// calls by attachment id (detach, static set, select, attend) to the attachment's owner.
// An id the router has not seen (made by another process) is found by asking the
// endpoints (GetSession; for an attachment, GetStaticSet of layer 0xFFFFFFFF, which the
// daemon resolves before it rejects the layer) and then remembered. NOT_FOUND only when
// every endpoint answered NOT_FOUND; UNAVAILABLE when some endpoint could not be asked
// (UNAVAILABLE or DEADLINE_EXCEEDED); any other answer (UNAUTHENTICATED, ...) as it came.
//
// Endpoints that are down: a new key (CreateSession, LookupPrefix) that gets UNAVAILABLE
// from its owner goes to the key's next-ranked endpoint, and the failed endpoint is
// skipped for `down_backoff` (tried last while marked down). Sessions are not replicated:
// calls about a session on a down endpoint fail with UNAVAILABLE. A CreateSession that
// failed over is a cache miss on the new endpoint, and later keys return to their owner
// once it is back.
//
// Batches: SelectAndReconstruct and Attend may mix attachments of several endpoints; the
// batch is split per endpoint, the parts run concurrently, and the answers come back in
// the request's order. If one part fails the call fails, while the other parts have
// already run (their attachments' slot tables advanced): keep a batch on one endpoint
// (one document's questions are, by construction) when that matters.
//
// Thread safety: a Router may be shared by threads, like a Client.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvshade/client/client.h"

namespace kvshade::client {

// Part of the placement scheme: changing it moves every key.
inline constexpr uint64_t kRouteSeed = 0x6B7673726F757465ull;  // "kvsroute"
inline constexpr uint32_t kDefaultRoutePrefixTokens = 256;     // = the prefix block size

struct RouterEndpoint {
  std::string name;       // identity in the hash; "" = options.target
  ClientOptions options;  // target, credentials, UCX, ... of this endpoint
};

struct RouterOptions {
  std::vector<RouterEndpoint> endpoints;
  // Tokens of the prompt that make the prefix key. Prompts sharing their first
  // route_prefix_tokens tokens (and model) land together; the server reuses prefixes in
  // blocks of 256 tokens, so a shared prefix shorter than one block gains nothing anyway.
  uint32_t route_prefix_tokens = kDefaultRoutePrefixTokens;
  // How long an endpoint that answered UNAVAILABLE is tried last for new keys.
  absl::Duration down_backoff = absl::Seconds(5);
};

// The placement functions (see the file comment for the exact bytes).
uint64_t RoutePrefixKey(std::string_view model_id, absl::Span<const int32_t> token_ids,
                        uint32_t route_prefix_tokens = kDefaultRoutePrefixTokens);
uint64_t RendezvousWeight(std::string_view endpoint_name, uint64_t key);
// Indices of `names` by decreasing weight for `key` (ties: lower name first).
std::vector<size_t> RendezvousRank(absl::Span<const std::string> names, uint64_t key);

class Router {
 public:
  // Connects a Client per endpoint (no RPC is made). InvalidArgument for an empty list,
  // duplicate names or route_prefix_tokens == 0.
  static absl::StatusOr<std::unique_ptr<Router>> Connect(const RouterOptions& options);
  // Same endpoint options for every target (`shared.target` is ignored).
  static absl::StatusOr<std::unique_ptr<Router>> Connect(
      const std::vector<std::string>& targets, const ClientOptions& shared,
      uint32_t route_prefix_tokens = kDefaultRoutePrefixTokens);

  // --- Placement ---
  size_t size() const { return endpoints_.size(); }
  const std::string& name(size_t i) const { return names_[i]; }
  Client& endpoint(size_t i) { return *endpoints_[i]; }
  uint64_t PrefixKey(const std::string& model_id, absl::Span<const int32_t> token_ids) const;
  // Endpoint indices for `key`, owner first.
  std::vector<size_t> Rank(uint64_t key) const { return RendezvousRank(names_, key); }
  // The endpoint that holds a session / attachment (remembered, else found by asking).
  absl::StatusOr<size_t> SessionEndpoint(const std::string& session_id);
  absl::StatusOr<size_t> AttachmentEndpoint(const std::string& attachment_id);
  // The Client of the endpoint holding `session_id` (for helpers that take a Client).
  absl::StatusOr<Client*> ClientForSession(const std::string& session_id);

  // --- Sessions ---
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const v1::CreateSessionRequest& req);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::LookupPrefixRequest& req);
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const std::string& parent_session_id,
                                                      uint64_t at_token);
  absl::StatusOr<v1::SessionInfo> GetSession(const std::string& session_id);
  // Every endpoint's sessions; UNAVAILABLE (naming it) if an endpoint cannot be asked.
  absl::StatusOr<v1::ListSessionsResponse> ListSessions();
  absl::Status CloseSession(const std::string& session_id);

  // --- Data ---
  absl::StatusOr<v1::IngestResponse> Ingest(absl::Span<const v1::IngestRequest> messages);
  absl::StatusOr<std::unique_ptr<IngestWriter>> StartIngest(const std::string& session_id);
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const v1::AppendTokensRequest& req);

  // --- Workers ---
  absl::StatusOr<v1::AttachResponse> Attach(const v1::AttachRequest& req);
  absl::Status Detach(const std::string& attachment_id);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const std::string& attachment_id,
                                                        uint32_t layer);
  // Client::RegisterSlotBuffers on the attachment's endpoint.
  absl::Status RegisterSlotBuffers(const std::string& attachment_id, void* k, void* v,
                                   size_t bytes);

  // --- Decode (batches may span endpoints; see the file comment) ---
  absl::StatusOr<v1::SelectAndReconstructResponse> SelectAndReconstruct(
      const v1::SelectAndReconstructRequest& req);
  absl::StatusOr<v1::AttendResponse> Attend(const v1::AttendRequest& req);
  // Async variants. A batch on one endpoint is that Client's async call; a batch over
  // several runs the sync call on a thread of its own (std::async: destroying the future
  // waits for it). The Router must outlive the futures.
  std::future<absl::StatusOr<v1::SelectAndReconstructResponse>> SelectAndReconstructAsync(
      const v1::SelectAndReconstructRequest& req);
  std::future<absl::StatusOr<v1::AttendResponse>> AttendAsync(const v1::AttendRequest& req);

  // --- Operations ---
  // Waits until every endpoint is SERVING (or `deadline` passes).
  absl::Status WaitForServing(absl::Duration deadline);
  // Sum of the endpoints' Client::ucx_fallbacks().
  uint64_t ucx_fallbacks() const;

 private:
  Router() = default;
  // Candidates for a new key: the rank, endpoints marked down moved to the end.
  std::vector<size_t> Candidates(uint64_t key) const;
  void MarkDown(size_t i);
  void RememberSession(const std::string& session_id, size_t i);
  void ForgetSession(const std::string& session_id);
  // Runs `call(client)` on the key's candidates until one answers something other than
  // UNAVAILABLE; *chosen (may be null) = the endpoint that answered.
  template <typename T, typename Call>
  absl::StatusOr<T> OnKey(uint64_t key, Call call, size_t* chosen);
  // Splits a batch by the endpoints of its queries' attachments.
  absl::StatusOr<std::vector<std::pair<size_t, std::vector<int>>>> GroupByEndpoint(
      const std::vector<std::string>& attachment_ids);
  // A decode batch over several endpoints: the parts run concurrently (`call(client,
  // part)`), and the per-query results (`items(response)`: deltas or outputs) come back
  // in the request's order.
  template <typename Req, typename Resp, typename Call, typename Items>
  absl::StatusOr<Resp> SplitBatch(const Req& req, Call call, Items items);

  RouterOptions options_;
  std::vector<std::string> names_;
  std::vector<std::unique_ptr<Client>> endpoints_;
  mutable std::mutex mu_;
  std::vector<absl::Time> down_until_;
  std::unordered_map<std::string, size_t> sessions_;  // session id -> endpoint
  struct AttachmentPlace {
    size_t endpoint;
    std::string session_id;  // "" when found by asking
  };
  std::unordered_map<std::string, AttachmentPlace> attachments_;
};

}  // namespace kvshade::client

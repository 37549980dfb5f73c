// Router (router.h): rendezvous placement of prefix keys over a static endpoint list,
// remembered ownership of sessions and attachments, failover of new keys to the
// next-ranked endpoint, and batches split per endpoint.
#include "kvshade/client/router.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <future>
#include <set>

#include "absl/strings/str_cat.h"

namespace kvshade::client {
namespace {

// The layer no model has: GetStaticSet resolves the attachment (NOT_FOUND when it is not
// on that endpoint) before it rejects the layer (INVALID_ARGUMENT), so this asks "is the
// attachment here?" without moving any data.
constexpr uint32_t kProbeLayer = 0xFFFFFFFFu;

// Errors that mean "this endpoint did not answer" (down, unreachable, too slow), as opposed
// to a daemon's answer.
bool CouldNotAsk(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded;
}

absl::Status Named(const std::string& endpoint, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("endpoint '", endpoint, "': ", std::string(s.message())));
}

void PutLe64(uint64_t v, unsigned char* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

// Binds `var` to the endpoint that holds `session_id` (remembered or found by asking), or
// returns the lookup's error.
#define KVSHADE_ROUTER_OWNER(var, session_id)          \
  auto var##_or = SessionEndpoint(session_id);         \
  if (!var##_or.ok()) return var##_or.status();        \
  const size_t var = *var##_or

// NOT_FOUND from a session's owner means the session is gone there (closed, expired, or
// lost in a restart): `forget` drops what the router remembered of it.
template <typename T>
absl::StatusOr<T> NoteNotFound(absl::StatusOr<T> r, const std::function<void()>& forget) {
  if (!r.ok() && r.status().code() == absl::StatusCode::kNotFound) forget();
  return r;
}

}  // namespace

uint64_t RoutePrefixKey(std::string_view model_id, absl::Span<const int32_t> token_ids,
                        uint32_t route_prefix_tokens) {
  const size_t n = std::min<size_t>(token_ids.size(), route_prefix_tokens);
  std::string bytes;
  bytes.reserve(model_id.size() + 1 + 4 * n);
  bytes.append(model_id.data(), model_id.size());
  bytes.push_back('\0');
  for (size_t i = 0; i < n; ++i) {
    const uint32_t t = static_cast<uint32_t>(token_ids[i]);
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>(t >> (8 * b)));
  }
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), kRouteSeed);
}

uint64_t RendezvousWeight(std::string_view endpoint_name, uint64_t key) {
  const uint64_t seed = XXH3_64bits_withSeed(endpoint_name.data(), endpoint_name.size(), kRouteSeed);
  unsigned char k[8];
  PutLe64(key, k);
  return XXH3_64bits_withSeed(k, sizeof(k), seed);
}

std::vector<size_t> RendezvousRank(absl::Span<const std::string> names, uint64_t key) {
  std::vector<std::pair<uint64_t, size_t>> w(names.size());
  for (size_t i = 0; i < names.size(); ++i) w[i] = {RendezvousWeight(names[i], key), i};
  std::sort(w.begin(), w.end(), [&](const auto& a, const auto& b) {
    if (a.first != b.first) return a.first > b.first;
    return names[a.second] < names[b.second];
  });
  std::vector<size_t> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = w[i].second;
  return out;
}

absl::StatusOr<std::unique_ptr<Router>> Router::Connect(const RouterOptions& options) {
  if (options.endpoints.empty()) {
    return absl::InvalidArgumentError("Router: endpoints must not be empty");
  }
  if (options.route_prefix_tokens == 0) {
    return absl::InvalidArgumentError("Router: route_prefix_tokens must be > 0, got 0");
  }
  std::unique_ptr<Router> r(new Router());
  r->options_ = options;
  std::set<std::string> seen;
  for (size_t i = 0; i < options.endpoints.size(); ++i) {
    const RouterEndpoint& e = options.endpoints[i];
    std::string name = e.name.empty() ? e.options.target : e.name;
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("Router: endpoint names must be unique, '", name, "' appears twice"));
    }
    auto c = Client::Connect(e.options);
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("Router: endpoint '", name, "': ", std::string(c.status().message())));
    }
    r->names_.push_back(std::move(name));
    r->endpoints_.push_back(*std::move(c));
  }
  r->down_until_.assign(r->endpoints_.size(), absl::InfinitePast());
  return r;
}

absl::StatusOr<std::unique_ptr<Router>> Router::Connect(const std::vector<std::string>& targets,
                                                        const ClientOptions& shared,
                                                        uint32_t route_prefix_tokens) {
  RouterOptions o;
  o.route_prefix_tokens = route_prefix_tokens;
  for (const std::string& t : targets) {
    RouterEndpoint e;
    e.options = shared;
    e.options.target = t;
    o.endpoints.push_back(std::move(e));
  }
  return Connect(o);
}

uint64_t Router::PrefixKey(const std::string& model_id, absl::Span<const int32_t> token_ids) const {
  return RoutePrefixKey(model_id, token_ids, options_.route_prefix_tokens);
}

std::vector<size_t> Router::Candidates(uint64_t key) const {
  std::vector<size_t> rank = Rank(key);
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  std::stable_partition(rank.begin(), rank.end(), [&](size_t i) { return down_until_[i] <= now; });
  return rank;
}

void Router::MarkDown(size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  down_until_[i] = absl::Now() + options_.down_backoff;
}

void Router::RememberSession(const std::string& session_id, size_t i) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_[session_id] = i;
}

void Router::ForgetSession(const std::string& session_id) {
  std::lock_guard<std::mutex> lock(mu_);
  sessions_.erase(session_id);
  for (auto it = attachments_.begin(); it != attachments_.end();) {
    it = it->second.session_id == session_id ? attachments_.erase(it) : std::next(it);
  }
}

template <typename T, typename Call>
absl::StatusOr<T> Router::OnKey(uint64_t key, Call call, size_t* chosen) {
  std::string tried;
  for (size_t i : Candidates(key)) {
    absl::StatusOr<T> r = call(*endpoints_[i]);
    if (r.ok() || r.status().code() != absl::StatusCode::kUnavailable) {
      if (chosen != nullptr) *chosen = i;
      return r;
    }
    // Down (or draining): the key's next-ranked endpoint takes it.
    MarkDown(i);
    absl::StrAppend(&tried, tried.empty() ? "" : "; ", names_[i], ": ", std::string(r.status().message()));
  }
  return absl::UnavailableError(absl::StrCat("no endpoint available (", tried, ")"));
}

absl::StatusOr<size_t> Router::SessionEndpoint(const std::string& session_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sessions_.find(session_id);
    if (it != sessions_.end()) return it->second;
  }
  std::string unreachable;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    auto r = endpoints_[i]->GetSession(session_id);
    if (r.ok()) {
      RememberSession(session_id, i);
      return i;
    }
    if (r.status().code() == absl::StatusCode::kNotFound) continue;
    // Any other answer from a daemon (a malformed id, a bad token) is the answer.
    if (!CouldNotAsk(r.status())) return Named(names_[i], r.status());
    absl::StrAppend(&unreachable, unreachable.empty() ? "" : "; ", names_[i], ": ",
                    std::string(r.status().message()));
  }
  if (unreachable.empty()) {
    return absl::NotFoundError(absl::StrCat("session '", session_id, "' is on none of the ",
                                            endpoints_.size(), " endpoints"));
  }
  return absl::UnavailableError(absl::StrCat("session '", session_id,
                                             "' not found on the endpoints that answered; could not ask ",
                                             unreachable));
}

absl::StatusOr<size_t> Router::AttachmentEndpoint(const std::string& attachment_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = attachments_.find(attachment_id);
    if (it != attachments_.end()) return it->second.endpoint;
  }
  std::string unreachable;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    auto r = endpoints_[i]->GetStaticSet(attachment_id, kProbeLayer);
    const absl::StatusCode code = r.ok() ? absl::StatusCode::kOk : r.status().code();
    if (code == absl::StatusCode::kNotFound) continue;
    if (code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kOk) {
      std::lock_guard<std::mutex> lock(mu_);
      attachments_[attachment_id] = AttachmentPlace{i, ""};
      return i;
    }
    if (!CouldNotAsk(r.status())) return Named(names_[i], r.status());
    absl::StrAppend(&unreachable, unreachable.empty() ? "" : "; ", names_[i], ": ",
                    std::string(r.status().message()));
  }
  if (unreachable.empty()) {
    return absl::NotFoundError(absl::StrCat("attachment '", attachment_id, "' is on none of the ",
                                            endpoints_.size(), " endpoints"));
  }
  return absl::UnavailableError(absl::StrCat("attachment '", attachment_id,
                                             "' not found on the endpoints that answered; could not ask ",
                                             unreachable));
}

absl::StatusOr<Client*> Router::ClientForSession(const std::string& session_id) {
  auto i = SessionEndpoint(session_id);
  if (!i.ok()) return i.status();
  return endpoints_[*i].get();
}

// --- Sessions ---------------------------------------------------------------------------

absl::StatusOr<v1::CreateSessionResponse> Router::CreateSession(const v1::CreateSessionRequest& req) {
  const uint64_t key = PrefixKey(req.model().model_id(), req.token_ids());
  size_t chosen = 0;
  auto r = OnKey<v1::CreateSessionResponse>(
      key, [&](Client& c) { return c.CreateSession(req); }, &chosen);
  if (r.ok()) RememberSession(r->session_id(), chosen);
  return r;
}

absl::StatusOr<v1::LookupPrefixResponse> Router::LookupPrefix(const v1::LookupPrefixRequest& req) {
  const uint64_t key = PrefixKey(req.model().model_id(), req.token_ids());
  return OnKey<v1::LookupPrefixResponse>(key, [&](Client& c) { return c.LookupPrefix(req); }, nullptr);
}

absl::StatusOr<v1::ForkSessionResponse> Router::ForkSession(const std::string& parent, uint64_t at_token) {
  KVSHADE_ROUTER_OWNER(i, parent);
  auto r = NoteNotFound(endpoints_[i]->ForkSession(parent, at_token), [&] { ForgetSession(parent); });
  if (r.ok()) RememberSession(r->session_id(), i);
  return r;
}

absl::StatusOr<v1::SessionInfo> Router::GetSession(const std::string& session_id) {
  KVSHADE_ROUTER_OWNER(i, session_id);
  return NoteNotFound(endpoints_[i]->GetSession(session_id), [&] { ForgetSession(session_id); });
}

absl::StatusOr<v1::ListSessionsResponse> Router::ListSessions() {
  v1::ListSessionsResponse all;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    auto r = endpoints_[i]->ListSessions();
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("ListSessions on '", names_[i], "': ", std::string(r.status().message())));
    }
    for (auto& s : *r->mutable_sessions()) {
      RememberSession(s.session_id(), i);
      *all.add_sessions() = std::move(s);
    }
  }
  return all;
}

absl::Status Router::CloseSession(const std::string& session_id) {
  KVSHADE_ROUTER_OWNER(i, session_id);
  absl::Status s = endpoints_[i]->CloseSession(session_id);
  if (s.ok() || s.code() == absl::StatusCode::kNotFound) ForgetSession(session_id);
  return s;
}

// --- Data -------------------------------------------------------------------------------

absl::StatusOr<v1::IngestResponse> Router::Ingest(absl::Span<const v1::IngestRequest> messages) {
  if (messages.empty() || !messages.front().has_header()) {
    return absl::InvalidArgumentError("Router::Ingest: the first message must be the header");
  }
  const std::string& sid = messages.front().header().session_id();
  KVSHADE_ROUTER_OWNER(i, sid);
  return endpoints_[i]->Ingest(messages);
}

absl::StatusOr<std::unique_ptr<IngestWriter>> Router::StartIngest(const std::string& session_id) {
  KVSHADE_ROUTER_OWNER(i, session_id);
  return endpoints_[i]->StartIngest(session_id);
}

absl::StatusOr<v1::AppendTokensResponse> Router::AppendTokens(const v1::AppendTokensRequest& req) {
  KVSHADE_ROUTER_OWNER(i, req.session_id());
  return endpoints_[i]->AppendTokens(req);
}

// --- Workers ----------------------------------------------------------------------------

absl::StatusOr<v1::AttachResponse> Router::Attach(const v1::AttachRequest& req) {
  KVSHADE_ROUTER_OWNER(i, req.session_id());
  auto r = NoteNotFound(endpoints_[i]->Attach(req), [&] { ForgetSession(req.session_id()); });
  if (r.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    attachments_[r->attachment_id()] = AttachmentPlace{i, req.session_id()};
  }
  return r;
}

absl::Status Router::Detach(const std::string& attachment_id) {
  auto i = AttachmentEndpoint(attachment_id);
  if (!i.ok()) return i.status();
  absl::Status s = endpoints_[*i]->Detach(attachment_id);
  if (s.ok() || s.code() == absl::StatusCode::kNotFound) {
    std::lock_guard<std::mutex> lock(mu_);
    attachments_.erase(attachment_id);
  }
  return s;
}

absl::StatusOr<v1::GetStaticSetResponse> Router::GetStaticSet(const std::string& attachment_id,
                                                              uint32_t layer) {
  auto i = AttachmentEndpoint(attachment_id);
  if (!i.ok()) return i.status();
  return endpoints_[*i]->GetStaticSet(attachment_id, layer);
}

absl::Status Router::RegisterSlotBuffers(const std::string& attachment_id, void* k, void* v,
                                         size_t bytes) {
  auto i = AttachmentEndpoint(attachment_id);
  if (!i.ok()) return i.status();
  return endpoints_[*i]->RegisterSlotBuffers(attachment_id, k, v, bytes);
}

// --- Decode -----------------------------------------------------------------------------

absl::StatusOr<std::vector<std::pair<size_t, std::vector<int>>>> Router::GroupByEndpoint(
    const std::vector<std::string>& attachment_ids) {
  std::vector<std::pair<size_t, std::vector<int>>> groups;
  for (size_t q = 0; q < attachment_ids.size(); ++q) {
    auto i = AttachmentEndpoint(attachment_ids[q]);
    if (!i.ok()) {
      return absl::Status(i.status().code(),
                          absl::StrCat("queries[", q, "]: ", std::string(i.status().message())));
    }
    auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& p) { return p.first == *i; });
    if (g == groups.end()) {
      groups.push_back({*i, {}});
      g = groups.end() - 1;
    }
    g->second.push_back(static_cast<int>(q));
  }
  return groups;
}

namespace {

// Runs `run(group index)` for every group, the first on this thread and the others on
// their own threads (each endpoint answers its part concurrently), and returns the
// results in group order.
template <typename T, typename Run>
std::vector<absl::StatusOr<T>> RunGroups(size_t n, Run run) {
  std::vector<std::future<absl::StatusOr<T>>> rest;
  for (size_t g = 1; g < n; ++g) rest.push_back(std::async(std::launch::async, run, g));
  std::vector<absl::StatusOr<T>> out;
  out.push_back(run(0));
  for (auto& f : rest) out.push_back(f.get());
  return out;
}

}  // namespace

template <typename Req, typename Resp, typename Call, typename Items>
absl::StatusOr<Resp> Router::SplitBatch(const Req& req, Call call, Items items) {
  std::vector<std::string> ids;
  for (const auto& q : req.queries()) ids.push_back(q.attachment_id());
  auto groups = GroupByEndpoint(ids);
  if (!groups.ok()) return groups.status();
  if (groups->size() <= 1) {
    const size_t i = groups->empty() ? 0 : groups->front().first;
    return call(*endpoints_[i], req);
  }
  Req shell = req;  // every other field, carried unchanged
  shell.clear_queries();
  auto results = RunGroups<Resp>(groups->size(), [&](size_t g) {
    Req part = shell;
    for (int q : (*groups)[g].second) *part.add_queries() = req.queries(q);
    return call(*endpoints_[(*groups)[g].first], part);
  });
  Resp out;
  auto* merged = items(out);
  for (int q = 0; q < req.queries_size(); ++q) merged->Add();
  for (size_t g = 0; g < groups->size(); ++g) {
    const std::string& name = names_[(*groups)[g].first];
    if (!results[g].ok()) return Named(name, results[g].status());
    const auto& idx = (*groups)[g].second;
    auto* part = items(*results[g]);
    if (part->size() != static_cast<int>(idx.size())) {
      return absl::InternalError(absl::StrCat("endpoint '", name, "' answered ", part->size(),
                                              " results for ", idx.size(), " queries"));
    }
    for (size_t k = 0; k < idx.size(); ++k) {
      merged->Mutable(idx[k])->Swap(part->Mutable(static_cast<int>(k)));
    }
  }
  return out;
}

absl::StatusOr<v1::SelectAndReconstructResponse> Router::SelectAndReconstruct(
    const v1::SelectAndReconstructRequest& req) {
  return SplitBatch<v1::SelectAndReconstructRequest, v1::SelectAndReconstructResponse>(
      req, [](Client& c, const v1::SelectAndReconstructRequest& r) { return c.SelectAndReconstruct(r); },
      [](v1::SelectAndReconstructResponse& r) { return r.mutable_deltas(); });
}

absl::StatusOr<v1::AttendResponse> Router::Attend(const v1::AttendRequest& req) {
  return SplitBatch<v1::AttendRequest, v1::AttendResponse>(
      req, [](Client& c, const v1::AttendRequest& r) { return c.Attend(r); },
      [](v1::AttendResponse& r) { return r.mutable_outputs(); });
}

namespace {

template <typename T>
std::future<absl::StatusOr<T>> Ready(absl::StatusOr<T> v) {
  std::promise<absl::StatusOr<T>> p;
  p.set_value(std::move(v));
  return p.get_future();
}

}  // namespace

std::future<absl::StatusOr<v1::SelectAndReconstructResponse>> Router::SelectAndReconstructAsync(
    const v1::SelectAndReconstructRequest& req) {
  std::vector<std::string> ids;
  for (const auto& q : req.queries()) ids.push_back(q.attachment_id());
  auto groups = GroupByEndpoint(ids);
  if (!groups.ok()) return Ready<v1::SelectAndReconstructResponse>(groups.status());
  if (groups->size() <= 1) {
    return endpoints_[groups->empty() ? 0 : groups->front().first]->SelectAndReconstructAsync(req);
  }
  return std::async(std::launch::async, [this, req] { return SelectAndReconstruct(req); });
}

std::future<absl::StatusOr<v1::AttendResponse>> Router::AttendAsync(const v1::AttendRequest& req) {
  std::vector<std::string> ids;
  for (const auto& q : req.queries()) ids.push_back(q.attachment_id());
  auto groups = GroupByEndpoint(ids);
  if (!groups.ok()) return Ready<v1::AttendResponse>(groups.status());
  if (groups->size() <= 1) {
    return endpoints_[groups->empty() ? 0 : groups->front().first]->AttendAsync(req);
  }
  return std::async(std::launch::async, [this, req] { return Attend(req); });
}

// --- Operations -------------------------------------------------------------------------

absl::Status Router::WaitForServing(absl::Duration deadline) {
  const absl::Time end = absl::Now() + deadline;
  for (size_t i = 0; i < endpoints_.size(); ++i) {
    absl::Status s = endpoints_[i]->WaitForServing(std::max(end - absl::Now(), absl::ZeroDuration()));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("endpoint '", names_[i], "': ", std::string(s.message())));
    }
  }
  return absl::OkStatus();
}

uint64_t Router::ucx_fallbacks() const {
  uint64_t n = 0;
  for (const auto& c : endpoints_) n += c->ucx_fallbacks();
  return n;
}

}  // namespace kvshade::client

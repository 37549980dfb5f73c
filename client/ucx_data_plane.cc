// UcxDataPlane (ucx_data_plane.h): HELLO with the admission token, then request/reply
// active messages matched by request id.
#include "kvshade/client/ucx_data_plane.h"

#include <chrono>
#include <condition_variable>

#include "absl/strings/str_cat.h"
#include "kvshade/service/ucx_core.h"

namespace kvshade::client {

namespace ucx = kvshade::service::ucx;

struct UcxDataPlane::Pending {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  Reply reply;
};

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::Open(const std::string& address,
                                                                 const UcxOptions& options) {
  std::unique_ptr<UcxDataPlane> dp(new UcxDataPlane());
  dp->options_ = options;
  UcxDataPlane* self = dp.get();
  std::map<unsigned, ucx::UcxLoop::Handler> handlers;
  handlers[ucx::kReply] = [self](ucx::AmMessage&& m) {
    self->OnReply(std::move(m.header), std::move(m.payload));
  };
  auto loop = ucx::UcxLoop::Start(options.transports, std::move(handlers));
  if (!loop.ok()) return loop.status();
  dp->loop_ = *std::move(loop);
  auto raw = ucx::DecodeWorkerAddress(address);
  if (!raw.ok()) return raw.status();
  absl::Status st = dp->loop_->CallStatus([self, &raw]() -> absl::Status {
    auto ep = ucx::UcxEndpoint::Connect(self->loop_->worker(), *raw);
    if (!ep.ok()) return ep.status();
    self->ep_ = *std::move(ep);
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  return dp;
}

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::Connect(const std::string& address,
                                                                    const std::string& token,
                                                                    const UcxOptions& options) {
  if (token.empty()) {
    return absl::InvalidArgumentError(
        "UCX connect: the admission token is empty (the daemon has no data plane, or Attach "
        "was not called)");
  }
  auto dp = Open(address, options);
  if (!dp.ok()) return dp.status();
  v1::DataPlaneHeader extra;
  // Lets the daemon notice our exit; only where the transports can detect a dead peer
  // (a second endpoint without detection over UCX 1.13 shm disturbs the first).
  if ((*dp)->ep_->peer_failure_detection()) extra.set_worker_address((*dp)->loop_->address());
  auto r = (*dp)->Call(ucx::kHello, token, "", "", &extra);
  if (!r.ok()) return r.status();
  if (r->code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  }
  if (r->connection_key.empty()) {
    return absl::InternalError("UCX connect: the daemon accepted HELLO but sent no key");
  }
  (*dp)->key_ = r->connection_key;
  return dp;
}

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::ConnectWithoutHello(
    const std::string& address, const UcxOptions& options) {
  return Open(address, options);
}

UcxDataPlane::~UcxDataPlane() {
  if (!loop_) return;
  UcxDataPlane* self = this;
  loop_->Stop([self] {
    if (self->ep_ && !self->key_.empty() && !self->ep_->failed()) {
      v1::DataPlaneHeader h;
      h.set_connection_key(self->key_);
      (void)self->loop_->Send(self->ep_->get(), ucx::kBye, h.SerializeAsString(), "");
      // Let the BYE leave before the endpoint closes (close flushes it too).
    }
    self->ep_.reset();
  });
  loop_.reset();
}

bool UcxDataPlane::failed() const { return ep_ == nullptr || ep_->failed(); }

void UcxDataPlane::OnReply(std::string header, std::string payload) {
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(header)) return;
  std::shared_ptr<Pending> p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(h.request_id());
    if (it == pending_.end()) return;  // timed out already
    p = it->second;
    pending_.erase(it);
  }
  std::lock_guard<std::mutex> lock(p->mu);
  p->reply.code = h.code();
  p->reply.payload = std::move(payload);
  p->reply.connection_key = h.connection_key();
  p->done = true;
  p->cv.notify_all();
}

absl::StatusOr<UcxDataPlane::Reply> UcxDataPlane::Call(unsigned am_id, const std::string& token,
                                                       const std::string& key,
                                                       std::string payload,
                                                       const v1::DataPlaneHeader* extra,
                                                       std::vector<std::pair<const void*, size_t>> iov) {
  if (ep_ == nullptr) return absl::FailedPreconditionError("UCX: not connected");
  if (ep_->failed()) return absl::UnavailableError(absl::StrCat("UCX: ", ep_->error().message()));
  const uint64_t id = next_id_.fetch_add(1);
  v1::DataPlaneHeader h;
  if (extra != nullptr) h = *extra;
  h.set_request_id(id);
  if (!token.empty()) h.set_admission_token(token);
  if (!key.empty()) h.set_connection_key(key);
  auto p = std::make_shared<Pending>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_[id] = p;
  }
  auto forget = [&] {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.erase(id);
  };
  UcxDataPlane* self = this;
  const bool posted = loop_->Post([self, am_id, p, hdr = h.SerializeAsString(),
                                   payload = std::move(payload), iov = std::move(iov)]() mutable {
    absl::Status st =
        iov.empty()
            ? self->loop_->Send(self->ep_->get(), am_id, std::move(hdr), std::move(payload))
            : self->loop_->SendIov(self->ep_->get(), am_id, std::move(hdr), std::move(iov));
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(p->mu);
      p->reply.code = static_cast<int>(st.code());
      p->reply.payload = std::string(st.message());
      p->done = true;
      p->cv.notify_all();
    }
  });
  if (!posted) {
    forget();
    return absl::UnavailableError("UCX: the progress thread has stopped");
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        absl::ToChronoMilliseconds(options_.timeout);
  std::unique_lock<std::mutex> lock(p->mu);
  while (!p->done) {
    // Wake now and then to notice a failed endpoint instead of waiting out the timeout.
    p->cv.wait_for(lock, std::chrono::milliseconds(50));
    if (p->done) break;
    if (ep_->failed()) {
      lock.unlock();
      forget();
      return absl::UnavailableError(absl::StrCat("UCX: ", ep_->error().message()));
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      lock.unlock();
      forget();
      return absl::DeadlineExceededError(absl::StrCat(
          "UCX: no reply from the daemon within ", absl::FormatDuration(options_.timeout)));
    }
  }
  Reply out = std::move(p->reply);
  lock.unlock();
  forget();  // a send that failed locally left its entry behind
  return out;
}

absl::StatusOr<v1::SelectAndReconstructResponse> UcxDataPlane::SelectAndReconstruct(
    const v1::SelectAndReconstructRequest& req) {
  auto r = Call(ucx::kSelect, "", key_, req.SerializeAsString());
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  v1::SelectAndReconstructResponse resp;
  if (!resp.ParseFromString(r->payload)) {
    return absl::InternalError("UCX SelectAndReconstruct: the reply does not parse");
  }
  return resp;
}

absl::StatusOr<std::string> UcxDataPlane::IngestMessage(const v1::IngestRequest& msg) {
  // The body is the message without tensor bytes; the bytes travel as the payload.
  v1::DataPlaneHeader extra;
  std::vector<std::pair<const void*, size_t>> iov;
  v1::IngestRequest body;
  if (msg.has_layer()) {
    const v1::IngestLayer& l = msg.layer();
    v1::IngestLayer* bl = body.mutable_layer();
    bl->set_layer(l.layer());
    bl->set_token_offset(l.token_offset());
    bl->set_last_part(l.last_part());
    auto add = [&](bool has, const v1::Tensor& t, auto mutable_out) {
      if (!has) return;
      v1::Tensor* out = mutable_out();  // only now: a mutable_ call creates the field
      *out->mutable_shape() = t.shape();
      out->set_dtype(t.dtype());
      iov.emplace_back(t.data().data(), t.data().size());
      extra.add_part_bytes(t.data().size());
    };
    add(l.has_k(), l.k(), [bl] { return bl->mutable_k(); });
    add(l.has_v(), l.v(), [bl] { return bl->mutable_v(); });
    add(l.has_observation_queries(), l.observation_queries(),
        [bl] { return bl->mutable_observation_queries(); });
  } else {
    body = msg;
  }
  extra.set_body(body.SerializeAsString());
  uint64_t total = 0;
  for (const auto& part : iov) total += part.second;
  // An empty payload still needs one (empty) element for the iov path; send it plainly.
  auto r = total == 0 ? Call(ucx::kIngest, "", key_, "", &extra)
                      : Call(ucx::kIngest, "", key_, "", &extra, std::move(iov));
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  return r->payload;
}

absl::StatusOr<v1::IngestResponse> UcxDataPlane::Ingest(
    absl::Span<const v1::IngestRequest> messages) {
  if (messages.empty() || !messages.front().has_header()) {
    return absl::InvalidArgumentError("UCX Ingest: the first message must be the header");
  }
  std::string last;
  for (const auto& m : messages) {
    auto r = IngestMessage(m);
    if (!r.ok()) return r.status();
    last = *std::move(r);
  }
  if (!messages.back().has_commit()) {
    return absl::InvalidArgumentError(
        "UCX Ingest: the stream ended without an IngestCommit; nothing was committed");
  }
  v1::IngestResponse resp;
  if (!resp.ParseFromString(last)) return absl::InternalError("UCX Ingest: the reply does not parse");
  return resp;
}

absl::StatusOr<std::string> UcxDataPlane::RawRequest(unsigned am_id,
                                                     const std::string& connection_key,
                                                     const std::string& payload) {
  auto r = Call(am_id, "", connection_key, payload);
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  return r->payload;
}

}  // namespace kvshade::client

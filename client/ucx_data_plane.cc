// UcxDataPlane (ucx_data_plane.h): HELLO with the admission token and this worker's
// address, then request/reply active messages matched by request id. Calls are
// asynchronous underneath (a table of pending replies, completed by the progress thread,
// with deadlines checked by its tick); the synchronous calls wait on a future.
#include "kvshade/client/ucx_data_plane.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <future>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kvshade/transport/decode_frame.h"
#include "kvshade/transport/frame.h"
#include "kvshade/transport/ucx_core.h"

namespace kvshade::client {

namespace ucx = kvshade::transport::ucx;
namespace frame = kvshade::transport::frame;
using SteadyClock = std::chrono::steady_clock;

struct UcxDataPlane::SlotBuffers {
  std::unique_ptr<ucx::UcxMemHandle> k, v;
};

namespace {

using Iov = std::vector<std::pair<const void*, size_t>>;

// A reply's status: the transport's, else the daemon's code.
template <typename R>
absl::Status ReplyStatus(const absl::StatusOr<R>& r) {
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  return absl::OkStatus();
}

template <typename T>
absl::StatusOr<T> ParseReply(const std::string& payload, std::string_view what) {
  T out;
  if (!out.ParseFromString(payload)) {
    return absl::InternalError(absl::StrCat("UCX ", std::string(what), ": the reply does not parse"));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxDataPlane>> UcxDataPlane::Open(const std::string& address,
                                                                 const UcxOptions& options) {
  std::unique_ptr<UcxDataPlane> dp(new UcxDataPlane());
  dp->options_ = options;
  UcxDataPlane* self = dp.get();
  std::map<unsigned, ucx::UcxLoop::Handler> handlers;
  handlers[ucx::kReply] = [self](ucx::AmMessage&& m) {
    self->OnReply(std::move(m.header), std::move(m.payload).TakeString(), m.oversize);
  };
  handlers[ucx::kFrameReply] = [self](ucx::AmMessage&& m) {
    self->OnFrameReply(std::move(m.header), std::move(m.payload).TakeString(), m.oversize);
  };
  // The tick enforces call deadlines and notices a failed endpoint while idle.
  auto loop = ucx::UcxLoop::Start(options.transports, std::move(handlers),
                                  [self] { self->OnTick(); }, std::chrono::milliseconds(20));
  if (!loop.ok()) return loop.status();
  dp->loop_ = *std::move(loop);
  dp->loop_->set_max_payload(options.max_reply_bytes);
  dp->loop_->set_busy_poll(absl::ToChronoMicroseconds(options.busy_poll));
  auto raw = ucx::DecodeWorkerAddress(address);
  if (!raw.ok()) return raw.status();
  absl::Status st = dp->loop_->CallStatus([self, &raw]() -> absl::Status {
    auto ep = ucx::UcxEndpoint::Connect(self->loop_->worker(), *raw, [self] {
      // Inside UCX's error callback: complete the calls from a task instead.
      self->loop_->Post([self] {
        self->FailPending(absl::UnavailableError(absl::StrCat("UCX: ", self->ep_->error().message())),
                          /*only_expired=*/false);
      });
    });
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
  // Our worker's address lets the daemon connect back (RMA puts, disconnect watch); its
  // endpoint must use our endpoint's error mode, since UCX pairs the two.
  v1::DataPlaneHeader extra;
  extra.set_worker_address((*dp)->loop_->address());
  extra.set_peer_failure_detection((*dp)->ep_->peer_failure_detection());
  auto r = (*dp)->Call(ucx::kHello, token, "", "", &extra);
  if (!r.ok() && r.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // Our endpoint reached the daemon (else the send would have failed), but nothing came
    // back: typically its worker cannot reach ours over the transports we offered (shared
    // memory of another user or container, a transport it does not load).
    return absl::UnavailableError(absl::StrCat(
        "UCX connect: no HELLO reply from the daemon within ",
        absl::FormatDuration(std::min(options.timeout, options.connect_timeout)),
        "; its worker may be unable to reach this client's worker over this client's "
        "transports '",
        options.transports.empty() ? std::string("UCX's choice") : options.transports,
        "' (the daemon's are its ucx.transports, logged at its start); give both sides "
        "transports they share, e.g. tcp,self"));
  }
  if (absl::Status st = ReplyStatus(r); !st.ok()) return st;
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
      // Closing the endpoint flushes the BYE out.
    }
    self->slot_buffers_.clear();  // unmapped on the thread that owns the context
    self->ep_.reset();
  });
  // The thread is gone: complete whatever is left here.
  FailPending(absl::CancelledError("UCX: the data plane was closed"), /*only_expired=*/false);
  loop_.reset();
}

bool UcxDataPlane::failed() const {
  return ep_ == nullptr || ep_->failed() || timed_out_.load();
}

std::string UcxDataPlane::failure() const {
  if (ep_ == nullptr) return "UCX: not connected";
  if (ep_->failed()) return absl::StrCat("UCX: ", ep_->error().message());
  if (timed_out_.load()) {
    std::lock_guard<std::mutex> lock(mu_);
    return timed_out_why_;
  }
  return "";
}

bool UcxDataPlane::peer_failure_detection() const {
  return ep_ != nullptr && ep_->peer_failure_detection();
}

void UcxDataPlane::Complete(uint64_t id, absl::StatusOr<Reply> r) {
  Callback<Reply> done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;  // completed already (timed out, failed)
    done = std::move(it->second.done);
    pending_.erase(it);
  }
  done(std::move(r));
}

void UcxDataPlane::FailPending(const absl::Status& why, bool only_expired) {
  std::vector<Callback<Reply>> failed;
  const auto now = SteadyClock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!only_expired || it->second.deadline <= now) {
        failed.push_back(std::move(it->second.done));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& done : failed) done(why);
}

void UcxDataPlane::OnTick() {
  if (ep_ != nullptr && ep_->failed()) {
    FailPending(absl::UnavailableError(absl::StrCat("UCX: ", ep_->error().message())), false);
    return;
  }
  const auto now = SteadyClock::now();
  bool expired = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, p] : pending_) expired = expired || p.deadline <= now;
    if (expired && !timed_out_.load()) {
      timed_out_why_ = "UCX: a call got no reply from the daemon in time, so this data plane "
                       "is no longer used";
      timed_out_.store(true);
    }
  }
  if (!expired) return;
  FailPending(absl::DeadlineExceededError(absl::StrCat(
                  "UCX: no reply from the daemon within ", absl::FormatDuration(options_.timeout))),
              /*only_expired=*/true);
}

void UcxDataPlane::OnReply(std::string header, std::string payload, size_t oversize) {
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(header)) return;
  if (oversize > 0) {
    Complete(h.request_id(),
             absl::ResourceExhaustedError(absl::StrCat(
                 "UCX: the daemon's ", oversize, "-byte reply exceeds this client's limit (",
                 options_.max_reply_bytes, " bytes)")));
    return;
  }
  Reply r;
  r.code = h.code();
  r.payload = std::move(payload);
  r.connection_key = h.connection_key();
  Complete(h.request_id(), std::move(r));
}

void UcxDataPlane::Dispatch(unsigned am_id, const std::function<std::string(uint64_t)>& header,
                            std::string payload, Iov iov, absl::Duration timeout,
                            Callback<Reply> done) {
  if (ep_ == nullptr) {
    done(absl::FailedPreconditionError("UCX: not connected"));
    return;
  }
  if (failed()) {
    done(absl::UnavailableError(failure()));
    return;
  }
  const uint64_t id = next_id_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_[id] = Pending{std::move(done), SteadyClock::now() + absl::ToChronoMilliseconds(timeout)};
  }
  UcxDataPlane* self = this;
  const bool posted = loop_->Post([self, id, am_id, hdr = header(id), payload = std::move(payload),
                                   iov = std::move(iov)]() mutable {
    size_t total = 0;
    for (const auto& part : iov) total += part.second;
    // An iov send needs at least one non-empty part; a bodiless message goes plainly.
    absl::Status st =
        total == 0
            ? self->loop_->Send(self->ep_->get(), am_id, std::move(hdr), std::move(payload))
            : self->loop_->SendIov(self->ep_->get(), am_id, std::move(hdr), std::move(iov));
    if (!st.ok()) self->Complete(id, st);
  });
  if (!posted) Complete(id, absl::UnavailableError("UCX: the progress thread has stopped"));
}

void UcxDataPlane::CallAsync(unsigned am_id, const std::string& token, const std::string& key,
                             std::string payload, const v1::DataPlaneHeader* extra, Iov iov,
                             Callback<Reply> done) {
  auto header = [&](uint64_t id) {
    v1::DataPlaneHeader h;
    if (extra != nullptr) h = *extra;
    h.set_request_id(id);
    if (!token.empty()) h.set_admission_token(token);
    if (!key.empty()) h.set_connection_key(key);
    return h.SerializeAsString();
  };
  const absl::Duration timeout =
      am_id == ucx::kHello ? std::min(options_.timeout, options_.connect_timeout) : options_.timeout;
  Dispatch(am_id, header, std::move(payload), std::move(iov), timeout, std::move(done));
}

absl::StatusOr<UcxDataPlane::Reply> UcxDataPlane::Call(unsigned am_id, const std::string& token,
                                                       const std::string& key,
                                                       std::string payload,
                                                       const v1::DataPlaneHeader* extra, Iov iov) {
  auto p = std::make_shared<std::promise<absl::StatusOr<Reply>>>();
  auto f = p->get_future();
  CallAsync(am_id, token, key, std::move(payload), extra, std::move(iov),
            [p](absl::StatusOr<Reply> r) { p->set_value(std::move(r)); });
  return f.get();
}

// --- Decode -------------------------------------------------------------------------------

namespace {

// A request tensor as a frame tensor: [rows, cols] whose bytes match its shape (the frame
// carries no separate length), or absent.
absl::StatusOr<frame::TensorRef> FrameTensorOf(const v1::Tensor& t, const std::string& what) {
  frame::TensorRef r;
  if (t.shape_size() == 0 && t.data().empty()) return r;
  const size_t eb = frame::ElementBytes(static_cast<uint8_t>(t.dtype()));
  if (t.shape_size() != 2 || t.shape(0) < 0 || t.shape(1) < 0 || t.shape(0) > UINT32_MAX ||
      t.shape(1) > UINT32_MAX || eb == 0 || t.has_cuda_ipc()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " must be an inline 2-D tensor of BF16, FP16, FP32 or INT32 (shape has ",
        t.shape_size(), " dimensions, dtype ", v1::DType_Name(t.dtype()), ")"));
  }
  r.dtype = static_cast<uint8_t>(t.dtype());
  r.rows = static_cast<uint32_t>(t.shape(0));
  r.cols = static_cast<uint32_t>(t.shape(1));
  if (t.data().size() != uint64_t{r.rows} * r.cols * eb) {
    return absl::InvalidArgumentError(absl::StrCat(what, ".data must hold ",
                                                   uint64_t{r.rows} * r.cols * eb, " bytes for shape [",
                                                   r.rows, ", ", r.cols, "], got ", t.data().size()));
  }
  r.data = t.data();
  return r;
}

// The frame body of a request's queries: each query's attachment id and its tensors, as
// `fields(query, &entry)` lists them (the request's tensor, the entry's slot for it, a name
// for errors; it may set the entry's other fields).
template <typename Q, typename Fields>
absl::StatusOr<std::string> FrameBody(const google::protobuf::RepeatedPtrField<Q>& queries,
                                      Fields fields) {
  std::string body;
  for (int i = 0; i < queries.size(); ++i) {
    frame::QueryRef ref;
    ref.attachment_id = queries[i].attachment_id();
    for (const auto& [tensor, slot, name] : fields(queries[i], &ref)) {
      auto t = FrameTensorOf(*tensor, absl::StrCat("queries[", i, "].", name));
      if (!t.ok()) return t.status();
      *slot = *t;
    }
    frame::AppendQuery(ref, &body);
  }
  return body;
}

using FrameTensors = std::vector<std::tuple<const v1::Tensor*, frame::TensorRef*, const char*>>;

absl::StatusOr<std::string> SelectBody(const v1::SelectAndReconstructRequest& req) {
  return FrameBody(req.queries(), [](const v1::SelectQuery& q, frame::QueryRef* ref) {
    ref->stage = q.has_stage_token_id();
    ref->stage_token_id = q.stage_token_id();
    ref->hold = q.stage_hold();
    // An unknown purpose travels as 3, which the daemon refuses (INVALID_ARGUMENT).
    ref->purpose = v1::SelectPurpose_IsValid(q.purpose()) ? static_cast<uint8_t>(q.purpose()) : 3;
    return FrameTensors{{&q.q(), &ref->q, "q"},
                        {&q.chunks(), &ref->chunks, "chunks"},
                        {&q.k_new(), &ref->k_new, "k_new"},
                        {&q.v_new(), &ref->v_new, "v_new"}};
  });
}

absl::StatusOr<std::string> AttendBody(const v1::AttendRequest& req) {
  return FrameBody(req.queries(), [](const v1::AttendQuery& q, frame::QueryRef* ref) {
    ref->stage = q.has_stage_token_id();
    ref->stage_token_id = q.stage_token_id();
    ref->hold = q.stage_hold();
    return FrameTensors{{&q.q(), &ref->q, "q"},
                        {&q.k_new(), &ref->k_new, "k_new"},
                        {&q.v_new(), &ref->v_new, "v_new"}};
  });
}

void SetTensor(v1::Tensor* t, v1::DType dtype, std::initializer_list<int64_t> shape,
               std::string_view data) {
  for (int64_t d : shape) t->add_shape(d);
  t->set_dtype(dtype);
  t->set_data(data.data(), data.size());
}

absl::StatusOr<v1::SelectAndReconstructResponse> SelectReply(
    const absl::StatusOr<UcxDataPlane::Reply>& r, const v1::SelectAndReconstructRequest& req) {
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  if (r->count != static_cast<uint32_t>(req.queries_size())) {
    return absl::InternalError(absl::StrCat("UCX SelectAndReconstruct: the reply has ", r->count,
                                            " deltas for ", req.queries_size(), " queries"));
  }
  auto deltas = frame::ParseDeltas(r->payload, r->count);
  if (!deltas.ok()) return absl::InternalError(deltas.status().message());
  v1::SelectAndReconstructResponse resp;
  for (size_t i = 0; i < deltas->size(); ++i) {
    const frame::Delta& d = (*deltas)[i];
    v1::SlotDelta* out = resp.add_deltas();
    out->set_attachment_id(req.queries(static_cast<int>(i)).attachment_id());
    out->mutable_head()->Add(d.head.begin(), d.head.end());
    out->mutable_slot()->Add(d.slot.begin(), d.slot.end());
    out->mutable_chunk()->Add(d.chunk.begin(), d.chunk.end());
    out->mutable_position()->Add(d.position.begin(), d.position.end());
    const int64_t m = static_cast<int64_t>(d.head.size());
    SetTensor(out->mutable_keys(), v1::DTYPE_BF16, {m, d.chunk_size, d.head_dim}, d.keys);
    SetTensor(out->mutable_values(), v1::DTYPE_BF16, {m, d.chunk_size, d.head_dim}, d.values);
    out->set_slot_tokens(d.chunk_size);
    out->set_delivered(d.delivered);
    out->set_fallback(d.fallback);
    out->set_tokens(d.tokens);
    out->set_selected(d.selected);
    out->set_hits(d.hits);
  }
  return resp;
}

absl::StatusOr<v1::AttendResponse> AttendReply(const absl::StatusOr<UcxDataPlane::Reply>& r,
                                               const v1::AttendRequest& req) {
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  if (r->count != static_cast<uint32_t>(req.queries_size())) {
    return absl::InternalError(absl::StrCat("UCX Attend: the reply has ", r->count,
                                            " outputs for ", req.queries_size(), " queries"));
  }
  auto outs = frame::ParseOutputs(r->payload, r->count);
  if (!outs.ok()) return absl::InternalError(outs.status().message());
  v1::AttendResponse resp;
  for (const frame::OutputRef& o : *outs) {
    SetTensor(resp.add_outputs(), v1::DTYPE_FP32, {o.query_heads, o.head_dim}, o.output);
    SetTensor(resp.add_lse(), v1::DTYPE_FP32, {o.query_heads}, o.lse);
    resp.add_tokens(o.tokens);
  }
  return resp;
}

}  // namespace

template <typename Req, typename Resp>
void UcxDataPlane::DecodeAsync(frame::Kind kind, const Req& req, absl::StatusOr<std::string> body,
                               absl::StatusOr<Resp> (*parse)(const absl::StatusOr<Reply>&, const Req&),
                               Callback<Resp> done) {
  if (!body.ok()) {
    done(body.status());
    return;
  }
  CallFrameAsync(kind, key_, req.layer(), req.queries_size(), *std::move(body),
                 [req, parse, done = std::move(done)](absl::StatusOr<Reply> r) { done(parse(r, req)); });
}

template <typename T>
absl::StatusOr<T> UcxDataPlane::Await(const std::function<void(Callback<T>)>& start) {
  auto p = std::make_shared<std::promise<absl::StatusOr<T>>>();
  auto f = p->get_future();
  start([p](absl::StatusOr<T> r) { p->set_value(std::move(r)); });
  // Spin on the reply for up to busy_poll before blocking (a blocked wait costs a wake-up).
  const auto spin_until = SteadyClock::now() + absl::ToChronoMicroseconds(options_.busy_poll);
  while (SteadyClock::now() < spin_until &&
         f.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
  }
  return f.get();
}

void UcxDataPlane::SelectAndReconstructAsync(const v1::SelectAndReconstructRequest& req,
                                             Callback<v1::SelectAndReconstructResponse> done) {
  DecodeAsync(frame::kSelect, req, SelectBody(req), &SelectReply, std::move(done));
}

absl::StatusOr<v1::SelectAndReconstructResponse> UcxDataPlane::SelectAndReconstruct(
    const v1::SelectAndReconstructRequest& req) {
  return Await<v1::SelectAndReconstructResponse>(
      [&](Callback<v1::SelectAndReconstructResponse> done) { SelectAndReconstructAsync(req, std::move(done)); });
}

void UcxDataPlane::AttendAsync(const v1::AttendRequest& req, Callback<v1::AttendResponse> done) {
  DecodeAsync(frame::kAttend, req, AttendBody(req), &AttendReply, std::move(done));
}

absl::StatusOr<v1::AttendResponse> UcxDataPlane::Attend(const v1::AttendRequest& req) {
  return Await<v1::AttendResponse>(
      [&](Callback<v1::AttendResponse> done) { AttendAsync(req, std::move(done)); });
}

void UcxDataPlane::CallFrameAsync(frame::Kind kind, const std::string& key, uint32_t layer,
                                  uint32_t count, std::string body, Callback<Reply> done) {
  auto header = [&](uint64_t id) {
    frame::FrameHeader h;
    h.kind = kind;
    h.request_id = id;
    h.key = key;
    h.layer = layer;
    h.count = count;
    return frame::EncodeHeader(h);
  };
  Dispatch(kind == frame::kSelect ? ucx::kSelectFrame : ucx::kAttendFrame, header, std::move(body), {},
           options_.timeout, std::move(done));
}

absl::StatusOr<std::string> UcxDataPlane::RawFrameRequest(frame::Kind kind, const std::string& key,
                                                          uint32_t layer, uint32_t count,
                                                          std::string body) {
  auto r = Await<Reply>([&](Callback<Reply> done) {
    CallFrameAsync(kind, key, layer, count, std::move(body), std::move(done));
  });
  if (!r.ok()) return r.status();
  if (r->code != 0) return absl::Status(static_cast<absl::StatusCode>(r->code), r->payload);
  return std::move(r->payload);
}

void UcxDataPlane::OnFrameReply(std::string header, std::string payload, size_t oversize) {
  auto h = frame::DecodeHeader(header);
  if (!h.ok() || h->kind != frame::kReply) return;
  if (oversize > 0) {
    Complete(h->request_id,
             absl::ResourceExhaustedError(absl::StrCat(
                 "UCX: the daemon's ", oversize, "-byte reply exceeds this client's limit (",
                 options_.max_reply_bytes, " bytes)")));
    return;
  }
  Reply r;
  r.code = h->code;
  r.count = h->count;
  r.payload = std::move(payload);
  Complete(h->request_id, std::move(r));
}

// --- Append -------------------------------------------------------------------------------

absl::StatusOr<v1::AppendTokensResponse> UcxDataPlane::AppendTokens(
    const v1::AppendTokensRequest& req) {
  // The body is the request without tensor bytes; the bytes are the payload (frame.h).
  v1::DataPlaneHeader extra;
  Iov iov = transport::FrameWriter::Frame(req, &extra);
  auto r = Call(ucx::kAppend, "", key_, "", &extra, std::move(iov));
  if (absl::Status st = ReplyStatus(r); !st.ok()) return st;
  return ParseReply<v1::AppendTokensResponse>(r->payload, "AppendTokens");
}

// --- Ingest -------------------------------------------------------------------------------

void UcxDataPlane::IngestMessageAsync(uint64_t stream, const v1::IngestRequest& msg,
                                      Callback<std::string> done) {
  // The body is the message without tensor bytes; the bytes are the payload (frame.h).
  v1::DataPlaneHeader extra;
  extra.set_stream_id(stream);
  Iov iov = transport::FrameWriter::Frame(msg, &extra);
  extra.set_sequence(NextSequence(stream, msg.has_commit()));
  CallAsync(ucx::kIngest, "", key_, "", &extra, std::move(iov),
            [done = std::move(done)](absl::StatusOr<Reply> r) {
              if (absl::Status st = ReplyStatus(r); !st.ok()) {
                done(st);
                return;
              }
              done(std::move(r->payload));
            });
}

uint64_t UcxDataPlane::NextSequence(uint64_t stream, bool ends) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ingest_sequence_.try_emplace(stream, 0).first;
  const uint64_t seq = it->second++;
  if (ends) ingest_sequence_.erase(it);  // the daemon starts counting afresh too
  return seq;
}

absl::StatusOr<std::string> UcxDataPlane::IngestMessage(const v1::IngestRequest& msg,
                                                        uint64_t stream) {
  auto p = std::make_shared<std::promise<absl::StatusOr<std::string>>>();
  auto f = p->get_future();
  IngestMessageAsync(stream, msg, [p](absl::StatusOr<std::string> r) { p->set_value(std::move(r)); });
  return f.get();
}

absl::Status UcxDataPlane::CancelIngest(uint64_t stream) {
  v1::DataPlaneHeader extra;
  extra.set_stream_id(stream);
  extra.set_cancel(true);
  extra.set_sequence(NextSequence(stream, /*ends=*/true));
  auto r = Call(ucx::kIngest, "", key_, "", &extra);
  return ReplyStatus(r);
}

absl::StatusOr<v1::IngestResponse> UcxDataPlane::Ingest(
    absl::Span<const v1::IngestRequest> messages) {
  if (messages.empty() || !messages.front().has_header()) {
    return absl::InvalidArgumentError("UCX Ingest: the first message must be the header");
  }
  if (!messages.back().has_commit()) {
    return absl::InvalidArgumentError(
        "UCX Ingest: the stream must end with an IngestCommit; nothing was sent");
  }
  const uint64_t stream = NewIngestStream();
  const size_t window = static_cast<size_t>(std::max(1, options_.ingest_window));
  std::deque<std::future<absl::StatusOr<std::string>>> inflight;
  absl::Status first_error;
  std::string last;
  // Replies come in stream order (the daemon runs a connection's messages in order), so
  // the first error met here is the stream's first error; later ones only echo it.
  auto retire_one = [&] {
    absl::StatusOr<std::string> r = inflight.front().get();
    inflight.pop_front();
    if (!r.ok()) {
      if (first_error.ok()) first_error = r.status();
    } else {
      last = *std::move(r);
    }
  };
  for (const auto& m : messages) {
    while (inflight.size() >= window) retire_one();
    if (!first_error.ok()) break;
    auto p = std::make_shared<std::promise<absl::StatusOr<std::string>>>();
    inflight.push_back(p->get_future());
    IngestMessageAsync(stream, m, [p](absl::StatusOr<std::string> r) { p->set_value(std::move(r)); });
  }
  // Every message's buffers stay valid until its reply: wait for all of them.
  while (!inflight.empty()) retire_one();
  if (!first_error.ok()) {
    if (!failed()) (void)CancelIngest(stream);  // forget the failed stream's state
    return first_error;
  }
  v1::IngestResponse resp;
  if (!resp.ParseFromString(last)) return absl::InternalError("UCX Ingest: the reply does not parse");
  return resp;
}

// --- RMA slot buffers ---------------------------------------------------------------------

absl::Status UcxDataPlane::RegisterSlotBuffers(const std::string& attachment_id, void* k,
                                               void* v, size_t bytes) {
  if (attachment_id.empty()) {
    return absl::InvalidArgumentError("RegisterSlotBuffers: attachment_id is empty");
  }
  if (k == nullptr || v == nullptr || bytes == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RegisterSlotBuffers: need non-null K and V buffers of > 0 bytes, got ", bytes, " bytes"));
  }
  auto bufs = std::make_shared<std::unique_ptr<SlotBuffers>>(std::make_unique<SlotBuffers>());
  v1::UcxSlotBuffers msg;
  UcxDataPlane* self = this;
  absl::Status st = loop_->CallStatus([&]() -> absl::Status {
    auto mk = ucx::UcxMemHandle::Map(self->loop_->context(), k, bytes);
    if (!mk.ok()) return mk.status();
    auto mv = ucx::UcxMemHandle::Map(self->loop_->context(), v, bytes);
    if (!mv.ok()) return mv.status();
    auto pk = (*mk)->PackRkey();
    if (!pk.ok()) return pk.status();
    auto pv = (*mv)->PackRkey();
    if (!pv.ok()) return pv.status();
    msg.set_attachment_id(attachment_id);
    msg.set_k_address((*mk)->address());
    msg.set_k_rkey(*std::move(pk));
    msg.set_v_address((*mv)->address());
    msg.set_v_rkey(*std::move(pv));
    msg.set_bytes(bytes);
    (*bufs)->k = *std::move(mk);
    (*bufs)->v = *std::move(mv);
    return absl::OkStatus();
  });
  if (st.ok()) {
    auto r = Call(ucx::kRegister, "", key_, msg.SerializeAsString());
    st = ReplyStatus(r);
  }
  // Keep the handles on success (replacing an earlier registration: the daemon answered
  // after its last put into those), else release them; on the loop thread either way.
  const bool keep = st.ok();
  (void)loop_->CallStatus([&]() -> absl::Status {
    if (keep) {
      self->slot_buffers_[attachment_id] = std::move(*bufs);
    } else {
      bufs->reset();
    }
    return absl::OkStatus();
  });
  if (keep) {
    std::lock_guard<std::mutex> lock(mu_);
    registered_[attachment_id] = true;
  }
  return st;
}

absl::Status UcxDataPlane::UnregisterSlotBuffers(const std::string& attachment_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_.contains(attachment_id)) return absl::OkStatus();
  }
  v1::UcxSlotBuffers msg;
  msg.set_attachment_id(attachment_id);
  auto r = Call(ucx::kUnregister, "", key_, msg.SerializeAsString());
  const absl::Status st = ReplyStatus(r);
  UcxDataPlane* self = this;
  (void)loop_->CallStatus([&]() -> absl::Status {
    self->slot_buffers_.erase(attachment_id);
    return absl::OkStatus();
  });
  std::lock_guard<std::mutex> lock(mu_);
  registered_.erase(attachment_id);
  return st;
}

bool UcxDataPlane::HasSlotBuffers(const std::string& attachment_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return registered_.contains(attachment_id);
}

absl::StatusOr<std::string> UcxDataPlane::RawRequest(unsigned am_id,
                                                     const std::string& connection_key,
                                                     const std::string& payload) {
  auto r = Call(am_id, "", connection_key, payload);
  if (absl::Status st = ReplyStatus(r); !st.ok()) return st;
  return r->payload;
}



}  // namespace kvshade::client

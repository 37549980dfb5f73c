// kvshade C++ client: channel set-up (credentials, message limits), the typed RPC wrappers,
// the grpc.health.v1 check (over a generic stub with the two tiny health messages encoded
// by hand, so the client needs no health .proto of its own), the Ingest writer, async
// decode calls, and the routing of data calls to the UCX data plane with loud fallback.
#include "kvshade/client/client.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <future>
#include <sstream>
#include <thread>

#include <grpcpp/generic/generic_stub.h>

#include "absl/strings/str_cat.h"
#include "kvshade/base/file.h"
#include "kvshade/client/tensor.h"

namespace kvshade::client {
namespace {

// Protobuf varint of a HealthCheckResponse.status (field 1). Unknown fields skipped.
HealthStatus ParseHealthResponse(const std::string& bytes) {
  size_t i = 0;
  auto varint = [&](uint64_t* out) {
    uint64_t v = 0;
    for (int shift = 0; i < bytes.size() && shift < 64; shift += 7) {
      const uint8_t b = static_cast<uint8_t>(bytes[i++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) {
        *out = v;
        return true;
      }
    }
    return false;
  };
  uint64_t status = 0;
  while (i < bytes.size()) {
    uint64_t tag = 0;
    if (!varint(&tag)) break;
    const int wire = static_cast<int>(tag & 7);
    if (tag >> 3 == 1 && wire == 0) {
      if (!varint(&status)) break;
    } else if (wire == 0) {
      uint64_t skip;
      if (!varint(&skip)) break;
    } else if (wire == 2) {
      uint64_t len;
      if (!varint(&len) || len > bytes.size() - i) break;
      i += len;
    } else {
      break;
    }
  }
  return status <= 3 ? static_cast<HealthStatus>(status) : HealthStatus::kUnknown;
}

std::string EncodeHealthRequest(const std::string& service) {
  if (service.empty()) return "";
  std::string out(1, '\x0a');
  size_t n = service.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + service;
}

}  // namespace

std::string_view HealthStatusName(HealthStatus s) {
  switch (s) {
    case HealthStatus::kServing: return "SERVING";
    case HealthStatus::kNotServing: return "NOT_SERVING";
    case HealthStatus::kServiceUnknown: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.error_code())),
                      s.error_message());
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.target.empty()) return absl::InvalidArgumentError("target must not be empty");
  std::unique_ptr<Client> c(new Client());
  c->options_ = options;
  grpc::ChannelArguments args;
  const int max_msg = static_cast<int>(std::min<uint64_t>(options.max_message_bytes, INT32_MAX));
  args.SetMaxReceiveMessageSize(max_msg);
  args.SetMaxSendMessageSize(max_msg);
  std::shared_ptr<grpc::ChannelCredentials> creds;
  if (options.tls || !options.ca_file.empty() || !options.cert_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    if (!options.ca_file.empty()) {
      auto ca = base::ReadFile(options.ca_file, "CA file");
      if (!ca.ok()) return ca.status();
      ssl.pem_root_certs = *ca;
    }
    if (options.cert_file.empty() != options.key_file.empty()) {
      return absl::InvalidArgumentError("client cert_file and key_file must be given together");
    }
    if (!options.cert_file.empty()) {
      auto cert = base::ReadFile(options.cert_file, "client certificate");
      if (!cert.ok()) return cert.status();
      auto key = base::ReadFile(options.key_file, "client key");
      if (!key.ok()) return key.status();
      ssl.pem_cert_chain = *cert;
      ssl.pem_private_key = *key;
    }
    if (!options.tls_server_name.empty()) args.SetSslTargetNameOverride(options.tls_server_name);
    creds = grpc::SslCredentials(ssl);
  } else {
    creds = grpc::InsecureChannelCredentials();
  }
  c->channel_ = grpc::CreateCustomChannel(options.target, creds, args);
  c->stub_ = v1::KvShade::NewStub(c->channel_);
  c->generic_ = std::make_unique<grpc::GenericStub>(c->channel_);
  return c;
}

std::unique_ptr<grpc::ClientContext> Client::NewContext(absl::Duration timeout) const {
  auto ctx = std::make_unique<grpc::ClientContext>();
  const absl::Duration t = timeout == absl::ZeroDuration() ? options_.timeout : timeout;
  if (t != absl::InfiniteDuration()) {
    ctx->set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(t));
  }
  if (!options_.bearer_token.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
  }
  return ctx;
}

template <typename Req, typename Resp, typename Method>
absl::StatusOr<Resp> Client::Unary(Method method, const Req& req) {
  auto ctx = NewContext();
  Resp resp;
  grpc::Status s = ((*stub_).*method)(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<v1::CreateSessionResponse> Client::CreateSession(const v1::CreateSessionRequest& req) {
  return Unary<v1::CreateSessionRequest, v1::CreateSessionResponse>(&v1::KvShade::Stub::CreateSession, req);
}

absl::StatusOr<v1::CreateSessionResponse> Client::CreateTensorParallelRank(
    v1::CreateSessionRequest req, uint32_t ranks, uint32_t rank, uint32_t kv_head_begin,
    uint32_t kv_head_end, const std::string& join) {
  v1::TensorParallel* tp = req.mutable_tensor_parallel();
  tp->set_ranks(ranks);
  tp->set_rank(rank);
  tp->set_kv_head_begin(kv_head_begin);
  tp->set_kv_head_end(kv_head_end);
  tp->set_session_id(join);
  return CreateSession(req);
}

absl::StatusOr<std::vector<v1::TensorParallelShard>> Client::TensorParallelShards(
    const std::string& session_id) {
  auto info = GetSession(session_id);
  if (!info.ok()) return info.status();
  if (!info->has_tensor_parallel() || info->tensor_parallel().session_id() != info->session_id()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "session '", info->session_id(), "' is not a tensor-parallel logical session"));
  }
  return std::vector<v1::TensorParallelShard>(info->tensor_parallel().shards().begin(),
                                              info->tensor_parallel().shards().end());
}

absl::StatusOr<v1::ForkSessionResponse> Client::ForkSession(const std::string& parent,
                                                            uint64_t at_token) {
  v1::ForkSessionRequest req;
  req.set_parent_session_id(parent);
  req.set_at_token(at_token);
  return Unary<v1::ForkSessionRequest, v1::ForkSessionResponse>(&v1::KvShade::Stub::ForkSession, req);
}

absl::StatusOr<v1::LookupPrefixResponse> Client::LookupPrefix(const v1::LookupPrefixRequest& req) {
  return Unary<v1::LookupPrefixRequest, v1::LookupPrefixResponse>(&v1::KvShade::Stub::LookupPrefix, req);
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const std::string& session_id,
                                                  bool include_selection) {
  v1::GetSessionRequest req;
  req.set_session_id(session_id);
  req.set_include_selection(include_selection);
  return GetSession(req);
}

absl::StatusOr<v1::SessionInfo> Client::GetSession(const v1::GetSessionRequest& req) {
  return Unary<v1::GetSessionRequest, v1::SessionInfo>(&v1::KvShade::Stub::GetSession, req);
}

absl::StatusOr<v1::ListSessionsResponse> Client::ListSessions() {
  return Unary<v1::ListSessionsRequest, v1::ListSessionsResponse>(&v1::KvShade::Stub::ListSessions,
                                                                  v1::ListSessionsRequest());
}

absl::Status Client::CloseSession(const std::string& session_id) {
  v1::CloseSessionRequest req;
  req.set_session_id(session_id);
  return Unary<v1::CloseSessionRequest, v1::CloseSessionResponse>(&v1::KvShade::Stub::CloseSession, req)
      .status();
}

namespace {

// A UCX call whose reply never came (DEADLINE_EXCEEDED from the data plane): the daemon
// may or may not have run it. A select advances the attachment's slot table, an append
// adds tokens, so resending it over gRPC could apply it twice; the call fails instead.
bool TimedOut(const absl::Status& st) { return st.code() == absl::StatusCode::kDeadlineExceeded; }

absl::Status TimedOutOverUcx(std::string_view method, const absl::Status& st) {
  return absl::UnavailableError(absl::StrCat(
      std::string(method), " over UCX got no reply (", std::string(st.message()),
      "); the daemon may have applied it, so it is not sent again; later calls go over gRPC"));
}

}  // namespace

absl::StatusOr<v1::IngestResponse> Client::Ingest(absl::Span<const v1::IngestRequest> messages) {
  if (options_.use_ucx && !messages.empty() && messages.front().has_header()) {
    if (auto dp = UcxForSession(messages.front().header().session_id()); dp != nullptr) {
      auto r = dp->Ingest(messages);
      if (r.ok() || !dp->failed()) return r;
      // The daemon discards a stream whose client vanished: send it again over gRPC.
      DropUcx(dp.get(), r.status());
    }
  }
  auto ctx = NewContext();
  v1::IngestResponse resp;
  auto writer = stub_->Ingest(ctx.get(), &resp);
  for (const auto& m : messages) {
    // A failed write means the server already ended the call; Finish() has the reason.
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpc(s);
  return resp;
}

absl::StatusOr<std::unique_ptr<IngestWriter>> Client::StartIngest(const std::string& session_id) {
  std::unique_ptr<IngestWriter> w(new IngestWriter());
  v1::IngestRequest header;
  header.mutable_header()->set_session_id(session_id);
  if (auto dp = UcxForSession(session_id); dp != nullptr) {
    w->ucx_ = dp;
    w->stream_ = dp->NewIngestStream();
    w->window_ = static_cast<size_t>(std::max(1, options_.ucx_ingest_window));
    // The header goes synchronously, so that an unknown session fails here as on gRPC.
    auto r = dp->IngestMessage(header, w->stream_);
    if (r.ok()) return w;
    w->done_ = true;
    if (!dp->failed()) {
      (void)dp->CancelIngest(w->stream_);
      return r.status();
    }
    DropUcx(dp.get(), r.status());
    w = std::unique_ptr<IngestWriter>(new IngestWriter());  // gRPC instead
  }
  w->ctx_ = NewContext();
  w->response_ = std::make_unique<v1::IngestResponse>();
  w->writer_ = stub_->Ingest(w->ctx_.get(), w->response_.get());
  if (!w->writer_->Write(header)) {
    w->done_ = true;
    w->writer_->WritesDone();
    return FromGrpc(w->writer_->Finish());
  }
  return w;
}

absl::StatusOr<v1::AppendTokensResponse> Client::AppendTokens(const v1::AppendTokensRequest& req) {
  if (auto dp = UcxForSession(req.session_id()); dp != nullptr) {
    auto r = dp->AppendTokens(req);
    if (r.ok() || !dp->failed()) return r;
    // Not sent again: the daemon may have applied it before the endpoint died.
    DropUcx(dp.get(), r.status());
    if (TimedOut(r.status())) return TimedOutOverUcx("AppendTokens", r.status());
    return r;
  }
  return Unary<v1::AppendTokensRequest, v1::AppendTokensResponse>(&v1::KvShade::Stub::AppendTokens, req);
}

absl::StatusOr<v1::AttachResponse> Client::Attach(const v1::AttachRequest& req) {
  auto r = Unary<v1::AttachRequest, v1::AttachResponse>(&v1::KvShade::Stub::Attach, req);
  if (!r.ok() || !options_.use_ucx) return r;
  std::lock_guard<std::mutex> lock(ucx_mu_);
  if (ucx_ != nullptr || ucx_tried_) return r;
  ucx_tried_ = true;
  if (r->data_plane_address().empty()) {
    UcxFallback(absl::UnavailableError("the daemon offers no UCX data plane (ucx.enable off)"));
    return r;
  }
  UcxOptions o;
  o.transports = options_.ucx_transports;
  o.timeout = options_.timeout;
  o.ingest_window = options_.ucx_ingest_window;
  o.busy_poll = absl::Microseconds(std::max(0, options_.ucx_busy_poll_us));
  o.max_reply_bytes = options_.max_message_bytes;
  auto dp = UcxDataPlane::Connect(r->data_plane_address(), r->data_plane_token(), o);
  if (!dp.ok()) {
    UcxFallback(dp.status());
  } else {
    ucx_ = *std::move(dp);
  }
  return r;
}

bool Client::ucx_connected() const {
  std::lock_guard<std::mutex> lock(ucx_mu_);
  return ucx_ != nullptr && !ucx_->failed();
}

void Client::UcxFallback(const absl::Status& why) {
  ucx_fallbacks_.fetch_add(1);
  std::fprintf(stderr, "kvshade client: UCX data plane unavailable, falling back to gRPC inline: %s\n",
               std::string(why.message()).c_str());
}

std::shared_ptr<UcxDataPlane> Client::Ucx() {
  std::vector<std::shared_ptr<UcxDataPlane>> retired;
  std::shared_ptr<UcxDataPlane> dp;
  absl::Status why;
  {
    std::lock_guard<std::mutex> lock(ucx_mu_);
    retired.swap(ucx_retired_);
    if (ucx_ != nullptr && ucx_->failed()) {
      why = absl::UnavailableError(ucx_->failure());
      retired.push_back(std::move(ucx_));
      ucx_.reset();
    }
    dp = ucx_;
  }
  if (!why.ok()) UcxFallback(why);
  return dp;  // `retired` is destroyed here, on this caller's thread, outside the lock
}

std::shared_ptr<UcxDataPlane> Client::UcxForSession(const std::string& session_id) {
  if (!options_.use_ucx) return nullptr;
  bool connect = false;
  {
    std::lock_guard<std::mutex> lock(ucx_mu_);
    connect = ucx_ == nullptr && !ucx_tried_ && !session_id.empty();
  }
  if (!connect) return Ucx();
  // Only Attach hands out admission tokens: attach to the session (which connects the
  // data plane, or falls back loudly), then let the attachment go.
  v1::AttachRequest ar;
  ar.set_session_id(session_id);
  ar.set_worker_id("kvshade-client/ucx-connect");
  auto a = Attach(ar);
  if (a.ok()) (void)Detach(a->attachment_id());
  return Ucx();
}

void Client::DropUcx(const UcxDataPlane* dp, const absl::Status& why) {
  {
    std::lock_guard<std::mutex> lock(ucx_mu_);
    if (ucx_ == nullptr || ucx_.get() != dp) return;  // dropped already
    ucx_retired_.push_back(std::move(ucx_));
    ucx_.reset();
  }
  UcxFallback(why);
}

absl::Status Client::RegisterSlotBuffers(const std::string& attachment_id, void* k, void* v,
                                         size_t bytes) {
  auto dp = Ucx();
  if (dp == nullptr) {
    return absl::FailedPreconditionError(
        "RegisterSlotBuffers needs the UCX data plane, and this client has none (use_ucx "
        "off, the daemon offers none, or it fell back to gRPC)");
  }
  return dp->RegisterSlotBuffers(attachment_id, k, v, bytes);
}

absl::Status Client::Detach(const std::string& attachment_id) {
  if (auto dp = Ucx(); dp != nullptr && dp->HasSlotBuffers(attachment_id)) {
    absl::Status st = dp->UnregisterSlotBuffers(attachment_id);
    if (!st.ok()) {
      std::fprintf(stderr, "kvshade client: unregistering the slot buffers of %s: %s\n",
                   attachment_id.c_str(), std::string(st.message()).c_str());
    }
  }
  v1::DetachRequest req;
  req.set_attachment_id(attachment_id);
  return Unary<v1::DetachRequest, v1::DetachResponse>(&v1::KvShade::Stub::Detach, req).status();
}

absl::StatusOr<v1::GetStaticSetResponse> Client::GetStaticSet(const std::string& attachment_id,
                                                              uint32_t layer) {
  v1::GetStaticSetRequest req;
  req.set_attachment_id(attachment_id);
  req.set_layer(layer);
  return Unary<v1::GetStaticSetRequest, v1::GetStaticSetResponse>(&v1::KvShade::Stub::GetStaticSet, req);
}

absl::StatusOr<uint64_t> Client::CommitStaged(const std::string& attachment_id, int32_t stage_token_id,
                                              bool discard) {
  v1::CommitStagedRequest req;
  req.set_attachment_id(attachment_id);
  req.set_stage_token_id(stage_token_id);
  req.set_discard(discard);
  auto r = Unary<v1::CommitStagedRequest, v1::CommitStagedResponse>(&v1::KvShade::Stub::CommitStaged, req);
  if (!r.ok()) return r.status();
  return r->tokens();
}

absl::StatusOr<v1::SlotTableResponse> Client::SlotTable(const std::string& attachment_id,
                                                        bool reset) {
  v1::SlotTableRequest req;
  req.set_attachment_id(attachment_id);
  req.set_reset(reset);
  return Unary<v1::SlotTableRequest, v1::SlotTableResponse>(&v1::KvShade::Stub::SlotTable, req);
}

absl::StatusOr<v1::SelectAndReconstructResponse> Client::SelectAndReconstruct(
    const v1::SelectAndReconstructRequest& req) {
  if (auto dp = Ucx(); dp != nullptr) {
    auto r = dp->SelectAndReconstruct(req);
    // Only a dead transport falls back; the daemon's own answers (bad request, unknown
    // attachment, ...) are returned as they are.
    if (r.ok() || !dp->failed()) return r;
    DropUcx(dp.get(), r.status());
    if (TimedOut(r.status())) return TimedOutOverUcx("SelectAndReconstruct", r.status());
  }
  return Unary<v1::SelectAndReconstructRequest, v1::SelectAndReconstructResponse>(
      &v1::KvShade::Stub::SelectAndReconstruct, req);
}

absl::StatusOr<v1::AttendResponse> Client::Attend(const v1::AttendRequest& req) {
  if (auto dp = Ucx(); dp != nullptr) {
    auto r = dp->Attend(req);
    if (r.ok() || !dp->failed()) return r;
    DropUcx(dp.get(), r.status());
    if (TimedOut(r.status())) return TimedOutOverUcx("Attend", r.status());
  }
  return Unary<v1::AttendRequest, v1::AttendResponse>(&v1::KvShade::Stub::Attend, req);
}

// --- Async decode calls ---------------------------------------------------------------

template <typename Req, typename Resp>
struct Client::AsyncCall {
  Req req;  // kept for a gRPC call (and a fallback to it)
  Resp resp;
  std::unique_ptr<grpc::ClientContext> ctx;
  std::promise<absl::StatusOr<Resp>> promise;
};

void Client::BeginAsync() {
  std::lock_guard<std::mutex> lock(async_mu_);
  ++async_inflight_;
}

void Client::EndAsync() {
  std::lock_guard<std::mutex> lock(async_mu_);
  if (--async_inflight_ == 0) async_cv_.notify_all();
}

template <typename Req, typename Resp, typename Start>
void Client::GrpcAsync(std::shared_ptr<AsyncCall<Req, Resp>> call, Start start) {
  BeginAsync();
  call->ctx = NewContext();
  start(stub_->async(), call->ctx.get(), &call->req, &call->resp, [this, call](grpc::Status s) {
    if (s.ok()) {
      call->promise.set_value(std::move(call->resp));
    } else {
      call->promise.set_value(FromGrpc(s));
    }
    EndAsync();
  });
}

template <typename Req, typename Resp, typename UcxStart, typename GrpcStart>
std::future<absl::StatusOr<Resp>> Client::DecodeAsync(const Req& req, UcxStart ucx_start,
                                                      GrpcStart grpc_start) {
  auto call = std::make_shared<AsyncCall<Req, Resp>>();
  call->req = req;
  auto fut = call->promise.get_future();
  auto dp = Ucx();
  if (dp == nullptr) {
    GrpcAsync(call, grpc_start);
    return fut;
  }
  BeginAsync();
  // Runs on the data plane's progress thread (or here, for an immediate failure): it
  // must not own `dp` (destroying it there would join that thread from itself).
  ucx_start(*dp, call->req,
            [this, call, raw = dp.get(), grpc_start](absl::StatusOr<Resp> r) {
              if (r.ok() || closing_.load() || !raw->failed()) {
                call->promise.set_value(std::move(r));
              } else if (TimedOut(r.status())) {
                DropUcx(raw, r.status());
                call->promise.set_value(TimedOutOverUcx("the async call", r.status()));
              } else {
                DropUcx(raw, r.status());
                GrpcAsync(call, grpc_start);
              }
              EndAsync();
            });
  return fut;
}

std::future<absl::StatusOr<v1::SelectAndReconstructResponse>> Client::SelectAndReconstructAsync(
    const v1::SelectAndReconstructRequest& req) {
  using Req = v1::SelectAndReconstructRequest;
  using Resp = v1::SelectAndReconstructResponse;
  return DecodeAsync<Req, Resp>(
      req,
      [](UcxDataPlane& dp, const Req& r, UcxDataPlane::Callback<Resp> done) {
        dp.SelectAndReconstructAsync(r, std::move(done));
      },
      [](auto* a, grpc::ClientContext* ctx, const Req* r, Resp* out,
         std::function<void(grpc::Status)> done) {
        a->SelectAndReconstruct(ctx, r, out, std::move(done));
      });
}

std::future<absl::StatusOr<v1::AttendResponse>> Client::AttendAsync(const v1::AttendRequest& req) {
  using Req = v1::AttendRequest;
  using Resp = v1::AttendResponse;
  return DecodeAsync<Req, Resp>(
      req,
      [](UcxDataPlane& dp, const Req& r, UcxDataPlane::Callback<Resp> done) {
        dp.AttendAsync(r, std::move(done));
      },
      [](auto* a, grpc::ClientContext* ctx, const Req* r, Resp* out,
         std::function<void(grpc::Status)> done) {
        a->Attend(ctx, r, out, std::move(done));
      });
}

Client::~Client() {
  closing_.store(true);
  std::shared_ptr<UcxDataPlane> dp;
  std::vector<std::shared_ptr<UcxDataPlane>> retired;
  {
    std::lock_guard<std::mutex> lock(ucx_mu_);
    dp = std::move(ucx_);
    retired.swap(ucx_retired_);
  }
  dp.reset();  // completes its outstanding calls (CANCELLED) unless a writer still holds it
  retired.clear();
  std::unique_lock<std::mutex> lock(async_mu_);
  async_cv_.wait(lock, [this] { return async_inflight_ == 0; });
}

absl::StatusOr<v1::SessionExport> Client::ExportSession(const v1::ExportSessionRequest& req) {
  return Unary<v1::ExportSessionRequest, v1::SessionExport>(&v1::KvShade::Stub::ExportSession, req);
}

absl::StatusOr<v1::StatsResponse> Client::Stats() {
  return Unary<v1::StatsRequest, v1::StatsResponse>(&v1::KvShade::Stub::Stats, v1::StatsRequest());
}

absl::StatusOr<HealthStatus> Client::CheckHealth(const std::string& service) {
  auto ctx = NewContext(std::min(options_.timeout, absl::Seconds(5)));
  const std::string req_bytes = EncodeHealthRequest(service);
  grpc::Slice slice(req_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::promise<grpc::Status> done;
  generic_->UnaryCall(ctx.get(), "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request,
                      &response, [&done](grpc::Status s) { done.set_value(std::move(s)); });
  grpc::Status s = done.get_future().get();
  if (!s.ok()) return FromGrpc(s);
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("cannot read health response");
  std::string bytes;
  for (const auto& sl : slices) bytes.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return ParseHealthResponse(bytes);
}

absl::Status Client::WaitForServing(absl::Duration deadline) {
  const absl::Time end = absl::Now() + deadline;
  absl::Duration backoff = absl::Milliseconds(10);
  std::string last = "no answer";
  while (true) {
    // Wait for the connection itself first, bounded by the overall deadline, so a server
    // that is still starting is not hammered.
    const absl::Time now = absl::Now();
    if (now >= end) break;
    channel_->WaitForConnected(absl::ToChronoTime(std::min(end, now + absl::Milliseconds(250))));
    auto h = CheckHealth();
    if (h.ok() && *h == HealthStatus::kServing) return absl::OkStatus();
    last = h.ok() ? std::string(HealthStatusName(*h)) : h.status().ToString();
    const absl::Duration left = end - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(std::min(backoff, left)));
    backoff = std::min(backoff * 2, absl::Milliseconds(200));
  }
  return absl::DeadlineExceededError(
      absl::StrCat("server at ", options_.target, " not SERVING within ", absl::FormatDuration(deadline),
                   " (last: ", last, ")"));
}

// --- IngestWriter ---------------------------------------------------------------------

IngestWriter::~IngestWriter() {
  if (ucx_ != nullptr) {
    if (!done_) {
      Drain(0);  // the parts in flight reference our copies
      if (!ucx_->failed()) (void)ucx_->CancelIngest(stream_);
    }
    return;
  }
  if (!done_ && ctx_) {
    ctx_->TryCancel();
    writer_->Finish();
  }
}

void IngestWriter::Drain(size_t keep) {
  while (inflight_.size() > keep) {
    absl::StatusOr<std::string> r = inflight_.front().reply.get();
    inflight_.pop_front();
    if (!r.ok()) {
      if (failed_.ok()) failed_ = r.status();
    } else {
      last_reply_ = *std::move(r);
    }
  }
}

absl::Status IngestWriter::Send(std::shared_ptr<v1::IngestRequest> msg) {
  if (done_) return absl::FailedPreconditionError("ingest stream already finished");
  bytes_sent_ += msg->ByteSizeLong();
  if (ucx_ == nullptr) {
    if (!writer_->Write(*msg)) {
      // The server ended the stream (bad part, unknown session, ...): its status says why.
      done_ = true;
      writer_->WritesDone();
      absl::Status s = FromGrpc(writer_->Finish());
      return s.ok() ? absl::AbortedError("ingest stream closed by the server") : s;
    }
    return absl::OkStatus();
  }
  Drain(window_ - 1);
  if (!failed_.ok()) return failed_;
  auto p = std::make_shared<std::promise<absl::StatusOr<std::string>>>();
  inflight_.push_back(InFlight{msg, p->get_future()});
  ucx_->IngestMessageAsync(stream_, *msg,
                           [p](absl::StatusOr<std::string> r) { p->set_value(std::move(r)); });
  return absl::OkStatus();
}

absl::Status IngestWriter::Write(const v1::IngestLayer& part) {
  auto req = std::make_shared<v1::IngestRequest>();
  *req->mutable_layer() = part;
  return Send(std::move(req));
}

absl::Status IngestWriter::WriteLayer(uint32_t layer, int64_t n, int h, int d,
                                      absl::Span<const uint16_t> k, absl::Span<const uint16_t> v,
                                      absl::Span<const uint16_t> obs, int64_t w, int hq,
                                      size_t max_part_bytes) {
  const int64_t row = static_cast<int64_t>(h) * d;
  if (n <= 0 || h <= 0 || d <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("WriteLayer: n, h, d must be > 0, got ", n, ", ", h, ", ", d));
  }
  if (static_cast<int64_t>(k.size()) != n * row || static_cast<int64_t>(v.size()) != n * row) {
    return absl::InvalidArgumentError(absl::StrCat("WriteLayer: k and v must hold n*h*d = ", n * row,
                                                   " elements, got ", k.size(), " and ", v.size()));
  }
  if (!obs.empty() && static_cast<int64_t>(obs.size()) != w * hq * d) {
    return absl::InvalidArgumentError(
        absl::StrCat("WriteLayer: observation queries must hold w*hq*d = ", w * hq * d, " elements"));
  }
  const int64_t tokens_per_part =
      std::max<int64_t>(1, static_cast<int64_t>(max_part_bytes) / (row * 2 * 2));
  for (int64_t t0 = 0; t0 < n; t0 += tokens_per_part) {
    const int64_t m = std::min(tokens_per_part, n - t0);
    auto req = std::make_shared<v1::IngestRequest>();
    v1::IngestLayer& part = *req->mutable_layer();
    part.set_layer(layer);
    part.set_token_offset(static_cast<uint64_t>(t0));
    *part.mutable_k() = MakeBf16Tensor({m, h, d}, k.subspan(t0 * row, m * row));
    *part.mutable_v() = MakeBf16Tensor({m, h, d}, v.subspan(t0 * row, m * row));
    const bool last = t0 + m == n;
    part.set_last_part(last);
    if (last && !obs.empty()) *part.mutable_observation_queries() = MakeBf16Tensor({w, hq, d}, obs);
    absl::Status s = Send(std::move(req));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::IngestResponse> IngestWriter::Commit() {
  if (done_) return absl::FailedPreconditionError("ingest stream already finished");
  auto req = std::make_shared<v1::IngestRequest>();
  req->mutable_commit();
  if (ucx_ != nullptr) {
    absl::Status st = Send(req);
    Drain(0);
    done_ = true;
    if (st.ok()) st = failed_;
    if (!st.ok()) {
      if (!ucx_->failed()) (void)ucx_->CancelIngest(stream_);  // forget the failed stream
      return st;
    }
    v1::IngestResponse resp;
    if (!resp.ParseFromString(last_reply_)) {
      return absl::InternalError("ingest over UCX: the commit's reply does not parse");
    }
    return resp;
  }
  writer_->Write(*req);
  writer_->WritesDone();
  done_ = true;
  grpc::Status s = writer_->Finish();
  if (!s.ok()) return FromGrpc(s);
  return *response_;
}

// --- Tensors ----------------------------------------------------------------------------

std::vector<uint16_t> ToBf16Bits(absl::Span<const float> x) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = FloatToBf16Bits(x[i]);
  return out;
}

int64_t NumElements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const uint16_t> bits) {
  v1::Tensor t;
  for (int64_t s : shape) t.add_shape(s);
  t.set_dtype(v1::DTYPE_BF16);
  // Little-endian host: the in-memory bits are the wire bytes.
  t.set_data(reinterpret_cast<const char*>(bits.data()), bits.size() * sizeof(uint16_t));
  return t;
}

v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const float> values) {
  const std::vector<uint16_t> bits = ToBf16Bits(values);
  return MakeBf16Tensor(std::move(shape), absl::MakeConstSpan(bits));
}

v1::Tensor MakeFp32Tensor(std::vector<int64_t> shape, absl::Span<const float> values) {
  v1::Tensor t;
  for (int64_t s : shape) t.add_shape(s);
  t.set_dtype(v1::DTYPE_FP32);
  t.set_data(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
  return t;
}

absl::Status CheckFloatTensor(const v1::Tensor& t) {
  if (t.dtype() != v1::DTYPE_BF16 && t.dtype() != v1::DTYPE_FP16 && t.dtype() != v1::DTYPE_FP32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor dtype ", t.dtype(), " is not a float type"));
  }
  int64_t n = 1;
  for (int64_t s : t.shape()) {
    if (s < 0) return absl::InvalidArgumentError("tensor has a negative dimension");
    n *= s;
  }
  const int64_t eb = t.dtype() == v1::DTYPE_FP32 ? 4 : 2;
  if (static_cast<int64_t>(t.data().size()) != n * eb) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor data has ", t.data().size(), " bytes; shape and dtype need ", n * eb));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& t) {
  if (absl::Status st = CheckFloatTensor(t); !st.ok()) return st;
  return BytesToFloats(t.dtype(), t.data(), NumElements(t.shape()));
}

absl::StatusOr<std::vector<float>> BytesToFloats(v1::DType dtype, absl::string_view data, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  switch (dtype) {
    case v1::DTYPE_FP32:
      if (data.size() != static_cast<size_t>(n) * 4) break;
      std::memcpy(out.data(), data.data(), data.size());
      return out;
    case v1::DTYPE_BF16:
      if (data.size() != static_cast<size_t>(n) * 2) break;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t b;
        std::memcpy(&b, data.data() + 2 * i, 2);
        out[i] = Bf16BitsToFloat(b);
      }
      return out;
    case v1::DTYPE_FP16:
      if (data.size() != static_cast<size_t>(n) * 2) break;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, data.data() + 2 * i, 2);
        const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
        float f;
        if (exp == 0) f = std::ldexp(static_cast<float>(mant), -24);
        else if (exp == 31) f = mant ? NAN : INFINITY;
        else f = std::ldexp(static_cast<float>(mant | 0x400), exp - 25);
        out[i] = sign ? -f : f;
      }
      return out;
    default:
      return absl::InvalidArgumentError(absl::StrCat("tensor dtype ", dtype, " is not a float type"));
  }
  return absl::InvalidArgumentError(absl::StrCat("tensor data has ", data.size(), " bytes; shape and dtype need ",
                                                 n * (dtype == v1::DTYPE_FP32 ? 4 : 2)));
}

}  // namespace kvshade::client

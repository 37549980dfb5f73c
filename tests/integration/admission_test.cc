// Integration: admission per tenant against the real server (docs/OPERATIONS.md "Limits on
// streams and calls"). A tenant at one of its limits is refused by name (RESOURCE_EXHAUSTED
// naming limits.max_calls_per_tenant or limits.max_streams_per_tenant) before its call
// takes a thread, and every other tenant keeps being served, whatever one tenant holds:
// idle Ingest streams, streams that trickle, unary calls. A stream that trickles is cut by
// the minimum-progress rule (limits.stream_min_bytes_per_s over
// limits.stream_progress_window_ms) and commits nothing. The caps count a tenant's calls
// and streams over gRPC and over the UCX data plane together, a UCX refusal reads like the
// gRPC one, UCX streams give their slots back however they end, and they are paced alike.
#include <atomic>
#include <chrono>
#include <fstream>
#include <iostream>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/ucx_data_plane.h"

namespace kvshade::integration {
namespace admission_test {
namespace {

constexpr char kAlpha[] = "alpha-token-1";
constexpr char kBeta[] = "beta-token-22";

std::string TwoTenants(const std::string& limits) {
  return absl::StrCat("tenants:\n  - {name: alpha, token: ", kAlpha,
                      "}\n  - {name: beta, token: ", kBeta, "}\nlimits:\n", limits);
}

client::ClientOptions WithToken(const char* token) {
  client::ClientOptions o;
  o.bearer_token = token;
  return o;
}

// A daemon of tenants alpha and beta under `limits` with 8 worker threads, a client of
// each, and a ready session of beta's.
struct TwoTenantDaemon {
  TempDir dir;
  ServerProcess server;
  std::unique_ptr<client::Client> alpha, beta;
  v1::CreateSessionResponse ready;

  void Start(const std::string& limits) {
    const std::string config = dir.path() + "/tenants.yaml";
    std::ofstream(config) << TwoTenants(limits);
    KV_ASSERT_OK(server.Start({"--config", config, "--worker-threads", "8"}, WithToken(kAlpha)));
    alpha = server.Connect(WithToken(kAlpha));
    beta = server.Connect(WithToken(kBeta));
    ASSERT_NE(alpha, nullptr);
    ASSERT_NE(beta, nullptr);
    const synthetic::Document beta_doc(SmallDoc(256, 3));
    KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*beta, beta_doc, ShadowProfile(), -1));
    ready = created;
  }
};

// Threads of process `pid` now (/proc/<pid>/status), -1 when unreadable.
int ThreadsOf(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "Threads:")) return std::atoi(line.c_str() + 8);
  }
  return -1;
}

// Polls `call` until it is refused (generous deadline: the streams take their slots when
// the server starts them); returns the refusal, or OK when it never came.
template <typename Call>
absl::Status FirstRefusal(Call&& call) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    absl::Status st = call();
    if (!st.ok() || std::chrono::steady_clock::now() > deadline) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The reported defect: --worker-threads 8, two tenants, max_streams_per_tenant 7 (the call
// cap automatic: 7). alpha holds 7 Ingest streams that sent their header and wait. beta's
// calls all failed with "Server Threadpool Exhausted", and so did alpha's 8th call. Now
// alpha's 8th call and 8th stream are refused by name, and beta is served every time.
TEST(Admission, IdleStreamsOfOneTenantLeaveTheOthersServed) {
  TwoTenantDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start("  max_streams_per_tenant: 7\n  stream_idle_timeout_ms: 60000\n"));
  ServerProcess& server = t.server;
  client::Client* alpha = t.alpha.get();
  client::Client* beta = t.beta.get();
  const v1::CreateSessionResponse& ready = t.ready;

  const synthetic::Document doc(SmallDoc(256, 5));
  auto stub = v1::KvShade::NewStub(alpha->channel());
  std::vector<std::unique_ptr<IdleStream>> held;
  for (int i = 0; i < 7; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(
        created, alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    held.push_back(OpenIdleStream(*stub, created.session_id(), kAlpha));
  }
  // alpha is at its call cap: its next call is refused by name.
  const absl::Status refused = FirstRefusal([&] { return alpha->ListSessions().status(); });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "limits.max_calls_per_tenant")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "'alpha'")) << refused;
  // beta is served, every time, unary calls and a whole ingest alike.
  for (int i = 0; i < 20; ++i) {
    auto info = beta->GetSession(ready.session_id());
    ASSERT_TRUE(info.ok()) << "GetSession " << i << ": " << info.status();
    EXPECT_EQ(info->state(), "ready");
  }
  const synthetic::Document beta_doc2(SmallDoc(256, 4));
  KV_ASSERT_OK(CreateAndIngest(*beta, beta_doc2, ShadowProfile(), -1).status());
  // alpha's 8th stream is refused by name as well, and ends at once.
  auto eighth = OpenIdleStream(*stub, "", kAlpha);
  const grpc::Status st = eighth->writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "limits.max_calls_per_tenant"))
      << st.error_message();
  // Once alpha lets its streams go, its calls are served again.
  for (auto& s : held) s->ctx.TryCancel();
  for (auto& s : held) s->writer->Finish();
  absl::Status again;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  do {
    again = alpha->ListSessions().status();
    if (again.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < deadline);
  KV_ASSERT_OK(again);
  EXPECT_FALSE(absl::StrContains(server.log(), "Threadpool")) << server.log();
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// Explicit caps of 6 (two threads to spare) under a mix of load from alpha: idle streams,
// streams that send a one-token part every 50 ms, and threads that call as fast as they
// can. Each of alpha's calls is served or refused by name; every one of beta's is served.
TEST(Admission, AnyMixOfOneTenantsLoadLeavesTheOthersServed) {
  TwoTenantDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start("  max_streams_per_tenant: 6\n  max_calls_per_tenant: 6\n  stream_idle_timeout_ms: 60000\n"));
  ServerProcess& server = t.server;
  client::Client* alpha = t.alpha.get();
  client::Client* beta = t.beta.get();
  const v1::CreateSessionResponse& ready = t.ready;

  const synthetic::Document doc(SmallDoc(256, 5));
  auto stub = v1::KvShade::NewStub(alpha->channel());
  std::vector<std::unique_ptr<IdleStream>> idle, trickling;
  std::vector<std::string> trickle_sessions;
  for (int i = 0; i < 5; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(
        created, alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    if (i < 3) {
      idle.push_back(OpenIdleStream(*stub, created.session_id(), kAlpha));
    } else {
      trickling.push_back(OpenIdleStream(*stub, created.session_id(), kAlpha));
      trickle_sessions.push_back(created.session_id());
    }
  }
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  std::atomic<int> trickle_failures{0};
  for (auto& s : trickling) {
    threads.emplace_back([&, w = s->writer.get()] {
      for (int64_t t = 0; t < 256 && !stop; ++t) {
        if (!w->Write(LayerPart(doc, 0, t, t + 1, false))) {
          ++trickle_failures;
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  std::atomic<int> alpha_served{0}, alpha_refused{0}, beta_served{0};
  std::mutex mu;
  std::vector<std::string> wrong;  // any answer that is neither served nor refused by name
  auto note = [&](const std::string& who, const absl::Status& st) {
    std::lock_guard<std::mutex> lock(mu);
    if (wrong.size() < 10) wrong.push_back(absl::StrCat(who, ": ", st.ToString()));
  };
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&] {
      auto c = server.Connect(WithToken(kAlpha));
      while (!stop) {
        const absl::Status st = c->ListSessions().status();
        if (st.ok()) {
          ++alpha_served;
        } else if (st.code() == absl::StatusCode::kResourceExhausted &&
                   absl::StrContains(st.message(), "limits.max_calls_per_tenant")) {
          ++alpha_refused;
        } else {
          note("alpha", st);
        }
      }
    });
  }
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&] {
      auto c = server.Connect(WithToken(kBeta));
      while (!stop) {
        const absl::Status st = c->GetSession(ready.session_id()).status();
        if (st.ok()) {
          ++beta_served;
        } else {
          note("beta", st);
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::seconds(3));
  // beta ingests a session meanwhile, too.
  const synthetic::Document beta_doc2(SmallDoc(256, 4));
  const absl::Status beta_ingest = CreateAndIngest(*beta, beta_doc2, ShadowProfile(), -1).status();
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT_TRUE(beta_ingest.ok()) << beta_ingest;
  EXPECT_TRUE(wrong.empty()) << absl::StrJoin(wrong, "\n");
  EXPECT_EQ(trickle_failures.load(), 0);
  EXPECT_GT(beta_served.load(), 20);
  EXPECT_GT(alpha_refused.load(), 0) << "alpha never reached its cap";
  std::cout << "alpha served " << alpha_served << ", refused by name " << alpha_refused
            << "; beta served " << beta_served << "\n";
  // The trickling streams were served all along: their parts are in.
  for (const auto& sid : trickle_sessions) {
    KV_ASSERT_OK_AND_ASSIGN(info, alpha->GetSession(sid));
    EXPECT_EQ(info.state(), "ingesting");
  }
  for (auto& s : idle) s->ctx.TryCancel();
  for (auto& s : trickling) s->ctx.TryCancel();
  for (auto& s : idle) s->writer->Finish();
  for (auto& s : trickling) s->writer->Finish();
  EXPECT_FALSE(absl::StrContains(server.log(), "Threadpool")) << server.log();
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// An open stream that waits for its client holds no thread: 64 idle streams (tenants
// unconfigured, no thread cap, the automatic stream cap: 64) leave the daemon's thread
// count where it was, give or take gRPC's own. (The synchronous server took a thread per
// stream.)
TEST(Admission, IdleStreamsHoldNoThread) {
  TempDir dir;
  const std::string config = dir.path() + "/limits.yaml";
  std::ofstream(config) << "limits:\n  stream_idle_timeout_ms: 60000\n";
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--config", config}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(256, 5));
  KV_ASSERT_OK(CreateAndIngest(*c, doc, ShadowProfile(), -1).status());  // threads warm
  const int before = ThreadsOf(server.pid());
  ASSERT_GT(before, 0);
  auto stub = v1::KvShade::NewStub(c->channel());
  // 65 streams: once one is refused by the stream cap (64), all the others are open.
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 65; ++i) idle.push_back(OpenIdleStream(*stub, ""));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (RpcCount(server, "Ingest", "RESOURCE_EXHAUSTED") < 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the 65th stream was not refused";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const int during = ThreadsOf(server.pid());
  std::cout << "daemon threads: " << before << " before, " << during << " with 64 idle Ingest streams\n";
  EXPECT_LT(during - before, 16) << "idle streams hold threads";
  KV_ASSERT_OK(c->ListSessions().status());  // served meanwhile
  for (auto& s : idle) s->ctx.TryCancel();
  for (auto& s : idle) s->writer->Finish();
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// A stream that is never idle for long but sends almost nothing: one one-token part every
// 100 ms, against limits.stream_min_bytes_per_s 4096 over windows of 500 ms of waiting
// (2048 bytes each; a part is under 300). The idle timeout (2 s) never fires; the
// minimum-progress rule ends it with DEADLINE_EXCEEDED naming the limit, nothing of it is
// committed, and the session ingests normally afterwards. A stream that sends its parts
// as fast as it can is not cut.
TEST(Admission, ATrickleStreamIsCutByTheMinimumProgressRule) {
  TempDir dir;
  const std::string config = dir.path() + "/limits.yaml";
  std::ofstream(config)
      << "limits:\n  stream_idle_timeout_ms: 2000\n  stream_min_bytes_per_s: 4096\n"
         "  stream_progress_window_ms: 500\n";
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--config", config}));
  auto c = server.Connect();
  const synthetic::Document fast(SmallDoc(512, 3));
  KV_ASSERT_OK(CreateAndIngest(*c, fast, ShadowProfile(), -1).status());

  const synthetic::Document doc(SmallDoc(512, 5));
  KV_ASSERT_OK_AND_ASSIGN(created,
                          c->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  auto stub = v1::KvShade::NewStub(c->channel());
  auto stream = OpenIdleStream(*stub, created.session_id());
  const auto start = std::chrono::steady_clock::now();
  // The client keeps trickling until the server has ended the stream (its metrics say so:
  // a client's writes into a stream the server has ended may go on succeeding for a while).
  int sent = 0;
  for (int64_t t = 0; t < 100 && RpcCount(server, "Ingest", "DEADLINE_EXCEEDED") < 1; ++t) {
    const v1::IngestRequest part = LayerPart(doc, 0, t, t + 1, false);
    ASSERT_LT(part.ByteSizeLong(), 300u);
    if (!stream->writer->Write(part)) break;
    ++sent;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const grpc::Status st = stream->writer->Finish();
  std::cout << "trickle stream ended after " << secs << " s, " << sent
            << " parts sent: " << st.error_message() << "\n";
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "limits.stream_min_bytes_per_s"))
      << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "nothing was committed")) << st.error_message();
  EXPECT_GE(secs, 0.5);
  EXPECT_LT(secs, 3.0) << "cut after " << sent << " parts";
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(created.session_id()));
  EXPECT_EQ(info.state(), "ingesting");
  EXPECT_EQ(info.layers_ingested(), 0u);
  KV_ASSERT_OK(synthetic::IngestRange(*c, doc, created.session_id(), -1, 0, 512).status());
  KV_ASSERT_OK_AND_ASSIGN(after, c->GetSession(created.session_id()));
  EXPECT_EQ(after.state(), "ready");
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// --- Both transports: one count per tenant ---------------------------------------------------

// A daemon of tenants alpha and beta with the UCX data plane (tcp) under `limits`, a gRPC
// client of each, and a ready session of each (Attach on it hands out UCX admission
// tokens of its tenant).
struct TwoTenantUcxDaemon {
  TempDir dir;
  ServerProcess server;
  std::unique_ptr<client::Client> alpha, beta;
  const synthetic::Document alpha_doc{SmallDoc(256, 21)}, beta_doc{SmallDoc(256, 22)};
  std::string alpha_ready, beta_ready;

  void Start(const std::string& limits, const std::string& ucx_extra = "") {
    const std::string config = dir.path() + "/tenants.yaml";
    std::ofstream(config) << TwoTenants(limits) << "ucx:\n  enable: true\n  transports: \"tcp,self\"\n"
                          << ucx_extra;
    KV_ASSERT_OK(server.Start({"--config", config}, WithToken(kAlpha)));
    alpha = server.Connect(WithToken(kAlpha));
    beta = server.Connect(WithToken(kBeta));
    ASSERT_NE(alpha, nullptr);
    ASSERT_NE(beta, nullptr);
    KV_ASSERT_OK_AND_ASSIGN(a, CreateAndIngest(*alpha, alpha_doc, ShadowProfile(), -1));
    KV_ASSERT_OK_AND_ASSIGN(b, CreateAndIngest(*beta, beta_doc, ShadowProfile(), -1));
    alpha_ready = a.session_id();
    beta_ready = b.session_id();
  }
};

// A UCX data plane of `c`'s tenant, admitted with the token of a fresh attachment of
// `session` (which must be ready); its attachment id in `attachment` when not null.
absl::StatusOr<std::unique_ptr<client::UcxDataPlane>> DataPlaneOf(client::Client& c,
                                                                  const std::string& session,
                                                                  std::string* attachment = nullptr) {
  static std::atomic<int> workers{0};
  v1::AttachRequest ar;
  ar.set_session_id(session);
  ar.set_worker_id("ucx-" + std::to_string(workers++));
  auto att = c.Attach(ar);
  if (!att.ok()) return att.status();
  if (att->data_plane_token().empty()) return absl::FailedPreconditionError("no data plane");
  if (attachment != nullptr) *attachment = att->attachment_id();
  client::UcxOptions o;
  o.transports = "tcp,self";
  o.timeout = absl::Seconds(30);
  return client::UcxDataPlane::Connect(att->data_plane_address(), att->data_plane_token(), o);
}

v1::IngestRequest Header(const std::string& session_id) {
  v1::IngestRequest m;
  m.mutable_header()->set_session_id(session_id);
  return m;
}

// The whole Ingest stream of `doc` alone for `session_id`: header, one part per layer,
// commit.
std::vector<v1::IngestRequest> WholeStream(const synthetic::Document& doc,
                                           const std::string& session_id) {
  std::vector<v1::IngestRequest> msgs = {Header(session_id)};
  const int64_t n = static_cast<int64_t>(doc.tokens().size());
  for (int l = 0; l < doc.spec().layers; ++l) msgs.push_back(LayerPart(doc, l, 0, n, true));
  msgs.emplace_back().mutable_commit();
  return msgs;
}

// Opens UCX ingest stream `stream` of `dp` on `session` (its header); its status.
absl::Status OpenUcxStream(client::UcxDataPlane& dp, uint64_t stream, const std::string& session) {
  return dp.IngestMessage(Header(session), stream).status();
}

// Retries `call` until it succeeds (slots given back asynchronously, e.g. by a cancel the
// server has yet to see, or a vanished client it has yet to notice); its last status.
template <typename Call>
absl::Status FirstSuccess(Call&& call, std::chrono::seconds within = std::chrono::seconds(30)) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  for (;;) {
    absl::Status st = call();
    if (st.ok() || std::chrono::steady_clock::now() > deadline) return st;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// Opens an idle gRPC Ingest stream of alpha's on each of `sessions` (into `held`) and
// polls `probe` until it is refused, which it is once the server has admitted them all.
// A probe admitted just before one of the streams takes the slot that stream needed, and
// the stream is refused (counted as Ingest RESOURCE_EXHAUSTED): then every stream is
// opened again. Returns the probe's refusal (OK when none came).
template <typename Probe>
absl::Status HoldStreamsUntilRefused(const ServerProcess& server, v1::KvShade::Stub& stub,
                                     const std::vector<std::string>& sessions,
                                     std::vector<std::unique_ptr<IdleStream>>* held,
                                     Probe&& probe) {
  constexpr char kDisplaced[] = "a stream was refused: open them again";
  absl::Status refused;
  for (int round = 0; round < 10; ++round) {
    for (auto& s : *held) s->ctx.TryCancel();
    for (auto& s : *held) s->writer->Finish();
    held->clear();
    const double before = RpcCount(server, "Ingest", "RESOURCE_EXHAUSTED");
    for (const std::string& session : sessions) held->push_back(OpenIdleStream(stub, session, kAlpha));
    refused = FirstRefusal([&]() -> absl::Status {
      if (RpcCount(server, "Ingest", "RESOURCE_EXHAUSTED") > before) {
        return absl::AbortedError(kDisplaced);
      }
      return probe();
    });
    if (refused.message() != kDisplaced) return refused;
  }
  return refused;
}

// max_streams_per_tenant 2: alpha's two gRPC streams leave it no UCX stream, and its two
// UCX streams no gRPC stream; beta is not affected either way.
TEST(Admission, TheStreamCapHoldsAcrossTransports) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 2\n  max_calls_per_tenant: 4\n  stream_idle_timeout_ms: 60000\n"));
  const synthetic::Document doc(SmallDoc(256, 5));  // never committed: every session ingests
  std::vector<std::string> sessions;
  for (int i = 0; i < 4; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(s, t.alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    sessions.push_back(s.session_id());
  }
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready));
  KV_ASSERT_OK_AND_ASSIGN(beta_dp, DataPlaneOf(*t.beta, t.beta_ready));

  // gRPC first: two open streams, then a UCX header is refused by the stream cap.
  auto stub = v1::KvShade::NewStub(t.alpha->channel());
  std::vector<std::unique_ptr<IdleStream>> grpc_streams;
  uint64_t refused_stream = 0;
  const absl::Status refused =
      HoldStreamsUntilRefused(t.server, *stub, {sessions[0], sessions[1]}, &grpc_streams, [&] {
        refused_stream = dp->NewIngestStream();
        absl::Status st = OpenUcxStream(*dp, refused_stream, sessions[2]);
        if (st.ok()) (void)dp->CancelIngest(refused_stream);  // the gRPC streams are not open yet
        return st;
      });
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StartsWith(refused.message(),
                               "ucx Ingest: tenant 'alpha' already has 2 open Ingest streams "
                               "(limits.max_streams_per_tenant)"))
      << refused;
  KV_ASSERT_OK(dp->CancelIngest(refused_stream));  // forget the refused stream
  // beta opens a UCX stream meanwhile, and alpha's unary calls fit under the call cap.
  const uint64_t beta_stream = beta_dp->NewIngestStream();
  KV_ASSERT_OK_AND_ASSIGN(beta_session, t.beta->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  KV_ASSERT_OK(OpenUcxStream(*beta_dp, beta_stream, beta_session.session_id()));
  KV_ASSERT_OK(beta_dp->CancelIngest(beta_stream));
  KV_ASSERT_OK(t.alpha->ListSessions().status());

  // The gRPC streams end; then two UCX streams leave no gRPC stream.
  for (auto& s : grpc_streams) s->ctx.TryCancel();
  for (auto& s : grpc_streams) s->writer->Finish();
  std::vector<uint64_t> ucx_streams;
  for (int i = 0; i < 2; ++i) {
    const uint64_t id = dp->NewIngestStream();
    // (The server sees the gRPC cancels in its own time.)
    KV_ASSERT_OK(FirstSuccess([&] {
      absl::Status st = OpenUcxStream(*dp, id, sessions[2 + i]);
      if (!st.ok()) (void)dp->CancelIngest(id);
      return st;
    }));
    ucx_streams.push_back(id);
  }
  auto over = OpenIdleStream(*stub, sessions[0], kAlpha);
  const grpc::Status st = over->writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StartsWith(st.error_message(),
                               "Ingest: tenant 'alpha' already has 2 open Ingest streams "
                               "(limits.max_streams_per_tenant)"))
      << st.error_message();
  // Once the UCX streams are cancelled, alpha ingests over gRPC again.
  for (uint64_t id : ucx_streams) KV_ASSERT_OK(dp->CancelIngest(id));
  const synthetic::Document fresh(SmallDoc(256, 6));
  KV_ASSERT_OK(CreateAndIngest(*t.alpha, fresh, ShadowProfile(), -1).status());
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

// alpha at its call cap (three idle gRPC streams): each of its UCX calls is refused with
// RESOURCE_EXHAUSTED and the gRPC refusal's message behind "ucx " (the limit and the
// tenant by name), counted in kvshade_rpc_total under its ucx/ method; beta's UCX calls
// are served meanwhile, and alpha's once its streams have ended.
TEST(Admission, UcxRefusalsReadLikeGrpcOnesAndAreCounted) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 3\n  max_calls_per_tenant: 3\n  stream_idle_timeout_ms: 60000\n"));
  std::string alpha_att, beta_att;
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready, &alpha_att));
  KV_ASSERT_OK_AND_ASSIGN(beta_dp, DataPlaneOf(*t.beta, t.beta_ready, &beta_att));
  const v1::SelectAndReconstructRequest select = MakeSelect(t.alpha_doc, 0, {alpha_att}, 0, 0, 256);
  v1::AttendRequest attend;
  attend.set_layer(0);
  attend.add_queries()->set_attachment_id(alpha_att);
  *attend.mutable_queries(0)->mutable_q() = select.queries(0).q();
  v1::AppendTokensRequest append;
  append.set_session_id(t.alpha_ready);
  KV_ASSERT_OK(dp->SelectAndReconstruct(select).status());  // served below the cap

  const synthetic::Document doc(SmallDoc(256, 5));
  auto stub = v1::KvShade::NewStub(t.alpha->channel());
  std::vector<std::string> sessions;
  for (int i = 0; i < 3; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(s, t.alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    sessions.push_back(s.session_id());
  }
  std::vector<std::unique_ptr<IdleStream>> held;
  const absl::Status grpc_select = HoldStreamsUntilRefused(
      t.server, *stub, sessions, &held, [&] { return t.alpha->SelectAndReconstruct(select).status(); });
  ASSERT_EQ(grpc_select.code(), absl::StatusCode::kResourceExhausted) << grpc_select;
  EXPECT_EQ(grpc_select.message(),
            "SelectAndReconstruct: tenant 'alpha' already has 3 calls in flight "
            "(limits.max_calls_per_tenant); retry when one has ended");

  struct Refusal {
    std::string method;  // gRPC's
    absl::Status grpc, ucx;
  };
  std::vector<Refusal> refusals = {
      {"SelectAndReconstruct", grpc_select, dp->SelectAndReconstruct(select).status()},
      {"Attend", t.alpha->Attend(attend).status(), dp->Attend(attend).status()},
      {"AppendTokens", t.alpha->AppendTokens(append).status(), dp->AppendTokens(append).status()},
      {"Ingest", t.alpha->Ingest(WholeStream(doc, t.alpha_ready)).status(),
       OpenUcxStream(*dp, 77, t.alpha_ready)},
  };
  (void)dp->CancelIngest(77);
  for (const Refusal& r : refusals) {
    EXPECT_EQ(r.grpc.code(), absl::StatusCode::kResourceExhausted) << r.method << ": " << r.grpc;
    EXPECT_EQ(r.ucx.code(), absl::StatusCode::kResourceExhausted) << r.method << ": " << r.ucx;
    EXPECT_EQ(r.ucx.message(), "ucx " + std::string(r.grpc.message())) << r.method;
    EXPECT_TRUE(absl::StrContains(r.ucx.message(), "tenant 'alpha'")) << r.ucx;
    EXPECT_TRUE(absl::StrContains(r.ucx.message(), "limits.max_calls_per_tenant")) << r.ucx;
    EXPECT_GE(RpcCount(t.server, "ucx/" + r.method, "RESOURCE_EXHAUSTED"), 1) << r.method;
    EXPECT_GE(RpcCount(t.server, r.method, "RESOURCE_EXHAUSTED"), 1) << r.method;
  }
  EXPECT_FALSE(dp->failed()) << "a refusal is an answer, not a transport failure";
  // beta is served over UCX meanwhile.
  KV_ASSERT_OK(beta_dp->SelectAndReconstruct(MakeSelect(t.beta_doc, 0, {beta_att}, 0, 0, 256)).status());
  // alpha's calls come back once its streams end.
  for (auto& s : held) s->ctx.TryCancel();
  for (auto& s : held) s->writer->Finish();
  KV_ASSERT_OK(FirstSuccess([&] { return dp->SelectAndReconstruct(select).status(); }));
  KV_ASSERT_OK(dp->Attend(attend).status());
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

// alpha holds its two streams over UCX (one connection each; a part sent on one) and
// stalls, with a single UCX engine thread: beta's calls and whole ingests over both
// transports are served meanwhile, and so are alpha's unary calls; only alpha's next
// stream is refused.
TEST(Admission, StalledUcxStreamsOfOneTenantLeaveTheOthersServed) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 2\n  max_calls_per_tenant: 4\n  stream_idle_timeout_ms: 60000\n",
      "  engine_threads: 1\n"));
  const synthetic::Document doc(SmallDoc(256, 5));
  std::vector<std::unique_ptr<client::UcxDataPlane>> stalled;
  for (int i = 0; i < 2; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(s, t.alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready));
    const uint64_t id = dp->NewIngestStream();
    KV_ASSERT_OK(OpenUcxStream(*dp, id, s.session_id()));
    if (i == 0) KV_ASSERT_OK(dp->IngestMessage(LayerPart(doc, 0, 0, 64, false), id).status());
    stalled.push_back(std::move(dp));
  }
  std::string beta_att;
  KV_ASSERT_OK_AND_ASSIGN(beta_dp, DataPlaneOf(*t.beta, t.beta_ready, &beta_att));
  for (int i = 0; i < 20; ++i) {
    KV_ASSERT_OK(t.beta->GetSession(t.beta_ready).status());
    KV_ASSERT_OK(beta_dp->SelectAndReconstruct(MakeSelect(t.beta_doc, i % 2, {beta_att}, 0, i, 256)).status());
  }
  const synthetic::Document over_ucx(SmallDoc(256, 7)), over_grpc(SmallDoc(256, 8));
  KV_ASSERT_OK_AND_ASSIGN(s1, t.beta->CreateSession(synthetic::MakeCreate(over_ucx, ShadowProfile(), -1)));
  KV_ASSERT_OK_AND_ASSIGN(r1, beta_dp->Ingest(WholeStream(over_ucx, s1.session_id())));
  EXPECT_EQ(r1.tokens(), 256u);
  KV_ASSERT_OK(CreateAndIngest(*t.beta, over_grpc, ShadowProfile(), -1).status());
  KV_ASSERT_OK(t.alpha->ListSessions().status());
  // alpha's third stream is refused, over either transport.
  auto stub = v1::KvShade::NewStub(t.alpha->channel());
  auto third = OpenIdleStream(*stub, "", kAlpha);
  const grpc::Status st = third->writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_TRUE(absl::StrContains(st.error_message(), "limits.max_streams_per_tenant")) << st.error_message();
  EXPECT_EQ(OpenUcxStream(*stalled[0], 99, t.alpha_ready).code(), absl::StatusCode::kResourceExhausted);
  (void)stalled[0]->CancelIngest(99);
  // Nothing of the stalled streams is visible.
  KV_ASSERT_OK_AND_ASSIGN(list, t.alpha->ListSessions());
  for (const auto& info : list.sessions()) {
    if (info.session_id() != t.alpha_ready) {
      EXPECT_EQ(info.layers_ingested(), 0u) << info.session_id();
    }
  }
  stalled.clear();  // BYE: the streams are discarded
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

// max_streams_per_tenant 1: after each way a UCX stream ends (a cancel, a commit, a
// failed part, BYE, a client that vanishes) alpha opens the next one. The cancel, the
// commit and the failure give the slots back before their reply.
TEST(Admission, UcxStreamsGiveTheirSlotsBackHoweverTheyEnd) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 1\n  max_calls_per_tenant: 2\n  stream_idle_timeout_ms: 60000\n"));
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready));
  const synthetic::Document a(SmallDoc(256, 11)), b(SmallDoc(256, 12)), c(SmallDoc(256, 13));
  KV_ASSERT_OK_AND_ASSIGN(sa, t.alpha->CreateSession(synthetic::MakeCreate(a, ShadowProfile(), -1)));
  KV_ASSERT_OK_AND_ASSIGN(sb, t.alpha->CreateSession(synthetic::MakeCreate(b, ShadowProfile(), -1)));
  KV_ASSERT_OK_AND_ASSIGN(sc, t.alpha->CreateSession(synthetic::MakeCreate(c, ShadowProfile(), -1)));
  const std::string session = sc.session_id();
  // The cap holds: with one stream open, the next header is refused.
  uint64_t open = dp->NewIngestStream(), next = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, open, session));
  EXPECT_EQ(OpenUcxStream(*dp, next, sb.session_id()).code(), absl::StatusCode::kResourceExhausted);
  KV_ASSERT_OK(dp->CancelIngest(next));
  // A cancel.
  KV_ASSERT_OK(dp->CancelIngest(open));
  // Commits, twice in a row.
  KV_ASSERT_OK_AND_ASSIGN(ra, dp->Ingest(WholeStream(a, sa.session_id())));
  KV_ASSERT_OK_AND_ASSIGN(rb, dp->Ingest(WholeStream(b, sb.session_id())));
  EXPECT_EQ(ra.tokens(), 256u);
  EXPECT_EQ(rb.tokens(), 256u);
  // A failed part (3 KV heads claimed for data of 2), not cancelled: the next stream opens.
  open = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, open, session));
  v1::IngestRequest bad = LayerPart(c, 0, 0, 64, false);
  bad.mutable_layer()->mutable_k()->set_shape(1, 3);
  EXPECT_EQ(dp->IngestMessage(bad, open).status().code(), absl::StatusCode::kInvalidArgument);
  next = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, next, session));
  KV_ASSERT_OK(dp->CancelIngest(next));
  KV_ASSERT_OK(dp->CancelIngest(open));
  // BYE with a stream open: the connection's streams are discarded.
  {
    KV_ASSERT_OK_AND_ASSIGN(other, DataPlaneOf(*t.alpha, t.alpha_ready));
    KV_ASSERT_OK(OpenUcxStream(*other, other->NewIngestStream(), session));
  }
  open = dp->NewIngestStream();
  KV_ASSERT_OK(FirstSuccess([&] {
    absl::Status st = OpenUcxStream(*dp, open, session);
    if (!st.ok()) (void)dp->CancelIngest(open);
    return st;
  }));
  KV_ASSERT_OK(dp->CancelIngest(open));
  // A client that vanishes without BYE (tcp notices the dead peer).
  {
    KV_ASSERT_OK_AND_ASSIGN(gone, DataPlaneOf(*t.alpha, t.alpha_ready));
    KV_ASSERT_OK(OpenUcxStream(*gone, gone->NewIngestStream(), session));
    gone->AbandonForTest();
  }
  open = dp->NewIngestStream();
  KV_ASSERT_OK(FirstSuccess([&] {
    absl::Status st = OpenUcxStream(*dp, open, session);
    if (!st.ok()) (void)dp->CancelIngest(open);
    return st;
  }));
  KV_ASSERT_OK(dp->CancelIngest(open));
  // Nothing of those streams was kept, and every slot is back: the session ingests whole
  // over gRPC, with a unary call beside it.
  KV_ASSERT_OK_AND_ASSIGN(info, t.alpha->GetSession(session));
  EXPECT_EQ(info.layers_ingested(), 0u);
  KV_ASSERT_OK(t.alpha->ListSessions().status());
  KV_ASSERT_OK_AND_ASSIGN(rc, t.alpha->Ingest(WholeStream(c, session)));
  EXPECT_EQ(rc.tokens(), 256u);
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

// The idle timeout over UCX: a stream that waits 1 s for its client is cut (counted like a
// gRPC stream's cut) and gives its slots back at once; its next message is answered with
// the gRPC stream's DEADLINE_EXCEEDED, and nothing of it was committed.
TEST(Admission, AnIdleUcxStreamIsCutAndGivesItsSlotsBack) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 1\n  max_calls_per_tenant: 2\n  stream_idle_timeout_ms: 1000\n"));
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready));
  const synthetic::Document doc(SmallDoc(256, 13));
  KV_ASSERT_OK_AND_ASSIGN(created, t.alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  const std::string session = created.session_id();
  const double cuts = RpcCount(t.server, "ucx/Ingest", "DEADLINE_EXCEEDED");
  const uint64_t idle = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, idle, session));
  KV_ASSERT_OK(dp->IngestMessage(LayerPart(doc, 0, 0, 64, false), idle).status());
  const auto start = std::chrono::steady_clock::now();
  while (RpcCount(t.server, "ucx/Ingest", "DEADLINE_EXCEEDED") < cuts + 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), start + std::chrono::seconds(20))
        << "the idle stream was not cut";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(900));
  // Its slots are back: the next stream opens on the same session, and commits.
  const uint64_t next = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, next, session));
  KV_ASSERT_OK(dp->CancelIngest(next));
  const absl::Status cut = dp->IngestMessage(LayerPart(doc, 0, 64, 128, false), idle).status();
  EXPECT_EQ(cut.code(), absl::StatusCode::kDeadlineExceeded) << cut;
  EXPECT_EQ(cut.message(),
            "Ingest: no message for 1000 ms (limits.stream_idle_timeout_ms); the stream is ended "
            "and nothing was committed");
  KV_ASSERT_OK(dp->CancelIngest(idle));
  KV_ASSERT_OK_AND_ASSIGN(info, t.alpha->GetSession(session));
  EXPECT_EQ(info.state(), "ingesting");
  EXPECT_EQ(info.layers_ingested(), 0u);
  KV_ASSERT_OK_AND_ASSIGN(r, dp->Ingest(WholeStream(doc, session)));
  EXPECT_EQ(r.tokens(), 256u);
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

// The minimum-progress rule over UCX, as ATrickleStreamIsCutByTheMinimumProgressRule over
// gRPC: one one-token part every 100 ms against 4096 bytes/s over 500 ms windows is cut
// with DEADLINE_EXCEEDED naming the limit, nothing is committed, the slots come back.
TEST(Admission, ATrickleUcxStreamIsCutByTheMinimumProgressRule) {
  TwoTenantUcxDaemon t;
  ASSERT_NO_FATAL_FAILURE(t.Start(
      "  max_streams_per_tenant: 1\n  stream_idle_timeout_ms: 2000\n"
      "  stream_min_bytes_per_s: 4096\n  stream_progress_window_ms: 500\n"));
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneOf(*t.alpha, t.alpha_ready));
  const synthetic::Document doc(SmallDoc(256, 5));
  KV_ASSERT_OK_AND_ASSIGN(created, t.alpha->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  const uint64_t id = dp->NewIngestStream();
  KV_ASSERT_OK(OpenUcxStream(*dp, id, created.session_id()));
  const auto start = std::chrono::steady_clock::now();
  absl::Status st;
  int sent = 0;
  for (int64_t tok = 0; tok < 100 && st.ok(); ++tok) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    st = dp->IngestMessage(LayerPart(doc, 0, tok, tok + 1, false), id).status();
    if (st.ok()) ++sent;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "UCX trickle stream ended after " << secs << " s, " << sent << " parts: " << st << "\n";
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_min_bytes_per_s")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nothing was committed")) << st;
  EXPECT_GE(secs, 0.5);
  EXPECT_LT(secs, 3.0);
  KV_ASSERT_OK(dp->CancelIngest(id));
  KV_ASSERT_OK_AND_ASSIGN(info, t.alpha->GetSession(created.session_id()));
  EXPECT_EQ(info.state(), "ingesting");
  EXPECT_EQ(info.layers_ingested(), 0u);
  // The stream cap is 1: the slot is back, and the session ingests whole over UCX.
  KV_ASSERT_OK_AND_ASSIGN(r, dp->Ingest(WholeStream(doc, created.session_id())));
  EXPECT_EQ(r.tokens(), 256u);
  EXPECT_EQ(t.server.Stop(), 0) << t.server.log();
}

}  // namespace
}  // namespace admission_test
}  // namespace kvshade::integration

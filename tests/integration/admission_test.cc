// Integration: admission per tenant against the real server (service/README.md "Limits on
// streams and calls"). A tenant at one of its limits is refused by name (RESOURCE_EXHAUSTED
// naming limits.max_calls_per_tenant or limits.max_streams_per_tenant) before its call
// takes a thread, and every other tenant keeps being served, whatever one tenant holds:
// idle Ingest streams, streams that trickle, unary calls. A stream that trickles is cut by
// the minimum-progress rule (limits.stream_min_bytes_per_s over
// limits.stream_progress_window_ms) and commits nothing.
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

namespace kvshade::integration {
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

}  // namespace
}  // namespace kvshade::integration

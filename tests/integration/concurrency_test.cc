// Integration: concurrency against the real server. Eight workers attached to one session
// decode concurrently (each attachment keeps its own slot tables, so all eight must see
// the same, deterministic answers as a single worker), and 100 sessions are created,
// ingested, used and closed at once from several client threads. Idle Ingest streams
// cannot take the server's threads from everyone else (limits.stream_idle_timeout_ms,
// limits.max_streams_per_tenant).
#include <atomic>
#include <chrono>
#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"

namespace kvshade::integration {
namespace concurrency_test {
namespace {

struct StepRecord {
  std::vector<int32_t> chunks;
  std::string keys, values;
  uint32_t hits = 0, selected = 0;
  bool operator==(const StepRecord& o) const {
    return chunks == o.chunks && keys == o.keys && values == o.values && hits == o.hits && selected == o.selected;
  }
};

TEST(Concurrency, EightWorkersOnOneSessionSeeIdenticalDeterministicAnswers) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(2048));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  const std::string sid = created.session_id();
  constexpr int kWorkers = 8, kSteps = 12;
  const int L = doc.spec().layers;

  // Reference: one worker alone.
  auto run_worker = [&](client::Client& cl, const std::string& worker,
                        std::vector<StepRecord>* out) -> absl::Status {
    v1::AttachRequest ar;
    ar.set_session_id(sid);
    ar.set_worker_id(worker);
    auto att = cl.Attach(ar);
    if (!att.ok()) return att.status();
    for (int step = 0; step < kSteps; ++step) {
      for (int l = 0; l < L; ++l) {
        auto r = cl.SelectAndReconstruct(MakeSelect(doc, l, {att->attachment_id()}, 0, step, 2048));
        if (!r.ok()) return r.status();
        if (r->deltas_size() != 1) return absl::InternalError("expected one delta");
        const auto& d = r->deltas(0);
        StepRecord rec;
        rec.chunks.assign(d.chunk().begin(), d.chunk().end());
        rec.keys = d.keys().data();
        rec.values = d.values().data();
        rec.hits = d.hits();
        rec.selected = d.selected();
        out->push_back(std::move(rec));
      }
    }
    return cl.Detach(att->attachment_id());
  };
  std::vector<StepRecord> reference;
  KV_ASSERT_OK(run_worker(*c, "solo", &reference));
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps * L));

  // Eight at once, each with its own channel (as separate worker processes would have).
  std::vector<std::vector<StepRecord>> got(kWorkers);
  std::vector<absl::Status> status(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      auto cl = server.Connect();
      status[w] = cl ? run_worker(*cl, "worker-" + std::to_string(w), &got[w]) : absl::InternalError("connect");
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    ASSERT_EQ(got[w].size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i) {
      ASSERT_TRUE(got[w][i] == reference[i]) << "worker " << w << " differs at call " << i;
    }
  }
  // The slot tables were private: the solo run's later steps hit (temporal locality).
  uint64_t hits = 0, selected = 0;
  for (size_t i = L; i < reference.size(); ++i) {
    hits += reference[i].hits;
    selected += reference[i].selected;
  }
  EXPECT_GT(hits, selected / 2) << "later steps should mostly hit the slot tables";
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.attachments(), 0u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(Concurrency, HundredSessionsAtOnce) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  constexpr int kSessions = 100, kThreads = 8;
  // Each session a distinct small document (different seeds: no prefix sharing), exact
  // profile for cheap ingest, a few hundred tokens.
  std::vector<std::string> ids(kSessions);
  std::vector<absl::Status> status(kSessions);
  std::atomic<int> next{0};
  std::vector<std::thread> threads;
  v1::Profile exact;
  exact.set_kind(v1::PROFILE_KIND_EXACT);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto cl = server.Connect();
      for (int i = next++; i < kSessions; i = next++) {
        if (!cl) {
          status[i] = absl::InternalError("connect");
          continue;
        }
        const synthetic::Document doc(SmallDoc(96 + (i % 4) * 8, 1000 + i));
        auto created = CreateAndIngest(*cl, doc, exact, -1);
        if (!created.ok()) {
          status[i] = created.status();
          continue;
        }
        ids[i] = created->session_id();
        v1::AttachRequest ar;
        ar.set_session_id(ids[i]);
        auto att = cl->Attach(ar);
        if (!att.ok()) {
          status[i] = att.status();
          continue;
        }
        v1::AttendRequest r;
        auto* q = r.add_queries();
        q->set_attachment_id(att->attachment_id());
        const auto qv = doc.Query(0, 0, 0, doc.spec().doc_tokens);
        *q->mutable_q() = client::MakeBf16Tensor({doc.spec().q_heads, doc.spec().head_dim}, absl::MakeConstSpan(qv));
        auto out = cl->Attend(r);
        status[i] = out.ok() ? cl->Detach(att->attachment_id()) : out.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) ASSERT_TRUE(status[i].ok()) << "session " << i << ": " << status[i];
  auto c = server.Connect();
  KV_ASSERT_OK_AND_ASSIGN(list, c->ListSessions());
  std::set<std::string> listed;
  for (const auto& s : list.sessions()) listed.insert(s.session_id());
  for (const auto& id : ids) EXPECT_TRUE(listed.count(id)) << id;
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), static_cast<size_t>(kSessions));
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_EQ(stats.sessions(), static_cast<uint64_t>(kSessions));
  // Close them all concurrently too.
  next = 0;
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto cl = server.Connect();
      for (int i = next++; i < kSessions; i = next++) status[i] = cl->CloseSession(ids[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) EXPECT_TRUE(status[i].ok()) << status[i];
  KV_ASSERT_OK_AND_ASSIGN(after, c->Stats());
  EXPECT_EQ(after.sessions(), 0u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// kvshade_rpc_total for Ingest with `code` (0 when absent).
double IngestCount(const ServerProcess& server, const std::string& code) {
  return RpcCount(server, "Ingest", code);
}

// The reported defect: with --worker-threads 8, one client holding 7 idle Ingest streams
// made every other caller get RESOURCE_EXHAUSTED "Server Threadpool Exhausted". Now the
// tenant's streams beyond max_streams_per_tenant (default with 8 threads: 4) are refused at
// once, the others end after stream_idle_timeout_ms with DEADLINE_EXCEEDED, and other
// callers are served throughout.
TEST(Concurrency, IdleIngestStreamsCannotTakeTheThreadPool) {
  TempDir dir;
  const std::string config = dir.path() + "/limits.yaml";
  std::ofstream(config) << "limits:\n  stream_idle_timeout_ms: 1500\n";
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--config", config, "--worker-threads", "8"}));
  auto holder = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  std::vector<std::string> sessions;
  for (int i = 0; i < 3; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(created, holder->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), i - 1)));
    sessions.push_back(created.session_id());
  }
  auto stub = v1::KvShade::NewStub(holder->channel());
  const auto opened = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 7; ++i) idle.push_back(OpenIdleStream(*stub, i < 3 ? sessions[i] : ""));
  // The three over the cap are refused as soon as they arrive.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (IngestCount(server, "RESOURCE_EXHAUSTED") < 3) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "streams over the cap were not refused";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Another caller is served while four streams sit idle. The refused streams' handler
  // threads go back to gRPC's pool only after their refusal is counted (a slow machine or a
  // sanitizer build widens that moment): the first call may wait for them, within bounds;
  // from then on every call must be served.
  auto other = server.Connect();
  const auto settle = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!other->Stats().ok()) {
    ASSERT_LT(std::chrono::steady_clock::now(), settle) << "no other call served while streams sit idle";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int i = 0; i < 20; ++i) {
    KV_ASSERT_OK(other->Stats().status());
    KV_ASSERT_OK(other->ListSessions().status());
    KV_ASSERT_OK(other->GetSession(sessions[0]).status());
  }
  const synthetic::Document other_doc(SmallDoc(512, 8));
  KV_ASSERT_OK_AND_ASSIGN(fresh, other->CreateSession(synthetic::MakeCreate(other_doc, ShadowProfile(), -1)));
  // Every idle stream ends with a code and a message that say why.
  int refused = 0, timed_out = 0;
  for (auto& s : idle) {
    const grpc::Status st = s->writer->Finish();  // no half-close: waits for the server
    if (st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_TRUE(absl::StrContains(st.error_message(), "max_streams_per_tenant")) << st.error_message();
    } else {
      ++timed_out;
      EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
      EXPECT_TRUE(absl::StrContains(st.error_message(), "stream_idle_timeout_ms")) << st.error_message();
    }
  }
  EXPECT_EQ(refused, 3);
  EXPECT_EQ(timed_out, 4);
  EXPECT_GE(std::chrono::steady_clock::now() - opened, std::chrono::milliseconds(1500));
  // The idle streams committed nothing; their sessions (and the others) ingest normally now.
  KV_ASSERT_OK_AND_ASSIGN(info, other->GetSession(sessions[0]));
  EXPECT_EQ(info.state(), "ingesting");
  KV_ASSERT_OK(synthetic::IngestRange(*other, doc, sessions[0], -1, 0, 512).status());
  KV_ASSERT_OK(synthetic::IngestRange(*other, other_doc, fresh.session_id(), -1, 0, 512).status());
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// The cap is per tenant: one tenant at its cap does not keep another from ingesting.
TEST(Concurrency, TheStreamCapIsPerTenant) {
  TempDir dir;
  const std::string config = dir.path() + "/tenants.yaml";
  std::ofstream(config) << "tenants:\n  - {name: alpha, token: alpha-token-1}\n"
                           "  - {name: beta, token: beta-token-22}\n"
                           "limits:\n  max_streams_per_tenant: 2\n  stream_idle_timeout_ms: 60000\n";
  ServerProcess server;
  client::ClientOptions alpha_options, beta_options;
  alpha_options.bearer_token = "alpha-token-1";
  beta_options.bearer_token = "beta-token-22";
  KV_ASSERT_OK(server.Start({"--config", config, "--worker-threads", "8"}, alpha_options));
  auto alpha = server.Connect(alpha_options);
  auto beta = server.Connect(beta_options);
  auto stub = v1::KvShade::NewStub(alpha->channel());
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 3; ++i) idle.push_back(OpenIdleStream(*stub, "", "alpha-token-1"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (IngestCount(server, "RESOURCE_EXHAUSTED") < 1) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "alpha's third stream was not refused";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // alpha is at its cap; beta ingests.
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK(CreateAndIngest(*beta, doc, ShadowProfile(), -1).status());
  auto refused = CreateAndIngest(*alpha, doc, ShadowProfile(), 1);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  // alpha's idle streams end when it cancels them; then it ingests too.
  for (auto& s : idle) s->ctx.TryCancel();
  for (auto& s : idle) s->writer->Finish();
  const auto again = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  absl::Status st;
  do {
    st = CreateAndIngest(*alpha, doc, ShadowProfile(), 2).status();
    if (st.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < again);
  KV_ASSERT_OK(st);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// Calls in flight are capped per tenant, Ingest streams included: a tenant whose two idle
// streams hold its two call slots gets RESOURCE_EXHAUSTED for any further call, naming the
// limit, while another tenant is served; once the streams end, its calls are served again.
TEST(Concurrency, TheCallCapIsPerTenantAndCountsStreams) {
  TempDir dir;
  const std::string config = dir.path() + "/tenants.yaml";
  std::ofstream(config) << "tenants:\n  - {name: alpha, token: alpha-token-1}\n"
                           "  - {name: beta, token: beta-token-22}\n"
                           "limits:\n  max_streams_per_tenant: 3\n  max_calls_per_tenant: 2\n"
                           "  stream_idle_timeout_ms: 60000\n";
  ServerProcess server;
  client::ClientOptions alpha_options, beta_options;
  alpha_options.bearer_token = "alpha-token-1";
  beta_options.bearer_token = "beta-token-22";
  KV_ASSERT_OK(server.Start({"--config", config, "--worker-threads", "8"}, alpha_options));
  auto alpha = server.Connect(alpha_options);
  auto beta = server.Connect(beta_options);
  KV_ASSERT_OK(alpha->ListSessions().status());  // under the cap: served
  auto stub = v1::KvShade::NewStub(alpha->channel());
  std::vector<std::unique_ptr<IdleStream>> idle;
  for (int i = 0; i < 2; ++i) idle.push_back(OpenIdleStream(*stub, "", "alpha-token-1"));
  // The streams take their slots when the server starts their handlers: poll (no timing
  // assumption beyond a generous deadline).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  absl::Status refused;
  for (;;) {
    refused = alpha->ListSessions().status();
    if (refused.code() == absl::StatusCode::kResourceExhausted) break;
    KV_ASSERT_OK(refused);
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "alpha's third call was not refused";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(absl::StrContains(refused.message(), "limits.max_calls_per_tenant")) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "alpha")) << refused;
  KV_ASSERT_OK(beta->ListSessions().status());  // another tenant is served meanwhile
  for (auto& s : idle) s->ctx.TryCancel();
  for (auto& s : idle) s->writer->Finish();
  const auto again = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  absl::Status st;
  do {
    st = alpha->ListSessions().status();
    if (st.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } while (std::chrono::steady_clock::now() < again);
  KV_ASSERT_OK(st);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace concurrency_test
}  // namespace kvshade::integration

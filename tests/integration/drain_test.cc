// Integration: a SIGTERM drain. Health turns NOT_SERVING at once; reads (GetSession,
// SelectAndReconstruct, Attend, GetStaticSet) keep working for the whole grace while a
// worker is attached; writes (CreateSession, ForkSession, Ingest, AppendTokens) get
// UNAVAILABLE; an idle Ingest stream is ended with UNAVAILABLE at once instead of holding
// the shutdown; the process exits 0 soon after the last attachment goes.
#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"

namespace kvshade::integration {
namespace drain_test {
namespace {

using Clock = std::chrono::steady_clock;

// The code an Ingest stream of just its header gets.
grpc::StatusCode IngestHeaderOnly(v1::KvShade::Stub& stub, const std::string& session_id) {
  grpc::ClientContext ctx;
  v1::IngestResponse resp;
  auto w = stub.Ingest(&ctx, &resp);
  v1::IngestRequest header;
  header.mutable_header()->set_session_id(session_id);
  w->Write(header);
  w->WritesDone();
  return w->Finish().error_code();
}

TEST(Drain, ServesReadsForTheGraceAndCutsIdleIngestStreams) {
  ServerProcess server;
  // A grace far longer than the checks below, so that a loaded machine cannot make the
  // drain end while they run (the attachment's detach ends it early, as the last check).
  KV_ASSERT_OK(server.Start({"--grace", "30"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(s.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  // An idle Ingest stream on a second session (header sent, then nothing).
  KV_ASSERT_OK_AND_ASSIGN(pending, c->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), 0)));
  auto stub = v1::KvShade::NewStub(c->channel());
  grpc::ClientContext idle_ctx;
  v1::IngestResponse idle_resp;
  auto idle = stub->Ingest(&idle_ctx, &idle_resp);
  v1::IngestRequest header;
  header.mutable_header()->set_session_id(pending.session_id());
  ASSERT_TRUE(idle->Write(header));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the server is reading it

  const auto t0 = Clock::now();
  server.Terminate();
  // The idle stream ends at once, with UNAVAILABLE and why.
  const grpc::Status cut = idle->Finish();
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::UNAVAILABLE) << cut.error_message();
  EXPECT_TRUE(absl::StrContains(cut.error_message(), "draining")) << cut.error_message();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(15));  // at once, not at the grace's end

  auto reader = server.Connect();  // a new connection during the drain is served too
  KV_ASSERT_OK_AND_ASSIGN(health, reader->CheckHealth());
  EXPECT_EQ(health, client::HealthStatus::kNotServing);
  // Reads for 3 s of the grace and at least 6 rounds (a slow machine, or a sanitizer build,
  // may need longer for them; the grace is 30 s); writes refused with UNAVAILABLE.
  int rounds = 0;
  while (rounds < 6 || Clock::now() - t0 < std::chrono::seconds(3)) {
    const auto got = reader->GetSession(s.session_id());
    ASSERT_TRUE(got.ok()) << "round " << rounds << ": " << got.status();
    const auto sel = reader->SelectAndReconstruct(MakeSelect(doc, 1, {att.attachment_id()}, 0, rounds, 512));
    ASSERT_TRUE(sel.ok()) << "round " << rounds << ": " << sel.status();
    v1::AttendRequest at;
    at.set_layer(0);
    auto* q = at.add_queries();
    q->set_attachment_id(att.attachment_id());
    const auto qv = doc.Query(0, 0, rounds, 512);
    *q->mutable_q() = client::MakeBf16Tensor({doc.spec().q_heads, doc.spec().head_dim}, absl::MakeConstSpan(qv));
    const auto out = reader->Attend(at);
    ASSERT_TRUE(out.ok()) << "round " << rounds << ": " << out.status();
    const auto st = reader->GetStaticSet(att.attachment_id(), 0);
    ASSERT_TRUE(st.ok()) << "round " << rounds << ": " << st.status();
    if (rounds % 10 == 0) {
      EXPECT_EQ(reader->ForkSession(s.session_id(), 512).status().code(), absl::StatusCode::kUnavailable);
      EXPECT_EQ(reader->AppendTokens(synthetic::MakeAppend(doc, s.session_id(), 0, 512, 520)).status().code(),
                absl::StatusCode::kUnavailable);
      EXPECT_EQ(reader->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), 1)).status().code(),
                absl::StatusCode::kUnavailable);
      EXPECT_EQ(IngestHeaderOnly(*stub, pending.session_id()), grpc::StatusCode::UNAVAILABLE);
    }
    ++rounds;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  // The last attachment goes: the server stops.
  KV_ASSERT_OK(reader->Detach(att.attachment_id()));
  EXPECT_EQ(server.WaitExit(absl::Seconds(10)), 0) << server.log();
  EXPECT_TRUE(absl::StrContains(server.log(), "reads served")) << server.log();
}

TEST(Drain, EndsOnceNoAttachmentIsLive) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--grace", "120"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  const auto t0 = Clock::now();
  EXPECT_EQ(server.Stop(absl::Seconds(100)), 0) << server.log();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(60));  // not the 120 s grace
}

// Idle clients (connected, no call in flight) do not hold the stop: gRPC's own stop waits for
// each of them to acknowledge its GOAWAY, which they do only seconds later (or at the
// grace's end), so with no call in flight the daemon gives its gRPC server's stop 0.2 s.
TEST(Drain, IdleClientsDoNotHoldTheStop) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--grace", "30"}));
  // A client that created and ingested a session, then went idle (no call in flight).
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK(CreateAndIngest(*c, doc, ShadowProfile(), -1).status());
  const auto t0 = Clock::now();
  EXPECT_EQ(server.Stop(absl::Seconds(40)), 0) << server.log();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(3)) << server.log();
  EXPECT_TRUE(absl::StrContains(server.log(), "0 calls in flight")) << server.log();
}

}  // namespace
}  // namespace drain_test
}  // namespace kvshade::integration

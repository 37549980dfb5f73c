// Integration: session semantics over the wire. Prefix reuse (a second create of the same
// document ingests nothing and answers exactly like the first; a question after the
// document reuses it), tenant isolation (bearer tokens; one tenant can never see, fork,
// attach, close or reuse another's sessions), and lease expiry and renewal.
#include <algorithm>
#include <thread>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"

namespace kvshade::integration {
namespace sessions_test {
namespace {

std::string Attach(client::Client& c, const std::string& sid, uint32_t lease_ms = 0) {
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("it");
  ar.set_lease_ms(lease_ms);
  auto a = c.Attach(ar);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? a->attachment_id() : "";
}

TEST(Sessions, PrefixReuseIngestsNothingAndAnswersIdentically) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(1024));
  const v1::Profile profile = ShadowProfile();

  KV_ASSERT_OK_AND_ASSIGN(first, CreateAndIngest(*c, doc, profile, -1));
  EXPECT_EQ(first.reused_tokens(), 0u);
  // The same document again: everything reused, nothing to ingest, ready at once.
  KV_ASSERT_OK_AND_ASSIGN(second, c->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
  EXPECT_EQ(second.reused_tokens(), 1024u);
  EXPECT_EQ(second.tokens_to_ingest(), 0u);
  KV_ASSERT_OK_AND_ASSIGN(info2, c->GetSession(second.session_id()));
  EXPECT_EQ(info2.state(), "ready");
  EXPECT_EQ(info2.reused_tokens(), 1024u);
  // A question after the document: the document part is reused, only the question sent.
  KV_ASSERT_OK_AND_ASSIGN(question, c->CreateSession(synthetic::MakeCreate(doc, profile, 0)));
  EXPECT_EQ(question.reused_tokens(), 1024u);
  EXPECT_EQ(question.tokens_to_ingest(), static_cast<uint64_t>(doc.spec().question_tokens));
  KV_ASSERT_OK_AND_ASSIGN(qi, synthetic::IngestRange(*c, doc, question.session_id(), 0, 1024,
                                                     1024 + doc.spec().question_tokens));
  EXPECT_EQ(qi.response.tokens(), 1024u + doc.spec().question_tokens);

  // Outputs of the first and second sessions are identical, call for call.
  const std::string a1 = Attach(*c, first.session_id()), a2 = Attach(*c, second.session_id());
  for (int step = 0; step < 4; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      KV_ASSERT_OK_AND_ASSIGN(r1, c->SelectAndReconstruct(MakeSelect(doc, l, {a1}, 1, step, 1024)));
      KV_ASSERT_OK_AND_ASSIGN(r2, c->SelectAndReconstruct(MakeSelect(doc, l, {a2}, 1, step, 1024)));
      ASSERT_EQ(r1.deltas_size(), 1);
      ASSERT_EQ(r2.deltas_size(), 1);
      const auto &d1 = r1.deltas(0), &d2 = r2.deltas(0);
      EXPECT_EQ(std::vector<int32_t>(d1.chunk().begin(), d1.chunk().end()),
                std::vector<int32_t>(d2.chunk().begin(), d2.chunk().end()));
      EXPECT_EQ(std::vector<uint32_t>(d1.slot().begin(), d1.slot().end()),
                std::vector<uint32_t>(d2.slot().begin(), d2.slot().end()));
      EXPECT_EQ(d1.keys().data(), d2.keys().data());
      EXPECT_EQ(d1.values().data(), d2.values().data());
      EXPECT_EQ(d1.hits(), d2.hits());
      v1::AttendRequest at;
      at.set_layer(l);
      for (const auto& a : {a1, a2}) {
        auto* q = at.add_queries();
        q->set_attachment_id(a);
        *q->mutable_q() = client::MakeBf16Tensor({doc.spec().q_heads, doc.spec().head_dim},
                                                 absl::MakeConstSpan(doc.Query(l, 1, step, 1024)));
      }
      KV_ASSERT_OK_AND_ASSIGN(o, c->Attend(at));
      ASSERT_EQ(o.outputs_size(), 2);
      EXPECT_EQ(o.outputs(0).data(), o.outputs(1).data());
    }
  }
  // Closing the first keeps the shared prefix alive for the others.
  KV_ASSERT_OK(c->Detach(a1));
  KV_ASSERT_OK(c->CloseSession(first.session_id()));
  KV_ASSERT_OK_AND_ASSIGN(after, c->SelectAndReconstruct(MakeSelect(doc, 0, {a2}, 1, 9, 1024)));
  EXPECT_EQ(after.deltas_size(), 1);
  KV_ASSERT_OK_AND_ASSIGN(third, c->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
  EXPECT_EQ(third.reused_tokens(), 1024u);
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_GE(stats.prefix_hits(), 3u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(Sessions, TenantsAreIsolated) {
  ServerProcess server;
  const std::string alice_token = "alice-token-0123456789", bob_token = "bob-token-9876543210";
  KV_ASSERT_OK(server.Start({"--tenant-token", "alice:" + alice_token, "--tenant-token", "bob:" + bob_token}));
  client::ClientOptions ao, bo, none, wrong;
  ao.bearer_token = alice_token;
  bo.bearer_token = bob_token;
  wrong.bearer_token = "not-a-real-token-000";
  auto alice = server.Connect(ao), bob = server.Connect(bo), anon = server.Connect(none),
       forger = server.Connect(wrong);
  const synthetic::Document doc(SmallDoc(1024));
  const v1::Profile profile = ShadowProfile();

  // Unauthenticated callers get nothing (health stays open for probes).
  EXPECT_EQ(anon->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(forger->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(anon->CreateSession(synthetic::MakeCreate(doc, profile, -1)).status().code(),
            absl::StatusCode::kUnauthenticated);
  KV_ASSERT_OK_AND_ASSIGN(h, anon->CheckHealth());
  EXPECT_EQ(h, client::HealthStatus::kServing);

  KV_ASSERT_OK_AND_ASSIGN(mine, CreateAndIngest(*alice, doc, profile, -1));
  const std::string sid = mine.session_id();
  const std::string att = Attach(*alice, sid);

  // Bob cannot see, fork, attach, append, close, ingest into, or use Alice's session or
  // attachment; "not found" (not "denied") so that ids do not leak.
  using C = absl::StatusCode;
  EXPECT_EQ(bob->GetSession(sid).status().code(), C::kNotFound);
  EXPECT_EQ(bob->ForkSession(sid, 1024).status().code(), C::kNotFound);
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  EXPECT_EQ(bob->Attach(ar).status().code(), C::kNotFound);
  EXPECT_EQ(bob->AppendTokens(synthetic::MakeAppend(doc, sid, 0, 1024, 1028)).status().code(), C::kNotFound);
  EXPECT_EQ(bob->CloseSession(sid).code(), C::kNotFound);
  EXPECT_EQ(bob->GetStaticSet(att, 0).status().code(), C::kNotFound);
  EXPECT_EQ(bob->SelectAndReconstruct(MakeSelect(doc, 0, {att}, 0, 0, 1024)).status().code(), C::kNotFound);
  EXPECT_EQ(bob->Detach(att).code(), C::kNotFound);
  {
    std::vector<v1::IngestRequest> msgs(1);
    msgs[0].mutable_header()->set_session_id(sid);
    EXPECT_EQ(bob->Ingest(msgs).status().code(), C::kNotFound);
  }
  KV_ASSERT_OK_AND_ASSIGN(bob_list, bob->ListSessions());
  EXPECT_EQ(bob_list.sessions_size(), 0);
  // Bob's prefix lookups and creates of the same document reuse nothing of Alice's.
  v1::LookupPrefixRequest lookup;
  *lookup.mutable_model() = doc.Model();
  *lookup.mutable_profile() = profile;
  lookup.mutable_token_ids()->Assign(doc.tokens().begin(), doc.tokens().end());
  KV_ASSERT_OK_AND_ASSIGN(bob_lookup, bob->LookupPrefix(lookup));
  EXPECT_EQ(bob_lookup.reusable_tokens(), 0u);
  KV_ASSERT_OK_AND_ASSIGN(alice_lookup, alice->LookupPrefix(lookup));
  EXPECT_EQ(alice_lookup.reusable_tokens(), 1024u);
  KV_ASSERT_OK_AND_ASSIGN(bob_created, bob->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
  EXPECT_EQ(bob_created.reused_tokens(), 0u);
  EXPECT_EQ(bob_created.tokens_to_ingest(), 1024u);
  // Stats are per tenant: each sees its own session and attachments, not the other's.
  KV_ASSERT_OK_AND_ASSIGN(bob_stats, bob->Stats());
  EXPECT_EQ(bob_stats.sessions(), 1u);
  EXPECT_EQ(bob_stats.attachments(), 0u);
  EXPECT_EQ(bob_stats.segments(), 0u);  // his session is still ingesting
  EXPECT_EQ(bob_stats.host_bytes_used(), 0u);
  KV_ASSERT_OK_AND_ASSIGN(alice_stats, alice->Stats());
  EXPECT_EQ(alice_stats.sessions(), 1u);
  EXPECT_EQ(alice_stats.attachments(), 1u);
  EXPECT_EQ(alice_stats.segments(), 1u);
  EXPECT_GT(alice_stats.host_bytes_used(), 0u);
  // Alice still sees exactly her session, and it still works.
  KV_ASSERT_OK_AND_ASSIGN(alice_list, alice->ListSessions());
  ASSERT_EQ(alice_list.sessions_size(), 1);
  EXPECT_EQ(alice_list.sessions(0).session_id(), sid);
  KV_ASSERT_OK_AND_ASSIGN(sel, alice->SelectAndReconstruct(MakeSelect(doc, 0, {att}, 0, 0, 1024)));
  EXPECT_EQ(sel.deltas_size(), 1);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(Sessions, LeasesExpireUnlessRenewedByUse) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--default-lease-ms", "400", "--max-lease-ms", "5000"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  const std::string sid = s.session_id();

  // A 2 s lease used every 50 ms lives well past its length. (The lease is long so that a
  // loaded machine never stalls two consecutive calls by that much; a stall could only make
  // `busy` expire, failing the test, never pass it wrongly.)
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_lease_ms(2000);
  KV_ASSERT_OK_AND_ASSIGN(busy, c->Attach(ar));
  // A default-lease (400 ms) attachment that is never used.
  ar.set_lease_ms(0);
  ar.set_writer(true);
  KV_ASSERT_OK_AND_ASSIGN(idle, c->Attach(ar));
  EXPECT_TRUE(idle.writer());
  const auto start = std::chrono::system_clock::now();
  EXPECT_LE(static_cast<int64_t>(idle.lease_expires_unix_ms()),
            std::chrono::duration_cast<std::chrono::milliseconds>(start.time_since_epoch()).count() + 400 + 50);
  const auto busy_expiry = std::chrono::system_clock::time_point(std::chrono::milliseconds(busy.lease_expires_unix_ms()));
  int step = 0;
  // Keep `busy` alive past both its own first expiry and the idle lease's (deadlines on the
  // clock that a slow machine only overshoots: the idle one is then more expired).
  const auto idle_expiry = std::chrono::system_clock::time_point(std::chrono::milliseconds(idle.lease_expires_unix_ms()));
  const auto until = std::max(idle_expiry, busy_expiry) + std::chrono::milliseconds(200);
  while (std::chrono::system_clock::now() < until) {
    KV_ASSERT_OK_AND_ASSIGN(r, c->SelectAndReconstruct(MakeSelect(doc, 0, {busy.attachment_id()}, 0, step++, 512)));
    EXPECT_EQ(r.deltas_size(), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_GT(step, 1);
  // The idle one expired: using it says so; the writer slot is free again.
  const auto expired = c->SelectAndReconstruct(MakeSelect(doc, 0, {idle.attachment_id()}, 0, 0, 512));
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kFailedPrecondition) << expired.status();
  EXPECT_NE(expired.status().message().find("expired"), std::string::npos) << expired.status();
  KV_ASSERT_OK_AND_ASSIGN(writer2, c->Attach(ar));
  EXPECT_TRUE(writer2.writer());
  // The busy one is still alive.
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.attachments(), 2u);
  KV_ASSERT_OK(c->Detach(busy.attachment_id()));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace sessions_test
}  // namespace kvshade::integration

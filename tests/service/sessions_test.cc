// Sessions, tenants and attachments: isolation, limits, leases renewed by use and expiring
// (fake clock, no sleeps), detach, close and drain.
#include "kvshade/service/session_manager.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace sessions_test {
namespace {

TEST(SessionManagerTest, LeasesAreRenewedByUseAndExpire) {
  LimitsConfig limits;
  int64_t now = 1000;
  SessionManager sm(limits, [&] { return now; });
  auto s = std::make_shared<Session>();
  s->id = SessionManager::NewId();
  s->tenant = "alice";
  s->model.layers = 1;
  ASSERT_TRUE(sm.AddSession(s).ok());
  auto a = sm.Attach("alice", s, "w1", 1000, false);
  ASSERT_TRUE(a.ok());
  now += 900;
  EXPECT_TRUE(sm.Use("alice", (*a)->id).ok());  // renewed to now + 1000
  now += 900;
  EXPECT_TRUE(sm.Use("alice", (*a)->id).ok());
  now += 1001;
  auto expired = sm.Use("alice", (*a)->id);
  EXPECT_EQ(expired.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(expired.status().message().find("lease expired"), std::string::npos);
  EXPECT_EQ(sm.Counts().attachments, 0u);
  EXPECT_EQ(sm.Use("alice", "nope").status().code(), absl::StatusCode::kNotFound);
  // Another tenant never learns about it.
  EXPECT_EQ(sm.Use("bob", (*a)->id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(sm.Attach("alice", s, "w2", limits.max_lease_ms + 1, false).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SessionManagerTest, WriterRoleAndAttachmentLimit) {
  LimitsConfig limits;
  limits.max_attachments_per_session = 2;
  int64_t now = 0;
  SessionManager sm(limits, [&] { return now; });
  auto s = std::make_shared<Session>();
  s->id = "s1";
  s->tenant = "alice";
  s->model.layers = 1;
  ASSERT_TRUE(sm.AddSession(s).ok());
  auto w = sm.Attach("alice", s, "writer", 100, true);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(sm.Attach("alice", s, "other", 100, true).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto r = sm.Attach("alice", s, "reader", 100, false);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(sm.Attach("alice", s, "third", 100, false).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(sm.CheckWriter("alice", *s, (*w)->id).ok());
  EXPECT_EQ(sm.CheckWriter("alice", *s, (*r)->id).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(sm.CheckWriter("alice", *s, "").code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(sm.Detach("alice", (*w)->id).ok());
  EXPECT_TRUE(sm.CheckWriter("alice", *s, "").ok());
  EXPECT_EQ(sm.Detach("alice", (*w)->id).code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, TenantsAreIsolated) {
  Harness hx;
  Stream s = MakeStream(100, hx.model, 41);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_TRUE(hx.engine->GetSession(hx.tenant, gr).ok());
  EXPECT_EQ(hx.engine->GetSession(hx.other, gr).status().code(), absl::StatusCode::kNotFound);
  v1::AttachRequest ar;
  ar.set_session_id(o.session);
  EXPECT_EQ(hx.engine->Attach(hx.other, ar).status().code(), absl::StatusCode::kNotFound);
  v1::CloseSessionRequest cr;
  cr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->CloseSession(hx.other, cr).status().code(), absl::StatusCode::kNotFound);
  v1::DetachRequest dr;
  dr.set_attachment_id(o.attachment);
  EXPECT_EQ(hx.engine->Detach(hx.other, dr).status().code(), absl::StatusCode::kNotFound);
  v1::GetStaticSetRequest sr;
  sr.set_attachment_id(o.attachment);
  EXPECT_EQ(hx.engine->GetStaticSet(hx.other, sr).status().code(), absl::StatusCode::kNotFound);
  v1::ListSessionsRequest lr;
  EXPECT_EQ(hx.engine->ListSessions(hx.tenant, lr)->sessions_size(), 1);
  EXPECT_EQ(hx.engine->ListSessions(hx.other, lr)->sessions_size(), 0);
  // Close: the session and its attachments are gone.
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok());
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(hx.engine->GetStaticSet(hx.tenant, sr).status().code(), absl::StatusCode::kNotFound);
}

TEST(SessionsTest, SessionLimitPerTenantAndLeaseExpiryThroughTheEngine) {
  Harness hx;
  hx.config.limits.max_sessions_per_tenant = 2;
  hx.Restart();
  Stream s = MakeStream(64, hx.model, 42);
  auto a = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  auto b = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_EXACT);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("max_sessions_per_tenant"), std::string::npos);
  EXPECT_TRUE(hx.engine->CreateSession(hx.other, cr).ok());  // other tenants unaffected

  // Default lease 30 s, renewed by every use.
  const auto q = hx.Query(1);
  hx.now_ms += 20'000;
  ASSERT_TRUE(hx.Attend(a.attachment, 0, q).ok());
  hx.now_ms += 20'000;
  ASSERT_TRUE(hx.Attend(a.attachment, 0, q).ok());
  hx.now_ms += 30'001;
  EXPECT_EQ(hx.Attend(a.attachment, 0, q).status().code(), absl::StatusCode::kFailedPrecondition);
  v1::GetSessionRequest gr;
  gr.set_session_id(a.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->attachments(), 0u);
  EXPECT_TRUE(hx.engine->GetSession(hx.tenant, gr).ok());  // the session itself stays
}

TEST(SessionsTest, DrainRefusesNewWork) {
  Harness hx;
  Stream s = MakeStream(64, hx.model, 43);
  auto a = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT));
  ASSERT_TRUE(hx.engine->Drain().ok());
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  EXPECT_EQ(hx.engine->CreateSession(hx.tenant, cr).status().code(), absl::StatusCode::kUnavailable);
  v1::AttachRequest ar;
  ar.set_session_id(a.session);
  EXPECT_EQ(hx.engine->Attach(hx.tenant, ar).status().code(), absl::StatusCode::kUnavailable);
  // Reads still work while draining.
  EXPECT_TRUE(hx.Attend(a.attachment, 0, hx.Query(2)).ok());
  EXPECT_TRUE(hx.engine->Drain().ok());  // idempotent
}


// Creates a session over all of `s` and ingests it; returns the session id, or the first
// error.
absl::StatusOr<std::string> CreateAndIngest(Harness& hx, const Stream& s, const Tenant& t) {
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_SHADOW);
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto c = hx.engine->CreateSession(t, cr);
  if (!c.ok()) return c.status();
  auto ing = hx.engine->Ingest(t, IngestStreamOf(c->session_id(), s, 0, s.n()));
  if (!ing.ok()) return ing.status();
  return c->session_id();
}

uint64_t Reusable(Harness& hx, const Stream& s) {
  v1::LookupPrefixRequest r;
  *r.mutable_model() = hx.model;
  *r.mutable_profile() = ProfileOf(v1::PROFILE_KIND_SHADOW);
  r.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto l = hx.engine->LookupPrefix(hx.tenant, r);
  EXPECT_TRUE(l.ok()) << l.status();
  return l.ok() ? l->reusable_tokens() : ~0ull;
}

TEST(SessionsTest, ClosedSessionsMakeRoomOnTheHostTierWithoutASpillTier) {
  // 1 MiB of host memory holds the values of four 512-token shadow sessions (about 248 KiB
  // each), and there is no spill tier.
  Harness hx;
  hx.config.host_budget_bytes = 1 << 20;
  hx.Restart();
  std::vector<Stream> docs;
  for (int i = 0; i < 6; ++i) docs.push_back(MakeStream(512, hx.model, 80 + i, 16, 1000 + 10000 * i));
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    auto id = CreateAndIngest(hx, docs[i], hx.tenant);
    ASSERT_TRUE(id.ok()) << i << ": " << id.status();
    ids.push_back(*id);
  }
  // A fifth does not fit while the four are open (their segments are in use).
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = ProfileOf(v1::PROFILE_KIND_SHADOW);
  cr.mutable_token_ids()->Add(docs[4].tokens.begin(), docs[4].tokens.end());
  auto fifth = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(fifth.ok()) << fifth.status();
  const auto fifth_stream = IngestStreamOf(fifth->session_id(), docs[4], 0, 512);
  auto refused = hx.engine->Ingest(hx.tenant, fifth_stream);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();

  // Closing two: their segments stay cached (reusable) until the memory is needed ...
  for (int i = 0; i < 2; ++i) {
    v1::CloseSessionRequest close;
    close.set_session_id(ids[i]);
    ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, close).ok());
  }
  EXPECT_EQ(Reusable(hx, docs[1]), 512u);
  // ... then the least recently used one goes first (docs[1] was just looked up).
  auto ing = hx.engine->Ingest(hx.tenant, fifth_stream);
  ASSERT_TRUE(ing.ok()) << ing.status();
  EXPECT_EQ(Reusable(hx, docs[0]), 0u);
  EXPECT_EQ(Reusable(hx, docs[1]), 512u);
  auto sixth = CreateAndIngest(hx, docs[5], hx.tenant);
  ASSERT_TRUE(sixth.ok()) << sixth.status();
  EXPECT_EQ(Reusable(hx, docs[1]), 0u);

  auto stats = hx.engine->Stats(hx.tenant, {});
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->sessions(), 4u);
  EXPECT_EQ(stats->segments(), 4u);
  EXPECT_LE(stats->host_bytes_used(), stats->host_bytes_budget());
  // Segments of open sessions were never touched.
  for (int i = 2; i < 4; ++i) EXPECT_EQ(Reusable(hx, docs[i]), 512u) << i;
  const std::string att = hx.AttachTo(ids[2]);
  EXPECT_TRUE(hx.Attend(att, 1, hx.Query(3)).ok());
  // And with every session open again, nothing is evictable: refused, not evicted.
  auto seventh = CreateAndIngest(hx, docs[0], hx.tenant);
  EXPECT_EQ(seventh.status().code(), absl::StatusCode::kResourceExhausted) << seventh.status();
  EXPECT_EQ(Reusable(hx, docs[2]), 512u);
}

TEST(SessionsTest, StatsCountOnlyTheCallersSessions) {
  Harness hx;
  Stream a1 = MakeStream(512, hx.model, 91, 16, 1000);
  Stream a2 = MakeStream(512, hx.model, 92, 16, 50000);
  Stream b1 = MakeStream(512, hx.model, 93, 16, 90000);
  const v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  auto oa1 = hx.Open(a1, p);
  auto oa2 = hx.Open(a2, p);
  auto ob = hx.Open(b1, p, -1, false, &hx.other);
  // Bob selects twice, Alice once.
  auto select = [&](const Tenant& t, const std::string& att, uint64_t seed) {
    v1::SelectAndReconstructRequest r;
    r.set_layer(0);
    auto* sq = r.add_queries();
    sq->set_attachment_id(att);
    *sq->mutable_q() = ToTensor(hx.Query(seed), {hx.model.num_query_heads(), hx.model.head_dim()});
    auto resp = hx.engine->SelectAndReconstruct(t, r);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp.ok() ? uint64_t(resp->deltas(0).selected()) : 0;
  };
  const uint64_t bob_selected = select(hx.other, ob.attachment, 1) + select(hx.other, ob.attachment, 2);
  const uint64_t alice_selected = select(hx.tenant, oa1.attachment, 3);
  ASSERT_GT(bob_selected, 0u);
  // Bob detaches: what his attachment selected still counts.
  v1::DetachRequest dr;
  dr.set_attachment_id(ob.attachment);
  ASSERT_TRUE(hx.engine->Detach(hx.other, dr).ok());

  auto bob = hx.engine->Stats(hx.other, {});
  auto alice = hx.engine->Stats(hx.tenant, {});
  const Tenant carol{"carol", TenantSalt("carol", "")};
  auto none = hx.engine->Stats(carol, {});
  ASSERT_TRUE(bob.ok() && alice.ok() && none.ok());
  EXPECT_EQ(bob->sessions(), 1u);
  EXPECT_EQ(bob->attachments(), 0u);
  EXPECT_EQ(bob->segments(), 1u);
  EXPECT_EQ(bob->prefix_lookups(), 1u);
  EXPECT_EQ(bob->prefix_hits(), 0u);
  EXPECT_EQ(bob->chunks_selected(), bob_selected);
  EXPECT_GT(bob->host_bytes_used(), 0u);
  EXPECT_GT(bob->device_bytes_used(), 0u);
  EXPECT_EQ(alice->sessions(), 2u);
  EXPECT_EQ(alice->attachments(), 2u);
  EXPECT_EQ(alice->segments(), 2u);
  EXPECT_EQ(alice->prefix_lookups(), 2u);
  EXPECT_EQ(alice->chunks_selected(), alice_selected);
  // Same geometry and length: Alice's two sessions hold twice Bob's one.
  EXPECT_EQ(alice->host_bytes_used(), 2 * bob->host_bytes_used());
  EXPECT_GT(alice->device_bytes_used(), bob->device_bytes_used());
  // A tenant with nothing sees nothing of the others, only the server's budgets.
  EXPECT_EQ(none->sessions(), 0u);
  EXPECT_EQ(none->attachments(), 0u);
  EXPECT_EQ(none->segments(), 0u);
  EXPECT_EQ(none->host_bytes_used(), 0u);
  EXPECT_EQ(none->device_bytes_used(), 0u);
  EXPECT_EQ(none->spilled_bytes(), 0u);
  EXPECT_EQ(none->prefix_lookups(), 0u);
  EXPECT_EQ(none->chunks_selected(), 0u);
  EXPECT_EQ(none->chunk_hits(), 0u);
  EXPECT_EQ(none->host_bytes_budget(), hx.config.host_budget_bytes);
  EXPECT_EQ(none->device_bytes_budget(), bob->device_bytes_budget());
  EXPECT_EQ(none->backend(), "cpu");
}

}  // namespace
}  // namespace sessions_test
}  // namespace kvshade::service::testing

// Idle expiry of sessions (limits.session_idle_ttl_s): a session no call has touched
// (create, ingest, append, attach, a decode call, GetSession) for the TTL and with no live
// attachment is closed by the engine's maintenance, durable ones with their record, and
// counted in kvshade_sessions_expired_total. 0 (the default) never expires anything.
// Fake clock, maintenance run by hand.
#include <filesystem>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace idle_expiry_test {
namespace {

constexpr int64_t kTtlS = 100;
constexpr int64_t kS = 1000;  // ms



// Tokens of their own per seed: no session reuses another's prefix.
Stream Doc(const Harness& hx, int n, int seed) { return MakeStream(n, hx.model, seed, 16, seed * 1000); }

v1::CreateSessionRequest CreateRequest(const Harness& hx, const Stream& s, int n, bool durable) {
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = SmallShadowProfile();
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + n);
  cr.set_durable(durable);
  return cr;
}

// A ready session of the first `n` tokens of `s` (nothing reused: each stream differs),
// without an attachment.
std::string Ready(Harness& hx, const Stream& s, int n = 256, bool durable = false) {
  auto c = hx.engine->CreateSession(hx.tenant, CreateRequest(hx, s, n, durable));
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return "";
  auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, int(c->reused_tokens()), n));
  EXPECT_TRUE(ing.ok()) << ing.status();
  return c->session_id();
}

bool Alive(Harness& hx, const std::string& session) {
  // Not GetSession: that would touch it.
  v1::ListSessionsRequest lr;
  auto list = hx.engine->ListSessions(hx.tenant, lr);
  EXPECT_TRUE(list.ok()) << list.status();
  for (const auto& s : list->sessions()) {
    if (s.session_id() == session) return true;
  }
  return false;
}

// Advances the fake clock to t0 + `seconds` and runs the maintenance.
void At(Harness& hx, int64_t t0, double seconds) {
  hx.now_ms = t0 + static_cast<int64_t>(seconds * kS);
  hx.engine->RunMaintenance();
}

TEST(IdleExpiry, OffByDefault) {
  Harness hx;
  ASSERT_EQ(hx.config.limits.session_idle_ttl_s, 0u);
  const std::string s = Ready(hx, Doc(hx, 256, 201));
  At(hx, hx.now_ms, 30.0 * 24 * 3600);  // a month
  EXPECT_TRUE(Alive(hx, s));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 0);
}

TEST(IdleExpiry, AnUntouchedSessionGoesAfterTheTtlAndIsCounted) {
  Harness hx;
  hx.config.limits.session_idle_ttl_s = kTtlS;
  const int64_t t0 = hx.now_ms;
  const Stream sa = Doc(hx, 256, 202), sb = Doc(hx, 256, 203),
               sc = Doc(hx, 300, 204);
  const std::string a = Ready(hx, sa), b = Ready(hx, sb), c = Ready(hx, sc, 256);
  v1::GetSessionRequest gb;
  gb.set_session_id(b);

  At(hx, t0, 60);
  // GetSession touches b; an append (no attachment) touches c; listing touches nothing.
  ASSERT_TRUE(hx.engine->GetSession(hx.tenant, gb).ok());
  v1::AppendTokensRequest ar;
  ar.set_session_id(c);
  const size_t tok = size_t(hx.model.num_kv_heads()) * hx.model.head_dim();
  for (int t = 256; t < 260; ++t) ar.add_token_ids(sc.tokens[t]);
  for (int l = 0; l < hx.model.num_layers(); ++l) {
    auto* lk = ar.add_layers();
    lk->set_layer(l);
    const std::vector<int64_t> shape = {4, hx.model.num_kv_heads(), hx.model.head_dim()};
    *lk->mutable_k() = ToTensor({sc.k[l].begin() + 256 * tok, sc.k[l].begin() + 260 * tok}, shape);
    *lk->mutable_v() = ToTensor({sc.v[l].begin() + 256 * tok, sc.v[l].begin() + 260 * tok}, shape);
  }
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
  EXPECT_TRUE(Alive(hx, a));

  At(hx, t0, kTtlS - 1);
  EXPECT_TRUE(Alive(hx, a));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 0);
  At(hx, t0, kTtlS + 1);
  EXPECT_FALSE(Alive(hx, a));
  v1::GetSessionRequest ga;
  ga.set_session_id(a);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, ga).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Alive(hx, b));
  EXPECT_TRUE(Alive(hx, c));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 1);
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions"), 2);

  At(hx, t0, 60 + kTtlS - 1);
  EXPECT_TRUE(Alive(hx, b));
  EXPECT_TRUE(Alive(hx, c));
  At(hx, t0, 60 + kTtlS + 1);
  EXPECT_FALSE(Alive(hx, b));
  EXPECT_FALSE(Alive(hx, c));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 3);
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions"), 0);

  // The tenant's session count is freed too: the limit counts only what is left.
  hx.config.limits.max_sessions_per_tenant = 1;
  hx.Restart();
  hx.config.limits.session_idle_ttl_s = kTtlS;
  const std::string again = Ready(hx, sa);
  At(hx, hx.now_ms, kTtlS + 1);
  EXPECT_FALSE(Alive(hx, again));
  EXPECT_FALSE(Ready(hx, sb).empty());  // room for one more
}

TEST(IdleExpiry, LiveAttachmentsAndDecodeCallsKeepASessionAlive) {
  Harness hx;
  hx.config.limits.session_idle_ttl_s = kTtlS;
  const int64_t t0 = hx.now_ms;
  const std::string held = Ready(hx, Doc(hx, 256, 205));
  const std::string leased = Ready(hx, Doc(hx, 256, 206));
  auto attach = [&](const std::string& session, uint32_t lease_ms) {
    v1::AttachRequest r;
    r.set_session_id(session);
    r.set_worker_id("w");
    r.set_lease_ms(lease_ms);
    auto a = hx.engine->Attach(hx.tenant, r);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : "";
  };
  const std::string worker = attach(held, 300 * kS);
  attach(leased, 10 * kS);

  // Idle for twice the TTL, but attached: kept.
  At(hx, t0, 2 * kTtlS);
  EXPECT_TRUE(Alive(hx, held));
  // The other one's lease ended at 10 s; its attach touched it at 0 s.
  EXPECT_FALSE(Alive(hx, leased));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 1);

  // A decode call touches the session (and renews the lease); after the detach the TTL
  // counts from that call.
  const auto q = hx.Query(7);
  ASSERT_TRUE(hx.Attend(worker, 0, q).ok());
  v1::DetachRequest dr;
  dr.set_attachment_id(worker);
  ASSERT_TRUE(hx.engine->Detach(hx.tenant, dr).ok());
  At(hx, t0, 2 * kTtlS + kTtlS - 1);
  EXPECT_TRUE(Alive(hx, held));
  At(hx, t0, 2 * kTtlS + kTtlS + 1);
  EXPECT_FALSE(Alive(hx, held));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 2);
}

TEST(IdleExpiry, AnOpenIngestStreamKeepsItsSessionAlive) {
  Harness hx;
  hx.config.limits.session_idle_ttl_s = kTtlS;
  const int64_t t0 = hx.now_ms;
  const Stream s = Doc(hx, 256, 207);
  auto c = hx.engine->CreateSession(hx.tenant, CreateRequest(hx, s, 256, false));
  ASSERT_TRUE(c.ok()) << c.status();
  const std::string never = hx.engine->CreateSession(hx.tenant, CreateRequest(hx, Doc(hx, 256, 208), 256, false))
                                ->session_id();
  const std::vector<v1::IngestRequest> msgs = IngestStreamOf(c->session_id(), s, 0, 256);
  auto stream = hx.engine->BeginIngest(hx.tenant, msgs[0]);
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (size_t i = 1; i < msgs.size(); ++i) {
    At(hx, t0, double(i) * 2 * kTtlS / double(msgs.size()));  // a slow client
    ASSERT_TRUE((*stream)->Add(msgs[i]).ok());
  }
  At(hx, t0, 2 * kTtlS);
  EXPECT_TRUE(Alive(hx, c->session_id()));
  EXPECT_FALSE(Alive(hx, never));  // created, never ingested, never touched again
  ASSERT_TRUE((*stream)->Finish().ok());
  stream->reset();
  At(hx, t0, 2 * kTtlS + kTtlS - 1);
  EXPECT_TRUE(Alive(hx, c->session_id()));
  At(hx, t0, 2 * kTtlS + kTtlS + 2);
  EXPECT_FALSE(Alive(hx, c->session_id()));
}

TEST(IdleExpiry, DurableSessionsGoWithTheirRecord) {
  TempDir dir;
  Harness hx(dir.path());
  hx.config.limits.session_idle_ttl_s = kTtlS;
  const int64_t t0 = hx.now_ms;
  const std::string idle = Ready(hx, Doc(hx, 256, 209), 256, /*durable=*/true);
  const std::string used = Ready(hx, Doc(hx, 256, 210), 256, /*durable=*/true);
  At(hx, t0, 60);
  v1::GetSessionRequest gr;
  gr.set_session_id(used);
  ASSERT_TRUE(hx.engine->GetSession(hx.tenant, gr).ok());
  At(hx, t0, kTtlS + 1);
  EXPECT_FALSE(Alive(hx, idle));
  EXPECT_TRUE(Alive(hx, used));
  EXPECT_EQ(MetricValue(hx, "kvshade_sessions_expired_total"), 1);

  // A new engine over the same spill tier restores only the session that was kept.
  hx.Restart();
  EXPECT_FALSE(Alive(hx, idle));
  EXPECT_TRUE(Alive(hx, used));
}

}  // namespace
}  // namespace idle_expiry_test
}  // namespace kvshade::service::testing

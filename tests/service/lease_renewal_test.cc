// Leases are renewed by every use of the attachment (docs/API.md "Workers"): here by
// GetStaticSet and by AppendTokens alone, on the fake clock, against a twin attachment that
// is not used and expires.
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace lease_renewal_test {
namespace {

constexpr int64_t kLeaseMs = 30'000;  // the default lease (limits.default_lease_ms)

absl::Status StaticSet(Harness& hx, const std::string& attachment) {
  v1::GetStaticSetRequest r;
  r.set_attachment_id(attachment);
  r.set_layer(0);
  return hx.engine->GetStaticSet(hx.tenant, r).status();
}

v1::AppendTokensRequest OneToken(const std::string& session, const std::string& attachment, const Stream& s,
                                 int at) {
  v1::AppendTokensRequest r;
  r.set_session_id(session);
  r.set_attachment_id(attachment);
  r.add_token_ids(s.tokens[at]);
  const size_t tok = size_t(s.h) * s.d;
  for (int l = 0; l < s.L; ++l) {
    auto* lk = r.add_layers();
    lk->set_layer(l);
    std::vector<bf16> k(s.k[l].begin() + at * tok, s.k[l].begin() + (at + 1) * tok);
    std::vector<bf16> v(s.v[l].begin() + at * tok, s.v[l].begin() + (at + 1) * tok);
    *lk->mutable_k() = ToTensor(k, {1, s.h, s.d});
    *lk->mutable_v() = ToTensor(v, {1, s.h, s.d});
  }
  return r;
}

void ExpectExpired(const absl::Status& st) {
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("expired"), std::string::npos) << st;
}

TEST(LeaseRenewal, GetStaticSetRenewsTheLease) {
  Harness hx;
  Stream s = MakeStream(300, hx.model, 91);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_SHADOW));
  const std::string idle = hx.AttachTo(o.session);
  // Used every 2/3 of a lease for three leases: alive throughout.
  for (int i = 0; i < 5; ++i) {
    hx.now_ms += kLeaseMs * 2 / 3;
    ASSERT_TRUE(StaticSet(hx, o.attachment).ok()) << "use " << i << ": " << StaticSet(hx, o.attachment);
  }
  ExpectExpired(StaticSet(hx, idle));
  EXPECT_TRUE(hx.Select(o.attachment, 1, hx.Query(1)).ok());
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->attachments(), 1u);
}

TEST(LeaseRenewal, AppendTokensRenewsTheWritersLease) {
  Harness hx;
  Stream s = MakeStream(320, hx.model, 92);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_SHADOW), 300);
  const std::string writer = hx.AttachTo(o.session, /*writer=*/true);
  for (int i = 0; i < 5; ++i) {
    hx.now_ms += kLeaseMs * 2 / 3;
    auto r = hx.engine->AppendTokens(hx.tenant, OneToken(o.session, writer, s, 300 + i));
    ASSERT_TRUE(r.ok()) << "append " << i << ": " << r.status();
    EXPECT_EQ(r->tokens(), uint64_t(301 + i));
  }
  // The reader attachment Open made was never used: expired; the writer is still the writer.
  ExpectExpired(StaticSet(hx, o.attachment));
  v1::AttachRequest second;
  second.set_session_id(o.session);
  second.set_writer(true);
  EXPECT_EQ(hx.engine->Attach(hx.tenant, second).status().code(), absl::StatusCode::kFailedPrecondition);
  // Left alone for a whole lease, it expires too and the role is free.
  hx.now_ms += kLeaseMs + 1;
  ExpectExpired(hx.engine->AppendTokens(hx.tenant, OneToken(o.session, writer, s, 305)).status());
  EXPECT_TRUE(hx.engine->Attach(hx.tenant, second).ok());
}

}  // namespace
}  // namespace lease_renewal_test
}  // namespace kvshade::service::testing

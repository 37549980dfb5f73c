// Prefix reuse and fork: a second session over the same document ingests nothing and
// answers bit-identically; question sessions project onto the cached basis; forks share
// segments at boundaries or at the end; prefixes are scoped by tenant.
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace prefix_fork_test {
namespace {

constexpr int kG = 2;

v1::Profile FullShadow() {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_sparse_budget(16);
  p.set_outliers(2);
  return p;
}

TEST(PrefixForkTest, SameDocumentIsReusedWithIdenticalOutputs) {
  Harness hx;
  Stream s = MakeStream(600, hx.model, 31);  // document = first 512 tokens (2 blocks)
  auto a = hx.Open(s, FullShadow(), 512);
  EXPECT_EQ(a.reused, 0u);
  auto b = hx.Open(s, FullShadow(), 512);
  EXPECT_EQ(b.reused, 512u);
  const auto q = hx.Query(70);
  for (int l = 0; l < 2; ++l) {
    auto oa = hx.Attend(a.attachment, l, q), ob = hx.Attend(b.attachment, l, q);
    ASSERT_TRUE(oa.ok() && ob.ok());
    ExpectSameBits(*oa, *ob);
    auto da = hx.Select(a.attachment, l, q), db = hx.Select(b.attachment, l, q);
    ASSERT_TRUE(da.ok() && db.ok());
    EXPECT_EQ(da->SerializeAsString().size(), db->SerializeAsString().size());
    EXPECT_EQ(da->keys().data(), db->keys().data());
    EXPECT_EQ(da->values().data(), db->values().data());
  }
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = hx.model;
  *lr.mutable_profile() = FullShadow();
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  auto lk = hx.engine->LookupPrefix(hx.tenant, lr);
  ASSERT_TRUE(lk.ok());
  EXPECT_EQ(lk->reusable_tokens(), 512u);
  EXPECT_EQ(lk->cached_segments(), 1u);
  // Another tenant shares nothing (its salt differs).
  EXPECT_EQ(hx.engine->LookupPrefix(hx.other, lr)->reusable_tokens(), 0u);
  // Another profile shares nothing either.
  v1::Profile p2 = FullShadow();
  p2.set_rank(64);
  *lr.mutable_profile() = p2;
  EXPECT_EQ(hx.engine->LookupPrefix(hx.tenant, lr)->reusable_tokens(), 0u);
  // Closing the first session keeps the shared segment alive for the second.
  v1::CloseSessionRequest cr;
  cr.set_session_id(a.session);
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok());
  EXPECT_TRUE(hx.Attend(b.attachment, 0, q).ok());
}

TEST(PrefixForkTest, QuestionSuffixIsProjectedOntoTheCachedBasis) {
  Harness hx;
  Stream s = MakeStream(600, hx.model, 32);
  auto doc = hx.Open(s, FullShadow(), 512);
  auto qa = hx.Open(s, FullShadow(), 600);
  EXPECT_EQ(qa.reused, 512u);
  ASSERT_EQ(qa.ingest.residual_energy_size(), 2);
  for (float r : qa.ingest.residual_energy()) EXPECT_LT(r, 1e-3);  // full-rank basis
  EXPECT_FALSE(qa.ingest.refactorization_scheduled());
  v1::GetSessionRequest gr;
  gr.set_session_id(qa.session);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  EXPECT_EQ(info->reused_tokens(), 512u);
  EXPECT_EQ(info->tokens(), 600u);
  v1::Profile all = FullShadow();
  all.set_sparse_budget(256);
  // With every chunk selected the answer is exact attention over the 600 tokens.
  auto full = hx.Open(s, all, 600);
  const auto q = hx.Query(80);
  auto out = hx.Attend(full.attachment, 1, q);
  ASSERT_TRUE(out.ok());
  EXPECT_LT(RelErr(*out, ExactAttend(s, 1, kG, q, 600)), 2e-2);
}

TEST(PrefixForkTest, ForkAtBoundaryAndAtEnd) {
  Harness hx;
  Stream s = MakeStream(640, hx.model, 33);
  auto doc = hx.Open(s, FullShadow(), 512);
  auto qa = hx.Open(s, FullShadow(), 600);
  const auto q = hx.Query(90);
  // At the segment boundary: the child is the document.
  v1::ForkSessionRequest fr;
  fr.set_parent_session_id(qa.session);
  fr.set_at_token(512);
  auto child = hx.engine->ForkSession(hx.tenant, fr);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->shared_tokens(), 512u);
  const std::string ca = hx.AttachTo(child->session_id());
  ExpectSameBits(*hx.Attend(ca, 0, q), *hx.Attend(doc.attachment, 0, q));
  // Not a boundary.
  fr.set_at_token(100);
  EXPECT_EQ(hx.engine->ForkSession(hx.tenant, fr).status().code(), absl::StatusCode::kInvalidArgument);
  // At the end, after appends (the open segment is sealed and shared).
  v1::AppendTokensRequest ar;
  ar.set_session_id(qa.session);
  const size_t tok = 2 * 64;
  for (int t = 600; t < 640; ++t) ar.add_token_ids(s.tokens[t]);
  for (int l = 0; l < 2; ++l) {
    auto* lk = ar.add_layers();
    lk->set_layer(l);
    *lk->mutable_k() = ToTensor({s.k[l].begin() + 600 * tok, s.k[l].begin() + 640 * tok}, {40, 2, 64});
    *lk->mutable_v() = ToTensor({s.v[l].begin() + 600 * tok, s.v[l].begin() + 640 * tok}, {40, 2, 64});
  }
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
  fr.set_at_token(640);
  auto end = hx.engine->ForkSession(hx.tenant, fr);
  ASSERT_TRUE(end.ok()) << end.status();
  const std::string ea = hx.AttachTo(end->session_id());
  for (int l = 0; l < 2; ++l) ExpectSameBits(*hx.Attend(ea, l, q), *hx.Attend(qa.attachment, l, q));
  // The parent keeps working after its open segment was sealed.
  ar.clear_token_ids();
  EXPECT_TRUE(hx.Select(qa.attachment, 0, q).ok());
  // Another tenant cannot fork it.
  EXPECT_EQ(hx.engine->ForkSession(hx.other, fr).status().code(), absl::StatusCode::kNotFound);
}

TEST(PrefixForkTest, ForksAtTheEndStayWithinTheSegmentLimit) {
  Harness hx;
  Stream s = MakeStream(800, hx.model, 34);
  auto o = hx.Open(s, FullShadow(), 400);
  const size_t tok = 2 * 64;
  const auto q = hx.Query(95);
  int pos = 400, forks = 0;
  for (int round = 0; round < 8; ++round, pos += 48) {
    v1::AppendTokensRequest ar;
    ar.set_session_id(o.session);
    for (int t = pos; t < pos + 48; ++t) ar.add_token_ids(s.tokens[t]);
    for (int l = 0; l < 2; ++l) {
      auto* lk = ar.add_layers();
      lk->set_layer(l);
      *lk->mutable_k() = ToTensor({s.k[l].begin() + pos * tok, s.k[l].begin() + (pos + 48) * tok}, {48, 2, 64});
      *lk->mutable_v() = ToTensor({s.v[l].begin() + pos * tok, s.v[l].begin() + (pos + 48) * tok}, {48, 2, 64});
    }
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id(o.session);
    fr.set_at_token(pos + 48);
    auto f = hx.engine->ForkSession(hx.tenant, fr);
    ASSERT_TRUE(f.ok()) << round << ": " << f.status();
    ++forks;
    auto child = hx.Select(hx.AttachTo(f->session_id()), 0, q);
    EXPECT_TRUE(child.ok()) << child.status();
    auto parent = hx.Select(o.attachment, 0, q);
    ASSERT_TRUE(parent.ok()) << round << ": " << parent.status();
  }
  EXPECT_EQ(forks, 8);  // each seal merges the appended segments: none is refused
}

}  // namespace
}  // namespace prefix_fork_test
}  // namespace kvshade::service::testing

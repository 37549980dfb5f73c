// Durable sessions (written through at commit, restored by a new engine over the same
// spill path, identical outputs) and background refactorization of a drifting suffix.
#include <cstdlib>
#include <filesystem>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace durable_refactor_test {
namespace {

constexpr int kG = 2;


v1::Profile Shadow(int rank, int budget) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(rank);
  p.set_sparse_budget(budget);
  p.set_outliers(2);
  return p;
}

TEST(DurableTest, SessionsSurviveARestart) {
  TempDir dir;
  Harness hx(dir.path());
  Stream s = MakeStream(600, hx.model, 61);
  auto doc = hx.Open(s, Shadow(64, 8), 512, /*durable=*/true);
  auto qa = hx.Open(s, Shadow(64, 8), 560, /*durable=*/true);
  EXPECT_EQ(qa.reused, 512u);
  auto mini = hx.Open(s, ProfileOf(v1::PROFILE_KIND_MINI), 200, /*durable=*/true);
  auto gone = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT), 100, /*durable=*/false);
  const auto q = hx.Query(5);
  std::vector<std::vector<float>> before;
  for (const auto* o : {&doc, &qa, &mini}) {
    auto out = hx.Attend(o->attachment, 1, q);
    ASSERT_TRUE(out.ok()) << out.status();
    before.push_back(*out);
  }
  auto sel_before = hx.Select(qa.attachment, 0, q);
  ASSERT_TRUE(sel_before.ok());

  // No drain: as after kill -9, only what was committed is there.
  hx.Restart();
  v1::ListSessionsRequest lr;
  auto list = hx.engine->ListSessions(hx.tenant, lr);
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 3);
  v1::GetSessionRequest gr;
  gr.set_session_id(gone.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr).status().code(), absl::StatusCode::kNotFound);
  gr.set_session_id(qa.session);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens(), 560u);
  EXPECT_EQ(info->reused_tokens(), 512u);
  EXPECT_TRUE(info->durable());
  int i = 0;
  for (const auto* o : {&doc, &qa, &mini}) {
    const std::string a = hx.AttachTo(o->session);
    auto out = hx.Attend(a, 1, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(std::memcmp(out->data(), before[i].data(), out->size() * 4), 0) << i;
    if (o == &qa) {
      auto sel = hx.Select(a, 0, q);
      ASSERT_TRUE(sel.ok());
      EXPECT_EQ(sel->keys().data(), sel_before->keys().data());
    }
    ++i;
  }
  // The document's prefix is registered again.
  v1::LookupPrefixRequest lk;
  *lk.mutable_model() = hx.model;
  *lk.mutable_profile() = Shadow(64, 8);
  lk.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + 512);
  EXPECT_EQ(hx.engine->LookupPrefix(hx.tenant, lk)->reusable_tokens(), 512u);
  // Closing a durable session removes it for good.
  v1::CloseSessionRequest cr;
  cr.set_session_id(mini.session);
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok());
  hx.Restart();
  EXPECT_EQ(hx.engine->ListSessions(hx.tenant, lr)->sessions_size(), 2);
}

TEST(DurableTest, DrainFlushesAppendedTokens) {
  TempDir dir;
  Harness hx(dir.path());
  Stream s = MakeStream(500, hx.model, 62);
  auto o = hx.Open(s, Shadow(64, 8), 400, /*durable=*/true);
  v1::AppendTokensRequest ar;
  ar.set_session_id(o.session);
  const size_t tok = 2 * 64;
  for (int t = 400; t < 500; ++t) ar.add_token_ids(s.tokens[t]);
  for (int l = 0; l < 2; ++l) {
    auto* lk = ar.add_layers();
    lk->set_layer(l);
    *lk->mutable_k() = ToTensor({s.k[l].begin() + 400 * tok, s.k[l].begin() + 500 * tok}, {100, 2, 64});
    *lk->mutable_v() = ToTensor({s.v[l].begin() + 400 * tok, s.v[l].begin() + 500 * tok}, {100, 2, 64});
  }
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
  const auto q = hx.Query(6);
  auto before = hx.Attend(o.attachment, 0, q);
  ASSERT_TRUE(before.ok());
  const absl::Status drained = hx.engine->Drain();
  ASSERT_TRUE(drained.ok()) << drained;
  hx.Restart();
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->tokens(), 500u);
  auto after = hx.Attend(hx.AttachTo(o.session), 0, q);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(std::memcmp(after->data(), before->data(), before->size() * 4), 0);
}

double PageIns(Harness& hx) { return MetricValue(hx, "kvshade_page_ins_total"); }

// A restored session's values are on the spill tier only; Attach pages them in before it
// answers (synchronously, the store has no prefetch thread): when it returns the page-in
// has happened and is counted (Attach updates the metrics as it ends) and the host tier
// holds the values. The spill tier keeps its copy.
TEST(DurableTest, AttachPagesRestoredValuesInBeforeItAnswers) {
  TempDir dir;
  Harness hx(dir.path());
  Stream s = MakeStream(512, hx.model, 63);
  auto o = hx.Open(s, Shadow(64, 8), 512, /*durable=*/true);
  hx.Restart();
  auto restored = hx.engine->Stats(hx.tenant, {});
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->host_bytes_used(), 0u);
  EXPECT_GT(restored->spilled_bytes(), 0u);
  const double ins = PageIns(hx);
  const std::string a = hx.AttachTo(o.session);
  ASSERT_FALSE(a.empty());
  EXPECT_EQ(PageIns(hx), ins + 1);  // its one segment
  auto attached = hx.engine->Stats(hx.tenant, {});
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_GE(attached->host_bytes_used(), restored->spilled_bytes());
  EXPECT_EQ(attached->spilled_bytes(), restored->spilled_bytes());
}

// A stream whose first `n1` tokens have keys in one subspace and the rest in another.
Stream TwoTopics(const v1::ModelSpec& m, int n1, int n2) {
  Stream a = MakeStream(n1, m, 70, 16, 100);
  Stream b = MakeStream(n2, m, 71, 16, 100 + n1);
  for (int l = 0; l < a.L; ++l) {
    a.k[l].insert(a.k[l].end(), b.k[l].begin(), b.k[l].end());
    a.v[l].insert(a.v[l].end(), b.v[l].begin(), b.v[l].end());
  }
  a.tokens.insert(a.tokens.end(), b.tokens.begin(), b.tokens.end());
  return a;
}

TEST(RefactorTest, DriftingSuffixIsRefactorizedInTheBackground) {
  Harness hx;
  Stream s = TwoTopics(hx.model, 512, 200);
  auto doc = hx.Open(s, Shadow(32, 256), 512);
  for (float e : doc.ingest.captured_energy()) EXPECT_GT(e, 0.99f);  // rank-16 keys
  auto turn = hx.Open(s, Shadow(32, 256), 712);
  EXPECT_EQ(turn.reused, 512u);
  ASSERT_EQ(turn.ingest.residual_energy_size(), 2);
  for (float r : turn.ingest.residual_energy()) EXPECT_GT(r, 0.5f);  // another subspace
  EXPECT_TRUE(turn.ingest.refactorization_scheduled());
  const auto q = hx.Query(7);
  auto doc_before = hx.Attend(doc.attachment, 0, q);
  std::vector<double> err_before;
  for (int l = 0; l < 2; ++l) {
    auto out = hx.Attend(turn.attachment, l, q);
    ASSERT_TRUE(out.ok());
    err_before.push_back(RelErr(*out, ExactAttend(s, l, kG, q, 712)));
  }
  // Slot state before the swap: chunk ids stay valid across it.
  auto d0 = hx.Select(turn.attachment, 0, q);
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ(hx.engine->RunMaintenance(), 1);
  for (int l = 0; l < 2; ++l) {
    auto out = hx.Attend(turn.attachment, l, q);
    ASSERT_TRUE(out.ok());
    const double err = RelErr(*out, ExactAttend(s, l, kG, q, 712));
    EXPECT_LT(err, err_before[l]) << l;
    EXPECT_LT(err, 0.05) << l;  // rank 32 holds both rank-16 topics
  }
  auto d1 = hx.Select(turn.attachment, 0, q);
  ASSERT_TRUE(d1.ok());
  EXPECT_EQ(d1->hits(), d0->selected());  // same selection, nothing moves
  // The shared document segment was not touched.
  auto doc_after = hx.Attend(doc.attachment, 0, q);
  EXPECT_EQ(std::memcmp(doc_after->data(), doc_before->data(), doc_before->size() * 4), 0);
  EXPECT_EQ(hx.engine->RunMaintenance(), 0);
}

// A short question on another topic after a long document: its own keys lie far from the
// document's basis, but it is 2.3% of the session, so the session's approximation loses
// little and no refit of the whole session is scheduled; the same question's residual is
// still reported. A long off-topic turn (above) is refitted.
TEST(RefactorTest, ShortSuffixDoesNotRefitTheWholeSession) {
  Harness hx;
  Stream s = TwoTopics(hx.model, 512, 12);
  auto doc = hx.Open(s, Shadow(32, 256), 512);
  auto turn = hx.Open(s, Shadow(32, 256), 524);
  EXPECT_EQ(turn.reused, 512u);
  ASSERT_EQ(turn.ingest.residual_energy_size(), 2);
  for (float r : turn.ingest.residual_energy()) EXPECT_GT(r, 0.5f);  // another subspace
  EXPECT_FALSE(turn.ingest.refactorization_scheduled());
  EXPECT_EQ(hx.engine->RunMaintenance(), 0);
  // With a threshold under the question's share of the residual, it is refitted.
  v1::Profile strict = Shadow(32, 256);
  strict.set_refactor_threshold(0.005f);
  auto doc2 = hx.Open(s, strict, 512);
  auto turn2 = hx.Open(s, strict, 524);
  EXPECT_EQ(turn2.reused, 512u);
  EXPECT_TRUE(turn2.ingest.refactorization_scheduled());
}

}  // namespace
}  // namespace durable_refactor_test
}  // namespace kvshade::service::testing

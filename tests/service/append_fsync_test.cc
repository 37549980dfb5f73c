// Logged appends (append_fsync, service/append_log.cc): appends of a durable session under
// everysec or always are in the spill tier before they are acknowledged, and a new engine
// over the same spill path (no drain: what a crash leaves) applies them; under no they are
// lost as documented. A commit folds them into the session record and deletes them; a
// close deletes them.
#include <cstdlib>
#include <filesystem>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace append_fsync_test {
namespace {



// Append records in the spill tier.
int AppendRecords(Harness& hx) {
  auto metas = hx.spill->ListSegments();
  EXPECT_TRUE(metas.ok());
  int n = 0;
  for (const auto& m : *metas) n += m.user_metadata.rfind("KVSHAPP1", 0) == 0;
  return n;
}

uint64_t Tokens(Harness& hx, const std::string& id) {
  v1::GetSessionRequest gr;
  gr.set_session_id(id);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? info->tokens() : 0;
}

// Appends in several calls (crossing chunk migrations of the exact tail), then a new engine
// without a drain; the outputs before and after must be bit-identical.
void AppendAndCrash(const std::string& mode, bool expect_kept) {
  TempDir dir;
  Harness hx(dir.path());
  hx.config.append_fsync = mode;
  hx.Restart();
  Stream s = MakeStream(500, hx.model, 81);
  auto o = hx.Open(s, SmallShadowProfile(), 400, /*durable=*/true);
  for (int at = 400; at < 500; at += 25) {
    auto r = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, at, at + 25));
    ASSERT_TRUE(r.ok()) << r.status();
  }
  const auto q = hx.Query(9);
  auto before = hx.Attend(o.attachment, 1, q);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(AppendRecords(hx), expect_kept ? 4 : 0);
  hx.Restart();  // no Drain: the appends are not in the session record
  ASSERT_EQ(Tokens(hx, o.session), expect_kept ? 500u : 400u) << mode;
  if (!expect_kept) return;
  auto after = hx.Attend(hx.AttachTo(o.session), 1, q);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(std::memcmp(after->data(), before->data(), before->size() * 4), 0);
  // The restored session keeps logging after its replayed appends.
  Stream more = MakeStream(520, hx.model, 81);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, more, 500, 520)).ok());
  hx.Restart();
  EXPECT_EQ(Tokens(hx, o.session), 520u);
}

TEST(AppendFsync, AlwaysKeepsAcknowledgedAppendsWithoutADrain) { AppendAndCrash("always", true); }
TEST(AppendFsync, EverysecKeepsAcknowledgedAppendsWithoutADrain) { AppendAndCrash("everysec", true); }
TEST(AppendFsync, NoLosesAppendsSinceTheLastCommit) { AppendAndCrash("no", false); }

TEST(AppendFsync, PerSessionChoiceOverridesTheServerDefault) {
  TempDir dir;
  Harness hx(dir.path());  // server default: no
  Stream s = MakeStream(440, hx.model, 82);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = SmallShadowProfile();
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + 400);
  cr.set_durable(true);
  cr.set_append_fsync(v1::APPEND_FSYNC_ALWAYS);
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 0, 400)).ok());
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(c->session_id(), s, 400, 440)).ok());
  v1::GetSessionRequest gr;
  gr.set_session_id(c->session_id());
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->append_fsync(), v1::APPEND_FSYNC_ALWAYS);
  hx.Restart();
  EXPECT_EQ(Tokens(hx, c->session_id()), 440u);
  // The choice is in the session record: it survives the restart.
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->append_fsync(), v1::APPEND_FSYNC_ALWAYS);
  // A non-durable session never logs; an unknown value is refused.
  cr.set_durable(false);
  auto nd = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(nd.ok());
  gr.set_session_id(nd->session_id());
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->append_fsync(), v1::APPEND_FSYNC_NO);
  cr.set_append_fsync(static_cast<v1::AppendFsync>(9));
  EXPECT_EQ(hx.engine->CreateSession(hx.tenant, cr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AppendFsync, ACommitFoldsTheLogAndACloseDeletesIt) {
  TempDir dir;
  Harness hx(dir.path());
  hx.config.append_fsync = "always";
  hx.Restart();
  Stream s = MakeStream(480, hx.model, 83);
  auto o = hx.Open(s, SmallShadowProfile(), 400, /*durable=*/true);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 400, 440)).ok());
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 440, 480)).ok());
  EXPECT_EQ(AppendRecords(hx), 2);
  ASSERT_TRUE(hx.engine->Drain().ok());  // the session record now holds the appends
  EXPECT_EQ(AppendRecords(hx), 0);
  hx.Restart();
  EXPECT_EQ(Tokens(hx, o.session), 480u);
  Stream more = MakeStream(500, hx.model, 83);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, more, 480, 500)).ok());
  EXPECT_EQ(AppendRecords(hx), 1);
  v1::CloseSessionRequest cl;
  cl.set_session_id(o.session);
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cl).ok());
  EXPECT_EQ(AppendRecords(hx), 0);
  hx.Restart();
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace append_fsync_test
}  // namespace kvshade::service::testing

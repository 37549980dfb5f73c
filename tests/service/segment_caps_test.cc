// Segment caps (service/README.md "Segment caps"): CreateSession reuses at most 6 cached
// segments (the 7th segment's tokens are ingested again), and a select over a session with
// more than 8 segments with selectable chunks (a durable session that kept appending across
// graceful restarts) is refused with FAILED_PRECONDITION and advice that works: a new
// session over the whole token list.
#include <cstdlib>
#include <filesystem>

#include "gmock/gmock.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;



constexpr int kBlock = 256;  // prefix block: each prompt below adds one cached segment

TEST(SegmentCaps, CreateSessionReusesAtMostSixSegments) {
  Harness hx;
  Stream s = MakeStream(8 * kBlock, hx.model, 71);
  // Prompts of 1..7 blocks: each reuses every segment of the previous one and adds one.
  for (int i = 1; i <= 7; ++i) {
    auto o = hx.Open(s, SmallShadowProfile(), i * kBlock);
    ASSERT_FALSE(o.session.empty());
    EXPECT_EQ(o.reused, uint64_t(std::min(i - 1, 6) * kBlock)) << i;
  }
  // Seven segments of the 7-block prompt are cached, but only six are reused: the 7th
  // segment's tokens are ingested, as one segment of the new session.
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = hx.model;
  *lr.mutable_profile() = SmallShadowProfile();
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + 7 * kBlock);
  auto lk = hx.engine->LookupPrefix(hx.tenant, lr);
  ASSERT_TRUE(lk.ok()) << lk.status();
  EXPECT_EQ(lk->reusable_tokens(), uint64_t(6 * kBlock));
  EXPECT_EQ(lk->cached_segments(), 6u);
  for (int blocks : {7, 8}) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = SmallShadowProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + blocks * kBlock);
    auto c = hx.engine->CreateSession(hx.tenant, cr);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->reused_tokens(), uint64_t(6 * kBlock)) << blocks;
    EXPECT_EQ(c->tokens_to_ingest(), uint64_t((blocks - 6) * kBlock)) << blocks;
    auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 6 * kBlock, blocks * kBlock));
    ASSERT_TRUE(ing.ok()) << ing.status();
    auto sel = hx.Select(hx.AttachTo(c->session_id()), 0, hx.Query(72));
    EXPECT_TRUE(sel.ok()) << sel.status();
  }
}

// Appends tokens [from, to) of `s` to `session`.
absl::Status Append(Harness& hx, const std::string& session, const Stream& s, int from, int to) {
  return hx.engine->AppendTokens(hx.tenant, AppendOf(session, s, from, to)).status();
}

TEST(SegmentCaps, SelectRefusesMoreThanEightSegmentsAndSaysWhatToDo) {
  TempDir dir;
  Harness hx(dir.path());
  constexpr int kPrompt = 400, kStep = 48, kRounds = 8;
  Stream s = MakeStream(kPrompt + kRounds * kStep, hx.model, 73);
  auto o = hx.Open(s, SmallShadowProfile(), kPrompt, /*durable=*/true);
  ASSERT_FALSE(o.session.empty());
  const auto q = hx.Query(74);
  // Each round appends whole chunks past the exact tail (into the open segment), then a
  // graceful restart: the drain writes the session through and seals its open segment.
  // Segments with selectable chunks: the prompt's, one sealed per earlier round, the open.
  int pos = kPrompt;
  absl::Status refused;
  int round = 0;
  for (; round < kRounds; ++round, pos += kStep) {
    ASSERT_TRUE(Append(hx, o.session, s, pos, pos + kStep).ok()) << round;
    const int segments = 1 + round + 1;
    auto sel = hx.Select(hx.AttachTo(o.session), 0, q);
    if (segments <= 8) {
      ASSERT_TRUE(sel.ok()) << round << ": " << sel.status();
    } else {
      refused = sel.status();
      break;
    }
    ASSERT_TRUE(hx.engine->Drain().ok()) << round;
    hx.Restart();
  }
  ASSERT_EQ(round, 7);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_THAT(refused.message(), HasSubstr("has more than 8 segments with selectable chunks"));
  EXPECT_THAT(refused.message(), HasSubstr("create a new session over its whole token list"));
  EXPECT_THAT(refused.message(), Not(HasSubstr("fork")));
  // Attend reads the same view and is refused alike.
  auto at = hx.Attend(hx.AttachTo(o.session), 0, q);
  EXPECT_EQ(at.status().code(), absl::StatusCode::kFailedPrecondition) << at.status();
  // A fork at the end shares the segments and compacts nothing: refused as well.
  v1::ForkSessionRequest fr;
  fr.set_parent_session_id(o.session);
  fr.set_at_token(pos + kStep);
  EXPECT_EQ(hx.engine->ForkSession(hx.tenant, fr).status().code(), absl::StatusCode::kFailedPrecondition);

  // The advice: a new session over the whole token list reuses the prompt's cached
  // segment, ingests the rest as one segment and selects.
  auto fresh = hx.Open(s, SmallShadowProfile(), pos + kStep);
  ASSERT_FALSE(fresh.session.empty());
  EXPECT_EQ(fresh.reused, uint64_t(kPrompt));
  auto sel = hx.Select(fresh.attachment, 0, q);
  EXPECT_TRUE(sel.ok()) << sel.status();
  auto out = hx.Attend(fresh.attachment, 0, q);
  EXPECT_TRUE(out.ok()) << out.status();
}

}  // namespace
}  // namespace kvshade::service::testing

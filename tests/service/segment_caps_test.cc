// Segment caps (docs/DESIGN.md "Segment caps"): CreateSession reuses at most 5 cached
// segments (the 6th segment's tokens are ingested again), and a durable session that keeps
// appending across graceful restarts (each drain seals its open segment) stays within the
// 8 segments a select searches: each seal merges its appended segments.
#include <cstdlib>
#include <filesystem>

#include "gmock/gmock.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace segment_caps_test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;



constexpr int kBlock = 256;  // prefix block: each prompt below adds one cached segment

TEST(SegmentCaps, CreateSessionReusesAtMostFiveSegments) {
  Harness hx;
  Stream s = MakeStream(8 * kBlock, hx.model, 71);
  // Prompts of 1..7 blocks: each reuses every segment of the previous one and adds one.
  for (int i = 1; i <= 7; ++i) {
    auto o = hx.Open(s, SmallShadowProfile(), i * kBlock);
    ASSERT_FALSE(o.session.empty());
    EXPECT_EQ(o.reused, uint64_t(std::min(i - 1, 5) * kBlock)) << i;
  }
  // Six one-block segments are cached, but only five are reused: the 6th segment's tokens
  // are ingested, as one segment of the new session.
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = hx.model;
  *lr.mutable_profile() = SmallShadowProfile();
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + 7 * kBlock);
  auto lk = hx.engine->LookupPrefix(hx.tenant, lr);
  ASSERT_TRUE(lk.ok()) << lk.status();
  EXPECT_EQ(lk->reusable_tokens(), uint64_t(5 * kBlock));
  EXPECT_EQ(lk->cached_segments(), 5u);
  for (int blocks : {7, 8}) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = SmallShadowProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + blocks * kBlock);
    auto c = hx.engine->CreateSession(hx.tenant, cr);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->reused_tokens(), uint64_t(5 * kBlock)) << blocks;
    EXPECT_EQ(c->tokens_to_ingest(), uint64_t((blocks - 5) * kBlock)) << blocks;
    auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, 5 * kBlock, blocks * kBlock));
    ASSERT_TRUE(ing.ok()) << ing.status();
    auto sel = hx.Select(hx.AttachTo(c->session_id()), 0, hx.Query(72));
    EXPECT_TRUE(sel.ok()) << sel.status();
  }
}

// Appends tokens [from, to) of `s` to `session`.
absl::Status Append(Harness& hx, const std::string& session, const Stream& s, int from, int to) {
  return hx.engine->AppendTokens(hx.tenant, AppendOf(session, s, from, to)).status();
}

TEST(SegmentCaps, ADurableSessionAppendingAcrossRestartsStaysWithinTheCap) {
  TempDir dir;
  Harness hx(dir.path());
  constexpr int kPrompt = 400, kStep = 48, kRounds = 8;
  Stream s = MakeStream(kPrompt + kRounds * kStep, hx.model, 73);
  auto o = hx.Open(s, SmallShadowProfile(), kPrompt, /*durable=*/true);
  ASSERT_FALSE(o.session.empty());
  // The same appends in a session that is never restarted: its appended chunks stay in
  // one open segment.
  auto ref = hx.Open(s, SmallShadowProfile(), kPrompt);
  const auto q = hx.Query(74);
  // Each round appends whole chunks past the exact tail (into the open segment), then a
  // graceful restart: the drain writes the session through and seals its open segment.
  // Without merging, round 7 would hold 9 segments with selectable chunks.
  int pos = kPrompt;
  std::vector<std::vector<float>> want;
  for (int round = 0; round < kRounds; ++round, pos += kStep) {
    ASSERT_TRUE(Append(hx, ref.session, s, pos, pos + kStep).ok()) << round;
    want.push_back(*hx.Attend(ref.attachment, 0, q));
  }
  pos = kPrompt;
  for (int round = 0; round < kRounds; ++round, pos += kStep) {
    ASSERT_TRUE(Append(hx, o.session, s, pos, pos + kStep).ok()) << round;
    const std::string a = hx.AttachTo(o.session);
    auto sel = hx.Select(a, 0, q);
    ASSERT_TRUE(sel.ok()) << round << ": " << sel.status();
    auto out = hx.Attend(a, 0, q);
    ASSERT_TRUE(out.ok()) << round << ": " << out.status();
    ASSERT_EQ(out->size(), want[round].size());
    for (size_t i = 0; i < out->size(); ++i) {
      ASSERT_EQ((*out)[i], want[round][i]) << round << " [" << i << "]";
    }
    // A fork at the end works too.
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id(o.session);
    fr.set_at_token(pos + kStep);
    auto f = hx.engine->ForkSession(hx.tenant, fr);
    ASSERT_TRUE(f.ok()) << round << ": " << f.status();
    ASSERT_TRUE(hx.engine->Drain().ok()) << round;
    hx.Restart();
    if (round == 0) ref = {};  // not durable: gone with the restart (want is recorded)
  }
}

}  // namespace
}  // namespace segment_caps_test
}  // namespace kvshade::service::testing

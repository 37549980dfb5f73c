// Forks at the end of a growing session (docs/DESIGN.md "Segment caps", append.cc
// "Compaction"): every fork seals the parent's open segment, and the seal merges the
// session's sealed appended segments so that a session never holds more segments than a
// select searches. Each fork, the parent and every earlier fork must select and attend
// exactly as a session that took the same appends and was never forked; durable forks
// come back the same after a restart; memory stays what the tokens need.
#include <map>

#include "gmock/gmock.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace fork_compaction_test {
namespace {

absl::StatusOr<std::string> ForkAtEnd(Harness& hx, const std::string& parent, uint64_t at) {
  v1::ForkSessionRequest fr;
  fr.set_parent_session_id(parent);
  fr.set_at_token(at);
  auto f = hx.engine->ForkSession(hx.tenant, fr);
  if (!f.ok()) return f.status();
  EXPECT_EQ(f->shared_tokens(), at);
  return f->session_id();
}

void Close(Harness& hx, const std::string& session) {
  v1::CloseSessionRequest cr;
  cr.set_session_id(session);
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok()) << session;
}

void Detach(Harness& hx, const std::string& attachment) {
  v1::DetachRequest dr;
  dr.set_attachment_id(attachment);
  ASSERT_TRUE(hx.engine->Detach(hx.tenant, dr).ok());
}

// The selection of a fresh attachment: chunk ids and their reconstructed K and V.
struct Selected {
  std::vector<int32_t> chunks;
  std::string k, v;
};

Selected FreshSelect(Harness& hx, const std::string& session, int layer, const std::vector<bf16>& q) {
  const std::string a = hx.AttachTo(session);
  auto d = hx.Select(a, layer, q);
  EXPECT_TRUE(d.ok()) << d.status();
  Selected out;
  if (d.ok()) {
    out.chunks.assign(d->chunk().begin(), d->chunk().end());
    out.k = d->keys().data();
    out.v = d->values().data();
  }
  Detach(hx, a);
  return out;
}

v1::SessionInfo Info(Harness& hx, const std::string& session) {
  v1::GetSessionRequest r;
  r.set_session_id(session);
  auto i = hx.engine->GetSession(hx.tenant, r);
  EXPECT_TRUE(i.ok()) << i.status();
  return i.ok() ? *i : v1::SessionInfo();
}

constexpr int kPrompt = 320;

// Small geometry: 2 layers, 2 KV heads of 32 dimensions, one query head each.
v1::ModelSpec SmallModel() { return TestModel(2, 2, 1, 32); }

TEST(ForkCompaction, ForkAtTheEndAfterEveryAppendFor1000Steps) {
  Harness hx;
  hx.model = SmallModel();
  constexpr int kSteps = 1000;
  Stream s = MakeStream(kPrompt + kSteps, hx.model, 301);
  // The parent (forked after every append) and a reference that takes the same appends and
  // is never forked (its appended chunks stay in one open segment).
  // Both reuse the prompt's segment from a first session, so that their own bytes are
  // their appended tokens'.
  const auto doc = hx.Open(s, SmallShadowProfile(), kPrompt);
  auto p = hx.Open(s, SmallShadowProfile(), kPrompt);
  auto ref = hx.Open(s, SmallShadowProfile(), kPrompt);
  ASSERT_FALSE(p.session.empty());
  ASSERT_FALSE(ref.session.empty());
  const auto q = hx.Query(302);
  struct Kept {
    std::string session, attachment;
    int tokens = 0;
    std::vector<float> out;
  };
  std::vector<Kept> kept;
  for (int step = 0; step < kSteps; ++step) {
    const int end = kPrompt + step + 1;
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(p.session, s, end - 1, end)).ok()) << step;
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(ref.session, s, end - 1, end)).ok()) << step;
    auto f = ForkAtEnd(hx, p.session, end);
    ASSERT_TRUE(f.ok()) << "step " << step << ": " << f.status();
    const std::string fa = hx.AttachTo(*f);
    const std::string what = "step " + std::to_string(step);
    for (int l = 0; l < (step % 10 == 0 ? 2 : 1); ++l) {
      auto want = hx.Attend(ref.attachment, l, q);
      ASSERT_TRUE(want.ok()) << what << ": " << want.status();
      auto got_f = hx.Attend(fa, l, q);
      ASSERT_TRUE(got_f.ok()) << what << ": " << got_f.status();
      auto got_p = hx.Attend(p.attachment, l, q);
      ASSERT_TRUE(got_p.ok()) << what << ": " << got_p.status();
      ExpectSameBits(*got_f, *want, what + " fork");
      ExpectSameBits(*got_p, *want, what + " parent");
    }
    if (step % 25 == 0) {
      const Selected want = FreshSelect(hx, ref.session, 0, q);
      const Selected got = FreshSelect(hx, *f, 0, q);
      EXPECT_EQ(got.chunks, want.chunks) << what;
      EXPECT_TRUE(got.k == want.k && got.v == want.v) << what;
    }
    if (step % 200 == 199) {
      kept.push_back({*f, fa, end, *hx.Attend(fa, 0, q)});
    } else {
      Close(hx, *f);
    }
  }
  // Earlier forks hold the segments they shared, whatever the parent merged since.
  for (const Kept& k : kept) {
    auto out = hx.Attend(k.attachment, 0, q);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectSameBits(*out, k.out, "kept fork at " + std::to_string(k.tokens));
  }
  // Memory: the parent holds what the reference holds for the same tokens (its own
  // segments: the merged appended chunks and a small open segment; the reference's open
  // segment has its growth headroom).
  const v1::SessionInfo pi = Info(hx, p.session), ri = Info(hx, ref.session);
  EXPECT_LE(pi.gpu_bytes(), ri.gpu_bytes() * 5 / 4) << pi.gpu_bytes() << " vs " << ri.gpu_bytes();
  EXPECT_LE(pi.host_bytes(), ri.host_bytes() * 5 / 4) << pi.host_bytes() << " vs " << ri.host_bytes();
  for (const Kept& k : kept) Close(hx, k.session);
  auto st = hx.engine->Stats(hx.tenant, v1::StatsRequest());
  ASSERT_TRUE(st.ok()) << st.status();
  // The shared prompt, at most 8 - 1 of the parent's own (its appended chunks merged) and
  // the reference's open one: no segment of a closed fork or of a merge is left.
  EXPECT_LE(st->segments(), 1u + (kernels::kMaxSegments - 1) + 1) << st->segments();
  const v1::SessionInfo di = Info(hx, doc.session);
  EXPECT_LE(st->device_bytes_used(), di.gpu_bytes() + pi.gpu_bytes() + ri.gpu_bytes());
  EXPECT_LE(st->host_bytes_used(), di.host_bytes() + pi.host_bytes() + ri.host_bytes());
}

TEST(ForkCompaction, ForksOfForksAttendAsTheUnforkedSession) {
  Harness hx;
  hx.model = SmallModel();
  constexpr int kSteps = 300;
  Stream s = MakeStream(kPrompt + kSteps, hx.model, 311);
  auto ref = hx.Open(s, SmallShadowProfile(), kPrompt);
  const auto q = hx.Query(312);
  // The reference's output at every length.
  std::map<int, std::vector<float>> want;
  for (int end = kPrompt + 1; end <= kPrompt + kSteps; ++end) {
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(ref.session, s, end - 1, end)).ok());
    want[end] = *hx.Attend(ref.attachment, 0, q);
  }
  // A line of forks of forks: each session appends a few tokens and forks at its end; the
  // fork continues. Every session along the line attends as the reference did at its length.
  std::string cur = hx.Open(s, SmallShadowProfile(), kPrompt).session;
  std::vector<std::string> line;
  for (int end = kPrompt + 1; end <= kPrompt + kSteps; ++end) {
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(cur, s, end - 1, end)).ok()) << end;
    if (end % 7 != 0) continue;
    auto f = ForkAtEnd(hx, cur, end);
    ASSERT_TRUE(f.ok()) << end << ": " << f.status();
    line.push_back(cur);
    cur = *f;
    auto out = hx.Attend(hx.AttachTo(cur), 0, q);
    ASSERT_TRUE(out.ok()) << end << ": " << out.status();
    ExpectSameBits(*out, want[end], "fork of fork at " + std::to_string(end));
  }
  auto out = hx.Attend(hx.AttachTo(cur), 0, q);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectSameBits(*out, want[kPrompt + kSteps], "the last fork");
}

TEST(ForkCompaction, DurableForksComeBackTheSameAfterRestarts) {
  TempDir dir;
  Harness hx(dir.path());
  hx.model = SmallModel();
  constexpr int kSteps = 72;
  Stream s = MakeStream(kPrompt + kSteps, hx.model, 321);
  const auto q = hx.Query(322);
  std::map<int, std::vector<float>> want;
  {
    auto ref = hx.Open(s, SmallShadowProfile(), kPrompt);
    for (int end = kPrompt + 1; end <= kPrompt + kSteps; ++end) {
      ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(ref.session, s, end - 1, end)).ok());
      want[end] = *hx.Attend(ref.attachment, 0, q);
    }
    Close(hx, ref.session);
  }
  const std::string p = hx.Open(s, SmallShadowProfile(), kPrompt, /*durable=*/true).session;
  std::map<std::string, int> forks;  // kept durable forks and their lengths
  for (int end = kPrompt + 1; end <= kPrompt + kSteps; ++end) {
    ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(p, s, end - 1, end)).ok()) << end;
    if (end % 4 != 0) continue;  // a fork every 4 tokens: one with new chunks every other
    auto f = ForkAtEnd(hx, p, end);
    ASSERT_TRUE(f.ok()) << end << ": " << f.status();
    if (end % 20 == 0) {
      forks[*f] = end;
    } else {
      Close(hx, *f);
    }
    if (end % 24 == 0) {  // a graceful restart: the drain seals (and merges) again
      ASSERT_TRUE(hx.engine->Drain().ok());
      hx.Restart();
    }
    auto out = hx.Attend(hx.AttachTo(p), 0, q);
    ASSERT_TRUE(out.ok()) << end << ": " << out.status();
    ExpectSameBits(*out, want[end], "durable parent at " + std::to_string(end));
  }
  ASSERT_TRUE(hx.engine->Drain().ok());
  hx.Restart();
  forks[p] = kPrompt + kSteps;
  for (const auto& [id, end] : forks) {
    auto out = hx.Attend(hx.AttachTo(id), 0, q);
    ASSERT_TRUE(out.ok()) << id << ": " << out.status();
    ExpectSameBits(*out, want[end], "restored session at " + std::to_string(end));
    EXPECT_EQ(Info(hx, id).tokens(), uint64_t(end));
  }
}

}  // namespace
}  // namespace fork_compaction_test
}  // namespace kvshade::service::testing

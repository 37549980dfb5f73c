// Attend as a decode loop uses it: the step's new token attended exactly beside the
// session (k_new pre-RoPE, rotated at the next position), and the log-sum-exp of the
// scores beside the output, so that a caller can merge attention over other tokens.
//
// References, both independent of how Attend merges its blocks:
//   - A zero key scores 0 whatever the rotation: merged = (e^lse o + v) / (e^lse + 1) and
//     lse' = log(e^lse + 1), from the answer without the token.
//   - The same token appended (AppendTokens) and attended without k_new: the same tokens,
//     so the same output and LSE (only the block order differs).
// Staging: the token staged layer by layer through Attend and appended after the last
// layer equals the same token appended by AppendTokens, bit for bit.
// Tolerance: fp32 accumulation over ~200 bf16 products per score and an online softmax in
// another block order: 1e-5 relative to the output's largest magnitude, 1e-5 absolute on
// the LSE (values of order 10).
#include <gtest/gtest.h>

#include <cmath>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace attend_decode_test {
namespace {

constexpr int kH = 2, kD = 64;

v1::AttendRequest AttendReq(const Harness& hx, const std::string& att, int layer,
                            const std::vector<bf16>& q, const std::vector<bf16>* kn,
                            const std::vector<bf16>* vn) {
  v1::AttendRequest r;
  r.set_layer(layer);
  auto* aq = r.add_queries();
  aq->set_attachment_id(att);
  *aq->mutable_q() = ToTensor(q, {int64_t(hx.model.num_query_heads()), hx.model.head_dim()});
  if (kn != nullptr) {
    *aq->mutable_k_new() = ToTensor(*kn, {kH, kD});
    *aq->mutable_v_new() = ToTensor(*vn, {kH, kD});
  }
  return r;
}

double MaxRel(const std::vector<float>& a, const std::vector<float>& b) {
  double mx = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    mx = std::max(mx, double(std::fabs(a[i])));
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
  }
  return diff / std::max(mx, 1e-30);
}

// Rank 16, budget 8, 2 outliers: small enough that selection leaves chunks out.
v1::Profile SmallProfile(v1::ProfileKind kind) {
  v1::Profile p = ProfileOf(kind);
  p.set_rank(16);
  p.set_sparse_budget(8);
  p.set_outliers(2);
  return p;
}

// Two sessions over the same n-token prompt of a stream with `extra` more tokens: `a`, into
// which the tests stage through its writer attachment, and its twin `b`, which gets the same
// tokens by AppendTokens.
struct StagingTwins {
  Harness hx;
  const int n;
  Stream s;
  Harness::Opened a, b;
  std::string writer;
  StagingTwins(int n_tokens, int extra, uint64_t seed, v1::ProfileKind kind = v1::PROFILE_KIND_SHADOW)
      : n(n_tokens), s(MakeStream(n_tokens + extra, hx.model, seed)) {
    a = hx.Open(s, SmallProfile(kind), n);
    b = hx.Open(s, SmallProfile(kind), n);
    writer = hx.AttachTo(a.session, true);
  }
  // Token t's K (pre-RoPE) or V [h, d] in `layer`.
  std::vector<bf16> TokenKv(int layer, int t, bool v) const {
    const auto& src = v ? s.v[layer] : s.k[layer];
    return std::vector<bf16>(src.begin() + size_t(t) * kH * kD, src.begin() + size_t(t + 1) * kH * kD);
  }
};

// Appends token `t` of stream `s` (position n) to session `session` by AppendTokens: the
// twin that staging must equal.
void AppendByRpc(Harness& hx, const Stream& s, const std::string& session, int n) {
  v1::AppendTokensRequest ap;
  ap.set_session_id(session);
  ap.add_token_ids(s.tokens[n]);
  for (int layer = 0; layer < s.L; ++layer) {
    auto* lk = ap.add_layers();
    lk->set_layer(layer);
    std::vector<bf16> k(s.k[layer].begin() + size_t(n) * kH * kD, s.k[layer].begin() + size_t(n + 1) * kH * kD);
    std::vector<bf16> v(s.v[layer].begin() + size_t(n) * kH * kD, s.v[layer].begin() + size_t(n + 1) * kH * kD);
    *lk->mutable_k() = ToTensor(k, {1, kH, kD});
    *lk->mutable_v() = ToTensor(v, {1, kH, kD});
  }
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ap).ok());
}

// Attend over every layer of two attachments with the same queries: the same bits, and
// both sessions `tokens` long.
void ExpectSameAnswers(Harness& hx, const Stream& s, const std::string& a, const std::string& b,
                       uint64_t stream, uint64_t tokens) {
  for (int layer = 0; layer < s.L; ++layer) {
    const std::vector<bf16> q = hx.Query(stream + layer);
    auto ra = hx.engine->Attend(hx.tenant, AttendReq(hx, a, layer, q, nullptr, nullptr));
    auto rb = hx.engine->Attend(hx.tenant, AttendReq(hx, b, layer, q, nullptr, nullptr));
    ASSERT_TRUE(ra.ok() && rb.ok());
    EXPECT_EQ(ra->outputs(0).data(), rb->outputs(0).data()) << "layer " << layer;
    EXPECT_EQ(ra->lse(0).data(), rb->lse(0).data()) << "layer " << layer;
    EXPECT_EQ(ra->tokens(0), tokens);
  }
}

TEST(AttendDecode, NewTokenAndLogSumExpAgainstReferences) {
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_EXACT}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    Harness hx;
    const int n = 200;
    Stream s = MakeStream(n + 1, hx.model, 41);
    const v1::Profile p = SmallProfile(kind);
    auto o = hx.Open(s, p, n);
    const int hq = hx.model.num_query_heads(), g = hq / kH;
    for (int layer = 0; layer < s.L; ++layer) {
      std::vector<bf16> q = hx.Query(100 + layer);
      auto base = hx.engine->Attend(hx.tenant, AttendReq(hx, o.attachment, layer, q, nullptr, nullptr));
      ASSERT_TRUE(base.ok()) << base.status();
      ASSERT_EQ(base->lse_size(), 1);
      const std::vector<float> o1 = TensorF32(base->outputs(0)), lse1 = TensorF32(base->lse(0));
      ASSERT_EQ(lse1.size(), size_t(hq));
      // A zero key: score 0 for every query head.
      std::vector<bf16> zero(size_t(kH) * kD, kernels::FloatToBf16(0.0f));
      std::vector<bf16> vn(s.v[layer].begin() + size_t(n) * kH * kD, s.v[layer].begin() + size_t(n + 1) * kH * kD);
      auto with0 = hx.engine->Attend(hx.tenant, AttendReq(hx, o.attachment, layer, q, &zero, &vn));
      ASSERT_TRUE(with0.ok()) << with0.status();
      const std::vector<float> o2 = TensorF32(with0->outputs(0)), lse2 = TensorF32(with0->lse(0));
      std::vector<float> ref(o1.size());
      for (int qh = 0; qh < hq; ++qh) {
        const double e = std::exp(double(lse1[qh]));
        EXPECT_NEAR(lse2[qh], std::log(e + 1.0), 1e-5) << "layer " << layer << " head " << qh;
        for (int c = 0; c < kD; ++c) {
          const double v = kernels::Bf16ToFloat(vn[size_t(qh / g) * kD + c]);
          ref[size_t(qh) * kD + c] = float((e * o1[size_t(qh) * kD + c] + v) / (e + 1.0));
        }
      }
      EXPECT_LT(MaxRel(ref, o2), 1e-5) << "layer " << layer;
    }
    // The real next token, against appending it: the same tokens either way.
    std::vector<std::vector<float>> with_new(s.L), lse_new(s.L);
    std::vector<std::vector<bf16>> qs(s.L);
    for (int layer = 0; layer < s.L; ++layer) {
      qs[layer] = hx.Query(200 + layer);
      std::vector<bf16> kn(s.k[layer].begin() + size_t(n) * kH * kD, s.k[layer].begin() + size_t(n + 1) * kH * kD);
      std::vector<bf16> vn(s.v[layer].begin() + size_t(n) * kH * kD, s.v[layer].begin() + size_t(n + 1) * kH * kD);
      auto r = hx.engine->Attend(hx.tenant, AttendReq(hx, o.attachment, layer, qs[layer], &kn, &vn));
      ASSERT_TRUE(r.ok()) << r.status();
      with_new[layer] = TensorF32(r->outputs(0));
      lse_new[layer] = TensorF32(r->lse(0));
    }
    ASSERT_NO_FATAL_FAILURE(AppendByRpc(hx, s, o.session, n));
    for (int layer = 0; layer < s.L; ++layer) {
      auto r = hx.engine->Attend(hx.tenant, AttendReq(hx, o.attachment, layer, qs[layer], nullptr, nullptr));
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_LT(MaxRel(TensorF32(r->outputs(0)), with_new[layer]), 1e-5) << "layer " << layer;
      const std::vector<float> lse = TensorF32(r->lse(0));
      for (size_t qh = 0; qh < lse.size(); ++qh) EXPECT_NEAR(lse[qh], lse_new[layer][qh], 1e-5);
    }
  }
}

// A decode step through Attend alone: every layer's call stages the new token
// (stage_token_id), the last layer's call appends it. The session then answers exactly
// as a twin that got the same token by AppendTokens, bit for bit. A different token id
// part-way restarts the staging (only the second token is appended).
TEST(AttendDecode, StagedTokenIsAppendedAfterTheLastLayer) {
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_EXACT}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    StagingTwins tw(200, 1, 47, kind);
    Harness& hx = tw.hx;
    const int n = tw.n;
    const Stream& s = tw.s;
    const auto &a = tw.a, &b = tw.b;
    const std::string& writer = tw.writer;
    auto token_kv = [&](int layer, int t, bool v) { return tw.TokenKv(layer, t, v); };
    // A false start: token 999 on layer 0 only, then the real token on every layer.
    {
      std::vector<bf16> kn = token_kv(0, n, false), vn = token_kv(0, n, true);
      v1::AttendRequest r = AttendReq(hx, writer, 0, hx.Query(5), &kn, &vn);
      r.mutable_queries(0)->set_stage_token_id(999);
      auto resp = hx.engine->Attend(hx.tenant, r);
      ASSERT_TRUE(resp.ok()) << resp.status();
      EXPECT_EQ(resp->tokens(0), uint64_t(n));
    }
    for (int layer = 0; layer < s.L; ++layer) {
      std::vector<bf16> kn = token_kv(layer, n, false), vn = token_kv(layer, n, true);
      v1::AttendRequest r = AttendReq(hx, writer, layer, hx.Query(300 + layer), &kn, &vn);
      r.mutable_queries(0)->set_stage_token_id(s.tokens[n]);
      auto resp = hx.engine->Attend(hx.tenant, r);
      ASSERT_TRUE(resp.ok()) << resp.status();
      ASSERT_EQ(resp->tokens_size(), 1);
      EXPECT_EQ(resp->tokens(0), uint64_t(layer + 1 < s.L ? n : n + 1)) << "layer " << layer;
    }
    ASSERT_NO_FATAL_FAILURE(AppendByRpc(hx, s, b.session, n));
    auto ia = hx.engine->GetSession(hx.tenant, [&] {
      v1::GetSessionRequest g;
      g.set_session_id(a.session);
      return g;
    }());
    ASSERT_TRUE(ia.ok());
    EXPECT_EQ(ia->tokens(), uint64_t(n + 1));
    ExpectSameAnswers(hx, s, a.attachment, b.attachment, 400, uint64_t(n + 1));
    // The writer rule holds for staging: another attachment may not stage.
    std::vector<bf16> kn = token_kv(0, n, false), vn = token_kv(0, n, true);
    v1::AttendRequest r = AttendReq(hx, a.attachment, 0, hx.Query(6), &kn, &vn);
    r.mutable_queries(0)->set_stage_token_id(5);
    auto denied = hx.engine->Attend(hx.tenant, r);
    ASSERT_FALSE(denied.ok());
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
    // Staging needs the token's K and V.
    v1::AttendRequest bare = AttendReq(hx, writer, 0, hx.Query(6), nullptr, nullptr);
    bare.mutable_queries(0)->set_stage_token_id(5);
    auto refused = hx.engine->Attend(hx.tenant, bare);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(refused.status().message()).find("queries[0].stage_token_id"), std::string::npos)
        << refused.status();
  }
}

// SelectAndReconstruct stages the new token like Attend (a worker that attends itself
// still hands each layer's K/V to the session): layers staged by either call count alike,
// the call that stages the last layer appends the token after its selection, and the
// session then answers as a twin that got the token by AppendTokens, bit for bit. A select
// that fails stages nothing; the new token alone is refused without stage_token_id.
TEST(AttendDecode, SelectStagesTheNewTokenAlikeWithAttend) {
  StagingTwins tw(200, 1, 53);
  Harness& hx = tw.hx;
  const int n = tw.n;
  const Stream& s = tw.s;
  ASSERT_GE(s.L, 2);
  const auto &a = tw.a, &b = tw.b;
  const std::string& writer = tw.writer;
  auto token_kv = [&](int layer, bool v) { return tw.TokenKv(layer, n, v); };
  auto select_req = [&](const std::string& att, int layer, bool with_token, int32_t id) {
    v1::SelectAndReconstructRequest r;
    r.set_layer(layer);
    auto* sq = r.add_queries();
    sq->set_attachment_id(att);
    *sq->mutable_q() = ToTensor(hx.Query(500 + layer), {int64_t(hx.model.num_query_heads()), kD});
    if (with_token) {
      *sq->mutable_k_new() = ToTensor(token_kv(layer, false), {kH, kD});
      *sq->mutable_v_new() = ToTensor(token_kv(layer, true), {kH, kD});
    }
    if (id >= 0) sq->set_stage_token_id(id);
    return r;
  };
  // Refusals first: they must stage nothing.
  {
    auto bare = hx.engine->SelectAndReconstruct(hx.tenant, select_req(writer, 0, true, -1));
    ASSERT_FALSE(bare.ok());
    EXPECT_EQ(bare.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(bare.status().message()).find("queries[0].k_new"), std::string::npos) << bare.status();
    v1::SelectAndReconstructRequest bad_q = select_req(writer, 0, true, s.tokens[n]);
    bad_q.mutable_queries(0)->mutable_q()->set_shape(0, hx.model.num_query_heads() + 1);
    ASSERT_FALSE(hx.engine->SelectAndReconstruct(hx.tenant, bad_q).ok());
    auto denied = hx.engine->SelectAndReconstruct(hx.tenant, select_req(a.attachment, 0, true, s.tokens[n]));
    ASSERT_FALSE(denied.ok());
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
    // ... before its selection moved the slot table: the same select now misses every chunk.
    auto after = hx.engine->SelectAndReconstruct(hx.tenant, select_req(a.attachment, 0, false, -1));
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_GT(after->deltas(0).selected(), 0u);
    EXPECT_EQ(after->deltas(0).hits(), 0u);
  }
  // Every layer but one through SelectAndReconstruct, layer 1 through Attend; layer 0
  // comes last, so the select of layer 0 appends.
  for (int layer = 1; layer < s.L; ++layer) {
    if (layer == 1) {
      std::vector<bf16> kn = token_kv(layer, false), vn = token_kv(layer, true);
      v1::AttendRequest r = AttendReq(hx, writer, layer, hx.Query(600), &kn, &vn);
      r.mutable_queries(0)->set_stage_token_id(s.tokens[n]);
      auto resp = hx.engine->Attend(hx.tenant, r);
      ASSERT_TRUE(resp.ok()) << resp.status();
      EXPECT_EQ(resp->tokens(0), uint64_t(n));
      continue;
    }
    auto resp = hx.engine->SelectAndReconstruct(hx.tenant, select_req(writer, layer, true, s.tokens[n]));
    ASSERT_TRUE(resp.ok()) << resp.status();
    EXPECT_EQ(resp->deltas(0).tokens(), uint64_t(n)) << "layer " << layer;
    EXPECT_GT(resp->deltas(0).selected(), 0u);
  }
  auto last = hx.engine->SelectAndReconstruct(hx.tenant, select_req(writer, 0, true, s.tokens[n]));
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->deltas(0).tokens(), uint64_t(n + 1));
  // A select without staging reports the length as it is.
  auto plain = hx.engine->SelectAndReconstruct(hx.tenant, select_req(a.attachment, 0, false, -1));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->deltas(0).tokens(), uint64_t(n + 1));

  ASSERT_NO_FATAL_FAILURE(AppendByRpc(hx, s, b.session, n));
  ExpectSameAnswers(hx, s, a.attachment, b.attachment, 700, uint64_t(n + 1));
}

TEST(AttendDecode, BadNewTokenIsRefusedNamingTheField) {
  Harness hx;
  Stream s = MakeStream(64, hx.model, 43);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_SHADOW));
  std::vector<bf16> q = hx.Query(7);
  std::vector<bf16> wrong(size_t(kH + 1) * kD, kernels::FloatToBf16(0.1f));
  v1::AttendRequest r = AttendReq(hx, o.attachment, 0, q, &wrong, &wrong);
  r.mutable_queries(0)->mutable_k_new()->set_shape(0, kH + 1);
  r.mutable_queries(0)->mutable_v_new()->set_shape(0, kH + 1);
  auto resp = hx.engine->Attend(hx.tenant, r);
  ASSERT_FALSE(resp.ok());
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(resp.status().message().find("queries[0].k_new"), std::string::npos) << resp.status();
}

// A held staged token (stage_hold) is not appended when its last layer is staged; the
// explicit CommitStaged appends it, and the session then answers as a twin that got the
// token by AppendTokens, bit for bit. Refusals: no such token, a layer missing, an append
// in between, not the writer; discard drops a complete held token and appends nothing.
TEST(AttendDecode, HeldStagedTokenWaitsForCommitStaged) {
  StagingTwins tw(200, 2, 59);
  Harness& hx = tw.hx;
  const int n = tw.n;
  const Stream& s = tw.s;
  ASSERT_GE(s.L, 2);
  const auto &a = tw.a, &b = tw.b;
  const std::string& writer = tw.writer;
  auto token_kv = [&](int layer, int t, bool v) { return tw.TokenKv(layer, t, v); };
  auto stage = [&](int layer, int t, int32_t id, bool hold) {
    std::vector<bf16> kn = token_kv(layer, t, false), vn = token_kv(layer, t, true);
    v1::AttendRequest r = AttendReq(hx, writer, layer, hx.Query(700 + layer), &kn, &vn);
    r.mutable_queries(0)->set_stage_token_id(id);
    r.mutable_queries(0)->set_stage_hold(hold);
    return hx.engine->Attend(hx.tenant, r);
  };
  auto commit = [&](const std::string& att, int32_t id, bool discard) {
    v1::CommitStagedRequest r;
    r.set_attachment_id(att);
    r.set_stage_token_id(id);
    r.set_discard(discard);
    return hx.engine->CommitStaged(hx.tenant, r);
  };
  const int32_t id = s.tokens[n];
  // Nothing staged yet.
  EXPECT_EQ(commit(writer, id, false).status().code(), absl::StatusCode::kFailedPrecondition);
  // Layer 0 held, the others not: the token is held (any call's hold holds it).
  for (int layer = 0; layer < s.L; ++layer) {
    auto r = stage(layer, n, id, layer == 0);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens(0), uint64_t(n)) << "layer " << layer << ": a held token is not appended";
  }
  // The wrong id, and another attachment (not the writer), are refused.
  auto wrong = commit(writer, id + 1, false);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_NE(std::string(wrong.status().message()).find(std::to_string(id)), std::string::npos) << wrong.status();
  EXPECT_EQ(commit(a.attachment, id, false).status().code(), absl::StatusCode::kPermissionDenied);
  auto done = commit(writer, id, false);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->tokens(), uint64_t(n + 1));
  ASSERT_NO_FATAL_FAILURE(AppendByRpc(hx, s, b.session, n));
  ExpectSameAnswers(hx, s, a.attachment, b.attachment, 800, uint64_t(n + 1));
  // Committed once: a second commit finds nothing.
  EXPECT_EQ(commit(writer, id, false).status().code(), absl::StatusCode::kFailedPrecondition);

  // A held token missing a layer: refused, naming the layer; then discarded.
  const int32_t id2 = s.tokens[n + 1];
  ASSERT_TRUE(stage(0, n + 1, id2, true).ok());
  auto partial = commit(writer, id2, false);
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kFailedPrecondition) << partial.status();
  EXPECT_NE(std::string(partial.status().message()).find("lacks layers [1"), std::string::npos) << partial.status();
  for (int layer = 1; layer < s.L; ++layer) ASSERT_TRUE(stage(layer, n + 1, id2, true).ok());
  auto dropped = commit(writer, id2, true);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  EXPECT_EQ(dropped->tokens(), uint64_t(n + 1));
  EXPECT_EQ(commit(writer, id2, false).status().code(), absl::StatusCode::kFailedPrecondition);

  // Staged completely and held, then an append comes in: the held token is refused.
  for (int layer = 0; layer < s.L; ++layer) ASSERT_TRUE(stage(layer, n + 1, id2, true).ok());
  v1::AppendTokensRequest ar = AppendOf(a.session, s, n + 1, n + 2, writer);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
  auto stale = commit(writer, id2, false);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kFailedPrecondition) << stale.status();
  EXPECT_NE(std::string(stale.status().message()).find("an append came in between"), std::string::npos)
      << stale.status();
}

}  // namespace
}  // namespace attend_decode_test
}  // namespace kvshade::service::testing

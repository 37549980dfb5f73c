// Tensor-parallel sessions (docs/DESIGN.md "Tensor-parallel sessions") on a daemon of two
// CPU devices ("cpu:0,cpu:1"): head-range checks that create nothing; two ranks holding
// the halves of a model's KV heads select and attend as one whole-model session does on
// those heads; appends and the logical token count; fork; close; per-rank prefix reuse;
// placement; a durable session restored whole, or damaged as a whole when a rank is
// missing.
#include <filesystem>

#include "kvshade/service/device_router.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace tensor_parallel_test {
namespace {

constexpr int kHeads = 4, kGroup = 2, kDim = 64, kLayers = 2;

// Heads [b, e) of `s`.
Stream SliceHeads(const Stream& s, int b, int e) {
  Stream o;
  o.L = s.L;
  o.h = e - b;
  o.d = s.d;
  o.tokens = s.tokens;
  for (int l = 0; l < s.L; ++l) {
    std::vector<bf16> k, v;
    for (int t = 0; t < s.n(); ++t) {
      const size_t row = (size_t(t) * s.h + b) * s.d;
      k.insert(k.end(), s.k[l].begin() + row, s.k[l].begin() + row + size_t(e - b) * s.d);
      v.insert(v.end(), s.v[l].begin() + row, s.v[l].begin() + row + size_t(e - b) * s.d);
    }
    o.k.push_back(std::move(k));
    o.v.push_back(std::move(v));
  }
  return o;
}


bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

// The router harness at rank 64 (RouterHarness), with an idle TTL when given.
class Tp : public RouterHarness {
 public:
  explicit Tp(std::string spill_path = "", uint32_t idle_ttl_s = 0)
      : RouterHarness("cpu:0,cpu:1", std::move(spill_path)) {
    config.profile.rank = 64;
    config.limits.session_idle_ttl_s = idle_ttl_s;
    absl::Status s = Start();
    EXPECT_TRUE(s.ok()) << s;
  }

  v1::CreateSessionRequest Request(const Stream& s, const v1::Profile& p, bool durable = false) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = model;
    *cr.mutable_profile() = p;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    cr.set_durable(durable);
    return cr;
  }
  absl::StatusOr<v1::CreateSessionResponse> Join(v1::CreateSessionRequest cr, const std::string& logical,
                                                 int ranks, int rank, int b, int e,
                                                 const std::string& device) {
    v1::TensorParallel* tp = cr.mutable_tensor_parallel();
    tp->set_ranks(ranks);
    tp->set_rank(rank);
    tp->set_kv_head_begin(b);
    tp->set_kv_head_end(e);
    tp->set_session_id(logical);
    cr.set_device(device);
    return router->CreateSession(tenant, cr);
  }
  absl::Status IngestAll(const v1::CreateSessionResponse& c, const Stream& s) {
    if (c.tokens_to_ingest() == 0) return absl::OkStatus();
    return router->Ingest(tenant, IngestStreamOf(c.session_id(), s, int(c.reused_tokens()), s.n())).status();
  }
  std::string Attach(const std::string& session) {
    v1::AttachRequest ar;
    ar.set_session_id(session);
    ar.set_worker_id("w");
    auto a = router->Attach(tenant, ar);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : "";
  }
  absl::StatusOr<v1::SessionInfo> Info(const std::string& id) {
    v1::GetSessionRequest g;
    g.set_session_id(id);
    return router->GetSession(tenant, g);
  }
  absl::Status Close(const std::string& id) {
    v1::CloseSessionRequest c;
    c.set_session_id(id);
    return router->CloseSession(tenant, c).status();
  }
  static std::vector<bf16> Query(uint64_t stream) {
    auto rng = kernels::testing::MakeRng(stream);
    return kernels::testing::RandomBf16(size_t(kHeads) * kGroup * kDim, rng, 1.0f);
  }
  // Query heads of KV heads [b, e).
  static std::vector<bf16> QueryRows(const std::vector<bf16>& q, int b, int e) {
    return {q.begin() + size_t(b) * kGroup * kDim, q.begin() + size_t(e) * kGroup * kDim};
  }
  absl::StatusOr<v1::AttendResponse> Attend(const std::string& attachment, int layer,
                                            const std::vector<bf16>& q) {
    return router->Attend(tenant, OneAttend(attachment, layer, q, kDim));
  }
  absl::StatusOr<v1::SlotDelta> Select(const std::string& attachment, int layer,
                                       const std::vector<bf16>& q) {
    auto resp = router->SelectAndReconstruct(tenant, OneSelect(attachment, layer, q, kDim));
    if (!resp.ok()) return resp.status();
    return resp->deltas(0);
  }
  size_t Listed() {
    auto l = router->ListSessions(tenant, v1::ListSessionsRequest());
    EXPECT_TRUE(l.ok()) << l.status();
    return l.ok() ? l->sessions_size() : 0;
  }

  // A logical session of two ranks (heads [0, 2) on cpu:0, [2, 4) on cpu:1), ingested.
  struct Logical {
    std::string id;
    std::string shard[2];
  };
  Logical OpenTp(const Stream& s, const v1::Profile& p, bool durable = false) {
    Logical out;
    for (int r = 0; r < 2; ++r) {
      auto c = Join(Request(s, p, durable), out.id, 2, r, r * 2, r * 2 + 2, r == 0 ? "cpu:0" : "cpu:1");
      EXPECT_TRUE(c.ok()) << c.status();
      if (!c.ok()) return out;
      out.id = c->tensor_parallel().session_id();
      out.shard[r] = c->session_id();
      absl::Status st = IngestAll(*c, SliceHeads(s, r * 2, r * 2 + 2));
      EXPECT_TRUE(st.ok()) << st;
    }
    return out;
  }

  v1::ModelSpec model = TestModel(kLayers, kHeads, kGroup, kDim);
};

TEST(TensorParallel, BadRangesAndMismatchedRanksAreRefusedAndCreateNothing) {
  Tp tp;
  ASSERT_TRUE(tp.router);
  const Stream s = MakeStream(256, tp.model, 11);
  const v1::Profile p = SmallShadowProfile();
  // A healthy plain session, and a logical session with rank 0 of 2 joined.
  v1::CreateSessionRequest plain = tp.Request(s, p);
  auto pc = tp.router->CreateSession(tp.tenant, plain);
  ASSERT_TRUE(pc.ok()) << pc.status();
  ASSERT_TRUE(tp.IngestAll(*pc, s).ok());
  const std::string pa = tp.Attach(pc->session_id());
  const std::vector<bf16> q = tp.Query(3);
  auto before = tp.Attend(pa, 1, q);
  ASSERT_TRUE(before.ok()) << before.status();
  auto r0 = tp.Join(tp.Request(s, p), "", 2, 0, 0, 2, "cpu:0");
  ASSERT_TRUE(r0.ok()) << r0.status();
  const std::string id = r0->tensor_parallel().session_id();
  EXPECT_EQ(r0->tensor_parallel().ranks(), 2u);
  EXPECT_EQ(r0->tensor_parallel().rank(), 0u);
  EXPECT_EQ(r0->tensor_parallel().ranks_joined(), 1u);
  EXPECT_NE(r0->session_id(), id);
  const size_t listed = tp.Listed();
  EXPECT_EQ(listed, 2u);  // the plain session and the logical one (not its shard)

  struct Case {
    std::string what;
    int ranks, rank, b, e;
    std::string join;  // "" = new logical session; "id" = join `id`
    absl::StatusCode code;
    std::string text;
  };
  const std::vector<Case> cases = {
      {"no ranks", 0, 0, 0, 4, "", absl::StatusCode::kInvalidArgument, "tensor_parallel.ranks"},
      {"more ranks than heads", 5, 0, 0, 1, "", absl::StatusCode::kInvalidArgument, "tensor_parallel.ranks"},
      {"rank past ranks", 2, 2, 2, 4, "", absl::StatusCode::kInvalidArgument, "tensor_parallel.rank"},
      {"empty range", 2, 0, 0, 0, "", absl::StatusCode::kInvalidArgument, "non-empty range"},
      {"past the heads", 2, 1, 2, 5, "", absl::StatusCode::kInvalidArgument, "non-empty range"},
      {"rank 0 not at head 0", 2, 0, 1, 2, "", absl::StatusCode::kInvalidArgument, "uncovered"},
      {"last rank short of the end", 2, 1, 2, 3, "", absl::StatusCode::kInvalidArgument, "uncovered"},
      {"no head left for rank 1", 3, 0, 0, 4, "", absl::StatusCode::kInvalidArgument, "fewer than one KV head"},
      {"overlaps rank 0", 2, 1, 1, 4, "id", absl::StatusCode::kInvalidArgument, "overlap"},
      {"rank 0 again", 2, 0, 0, 2, "id", absl::StatusCode::kFailedPrecondition, "already joined"},
      {"other rank count", 4, 1, 1, 2, "id", absl::StatusCode::kInvalidArgument, "has 2 ranks"},
      {"unknown logical session", 2, 1, 2, 4, "0123456789abcdef0123456789abcdef",
       absl::StatusCode::kNotFound, "not found"},
  };
  for (const Case& c : cases) {
    auto r = tp.Join(tp.Request(s, p), c.join == "id" ? id : c.join, c.ranks, c.rank, c.b, c.e, "cpu:1");
    EXPECT_EQ(r.status().code(), c.code) << c.what << ": " << r.status();
    EXPECT_TRUE(Contains(r.status(), c.text)) << c.what << ": " << r.status();
  }
  // A gap: ranks 0 and 2 of 3 joined, rank 1's range leaves a head between it and rank 2.
  auto g0 = tp.Join(tp.Request(s, p), "", 3, 0, 0, 1, "cpu:0");
  ASSERT_TRUE(g0.ok()) << g0.status();
  const std::string gid = g0->tensor_parallel().session_id();
  ASSERT_TRUE(tp.Join(tp.Request(s, p), gid, 3, 2, 3, 4, "cpu:1").ok());
  auto gap = tp.Join(tp.Request(s, p), gid, 3, 1, 1, 2, "cpu:1");
  EXPECT_EQ(gap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(gap.status(), "leave KV heads [2, 3) uncovered")) << gap.status();
  // Query heads that split a GQA group (or belong to other KV heads).
  v1::CreateSessionRequest split = tp.Request(s, p);
  split.mutable_tensor_parallel()->set_query_head_begin(4);
  split.mutable_tensor_parallel()->set_query_head_end(7);
  auto sq = tp.Join(split, id, 2, 1, 2, 4, "cpu:1");
  EXPECT_EQ(sq.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(sq.status(), "whole GQA groups")) << sq.status();
  // Another prompt, profile or durability than rank 0's.
  Stream other = s;
  other.tokens[100] += 1;
  auto diff = tp.Join(tp.Request(other, p), id, 2, 1, 2, 4, "cpu:1");
  EXPECT_EQ(diff.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(diff.status(), "token_ids differs")) << diff.status();
  auto prof = tp.Join(tp.Request(s, ProfileOf(v1::PROFILE_KIND_EXACT)), id, 2, 1, 2, 4, "cpu:1");
  EXPECT_TRUE(Contains(prof.status(), "profile differs")) << prof.status();
  // An unknown device.
  auto dev = tp.Join(tp.Request(s, p), id, 2, 1, 2, 4, "cpu:7");
  EXPECT_EQ(dev.status().code(), absl::StatusCode::kInvalidArgument);

  // Nothing was created: the same sessions, rank 1 still open, the plain session unchanged.
  EXPECT_EQ(tp.Listed(), listed + 1);  // + the gap test's logical session
  auto info = tp.Info(id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), "joining");
  EXPECT_EQ(info->tensor_parallel().ranks_joined(), 1u);
  EXPECT_EQ(tp.router->Stats(tp.tenant, v1::StatsRequest())->sessions(), 4u);  // plain + 3 shards
  auto after = tp.Attend(pa, 1, q);
  ASSERT_TRUE(after.ok()) << after.status();
  ExpectSameBits(TensorF32(after->outputs(0)), TensorF32(before->outputs(0)));
  // Rank 1 can still join with the right range.
  auto r1 = tp.Join(tp.Request(s, p), id, 2, 1, 2, 4, "cpu:1");
  ASSERT_TRUE(r1.ok()) << r1.status();
  EXPECT_EQ(r1->tensor_parallel().ranks_joined(), 2u);
  EXPECT_EQ(r1->device(), "cpu:1");
}

// Decoding with two ranks equals one whole-model session on the concatenated heads: per
// rank, the same chunks selected (heads, chunks, positions) with the same rows, and the same
// attended output and log-sum-exp on its query heads; then after both ranks append.
void ExpectRanksDecodeAsTheWhole(const v1::Profile& profile, bool exact_rows) {
  Tp tp;
  ASSERT_TRUE(tp.router);
  const int n = 512, extra = 24;
  const Stream all = MakeStream(n + extra, tp.model, 21);
  const Stream s = FirstTokens(all, n);
  auto wc = tp.router->CreateSession(tp.tenant, tp.Request(s, profile));
  ASSERT_TRUE(wc.ok()) << wc.status();
  ASSERT_TRUE(tp.IngestAll(*wc, s).ok());
  const Tp::Logical lg = tp.OpenTp(s, profile);
  ASSERT_FALSE(lg.shard[1].empty());
  // Placement: each shard on its rank's device; the logical session reports both.
  auto info = tp.Info(lg.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), "ready");
  EXPECT_EQ(info->tokens(), uint64_t(n));
  ASSERT_EQ(info->tensor_parallel().shards_size(), 2);
  EXPECT_EQ(info->tensor_parallel().shards(0).device(), "cpu:0");
  EXPECT_EQ(info->tensor_parallel().shards(1).device(), "cpu:1");
  EXPECT_EQ(info->tensor_parallel().shards(1).kv_head_begin(), 2u);
  for (int r = 0; r < 2; ++r) {
    auto si = tp.Info(lg.shard[r]);
    ASSERT_TRUE(si.ok()) << si.status();
    EXPECT_EQ(si->device(), r == 0 ? "cpu:0" : "cpu:1");
    EXPECT_EQ(si->tensor_parallel().session_id(), lg.id);
    EXPECT_EQ(si->tensor_parallel().rank(), uint32_t(r));
    EXPECT_EQ(si->tensor_parallel().kv_head_end(), uint32_t(2 * r + 2));
  }
  // Per-shard calls take the shard's id; the logical id is refused, naming the shards.
  v1::AttachRequest la;
  la.set_session_id(lg.id);
  la.set_worker_id("w");
  auto refused = tp.router->Attach(tp.tenant, la);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(refused.status(), "its own shard's session id")) << refused.status();
  EXPECT_EQ(tp.router->AppendTokens(tp.tenant, AppendOf(lg.id, all, n, n + 1)).status().code(),
            absl::StatusCode::kFailedPrecondition);

  const std::string wa = tp.Attach(wc->session_id());
  const std::string sa[2] = {tp.Attach(lg.shard[0]), tp.Attach(lg.shard[1])};
  auto compare = [&](uint64_t qseed) {
    const std::vector<bf16> q = tp.Query(qseed);
    for (int layer = 0; layer < kLayers; ++layer) {
      auto whole_sel = tp.Select(wa, layer, q);
      ASSERT_TRUE(whole_sel.ok()) << whole_sel.status();
      const std::vector<bf16> wk = TensorBf16(whole_sel->keys()), wv = TensorBf16(whole_sel->values());
      auto whole = tp.Attend(wa, layer, q);
      ASSERT_TRUE(whole.ok()) << whole.status();
      const std::vector<float> wo = TensorF32(whole->outputs(0)), wl = TensorF32(whole->lse(0));
      size_t miss_row = 0;
      for (int r = 0; r < 2; ++r) {
        const int b = 2 * r, e = 2 * r + 2;
        const std::vector<bf16> qr = Tp::QueryRows(q, b, e);
        auto sel = tp.Select(sa[r], layer, qr);
        ASSERT_TRUE(sel.ok()) << sel.status();
        // The whole session's misses of heads [b, e), in its order (head-major).
        std::vector<std::tuple<uint32_t, uint32_t, int32_t, int64_t>> want, got;
        std::vector<size_t> rows;
        for (int i = 0; i < whole_sel->head_size(); ++i) {
          if (int(whole_sel->head(i)) >= b && int(whole_sel->head(i)) < e) {
            want.emplace_back(whole_sel->head(i) - b, whole_sel->slot(i), whole_sel->chunk(i),
                              whole_sel->position(i));
            rows.push_back(i);
          }
        }
        for (int i = 0; i < sel->head_size(); ++i) {
          got.emplace_back(sel->head(i), sel->slot(i), sel->chunk(i), sel->position(i));
        }
        EXPECT_EQ(got, want) << "layer " << layer << " rank " << r;
        // The rows of each miss (reconstructed keys, values).
        const std::vector<bf16> gk = TensorBf16(sel->keys()), gv = TensorBf16(sel->values());
        const size_t row = gk.empty() ? 0 : gk.size() / std::max<size_t>(got.size(), 1);
        ASSERT_EQ(gk.size(), rows.size() * row);
        double worst = 0;
        for (size_t i = 0; i < rows.size(); ++i) {
          for (size_t j = 0; j < row; ++j) {
            const float a = kernels::Bf16ToFloat(gk[i * row + j]), c = kernels::Bf16ToFloat(wk[rows[i] * row + j]);
            worst = std::max<double>(worst, std::abs(a - c));
            EXPECT_EQ(kernels::Bf16ToFloat(gv[i * row + j]), kernels::Bf16ToFloat(wv[rows[i] * row + j]));
          }
        }
        if (exact_rows) {
          EXPECT_EQ(worst, 0.0) << "layer " << layer << " rank " << r;
        } else {
          EXPECT_LT(worst, 0.1) << "layer " << layer << " rank " << r;
        }
        miss_row += rows.size();
        auto out = tp.Attend(sa[r], layer, qr);
        ASSERT_TRUE(out.ok()) << out.status();
        const std::vector<float> o = TensorF32(out->outputs(0)), lse = TensorF32(out->lse(0));
        const std::vector<float> wo_r(wo.begin() + size_t(b) * kGroup * kDim, wo.begin() + size_t(e) * kGroup * kDim);
        const std::vector<float> wl_r(wl.begin() + b * kGroup, wl.begin() + e * kGroup);
        if (exact_rows) {
          ExpectSameBits(o, wo_r, "output");
          ExpectSameBits(lse, wl_r, "lse");
        } else {
          EXPECT_LT(RelErr(o, wo_r), 0.02) << "layer " << layer << " rank " << r;
          EXPECT_LT(RelErr(lse, wl_r), 0.01) << "layer " << layer << " rank " << r;
        }
      }
      EXPECT_EQ(miss_row, size_t(whole_sel->head_size()));
      if (!exact_rows) EXPECT_GT(whole_sel->selected(), 0u);  // shadow selects (exact has no selection)
    }
  };
  compare(5);
  compare(6);  // a second step: hits as well as misses
  // Appends: rank 0 first (the logical session counts the tokens every rank has), then
  // rank 1; the whole session gets the same tokens.
  const Stream h0 = SliceHeads(all, 0, 2), h1 = SliceHeads(all, 2, 4);
  ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(lg.shard[0], h0, n, n + extra)).ok());
  info = tp.Info(lg.id);
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->tokens(), uint64_t(n));
  EXPECT_EQ(info->tensor_parallel().shards(0).tokens(), uint64_t(n + extra));
  EXPECT_EQ(info->tensor_parallel().shards(1).tokens(), uint64_t(n));
  ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(lg.shard[1], h1, n, n + extra)).ok());
  ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(wc->session_id(), all, n, n + extra)).ok());
  EXPECT_EQ(tp.Info(lg.id)->tokens(), uint64_t(n + extra));
  compare(7);
}

TEST(TensorParallel, TwoRanksDecodeAsTheWholeModelExact) {
  ExpectRanksDecodeAsTheWhole(ProfileOf(v1::PROFILE_KIND_EXACT), /*exact_rows=*/true);
}

TEST(TensorParallel, TwoRanksDecodeAsTheWholeModelShadow) {
  ExpectRanksDecodeAsTheWhole(SmallShadowProfile(), /*exact_rows=*/false);
}

TEST(TensorParallel, ForkForksEveryRankAtOneTokenAndCloseClosesEvery) {
  Tp tp;
  ASSERT_TRUE(tp.router);
  const int n = 256;
  const Stream all = MakeStream(n + 8, tp.model, 41);
  const Tp::Logical lg = tp.OpenTp(FirstTokens(all, n), SmallShadowProfile());
  ASSERT_FALSE(lg.shard[1].empty());
  const v1::StatsResponse st0 = *tp.router->Stats(tp.tenant, v1::StatsRequest());
  // A shard is forked and closed only with its logical session.
  v1::ForkSessionRequest fs;
  fs.set_parent_session_id(lg.shard[0]);
  fs.set_at_token(n);
  auto shard_fork = tp.router->ForkSession(tp.tenant, fs);
  EXPECT_EQ(shard_fork.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(shard_fork.status(), lg.id)) << shard_fork.status();
  EXPECT_EQ(tp.Close(lg.shard[1]).code(), absl::StatusCode::kFailedPrecondition);
  // Rank 0 ahead of rank 1: a fork at rank 0's end is refused (rank 1 has not committed
  // it), and nothing is forked.
  ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(lg.shard[0], SliceHeads(all, 0, 2), n, n + 8)).ok());
  v1::ForkSessionRequest f;
  f.set_parent_session_id(lg.id);
  f.set_at_token(n + 8);
  auto ahead = tp.router->ForkSession(tp.tenant, f);
  EXPECT_EQ(ahead.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(ahead.status(), "rank 1 has committed 256 tokens")) << ahead.status();
  EXPECT_EQ(tp.router->Stats(tp.tenant, v1::StatsRequest())->sessions(), st0.sessions());
  ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(lg.shard[1], SliceHeads(all, 2, 4), n, n + 8)).ok());
  auto child = tp.router->ForkSession(tp.tenant, f);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->shared_tokens(), uint64_t(n + 8));
  ASSERT_EQ(child->tensor_parallel().shards_size(), 2);
  auto ci = tp.Info(child->session_id());
  ASSERT_TRUE(ci.ok()) << ci.status();
  EXPECT_EQ(ci->state(), "ready");
  EXPECT_EQ(ci->tokens(), uint64_t(n + 8));
  // Each child shard is on its parent shard's device and answers as it does.
  const std::vector<bf16> q = tp.Query(9);
  for (int r = 0; r < 2; ++r) {
    const v1::TensorParallelShard& cs = child->tensor_parallel().shards(r);
    EXPECT_EQ(cs.device(), r == 0 ? "cpu:0" : "cpu:1");
    EXPECT_NE(cs.session_id(), lg.shard[r]);
    auto si = tp.Info(cs.session_id());
    ASSERT_TRUE(si.ok());
    EXPECT_EQ(si->tensor_parallel().session_id(), child->session_id());
    const std::vector<bf16> qr = Tp::QueryRows(q, 2 * r, 2 * r + 2);
    auto a = tp.Attend(tp.Attach(lg.shard[r]), 1, qr);
    auto b = tp.Attend(tp.Attach(cs.session_id()), 1, qr);
    ASSERT_TRUE(a.ok() && b.ok());
    ExpectSameBits(TensorF32(a->outputs(0)), TensorF32(b->outputs(0)));
  }
  // Closing the parent closes both its shards and leaves the child whole.
  ASSERT_TRUE(tp.Close(lg.id).ok());
  EXPECT_EQ(tp.Info(lg.id).status().code(), absl::StatusCode::kNotFound);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(tp.Info(lg.shard[r]).status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(tp.Info(child->session_id())->state(), "ready");
  EXPECT_EQ(tp.Listed(), 1u);
  ASSERT_TRUE(tp.Close(child->session_id()).ok());
  EXPECT_EQ(tp.Listed(), 0u);
  EXPECT_EQ(tp.router->Stats(tp.tenant, v1::StatsRequest())->sessions(), 0u);
}

// Idle expiry acts per shard: a logical session one of whose shards expired is damaged
// (that rank's shard missing); one whose shards all expired is gone.
TEST(TensorParallel, IdleExpiryOfAShardDamagesTheLogicalSessionAndOfAllRemovesIt) {
  Tp tp("", /*idle_ttl_s=*/10);
  ASSERT_TRUE(tp.router);
  const Stream s = MakeStream(256, tp.model, 71);
  const Tp::Logical lg = tp.OpenTp(s, SmallShadowProfile());
  ASSERT_FALSE(lg.shard[1].empty());
  tp.now_ms += 6000;
  ASSERT_TRUE(tp.Info(lg.shard[0]).ok());  // rank 0's shard is used; rank 1's is not
  tp.now_ms += 6000;
  tp.router->RunMaintenance();
  auto info = tp.Info(lg.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), "damaged");
  EXPECT_EQ(info->tensor_parallel().shards(1).state(), "missing");
  EXPECT_TRUE(info->damage().find("rank 1's shard") != std::string::npos) << info->damage();
  EXPECT_EQ(info->tensor_parallel().shards(0).state(), "ready");
  tp.now_ms += 20000;
  tp.router->RunMaintenance();
  EXPECT_EQ(tp.Info(lg.id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(tp.Listed(), 0u);
  // The id is forgotten: a per-shard call naming it is an unknown session's.
  EXPECT_EQ(tp.router->AppendTokens(tp.tenant, AppendOf(lg.id, s, 0, 1)).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(TensorParallel, PrefixesAreReusedPerRank) {
  Tp tp;
  ASSERT_TRUE(tp.router);
  const int n = 512;
  const Stream s = MakeStream(n, tp.model, 51);
  const v1::Profile p = SmallShadowProfile();
  const Tp::Logical first = tp.OpenTp(s, p);
  ASSERT_FALSE(first.shard[1].empty());
  ASSERT_TRUE(tp.Close(first.id).ok());  // its segments stay cached
  // A rank's lookup sees its own heads' prefix.
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = tp.model;
  *lr.mutable_profile() = p;
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  lr.set_device("cpu:1");
  EXPECT_EQ(tp.router->LookupPrefix(tp.tenant, lr)->reusable_tokens(), 0u);  // whole model
  lr.mutable_tensor_parallel()->set_ranks(2);
  lr.mutable_tensor_parallel()->set_rank(1);
  lr.mutable_tensor_parallel()->set_kv_head_begin(2);
  lr.mutable_tensor_parallel()->set_kv_head_end(4);
  EXPECT_GT(tp.router->LookupPrefix(tp.tenant, lr)->reusable_tokens(), 0u);
  // The same prompt and layout: each rank reuses its cached prefix.
  std::string id;
  for (int r = 0; r < 2; ++r) {
    auto c = tp.Join(tp.Request(s, p), id, 2, r, 2 * r, 2 * r + 2, r == 0 ? "cpu:0" : "cpu:1");
    ASSERT_TRUE(c.ok()) << c.status();
    id = c->tensor_parallel().session_id();
    EXPECT_GT(c->reused_tokens(), uint64_t(n / 2)) << "rank " << r;
    ASSERT_TRUE(tp.IngestAll(*c, SliceHeads(s, 2 * r, 2 * r + 2)).ok());
  }
  EXPECT_EQ(tp.Info(id)->state(), "ready");
  // Another layout (heads [0, 1) and [1, 4)), the whole model, or rank 1's heads on the
  // other device: nothing to reuse.
  auto other = tp.Join(tp.Request(s, p), "", 2, 0, 0, 1, "cpu:0");
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->reused_tokens(), 0u);
  auto whole = tp.router->CreateSession(tp.tenant, tp.Request(s, p));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->reused_tokens(), 0u);
  auto moved = tp.Join(tp.Request(s, p), "", 2, 1, 2, 4, "cpu:0");
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(moved->reused_tokens(), 0u);
}

TEST(TensorParallel, DurableSessionsRestoreWholeOrDamagedAsAWhole) {
  TempDir dir;
  const std::string spill = dir.path() + "/spill";
  const int n = 256, extra = 8;
  Tp::Logical whole, partial;
  std::vector<float> out[2];
  const std::vector<bf16> q = Tp::Query(13);
  {
    Tp tp(spill);
    ASSERT_TRUE(tp.router);
    const Stream all = MakeStream(n + extra, tp.model, 61);
    whole = tp.OpenTp(FirstTokens(all, n), SmallShadowProfile(), /*durable=*/true);
    ASSERT_FALSE(whole.shard[1].empty());
    for (int r = 0; r < 2; ++r) {
      ASSERT_TRUE(tp.router->AppendTokens(tp.tenant, AppendOf(whole.shard[r], SliceHeads(all, 2 * r, 2 * r + 2), n, n + extra)).ok());
      auto a = tp.Attend(tp.Attach(whole.shard[r]), 1, Tp::QueryRows(q, 2 * r, 2 * r + 2));
      ASSERT_TRUE(a.ok()) << a.status();
      out[r] = TensorF32(a->outputs(0));
    }
    // A second durable logical session whose rank 1 never committed its ingest.
    const Stream s2 = MakeStream(n, tp.model, 62);
    auto c0 = tp.Join(tp.Request(s2, SmallShadowProfile(), true), "", 2, 0, 0, 2, "cpu:1");
    ASSERT_TRUE(c0.ok()) << c0.status();
    partial.id = c0->tensor_parallel().session_id();
    partial.shard[0] = c0->session_id();
    ASSERT_TRUE(tp.IngestAll(*c0, SliceHeads(s2, 0, 2)).ok());
    auto c1 = tp.Join(tp.Request(s2, SmallShadowProfile(), true), partial.id, 2, 1, 2, 4, "cpu:0");
    ASSERT_TRUE(c1.ok()) << c1.status();
    partial.shard[1] = c1->session_id();
    ASSERT_TRUE(tp.router->Drain().ok());
  }
  Tp tp(spill);
  ASSERT_TRUE(tp.router);
  // Whole: every rank's shard back on its device with its appends, answering as before.
  auto info = tp.Info(whole.id);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->state(), "ready");
  EXPECT_TRUE(info->durable());
  EXPECT_EQ(info->tokens(), uint64_t(n + extra));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(info->tensor_parallel().shards(r).session_id(), whole.shard[r]);
    EXPECT_EQ(info->tensor_parallel().shards(r).device(), r == 0 ? "cpu:0" : "cpu:1");
    auto a = tp.Attend(tp.Attach(whole.shard[r]), 1, Tp::QueryRows(q, 2 * r, 2 * r + 2));
    ASSERT_TRUE(a.ok()) << a.status();
    ExpectSameBits(TensorF32(a->outputs(0)), out[r], "restored rank");
  }
  // Partial: damaged as a whole; its restored shard is not served; close removes it.
  auto pi = tp.Info(partial.id);
  ASSERT_TRUE(pi.ok()) << pi.status();
  EXPECT_EQ(pi->state(), "damaged");
  EXPECT_TRUE(pi->damaged());
  EXPECT_TRUE(pi->damage().find("rank 1's shard was not restored") != std::string::npos) << pi->damage();
  v1::AttachRequest ar;
  ar.set_session_id(partial.shard[0]);
  ar.set_worker_id("w");
  auto refused = tp.router->Attach(tp.tenant, ar);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_EQ(tp.Join(tp.Request(MakeStream(n, tp.model, 62), SmallShadowProfile(), true), partial.id,
                    2, 1, 2, 4, "cpu:0").status().code(),
            absl::StatusCode::kFailedPrecondition);
  v1::ForkSessionRequest f;
  f.set_parent_session_id(partial.id);
  f.set_at_token(n);
  EXPECT_EQ(tp.router->ForkSession(tp.tenant, f).status().code(), absl::StatusCode::kDataLoss);
  ASSERT_TRUE(tp.Close(partial.id).ok());
  EXPECT_EQ(tp.Info(partial.id).status().code(), absl::StatusCode::kNotFound);
  // And the close stuck: after another restart only the whole session is there.
  ASSERT_TRUE(tp.Restart().ok());
  EXPECT_EQ(tp.Listed(), 1u);
  EXPECT_EQ(tp.Info(whole.id)->state(), "ready");
}

}  // namespace
}  // namespace tensor_parallel_test
}  // namespace kvshade::service::testing

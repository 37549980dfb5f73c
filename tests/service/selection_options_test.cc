// Selection options through the engine (docs/ALGORITHM.md "Selection options"): model-native
// chunk ids served exactly into the slot tables (and refused when malformed), two-stage and
// mass-budget profiles, and the recall guard: sampled recall@k in metrics and GetSession,
// and the fallback on a planted low-recall session (a widened budget, or every chunk, which
// Attend then uses).
#include <prometheus/text_serializer.h>

#include <map>
#include <set>

#include "kvshade/service/selection_guard.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace selection_options_test {
namespace {

constexpr int kC = 8;

v1::Tensor ChunkTensor(const std::vector<int32_t>& ids, int h) {
  v1::Tensor t;
  t.add_shape(h);
  t.add_shape(int64_t(ids.size()) / h);
  t.set_dtype(v1::DTYPE_INT32);
  t.set_data(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  return t;
}

absl::StatusOr<v1::SlotDelta> NativeSelect(Harness& hs, const std::string& attachment, int layer,
                                           const std::vector<int32_t>& ids) {
  v1::SelectAndReconstructRequest r;
  r.set_layer(layer);
  auto* sq = r.add_queries();
  sq->set_attachment_id(attachment);
  *sq->mutable_chunks() = ChunkTensor(ids, hs.model.num_kv_heads());
  auto resp = hs.engine->SelectAndReconstruct(hs.tenant, r);
  if (!resp.ok()) return resp.status();
  return resp->deltas(0);
}

v1::Profile ShadowProfile(int budget) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_sparse_budget(budget);
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  p.set_rank(128);  // full rank (h*d): reconstructed keys are the keys, to bf16
  p.set_rerank_factor(1);
  return p;
}

// Budgets by attention mass: cap `budget`, mass `top_p`, floor `min_chunks`.
v1::Profile MassProfile(int budget, float top_p, int min_chunks) {
  v1::Profile p = ShadowProfile(budget);
  p.set_mass_top_p(top_p);
  p.set_mass_min_chunks(min_chunks);
  return p;
}

TEST(ModelNative, GivenChunksAreServedExactlyIntoTheSlots) {
  Harness hs;
  hs.config.profile.outliers = 0;  // only the sink is static: every id below is selectable
  hs.Restart();
  const Stream s = MakeStream(512, hs.model, 1);
  auto o = hs.Open(s, ShadowProfile(6));
  const int h = 2, d = 64;
  const std::vector<float> exact_k = PostRope(s, 1);
  // Head 0 asks for chunks 10, 3, 40; head 1 for 7 and 20 (m = 3, -1 padded).
  std::vector<int32_t> ids = {10, 3, 40, 7, -1, 20};
  auto delta = NativeSelect(hs, o.attachment, 1, ids);
  ASSERT_TRUE(delta.ok()) << delta.status();
  std::map<int, std::set<int>> got;
  const std::vector<bf16> keys = TensorBf16(delta->keys()), values = TensorBf16(delta->values());
  for (int i = 0; i < delta->head_size(); ++i) {
    const int hh = delta->head(i), c = delta->chunk(i);
    got[hh].insert(c);
    // The rows are the chunk's keys (post-RoPE, to bf16 and the rank-128 basis) and values.
    for (int t = 0; t < kC; ++t) {
      for (int ch = 0; ch < d; ++ch) {
        const size_t tok = size_t(c) * kC + t;
        EXPECT_NEAR(kernels::Bf16ToFloat(keys[(size_t(i) * kC + t) * d + ch]),
                    exact_k[(tok * h + hh) * d + ch], 0.08)
            << "head " << hh << " chunk " << c;
        EXPECT_EQ(kernels::Bf16ToFloat(values[(size_t(i) * kC + t) * d + ch]),
                  kernels::Bf16ToFloat(s.v[1][(tok * h + hh) * d + ch]));
      }
    }
  }
  // Chunk 0 is the sink (static): it is skipped if named; these are all selectable.
  EXPECT_EQ(got[0], (std::set<int>{3, 10, 40}));
  EXPECT_EQ(got[1], (std::set<int>{7, 20}));
  EXPECT_EQ(delta->selected(), 5u);
  EXPECT_EQ(delta->hits(), 0u);
  // The next step keeps 10 and 20 in their slots: only the new chunks move.
  auto again = NativeSelect(hs, o.attachment, 1, {10, 11, -1, 20, 21, 22});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->selected(), 5u);
  EXPECT_EQ(again->hits(), 2u);
  std::set<std::pair<int, int>> moved;
  for (int i = 0; i < again->head_size(); ++i) moved.insert({int(again->head(i)), again->chunk(i)});
  EXPECT_EQ(moved, (std::set<std::pair<int, int>>{{0, 11}, {1, 21}, {1, 22}}));
}

TEST(ModelNative, MalformedIdsAreRefused) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 2);
  auto o = hs.Open(s, ShadowProfile(4));
  for (const std::vector<int32_t>& bad :
       {std::vector<int32_t>{5, 5, -1, 1, 2, 3},     // repeated in one head
        std::vector<int32_t>{5, 9999, -1, 1, 2, 3},  // beyond the layer's chunks
        std::vector<int32_t>{5, -3, -1, 1, 2, 3},    // negative other than -1
        std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}}) {  // m = 5 > 4 slots
    auto d = NativeSelect(hs, o.attachment, 0, bad);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  }
}

TEST(SelectionProfiles, MassBudgetSelectsFewerChunksThanTheCap) {
  Harness hs;
  auto o = hs.Open(MakeStream(512, hs.model, 3), MassProfile(16, 0.05f, 2));
  auto d = hs.Select(o.attachment, 0, hs.Query(7, 3.0f));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_LT(d->selected(), 2u * 16);
  EXPECT_GE(d->selected(), 2u * 2);
  // Two stages at the same budget answer too (the kernels' tests check what they pick).
  v1::Profile t = ShadowProfile(8);
  t.set_rerank_factor(4);
  auto o2 = hs.Open(MakeStream(512, hs.model, 4), t);
  auto d2 = hs.Select(o2.attachment, 0, hs.Query(8));
  ASSERT_TRUE(d2.ok()) << d2.status();
  EXPECT_EQ(d2->selected(), 2u * 8);
}

// A worker that keeps its own copy of the slots applies the deltas' misses only. With a mass
// budget (fewer chunks than slots on sharp queries, more on flat ones) its copy must stay the
// daemon's table, read back through SlotTable, step after step.
TEST(SelectionProfiles, MassBudgetDeltasKeepAWorkersSlotsEqualToTheTable) {
  Harness hs;
  auto o = hs.Open(MakeStream(512, hs.model, 5), MassProfile(16, 0.5f, 1));
  const int h = hs.model.num_kv_heads(), k = 16, layer = 1;
  std::vector<int32_t> mirror(size_t(h) * k, -1);
  uint32_t fewest = 2 * k, most = 0;
  for (int step = 0; step < 12; ++step) {
    auto d = hs.Select(o.attachment, layer, hs.Query(40 + step, step % 2 == 0 ? 4.0f : 0.25f));
    ASSERT_TRUE(d.ok()) << d.status();
    fewest = std::min(fewest, d->selected());
    most = std::max(most, d->selected());
    for (int i = 0; i < d->slot_size(); ++i) mirror[size_t(d->head(i)) * k + d->slot(i)] = d->chunk(i);
    v1::SlotTableRequest r;
    r.set_attachment_id(o.attachment);
    auto t = hs.engine->SlotTable(hs.tenant, r);
    ASSERT_TRUE(t.ok()) << t.status();
    ASSERT_EQ(t->layers_size(), 1);
    ASSERT_EQ(t->layers(0).slots_per_head(), uint32_t(k));
    const std::vector<int32_t> table(t->layers(0).chunk().begin(), t->layers(0).chunk().end());
    EXPECT_EQ(mirror, table) << "step " << step;
  }
  EXPECT_LT(fewest, most);  // the budget did change between steps
}

std::string MetricsText(Harness& hs) {
  prometheus::TextSerializer ser;
  return ser.Serialize(hs.metrics.registry()->Collect());
}

// Keys with no low-rank structure and a tiny budget: the landmarks of 8 random keys say
// little about their maximum, so recall@2 against the oracle stays far below 0.95.
struct Planted {
  Harness hs;
  Stream s;
  Harness::Opened o;
  explicit Planted(v1::RecallAction action, float floor = 0.95f) {
    s = MakeStream(512, hs.model, 11, /*key_rank=*/2, 1000, /*noise=*/1.0f);
    v1::Profile p = ShadowProfile(2);
    p.set_recall_sample_rate(1.0f);
    p.set_recall_floor(floor);
    p.set_recall_action(action);
    o = hs.Open(s, p);
  }
};

v1::SessionInfo Info(Harness& hs, const std::string& session) {
  v1::GetSessionRequest r;
  r.set_session_id(session);
  r.set_include_selection(true);
  auto info = hs.engine->GetSession(hs.tenant, r);
  EXPECT_TRUE(info.ok()) << info.status();
  return info.ok() ? *info : v1::SessionInfo();
}

TEST(RecallGuard, WidensTheBudgetOfALowRecallLayer) {
  Planted pl(v1::RECALL_ACTION_WIDEN);
  // The step on which the guard acts is still served from the slots (its selection was
  // delivered); the layer's later selects are fallbacks.
  for (int step = 0; step < SelectionGuard::kWindow; ++step) {
    auto d = pl.hs.Select(pl.o.attachment, 1, pl.hs.Query(100 + step));
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_FALSE(d->fallback()) << "step " << step;
    EXPECT_GT(d->selected(), 0u) << "step " << step;
  }
  const v1::SessionInfo info = Info(pl.hs, pl.o.session);
  ASSERT_EQ(info.selection().layers_size(), 1);
  const v1::LayerSelection& l = info.selection().layers(0);
  EXPECT_EQ(l.layer(), 1u);
  EXPECT_EQ(l.samples(), uint64_t(SelectionGuard::kWindow));
  EXPECT_LT(l.recall(), 0.95);
  EXPECT_GE(l.recall(), 0.0);
  EXPECT_EQ(l.fallback(), v1::RECALL_ACTION_WIDEN);
  EXPECT_EQ(l.budget(), 4u);  // 2 doubled
  EXPECT_EQ(l.actions(), 1u);
  EXPECT_EQ(info.selection().samples(), uint64_t(SelectionGuard::kWindow));
  // Without include_selection the figures are left out.
  v1::GetSessionRequest plain;
  plain.set_session_id(pl.o.session);
  EXPECT_FALSE(pl.hs.engine->GetSession(pl.hs.tenant, plain)->has_selection());
  // A fallback select selects, reconstructs and delivers nothing, and is not sampled.
  auto fb = pl.hs.Select(pl.o.attachment, 1, pl.hs.Query(120));
  ASSERT_TRUE(fb.ok()) << fb.status();
  EXPECT_TRUE(fb->fallback());
  EXPECT_EQ(fb->selected(), 0u);
  EXPECT_EQ(fb->head_size(), 0);
  EXPECT_EQ(Info(pl.hs, pl.o.session).selection().layers(0).samples(), uint64_t(SelectionGuard::kWindow));
  const std::string text = MetricsText(pl.hs);
  EXPECT_NE(text.find("kvshade_selection_recall_count{profile=\"shadow\"} 4"), std::string::npos)
      << text;
  EXPECT_NE(text.find("kvshade_selection_guard_actions_total{action=\"widen\",profile=\"shadow\"} 1"),
            std::string::npos)
      << text;
}

// Attend serves a widened layer at its widened budget and samples there: a second window
// below the floor doubles the budget again (2 -> 4 -> 8), not back from the profile's.
TEST(RecallGuard, WidenDoublesFromTheBudgetInUse) {
  Planted pl(v1::RECALL_ACTION_WIDEN, /*floor=*/1.0f);
  std::vector<uint32_t> budgets;
  for (int step = 0; step < 3 * SelectionGuard::kWindow; ++step) {
    ASSERT_TRUE(pl.hs.Attend(pl.o.attachment, 0, pl.hs.Query(600 + step)).ok());
    const v1::SessionInfo info = Info(pl.hs, pl.o.session);
    ASSERT_EQ(info.selection().layers_size(), 1);
    budgets.push_back(info.selection().layers(0).budget());
  }
  const int w = SelectionGuard::kWindow;
  EXPECT_EQ(budgets[w - 2], 0u);  // the profile's until the first full window
  EXPECT_EQ(budgets[w - 1], 4u);
  EXPECT_EQ(budgets[2 * w - 1], 8u) << "the second action doubles the widened budget";
  const v1::SessionInfo info = Info(pl.hs, pl.o.session);
  EXPECT_EQ(info.selection().layers(0).samples(), uint64_t(3 * w));
}

TEST(RecallGuard, ExactFallbackAttendsEveryChunk) {
  Planted pl(v1::RECALL_ACTION_EXACT);
  const std::vector<bf16> q = pl.hs.Query(200);
  auto before = pl.hs.Attend(pl.o.attachment, 0, q);
  ASSERT_TRUE(before.ok()) << before.status();
  for (int step = 0; step < SelectionGuard::kWindow; ++step) {
    ASSERT_TRUE(pl.hs.Attend(pl.o.attachment, 0, pl.hs.Query(300 + step)).ok());
  }
  const v1::SessionInfo info = Info(pl.hs, pl.o.session);
  ASSERT_EQ(info.selection().layers_size(), 1);
  EXPECT_EQ(info.selection().layers(0).fallback(), v1::RECALL_ACTION_EXACT);
  // Attention now covers every chunk: it equals a twin session whose budget covers them.
  auto after = pl.hs.Attend(pl.o.attachment, 0, q);
  ASSERT_TRUE(after.ok()) << after.status();
  v1::Profile all = ShadowProfile(4096);
  auto twin = pl.hs.Open(pl.s, all);
  auto full = pl.hs.Attend(twin.attachment, 0, q);
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_LT(RelErr(*after, *full), 1e-5);
  EXPECT_GT(RelErr(*before, *full), 1e-3);  // the fallback changed the answer
}

TEST(RecallGuard, NoActionAboveTheFloorAndNoSamplingWhenOff) {
  Planted low_floor(v1::RECALL_ACTION_WIDEN, /*floor=*/0.01f);
  for (int step = 0; step < 2 * SelectionGuard::kWindow; ++step) {
    auto d = low_floor.hs.Select(low_floor.o.attachment, 0, low_floor.hs.Query(400 + step));
    ASSERT_TRUE(d.ok());
    EXPECT_FALSE(d->fallback());
  }
  const v1::SessionInfo info = Info(low_floor.hs, low_floor.o.session);
  ASSERT_EQ(info.selection().layers_size(), 1);
  EXPECT_EQ(info.selection().layers(0).samples(), uint64_t(2 * SelectionGuard::kWindow));
  EXPECT_EQ(info.selection().layers(0).fallback(), v1::RECALL_ACTION_UNSPECIFIED);

  Harness hs;  // the server default: sampling off
  auto o = hs.Open(MakeStream(512, hs.model, 12), ShadowProfile(2));
  for (int step = 0; step < 8; ++step) ASSERT_TRUE(hs.Select(o.attachment, 0, hs.Query(500 + step)).ok());
  EXPECT_EQ(Info(hs, o.session).selection().samples(), 0u);
}

}  // namespace
}  // namespace selection_options_test
}  // namespace kvshade::service::testing

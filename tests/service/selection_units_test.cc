// Selection units through the engine (docs/ALGORITHM.md "Selection units"): the profile
// knob's validation and echo; slots sized in units (Attach, the slot table); deltas whose
// misses are units of u rows, each the exact tokens of its unit at their positions; the
// daemon's Attend over units; model-native ids refused; the recall guard counting units.
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "kvshade/service/config.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace selection_units_test {
namespace {

constexpr int kC = 8;

v1::Profile UnitProfile(int budget, int unit, int rerank = 4) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_sparse_budget(budget);
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  p.set_rank(128);  // full rank (h*d): reconstructed keys are the keys, to bf16
  p.set_rerank_factor(rerank);
  if (unit >= 0) p.set_selection_unit(unit);
  return p;
}

absl::StatusOr<v1::CreateSessionResponse> Create(Harness& hs, const Stream& s, const v1::Profile& p,
                                                 int n = -1) {
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hs.model;
  *cr.mutable_profile() = p;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + (n < 0 ? s.n() : n));
  return hs.engine->CreateSession(hs.tenant, cr);
}

void ExpectRefused(Harness& hs, const Stream& s, const v1::Profile& p, const std::string& what,
                   int n = -1) {
  auto c = Create(hs, s, p, n);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << c.status();
  EXPECT_NE(c.status().message().find("selection_unit"), std::string::npos) << what << ": " << c.status();
}

TEST(SelectionUnits, TheProfileKnobIsValidated) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 1);
  ExpectRefused(hs, s, UnitProfile(8, 3), "3 does not divide C = 8");
  ExpectRefused(hs, s, UnitProfile(8, 16), "16 is wider than C = 8");
  ExpectRefused(hs, s, UnitProfile(8, 2, /*rerank=*/1), "units need two stages");
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_MINI, v1::PROFILE_KIND_EXACT}) {
    v1::Profile p = UnitProfile(8, 2);
    p.set_kind(kind);
    ExpectRefused(hs, s, p, v1::ProfileKind_Name(kind));
  }
  // Echoed by GetSession: u, or 0 for whole chunks (u = C is whole chunks).
  for (auto [asked, echoed] : {std::pair{2, 2}, {1, 1}, {kC, 0}, {0, 0}, {-1, 0}}) {
    auto c = Create(hs, s, UnitProfile(8, asked));
    ASSERT_TRUE(c.ok()) << asked << ": " << c.status();
    v1::GetSessionRequest gr;
    gr.set_session_id(c->session_id());
    auto info = hs.engine->GetSession(hs.tenant, gr);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->selection_unit(), uint32_t(echoed)) << asked;
  }
  // AUTO keeps units for shadow sessions only: a short prompt resolves to mini without them.
  v1::Profile aut = UnitProfile(8, 2);
  aut.set_kind(v1::PROFILE_KIND_AUTO);
  auto mini = Create(hs, s, aut, 64);  // below the harness's min_tokens (256)
  ASSERT_TRUE(mini.ok()) << mini.status();
  EXPECT_EQ(mini->effective_profile(), v1::PROFILE_KIND_MINI);
  v1::GetSessionRequest gr;
  gr.set_session_id(mini->session_id());
  auto info = hs.engine->GetSession(hs.tenant, gr);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->selection_unit(), 0u);
}

TEST(SelectionUnits, ServerDefaultsAreValidated) {
  ServerConfig c;
  c.profile.rerank_factor = 4;
  c.profile.selection_unit = 2;
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.profile.selection_unit = 3;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.profile.selection_unit = 16;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.profile.selection_unit = 2;
  c.profile.rerank_factor = 1;
  EXPECT_FALSE(ValidateConfig(c).ok());
  c.profile.selection_unit = 8;  // = chunk_size: whole chunks
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(SelectionUnits, ServerDefaultAppliesToShadowSessions) {
  Harness hs;
  hs.config.profile.rerank_factor = 4;
  hs.config.profile.selection_unit = 4;
  hs.Restart();
  const Stream s = MakeStream(512, hs.model, 2);
  v1::Profile p = UnitProfile(8, -1);
  p.clear_rerank_factor();
  auto o = hs.Open(s, p);
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  auto info = hs.engine->GetSession(hs.tenant, gr);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->selection_unit(), 4u);
  auto d = hs.Select(o.attachment, 0, hs.Query(3));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->slot_tokens(), 4u);
}

// Attach sizes the slots in units (the same bytes as whole chunks); a select's misses are
// units: u rows each, unit ids, the positions and exact rows of their tokens; the slot
// table counts units; a second step with the same query hits every unit.
TEST(SelectionUnits, DeltasCarryUnitsOfURows) {
  Harness hs;
  hs.config.profile.outliers = 0;  // only the sink is static
  hs.Restart();
  const Stream s = MakeStream(512, hs.model, 4);
  const int h = 2, d = 64, budget = 6;
  for (int u : {1, 2, 4}) {
    auto o = hs.Open(s, UnitProfile(budget, u));
    v1::AttachRequest ar;
    ar.set_session_id(o.session);
    auto att = hs.engine->Attach(hs.tenant, ar);
    ASSERT_TRUE(att.ok()) << att.status();
    const int k = budget * kC / u;
    EXPECT_EQ(att->slots_per_head(), uint32_t(k)) << u;
    EXPECT_EQ(att->slot_tokens(), uint32_t(u));
    EXPECT_EQ(att->chunk_size(), uint32_t(kC));
    EXPECT_EQ(att->slot_buffer_bytes(), uint64_t(hs.model.num_layers()) * h * budget * kC * d * 2);
    const std::vector<float> exact_k = PostRope(s, 1);
    const std::vector<bf16> q = hs.Query(5, 2.0f);
    auto delta = hs.Select(o.attachment, 1, q);
    ASSERT_TRUE(delta.ok()) << delta.status();
    EXPECT_EQ(delta->slot_tokens(), uint32_t(u));
    EXPECT_EQ(delta->selected(), uint32_t(h * k));
    ASSERT_EQ(delta->head_size(), h * k);
    ASSERT_EQ(delta->keys().shape_size(), 3);
    EXPECT_EQ(delta->keys().shape(1), u);
    const std::vector<bf16> keys = TensorBf16(delta->keys()), values = TensorBf16(delta->values());
    std::map<int, std::set<int>> units;
    for (int i = 0; i < delta->head_size(); ++i) {
      const int hh = delta->head(i), j = delta->chunk(i);
      ASSERT_GE(j, u == kC ? 0 : kC / u);  // never the sink chunk's units
      ASSERT_LT(j, s.n() / u);
      EXPECT_TRUE(units[hh].insert(j).second) << "unit " << j << " twice for head " << hh;
      EXPECT_EQ(delta->position(i), int64_t(j) * u) << "unit " << j;
      for (int t = 0; t < u; ++t) {
        const size_t tok = size_t(j) * u + t;
        for (int ch = 0; ch < d; ++ch) {
          EXPECT_NEAR(kernels::Bf16ToFloat(keys[(size_t(i) * u + t) * d + ch]),
                      exact_k[(tok * h + hh) * d + ch], 0.08)
              << "u " << u << " head " << hh << " unit " << j;
          EXPECT_EQ(kernels::Bf16ToFloat(values[(size_t(i) * u + t) * d + ch]),
                    kernels::Bf16ToFloat(s.v[1][(tok * h + hh) * d + ch]));
        }
      }
    }
    // The slot table holds the units, k per head.
    v1::SlotTableRequest tr;
    tr.set_attachment_id(o.attachment);
    auto table = hs.engine->SlotTable(hs.tenant, tr);
    ASSERT_TRUE(table.ok()) << table.status();
    ASSERT_EQ(table->layers_size(), 1);
    EXPECT_EQ(table->layers(0).slots_per_head(), uint32_t(k));
    for (int hh = 0; hh < h; ++hh) {
      std::set<int> held;
      for (int x = 0; x < k; ++x) held.insert(table->layers(0).chunk(hh * k + x));
      EXPECT_EQ(held, units[hh]) << "u " << u << " head " << hh;
    }
    // The same query again: every unit is a hit.
    auto again = hs.Select(o.attachment, 1, q);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->head_size(), 0);
    EXPECT_EQ(again->hits(), uint32_t(h * k));
  }
}

// The daemon's Attend with units attends the static set, the selected units' rows (those a
// select on a fresh attachment delivers) and the tail; with a budget that covers every
// selectable token, units and whole chunks attend the same rows (the same output).
TEST(SelectionUnits, AttendOverUnits) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 6);
  const std::vector<bf16> q = hs.Query(9, 2.0f);
  const int g = hs.model.num_query_heads() / hs.model.num_kv_heads(), d = hs.model.head_dim();
  auto whole = hs.Open(s, UnitProfile(64, 0));
  auto units = hs.Open(s, UnitProfile(64, 2));
  for (int l = 0; l < hs.model.num_layers(); ++l) {
    auto a = hs.Attend(whole.attachment, l, q);
    auto b = hs.Attend(units.attachment, l, q);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_LT(RelErr(*b, *a), 1e-5) << "layer " << l;
  }
  for (int u : {1, 4}) {
    auto o = hs.Open(s, UnitProfile(4, u));
    for (int l = 0; l < hs.model.num_layers(); ++l) {
      auto got = hs.Attend(o.attachment, l, q);
      ASSERT_TRUE(got.ok()) << got.status();
      auto dl = hs.Select(o.attachment, l, q);  // the attachment's first select: every unit misses
      ASSERT_TRUE(dl.ok()) << dl.status();
      EXPECT_EQ(dl->head_size(), 2 * 4 * kC / u);
      const std::vector<float> want = HeldAttend(hs.StaticSet(o.attachment, l), g, d, q, &*dl);
      EXPECT_LT(RelErr(*got, want), 1e-5) << "u " << u << " layer " << l;
    }
  }
}

TEST(SelectionUnits, ModelNativeIdsAreRefused) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 7);
  auto o = hs.Open(s, UnitProfile(4, 2));
  v1::SelectAndReconstructRequest r;
  r.set_layer(0);
  auto* sq = r.add_queries();
  sq->set_attachment_id(o.attachment);
  const std::vector<int32_t> ids = {3, 4};
  v1::Tensor* t = sq->mutable_chunks();
  t->add_shape(2);
  t->add_shape(1);
  t->set_dtype(v1::DTYPE_INT32);
  t->set_data(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  auto resp = hs.engine->SelectAndReconstruct(hs.tenant, r);
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kInvalidArgument) << resp.status();
  EXPECT_NE(resp.status().message().find("selection_unit"), std::string::npos) << resp.status();
}

// The recall guard samples units against an oracle over units: a budget of every chunk
// recalls every oracle unit (recall 1); GetSession reports the samples.
TEST(SelectionUnits, RecallGuardCountsUnits) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 8);
  v1::Profile full = UnitProfile(64, 2);
  full.set_recall_sample_rate(1.0f);
  full.set_recall_floor(0.01f);
  auto o = hs.Open(s, full);
  v1::Profile narrow = UnitProfile(2, 1, /*rerank=*/2);
  narrow.set_recall_sample_rate(1.0f);
  narrow.set_recall_floor(0.01f);
  auto n = hs.Open(s, narrow);
  for (int step = 0; step < 3; ++step) {
    for (const auto* a : {&o, &n}) {
      auto d = hs.Select(a->attachment, 0, hs.Query(20 + step, 2.0f));
      ASSERT_TRUE(d.ok()) << d.status();
      ASSERT_FALSE(d->fallback());
    }
  }
  for (const auto* a : {&o, &n}) {
    v1::GetSessionRequest gr;
    gr.set_session_id(a->session);
    gr.set_include_selection(true);
    auto info = hs.engine->GetSession(hs.tenant, gr);
    ASSERT_TRUE(info.ok()) << info.status();
    ASSERT_EQ(info->selection().layers_size(), 1);
    EXPECT_EQ(info->selection().layers(0).samples(), 3u);
    const double recall = info->selection().layers(0).recall();
    if (a == &o) {
      EXPECT_DOUBLE_EQ(recall, 1.0);
    } else {
      EXPECT_GT(recall, 0.0);
      EXPECT_LE(recall, 1.0);
    }
  }
}

}  // namespace
}  // namespace selection_units_test
}  // namespace kvshade::service::testing

// The decode core with selection units (kvshade/kernels/decode_step.h, docs/ALGORITHM.md
// "Selection units") on the CPU backend: the policy's options and slot widths keep the token
// budget (k chunks' worth of tokens, k*C/u units, the mass floor in units); groups of
// different units never share a launch; reconstruct items carry the unit; the backend probe;
// the recall oracle over units (recall counted in units) and the guard's budgets in chunks.
#include <algorithm>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/decode_step.h"
#include "select_ex_util.h"
#include "test_util.h"

namespace kvshade::decode {
namespace decode_step_units_test {
namespace {

using kernels::testing::Cpu;
using kernels::testing::LowRankCase;
using kernels::testing::MakeRng;
using kernels::testing::RandomLowRank;

SelectionPolicy UnitPolicy(int budget, int rerank, int unit) {
  SelectionPolicy p;
  p.sparse_budget = budget;
  p.rerank_factor = rerank;
  p.selection_unit = unit;
  return p;
}

TEST(DecodeStepUnits, OptionsKeepTheTokenBudget) {
  kernels::RopeSpec rope;
  rope.theta = 10000.0f;
  SelectionPolicy p = UnitPolicy(16, 4, 2);
  p.mass_top_p = 0.9f;
  p.mass_min_chunks = 40;
  EXPECT_TRUE(p.units(8));
  EXPECT_EQ(p.UnitsPerChunk(8), 4);
  EXPECT_EQ(p.Slots(16, 8), 64);  // 16 chunks' worth of tokens in units of 2
  const kernels::SelectOptions o = p.OptionsAt(16, 8, rope);
  EXPECT_EQ(o.candidates, 4 * 16);  // stage 1 counts chunks
  EXPECT_EQ(o.unit, 2);
  EXPECT_EQ(o.C, 8);
  EXPECT_EQ(o.min_k, 40);  // the mass floor counts units, at most the 64 slots
  p.mass_min_chunks = 100;
  EXPECT_EQ(p.OptionsAt(16, 8, rope).min_k, 64);
  EXPECT_EQ(p.Label(false), "shadow+rerank4+top_p0.9+unit2");
  // u = C, or 0: whole chunks.
  for (int u : {0, 8}) {
    const SelectionPolicy w = UnitPolicy(16, 4, u);
    EXPECT_FALSE(w.units(8));
    EXPECT_EQ(w.Slots(16, 8), 16);
    EXPECT_EQ(w.OptionsAt(16, 8, rope).unit, 0) << u;
  }
  // Groups of different units never share a launch; the group tells its rows per slot.
  SelectionGroup a, b;
  a.C = b.C = 8;
  a.options = UnitPolicy(16, 4, 2).OptionsAt(16, 8, rope);
  b.options = UnitPolicy(16, 4, 4).OptionsAt(16, 8, rope);
  EXPECT_NE(a.Key(), b.Key());
  EXPECT_EQ(a.unit_tokens(), 2);
  EXPECT_EQ(a.units_per_chunk(), 4);
  EXPECT_EQ(b.unit_tokens(), 4);
  kernels::SelectItem s;
  EXPECT_EQ(ReconstructOf(a, s, nullptr, nullptr, false).unit, 2);
  SelectionGroup native = a;
  native.native = true;
  EXPECT_EQ(ReconstructOf(native, s, nullptr, nullptr, false).unit, 0);
  // Unit ids' positions: unit 5 of u = 2 is token 2 of chunk 1.
  kernels::SessionLayerView view;
  view.n_segments = 1;
  view.segments[0].n_chunks = 4;
  view.segments[0].first_position = 100;
  EXPECT_EQ(a.position(view, 5), 100 + 8 + 2);
}

TEST(DecodeStepUnits, TheBackendProbe) {
  auto be = Cpu();
  kernels::RopeSpec rope;
  rope.theta = 10000.0f;
  const kernels::LayerShape shape{2, 2, 16};
  EXPECT_TRUE(CheckUnitsSupported(*be, shape, UnitPolicy(8, 4, 2), 8, rope).ok());
  EXPECT_TRUE(CheckUnitsSupported(*be, shape, UnitPolicy(8, 1, 0), 8, rope).ok());
  EXPECT_TRUE(absl::IsInvalidArgument(CheckUnitsSupported(*be, shape, UnitPolicy(8, 1, 2), 8, rope)));
}

struct HostView {
  kernels::SessionLayerView view;
};

HostView ViewOf(const LowRankCase& c) {
  HostView v;
  v.view.n_segments = 1;
  v.view.b = c.b.data();
  v.view.r = c.r;
  kernels::SegmentView& s = v.view.segments[0];
  s.n_chunks = c.n_chunks;
  s.first_position = c.first_position;
  s.landmarks = c.landmarks.data();
  s.excluded = c.excluded.data();
  s.a = c.a.data();
  return v;
}

// The selection of group `g` (fresh slots) as [h, g.k] ids.
std::vector<int32_t> Select(kernels::Backend& be, const SelectionGroup& g, const LowRankCase& c,
                            const kernels::SessionLayerView& view) {
  const int h = g.shape.h;
  std::vector<int32_t> slots(size_t(h) * g.k, -1), outs(SelectOutputWords(h, g.k));
  kernels::SelectItem it;
  it.view = view;
  it.q = c.q.data();
  it.slots = slots.data();
  BindOutputs(outs.data(), h, g.k, &it);
  const kernels::SelectItem items[1] = {it};
  std::vector<char> ws(SelectionWorkspaceBytes(be, g, items) + 16);
  EXPECT_TRUE(RunSelection(be, g, items, kernels::Workspace{ws.data(), ws.size()}, {}).ok());
  return std::vector<int32_t>(outs.begin(), outs.begin() + size_t(h) * g.k);
}

// The oracle ranks units of the group's size: a selection with every chunk as a candidate
// is the oracle (recall 1); nothing selected recalls nothing; the guard records budgets in
// chunks, so a widened layer doubles its chunks (its slots stay budget * C/u).
TEST(DecodeStepUnits, OracleOverUnitsAndGuardBudgetsInChunks) {
  auto be = Cpu();
  auto rng = MakeRng(901);
  LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 8, 8, 24, /*static_every=*/7);
  const HostView hv = ViewOf(c);
  const int budget = 3;
  SelectionPolicy p = UnitPolicy(budget, 24, 2);  // 24 * 3 candidates: every chunk
  SelectionGroup g;
  g.shape = c.shape;
  g.C = c.C;
  g.rope = c.rope;
  g.k = p.Slots(budget, c.C);
  g.options = p.OptionsAt(budget, c.C, c.rope);
  ASSERT_TRUE(g.options.units());
  const std::vector<int32_t> sel = Select(*be, g, c, hv.view);
  for (int32_t j : sel) ASSERT_LT(j, c.n_chunks * c.C / 2);
  std::vector<char> ws(OracleWorkspaceBytes(*be, g, hv.view, budget));
  const kernels::Workspace w{ws.data(), ws.size()};
  auto full = OracleRecall(*be, g, hv.view, c.q.data(), sel.data(), g.k, budget, w, {});
  ASSERT_TRUE(full.ok()) << full.status();
  ASSERT_TRUE(full->has_value());
  EXPECT_DOUBLE_EQ(**full, 1.0);
  // Nothing selected recalls nothing.
  const std::vector<int32_t> none(sel.size(), -1);
  auto zero = OracleRecall(*be, g, hv.view, c.q.data(), none.data(), g.k, budget, w, {});
  ASSERT_TRUE(zero.ok() && zero->has_value());
  EXPECT_DOUBLE_EQ(**zero, 0.0);

  // The guard: four samples at recall 0 widen the layer from 3 chunks (12 slots) to 6.
  p.recall_sample_rate = 1.0f;
  p.recall_floor = 0.5f;
  p.recall_action = RecallAction::kWiden;
  SelectionGuard guard;
  GuardOutcome last;
  for (int i = 0; i < SelectionGuard::kWindow; ++i) {
    ASSERT_TRUE(GuardSamples(guard, p, 0));
    auto o = GuardStep(*be, guard, p, g, 0, hv.view, c.q.data(), none.data(), g.k, w, {});
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_TRUE(o->sampled);
    last = *o;
  }
  EXPECT_EQ(last.action, RecallAction::kWiden);
  EXPECT_EQ(guard.Budget(0, budget, c.n_chunks), 2 * budget);
  EXPECT_EQ(p.Slots(guard.Budget(0, budget, c.n_chunks), c.C), 2 * budget * 4);
}

}  // namespace
}  // namespace decode_step_units_test
}  // namespace kvshade::decode

// SelectEx (two-stage selection, mass budgets) and AssignSlots (model-native selection) on
// the CPU reference: defaults equal Select; two stages over every chunk equal a brute-force
// double-precision oracle; stage 2 normalises each query head before the group's maximum;
// on planted needles two stages never recall less than stage 1 alone; the mass budget
// against a reference cut (landmark scores in one stage, stage-2 shares in two), its floor
// and cap; caller-chosen ids served exactly (slot diff and the reconstructed rows); stage 2
// from key signatures against the same oracle over the keys they stand for, and their
// encoder against the reference.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"
#include "select_ex_util.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace select_ex_test {
namespace {

using testing::Cpu;
using testing::ExOut;
using testing::LowRankCase;
using testing::MakeRng;
using testing::OracleTopK;
using testing::RandomLowRank;
using testing::RunEx;

std::set<int32_t> Row(const std::vector<int32_t>& v, int hh, int k) {
  std::set<int32_t> s;
  for (int i = 0; i < k; ++i)
    if (v[size_t(hh) * k + i] >= 0) s.insert(v[size_t(hh) * k + i]);
  return s;
}

double Recall(const std::set<int32_t>& got, const std::vector<int32_t>& oracle) {
  if (oracle.empty()) return 1.0;
  int hit = 0;
  for (int32_t c : oracle) hit += got.count(c);
  return double(hit) / double(oracle.size());
}

// Runs Select (the reference for default options) on the CPU for the same case.
ExOut RunPlainSelect(Backend& be, const LowRankCase& c, int k, const std::vector<int32_t>& slots) {
  // SelectEx with default options must equal Select: run Select through the same inputs by
  // a SelectItem built like RunEx's.
  const int h = c.shape.h;
  ExOut out;
  out.slots = slots;
  out.selected.assign(size_t(h) * k, -7);
  out.miss_slot.assign(size_t(h) * k, -7);
  out.miss_chunk.assign(size_t(h) * k, -7);
  out.miss_count.assign(h, -7);
  SelectItem it;
  it.view.n_segments = 1;
  it.view.b = c.b.data();
  it.view.r = c.r;
  it.view.segments[0].n_chunks = c.n_chunks;
  it.view.segments[0].first_position = c.first_position;
  it.view.segments[0].landmarks = c.landmarks.data();
  it.view.segments[0].excluded = c.excluded.data();
  it.view.segments[0].a = c.a.data();
  it.q = c.q.data();
  it.slots = out.slots.data();
  it.selected = out.selected.data();
  it.miss_slot = out.miss_slot.data();
  it.miss_chunk = out.miss_chunk.data();
  it.miss_count = out.miss_count.data();
  std::vector<SelectItem> items = {it};
  auto ws = be.Allocate(be.SelectWorkspaceBytes(c.shape, k, items)).value();
  EXPECT_TRUE(be.Select(c.shape, k, items, ws.workspace()).ok());
  return out;
}

TEST(SelectEx, DefaultOptionsEqualSelectOverSteps) {
  auto be = Cpu();
  auto rng = MakeRng(1);
  LowRankCase c = RandomLowRank(rng, {2, 3, 16}, 4, 8, 40, /*static_every=*/7);
  const int k = 6;
  std::vector<int32_t> a(2 * k, -1), b(2 * k, -1);
  for (int step = 0; step < 4; ++step) {
    ExOut x = RunEx(*be, c, k, nullptr, a);
    ExOut y = RunPlainSelect(*be, c, k, b);
    EXPECT_EQ(x.selected, y.selected) << "step " << step;
    EXPECT_EQ(x.slots, y.slots);
    EXPECT_EQ(x.miss_slot, y.miss_slot);
    EXPECT_EQ(x.miss_chunk, y.miss_chunk);
    EXPECT_EQ(x.miss_count, y.miss_count);
    a = x.slots;
    b = y.slots;
    c.q = testing::RandomBf16(c.q.size(), rng, 1.0f);  // the next step's query
  }
}

TEST(SelectEx, TwoStageOverEveryChunkIsTheBruteForceOracle) {
  auto be = Cpu();
  for (int seed = 0; seed < 4; ++seed) {
    auto rng = MakeRng(100 + seed);
    LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 4, 16, 30, /*static_every=*/5);
    const int k = 5;
    SelectOptions o;
    o.candidates = 1000;  // >= every chunk: stage 2 scores them all
    o.C = c.C;
    o.rope = c.rope;
    ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(2 * k, -1));
    for (int hh = 0; hh < 2; ++hh) {
      const std::vector<int32_t> want = OracleTopK(c, hh, k);
      std::vector<int32_t> got(x.selected.begin() + hh * k, x.selected.begin() + (hh + 1) * k);
      EXPECT_EQ(got, want) << "seed " << seed << " head " << hh;  // order too
    }
    // candidates == selectable count exactly is the same thing.
    SelectOptions o2 = o;
    o2.candidates = 24;  // 30 chunks, 6 static per head: 24 selectable
    ExOut y = RunEx(*be, c, k, &o2, std::vector<int32_t>(2 * k, -1));
    EXPECT_EQ(y.selected, x.selected);
  }
}

// Needle chunks: one token strongly aligned with q among tokens pointing away, so that the
// chunk mean is only slightly positive; decoys: every token moderately aligned (a higher
// mean, a lower max); background: noise. Landmarks rank the decoys first; the oracle ranks
// the needles first.
LowRankCase Planted(std::mt19937_64& rng, int n_chunks, const std::vector<int>& needles,
                    const std::vector<int>& decoys, int C = 4) {
  LowRankCase c;
  const int d = 16;
  c.shape = {1, 1, d};
  c.C = C;
  c.r = d;
  c.n_chunks = n_chunks;
  c.first_position = 5;
  c.rope.theta = 10000.0f;
  c.b.assign(size_t(d) * d, bf16{});
  for (int x = 0; x < d; ++x) c.b[size_t(x) * d + x] = FloatToBf16(1.0f);
  c.q.assign(d, bf16{});
  c.q[0] = FloatToBf16(4.0f);
  std::normal_distribution<float> noise(0.0f, 0.1f);
  const RopeTable table = MakeRopeTable(c.rope, d).value();
  c.a.assign(size_t(n_chunks) * C * d, bf16{});
  for (int j = 0; j < n_chunks; ++j) {
    const bool needle = std::count(needles.begin(), needles.end(), j) > 0;
    const bool decoy = std::count(decoys.begin(), decoys.end(), j) > 0;
    const int hot = int(rng() % C);
    for (int t = 0; t < C; ++t) {
      std::vector<float> kp(d);
      for (float& x : kp) x = noise(rng);
      if (needle) kp[0] += t == hot ? 6.0f : -1.5f;
      if (decoy) kp[0] += 1.5f;
      // Pre-RoPE key: rotate back from the token's position.
      ApplyRopeReference(table, c.rope.pairing, -(c.first_position + j * C + t), kp.data(), d);
      for (int x = 0; x < d; ++x) c.a[(size_t(j) * C + t) * d + x] = FloatToBf16(kp[x]);
    }
  }
  c.excluded.assign(n_chunks, 0);
  testing::BuildLandmarks(c);
  return c;
}

TEST(SelectEx, TwoStageFindsPlantedNeedlesThatLandmarksMiss) {
  auto be = Cpu();
  auto rng = MakeRng(7);
  const std::vector<int> needles = {3, 17, 29, 41, 50, 58, 62, 70};
  const std::vector<int> decoys = {1, 9, 22, 33, 44, 55, 66, 75};
  LowRankCase c = Planted(rng, 80, needles, decoys);
  const int k = 8;
  const std::vector<int32_t> oracle = OracleTopK(c, 0, k);
  EXPECT_EQ(std::set<int32_t>(oracle.begin(), oracle.end()),
            std::set<int32_t>(needles.begin(), needles.end()));
  ExOut one = RunEx(*be, c, k, nullptr, std::vector<int32_t>(k, -1));
  SelectOptions o;
  o.candidates = 4 * k;
  o.C = c.C;
  o.rope = c.rope;
  ExOut two = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
  EXPECT_EQ(Recall(Row(one.selected, 0, k), oracle), 0.0);  // landmarks pick the decoys
  EXPECT_EQ(Recall(Row(two.selected, 0, k), oracle), 1.0);
}

TEST(SelectEx, TwoStageNeverRecallsLessThanStageOneOnPlantedCases) {
  auto be = Cpu();
  double sum1 = 0, sum2 = 0;
  for (int seed = 0; seed < 12; ++seed) {
    auto rng = MakeRng(200 + seed);
    std::vector<int> ids(64);
    for (int i = 0; i < 64; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    const int n_needles = 2 + seed % 6, n_decoys = 2 + (seed * 5) % 9;
    std::vector<int> needles(ids.begin(), ids.begin() + n_needles);
    std::vector<int> decoys(ids.begin() + n_needles, ids.begin() + n_needles + n_decoys);
    LowRankCase c = Planted(rng, 64, needles, decoys, 2 + seed % 3);
    const int k = 4 + seed % 5;
    const std::vector<int32_t> oracle = OracleTopK(c, 0, k);
    ExOut one = RunEx(*be, c, k, nullptr, std::vector<int32_t>(k, -1));
    for (int factor : {2, 4}) {
      SelectOptions o;
      o.candidates = factor * k;
      o.C = c.C;
      o.rope = c.rope;
      ExOut two = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
      const double r1 = Recall(Row(one.selected, 0, k), oracle);
      const double r2 = Recall(Row(two.selected, 0, k), oracle);
      EXPECT_GE(r2, r1) << "seed " << seed << " factor " << factor;
      sum1 += r1;
      sum2 += r2;
    }
  }
  EXPECT_GT(sum2, sum1 + 1.0);  // and clearly better on the whole
}

// Reference cut of the mass budget over the landmark scores of one head, in double.
int ReferenceMassCut(const LowRankCase& c, int hh, int k, double top_p, int min_k) {
  const int h = c.shape.h, g = c.shape.g, d = c.shape.d;
  std::vector<double> s(c.n_chunks, -INFINITY);
  for (int n = 0; n < g; ++n) {
    std::vector<double> x(c.n_chunks);
    double mx = -INFINITY;
    for (int j = 0; j < c.n_chunks; ++j) {
      if (c.excluded[size_t(hh) * c.n_chunks + j]) continue;
      double dot = 0;
      for (int ch = 0; ch < d; ++ch)
        dot += double(Bf16ToFloat(c.q[size_t(hh * g + n) * d + ch])) *
               Bf16ToFloat(c.landmarks[(size_t(j) * h + hh) * d + ch]);
      x[j] = dot / std::sqrt(double(d));
      mx = std::max(mx, x[j]);
    }
    double z = 0;
    for (int j = 0; j < c.n_chunks; ++j)
      if (!c.excluded[size_t(hh) * c.n_chunks + j]) z += std::exp(x[j] - mx);
    for (int j = 0; j < c.n_chunks; ++j)
      if (!c.excluded[size_t(hh) * c.n_chunks + j]) s[j] = std::max(s[j], std::exp(x[j] - mx) / z);
  }
  std::vector<double> sorted;
  for (int j = 0; j < c.n_chunks; ++j)
    if (!c.excluded[size_t(hh) * c.n_chunks + j]) sorted.push_back(s[j]);
  std::sort(sorted.rbegin(), sorted.rend());
  const int kk = std::min<int>(k, int(sorted.size()));
  double cum = 0;
  int n = kk;
  for (int i = 0; i < kk; ++i) {
    cum += sorted[i];
    if (cum >= top_p) {
      n = i + 1;
      break;
    }
  }
  return std::min(kk, std::max(n, min_k));
}

int Count(const std::vector<int32_t>& v, int hh, int k) {
  int n = 0;
  for (int i = 0; i < k; ++i) n += v[size_t(hh) * k + i] >= 0;
  return n;
}

TEST(SelectEx, MassBudgetCutsWhereTheReferenceDoes) {
  auto be = Cpu();
  for (int seed = 0; seed < 6; ++seed) {
    auto rng = MakeRng(300 + seed);
    LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 4, 8, 48, /*static_every=*/6);
    // Sharpen the query so that the mass concentrates on a few chunks.
    for (bf16& x : c.q) x = FloatToBf16(Bf16ToFloat(x) * 4.0f);
    const int k = 16;
    ExOut full = RunEx(*be, c, k, nullptr, std::vector<int32_t>(2 * k, -1));
    for (double p : {0.3, 0.6, 0.9}) {
      for (int min_k : {0, 3}) {
        SelectOptions o;
        o.top_p = float(p);
        o.min_k = min_k;
        ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(2 * k, -1));
        for (int hh = 0; hh < 2; ++hh) {
          const int want = ReferenceMassCut(c, hh, k, p, min_k);
          EXPECT_EQ(Count(x.selected, hh, k), want) << "seed " << seed << " p " << p;
          // The kept chunks are the prefix of the fixed-k ranking.
          for (int i = 0; i < want; ++i) EXPECT_EQ(x.selected[hh * k + i], full.selected[hh * k + i]);
          EXPECT_EQ(x.miss_count[hh], want);  // from an empty table: every kept chunk misses
        }
      }
    }
  }
}

TEST(SelectEx, MassBudgetFloorAndCap) {
  auto be = Cpu();
  auto rng = MakeRng(400);
  LowRankCase c = RandomLowRank(rng, {1, 1, 16}, 4, 8, 40);
  const int k = 10;
  SelectOptions o;
  o.top_p = 1e-6f;  // the first chunk reaches it: the floor decides
  o.min_k = 4;
  EXPECT_EQ(Count(RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1)).selected, 0, k), 4);
  o.min_k = 0;
  EXPECT_EQ(Count(RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1)).selected, 0, k), 1);
  o.top_p = 1.0f;  // never reached by 10 of 40 chunks: the cap decides
  EXPECT_EQ(Count(RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1)).selected, 0, k), k);
  // Slots a shorter cut does not need keep their chunks (they were delivered before), so
  // the table is unchanged and the full selection again hits every chunk.
  ExOut full = RunEx(*be, c, k, nullptr, std::vector<int32_t>(k, -1));
  o.top_p = 1e-6f;
  o.min_k = 2;
  ExOut cut = RunEx(*be, c, k, &o, full.slots);
  EXPECT_EQ(Count(cut.selected, 0, k), 2);
  EXPECT_EQ(cut.slots, full.slots);
  EXPECT_EQ(cut.miss_count[0], 0);  // both kept chunks were already in slots
  ExOut again = RunEx(*be, c, k, nullptr, cut.slots);
  EXPECT_EQ(again.miss_count[0], 0);
  EXPECT_EQ(again.slots, full.slots);
  // Two stages with a budget: the candidates' shares w of the attention over them.
  SelectOptions t;
  t.candidates = 40;
  t.C = c.C;
  t.rope = c.rope;
  t.top_p = 1e-6f;
  t.min_k = 3;
  ExOut ts = RunEx(*be, c, k, &t, std::vector<int32_t>(k, -1));
  EXPECT_EQ(Count(ts.selected, 0, k), 3);
  const std::vector<int32_t> oracle = OracleTopK(c, 0, 3);
  EXPECT_EQ(std::vector<int32_t>(ts.selected.begin(), ts.selected.begin() + 3), oracle);
}

// Stage 2 normalises each query head over the candidates' tokens before the group's maximum,
// as stage 1 and the oracle do (FlatHeadCase: the raw maximum ranks chunk 2 first, the
// normalised scores chunk 5). The mass budget sums the chunks' shares w: chunk 5 alone holds
// 0.99 of head 1's attention (a softmax of the raw maxima gave it 0.095, and 4 chunks reached
// only 0.62).
TEST(SelectEx, TwoStageNormalisesEachQueryHead) {
  auto be = Cpu();
  using testing::FlatHeadCase;
  const int C = FlatHeadCase::kC, n_chunks = FlatHeadCase::kChunks;
  const int X = FlatHeadCase::kX, Y = FlatHeadCase::kY;
  const LowRankCase c = FlatHeadCase::Make();

  // What the raw maximum would rank first: chunk Y, above X.
  auto raw_max = [&](int j) {
    double best = -INFINITY;
    for (int t = 0; t < C; ++t) {
      const std::vector<float> k = testing::KeyOf(c, 0, j * C + t);
      for (int n = 0; n < 2; ++n) {
        double dot = 0;
        for (int ch = 0; ch < 16; ++ch) dot += double(Bf16ToFloat(c.q[n * 16 + ch])) * k[ch];
        best = std::max(best, dot / 4.0);
      }
    }
    return best;
  };
  EXPECT_DOUBLE_EQ(raw_max(Y), 11.25);
  EXPECT_DOUBLE_EQ(raw_max(X), 10.0);

  for (int candidates : {4, n_chunks}) {
    SelectOptions o;
    o.candidates = candidates;
    o.C = C;
    o.rope = c.rope;
    const int k = 2;
    ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
    EXPECT_EQ(x.selected, (std::vector<int32_t>{X, Y})) << "candidates " << candidates;
  }
  EXPECT_EQ(OracleTopK(c, 0, 2), (std::vector<int32_t>{X, Y}));
  {
    SelectOptions o;
    o.candidates = n_chunks;
    o.C = C;
    o.rope = c.rope;
    // The chunks after X and Y tie (every token at 10 under head 0): ids break the tie.
    EXPECT_EQ(RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1)).selected,
              (std::vector<int32_t>{X, Y, 0, 1}));
  }

  // Mass budget over every chunk: w(X) = (e^8 + 3) / (e^8 + 31) = 0.9907 (head 1),
  // w(Y) = (e^1.25 + 3) / (e^1.25 + 31) = 0.188 (head 0), every other chunk 4 / 34.49.
  const testing::OracleScores ref = testing::ScoreCandidates(c, 0, testing::SelectableChunks(c, 0));
  EXPECT_NEAR(std::exp(ref.log_w[X]), (std::exp(8.0) + 3) / (std::exp(8.0) + 31), 1e-12);
  EXPECT_NEAR(std::exp(ref.log_w[Y]), (std::exp(1.25) + 3) / (std::exp(1.25) + 31), 1e-12);
  SelectOptions o;
  o.candidates = n_chunks;
  o.C = C;
  o.rope = c.rope;
  const int k = 4;
  o.top_p = 0.95f;  // X alone
  EXPECT_EQ(RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1)).selected,
            (std::vector<int32_t>{X, -1, -1, -1}));
  o.top_p = 1.0f;  // X and Y: 1.18 (the group's maxima can sum past 1)
  EXPECT_EQ(RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1)).selected,
            (std::vector<int32_t>{X, Y, -1, -1}));
}

// Reference cut of the mass budget in two stages (double): the candidates in stage-2 rank
// order with their log w.
int ReferenceTwoStageCut(const std::vector<std::pair<int32_t, double>>& ranked, int k,
                         double top_p, int min_k) {
  const int kk = std::min<int>(k, int(ranked.size()));
  double cum = 0;
  int n = kk;
  for (int i = 0; i < kk; ++i) {
    cum += std::exp(ranked[i].second);
    if (cum >= top_p) {
      n = i + 1;
      break;
    }
  }
  return std::min(kk, std::max(n, min_k));
}

// Two stages, with stage 1 narrowing the candidates and with every chunk a candidate: the
// fixed-k ranking is the reference's stage-2 ranking of the same candidates (Select's top
// max(candidates, k)), and the mass budget cuts it where the reference's w does.
TEST(SelectEx, TwoStageMassBudgetCutsWhereTheReferenceDoes) {
  auto be = Cpu();
  const int h = 2, k = 12;
  for (int seed = 0; seed < 6; ++seed) {
    auto rng = MakeRng(350 + seed);
    LowRankCase c = RandomLowRank(rng, {h, 3, 16}, 4, 8, 48, /*static_every=*/6);
    for (bf16& x : c.q) x = FloatToBf16(Bf16ToFloat(x) * 3.0f);
    for (int candidates : {3 * k, 1000}) {  // 36 of 40 selectable per head; all of them
      SelectOptions o;
      o.candidates = candidates;
      o.C = c.C;
      o.rope = c.rope;
      const std::vector<std::vector<int32_t>> cands = testing::StageOneCandidates(*be, c, k, o);
      ExOut full = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
      std::vector<std::vector<std::pair<int32_t, double>>> ranked(h);
      for (int hh = 0; hh < h; ++hh) {
        ASSERT_EQ(cands[hh].size(), size_t(std::min(candidates, 40)));
        ranked[hh] = testing::RankCandidates(c, hh, cands[hh]);
        for (int i = 0; i < k; ++i) {
          EXPECT_EQ(full.selected[size_t(hh) * k + i], ranked[hh][i].first)
              << "seed " << seed << " candidates " << candidates << " head " << hh << " rank " << i;
        }
      }
      for (double p : {0.3, 0.6, 0.9}) {
        for (int min_k : {0, 3}) {
          o.top_p = float(p);
          o.min_k = min_k;
          ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
          for (int hh = 0; hh < h; ++hh) {
            const int want = ReferenceTwoStageCut(ranked[hh], k, p, min_k);
            EXPECT_EQ(Count(x.selected, hh, k), want)
                << "seed " << seed << " candidates " << candidates << " p " << p << " head " << hh;
            for (int i = 0; i < want; ++i)
              EXPECT_EQ(x.selected[hh * k + i], full.selected[hh * k + i]);
          }
        }
      }
    }
  }
}

// A worker mirrors the slot table from the misses alone (slot <- chunk). Over steps that mix
// mass budgets, two stages and plain selection with changing queries, the mirror must stay
// equal to the table, hold each chunk at most once per head, and hold every selected chunk:
// a slot the table emptied behind the worker's back would leave a stale chunk in the mirror,
// attended twice once it is selected again into another slot.
TEST(SelectEx, MissesAloneKeepAWorkersMirrorOfTheTable) {
  auto be = Cpu();
  auto rng = MakeRng(450);
  LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 4, 8, 60, /*static_every=*/7);
  const int h = 2, k = 12;
  std::vector<int32_t> slots(size_t(h) * k, -1), mirror = slots;
  int cut_steps = 0;
  for (int step = 0; step < 40; ++step) {
    c.q = testing::RandomBf16(c.q.size(), rng, step % 3 == 0 ? 4.0f : 1.0f);
    SelectOptions o;
    if (step % 4 != 3) {
      o.top_p = step % 2 == 0 ? 0.5f : 0.9f;
      o.min_k = 1;
    }
    if (step % 5 == 4) {
      o.candidates = 3 * k;
      o.C = c.C;
      o.rope = c.rope;
    }
    ExOut x = RunEx(*be, c, k, &o, slots);
    for (int hh = 0; hh < h; ++hh) {
      cut_steps += Count(x.selected, hh, k) < k;
      for (int j = 0; j < x.miss_count[hh]; ++j) {
        mirror[size_t(hh) * k + x.miss_slot[size_t(hh) * k + j]] = x.miss_chunk[size_t(hh) * k + j];
      }
      std::set<int32_t> held;
      for (int i = 0; i < k; ++i) {
        const int32_t m = mirror[size_t(hh) * k + i];
        if (m >= 0) EXPECT_TRUE(held.insert(m).second) << "step " << step << ": chunk " << m << " twice";
      }
      for (int i = 0; i < k; ++i) {
        const int32_t sel = x.selected[size_t(hh) * k + i];
        if (sel >= 0) EXPECT_TRUE(held.count(sel)) << "step " << step << ": selected " << sel << " not held";
      }
    }
    EXPECT_EQ(mirror, x.slots) << "step " << step;
    slots = x.slots;
  }
  EXPECT_GT(cut_steps, 10);  // the mass budget did cut below the cap
}

TEST(SelectEx, RejectsBadOptions) {
  auto be = Cpu();
  auto rng = MakeRng(500);
  LowRankCase c = RandomLowRank(rng, {1, 1, 16}, 4, 8, 20);
  absl::Status st;
  SelectOptions o;
  o.top_p = 1.5f;
  RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.min_k = 5;
  RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.candidates = 8;  // two stages need C
  RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

// --- Stage 2 from key signatures (SelectOptions::signatures) ------------------------------

TEST(SelectEx, SignaturesOverEveryChunkRankAsTheirKeys) {
  auto be = Cpu();
  for (int bits : {2, 4, 8}) {
    for (int seed = 0; seed < 3; ++seed) {
      auto rng = MakeRng(700 + 10 * bits + seed);
      LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 4, 16, 30, /*static_every=*/5);
      testing::BuildSignatures(c, bits);
      const int k = 5;
      SelectOptions o;
      o.candidates = 1000;
      o.C = c.C;
      o.signatures = true;
      ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(2 * k, -1));
      for (int hh = 0; hh < 2; ++hh) {
        const std::vector<int32_t> want = OracleTopK(c, hh, k, /*signatures=*/true);
        std::vector<int32_t> got(x.selected.begin() + hh * k, x.selected.begin() + (hh + 1) * k);
        EXPECT_EQ(got, want) << "bits " << bits << " seed " << seed << " head " << hh;
      }
    }
  }
}

TEST(SelectEx, SignaturesFindPlantedNeedlesThatLandmarksMiss) {
  auto be = Cpu();
  auto rng = MakeRng(7);
  const std::vector<int> needles = {3, 17, 29, 41, 50, 58, 62, 70};
  const std::vector<int> decoys = {1, 9, 22, 33, 44, 55, 66, 75};
  LowRankCase c = Planted(rng, 80, needles, decoys);
  const int k = 8;
  const std::vector<int32_t> oracle = OracleTopK(c, 0, k);
  for (int bits : {2, 4, 8}) {
    testing::BuildSignatures(c, bits);
    SelectOptions o;
    o.candidates = 4 * k;
    o.C = c.C;
    o.signatures = true;
    ExOut two = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
    EXPECT_EQ(Recall(Row(two.selected, 0, k), oracle), 1.0) << bits;
    o.candidates = 1000;  // every chunk scored from its signatures
    ExOut all = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
    EXPECT_EQ(Recall(Row(all.selected, 0, k), oracle), 1.0) << bits;
  }
}

TEST(SelectEx, SignaturesNeedNoBasisOrCoordinates) {
  auto be = Cpu();
  auto rng = MakeRng(710);
  LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 4, 16, 30);
  testing::BuildSignatures(c, 4);
  const int k = 5;
  SelectOptions o;
  o.candidates = 3 * k;
  o.C = c.C;
  o.signatures = true;
  ExOut want = RunEx(*be, c, k, &o, std::vector<int32_t>(2 * k, -1));
  LowRankCase bare = c;
  for (bf16& x : bare.a) x = FloatToBf16(std::nanf(""));  // never read
  for (bf16& x : bare.b) x = FloatToBf16(std::nanf(""));
  ExOut got = RunEx(*be, bare, k, &o, std::vector<int32_t>(2 * k, -1));
  EXPECT_EQ(got.selected, want.selected);
  EXPECT_EQ(got.slots, want.slots);
}

TEST(SelectEx, RejectsSignaturesItCannotRead) {
  auto be = Cpu();
  auto rng = MakeRng(720);
  LowRankCase c = RandomLowRank(rng, {1, 1, 16}, 4, 8, 20);
  absl::Status st;
  SelectOptions o;
  o.candidates = 8;
  o.C = c.C;
  o.signatures = true;
  RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1), nullptr, &st);  // no signatures
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("sig"), std::string::npos) << st;
  testing::BuildSignatures(c, 4);
  c.sig_bits = 3;
  RunEx(*be, c, 4, &o, std::vector<int32_t>(4, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
}

// The int8 query of stage 2 from signatures: its largest channel maps to +-127, every
// channel to the nearest step (ties to even), the scale reads it back within half a step;
// a zero row gives scale 0, a non-finite one NaN, both with q8 all 0. The dot is the exact
// integer sum scaled once, and the base is the sum of its two halves.
TEST(Signatures, QueryDotAndBaseReferences) {
  const int d = 16, bits = 4;
  std::vector<bf16> q(d);
  const float xs[d] = {0.5f, -1.0f, 0.25f, 0.0f, 2.0f, -2.0f, 1.0f / 127.0f, 0.75f,
                       -0.125f, 1.5f, -0.5f, 0.0625f, 0.3f, -0.7f, 1.25f, -1.75f};
  for (int i = 0; i < d; ++i) q[i] = FloatToBf16(xs[i]);
  std::vector<int8_t> q8(d);
  const float s = SignatureQueryReference(q.data(), d, q8.data());
  EXPECT_EQ(s, 2.0f / 127.0f);
  EXPECT_EQ(q8[4], 127);
  EXPECT_EQ(q8[5], -127);
  EXPECT_EQ(q8[3], 0);
  for (int i = 0; i < d; ++i) {
    const float x = Bf16ToFloat(q[i]);
    EXPECT_EQ(q8[i], int8_t(std::nearbyint(x * (127.0f / 2.0f)))) << i;
    EXPECT_LE(std::fabs(q8[i] * s - x), 0.5f * s * 1.0001f) << i;
  }
  std::vector<bf16> zero(d, FloatToBf16(0.0f));
  EXPECT_EQ(SignatureQueryReference(zero.data(), d, q8.data()), 0.0f);
  EXPECT_TRUE(std::all_of(q8.begin(), q8.end(), [](int8_t v) { return v == 0; }));
  std::vector<bf16> bad = q;
  bad[7] = FloatToBf16(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(SignatureQueryReference(bad.data(), d, q8.data())));
  EXPECT_TRUE(std::all_of(q8.begin(), q8.end(), [](int8_t v) { return v == 0; }));

  // A record with codes 0..15 and scale 0.5.
  std::vector<std::byte> rec(SignatureRecordBytes(bits, d));
  for (int w = 0; w < d / 8; ++w) {
    uint32_t word = 0;
    for (int j = 0; j < 8; ++j) word |= uint32_t(w * 8 + j) << (4 * j);
    std::memcpy(rec.data() + 4 * w, &word, 4);
  }
  const float half_scale = 0.5f;
  std::memcpy(rec.data() + d * bits / 8, &half_scale, 4);
  std::vector<uint8_t> codes(d);
  float sc = 0.0f;
  SignatureUnpackReference(rec.data(), d, bits, codes.data(), &sc);
  EXPECT_EQ(sc, 0.5f);
  for (int i = 0; i < d; ++i) EXPECT_EQ(codes[i], i);
  const float s2 = SignatureQueryReference(q.data(), d, q8.data());
  int64_t exact = 0;
  for (int i = 0; i < d; ++i) exact += int64_t(q8[i]) * (2 * codes[i] - 15);
  EXPECT_EQ(SignatureDotReference(q8.data(), s2, codes.data(), d, bits),
            float(exact) * (s2 * 0.5f));
  // Against the unquantized dot, within what the int8 steps allow.
  double ref = 0, err = 0;
  for (int i = 0; i < d; ++i) {
    ref += double(Bf16ToFloat(q[i])) * (codes[i] - 7.5);
    err += 0.5 * s2 * std::fabs(codes[i] - 7.5);
  }
  EXPECT_NEAR(SignatureDotReference(q8.data(), s2, codes.data(), d, bits), ref, err * 1.001);

  std::vector<bf16> lm(d);
  for (int i = 0; i < d; ++i) lm[i] = FloatToBf16(0.1f * float(i) - 0.7f);
  float lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < d / 2; ++i) lo += Bf16ToFloat(q[i]) * Bf16ToFloat(lm[i]);
  for (int i = d / 2; i < d; ++i) hi += Bf16ToFloat(q[i]) * Bf16ToFloat(lm[i]);
  EXPECT_EQ(SignatureBaseReference(q.data(), lm.data(), d), lo + hi);
}

// The encoder: the backend's records equal the reference's; each channel reads back within
// half a step of its key; a key equal to its landmark has scale 0; bad arguments refused.
TEST(Signatures, BackendEncodesTheReference) {
  auto be = Cpu();
  auto rng = MakeRng(730);
  const int h = 3, d = 64, C = 4, n_chunks = 20, n = n_chunks * C + 3;
  std::vector<bf16> kr = testing::RandomBf16(size_t(n) * h * d, rng, 2.0f);
  for (int t = 0; t < C; ++t)  // chunk 1, head 0: every token the same key
    for (int ch = 0; ch < d; ++ch) kr[(size_t(C + t) * h) * d + ch] = kr[size_t(C * h) * d + ch];
  std::vector<bf16> lm(size_t(n_chunks) * h * d);
  std::vector<float> min_cos(size_t(h) * n_chunks);
  ASSERT_TRUE(be->BuildLandmarks(kr, n, h, d, C, n_chunks, absl::MakeSpan(lm),
                                 absl::MakeSpan(min_cos)).ok());
  for (int bits : {2, 4, 8}) {
    const size_t rec = SignatureRecordBytes(bits, d);
    std::vector<std::byte> sig(size_t(n_chunks) * C * h * rec);
    ASSERT_TRUE(be->EncodeSignatures(kr, lm, h, d, C, n_chunks, bits, absl::MakeSpan(sig)).ok());
    std::vector<std::byte> one(rec);
    const float half = float((1 << bits) - 1) / 2.0f;
    for (int t = 0; t < n_chunks * C; ++t) {
      for (int hh = 0; hh < h; ++hh) {
        const bf16* key = kr.data() + (size_t(t) * h + hh) * d;
        const bf16* l = lm.data() + (size_t(t / C) * h + hh) * d;
        SignatureEncodeReference(key, l, d, bits, one.data());
        const std::byte* got = sig.data() + (size_t(t) * h + hh) * rec;
        ASSERT_TRUE(std::equal(one.begin(), one.end(), got)) << t << " " << hh;
        float scale = 0.0f;
        std::memcpy(&scale, got + size_t(d) * bits / 8, 4);
        if (t / C == 1 && hh == 0) {
          // Residual 0 up to the landmark's rounding; identical keys give identical records.
          EXPECT_LE(scale, 0.05f);
        }
        for (int ch = 0; ch < d; ++ch) {
          uint32_t word = 0;
          std::memcpy(&word, got + size_t(ch / (32 / bits)) * 4, 4);
          const float code = float((word >> (bits * (ch % (32 / bits)))) & ((1u << bits) - 1));
          const float r = Bf16ToFloat(key[ch]) - Bf16ToFloat(l[ch]);
          EXPECT_LE(std::fabs((code - half) * scale - r), 0.5f * scale * 1.0001f + 1e-7f);
        }
      }
    }
  }
  std::vector<std::byte> sig(size_t(n_chunks) * C * h * SignatureRecordBytes(2, d));
  EXPECT_EQ(be->EncodeSignatures(kr, lm, h, d, C, n_chunks, 3, absl::MakeSpan(sig)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->EncodeSignatures(kr, lm, h, d, C, n_chunks, 2,
                                 absl::MakeSpan(sig).subspan(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(be->EncodeSignatures(absl::MakeConstSpan(kr).subspan(0, 10), lm, h, d, C, n_chunks, 2,
                                 absl::MakeSpan(sig)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(AssignSlots, ServesTheGivenChunksExactly) {
  auto be = Cpu();
  auto rng = MakeRng(600);
  LowRankCase c = RandomLowRank(rng, {2, 1, 16}, 4, 8, 48, /*static_every=*/8);
  const int k = 4;
  // Head 0: T3's vector with 41 for 40 (chunks 0, 8, .. 40 are static for head 0).
  std::vector<int32_t> slots = {10, 20, 30, 41, -1, -1, -1, -1};
  std::vector<int32_t> given = {41, 5, 20, 7,
                                // head 1: a static chunk (chunk 1 is static for head 1), a
                                // repeat and an id out of range: only 12 counts
                                12, 1, 12, 99};
  ExOut x = RunEx(*be, c, k, nullptr, slots, &given);
  EXPECT_EQ(std::vector<int32_t>(x.slots.begin(), x.slots.begin() + 4),
            (std::vector<int32_t>{5, 20, 7, 41}));
  EXPECT_EQ(x.miss_count[0], 2);
  EXPECT_EQ(std::vector<int32_t>(x.miss_slot.begin(), x.miss_slot.begin() + 2),
            (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(std::vector<int32_t>(x.miss_chunk.begin(), x.miss_chunk.begin() + 2),
            (std::vector<int32_t>{5, 7}));
  EXPECT_EQ(std::vector<int32_t>(x.slots.begin() + 4, x.slots.end()),
            (std::vector<int32_t>{12, -1, -1, -1}));
  EXPECT_EQ(x.miss_count[1], 1);

  // The misses reconstruct to the given chunks' keys in their slots.
  const int h = 2, d = 16, C = c.C;
  std::vector<bf16> keys(size_t(h) * k * C * d, FloatToBf16(-9.0f));
  std::vector<bf16> values(keys.size());
  std::vector<std::byte> vstore(size_t(h) * c.n_chunks * C * d * 2);
  ReconstructItem ri;
  ri.view.n_segments = 1;
  ri.view.b = c.b.data();
  ri.view.r = c.r;
  ri.view.segments[0].n_chunks = c.n_chunks;
  ri.view.segments[0].first_position = c.first_position;
  ri.view.segments[0].landmarks = c.landmarks.data();
  ri.view.segments[0].a = c.a.data();
  ri.view.segments[0].values = vstore.data();
  ri.view.segments[0].value_head_stride = int64_t(c.n_chunks) * C * d * 2;
  ri.view.segments[0].value_chunk_stride = int64_t(C) * d * 2;
  ri.miss_chunk = x.miss_chunk.data();
  ri.miss_count = x.miss_count.data();
  ri.miss_slot = x.miss_slot.data();
  ri.keys = keys.data();
  ri.values = values.data();
  std::vector<ReconstructItem> items = {ri};
  ValueCodecSpec codec;
  auto ws = be->Allocate(std::max<size_t>(be->ReconstructWorkspaceBytes(c.shape, k, items), 1)).value();
  ASSERT_TRUE(be->Reconstruct(c.shape, C, k, c.rope, codec, items, ws.workspace()).ok());
  for (int hh = 0; hh < h; ++hh) {
    for (int slot = 0; slot < k; ++slot) {
      const int32_t chunk = x.slots[hh * k + slot];
      if (chunk < 0) continue;
      bool missed = false;
      for (int j = 0; j < x.miss_count[hh]; ++j) missed |= x.miss_slot[hh * k + j] == slot;
      if (!missed) continue;  // a hit: the worker already holds it
      for (int t = 0; t < C; ++t) {
        const std::vector<float> want = testing::KeyOf(c, hh, chunk * C + t);
        for (int ch = 0; ch < d; ++ch) {
          EXPECT_EQ(Bf16ToFloat(keys[((size_t(hh) * k + slot) * C + t) * d + ch]),
                    Bf16ToFloat(FloatToBf16(want[ch])))
              << "head " << hh << " slot " << slot << " token " << t;
        }
      }
    }
  }
}

}  // namespace
}  // namespace select_ex_test
}  // namespace kvshade::kernels

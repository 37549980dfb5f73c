// Select (docs/ALGORITHM.md decode steps 1-3): the T3 temporal-cache vector, all-hit steps,
// deterministic ties, excluded chunks, multi-segment chunk ids, -1 padding, argument
// checks, and the GQA-max scoring against a naive double-precision computation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace select_test {
namespace {

using testing::Cpu;
using testing::MakeRng;

// Host-side inputs of one Select item; segments own their landmarks and masks.
struct SegmentData {
  int n_chunks = 0;
  int64_t first_position = 0;
  std::vector<bf16> landmarks;  // [n_chunks, h, d]
  std::vector<uint8_t> excluded;  // [h, n_chunks] or empty
};

struct SelectCase {
  LayerShape shape;
  int k = 0;
  std::vector<SegmentData> segments;
  std::vector<bf16> q;         // [h*g, d]
  std::vector<int32_t> slots;  // [h, k]
};

struct SelectOut {
  std::vector<int32_t> slots, selected, miss_slot, miss_chunk, miss_count;
};

// Runs Select on the CPU backend (host memory) for one item.
absl::StatusOr<SelectOut> RunSelect(Backend& be, SelectCase& sc) {
  const int h = sc.shape.h, k = sc.k;
  SelectOut out;
  out.slots = sc.slots;
  out.selected.assign(size_t(h) * k, -7);
  out.miss_slot.assign(size_t(h) * k, -7);
  out.miss_chunk.assign(size_t(h) * k, -7);
  out.miss_count.assign(h, -7);
  static const bf16 kBasis[1] = {};
  SelectItem item;
  item.view.n_segments = int(sc.segments.size());
  item.view.b = kBasis;
  item.view.r = 8;
  for (size_t s = 0; s < sc.segments.size(); ++s) {
    SegmentView& v = item.view.segments[s];
    v.n_chunks = sc.segments[s].n_chunks;
    v.first_position = sc.segments[s].first_position;
    v.landmarks = sc.segments[s].landmarks.data();
    v.excluded = sc.segments[s].excluded.empty() ? nullptr : sc.segments[s].excluded.data();
  }
  item.q = sc.q.data();
  item.slots = out.slots.data();
  item.selected = out.selected.data();
  item.miss_slot = out.miss_slot.data();
  item.miss_chunk = out.miss_chunk.data();
  item.miss_count = out.miss_count.data();
  std::vector<SelectItem> items = {item};
  auto ws = be.Allocate(be.SelectWorkspaceBytes(sc.shape, k, items));
  if (!ws.ok()) return ws.status();
  absl::Status st = be.Select(sc.shape, k, items, ws->workspace());
  if (!st.ok()) return st;
  sc.slots = out.slots;  // next step continues from here
  return out;
}

// A single-segment case whose landmarks put score `x[c]` on channel 0 for every head, with
// q = sqrt(d) on channel 0, so that logits equal x exactly.
SelectCase ScoreCase(const std::vector<float>& x, int k, int h = 1, int g = 1, int d = 64) {
  SelectCase sc;
  sc.shape = {h, g, d};
  sc.k = k;
  SegmentData seg;
  seg.n_chunks = int(x.size());
  seg.landmarks.assign(x.size() * h * d, bf16{});
  for (size_t c = 0; c < x.size(); ++c)
    for (int hh = 0; hh < h; ++hh) seg.landmarks[(c * h + hh) * d] = FloatToBf16(x[c]);
  sc.segments.push_back(seg);
  sc.q.assign(size_t(h) * g * d, bf16{});
  for (int qh = 0; qh < h * g; ++qh) sc.q[size_t(qh) * d] = FloatToBf16(std::sqrt(float(d)));
  sc.slots.assign(size_t(h) * k, -1);
  return sc;
}

TEST(AlgorithmVectors, T3TemporalCache) {
  auto be = Cpu();
  std::vector<float> x(48, -4.0f);
  x[40] = 4;
  x[5] = 3;
  x[20] = 2;
  x[7] = 1;
  SelectCase sc = ScoreCase(x, 4);
  sc.slots = {10, 20, 30, 40};
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->selected, (std::vector<int32_t>{40, 5, 20, 7}));
  EXPECT_EQ(out->slots, (std::vector<int32_t>{5, 20, 7, 40}));  // 20, 40 hit in place
  EXPECT_EQ(out->miss_count, (std::vector<int32_t>{2}));
  EXPECT_EQ(out->miss_slot[0], 0);
  EXPECT_EQ(out->miss_chunk[0], 5);
  EXPECT_EQ(out->miss_slot[1], 2);
  EXPECT_EQ(out->miss_chunk[1], 7);
  EXPECT_EQ(out->miss_slot[2], -1);  // unused entries are -1
  EXPECT_EQ(out->miss_chunk[3], -1);

  // Same query again: every chunk hits, nothing moves.
  auto again = RunSelect(*be, sc);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->miss_count, (std::vector<int32_t>{0}));
  EXPECT_EQ(again->slots, (std::vector<int32_t>{5, 20, 7, 40}));
  EXPECT_EQ(again->selected, (std::vector<int32_t>{40, 5, 20, 7}));
}

TEST(Select, FirstStepFillsEmptySlotsInOrder) {
  auto be = Cpu();
  std::vector<float> x(16, 0.0f);
  x[9] = 3;
  x[2] = 2;
  x[14] = 1;
  SelectCase sc = ScoreCase(x, 3);
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->selected, (std::vector<int32_t>{9, 2, 14}));
  EXPECT_EQ(out->slots, (std::vector<int32_t>{2, 9, 14}));
  EXPECT_EQ(out->miss_count[0], 3);
  EXPECT_EQ(out->miss_slot, (std::vector<int32_t>{0, 1, 2}));
  EXPECT_EQ(out->miss_chunk, (std::vector<int32_t>{2, 9, 14}));
}

TEST(Select, TiesGoToLowerChunkIds) {
  auto be = Cpu();
  std::vector<float> x(20, 1.0f);
  x[17] = 2.0f;
  x[11] = 2.0f;
  SelectCase sc = ScoreCase(x, 5, /*h=*/2, /*g=*/3);
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok());
  for (int hh = 0; hh < 2; ++hh) {
    EXPECT_EQ(std::vector<int32_t>(out->selected.begin() + hh * 5, out->selected.begin() + hh * 5 + 5),
              (std::vector<int32_t>{11, 17, 0, 1, 2}));
  }
  // Twice from the same state: identical.
  SelectCase sc2 = ScoreCase(x, 5, 2, 3);
  auto out2 = RunSelect(*be, sc2);
  ASSERT_TRUE(out2.ok());
  EXPECT_EQ(out->selected, out2->selected);
  EXPECT_EQ(out->slots, out2->slots);
}

TEST(Select, DuplicateAndInvalidSlotEntriesAreFreed) {
  auto be = Cpu();
  std::vector<float> x(10, 0.0f);
  x[3] = 3;
  x[4] = 2;
  x[8] = 1;
  SelectCase sc = ScoreCase(x, 4);
  sc.slots = {4, 4, 99, -1};  // a duplicate, an out-of-range id and an empty slot
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->selected, (std::vector<int32_t>{3, 4, 8, 0}));
  // 4 hits in slot 0; misses 0, 3, 8 go to slots 1, 2, 3.
  EXPECT_EQ(out->slots, (std::vector<int32_t>{4, 0, 3, 8}));
  EXPECT_EQ(out->miss_count[0], 3);
}

TEST(Select, ExcludedChunksNeverSelectedAndPadding) {
  auto be = Cpu();
  auto rng = MakeRng(3);
  const int h = 3, g = 2, d = 64, n_chunks = 40, k = 16;
  SelectCase sc;
  sc.shape = {h, g, d};
  sc.k = k;
  SegmentData seg;
  seg.n_chunks = n_chunks;
  seg.landmarks = testing::RandomBf16(size_t(n_chunks) * h * d, rng);
  seg.excluded.assign(size_t(h) * n_chunks, 0);
  std::bernoulli_distribution coin(0.4);
  for (int c = 0; c < n_chunks; ++c) seg.excluded[c] = coin(rng);  // head 0: random
  for (int c = 0; c < n_chunks; ++c) seg.excluded[n_chunks + c] = c % 7 != 0;  // head 1: 6 left
  for (int c = 0; c < n_chunks; ++c) seg.excluded[2 * n_chunks + c] = c < 10;
  sc.segments.push_back(seg);
  sc.q = testing::RandomBf16(size_t(h) * g * d, rng);
  sc.slots.assign(size_t(h) * k, -1);
  sc.slots[k + 3] = 14;  // head 1 holds chunk 14 (selectable: 14 % 7 == 0)
  sc.slots[k + 5] = 15;  // and chunk 15 (excluded): must leave
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int hh = 0; hh < h; ++hh) {
    int selectable = 0;
    for (int c = 0; c < n_chunks; ++c) selectable += !seg.excluded[size_t(hh) * n_chunks + c];
    const int want = std::min(k, selectable);
    std::set<int> seen;
    for (int i = 0; i < k; ++i) {
      const int c = out->selected[size_t(hh) * k + i];
      if (i >= want) {
        EXPECT_EQ(c, -1) << "head " << hh << " entry " << i;
        continue;
      }
      ASSERT_GE(c, 0);
      ASSERT_LT(c, n_chunks);
      EXPECT_FALSE(seg.excluded[size_t(hh) * n_chunks + c]) << "head " << hh << " chunk " << c;
      EXPECT_TRUE(seen.insert(c).second);
    }
    // Slots hold exactly the selected chunks, the rest empty.
    std::multiset<int> in_slots(out->slots.begin() + hh * k, out->slots.begin() + (hh + 1) * k);
    EXPECT_EQ(int(in_slots.count(-1)), k - want);
    for (int c : seen) EXPECT_EQ(in_slots.count(c), 1u);
  }
  EXPECT_EQ(out->slots[k + 3], 14);  // the hit stayed in its slot
  EXPECT_EQ(out->miss_count[1], 5);  // 0, 7, 21, 28, 35
}

TEST(Select, ExcludedChunksAreNotInTheDenominator) {
  // Two query heads: head 0 scores chunk 0 at logit 2 (and the excluded chunk 3 at 10),
  // head 1 scores chunk 2 at 1.5. With chunk 3 left out of head 0's softmax, p(0) = 0.79
  // beats head 1's p(2) = 0.69; were it included, p(0) would be ~3e-4.
  auto be = Cpu();
  const int d = 64;
  SelectCase sc;
  sc.shape = {1, 2, d};
  sc.k = 1;
  SegmentData seg;
  seg.n_chunks = 4;
  seg.landmarks.assign(4 * d, bf16{});
  seg.landmarks[0 * d + 0] = FloatToBf16(2.0f);
  seg.landmarks[2 * d + 1] = FloatToBf16(1.5f);
  seg.landmarks[3 * d + 0] = FloatToBf16(10.0f);
  seg.excluded = {0, 0, 0, 1};
  sc.segments.push_back(seg);
  sc.q.assign(2 * d, bf16{});
  sc.q[0] = FloatToBf16(8.0f);      // head 0 reads channel 0 (logit = x, 8/sqrt(64) = 1)
  sc.q[d + 1] = FloatToBf16(8.0f);  // head 1 reads channel 1
  sc.slots = {-1};
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->selected[0], 0);
}

TEST(Select, GqaMaxOfProbabilitiesNotMeanOfLogits) {
  // Head 0 peaks at chunk 3 (logit 4), head 1 mildly prefers chunk 5 (logit 1) and dislikes
  // chunk 3 (logit -4). Max of softmax picks 3; a mean of logits would pick 5.
  auto be = Cpu();
  const int d = 64;
  SelectCase sc;
  sc.shape = {1, 2, d};
  sc.k = 1;
  SegmentData seg;
  seg.n_chunks = 16;
  seg.landmarks.assign(16 * d, bf16{});
  seg.landmarks[3 * d + 0] = FloatToBf16(4.0f);
  seg.landmarks[3 * d + 1] = FloatToBf16(-4.0f);
  seg.landmarks[5 * d + 1] = FloatToBf16(1.0f);
  sc.segments.push_back(seg);
  sc.q.assign(2 * d, bf16{});
  sc.q[0] = FloatToBf16(8.0f);
  sc.q[d + 1] = FloatToBf16(8.0f);
  sc.slots = {-1};
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->selected[0], 3);
}

// Naive scores in double: per query head softmax over selectable chunks, max over group.
std::vector<double> NaiveScores(const SelectCase& sc) {
  const int h = sc.shape.h, g = sc.shape.g, d = sc.shape.d;
  int total = 0;
  for (const auto& s : sc.segments) total += s.n_chunks;
  std::vector<double> out(size_t(h) * total, -1.0);  // -1: excluded
  for (int hh = 0; hh < h; ++hh) {
    for (int qi = 0; qi < g; ++qi) {
      std::vector<double> logit(total, 0.0);
      std::vector<bool> ok(total, false);
      double mx = -INFINITY;
      int base = 0;
      for (const auto& s : sc.segments) {
        for (int j = 0; j < s.n_chunks; ++j) {
          if (!s.excluded.empty() && s.excluded[size_t(hh) * s.n_chunks + j]) continue;
          double dot = 0;
          for (int c = 0; c < d; ++c) {
            dot += double(Bf16ToFloat(sc.q[size_t(hh * g + qi) * d + c])) *
                   Bf16ToFloat(s.landmarks[(size_t(j) * h + hh) * d + c]);
          }
          logit[base + j] = dot / std::sqrt(double(d));
          ok[base + j] = true;
          mx = std::max(mx, logit[base + j]);
        }
        base += s.n_chunks;
      }
      double sum = 0;
      for (int c = 0; c < total; ++c) sum += ok[c] ? std::exp(logit[c] - mx) : 0.0;
      for (int c = 0; c < total; ++c) {
        if (ok[c]) out[size_t(hh) * total + c] = std::max(out[size_t(hh) * total + c], std::exp(logit[c] - mx) / sum);
      }
    }
  }
  return out;
}

// Checks `selected` against naive scores: descending order and a correct top-k set, up to
// a tolerance for near-ties between fp32 and double.
void ExpectMatchesNaive(const SelectCase& sc, const SelectOut& out) {
  const int h = sc.shape.h, k = sc.k;
  const std::vector<double> s = NaiveScores(sc);
  const int total = int(s.size()) / h;
  constexpr double kTol = 1e-5;
  for (int hh = 0; hh < h; ++hh) {
    const double* row = s.data() + size_t(hh) * total;
    std::vector<int> sel;
    for (int i = 0; i < k; ++i) {
      const int c = out.selected[size_t(hh) * k + i];
      if (c >= 0) sel.push_back(c);
    }
    int selectable = 0;
    for (int c = 0; c < total; ++c) selectable += row[c] >= 0;
    ASSERT_EQ(int(sel.size()), std::min(k, selectable)) << "head " << hh;
    double weakest = INFINITY;
    for (size_t i = 0; i < sel.size(); ++i) {
      ASSERT_GE(row[sel[i]], 0.0) << "excluded chunk " << sel[i] << " selected";
      if (i > 0) EXPECT_LE(row[sel[i]], row[sel[i - 1]] * (1 + kTol)) << "order, head " << hh;
      weakest = std::min(weakest, row[sel[i]]);
    }
    std::set<int> chosen(sel.begin(), sel.end());
    for (int c = 0; c < total; ++c) {
      if (row[c] >= 0 && !chosen.count(c)) {
        EXPECT_LE(row[c], weakest * (1 + kTol)) << "head " << hh << " missed chunk " << c;
      }
    }
  }
}

TEST(Select, GqaMaxMatchesNaiveAcrossSegments) {
  auto be = Cpu();
  auto rng = MakeRng(4);
  const int h = 4, g = 4, d = 64, k = 24;
  SelectCase sc;
  sc.shape = {h, g, d};
  sc.k = k;
  const int counts[3] = {30, 1, 45};
  std::bernoulli_distribution coin(0.2);
  int64_t pos = 100;
  for (int n : counts) {
    SegmentData seg;
    seg.n_chunks = n;
    seg.first_position = pos;
    pos += int64_t(n) * 8;
    seg.landmarks = testing::RandomBf16(size_t(n) * h * d, rng, 0.5f);
    seg.excluded.resize(size_t(h) * n);
    for (auto& e : seg.excluded) e = coin(rng);
    sc.segments.push_back(seg);
  }
  sc.segments[1].excluded.clear();  // null mask: all selectable
  sc.q = testing::RandomBf16(size_t(h) * g * d, rng, 2.0f);
  sc.slots.assign(size_t(h) * k, -1);
  auto out = RunSelect(*be, sc);
  ASSERT_TRUE(out.ok()) << out.status();
  ExpectMatchesNaive(sc, *out);

  // A second step with a new query moves only misses; hits keep their slots.
  const std::vector<int32_t> before = sc.slots;
  sc.q = testing::RandomBf16(size_t(h) * g * d, rng, 2.0f);
  auto out2 = RunSelect(*be, sc);
  ASSERT_TRUE(out2.ok());
  ExpectMatchesNaive(sc, *out2);
  for (int hh = 0; hh < h; ++hh) {
    std::set<int> sel(out2->selected.begin() + hh * k, out2->selected.begin() + (hh + 1) * k);
    int moved = 0;
    for (int slot = 0; slot < k; ++slot) {
      const int old = before[size_t(hh) * k + slot], now = out2->slots[size_t(hh) * k + slot];
      if (sel.count(old)) EXPECT_EQ(now, old) << "a hit moved";
      if (now != old) ++moved;
      EXPECT_TRUE(sel.count(now)) << "slot holds an unselected chunk";
    }
    EXPECT_EQ(moved, out2->miss_count[hh]);
    for (int i = 1; i < out2->miss_count[hh]; ++i) {
      EXPECT_LT(out2->miss_slot[size_t(hh) * k + i - 1], out2->miss_slot[size_t(hh) * k + i]);
      EXPECT_LT(out2->miss_chunk[size_t(hh) * k + i - 1], out2->miss_chunk[size_t(hh) * k + i]);
    }
    for (int i = 0; i < out2->miss_count[hh]; ++i) {
      EXPECT_EQ(out2->slots[size_t(hh) * k + out2->miss_slot[size_t(hh) * k + i]],
                out2->miss_chunk[size_t(hh) * k + i]);
    }
  }
}

TEST(Select, BatchOfItemsMatchesOneAtATime) {
  auto be = Cpu();
  auto rng = MakeRng(5);
  const LayerShape shape{2, 3, 64};
  const int k = 8;
  std::vector<SelectCase> cases;
  for (int i = 0; i < 3; ++i) {
    SelectCase sc;
    sc.shape = shape;
    sc.k = k;
    SegmentData seg;
    seg.n_chunks = 10 + 7 * i;
    seg.landmarks = testing::RandomBf16(size_t(seg.n_chunks) * shape.h * shape.d, rng);
    sc.segments.push_back(seg);
    sc.q = testing::RandomBf16(size_t(shape.h) * shape.g * shape.d, rng);
    sc.slots.assign(size_t(shape.h) * k, -1);
    cases.push_back(sc);
  }
  std::vector<SelectOut> single;
  for (auto sc : cases) single.push_back(RunSelect(*be, sc).value());
  // Batched.
  std::vector<SelectOut> outs(cases.size());
  std::vector<SelectItem> items;
  static const bf16 kBasis[1] = {};
  for (size_t i = 0; i < cases.size(); ++i) {
    auto& o = outs[i];
    o.slots = cases[i].slots;
    o.selected.assign(size_t(shape.h) * k, 0);
    o.miss_slot = o.miss_chunk = o.selected;
    o.miss_count.assign(shape.h, 0);
    SelectItem it;
    it.view.n_segments = 1;
    it.view.b = kBasis;
    it.view.r = 8;
    it.view.segments[0].n_chunks = cases[i].segments[0].n_chunks;
    it.view.segments[0].landmarks = cases[i].segments[0].landmarks.data();
    it.q = cases[i].q.data();
    it.slots = o.slots.data();
    it.selected = o.selected.data();
    it.miss_slot = o.miss_slot.data();
    it.miss_chunk = o.miss_chunk.data();
    it.miss_count = o.miss_count.data();
    items.push_back(it);
  }
  auto ws = be->Allocate(be->SelectWorkspaceBytes(shape, k, items)).value();
  ASSERT_TRUE(be->Select(shape, k, items, ws.workspace()).ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(outs[i].selected, single[i].selected);
    EXPECT_EQ(outs[i].slots, single[i].slots);
    EXPECT_EQ(outs[i].miss_count, single[i].miss_count);
  }
}

TEST(Select, BadArgumentsRejected) {
  auto be = Cpu();
  std::vector<float> x(6, 0.0f);
  {
    SelectCase sc = ScoreCase(x, 7);  // k > total chunks
    EXPECT_EQ(RunSelect(*be, sc).status().code(), absl::StatusCode::kInvalidArgument);
  }
  {
    SelectCase sc = ScoreCase(x, 6);  // k == total chunks is fine
    EXPECT_TRUE(RunSelect(*be, sc).ok());
  }
  SelectCase sc = ScoreCase(x, 2);
  std::vector<int32_t> slots(2, -1), sel(2), ms(2), mc(2), cnt(1);
  static const bf16 kBasis[1] = {};
  SelectItem it;
  it.view.n_segments = 1;
  it.view.b = kBasis;
  it.view.r = 8;
  it.view.segments[0].n_chunks = 6;
  it.view.segments[0].landmarks = sc.segments[0].landmarks.data();
  it.q = sc.q.data();
  it.slots = slots.data();
  it.selected = sel.data();
  it.miss_slot = ms.data();
  it.miss_chunk = mc.data();
  it.miss_count = cnt.data();
  auto ws = be->Allocate(1 << 16).value();
  auto run = [&](SelectItem item, int k = 2, Workspace w = {}) {
    if (w.data == nullptr) w = ws.workspace();
    std::vector<SelectItem> items = {item};
    return be->Select(sc.shape, k, items, w).code();
  };
  EXPECT_EQ(run(it), absl::StatusCode::kOk);
  EXPECT_EQ(run(it, 0), absl::StatusCode::kInvalidArgument);
  SelectItem bad = it;
  bad.q = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.miss_count = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.view.n_segments = 0;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.view.n_segments = kMaxSegments + 1;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.view.r = 0;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.view.segments[0].landmarks = nullptr;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  bad = it;
  bad.view.segments[0].n_chunks = -1;
  EXPECT_EQ(run(bad), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(run(it, 2, Workspace{ws.data(), 4}), absl::StatusCode::kInvalidArgument);
  LayerShape bad_shape{0, 1, 64};
  std::vector<SelectItem> items = {it};
  EXPECT_EQ(be->Select(bad_shape, 2, items, ws.workspace()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace select_test
}  // namespace kvshade::kernels

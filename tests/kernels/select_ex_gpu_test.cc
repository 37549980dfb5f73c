// CUDA parity of SelectEx (two stages, mass budgets, both, every chunk scored; stage 2's
// per-query-head normalisation on a planted group) and AssignSlots against the CPU reference
// (select_ex_test.cc holds the CPU's own tests); the key signature encoder byte for byte and
// stage 2 from signatures; selection units (SelectOptions::unit) equal to the CPU exactly.
// Scores are summed in another order on the GPU, so chunks whose scores tie to within fp32
// rounding may swap: a difference is accepted only where the double-precision stage-2
// scores (log m over the CPU's stage-1 candidates) of the two chunks agree to 1e-3.
#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "select_ex_util.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace select_ex_gpu_test {
namespace {

using testing::Cpu;
using testing::ExOut;
using testing::LowRankCase;
using testing::MakeRng;
using testing::RandomLowRank;
using testing::RunEx;

// Same selected sets per head, up to swaps of near-tied chunks (by the reference stage-2
// score over the candidates `cands` in two stages; null: one stage, no swaps).
void ExpectSameSelection(const LowRankCase& c, int k, const ExOut& a, const ExOut& b,
                         const std::vector<std::vector<int32_t>>* cands,
                         bool signatures = false) {
  for (int hh = 0; hh < c.shape.h; ++hh) {
    std::set<int32_t> sa, sb;
    int na = 0, nb = 0;
    for (int i = 0; i < k; ++i) {
      const int32_t x = a.selected[hh * k + i], y = b.selected[hh * k + i];
      if (x >= 0) sa.insert(x), ++na;
      if (y >= 0) sb.insert(y), ++nb;
    }
    EXPECT_EQ(na, nb) << "head " << hh;
    std::vector<int32_t> only_a, only_b;
    std::set_difference(sa.begin(), sa.end(), sb.begin(), sb.end(), std::back_inserter(only_a));
    std::set_difference(sb.begin(), sb.end(), sa.begin(), sa.end(), std::back_inserter(only_b));
    ASSERT_EQ(only_a.size(), only_b.size());
    for (size_t i = 0; i < only_a.size(); ++i) {
      if (cands != nullptr) {
        // A chunk the GPU's stage 1 kept in place of a near-tied one is scored among the
        // CPU's candidates too.
        std::vector<int32_t> set = (*cands)[hh];
        for (int32_t x : {only_a[i], only_b[i]}) {
          if (std::find(set.begin(), set.end(), x) == set.end()) set.push_back(x);
        }
        const testing::OracleScores ref = testing::ScoreCandidates(c, hh, set, signatures);
        EXPECT_NEAR(ref.LogM(only_a[i]), ref.LogM(only_b[i]), 1e-3)
            << "head " << hh << ": " << only_a[i] << " vs " << only_b[i];
      } else {
        ADD_FAILURE() << "head " << hh << ": chunk " << only_a[i] << " vs " << only_b[i];
      }
    }
    if (only_a.empty()) {
      // Same sets: the slot tables agree exactly (the slot diff is deterministic).
      EXPECT_EQ(std::vector<int32_t>(a.slots.begin() + hh * k, a.slots.begin() + (hh + 1) * k),
                std::vector<int32_t>(b.slots.begin() + hh * k, b.slots.begin() + (hh + 1) * k));
      EXPECT_EQ(a.miss_count[hh], b.miss_count[hh]);
    }
  }
}

TEST(SelectExGpu, ParityWithTheCpuReference) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  struct Mode {
    int factor;  // candidates = factor * k (0: one stage; -1: every chunk)
    float top_p;
    int min_k;
  };
  const Mode modes[] = {{0, 0, 0}, {4, 0, 0}, {-1, 0, 0}, {0, 0.5f, 2}, {4, 0.8f, 4}};
  for (int seed = 0; seed < 3; ++seed) {
    auto rng = MakeRng(700 + seed);
    LowRankCase c = RandomLowRank(rng, {4, 4, 64}, 8, 32, 300, /*static_every=*/9);
    const int k = 16;
    for (const Mode& m : modes) {
      SelectOptions o;
      if (m.factor != 0) {
        o.candidates = m.factor > 0 ? m.factor * k : 100000;
        o.C = c.C;
        o.rope = c.rope;
      }
      o.top_p = m.top_p;
      o.min_k = m.min_k;
      std::vector<int32_t> slots(size_t(c.shape.h) * k, -1);
      // Two steps: the second starts from the first's table (hits and misses).
      for (int step = 0; step < 2; ++step) {
        ExOut a = RunEx(*cpu, c, k, &o, slots);
        ExOut b = RunEx(*gpu, c, k, &o, slots);
        std::vector<std::vector<int32_t>> cands;
        if (m.factor != 0) cands = testing::StageOneCandidates(*cpu, c, k, o);
        ExpectSameSelection(c, k, a, b, m.factor != 0 ? &cands : nullptr);
        slots = a.slots;
        c.q = testing::RandomBf16(c.q.size(), rng, 1.0f);
      }
    }
  }
}

// Stage 2 normalises each query head on the GPU as on the CPU (FlatHeadCase: chunk kX first,
// then kY, then ties by id; the mass budget's shares w), through stage 1 and over every chunk.
TEST(SelectExGpu, StageTwoNormalisesEachQueryHead) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  using testing::FlatHeadCase;
  const LowRankCase c = FlatHeadCase::Make();
  const int X = FlatHeadCase::kX, Y = FlatHeadCase::kY, k = 4;
  struct Want {
    float top_p;
    std::vector<int32_t> selected;
  };
  const Want wants[] = {{0.0f, {X, Y, 0, 1}}, {0.95f, {X, -1, -1, -1}}, {1.0f, {X, Y, -1, -1}}};
  for (int candidates : {4, FlatHeadCase::kChunks}) {
    for (const Want& w : wants) {
      SelectOptions o;
      o.candidates = candidates;
      o.C = c.C;
      o.rope = c.rope;
      o.top_p = w.top_p;
      const std::vector<int32_t> slots(k, -1);
      const ExOut a = RunEx(*cpu, c, k, &o, slots), b = RunEx(*gpu, c, k, &o, slots);
      EXPECT_EQ(a.selected, w.selected) << "candidates " << candidates << " top_p " << w.top_p;
      EXPECT_EQ(b.selected, w.selected) << "candidates " << candidates << " top_p " << w.top_p;
      EXPECT_EQ(a.slots, b.slots);
      EXPECT_EQ(a.miss_count, b.miss_count);
    }
  }
}

// Items of one call that take different paths: a small item whose chunks are all
// candidates (scored directly) beside larger ones that go through stage 1.
std::vector<ExOut> RunBatch(Backend& be, const std::vector<LowRankCase>& cs, int k,
                            const SelectOptions& o) {
  std::vector<Buffer> keep;
  std::vector<SelectItem> items(cs.size());
  const LayerShape shape = cs[0].shape;
  const size_t hk = size_t(shape.h) * k;
  for (size_t i = 0; i < cs.size(); ++i) {
    const LowRankCase& c = cs[i];
    SelectItem& it = items[i];
    it.view.n_segments = 1;
    keep.push_back(testing::Upload(be, c.b));
    it.view.b = static_cast<const bf16*>(keep.back().data());
    it.view.r = c.r;
    SegmentView& v = it.view.segments[0];
    v.n_chunks = c.n_chunks;
    v.first_position = c.first_position;
    keep.push_back(testing::Upload(be, c.landmarks));
    v.landmarks = static_cast<const bf16*>(keep.back().data());
    keep.push_back(testing::Upload(be, c.excluded));
    v.excluded = static_cast<const uint8_t*>(keep.back().data());
    keep.push_back(testing::Upload(be, c.a));
    v.a = static_cast<const bf16*>(keep.back().data());
    keep.push_back(testing::Upload(be, c.q));
    it.q = static_cast<const bf16*>(keep.back().data());
    keep.push_back(testing::Upload(be, std::vector<int32_t>(hk, -1)));
    it.slots = static_cast<int32_t*>(keep.back().data());
    keep.push_back(testing::Scratch<int32_t>(be, hk));
    it.selected = static_cast<int32_t*>(keep.back().data());
    keep.push_back(testing::Scratch<int32_t>(be, hk));
    it.miss_slot = static_cast<int32_t*>(keep.back().data());
    keep.push_back(testing::Scratch<int32_t>(be, hk));
    it.miss_chunk = static_cast<int32_t*>(keep.back().data());
    keep.push_back(testing::Scratch<int32_t>(be, size_t(shape.h)));
    it.miss_count = static_cast<int32_t*>(keep.back().data());
  }
  auto ws = be.Allocate(std::max<size_t>(be.SelectExWorkspaceBytes(shape, k, o, items), 1));
  EXPECT_TRUE(be.SelectEx(shape, k, o, items, ws->workspace()).ok());
  EXPECT_TRUE(be.Synchronize().ok());
  std::vector<ExOut> out(cs.size());
  for (size_t i = 0; i < cs.size(); ++i) {
    out[i].slots = testing::Download<int32_t>(be, items[i].slots, hk);
    out[i].selected = testing::Download<int32_t>(be, items[i].selected, hk);
    out[i].miss_slot = testing::Download<int32_t>(be, items[i].miss_slot, hk);
    out[i].miss_chunk = testing::Download<int32_t>(be, items[i].miss_chunk, hk);
    out[i].miss_count = testing::Download<int32_t>(be, items[i].miss_count, size_t(shape.h));
  }
  return out;
}

TEST(SelectExGpu, MixedBatchParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(900);
  const int k = 12;
  std::vector<LowRankCase> cs;
  for (int chunks : {40, 400, 1000}) cs.push_back(RandomLowRank(rng, {4, 2, 64}, 8, 32, chunks, 11));
  SelectOptions o;
  o.candidates = 4 * k;  // 48: every chunk of the first item, stage 1 for the others
  o.C = 8;
  o.rope = cs[0].rope;
  for (float top_p : {0.0f, 0.7f}) {
    o.top_p = top_p;
    o.min_k = top_p > 0 ? 3 : 0;
    const std::vector<ExOut> a = RunBatch(*cpu, cs, k, o), b = RunBatch(*gpu, cs, k, o);
    for (size_t i = 0; i < cs.size(); ++i) {
      const std::vector<std::vector<int32_t>> cands =
          testing::StageOneCandidates(*cpu, cs[i], k, o);
      ExpectSameSelection(cs[i], k, a[i], b[i], &cands);
    }
  }
}

TEST(SelectExGpu, AssignSlotsParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(800);
  LowRankCase c = RandomLowRank(rng, {4, 1, 64}, 8, 32, 200, /*static_every=*/7);
  const int k = 24;
  std::vector<int32_t> slots(size_t(c.shape.h) * k, -1);
  for (int step = 0; step < 3; ++step) {
    std::vector<int32_t> given(size_t(c.shape.h) * k);
    for (int32_t& x : given) x = int32_t(rng() % 230) - 10;  // -10..219: some invalid, repeats
    ExOut a = RunEx(*cpu, c, k, nullptr, slots, &given);
    ExOut b = RunEx(*gpu, c, k, nullptr, slots, &given);
    EXPECT_EQ(a.slots, b.slots) << "step " << step;
    EXPECT_EQ(a.miss_slot, b.miss_slot);
    EXPECT_EQ(a.miss_chunk, b.miss_chunk);
    EXPECT_EQ(a.miss_count, b.miss_count);
    slots = a.slots;
  }
}

// Key signatures: the GPU's records equal the CPU's byte for byte, and stage 2 from them
// selects as the CPU does (two stages over stage-1 candidates, and over every chunk).
TEST(SelectExGpu, SignaturesParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  // (bits, g, C): the kernels specialised for (C, bits, g), the generic token-per-lane ones
  // (g 3), and the warp-per-candidate one (C 6, not a power of two).
  const std::tuple<int, int, int> cases[] = {{2, 4, 8}, {2, 3, 8}, {4, 4, 8}, {4, 3, 8},
                                             {4, 8, 16}, {4, 3, 6}, {8, 4, 8}, {8, 8, 16},
                                             {8, 3, 8}};
  for (const auto& [bits, g, C] : cases) {
    SCOPED_TRACE("bits " + std::to_string(bits) + " g " + std::to_string(g) + " C " +
                 std::to_string(C));
    auto rng = MakeRng(900 + bits + 10 * g + 100 * C);
    LowRankCase c = RandomLowRank(rng, {4, g, 64}, C, 32, 300, /*static_every=*/9);
    testing::BuildSignatures(c, bits);
    // The backend encoder from the same keys and landmarks.
    const int h = c.shape.h, d = c.shape.d, tokens = c.n_chunks * c.C;
    std::vector<bf16> kr(size_t(tokens) * h * d);
    for (int t = 0; t < tokens; ++t)
      for (int hh = 0; hh < h; ++hh) {
        const std::vector<float> k = testing::KeyOf(c, hh, t);
        for (int ch = 0; ch < d; ++ch) kr[(size_t(t) * h + hh) * d + ch] = FloatToBf16(k[ch]);
      }
    Buffer kb = testing::Upload(*gpu, kr), lb = testing::Upload(*gpu, c.landmarks);
    Buffer sb = testing::Scratch<std::byte>(*gpu, c.sig.size());
    ASSERT_TRUE(gpu->EncodeSignatures(
                       absl::MakeConstSpan(static_cast<const bf16*>(kb.data()), kr.size()),
                       absl::MakeConstSpan(static_cast<const bf16*>(lb.data()),
                                           c.landmarks.size()),
                       h, d, c.C, c.n_chunks, bits,
                       absl::MakeSpan(static_cast<std::byte*>(sb.data()), c.sig.size()))
                    .ok());
    ASSERT_TRUE(gpu->Synchronize().ok());
    EXPECT_EQ(testing::Download<std::byte>(*gpu, sb.data(), c.sig.size()), c.sig) << bits;
    const int k = 16;
    for (int cands : {4 * k, 100000}) {
      SelectOptions o;
      o.candidates = cands;
      o.C = c.C;
      o.signatures = true;
      ExOut a = RunEx(*cpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
      ExOut b = RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
      const auto s1 = testing::StageOneCandidates(*cpu, c, k, o);
      ExpectSameSelection(c, k, a, b, &s1, /*signatures=*/true);
    }
  }
}

// Selection units (SelectOptions::unit = u < C): the GPU's outputs equal the CPU's exactly,
// `selected`, the slot table and the miss lists, over several steps that carry the slot
// table on (hits, misses, units kept in unused slots under a mass budget). Both backends
// compute the stage-2 logits with the same arithmetic (keys reconstructed with fp32 sums in
// rank order, double-precision RoPE, bf16 rounding; fp32 dots in channel order), so only
// units whose scores tie to within fp32 rounding of the LSE sums could differ; on a
// mismatch the message gives both rows.
std::string Row(const std::vector<int32_t>& v, int hh, int k) {
  std::string out;
  for (int i = 0; i < k; ++i) out += std::to_string(v[size_t(hh) * k + i]) + " ";
  return out;
}

void ExpectSameUnitOutputs(const ExOut& a, const ExOut& b, int h, int k, const std::string& what) {
  for (int hh = 0; hh < h; ++hh) {
    EXPECT_EQ(Row(a.selected, hh, k), Row(b.selected, hh, k)) << what << " selected, head " << hh;
    EXPECT_EQ(Row(a.slots, hh, k), Row(b.slots, hh, k)) << what << " slots, head " << hh;
    EXPECT_EQ(Row(a.miss_slot, hh, k), Row(b.miss_slot, hh, k))
        << what << " miss_slot, head " << hh;
    EXPECT_EQ(Row(a.miss_chunk, hh, k), Row(b.miss_chunk, hh, k))
        << what << " miss_chunk, head " << hh;
  }
  EXPECT_EQ(a.miss_count, b.miss_count) << what;
}

// The next step's query: this one plus noise, so that most units stay selected (hits).
std::vector<bf16> NextQuery(const std::vector<bf16>& q, std::mt19937_64& rng) {
  const std::vector<bf16> noise = testing::RandomBf16(q.size(), rng, 0.3f);
  std::vector<bf16> out(q.size());
  for (size_t i = 0; i < q.size(); ++i) {
    out[i] = FloatToBf16(Bf16ToFloat(q[i]) + Bf16ToFloat(noise[i]));
  }
  return out;
}

TEST(SelectExGpu, UnitsParityWithTheCpuReference) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  struct Shape {
    LayerShape shape;
    int sig_bits;
  };
  // The first three run the stage-2 kernels specialised for (C, bits, g) (the last at the
  // Llama-3-8B shape), the fourth the generic ones, the fifth the 8-bit specialised ones.
  const Shape shapes[] = {{{4, 4, 64}, 4}, {{2, 8, 128}, 2}, {{2, 4, 128}, 4}, {{4, 2, 64}, 4},
                          {{2, 4, 128}, 8}};
  for (int si = 0; si < 5; ++si) {
    auto rng = MakeRng(1100 + si);
    const LowRankCase base = [&] {
      LowRankCase c = RandomLowRank(rng, shapes[si].shape, 8, 32, 160, /*static_every=*/9);
      testing::BuildSignatures(c, shapes[si].sig_bits);
      return c;
    }();
    const int h = base.shape.h;
    for (int u : {1, 2, 4}) {
      const int k = 12 * base.C / u;  // the token budget of 12 chunks
      for (bool sig : {false, true}) {
        // 16: stage 1 keeps 16 chunks (k1 = max(16, 12)); 100000: every chunk is scored.
        for (int cands : {16, 100000}) {
          for (float top_p : {0.0f, 0.7f}) {
            SelectOptions o;
            o.candidates = cands;
            o.C = base.C;
            o.rope = base.rope;
            o.unit = u;
            o.signatures = sig;
            o.top_p = top_p;
            o.min_k = top_p > 0 ? 3 : 0;
            LowRankCase c = base;
            std::vector<int32_t> slots(size_t(h) * k, -1);
            for (int step = 0; step < 3; ++step) {
              const std::string what = "shape " + std::to_string(si) + " u " +
                                       std::to_string(u) + " sig " + std::to_string(sig) +
                                       " candidates " + std::to_string(cands) + " top_p " +
                                       std::to_string(top_p) + " step " + std::to_string(step);
              absl::Status sa, sb;
              const ExOut a = RunEx(*cpu, c, k, &o, slots, nullptr, &sa);
              const ExOut b = RunEx(*gpu, c, k, &o, slots, nullptr, &sb);
              ASSERT_TRUE(sa.ok()) << what << ": " << sa;
              ASSERT_TRUE(sb.ok()) << what << ": " << sb;
              ExpectSameUnitOutputs(a, b, h, k, what);
              slots = a.slots;
              c.q = NextQuery(c.q, rng);
            }
          }
        }
      }
    }
  }
}

// Items of one call on both paths (every chunk scored, stage 1), with units.
TEST(SelectExGpu, UnitsMixedBatchParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(1200);
  std::vector<LowRankCase> cs;
  for (int chunks : {40, 300, 700}) cs.push_back(RandomLowRank(rng, {4, 2, 64}, 8, 32, chunks, 11));
  for (int u : {1, 2}) {
    const int k = 10 * 8 / u;
    SelectOptions o;
    o.candidates = 48;  // every chunk of the first item, stage 1 for the others
    o.C = 8;
    o.rope = cs[0].rope;
    o.unit = u;
    for (float top_p : {0.0f, 0.6f}) {
      o.top_p = top_p;
      o.min_k = top_p > 0 ? 2 : 0;
      const std::vector<ExOut> a = RunBatch(*cpu, cs, k, o), b = RunBatch(*gpu, cs, k, o);
      for (size_t i = 0; i < cs.size(); ++i) {
        ExpectSameUnitOutputs(a[i], b[i], cs[i].shape.h, k,
                              "u " + std::to_string(u) + " top_p " + std::to_string(top_p) +
                                  " item " + std::to_string(i));
      }
    }
  }
}

// The CUDA backend's limits for units, each an InvalidArgument naming it (the CPU backend
// has none): at most 16384 candidate units per head and k <= 4096 units. A unit that does
// not divide C is refused by both; unit = C is whole chunks.
TEST(SelectExGpu, UnitsLimits) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(1300);
  LowRankCase c = RandomLowRank(rng, {2, 1, 16}, 64, 8, 300);
  const int h = c.shape.h;
  SelectOptions o;
  o.C = c.C;
  o.rope = c.rope;
  o.unit = 1;
  absl::Status st;
  // 260 candidate chunks of 64 units: 16640 candidate units.
  o.candidates = 260;
  int k = 64;
  RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("16384 candidate units"), std::string::npos) << st;
  RunEx(*cpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  EXPECT_TRUE(st.ok()) << st;
  // 256 candidate chunks: 16384 units, the limit itself.
  o.candidates = 256;
  const ExOut a = RunEx(*cpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  ASSERT_TRUE(st.ok()) << st;
  const ExOut b = RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  ASSERT_TRUE(st.ok()) << st;
  ExpectSameUnitOutputs(a, b, h, k, "16384 candidate units");
  // k above 4096 units.
  o.candidates = 8;
  o.unit = 4;  // 16 units per chunk: k = 4097 needs 257 chunks, 4112 units
  k = 4097;
  RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("k <= 4096"), std::string::npos) << st;
  o.unit = 3;
  k = 8;
  RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  o.unit = c.C;
  RunEx(*gpu, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1), nullptr, &st);
  EXPECT_TRUE(st.ok()) << st;
}

// A call with no items selects nothing and needs no workspace, units or not: what the
// decode core's probe of a backend (decode::CheckUnitsSupported) sends before a daemon
// accepts a session that selects units, or a same-node decoder joins one.
TEST(SelectExGpu, UnitsWithNoItemsNeedNoWorkspace) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  SelectOptions o;
  o.C = 8;
  o.candidates = 32;
  for (int unit : {0, 1, 2, 4}) {
    o.unit = unit;
    EXPECT_TRUE(gpu->SelectEx({2, 4, 64}, 8, o, {}, Workspace{}, Stream{}).ok()) << "unit " << unit;
  }
  o.unit = 3;  // not a divisor of C: still refused without items
  EXPECT_EQ(gpu->SelectEx({2, 4, 64}, 8, o, {}, Workspace{}, Stream{}).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace select_ex_gpu_test
}  // namespace kvshade::kernels

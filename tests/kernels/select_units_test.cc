// Selection units (SelectOptions::unit, ReconstructItem::unit) on the CPU reference: unit = C
// is whole-chunk selection bit for bit; with units below the chunk size SelectEx ranks the
// candidate chunks' units as a brute-force double-precision reference computed from the
// definition does (reconstructed keys and key signatures, with and without a mass budget);
// needed tokens scattered one per chunk are all covered by units within the token budget
// that whole chunks spend on two of them; Reconstruct of units equals the matching rows of
// whole-chunk Reconstruct for every codec; the slot diff over unit ids (hits, misses, a
// worker's mirror); bad units and budgets are refused.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"
#include "select_ex_util.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace select_units_test {
namespace {

using testing::Cpu;
using testing::ExOut;
using testing::LowRankCase;
using testing::MakeRng;
using testing::RandomLowRank;
using testing::RunEx;

SelectOptions TwoStage(const LowRankCase& c, int candidates, int unit, bool signatures = false) {
  SelectOptions o;
  o.candidates = candidates;
  o.C = c.C;
  o.rope = c.rope;
  o.unit = unit;
  o.signatures = signatures;
  return o;
}

void ExpectSameOutputs(const ExOut& x, const ExOut& y, const std::string& what) {
  EXPECT_EQ(x.selected, y.selected) << what;
  EXPECT_EQ(x.slots, y.slots) << what;
  EXPECT_EQ(x.miss_slot, y.miss_slot) << what;
  EXPECT_EQ(x.miss_chunk, y.miss_chunk) << what;
  EXPECT_EQ(x.miss_count, y.miss_count) << what;
}

TEST(SelectUnits, UnitEqualToTheChunkSizeIsWholeChunkSelection) {
  auto be = Cpu();
  auto rng = MakeRng(800);
  LowRankCase c = RandomLowRank(rng, {2, 3, 16}, 8, 8, 30, /*static_every=*/6);
  testing::BuildSignatures(c, 4);
  const int h = 2, k = 5;
  for (bool sig : {false, true}) {
    for (float top_p : {0.0f, 0.6f}) {
      std::vector<int32_t> a(size_t(h) * k, -1), b = a;
      for (int step = 0; step < 3; ++step) {
        SelectOptions chunks = TwoStage(c, 12, 0, sig);
        chunks.top_p = top_p;
        chunks.min_k = top_p > 0 ? 1 : 0;
        SelectOptions unit_c = chunks;
        unit_c.unit = c.C;
        const ExOut x = RunEx(*be, c, k, &chunks, a);
        const ExOut y = RunEx(*be, c, k, &unit_c, b);
        ExpectSameOutputs(x, y,
                          "sig " + std::to_string(sig) + " top_p " + std::to_string(top_p) +
                              " step " + std::to_string(step));
        a = x.slots;
        b = y.slots;
        for (bf16& q : c.q) q = FloatToBf16(Bf16ToFloat(q) * -1.25f);  // the next query
      }
    }
  }
}

// A unit of the reference ranking: its id and, in double, log m (its best token's
// probability, the group's maximum) and log w (its share of the attention).
struct UnitScore {
  int32_t id;
  double log_m, log_w;
};

// The reference: per-token logits of every token of the candidate chunks straight from the
// definition (double dots with the bf16 keys Reconstruct would write, or the dots the
// signatures stand for, SignatureDotOf), each query head's log-softmax over all of them,
// then per unit of u tokens log m = max_n max_t and log w = max_n logsumexp_t; ranked by
// (m desc, id asc).
std::vector<UnitScore> RankUnits(const LowRankCase& c, int hh, const std::vector<int32_t>& cands,
                                 int u, bool signatures) {
  const int g = c.shape.g, d = c.shape.d, C = c.C, per = C / u;
  const size_t n_tok = cands.size() * C;
  std::vector<std::vector<double>> l(n_tok, std::vector<double>(g));
  for (size_t i = 0; i < cands.size(); ++i) {
    for (int t = 0; t < C; ++t) {
      const int token = cands[i] * C + t;
      std::vector<double> key(d);
      if (!signatures) {
        const std::vector<float> kf = testing::KeyOf(c, hh, token);
        for (int ch = 0; ch < d; ++ch) key[ch] = Bf16ToFloat(FloatToBf16(kf[ch]));
      }
      for (int n = 0; n < g; ++n) {
        double dot = 0;
        if (signatures) {
          dot = testing::SignatureDotOf(c, hh, n, token);
        } else {
          for (int ch = 0; ch < d; ++ch)
            dot += double(Bf16ToFloat(c.q[size_t(hh * g + n) * d + ch])) * key[ch];
        }
        l[i * C + t][n] = dot / std::sqrt(double(d));
      }
    }
  }
  std::vector<double> lse(g);
  for (int n = 0; n < g; ++n) {
    double mx = -INFINITY, z = 0;
    for (const auto& x : l) mx = std::max(mx, x[n]);
    for (const auto& x : l) z += std::exp(x[n] - mx);
    lse[n] = mx + std::log(z);
  }
  std::vector<UnitScore> out;
  for (size_t i = 0; i < cands.size(); ++i) {
    for (int j = 0; j < per; ++j) {
      UnitScore s{cands[i] * per + j, -INFINITY, -INFINITY};
      for (int n = 0; n < g; ++n) {
        double mx = -INFINITY, z = 0;
        for (int t = j * u; t < (j + 1) * u; ++t) mx = std::max(mx, l[i * C + t][n]);
        for (int t = j * u; t < (j + 1) * u; ++t) z += std::exp(l[i * C + t][n] - mx);
        s.log_m = std::max(s.log_m, mx - lse[n]);
        s.log_w = std::max(s.log_w, mx + std::log(z) - lse[n]);
      }
      out.push_back(s);
    }
  }
  std::sort(out.begin(), out.end(), [](const UnitScore& a, const UnitScore& b) {
    if (a.log_m != b.log_m) return a.log_m > b.log_m;
    return a.id < b.id;
  });
  return out;
}

// Stage 1's candidate chunks of head hh at `width` chunks: Select's top `width` (stage 1 is
// whole-chunk landmark selection, unchanged by units), every selectable chunk when `width`
// covers them.
std::vector<int32_t> StageOne(Backend& be, const LowRankCase& c, int hh, int width) {
  if (width >= c.n_chunks) return testing::SelectableChunks(c, hh);
  const int h = c.shape.h;
  const ExOut s1 = RunEx(be, c, width, nullptr, std::vector<int32_t>(size_t(h) * width, -1));
  std::vector<int32_t> out;
  for (int i = 0; i < width; ++i) {
    if (s1.selected[size_t(hh) * width + i] >= 0)
      out.push_back(s1.selected[size_t(hh) * width + i]);
  }
  return out;
}

// The mass budget's reference cut of a ranking.
int ReferenceCut(const std::vector<UnitScore>& ranked, int k, double top_p, int min_k) {
  const int kk = std::min<int>(k, int(ranked.size()));
  double cum = 0;
  int n = kk;
  for (int i = 0; i < kk; ++i) {
    cum += std::exp(ranked[i].log_w);
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

TEST(SelectUnits, RankAsTheBruteForceReference) {
  auto be = Cpu();
  const int h = 2, C = 8, kc = 3;  // a budget of 3 chunks: 24 tokens
  int compared = 0, cuts = 0;
  for (bool sig : {false, true}) {
    for (int seed = 0; seed < 3; ++seed) {
      auto rng = MakeRng(810 + seed + 10 * sig);
      LowRankCase c = RandomLowRank(rng, {h, 3, 16}, C, 8, 24, /*static_every=*/5);
      for (bf16& x : c.q) x = FloatToBf16(Bf16ToFloat(x) * 2.0f);
      if (sig) testing::BuildSignatures(c, seed % 2 == 0 ? 4 : 2);
      for (int u : {1, 2, 4}) {
        const int per = C / u, k = kc * per;
        for (int candidates : {6, 1000}) {
          SelectOptions o = TwoStage(c, candidates, u, sig);
          const ExOut full = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
          const int width = std::max(candidates, (k + per - 1) / per);
          std::vector<std::vector<UnitScore>> ranked(h);
          for (int hh = 0; hh < h; ++hh) {
            const std::vector<int32_t> cands = StageOne(*be, c, hh, width);
            ASSERT_EQ(cands.size(),
                      std::min<size_t>(width, testing::SelectableChunks(c, hh).size()));
            ranked[hh] = RankUnits(c, hh, cands, u, sig);
            for (int i = 0; i < k; ++i) {
              EXPECT_EQ(full.selected[size_t(hh) * k + i], ranked[hh][i].id)
                  << "sig " << sig << " seed " << seed << " u " << u << " candidates " << candidates
                  << " head " << hh << " rank " << i;
            }
            // From an empty table every selected unit misses, in ascending unit id.
            std::vector<int32_t> want(full.selected.begin() + hh * k,
                                      full.selected.begin() + (hh + 1) * k);
            std::sort(want.begin(), want.end());
            EXPECT_EQ(std::vector<int32_t>(full.miss_chunk.begin() + hh * k,
                                           full.miss_chunk.begin() + (hh + 1) * k),
                      want);
            EXPECT_EQ(full.miss_count[hh], k);
            ++compared;
          }
          for (double p : {0.3, 0.7}) {
            for (int min_k : {0, 2}) {
              o.top_p = float(p);
              o.min_k = min_k;
              const ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
              for (int hh = 0; hh < h; ++hh) {
                const int want = ReferenceCut(ranked[hh], k, p, min_k);
                cuts += want < k;
                EXPECT_EQ(Count(x.selected, hh, k), want)
                    << "sig " << sig << " seed " << seed << " u " << u << " p " << p;
                for (int i = 0; i < want; ++i) {
                  EXPECT_EQ(x.selected[size_t(hh) * k + i], full.selected[size_t(hh) * k + i]);
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(compared, 2 * 3 * 3 * 2 * h);
  EXPECT_GT(cuts, 2 * 3 * 3 * 2 * h);  // the mass budget did cut below the cap
}

// One KV head, one query head, 16 chunks of 8 tokens (ExactKeys: logits exact). Chunk 0 is
// eight moderately aligned tokens (logit 2 each, so its landmark ranks first); chunks 1, 3,
// .., 15 each hold one needed token (logit 4) among tokens the query ignores (logit 0); the
// even chunks are background. A budget of 2 chunks (16 tokens) in whole chunks covers 2 of
// the 8 needles however it ranks; units of 2 tokens (k = 8) or single tokens (k = 16) cover
// all 8 with the same 16 tokens.
TEST(SelectUnits, ScatteredNeedlesFitTheTokenBudgetOnlyAsUnits) {
  auto be = Cpu();
  const int C = 8, n_chunks = 16, kc = 2;
  std::vector<std::vector<float>> keys(size_t(n_chunks) * C, std::vector<float>(8, 0.0f));
  std::vector<int> needle_tokens;
  for (int t = 0; t < C; ++t) keys[t][0] = 1.0f;
  for (int j = 1; j < n_chunks; j += 2) {
    const int t = j * C + (j * 3) % C;
    keys[t][0] = 2.0f;
    needle_tokens.push_back(t);
  }
  std::vector<std::vector<float>> q(1, std::vector<float>(8, 0.0f));
  q[0][0] = 8.0f;  // logits 8 * key / sqrt(16): 4 for a needle, 2 in chunk 0, 0 elsewhere
  const LowRankCase c = testing::ExactKeys(1, C, n_chunks, keys, q);
  auto covered = [&](const ExOut& x, int k, int u) {
    std::set<int32_t> units(x.selected.begin(), x.selected.begin() + k);
    int n = 0;
    for (int t : needle_tokens) n += units.count(t / u);
    return n;
  };
  // Whole chunks: the best two chunks hold two needles.
  SelectOptions chunks = TwoStage(c, n_chunks, 0);
  const ExOut whole = RunEx(*be, c, kc, &chunks, std::vector<int32_t>(kc, -1));
  EXPECT_EQ(covered(whole, kc, C), 2);
  for (int u : {1, 2}) {
    const int k = kc * C / u;
    SelectOptions o = TwoStage(c, n_chunks, u);
    const ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
    EXPECT_EQ(covered(x, k, u), 8) << "u " << u;
    EXPECT_EQ(Count(x.selected, 0, k), k);
    // The needles rank first (probability e^4 against e^2 and e^0 per token).
    std::set<int32_t> first(x.selected.begin(), x.selected.begin() + 8);
    for (int t : needle_tokens) EXPECT_TRUE(first.count(t / u)) << "u " << u << " token " << t;
    // Stage 1 narrower than every chunk: the landmarks of the needle chunks (mean logit 0.5)
    // beat the background (0), so 9 candidates (chunk 0 and the needle chunks) suffice.
    SelectOptions narrow = TwoStage(c, 9, u);
    EXPECT_EQ(covered(RunEx(*be, c, k, &narrow, std::vector<int32_t>(k, -1)), k, u), 8);
    // A mass budget over units: the 8 needle units hold 8 e^4 / (8 e^4 + 8 e^2 + 112) = 0.72
    // of the attention with u = 1 (8 (e^4 + 1) / 607.9 = 0.73 with u = 2), 7 of them 0.63
    // (0.64), so top_p = 0.7 keeps exactly them.
    o.top_p = 0.7f;
    const ExOut cut = RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1));
    EXPECT_EQ(Count(cut.selected, 0, k), 8) << "u " << u;
    EXPECT_EQ(covered(cut, k, u), 8);
  }
}

// --- The slot diff over unit ids --------------------------------------------------------

TEST(SelectUnits, SlotDiffOverUnitIds) {
  auto be = Cpu();
  auto rng = MakeRng(830);
  LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 8, 8, 20, /*static_every=*/4);
  const int h = 2, u = 2, per = 4, k = 12;
  SelectOptions o = TwoStage(c, 8, u);
  const ExOut s1 = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
  // The same query again: every unit hits and nothing moves.
  const ExOut s2 = RunEx(*be, c, k, &o, s1.slots);
  EXPECT_EQ(s2.slots, s1.slots);
  EXPECT_EQ(s2.miss_count, (std::vector<int32_t>{0, 0}));
  EXPECT_EQ(s2.miss_slot, std::vector<int32_t>(size_t(h) * k, -1));
  // A new query: units selected both times stay in their slots, the others fill the freed
  // slots, ascending unit into ascending slot.
  LowRankCase c2 = c;
  for (size_t i = 0; i < c2.q.size(); ++i) {
    c2.q[i] = FloatToBf16(0.6f * Bf16ToFloat(c.q[i]) + 0.8f * float(int(rng() % 5) - 2) / 2.0f);
  }
  const ExOut s3 = RunEx(*be, c2, k, &o, s1.slots);
  int moved = 0, stayed = 0;
  for (int hh = 0; hh < h; ++hh) {
    const std::set<int32_t> sel(s3.selected.begin() + hh * k, s3.selected.begin() + (hh + 1) * k);
    std::vector<int32_t> free_slots, misses;
    for (int i = 0; i < k; ++i) {
      const int32_t before = s1.slots[size_t(hh) * k + i];
      if (sel.count(before)) {
        EXPECT_EQ(s3.slots[size_t(hh) * k + i], before);
        ++stayed;
      } else {
        free_slots.push_back(i);
      }
    }
    const std::set<int32_t> held(s1.slots.begin() + hh * k, s1.slots.begin() + (hh + 1) * k);
    for (int32_t id : sel)
      if (!held.count(id)) misses.push_back(id);  // ascending: std::set order
    ASSERT_EQ(s3.miss_count[hh], int(misses.size()));
    moved += int(misses.size());
    for (size_t j = 0; j < misses.size(); ++j) {
      EXPECT_EQ(s3.miss_chunk[size_t(hh) * k + j], misses[j]);
      EXPECT_EQ(s3.miss_slot[size_t(hh) * k + j], free_slots[j]);
      EXPECT_EQ(s3.slots[size_t(hh) * k + free_slots[j]], misses[j]);
    }
  }
  EXPECT_GT(moved, 0);
  EXPECT_GT(stayed, 0);

  // Slots a cut selection does not need keep their units when those are units of chunks the
  // head may select, and are emptied otherwise: put a static chunk's unit (head 0: chunks 0,
  // 4, 8, .. are static) and an id past the 80 units (head 1) in the last slots.
  std::vector<int32_t> slots = s1.slots;
  slots[size_t(k) - 1] = 4 * per + 1;
  slots[size_t(2 * k) - 1] = 20 * per;
  SelectOptions cut = o;
  cut.top_p = 1e-6f;
  cut.min_k = 1;
  const ExOut s4 = RunEx(*be, c, k, &cut, slots);
  for (int hh = 0; hh < h; ++hh) {
    ASSERT_EQ(Count(s4.selected, hh, k), 1);
    const int32_t sel = s4.selected[size_t(hh) * k];
    auto selectable = [&](int32_t id) {
      return id >= 0 && id < 20 * per && !c.excluded[size_t(hh) * c.n_chunks + id / per];
    };
    // The reference slot diff of one selected unit: a hit stays; a miss takes the first slot
    // not holding it; every other slot keeps a selectable unit and is emptied otherwise.
    std::vector<int32_t> want(slots.begin() + hh * k, slots.begin() + (hh + 1) * k);
    const bool missed = std::find(want.begin(), want.end(), sel) == want.end();
    if (missed) want[0] = sel;  // slot 0 holds another unit: it is the first free slot
    for (int i = 0; i < k; ++i) {
      if (want[i] != sel && !selectable(want[i])) want[i] = -1;
    }
    EXPECT_EQ(std::vector<int32_t>(s4.slots.begin() + hh * k, s4.slots.begin() + (hh + 1) * k),
              want)
        << "head " << hh;
    EXPECT_EQ(s4.miss_count[hh], missed ? 1 : 0);
  }
  EXPECT_EQ(s4.slots[size_t(k) - 1], -1);
  EXPECT_EQ(s4.slots[size_t(2 * k) - 1], -1);
}

// A worker that mirrors the slot table from the misses alone stays equal to it over steps
// with units, mass budgets and changing queries, holding every selected unit once.
TEST(SelectUnits, MissesAloneKeepAWorkersMirrorOfTheTable) {
  auto be = Cpu();
  auto rng = MakeRng(840);
  LowRankCase c = RandomLowRank(rng, {2, 2, 16}, 8, 8, 30, /*static_every=*/7);
  testing::BuildSignatures(c, 2);
  const int h = 2, u = 2, k = 16;
  std::vector<int32_t> slots(size_t(h) * k, -1), mirror = slots;
  int cut_steps = 0;
  for (int step = 0; step < 24; ++step) {
    c.q = testing::RandomBf16(c.q.size(), rng, step % 3 == 0 ? 4.0f : 1.0f);
    SelectOptions o = TwoStage(c, 10, u, /*signatures=*/step % 2 == 1);
    if (step % 4 != 3) {
      o.top_p = step % 2 == 0 ? 0.5f : 0.9f;
      o.min_k = 1;
    }
    const ExOut x = RunEx(*be, c, k, &o, slots);
    for (int hh = 0; hh < h; ++hh) {
      cut_steps += Count(x.selected, hh, k) < k;
      for (int j = 0; j < x.miss_count[hh]; ++j) {
        mirror[size_t(hh) * k + x.miss_slot[size_t(hh) * k + j]] = x.miss_chunk[size_t(hh) * k + j];
      }
      std::set<int32_t> held;
      for (int i = 0; i < k; ++i) {
        const int32_t m = mirror[size_t(hh) * k + i];
        if (m >= 0)
          EXPECT_TRUE(held.insert(m).second) << "step " << step << ": unit " << m << " twice";
      }
      for (int i = 0; i < k; ++i) {
        const int32_t sel = x.selected[size_t(hh) * k + i];
        if (sel >= 0) EXPECT_TRUE(held.count(sel)) << "step " << step << ": selected " << sel;
      }
    }
    EXPECT_EQ(mirror, x.slots) << "step " << step;
    slots = x.slots;
  }
  EXPECT_GT(cut_steps, 5);
}

// --- Reconstruct of units -----------------------------------------------------------------

struct ValueSegment {
  int n_chunks = 0;
  int64_t first_position = 0;
  std::vector<bf16> a;
  std::vector<std::byte> values;
  int64_t head_stride = 0, chunk_stride = 0;
};

// Three segments of random factors and backend-encoded values with padded strides.
struct UnitFixture {
  LayerShape shape{3, 2, 64};
  int C = 8, r = 24;
  RopeSpec rope;
  ValueCodecSpec codec;
  std::vector<bf16> b;
  std::vector<ValueSegment> segs;

  void Build(Backend& be, std::mt19937_64& rng, const std::vector<int>& chunk_counts) {
    const int h = shape.h, d = shape.d;
    b = testing::RandomBf16(size_t(h) * r * d, rng, 0.3f);
    const size_t chunk_bytes = ValueChunkBytes(codec, C, d).value();
    int64_t pos = 11;
    for (int n_chunks : chunk_counts) {
      ValueSegment s;
      s.n_chunks = n_chunks;
      s.first_position = pos;
      pos += int64_t(n_chunks) * C + 3;
      s.a = testing::RandomBf16(size_t(n_chunks) * C * r, rng, 1.0f);
      const int n = n_chunks * C;
      const std::vector<bf16> v = testing::RandomBf16(size_t(n) * h * d, rng, 1.0f);
      std::vector<std::byte> dense(size_t(h) * n_chunks * chunk_bytes);
      EXPECT_TRUE(be.EncodeValueChunks(v, n, h, d, C, n_chunks, codec, absl::MakeSpan(dense)).ok());
      s.chunk_stride = int64_t(chunk_bytes) + 8;
      s.head_stride = s.chunk_stride * n_chunks + 16;
      s.values.assign(size_t(s.head_stride) * h, std::byte{0xAB});
      for (int hh = 0; hh < h; ++hh)
        for (int j = 0; j < n_chunks; ++j)
          std::memcpy(s.values.data() + hh * s.head_stride + j * s.chunk_stride,
                      dense.data() + (size_t(hh) * n_chunks + j) * chunk_bytes, chunk_bytes);
      segs.push_back(std::move(s));
    }
  }

  SessionLayerView View() const {
    SessionLayerView v;
    v.n_segments = int(segs.size());
    v.b = b.data();
    v.r = r;
    for (size_t i = 0; i < segs.size(); ++i) {
      v.segments[i].n_chunks = segs[i].n_chunks;
      v.segments[i].first_position = segs[i].first_position;
      v.segments[i].a = segs[i].a.data();
      v.segments[i].values = segs[i].values.data();
      v.segments[i].value_head_stride = segs[i].head_stride;
      v.segments[i].value_chunk_stride = segs[i].chunk_stride;
    }
    return v;
  }

  // Runs Reconstruct of one item; keys/values are [h, k, rows, d] prefilled with a sentinel.
  absl::Status Run(Backend& be, int k, int unit, const std::vector<int32_t>& miss_chunk,
                   const std::vector<int32_t>& miss_count, const std::vector<int32_t>* miss_slot,
                   std::vector<bf16>* keys, std::vector<bf16>* values) const {
    ReconstructItem it;
    it.view = View();
    it.miss_chunk = miss_chunk.data();
    it.miss_count = miss_count.data();
    it.miss_slot = miss_slot != nullptr ? miss_slot->data() : nullptr;
    it.unit = unit;
    const int rows = unit > 0 && unit < C ? unit : C;
    keys->assign(size_t(shape.h) * k * rows * shape.d, bf16{0x7FC1});
    values->assign(keys->size(), bf16{0x7FC1});
    it.keys = keys->data();
    it.values = values->data();
    std::vector<ReconstructItem> items = {it};
    auto ws =
        be.Allocate(std::max<size_t>(be.ReconstructWorkspaceBytes(shape, k, items), 1)).value();
    return be.Reconstruct(shape, C, k, rope, codec, items, ws.workspace());
  }

  int total() const {
    int t = 0;
    for (const auto& s : segs) t += s.n_chunks;
    return t;
  }
};

class ReconstructUnits : public ::testing::TestWithParam<ValueCodecSpec> {};

TEST_P(ReconstructUnits, RowsEqualWholeChunkReconstruct) {
  auto be = Cpu();
  auto rng = MakeRng(850 + int(GetParam().codec));
  UnitFixture f;
  f.codec = GetParam();
  f.rope.theta = 500000.0f;
  f.Build(*be, rng, {5, 3, 6});
  const int h = f.shape.h, d = f.shape.d, C = f.C, total = f.total();
  // Every chunk of every head, whole.
  std::vector<int32_t> all(size_t(h) * total), all_count(h, total);
  for (int hh = 0; hh < h; ++hh)
    std::iota(all.begin() + hh * total, all.begin() + (hh + 1) * total, 0);
  std::vector<bf16> whole_k, whole_v;
  ASSERT_TRUE(f.Run(*be, total, 0, all, all_count, nullptr, &whole_k, &whole_v).ok());
  // unit = C is whole chunks.
  std::vector<bf16> same_k, same_v;
  ASSERT_TRUE(f.Run(*be, total, C, all, all_count, nullptr, &same_k, &same_v).ok());
  EXPECT_EQ(0, std::memcmp(same_k.data(), whole_k.data(), whole_k.size() * sizeof(bf16)));
  EXPECT_EQ(0, std::memcmp(same_v.data(), whole_v.data(), whole_v.size() * sizeof(bf16)));

  for (int u : {1, 2, 4}) {
    const int per = C / u, units = total * per, k = 20;
    // Per head a random set of distinct units (fewer for head 2), written to permuted slots.
    std::vector<int32_t> miss(size_t(h) * k, -1), slot(size_t(h) * k, -1);
    const std::vector<int32_t> count = {k, 13, 5};
    for (int hh = 0; hh < h; ++hh) {
      std::vector<int32_t> ids(units);
      std::iota(ids.begin(), ids.end(), 0);
      std::shuffle(ids.begin(), ids.end(), rng);
      std::sort(ids.begin(), ids.begin() + count[hh]);
      if (hh == 0) ids[count[hh] - 1] = units - 1;  // the last unit of the last segment
      std::vector<int32_t> slots(k);
      std::iota(slots.begin(), slots.end(), 0);
      std::shuffle(slots.begin(), slots.end(), rng);
      for (int j = 0; j < count[hh]; ++j) {
        miss[size_t(hh) * k + j] = ids[j];
        slot[size_t(hh) * k + j] = slots[j];
      }
    }
    std::vector<bf16> uk, uv;
    ASSERT_TRUE(f.Run(*be, k, u, miss, count, &slot, &uk, &uv).ok()) << "u " << u;
    std::vector<bool> written(size_t(h) * k, false);
    for (int hh = 0; hh < h; ++hh) {
      for (int j = 0; j < count[hh]; ++j) {
        const int32_t id = miss[size_t(hh) * k + j];
        const int chunk = id * u / C, t0 = id * u % C;
        const size_t row = size_t(hh) * k + slot[size_t(hh) * k + j];
        written[row] = true;
        const size_t src = ((size_t(hh) * total + chunk) * C + t0) * d;
        EXPECT_EQ(0, std::memcmp(uk.data() + row * u * d, whole_k.data() + src, size_t(u) * d * 2))
            << "keys: u " << u << " head " << hh << " unit " << id;
        EXPECT_EQ(0, std::memcmp(uv.data() + row * u * d, whole_v.data() + src, size_t(u) * d * 2))
            << "values: u " << u << " head " << hh << " unit " << id;
      }
    }
    // Rows no miss names are untouched.
    for (size_t row = 0; row < written.size(); ++row) {
      if (written[row]) continue;
      for (int x = 0; x < u * d; ++x) {
        ASSERT_EQ(uk[row * u * d + x].bits, 0x7FC1) << "row " << row;
        ASSERT_EQ(uv[row * u * d + x].bits, 0x7FC1) << "row " << row;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    All, ReconstructUnits,
    ::testing::Values(ValueCodecSpec{ValueCodec::kBF16, 16}, ValueCodecSpec{ValueCodec::kFP8, 16},
                      ValueCodecSpec{ValueCodec::kINT4, 16}, ValueCodecSpec{ValueCodec::kINT2, 32}),
    [](const auto& info) { return std::string(ValueCodecName(info.param.codec)); });

// Selection units end to end: SelectEx's unit misses reconstruct to the units' keys.
TEST(SelectUnits, SelectedUnitsReconstructToTheirTokensKeys) {
  auto be = Cpu();
  auto rng = MakeRng(860);
  LowRankCase c = RandomLowRank(rng, {2, 1, 16}, 8, 16, 12);
  const int h = 2, u = 2, k = 10, d = 16;
  SelectOptions o = TwoStage(c, 6, u);
  const ExOut x = RunEx(*be, c, k, &o, std::vector<int32_t>(size_t(h) * k, -1));
  std::vector<bf16> keys(size_t(h) * k * u * d), values(keys.size());
  std::vector<std::byte> vstore(size_t(h) * c.n_chunks * c.C * d * 2);
  ReconstructItem ri;
  ri.view.n_segments = 1;
  ri.view.b = c.b.data();
  ri.view.r = c.r;
  ri.view.segments[0].n_chunks = c.n_chunks;
  ri.view.segments[0].first_position = c.first_position;
  ri.view.segments[0].a = c.a.data();
  ri.view.segments[0].values = vstore.data();
  ri.view.segments[0].value_head_stride = int64_t(c.n_chunks) * c.C * d * 2;
  ri.view.segments[0].value_chunk_stride = int64_t(c.C) * d * 2;
  ri.miss_chunk = x.miss_chunk.data();
  ri.miss_count = x.miss_count.data();
  ri.miss_slot = x.miss_slot.data();
  ri.keys = keys.data();
  ri.values = values.data();
  ri.unit = u;
  std::vector<ReconstructItem> items = {ri};
  auto ws = be->Allocate(be->ReconstructWorkspaceBytes(c.shape, k, items)).value();
  ASSERT_TRUE(be->Reconstruct(c.shape, c.C, k, c.rope, {}, items, ws.workspace()).ok());
  for (int hh = 0; hh < h; ++hh) {
    ASSERT_EQ(x.miss_count[hh], k);
    for (int slot = 0; slot < k; ++slot) {
      const int32_t id = x.slots[size_t(hh) * k + slot];
      for (int i = 0; i < u; ++i) {
        const std::vector<float> want = testing::KeyOf(c, hh, id * u + i);
        for (int ch = 0; ch < d; ++ch) {
          EXPECT_EQ(keys[((size_t(hh) * k + slot) * u + i) * d + ch].bits,
                    FloatToBf16(want[ch]).bits)
              << "head " << hh << " slot " << slot << " unit " << id << " token " << i;
        }
      }
    }
  }
}

// --- Validation ---------------------------------------------------------------------------

TEST(SelectUnits, RejectsBadUnitsAndBudgets) {
  auto be = Cpu();
  auto rng = MakeRng(870);
  LowRankCase c = RandomLowRank(rng, {1, 1, 16}, 8, 8, 10);
  absl::Status st;
  auto expect_bad = [&](const SelectOptions& o, int k, const std::string& needle) {
    RunEx(*be, c, k, &o, std::vector<int32_t>(k, -1), nullptr, &st);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << needle << ": " << st;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st;
  };
  expect_bad(TwoStage(c, 4, 3), 4, "unit");   // not a divisor of C = 8
  expect_bad(TwoStage(c, 4, 16), 4, "unit");  // above C
  expect_bad(TwoStage(c, 4, -2), 4, "unit");
  SelectOptions one = TwoStage(c, 0, 2);  // units need two stages
  expect_bad(one, 4, "two-stage");
  // k counts units: up to 10 chunks * 4 units of 2 tokens.
  expect_bad(TwoStage(c, 4, 2), 41, "total_units = 40");
  RunEx(*be, c, 40, nullptr, std::vector<int32_t>(40, -1), nullptr, &st);  // whole chunks: 10
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  SelectOptions ok = TwoStage(c, 4, 2);
  RunEx(*be, c, 40, &ok, std::vector<int32_t>(40, -1), nullptr, &st);
  EXPECT_TRUE(st.ok()) << st;
  // unit = C with one stage is whole chunks: accepted.
  SelectOptions whole;
  whole.C = c.C;
  whole.unit = c.C;
  RunEx(*be, c, 4, &whole, std::vector<int32_t>(4, -1), nullptr, &st);
  EXPECT_TRUE(st.ok()) << st;

  // Reconstruct: the item's unit, and miss ids and k against the units.
  UnitFixture f;
  f.Build(*be, rng, {4, 2});  // 6 chunks: 24 units of 2 tokens, 48 of 1
  std::vector<bf16> keys, values;
  std::vector<int32_t> miss(size_t(f.shape.h) * 8, 0), count(f.shape.h, 1);
  for (int bad : {3, -1, 16}) {
    st = f.Run(*be, 8, bad, miss, count, nullptr, &keys, &values);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("unit"), std::string::npos) << st;
  }
  EXPECT_TRUE(f.Run(*be, 8, 2, miss, count, nullptr, &keys, &values).ok());
  miss[0] = 24;  // one past the last unit of 2 tokens
  st = f.Run(*be, 8, 2, miss, count, nullptr, &keys, &values);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("total_units = 24"), std::string::npos) << st;
  EXPECT_TRUE(f.Run(*be, 8, 1, miss, count, nullptr, &keys, &values).ok());  // 48 units of 1
  std::vector<int32_t> wide(size_t(f.shape.h) * 25, 0);
  st = f.Run(*be, 25, 2, wide, count, nullptr, &keys, &values);  // k above 24 units
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("total_units"), std::string::npos) << st;
}

}  // namespace
}  // namespace select_units_test
}  // namespace kvshade::kernels

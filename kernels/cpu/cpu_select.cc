// CPU Select (docs/ALGORITHM.md decode steps 1-3): landmark scores, GQA max, top-k per KV head
// and the temporal-cache slot diff, per session item.
//
// Per (item, KV head hh), with scale = 1/sqrtf(d) and chunk ids global across the view's
// segments (segment 0 first):
//   logit[c] = dot(q[qh], L[c, hh]) * scale   (fp32, channels in order)
//   p[c]     = exp(logit[c] - max) / sum      over the head's selectable chunks only
//   s[c]     = max over the g query heads of p[c]
// Top-k orders by (s descending, chunk id ascending); a NaN score ranks as -inf. Slot diff:
// scanning slots in ascending order, a slot whose chunk is selected (first occurrence only)
// is a hit and keeps it; every other slot is free; misses (selected, not hit) in ascending
// chunk id fill free slots in ascending slot order; free slots left over become -1.
// miss_slot/miss_chunk entries at or after miss_count are set to -1.
//
// Workspace, per item i and head hh (f32 words): s [total_i], tmp [total_i] (exp values,
// then reused as the int32 candidate list), aux [4k] int32 (slot-diff scratch).
//
// SelectEx (SelectOptions in backend.h) runs the same scoring, keeps the best
// max(candidates, ceil(k/P)) chunks in two-stage mode (P = C/unit units per chunk, 1 for
// whole chunks) and re-ranks their units by the per-query-head softmax over every candidate
// token (ChunkStats, StageTwoScores; keys reconstructed exactly as cpu_reconstruct.cc does,
// rounded to bf16, fp32 dots in channel order; or, with `signatures`, logits from the key
// signatures: ChunkStatsSig; (M, S) folded per unit, a whole chunk being one unit), then
// cuts at the mass budget; workspace per (item, head): s, cand, tmp [total], aux [4k],
// acc [d], and in two stages, over the U = min(total, stage-1 width) * P candidate units,
// stats [U, g] (M, S), lse [g], uid, m, w, order [U]. Whole chunks (unit 0 or C) run the
// same arithmetic in the same order as before units existed. AssignSlots filters the
// caller's ids (range, static, repeats) and runs the same slot diff.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/codec.h"

namespace kvshade::kernels {
namespace {

// Total chunks of a view, robust to unvalidated counts (used for workspace sizing).
int64_t SafeTotalChunks(const SessionLayerView& view) {
  int64_t t = 0;
  const int n = std::clamp(view.n_segments, 0, kMaxSegments);
  for (int s = 0; s < n; ++s) t += std::max<int64_t>(view.segments[s].n_chunks, 0);
  return t;
}

int64_t RowWords(int64_t total, int k) { return 2 * total + 4 * int64_t(k); }

// Landmark scores of one head: s[c] = max over the group of the per-query-head softmax
// over the selectable chunks; NaN for excluded chunks, -inf for 0/0. tmp [total] scratch.
void ScoreHead(const LayerShape& shape, const SelectItem& item, int hh, float* s, float* tmp) {
  const int h = shape.h, g = shape.g, d = shape.d;
  const SessionLayerView& view = item.view;
  const int total = view.total_chunks();
  const float scale = 1.0f / std::sqrt(float(d));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // s[c] is NaN for excluded chunks (the marker) and starts at -inf for selectable ones;
  // tmp holds logits, then exp values.
  {
    int base = 0;
    for (int si = 0; si < view.n_segments; ++si) {
      const SegmentView& seg = view.segments[si];
      for (int j = 0; j < seg.n_chunks; ++j) {
        const bool excluded =
            seg.excluded != nullptr && seg.excluded[int64_t(hh) * seg.n_chunks + j] != 0;
        s[base + j] = excluded ? std::numeric_limits<float>::quiet_NaN() : kNegInf;
      }
      base += seg.n_chunks;
    }
  }
  for (int qi = 0; qi < g; ++qi) {
    const bf16* qv = item.q + int64_t(hh * g + qi) * d;
    float mx = kNegInf;
    int base = 0;
    for (int si = 0; si < view.n_segments; ++si) {
      const SegmentView& seg = view.segments[si];
      for (int j = 0; j < seg.n_chunks; ++j) {
        const int c = base + j;
        if (std::isnan(s[c])) continue;
        const bf16* lv = seg.landmarks + (int64_t(j) * h + hh) * d;
        float dot = 0.0f;
        for (int x = 0; x < d; ++x) dot += Bf16ToFloat(qv[x]) * Bf16ToFloat(lv[x]);
        const float logit = dot * scale;
        tmp[c] = std::isnan(logit) ? kNegInf : logit;
        mx = std::max(mx, tmp[c]);
      }
      base += seg.n_chunks;
    }
    float sum = 0.0f;
    for (int c = 0; c < total; ++c) {
      if (std::isnan(s[c])) continue;
      // An all -inf head (exp(-inf - -inf) = NaN) contributes probability 0.
      const float e = mx == kNegInf ? 0.0f : std::exp(tmp[c] - mx);
      tmp[c] = e;
      sum += e;
    }
    for (int c = 0; c < total; ++c) {
      if (std::isnan(s[c])) continue;
      float p = tmp[c] / sum;
      if (std::isnan(p)) p = kNegInf;  // 0/0 or inf/inf: ranks last
      s[c] = std::max(s[c], p);
    }
  }
}

// The selectable chunks (s not NaN) into cand, the best m first by (s desc, id asc).
// Returns the number of selectable chunks.
int RankByScore(const float* s, int total, int m, int32_t* cand) {
  int n_cand = 0;
  for (int c = 0; c < total; ++c) {
    if (!std::isnan(s[c])) cand[n_cand++] = c;
  }
  std::partial_sort(cand, cand + std::min(m, n_cand), cand + n_cand, [s](int32_t a, int32_t b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
  });
  return n_cand;
}

// Whether id (global; a chunk id, or with `per` > 1 units per chunk a unit id) is of a chunk
// of the view that head hh may select: in range and not excluded (static) for that head.
bool SelectableChunk(const SessionLayerView& v, int hh, int32_t id, int per = 1) {
  if (id < 0 || int64_t(id) >= int64_t(v.total_chunks()) * per) return false;
  int local = id / per, si = 0;
  while (local >= v.segments[si].n_chunks) local -= v.segments[si++].n_chunks;
  const SegmentView& seg = v.segments[si];
  return seg.excluded == nullptr || seg.excluded[int64_t(hh) * seg.n_chunks + local] == 0;
}

// Slot diff of one head for the chosen chunks ids[0, kk) (distinct, any order); aux [3k].
// With selection units the ids are unit ids, `per` of them per chunk.
void SlotDiff(int k, const int32_t* ids, int kk, const SelectItem& item, int hh, int32_t* aux,
              int per = 1) {
  int32_t* sorted_sel = aux;         // [kk] ascending chunk ids
  int32_t* claimed = aux + k;        // [kk] 1 = hit
  int32_t* free_slots = aux + 2 * k; // ascending
  std::copy(ids, ids + kk, sorted_sel);
  std::sort(sorted_sel, sorted_sel + kk);
  std::fill(claimed, claimed + kk, 0);
  int32_t* slots = item.slots + int64_t(hh) * k;
  int n_free = 0;
  for (int slot = 0; slot < k; ++slot) {
    const int32_t c = slots[slot];
    const int32_t* it = std::lower_bound(sorted_sel, sorted_sel + kk, c);
    if (it != sorted_sel + kk && *it == c && !claimed[it - sorted_sel]) {
      claimed[it - sorted_sel] = 1;  // hit: stays in its slot
    } else {
      free_slots[n_free++] = slot;  // evicted, empty, invalid or duplicate
    }
  }
  int32_t* miss_slot = item.miss_slot + int64_t(hh) * k;
  int32_t* miss_chunk = item.miss_chunk + int64_t(hh) * k;
  int n_miss = 0;
  for (int i = 0; i < kk; ++i) {
    if (claimed[i]) continue;
    const int32_t slot = free_slots[n_miss];  // n_free >= misses: k - hits >= kk - hits
    slots[slot] = sorted_sel[i];
    miss_slot[n_miss] = slot;
    miss_chunk[n_miss] = sorted_sel[i];
    ++n_miss;
  }
  // Free slots no miss took keep their chunk when it is a chunk of the session that this
  // step did not select (a mass budget or model-native ids chose fewer than k): it was
  // delivered before, so a worker's copy of the slot stays equal to the table and a later
  // step that selects it again hits. Other entries (empty, not selectable by this head, or
  // a second copy of a selected chunk) are emptied.
  for (int i = n_miss; i < n_free; ++i) {
    int32_t& c = slots[free_slots[i]];
    const bool selected = std::binary_search(sorted_sel, sorted_sel + kk, c);
    if (selected || !SelectableChunk(item.view, hh, c, per)) c = -1;
  }
  for (int i = n_miss; i < k; ++i) miss_slot[i] = miss_chunk[i] = -1;
  item.miss_count[hh] = n_miss;
}

void SelectHead(const LayerShape& shape, int k, const SelectItem& item, int hh, float* s,
                float* tmp, int32_t* aux) {
  const int total = item.view.total_chunks();
  ScoreHead(shape, item, hh, s, tmp);
  int32_t* cand = reinterpret_cast<int32_t*>(tmp);
  const int kk = std::min(k, RankByScore(s, total, k, cand));
  int32_t* selected = item.selected + int64_t(hh) * k;
  for (int i = 0; i < k; ++i) selected[i] = i < kk ? cand[i] : -1;
  SlotDiff(k, cand, kk, item, hh, aux);
}

// One stage-2 logit into a chunk's running (M, S) of query head n; non-finite logits carry
// no weight.
inline void FoldLogit(float logit, float* stats_n) {
  if (!std::isfinite(logit)) return;
  float& mx = stats_n[0];
  float& sum = stats_n[1];
  if (logit > mx) {
    sum = sum * std::exp(mx - logit) + 1.0f;
    mx = logit;
  } else {
    sum += std::exp(logit - mx);
  }
}

// Resets the (M, S) pairs of n_stats query-head slots: M = -inf, S = 0.
inline void ResetStats(float* stats, int64_t n_stats) {
  for (int64_t i = 0; i < n_stats; ++i) {
    stats[2 * i] = -std::numeric_limits<float>::infinity();
    stats[2 * i + 1] = 0.0f;
  }
}

// ChunkStats from the key signatures (SelectOptions::signatures): per query head n,
// base_n = SignatureBaseReference(q_n, L[c]) once, then per token
// l = (base_n + scale_t * SignatureDotReference(q8_n, code_t)) / sqrt(d), folded in token
// order as below, token t into the stats of its unit t / u. q8 [g, d] and q_scale [g]: the
// group's int8 query rows (SignatureQueryReference); codes [d] scratch; base [g] scratch
// (the row's lse, which StageTwoScores fills only after every candidate).
void ChunkStatsSig(const LayerShape& shape, const SelectOptions& o, const SelectItem& item,
                   int hh, int c, const int8_t* q8, const float* q_scale, uint8_t* codes,
                   float* base, float* stats) {
  const int h = shape.h, g = shape.g, d = shape.d, C = o.C, u = o.unit_tokens();
  const SessionLayerView& view = item.view;
  int local = c, si = 0;
  while (local >= view.segments[si].n_chunks) local -= view.segments[si++].n_chunks;
  const SegmentView& seg = view.segments[si];
  const float scale = 1.0f / std::sqrt(float(d));
  const int bits = view.sig_bits;
  const size_t rec = SignatureRecordBytes(bits, d);
  const bf16* lm = seg.landmarks + (int64_t(local) * h + hh) * d;
  ResetStats(stats, int64_t(C / u) * g);
  for (int n = 0; n < g; ++n) {
    base[n] = SignatureBaseReference(item.q + int64_t(hh * g + n) * d, lm, d);
  }
  for (int t = 0; t < C; ++t) {
    float sc = 0.0f;
    SignatureUnpackReference(seg.sig + ((int64_t(local) * C + t) * h + hh) * int64_t(rec), d,
                             bits, codes, &sc);
    float* unit_stats = stats + int64_t(2) * g * (t / u);
    for (int n = 0; n < g; ++n) {
      const float dot = SignatureDotReference(q8 + int64_t(n) * d, q_scale[n], codes, d, bits);
      FoldLogit((base[n] + sc * dot) * scale, unit_stats + 2 * n);
    }
  }
}

// Stage-2 statistics of chunk c of head hh, per unit of u = o.unit_tokens() tokens (the
// whole chunk when u = C) and query head n of the group, over the logits
// l = q_n . k_hat / sqrt(d) of the unit's tokens (k_hat the bf16-rounded reconstructed
// post-RoPE key, fp32 dot): M = the max logit and S = sum_t exp(l - M), accumulated in token
// order and rescaled when the max grows (the CUDA kernel runs the same sequence for whole
// chunks). Non-finite logits (NaN, or +-inf from overflow) carry no weight; a head without a
// finite logit has M = -inf, S = 0. stats [C/u, g] (M, S) pairs; acc [d].
void ChunkStats(const LayerShape& shape, const SelectOptions& o, const RopeTable& table,
                const SelectItem& item, int hh, int c, float* acc, float* stats) {
  const int g = shape.g, d = shape.d, C = o.C, u = o.unit_tokens();
  const SessionLayerView& view = item.view;
  const int r = view.r;
  int local = c, si = 0;
  while (local >= view.segments[si].n_chunks) local -= view.segments[si++].n_chunks;
  const SegmentView& seg = view.segments[si];
  const bf16* b = view.b + int64_t(hh) * r * d;
  const float scale = 1.0f / std::sqrt(float(d));
  ResetStats(stats, int64_t(C / u) * g);
  for (int t = 0; t < C; ++t) {
    const bf16* a = seg.a + (int64_t(local) * C + t) * r;
    std::fill(acc, acc + d, 0.0f);
    for (int x = 0; x < r; ++x) {
      const float ax = Bf16ToFloat(a[x]);
      const bf16* bx = b + int64_t(x) * d;
      for (int ch = 0; ch < d; ++ch) acc[ch] += ax * Bf16ToFloat(bx[ch]);
    }
    ApplyRopeReference(table, o.rope.pairing, seg.first_position + int64_t(local) * C + t, acc, d);
    for (int ch = 0; ch < d; ++ch) acc[ch] = Bf16ToFloat(FloatToBf16(acc[ch]));
    float* unit_stats = stats + int64_t(2) * g * (t / u);
    for (int n = 0; n < g; ++n) {
      const bf16* qv = item.q + int64_t(hh * g + n) * d;
      float dot = 0.0f;
      for (int ch = 0; ch < d; ++ch) dot += Bf16ToFloat(qv[ch]) * acc[ch];
      FoldLogit(dot * scale, unit_stats + 2 * n);
    }
  }
}

// Stage-2 scores of the candidate units [0, n) from their stats [n, g] (M, S), normalised
// per query head over every candidate token: per head n,
//   LSE_n = log sum_i S_in exp(M_in)   (the max of M + log S first, then the sum in
//                                       candidate order)
//   m[i] = max_n exp(M_in - LSE_n)             (the unit's best token probability)
//   w[i] = max_n exp(M_in + log S_in - LSE_n)  (the unit's share of the head's attention)
// over the heads with a finite M_in; 0 for a unit without any. m and w [n] are indexed by
// candidate position; lse [g] scratch.
void StageTwoScores(int g, int n_units, const float* stats, float* lse, float* m, float* w) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int n = 0; n < g; ++n) {
    float mx = kNegInf;
    for (int i = 0; i < n_units; ++i) {
      const float M = stats[(int64_t(i) * g + n) * 2];
      if (M != kNegInf) mx = std::max(mx, M + std::log(stats[(int64_t(i) * g + n) * 2 + 1]));
    }
    if (mx == kNegInf) {
      lse[n] = kNegInf;  // no finite logit for this head: it scores nothing
      continue;
    }
    float z = 0.0f;
    for (int i = 0; i < n_units; ++i) {
      const float M = stats[(int64_t(i) * g + n) * 2];
      if (M != kNegInf) z += std::exp(M + std::log(stats[(int64_t(i) * g + n) * 2 + 1]) - mx);
    }
    lse[n] = mx + std::log(z);
  }
  for (int i = 0; i < n_units; ++i) {
    float best = 0.0f, mass = 0.0f;
    for (int n = 0; n < g; ++n) {
      const float M = stats[(int64_t(i) * g + n) * 2];
      if (M == kNegInf) continue;
      best = std::max(best, std::exp(M - lse[n]));
      mass = std::max(mass, std::exp(M + std::log(stats[(int64_t(i) * g + n) * 2 + 1]) - lse[n]));
    }
    m[i] = best;
    w[i] = mass;
  }
}

// Stage-1 width in chunks: max(candidates, ceil(k / units per chunk)) in two stages (so that
// the candidates hold k units), k in one.
int StageOneWidth(const SelectOptions& o, int k) {
  if (!o.two_stage()) return k;
  const int per = o.units_per_chunk();
  return std::max(o.candidates, k / per + (k % per != 0));
}

// Candidate units of the two-stage rows: min(total, stage-1 width) chunks of P units.
int64_t StageTwoUnits(int64_t total, int k, const SelectOptions& o) {
  return std::min<int64_t>(total, StageOneWidth(o, k)) * o.units_per_chunk();
}

// Words of SelectEx's workspace row per (item, head): s [total], cand [total], tmp [total],
// aux [4k], acc [d], then in two stages, over U = StageTwoUnits candidate units, stats
// [U, g] (M, S), lse [g], uid [U], m [U], w [U] and order [U].
int64_t RowWordsEx(int64_t total, int k, int d, int g, const SelectOptions& o) {
  int64_t words = 3 * total + 4 * int64_t(k) + d;
  if (o.two_stage()) {
    const int64_t units = StageTwoUnits(total, k, o);
    words += 2 * units * g + g + 4 * units;
  }
  return words;
}

void SelectExHead(const LayerShape& shape, int k, const SelectOptions& o, const RopeTable* table,
                  const SelectItem& item, int hh, float* row) {
  const int total = item.view.total_chunks();
  const int g = shape.g, d = shape.d;
  float* s = row;
  int32_t* cand = reinterpret_cast<int32_t*>(row + total);
  float* tmp = row + 2 * total;
  int32_t* aux = reinterpret_cast<int32_t*>(row + 3 * total);
  float* acc = row + 3 * total + 4 * k;
  ScoreHead(shape, item, hh, s, tmp);
  const int stage1 = StageOneWidth(o, k);
  const int n_sel = RankByScore(s, total, stage1, cand);
  const int n_cand = std::min(stage1, n_sel);
  // One stage: the ranking is cand (chunk ids), the mass of chunk c its landmark score s[c].
  // Two stages: the ranking is order (unit ids once ranked), the mass of the unit at
  // candidate position i is w[i].
  int32_t* ranked = cand;
  int n_ranked = n_cand;
  const float* mass = nullptr;
  int per = 1;
  if (o.two_stage()) {
    per = o.units_per_chunk();
    const int64_t units = StageTwoUnits(total, k, o);
    float* stats = acc + d;
    float* lse = stats + 2 * units * g;
    int32_t* uid = reinterpret_cast<int32_t*>(lse + g);
    float* m = lse + g + units;
    float* w = m + units;
    int32_t* order = reinterpret_cast<int32_t*>(w + units);
    std::vector<int8_t> q8;
    std::vector<float> q_scale;
    if (o.signatures) {
      q8.resize(size_t(g) * d);
      q_scale.resize(size_t(g));
      for (int n = 0; n < g; ++n) {
        q_scale[n] = SignatureQueryReference(item.q + int64_t(hh * g + n) * d, d,
                                             q8.data() + int64_t(n) * d);
      }
    }
    for (int i = 0; i < n_cand; ++i) {
      float* chunk_stats = stats + int64_t(2) * g * per * i;
      if (o.signatures) {
        ChunkStatsSig(shape, o, item, hh, cand[i], q8.data(), q_scale.data(),
                      reinterpret_cast<uint8_t*>(acc), lse, chunk_stats);
      } else {
        ChunkStats(shape, o, *table, item, hh, cand[i], acc, chunk_stats);
      }
    }
    n_ranked = n_cand * per;
    StageTwoScores(g, n_ranked, stats, lse, m, w);
    for (int i = 0; i < n_ranked; ++i) {
      uid[i] = cand[i / per] * per + i % per;
      order[i] = i;
    }
    std::sort(order, order + n_ranked, [m, uid](int32_t a, int32_t b) {
      const bool na = std::isnan(m[a]), nb = std::isnan(m[b]);
      if (na != nb) return nb;
      if (!na && m[a] != m[b]) return m[a] > m[b];
      return uid[a] < uid[b];
    });
    // The units' masses in rank order (into m: the scores are no longer needed), then
    // order's positions become unit ids in place.
    for (int i = 0; i < n_ranked; ++i) m[i] = w[order[i]];
    for (int i = 0; i < n_ranked; ++i) order[i] = uid[order[i]];
    ranked = order;
    mass = m;
  }
  int kk = std::min(k, n_ranked);
  if (o.top_p > 0.0f && kk > 0) {
    float cum = 0.0f;
    int n = kk;
    for (int i = 0; i < kk; ++i) {
      const float x = mass != nullptr ? mass[i] : s[ranked[i]];
      cum += std::isfinite(x) && x > 0.0f ? x : 0.0f;
      if (cum >= o.top_p) {
        n = i + 1;
        break;
      }
    }
    kk = std::min(kk, std::max(n, o.min_k));
  }
  int32_t* selected = item.selected + int64_t(hh) * k;
  for (int i = 0; i < k; ++i) selected[i] = i < kk ? ranked[i] : -1;
  SlotDiff(k, ranked, kk, item, hh, aux, per);
}

}  // namespace

size_t CpuBackend::SelectWorkspaceBytes(const LayerShape& shape, int k,
                                        absl::Span<const SelectItem> items) const {
  int64_t words = 0;
  for (const SelectItem& it : items) {
    words += int64_t(std::max(shape.h, 0)) * RowWords(SafeTotalChunks(it.view), std::max(k, 0));
  }
  return size_t(words) * sizeof(float);
}

absl::Status CpuBackend::Select(const LayerShape& shape, int k,
                                absl::Span<const SelectItem> items, Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Select(shape, k, items, ws, SelectWorkspaceBytes(shape, k, items)));
  const int h = shape.h;
  const int64_t n_items = int64_t(items.size());
  // Word offset of each item's workspace rows; the items' sizes differ.
  float* base = static_cast<float*>(ws.data);
  int64_t pairs = n_items * h;
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t i = p / h;
    const int hh = int(p % h);
    int64_t off = 0;  // recomputed per pair: cheap next to the scoring work
    for (int64_t j = 0; j < i; ++j) off += int64_t(h) * RowWords(SafeTotalChunks(items[j].view), k);
    const int64_t total = SafeTotalChunks(items[i].view);
    float* row = base + off + hh * RowWords(total, k);
    SelectHead(shape, k, items[i], hh, row, row + total,
               reinterpret_cast<int32_t*>(row + 2 * total));
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

namespace kvshade::kernels {
namespace {

absl::Status CheckOptions(const LayerShape& shape, int k, const SelectOptions& o,
                          absl::Span<const SelectItem> items) {
  (void)shape;
  if (o.candidates < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectEx: candidates must be >= 0, got ", o.candidates));
  }
  if (!(o.top_p >= 0.0f && o.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectEx: top_p must be in [0, 1], got ", o.top_p));
  }
  if (o.min_k < 0 || o.min_k > k) {
    return absl::InvalidArgumentError(
        absl::StrCat("SelectEx: min_k must be in [0, k = ", k, "], got ", o.min_k));
  }
  if (!o.two_stage()) return absl::OkStatus();
  if (o.C < 1) return absl::InvalidArgumentError(absl::StrCat("SelectEx: C must be >= 1, got ", o.C));
  for (size_t i = 0; i < items.size(); ++i) {
    const SessionLayerView& v = items[i].view;
    if (o.signatures) {
      if (!ValidSignatureBits(v.sig_bits) || (int64_t{shape.d} * v.sig_bits) % 32 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SelectEx: items[", i, "].view.sig_bits = ", v.sig_bits,
            " (stage 2 from key signatures needs ", kSignatureBitsText,
            ", with d*bits a multiple of 32)"));
      }
      for (int s = 0; s < v.n_segments; ++s) {
        if (v.segments[s].n_chunks > 0 && v.segments[s].sig == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("SelectEx: items[", i, "].view.segments[", s,
                           "].sig is null (stage 2 scores key signatures)"));
        }
      }
      continue;
    }
    if (v.b == nullptr || v.r < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectEx: items[", i, "].view needs the basis b and r >= 1 for two-stage selection"));
    }
    for (int s = 0; s < v.n_segments; ++s) {
      if (v.segments[s].n_chunks > 0 && v.segments[s].a == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("SelectEx: items[", i, "].view.segments[", s,
                         "].a is null (two-stage selection reconstructs keys)"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

size_t CpuBackend::SelectExWorkspaceBytes(const LayerShape& shape, int k,
                                          const SelectOptions& options,
                                          absl::Span<const SelectItem> items) const {
  int64_t words = 0;
  for (const SelectItem& it : items) {
    words += int64_t(std::max(shape.h, 0)) * RowWordsEx(SafeTotalChunks(it.view), std::max(k, 0),
                                                        std::max(shape.d, 0),
                                                        std::max(shape.g, 0), options);
  }
  return size_t(words) * sizeof(float);
}

absl::Status CpuBackend::SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                                  absl::Span<const SelectItem> items, Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::SelectEx(shape, k, options, items, ws,
                                             SelectExWorkspaceBytes(shape, k, options, items)));
  KVSHADE_RETURN_IF_ERROR(CheckOptions(shape, k, options, items));
  RopeTable table;
  if (options.two_stage() && !options.signatures) {
    KVSHADE_ASSIGN_OR_RETURN(table, MakeRopeTable(options.rope, shape.d));
  }
  const int h = shape.h;
  std::vector<int64_t> offs(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) {
    offs[i + 1] = offs[i] + int64_t(h) * RowWordsEx(SafeTotalChunks(items[i].view), k, shape.d,
                                                    shape.g, options);
  }
  float* base = static_cast<float*>(ws.data);
  const int64_t pairs = int64_t(items.size()) * h;
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t i = p / h;
    const int hh = int(p % h);
    const int64_t total = SafeTotalChunks(items[i].view);
    SelectExHead(shape, k, options, &table, items[i], hh,
                 base + offs[i] + hh * RowWordsEx(total, k, shape.d, shape.g, options));
  }
  return absl::OkStatus();
}

size_t CpuBackend::AssignSlotsWorkspaceBytes(const LayerShape& shape, int k,
                                             absl::Span<const SelectItem> items) const {
  // Per (item, head): the filtered ids [k] and the slot-diff scratch [3k].
  return items.size() * size_t(std::max(shape.h, 0)) * 4 * size_t(std::max(k, 0)) *
         sizeof(int32_t);
}

absl::Status CpuBackend::AssignSlots(const LayerShape& shape, int k,
                                     absl::Span<const SelectItem> items, Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::AssignSlots(shape, k, items, ws,
                                                AssignSlotsWorkspaceBytes(shape, k, items)));
  const int h = shape.h;
  int32_t* base = static_cast<int32_t*>(ws.data);
  const int64_t pairs = int64_t(items.size()) * h;
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    const SelectItem& it = items[p / h];
    const int hh = int(p % h);
    int32_t* ids = base + p * 4 * k;
    const int32_t* in = it.selected + int64_t(hh) * k;
    int n = 0;
    for (int i = 0; i < k; ++i) {
      if (SelectableChunk(it.view, hh, in[i])) ids[n++] = in[i];
    }
    std::sort(ids, ids + n);
    n = int(std::unique(ids, ids + n) - ids);
    SlotDiff(k, ids, n, it, hh, ids + k);
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

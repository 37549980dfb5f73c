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
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"

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

void SelectHead(const LayerShape& shape, int k, const SelectItem& item, int hh, float* s,
                float* tmp, int32_t* aux) {
  const int h = shape.h, g = shape.g, d = shape.d;
  const SessionLayerView& view = item.view;
  const int total = view.total_chunks();
  const float scale = 1.0f / std::sqrt(float(d));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // --- scores: softmax per query head over selectable chunks, max over the group ---
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

  // --- top-k over selectable chunks: (score desc, id asc) ---
  int32_t* cand = reinterpret_cast<int32_t*>(tmp);
  int n_cand = 0;
  for (int c = 0; c < total; ++c) {
    if (!std::isnan(s[c])) cand[n_cand++] = c;
  }
  const int kk = std::min(k, n_cand);
  std::partial_sort(cand, cand + kk, cand + n_cand, [s](int32_t a, int32_t b) {
    return s[a] > s[b] || (s[a] == s[b] && a < b);
  });
  int32_t* selected = item.selected + int64_t(hh) * k;
  for (int i = 0; i < k; ++i) selected[i] = i < kk ? cand[i] : -1;

  // --- slot diff ---
  int32_t* sorted_sel = aux;         // [kk] ascending chunk ids
  int32_t* claimed = aux + k;        // [kk] 1 = hit
  int32_t* free_slots = aux + 2 * k; // ascending
  std::copy(cand, cand + kk, sorted_sel);
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
  for (int i = n_miss; i < n_free; ++i) slots[free_slots[i]] = -1;
  for (int i = n_miss; i < k; ++i) miss_slot[i] = miss_chunk[i] = -1;
  item.miss_count[hh] = n_miss;
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

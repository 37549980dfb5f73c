// CPU decode attention: per query head, softmax(q K^T * scale) V over the union of the
// item's KV blocks (in block order), with an fp32 online softmax in tiles of kTokenTile tokens:
// one rescale of the running sum and accumulator per tile. The output row itself is the
// accumulator, so no workspace is needed. A head with no attended tokens outputs zeros.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

constexpr int kTokenTile = 64;

void AttendHead(const LayerShape& shape, float scale, const AttendItem& item, int qh) {
  const int d = shape.d;
  const int hh = qh / shape.g;
  const bf16* q = item.q + int64_t(qh) * d;
  float* acc = item.out + int64_t(qh) * d;
  std::fill(acc, acc + d, 0.0f);
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
  float logits[kTokenTile];
  for (int bi = 0; bi < item.n_blocks; ++bi) {
    const KvBlock& blk = item.blocks[bi];
    const int64_t len =
        blk.len_per_head != nullptr ? std::max<int64_t>(blk.len_per_head[hh], 0) : blk.len;
    if (len == 0) continue;
    const bf16* kb = blk.k + int64_t(hh) * blk.head_stride;
    const bf16* vb = blk.v + int64_t(hh) * blk.head_stride;
    for (int64_t t0 = 0; t0 < len; t0 += kTokenTile) {
      const int n = int(std::min<int64_t>(kTokenTile, len - t0));
      float tile_max = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < n; ++t) {
        const bf16* kt = kb + (t0 + t) * blk.token_stride;
        float dot = 0.0f;
        for (int c = 0; c < d; ++c) dot += Bf16ToFloat(q[c]) * Bf16ToFloat(kt[c]);
        logits[t] = dot * scale;
        tile_max = std::max(tile_max, logits[t]);
      }
      const float m_new = std::max(m, tile_max);
      if (m_new == -std::numeric_limits<float>::infinity()) continue;  // all weights 0
      const float corr = std::exp(m - m_new);  // 0 on the first tile (m = -inf)
      if (corr != 1.0f) {
        l *= corr;
        for (int c = 0; c < d; ++c) acc[c] *= corr;
      }
      for (int t = 0; t < n; ++t) {
        const float w = std::exp(logits[t] - m_new);
        l += w;
        const bf16* vt = vb + (t0 + t) * blk.token_stride;
        for (int c = 0; c < d; ++c) acc[c] += w * Bf16ToFloat(vt[c]);
      }
      m = m_new;
    }
  }
  if (l > 0.0f) {
    const float inv = 1.0f / l;
    for (int c = 0; c < d; ++c) acc[c] *= inv;
  }
  if (item.lse != nullptr) {
    item.lse[qh] = l > 0.0f ? m + std::log(l) : -std::numeric_limits<float>::infinity();
  }
}

}  // namespace

size_t CpuBackend::AttendWorkspaceBytes(const LayerShape&,
                                        absl::Span<const AttendItem>) const {
  return 0;
}

absl::Status CpuBackend::Attend(const LayerShape& shape, float scale,
                                absl::Span<const AttendItem> items, Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Attend(shape, scale, items, ws, AttendWorkspaceBytes(shape, items)));
  const int heads = shape.query_heads();
  const int64_t pairs = int64_t(items.size()) * heads;
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    AttendHead(shape, scale, items[p / heads], int(p % heads));
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// CPU Reconstruct (docs/ALGORITHM.md decode step 4): for every miss of every head, the chunk's
// keys from the low-rank factors and its values from the host store, fused.
//   keys  : k_hat[t] = sum_i A[local*C + t, i] * B[hh, i, :]   (fp32, i ascending), then
//           ApplyRopeReference at first_position + local*C + t, rounded once to bf16
//   values: the codec's decode of the chunk at
//           values + hh*value_head_stride + local*value_chunk_stride
// Chunk ids are global over the view's segments (segment 0 first). Miss j of head hh goes
// to output row (hh, j), or to row (hh, miss_slot[hh*k + j]) when miss_slot is set. Every
// id and slot is checked before anything is written (InvalidArgument on a chunk id outside
// [0, total_chunks), a slot outside [0, k) or a slot named twice in one head).
// Selection units (ReconstructItem::unit = u, 0 < u < C): a miss id j is unit j, tokens
// t0 + [0, u) of chunk c = (j*u) / C with t0 = (j*u) % C; the loops above run over those u
// tokens only (keys at first_position + c*C + t0 + i, values DecodeValueRows of the same
// encoded chunk) into rows of u tokens; ids are checked against total_chunks * C/u.
// Workspace: d f32 per (item, head), the accumulator row.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_codec_internal.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {

size_t CpuBackend::ReconstructWorkspaceBytes(const LayerShape& shape, int k,
                                             absl::Span<const ReconstructItem> items) const {
  (void)k;
  return items.size() * size_t(std::max(shape.h, 0)) * size_t(std::max(shape.d, 0)) *
         sizeof(float);
}

absl::Status CpuBackend::Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                                     const ValueCodecSpec& codec,
                                     absl::Span<const ReconstructItem> items, Workspace ws,
                                     Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::Reconstruct(shape, C, k, rope, codec, items, ws,
                                                ReconstructWorkspaceBytes(shape, k, items)));
  KVSHADE_ASSIGN_OR_RETURN(const RopeTable table, MakeRopeTable(rope, shape.d));
  KVSHADE_ASSIGN_OR_RETURN(const size_t chunk_bytes, ValueChunkBytes(codec, C, shape.d));
  (void)chunk_bytes;
  const int h = shape.h, d = shape.d;

  // Miss lists live in host memory on this backend: check them up front so that a bad id
  // or slot fails the call without partial writes.
  for (size_t i = 0; i < items.size(); ++i) {
    const ReconstructItem& it = items[i];
    const bool units = it.unit > 0 && it.unit < C;
    const int64_t total = int64_t(it.view.total_chunks()) * (units ? C / it.unit : 1);
    for (int hh = 0; hh < h; ++hh) {
      const int count = it.miss_count[hh];
      if (count < 0 || count > k) {
        return absl::InvalidArgumentError(absl::StrCat("Reconstruct: items[", i, "].miss_count[",
                                                       hh, "] must be in [0, k = ", k,
                                                       "], got ", count));
      }
      for (int j = 0; j < count; ++j) {
        const int32_t c = it.miss_chunk[int64_t(hh) * k + j];
        if (c < 0 || c >= total) {
          return absl::InvalidArgumentError(
              absl::StrCat("Reconstruct: items[", i, "].miss_chunk[", hh, ", ", j,
                           "] must be in [0, ", units ? "total_units = " : "total_chunks = ",
                           total, "), got ", c));
        }
      }
      if (it.miss_slot == nullptr) continue;
      const int32_t* slot = it.miss_slot + int64_t(hh) * k;
      for (int j = 0; j < count; ++j) {
        if (slot[j] < 0 || slot[j] >= k) {
          return absl::InvalidArgumentError(
              absl::StrCat("Reconstruct: items[", i, "].miss_slot[", hh, ", ", j,
                           "] must be in [0, k = ", k, "), got ", slot[j]));
        }
        // Two misses in one slot would overwrite each other (and race on CUDA). Quadratic
        // in count, which is small next to the C*r*d multiply-adds of each miss.
        for (int j2 = 0; j2 < j; ++j2) {
          if (slot[j2] == slot[j]) {
            return absl::InvalidArgumentError(
                absl::StrCat("Reconstruct: items[", i, "].miss_slot[", hh, ", ", j,
                             "] repeats slot ", slot[j], " of miss_slot[", hh, ", ", j2, "]"));
          }
        }
      }
    }
  }

  float* ws_base = static_cast<float*>(ws.data);
  const int64_t pairs = int64_t(items.size()) * h;
#pragma omp parallel for schedule(dynamic, 1) if (pairs > 1)
  for (int64_t p = 0; p < pairs; ++p) {
    const ReconstructItem& it = items[p / h];
    const int hh = int(p % h);
    const SessionLayerView& view = it.view;
    const int r = view.r;
    const bf16* b = view.b + int64_t(hh) * r * d;  // [r, d] of this head
    float* acc = ws_base + p * d;
    // Tokens per miss: u tokens starting at t0 of the chunk (the whole chunk: u = C, t0 = 0).
    const int u = it.unit > 0 && it.unit < C ? it.unit : C;
    for (int j = 0; j < it.miss_count[hh]; ++j) {
      const int64_t id = it.miss_chunk[int64_t(hh) * k + j];
      int local = int(id * u / C);
      const int t0 = int(id * u % C);
      int si = 0;
      while (local >= view.segments[si].n_chunks) local -= view.segments[si++].n_chunks;
      const SegmentView& seg = view.segments[si];
      const int64_t row =
          int64_t(hh) * k + (it.miss_slot != nullptr ? it.miss_slot[int64_t(hh) * k + j] : j);
      bf16* keys = it.keys + row * u * d;
      for (int i = 0; i < u; ++i) {
        const int t = t0 + i;
        const bf16* a = seg.a + (int64_t(local) * C + t) * r;
        std::fill(acc, acc + d, 0.0f);
        for (int x = 0; x < r; ++x) {
          const float ax = Bf16ToFloat(a[x]);
          const bf16* bx = b + int64_t(x) * d;
          for (int c = 0; c < d; ++c) acc[c] += ax * Bf16ToFloat(bx[c]);
        }
        ApplyRopeReference(table, rope.pairing, seg.first_position + int64_t(local) * C + t, acc,
                           d);
        for (int c = 0; c < d; ++c) keys[int64_t(i) * d + c] = FloatToBf16(acc[c]);
      }
      const std::byte* src =
          seg.values + hh * seg.value_head_stride + int64_t(local) * seg.value_chunk_stride;
      cpu_internal::DecodeValueRows(src, C, d, codec, t0, u, it.values + row * u * d);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// CPU ApplyRope: x [n, heads, d] bf16 rotated in place at absolute positions [n] int64.
// Convention: each element is read as fp32, rotated with the table's cos/sin exactly as
// ApplyRopeReference does (angles in double, rounded to float; common/rope_math.h), and
// rounded once to bf16 (nearest even). Dimensions >= rotary_dim are untouched. The result
// is bit-identical to ApplyRopeReference on the bf16->fp32 inputs followed by one rounding.
// OpenMP over tokens; cos/sin are computed once per token for all heads, in tiles of
// kPairTile pairs on the stack (no allocation besides the frequency table).
#include <algorithm>

#include "common/rope_math.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/kernels/status_macros.h"

namespace kvshade::kernels {
namespace {
constexpr int kPairTile = 64;
}

absl::Status CpuBackend::ApplyRope(const RopeSpec& rope, absl::Span<const int64_t> positions,
                                   int heads, int d, absl::Span<bf16> x, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ApplyRope(rope, positions.size(), heads, d, x.size()));
  KVSHADE_ASSIGN_OR_RETURN(RopeTable table, MakeRopeTable(rope, d));
  const int64_t n = static_cast<int64_t>(positions.size());
  const int half = table.rotary_dim / 2;
  const RopePairing pairing = rope.pairing;
  const int64_t* pos = positions.data();
  bf16* data = x.data();

#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float cs[kPairTile], sn[kPairTile];
    bf16* token = data + t * static_cast<int64_t>(heads) * d;
    for (int i0 = 0; i0 < half; i0 += kPairTile) {
      const int i1 = std::min(half, i0 + kPairTile);
      for (int i = i0; i < i1; ++i) rope_math::CosSin(table, pos[t], i, &cs[i - i0], &sn[i - i0]);
      for (int hh = 0; hh < heads; ++hh) {
        bf16* v = token + static_cast<int64_t>(hh) * d;
        for (int i = i0; i < i1; ++i) {
          int a, b;
          rope_math::PairIndex(pairing, table.rotary_dim, i, &a, &b);
          float xa = Bf16ToFloat(v[a]), xb = Bf16ToFloat(v[b]);
          rope_math::Rotate(cs[i - i0], sn[i - i0], &xa, &xb);
          v[a] = FloatToBf16(xa);
          v[b] = FloatToBf16(xb);
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

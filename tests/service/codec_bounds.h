// Per-element error bounds of the value codecs and of the INT2 heavy rows, derived from how
// the kernels encode and decode (kernels/include/kvshade/kernels/codec.h for the layouts,
// kernels/common/codec.cc and kernels/cpu/cpu_codec.cc for the arithmetic). Used by the
// service tests to check what a session hands back against the exact input, tightly enough
// that data of a coarser codec falls outside a finer codec's bound.
//
// bf16: values are stored as given: the decoded value equals the input (bound 0).
//
// fp8 (e4m3, one fp32 scale per chunk of one head, C x d values):
//   scale = amax / 448, y = x / scale, code = e4m3(y) rounded to nearest even, decoded
//   bf16(float(code) * scale). e4m3 has 4 significant bits: for normal |y| >= 2^-6 the
//   rounding error is at most half an ulp, 2^-4 |y|; below, the subnormal spacing is 2^-9,
//   so at most 2^-10. The fp32 divide and multiply add 2^-24 relative each; the final bf16
//   rounding (8 significant bits) adds at most 2^-8 |decoded| <= 2^-8 (1 + 2^-4) |x| +
//   2^-18 scale. In all:
//     |decoded - x| <= (2^-4 + 2^-8 (1 + 2^-4) + 2^-20) |x| + 2^-9 scale.
//
// int4 / int2 (KIVI, one fp16 minimum and scale per group of G values, 2^bits - 1 = N
// levels; values: G consecutive channels of one token; heavy keys: G consecutive rows of one
// channel): with lo, hi the group's extremes,
//   s = (hi - lo) / N (fp32), scale = fp16(s), mn = fp16(lo),
//   q = rint(clamp((x - mn) / scale, 0, N)), decoded bf16(fma(q, scale, mn)).
//   Inside [0, N] the nearest level is at most scale/2 away. Clamped below (x < mn): the
//   error is mn - x <= |mn - lo|. Clamped above: x - (N scale + mn) <= N |s - scale| +
//   |lo - mn|. fp32 rounding of the subtract, divide and fma: below 2^-20 (amax + scale).
//   The bf16 rounding of the result: 2^-8 (amax + scale). In all, per group:
//     |decoded - x| <= max(scale/2, |mn - lo| + N |s - scale|) + (2^-8 + 2^-20)(amax + scale)
//   where amax = max(|lo|, |hi|). With scale ~ (hi - lo) / N this is (hi - lo) / 30 for int4
//   and (hi - lo) / 6 for int2 (plus the small terms), five times apart.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvshade/kernels/codec.h"
#include "kvshade/kernels/types.h"

namespace kvshade::service::testing {

// The bound above for one KIVI group of `n` exact inputs (`bits` = 4 or 2).
inline double KiviGroupBound(const float* x, int n, int bits) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  const int levels = (1 << bits) - 1;
  const float s = (hi - lo) / float(levels);
  const double scale = kernels::Fp16ToFloat(kernels::FloatToFp16(s));
  const double mn = kernels::Fp16ToFloat(kernels::FloatToFp16(lo));
  const double amax = std::max(std::fabs(double(lo)), std::fabs(double(hi)));
  const double clamp_err = std::fabs(mn - lo) + levels * std::fabs(double(s) - scale);
  return std::max(scale / 2, clamp_err) + (std::ldexp(1.0, -8) + std::ldexp(1.0, -20)) * (amax + scale);
}

// Per-element bounds for one value chunk [C, d] (exact inputs `x`) stored in `codec`, with
// KIVI groups of `group` channels.
inline std::vector<double> ValueChunkBounds(kernels::ValueCodec codec, const std::vector<float>& x,
                                            int C, int d, int group = kernels::kDefaultKiviGroup) {
  std::vector<double> b(x.size(), 0.0);
  switch (codec) {
    case kernels::ValueCodec::kBF16:
      break;
    case kernels::ValueCodec::kFP8: {
      float amax = 0.0f;
      for (float v : x) amax = std::max(amax, std::fabs(v));
      const double scale = amax / kernels::kFp8E4M3Max;
      for (size_t i = 0; i < x.size(); ++i) {
        b[i] = (std::ldexp(1.0, -4) + std::ldexp(1.0625, -8) + std::ldexp(1.0, -20)) * std::fabs(x[i]) +
               std::ldexp(scale, -9);
      }
      break;
    }
    case kernels::ValueCodec::kINT4:
    case kernels::ValueCodec::kINT2: {
      const int bits = kernels::CodecBits(codec);
      for (int t = 0; t < C; ++t) {
        for (int g0 = 0; g0 < d; g0 += group) {
          const double gb = KiviGroupBound(&x[size_t(t) * d + g0], group, bits);
          for (int c = g0; c < g0 + group; ++c) b[size_t(t) * d + c] = gb;
        }
      }
      break;
    }
  }
  return b;
}

// The largest |got - want| / bound over the elements: <= 1 means every element is within
// its bound. An element off by anything where the bound is 0 gives infinity.
inline double WorstRatio(const std::vector<float>& got, const std::vector<float>& want,
                         const std::vector<double>& bound) {
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    if (err == 0.0) continue;
    worst = std::max(worst, bound[i] > 0 ? err / bound[i] : std::numeric_limits<double>::infinity());
  }
  return worst;
}

}  // namespace kvshade::service::testing

// The per-pair rotation of RoPE, shared by ApplyRopeReference and the CPU backend's
// ApplyRope (and any host code that rotates keys) so that they produce bit-identical
// results. Private to kernels/; the CUDA backend reproduces the same formula.
//
// For pair i of a table at absolute position pos:
//   angle = double(pos) * double(position_scale) * double(inv_freq[i])   (double)
//   c = float(cos(angle) * double(magnitude)),  s = float(sin(angle) * double(magnitude))
//   y0 = x0*c - x1*s,  y1 = x1*c + x0*s                                    (fp32)
// where (x0, x1) = (x[i], x[i + rotary_dim/2]) for half-split pairing and (x[2i], x[2i+1])
// for interleaved pairing.
#pragma once

#include <cmath>

#include "kvshade/kernels/rope.h"

namespace kvshade::kernels::rope_math {

inline void CosSin(const RopeTable& table, long long pos, int i, float* c, float* s) {
  const double angle = static_cast<double>(pos) * static_cast<double>(table.position_scale) *
                       static_cast<double>(table.inv_freq[i]);
  const double m = static_cast<double>(table.magnitude);
  *c = static_cast<float>(std::cos(angle) * m);
  *s = static_cast<float>(std::sin(angle) * m);
}

// Index of the two elements of pair i in a head vector.
inline void PairIndex(RopePairing pairing, int rotary_dim, int i, int* i0, int* i1) {
  if (pairing == RopePairing::kHalfSplit) {
    *i0 = i;
    *i1 = i + rotary_dim / 2;
  } else {
    *i0 = 2 * i;
    *i1 = 2 * i + 1;
  }
}

inline void Rotate(float c, float s, float* x0, float* x1) {
  const float a = *x0, b = *x1;
  *x0 = a * c - b * s;
  *x1 = b * c + a * s;
}

}  // namespace kvshade::kernels::rope_math

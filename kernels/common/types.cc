// Host-side fp16 and fp8 (e4m3fn) conversions. These are the bit-exact references that
// the CUDA backend matches: FloatToFp16 == __float2half_rn and FloatToFp8E4M3 ==
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3), including NaN encodings
// (fp16 NaN -> 0x7fff, fp8 NaN -> 0x7f, sign dropped), signed zeros and subnormals.
// Integer-only rounding, so the result does not depend on the floating-point environment.
#include "kvshade/kernels/types.h"

#include <cstdint>
#include <cstring>

namespace kvshade::kernels {
namespace {

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// value >> shift, rounded to nearest, ties to even (shift in [1, 63]).
uint64_t ShiftRoundNearestEven(uint64_t value, int shift) {
  const uint64_t q = value >> shift;
  const uint64_t rem = value & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return (rem > half || (rem == half && (q & 1))) ? q + 1 : q;
}

}  // namespace

float Fp16ToFloat(fp16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  const uint32_t exp = (x.bits >> 10) & 0x1fu;
  const uint32_t mant = x.bits & 0x3ffu;
  if (exp == 0x1f) {  // inf or NaN (payload kept, made quiet)
    return BitsFloat(sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
  }
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float mag = float(mant) * 0x1p-24f;
    return sign ? -mag : mag;
  }
  return BitsFloat(sign | ((exp + 112u) << 23) | (mant << 13));
}

fp16 FloatToFp16(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp16{0x7fff};                           // NaN: canonical
  if (a >= 0x477ff000u) return fp16{static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520: inf
  if (a >= 0x38800000u) {  // normal half (>= 2^-14); a carry may reach the next exponent
    const uint64_t rebased = a - 0x38000000u;  // float exponent bias 127 -> half bias 15
    return fp16{static_cast<uint16_t>(sign | ShiftRoundNearestEven(rebased, 13))};
  }
  // Subnormal half: round(|f| * 2^24). |f| = m * 2^(e-150) with the implicit bit in m.
  const uint32_t e = a >> 23;
  if (e == 0) return fp16{sign};  // float subnormals are far below half's range
  const uint64_t m = (a & 0x7fffffu) | 0x800000u;
  const int shift = 126 - int(e);  // >= 14 here
  if (shift >= 26) return fp16{sign};  // below a quarter of the smallest subnormal
  return fp16{static_cast<uint16_t>(sign | ShiftRoundNearestEven(m, shift))};
}

float Fp8E4M3ToFloat(uint8_t x) {
  const bool negative = (x & 0x80u) != 0;
  const uint32_t exp = (x >> 3) & 0xfu;
  const uint32_t mant = x & 0x7u;
  float mag;
  if ((x & 0x7fu) == 0x7fu) {
    mag = BitsFloat(0x7fc00000u);  // the only NaN encodings (no infinities in e4m3fn)
  } else if (exp == 0) {
    mag = float(mant) * 0x1p-9f;  // subnormal: mant * 2^-9
  } else {
    mag = BitsFloat(((exp + 120u) << 23) | (mant << 20));  // bias 7 -> 127
  }
  return negative ? -mag : mag;
}

uint8_t FloatToFp8E4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7f;  // NaN: canonical, sign dropped (as CUDA)
  // Everything at or above 448 (including inf) saturates to +-448; values in (448, 464]
  // would round to 448 anyway and larger ones saturate (SATFINITE).
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);
  if (a >= 0x3c800000u) {  // normal e4m3 (>= 2^-6)
    const uint64_t rebased = a - (uint32_t{120} << 23);  // bias 127 -> 7
    return static_cast<uint8_t>(sign | ShiftRoundNearestEven(rebased, 20));
  }
  // Subnormal e4m3: round(|f| * 2^9); |f| = m * 2^(e-150).
  const uint32_t e = a >> 23;
  if (e == 0) return sign;
  const uint64_t m = (a & 0x7fffffu) | 0x800000u;
  const int shift = 141 - int(e);  // >= 21 here
  if (shift >= 26) return sign;
  return static_cast<uint8_t>(sign | ShiftRoundNearestEven(m, shift));
}

}  // namespace kvshade::kernels

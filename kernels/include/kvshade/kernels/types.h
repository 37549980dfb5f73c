// Element types shared by every kvshade backend: bf16, fp16 and fp8 (e4m3) storage types
// with host-side conversions. The conversions round to nearest even and are the reference
// the CUDA backend matches (CUDA's __float2bfloat16_rn / __float2half_rn / __nv_cvt with
// saturation-to-finite give the same bits).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvshade/base/bf16.h"

namespace kvshade::kernels {

// bfloat16 storage: the upper half of an IEEE-754 binary32. Layout-compatible with
// CUDA's __nv_bfloat16.
struct bf16 {
  uint16_t bits = 0;
};
// IEEE-754 binary16 storage. Layout-compatible with CUDA's __half.
struct fp16 {
  uint16_t bits = 0;
};
static_assert(sizeof(bf16) == 2 && sizeof(fp16) == 2);

inline float Bf16ToFloat(bf16 x) { return base::Bf16BitsToFloat(x.bits); }
inline bf16 FloatToBf16(float f) { return bf16{base::FloatToBf16Bits(f)}; }

inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

float Fp16ToFloat(fp16 x);
fp16 FloatToFp16(float f);  // round to nearest even; overflow -> inf

// fp8 e4m3 (OCP "e4m3fn": no infinities, max finite 448). Encoding saturates to +-448
// (the scale chosen per chunk keeps values in range; saturation only guards rounding).
float Fp8E4M3ToFloat(uint8_t x);
uint8_t FloatToFp8E4M3(float f);
inline constexpr float kFp8E4M3Max = 448.0f;

}  // namespace kvshade::kernels

// bfloat16 as raw 16 bits (the upper half of an IEEE-754 binary32), the one definition of
// its conversions: round to nearest even, NaN kept quiet. The kernels' bf16 type, the wire
// tensors of the client and the daemon's decoders all convert through these.
#pragma once

#include <cstdint>
#include <cstring>

namespace kvshade::base {

inline float Bf16BitsToFloat(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace kvshade::base

// bfloat16 as raw 16 bits (the upper half of an IEEE-754 binary32), the one definition of
// its conversions: round to nearest even, NaN kept quiet. The kernels' bf16 type, the wire
// tensors of the client and the daemon's decoders all convert through these.
#pragma once

#include <cstddef>
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

inline bool Bf16BitsNonFinite(uint16_t bits) { return (bits & 0x7f80u) == 0x7f80u; }

// The index of the first NaN or infinity among n bf16 values (raw bits), or n when every
// value is finite. Blocks of 256 are tested without a branch per value (the compiler
// vectorizes them); only a block with a non-finite value is searched element by element.
inline size_t FirstNonFiniteBf16Bits(const uint16_t* x, size_t n) {
  constexpr size_t kBlock = 256;
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    unsigned bad = 0;
    for (size_t j = 0; j < kBlock; ++j) bad |= Bf16BitsNonFinite(x[i + j]) ? 1u : 0u;
    if (bad != 0) break;
  }
  for (; i < n; ++i) {
    if (Bf16BitsNonFinite(x[i])) return i;
  }
  return n;
}

}  // namespace kvshade::base

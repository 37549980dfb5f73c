// Inline tensors of the kvshade.v1 wire format (row-major, little-endian; see Tensor in
// kvshade.proto) and the bf16 conversions clients need to build them. bf16 values are
// carried as their raw 16 bits (uint16_t) so that the client does not depend on the
// kernels library; the rounding (nearest even) matches kvshade::kernels::FloatToBf16.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::client {

inline uint16_t FloatToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float Bf16BitsToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

std::vector<uint16_t> ToBf16Bits(absl::Span<const float> x);

int64_t NumElements(absl::Span<const int64_t> shape);

// A bf16 tensor of `shape` holding `bits` (prod(shape) elements).
v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const uint16_t> bits);
// Same, rounding fp32 values to bf16.
v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const float> values);
v1::Tensor MakeFp32Tensor(std::vector<int64_t> shape, absl::Span<const float> values);

// Decodes a BF16, FP16 or FP32 tensor to fp32; InvalidArgument when the byte count does
// not match the shape.
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& t);

}  // namespace kvshade::client

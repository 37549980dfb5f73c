// Inline tensors of the kvshade.v1 wire format (row-major, little-endian; see Tensor in
// kvshade.proto) and the bf16 conversions clients need to build them. bf16 values are
// carried as their raw 16 bits (uint16_t); the conversions are kvshade::base's, the same
// ones the kernels use.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvshade/base/bf16.h"
#include "absl/types/span.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::client {

using base::Bf16BitsToFloat;
using base::FloatToBf16Bits;

std::vector<uint16_t> ToBf16Bits(absl::Span<const float> x);

int64_t NumElements(absl::Span<const int64_t> shape);

// A bf16 tensor of `shape` holding `bits` (prod(shape) elements).
v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const uint16_t> bits);
// Same, rounding fp32 values to bf16.
v1::Tensor MakeBf16Tensor(std::vector<int64_t> shape, absl::Span<const float> values);
v1::Tensor MakeFp32Tensor(std::vector<int64_t> shape, absl::Span<const float> values);

// OK when t is a BF16, FP16 or FP32 tensor whose byte count matches its shape, else
// InvalidArgument saying what is wrong.
absl::Status CheckFloatTensor(const v1::Tensor& t);
// Decodes a tensor that CheckFloatTensor accepts to fp32 (its error otherwise).
absl::StatusOr<std::vector<float>> TensorToFloats(const v1::Tensor& t);
// The same for n elements of `dtype` in `data` (a tensor's data without the tensor).
absl::StatusOr<std::vector<float>> BytesToFloats(v1::DType dtype, absl::string_view data, int64_t n);

}  // namespace kvshade::client

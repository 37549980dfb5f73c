// Footprint arithmetic of the shadow profile; formulas documented in footprint.h.
#include "kvshade/kernels/footprint.h"

#include "common/validate.h"
#include "kvshade/base/status_macros.h"
#include "absl/strings/str_cat.h"

namespace kvshade::kernels {
namespace {
constexpr double kBf16Bytes = 2.0;
}

absl::StatusOr<double> ShadowGpuBytesPerToken(const LayerShape& shape, int r, int C,
                                              int signature_bits) {
  KVSHADE_RETURN_IF_ERROR(validate::Shape(shape));
  if (r < 1) return absl::InvalidArgumentError(absl::StrCat("footprint: r must be >= 1, got ", r));
  if (C < 1) return absl::InvalidArgumentError(absl::StrCat("footprint: C must be >= 1, got ", C));
  if (signature_bits != 0 && !ValidSignatureBits(signature_bits)) {
    return absl::InvalidArgumentError(
        absl::StrCat("footprint: signature_bits must be 0 or ", kSignatureBitsText, ", got ",
                     signature_bits));
  }
  const double D = static_cast<double>(shape.D());
  const double sig = signature_bits > 0
                         ? static_cast<double>(shape.h) * SignatureRecordBytes(signature_bits, shape.d)
                         : 0.0;
  return kBf16Bytes * r + kBf16Bytes * D / C + sig;
}

absl::StatusOr<double> FullKvBytesPerToken(const LayerShape& shape) {
  KVSHADE_RETURN_IF_ERROR(validate::Shape(shape));
  return 2.0 * kBf16Bytes * static_cast<double>(shape.D());  // K and V
}

absl::StatusOr<double> ShadowCompressionRatio(const LayerShape& shape, int r, int C,
                                              int signature_bits) {
  KVSHADE_ASSIGN_OR_RETURN(double shadow, ShadowGpuBytesPerToken(shape, r, C, signature_bits));
  KVSHADE_ASSIGN_OR_RETURN(double full, FullKvBytesPerToken(shape));
  return full / shadow;
}

}  // namespace kvshade::kernels

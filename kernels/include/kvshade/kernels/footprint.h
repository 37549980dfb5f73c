// Memory footprint arithmetic of the `shadow` profile (docs/ALGORITHM.md, T6), for capacity
// planning and reporting. Host-side scalar math, no backend needed.
//
// Per token and per layer, with bf16 storage (2 bytes per element) and D = h*d:
//   shadow GPU bytes = 2*r      (the token's row of A [n, r])
//                    + 2*D/C    (its share of one landmark [h, d] per chunk of C tokens)
//                    + h*SignatureRecordBytes(bits, d)   (its key signatures, when the
//                               profile keeps them: h*(d*bits/8 + 4); docs/ALGORITHM.md
//                               "Key signatures")
//   full K+V bytes   = 2*2*D = 4*D
// The basis B [h, r, d] is per layer, not per token, and the static set (sink, outliers,
// heavy chunks, local tail) is a separate, bounded term; neither is included here.
// Example (T6): h = 8, d = 128, r = 160, C = 8 -> 320 + 256 = 576 bytes against 4096:
// 7.1x smaller. With 2-bit signatures: + 8*36 = 288 -> 864 bytes (4.7x); 4-bit: + 544.
#pragma once

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// 2*r + 2*D/C (may be fractional when C does not divide D), plus h*SignatureRecordBytes(
// signature_bits, d) when signature_bits is 2, 4 or 8. InvalidArgument for a bad shape,
// r < 1, C < 1 or signature_bits other than 0, 2, 4, 8.
absl::StatusOr<double> ShadowGpuBytesPerToken(const LayerShape& shape, int r, int C,
                                              int signature_bits = 0);

// 4*D: exact bf16 keys and values of one token of one layer.
absl::StatusOr<double> FullKvBytesPerToken(const LayerShape& shape);

// FullKvBytesPerToken / ShadowGpuBytesPerToken (about 7.1 for T6).
absl::StatusOr<double> ShadowCompressionRatio(const LayerShape& shape, int r, int C,
                                              int signature_bits = 0);

}  // namespace kvshade::kernels

// Argument validation shared by every backend's launchers, so that the CPU and CUDA
// backends reject exactly the same inputs with the same messages. Each function mirrors
// one Backend op (same parameter names) and returns InvalidArgument naming the problem
// (shape, size, range), or OK. Sizes are element counts of the spans.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels::validate {

absl::Status Shape(const LayerShape& shape);

absl::Status ApplyRope(const RopeSpec& rope, size_t positions, int heads, int d, size_t x);

absl::Status Factorize(size_t k, int n, const LayerShape& shape, const FactorizeOptions& options,
                       size_t a, size_t b, size_t eigenvalues, const Workspace& ws,
                       size_t ws_needed);
absl::Status ProjectKeys(size_t k, int n, const LayerShape& shape, size_t b, int r, size_t a,
                         const Workspace& ws, size_t ws_needed);
absl::Status BuildLandmarks(size_t kr, int n, int h, int d, int C, int n_chunks,
                            size_t landmarks, size_t min_cos);
absl::Status EncodeSignatures(size_t kr, size_t landmarks, int h, int d, int C, int n_chunks,
                              int bits, size_t sig_bytes);
absl::Status TopK(size_t scores, size_t mask, int rows, int cols, int k, size_t out,
                  const Workspace& ws, size_t ws_needed);
absl::Status ObservationMass(size_t qobs, size_t q_positions, int w, size_t kr,
                             size_t k_positions, int n, const LayerShape& shape, size_t mass,
                             const Workspace& ws, size_t ws_needed);
absl::Status ChunkSum(size_t mass, int h, int n, int C, int n_chunks, size_t chunk_mass);

absl::Status EncodeValueChunks(size_t v, int n, int h, int d, int C, int n_chunks,
                               const ValueCodecSpec& spec, size_t out_bytes);
absl::Status DecodeValueChunks(size_t encoded_bytes, int m, int C, int d,
                               const ValueCodecSpec& spec, size_t out);
absl::Status Kivi(size_t x, const KiviLayout& layout, size_t codes, size_t scale, size_t mn);

// Checks every item's pointers, segment count, k <= total chunks, r.
absl::Status Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                    const Workspace& ws, size_t ws_needed);
// SelectOptions::unit: 0, C, or a divisor of C below it with two stages (candidates > 0,
// C >= 1). The other options are each backend's to check.
absl::Status SelectUnit(const SelectOptions& options);
// SelectUnit, then Select's checks, with k <= total_chunks * C/unit per item when
// options.units().
absl::Status SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                      absl::Span<const SelectItem> items, const Workspace& ws,
                      size_t ws_needed);
// Select's checks minus the query (AssignSlots does not read q).
absl::Status AssignSlots(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                         const Workspace& ws, size_t ws_needed);
// Also each item's unit (0, C, or a divisor of C below it) and k <= total units with one.
absl::Status Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                         const ValueCodecSpec& codec, absl::Span<const ReconstructItem> items,
                         const Workspace& ws, size_t ws_needed);
// Pointers, n >= 0 and row_bytes a positive multiple of 16 (row indices live in backend
// memory and are not read here).
absl::Status CopyRows(const void* src, const void* dst, size_t row_bytes, int n,
                      const int64_t* src_rows, const int64_t* dst_rows);

// x non-null when count > 0; first holds exactly one value.
absl::Status FirstNonFinite(const void* x, size_t count, size_t first_size);

absl::Status Attend(const LayerShape& shape, float scale, absl::Span<const AttendItem> items,
                    const Workspace& ws, size_t ws_needed);

}  // namespace kvshade::kernels::validate

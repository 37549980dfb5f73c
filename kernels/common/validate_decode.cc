// Argument checks of the codec and decode ops (EncodeValueChunks, DecodeValueChunks, KIVI,
// Select, SelectEx's selection units, Reconstruct, Attend), shared by the CPU and CUDA
// launchers so that both reject the same inputs with the same messages. Only host-readable
// facts are checked here (sizes, counts, pointers, strides, options); contents of backend
// memory are not read.
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels::validate {
namespace {

absl::Status Bad(std::string_view op, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(op), ": ", std::string(what)));
}

// Spans must match their shapes exactly (as in validate_ingest.cc).
absl::Status Exact(std::string_view op, std::string_view name, size_t actual, size_t expected,
                   std::string_view unit = "elements") {
  if (actual == expected) return absl::OkStatus();
  return Bad(op, absl::StrCat(std::string(name), " must have ", expected, " ", std::string(unit),
                              ", got ", actual));
}

absl::Status CheckWorkspace(std::string_view op, const Workspace& ws, size_t needed) {
  if (needed == 0) return absl::OkStatus();
  if (ws.data == nullptr || ws.bytes < needed) {
    return Bad(op, absl::StrCat("workspace has ", ws.data == nullptr ? 0 : ws.bytes,
                                " bytes, expected at least ", needed));
  }
  return absl::OkStatus();
}

absl::Status CheckChunkBytes(std::string_view op, const ValueCodecSpec& spec, int C, int d,
                             size_t* bytes) {
  auto b = ValueChunkBytes(spec, C, d);
  if (!b.ok()) return Bad(op, std::string(b.status().message()));
  *bytes = *b;
  return absl::OkStatus();
}

// Segment count, basis, k range and the per-segment facts shared by Select and
// Reconstruct. `item` names the item in messages. With selection units (units_per_chunk
// = C/unit > 1) k counts units: k <= total_chunks * units_per_chunk.
absl::Status CheckView(std::string_view op, const std::string& item,
                       const SessionLayerView& view, int k, int units_per_chunk = 1) {
  if (view.n_segments < 1 || view.n_segments > kMaxSegments) {
    return Bad(op, absl::StrCat(item, ".view.n_segments must be in [1, ", kMaxSegments,
                                "], got ", view.n_segments));
  }
  if (view.r <= 0) return Bad(op, absl::StrCat(item, ".view.r must be > 0, got ", view.r));
  if (view.b == nullptr) return Bad(op, absl::StrCat(item, ".view.b is null"));
  int64_t total = 0;
  for (int s = 0; s < view.n_segments; ++s) {
    const SegmentView& seg = view.segments[s];
    if (seg.n_chunks < 0) {
      return Bad(op, absl::StrCat(item, ".view.segments[", s, "].n_chunks must be >= 0, got ",
                                  seg.n_chunks));
    }
    if (seg.first_position < 0) {
      return Bad(op, absl::StrCat(item, ".view.segments[", s,
                                  "].first_position must be >= 0, got ", seg.first_position));
    }
    total += seg.n_chunks;
  }
  if (total > INT32_MAX) return Bad(op, absl::StrCat(item, ": total chunks overflow int32"));
  if (units_per_chunk > 1) {
    const int64_t units = total * units_per_chunk;
    if (units > INT32_MAX) return Bad(op, absl::StrCat(item, ": total units overflow int32"));
    if (k < 1 || k > units) {
      return Bad(op, absl::StrCat("k must be in [1, total_units = ", units, "] (",
                                  units_per_chunk, " units per chunk) for ", item, ", got ", k));
    }
    return absl::OkStatus();
  }
  if (k < 1 || k > total) {
    return Bad(op, absl::StrCat("k must be in [1, total_chunks = ", total, "] for ", item,
                                ", got ", k));
  }
  return absl::OkStatus();
}

// A selection unit of `unit` tokens against chunks of C (> 0) tokens: 0 or C means whole
// chunks; otherwise 0 < unit < C and unit divides C. `what` names the field in messages.
absl::Status CheckUnit(std::string_view op, const std::string& what, int unit, int C) {
  if (unit == 0 || unit == C) return absl::OkStatus();
  if (unit < 0 || unit > C || C % unit != 0) {
    return Bad(op, absl::StrCat(what, " must be 0 or C = ", C,
                                " (whole chunks), or a divisor of C below it (units of that "
                                "many tokens), got ",
                                unit));
  }
  return absl::OkStatus();
}

// Select's checks (pointers, view, k, landmarks, workspace); k counts units when
// units_per_chunk > 1.
absl::Status CheckSelect(std::string_view op, const LayerShape& shape, int k,
                         int units_per_chunk, absl::Span<const SelectItem> items,
                         const Workspace& ws, size_t ws_needed) {
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  if (k < 1) return Bad(op, absl::StrCat("k must be >= 1, got ", k));
  for (size_t i = 0; i < items.size(); ++i) {
    const SelectItem& it = items[i];
    const std::string name = absl::StrCat("items[", i, "]");
    if (it.q == nullptr) return Bad(op, absl::StrCat(name, ".q is null"));
    if (it.slots == nullptr) return Bad(op, absl::StrCat(name, ".slots is null"));
    if (it.selected == nullptr) return Bad(op, absl::StrCat(name, ".selected is null"));
    if (it.miss_slot == nullptr) return Bad(op, absl::StrCat(name, ".miss_slot is null"));
    if (it.miss_chunk == nullptr) return Bad(op, absl::StrCat(name, ".miss_chunk is null"));
    if (it.miss_count == nullptr) return Bad(op, absl::StrCat(name, ".miss_count is null"));
    KVSHADE_RETURN_IF_ERROR(CheckView(op, name, it.view, k, units_per_chunk));
    for (int s = 0; s < it.view.n_segments; ++s) {
      if (it.view.segments[s].n_chunks > 0 && it.view.segments[s].landmarks == nullptr) {
        return Bad(op, absl::StrCat(name, ".view.segments[", s, "].landmarks is null"));
      }
    }
  }
  return CheckWorkspace(op, ws, ws_needed);
}

}  // namespace

absl::Status EncodeValueChunks(size_t v, int n, int h, int d, int C, int n_chunks,
                               const ValueCodecSpec& spec, size_t out_bytes) {
  constexpr std::string_view kOp = "EncodeValueChunks";
  if (n < 0) return Bad(kOp, absl::StrCat("n must be >= 0, got ", n));
  if (h <= 0) return Bad(kOp, absl::StrCat("h must be > 0, got ", h));
  if (n_chunks < 0) return Bad(kOp, absl::StrCat("n_chunks must be >= 0, got ", n_chunks));
  size_t chunk_bytes = 0;
  KVSHADE_RETURN_IF_ERROR(CheckChunkBytes(kOp, spec, C, d, &chunk_bytes));
  if (int64_t(n_chunks) * C > n) {
    return Bad(kOp, absl::StrCat("n_chunks * C = ", int64_t(n_chunks) * C,
                                 " exceeds n = ", n));
  }
  KVSHADE_RETURN_IF_ERROR(Exact(kOp, "v [n, h, d]", v, size_t(n) * h * d));
  return Exact(kOp, "out [h, n_chunks, ValueChunkBytes]", out_bytes,
               size_t(h) * n_chunks * chunk_bytes, "bytes");
}

absl::Status DecodeValueChunks(size_t encoded_bytes, int m, int C, int d,
                               const ValueCodecSpec& spec, size_t out) {
  constexpr std::string_view kOp = "DecodeValueChunks";
  if (m < 0) return Bad(kOp, absl::StrCat("m must be >= 0, got ", m));
  size_t chunk_bytes = 0;
  KVSHADE_RETURN_IF_ERROR(CheckChunkBytes(kOp, spec, C, d, &chunk_bytes));
  KVSHADE_RETURN_IF_ERROR(Exact(kOp, "encoded [m, ValueChunkBytes]", encoded_bytes,
                                size_t(m) * chunk_bytes, "bytes"));
  return Exact(kOp, "out [m, C, d]", out, size_t(m) * C * d);
}

absl::Status Kivi(size_t x, const KiviLayout& layout, size_t codes, size_t scale, size_t mn) {
  constexpr std::string_view kOp = "Kivi";
  if (absl::Status st = ValidateKiviLayout(layout); !st.ok()) return Bad(kOp, std::string(st.message()));
  KVSHADE_RETURN_IF_ERROR(Exact(kOp, "x [rows, cols]", x, size_t(layout.rows) * layout.cols));
  KVSHADE_RETURN_IF_ERROR(Exact(kOp, "codes", codes, layout.code_words()));
  KVSHADE_RETURN_IF_ERROR(Exact(kOp, "scale", scale, layout.n_groups()));
  return Exact(kOp, "mn", mn, layout.n_groups());
}

absl::Status Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                    const Workspace& ws, size_t ws_needed) {
  return CheckSelect("Select", shape, k, 1, items, ws, ws_needed);
}

absl::Status SelectUnit(const SelectOptions& options) {
  constexpr std::string_view kOp = "SelectEx";
  const int unit = options.unit;
  if (unit == 0 || unit == options.C) return absl::OkStatus();  // whole chunks
  if (unit < 0) return Bad(kOp, absl::StrCat("unit must be >= 0 (0 = whole chunks), got ", unit));
  if (!options.two_stage() || options.C < 1) {
    return Bad(kOp, absl::StrCat("unit = ", unit,
                                 " needs two-stage selection (candidates > 0 and the chunk "
                                 "size C >= 1), got candidates = ",
                                 options.candidates, ", C = ", options.C));
  }
  return CheckUnit(kOp, "unit", unit, options.C);
}

absl::Status SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                      absl::Span<const SelectItem> items, const Workspace& ws,
                      size_t ws_needed) {
  KVSHADE_RETURN_IF_ERROR(SelectUnit(options));
  // Whole chunks: exactly Select's checks and messages.
  if (!options.units()) return Select(shape, k, items, ws, ws_needed);
  return CheckSelect("SelectEx", shape, k, options.units_per_chunk(), items, ws, ws_needed);
}

absl::Status AssignSlots(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                         const Workspace& ws, size_t ws_needed) {
  constexpr std::string_view kOp = "AssignSlots";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  if (k < 1) return Bad(kOp, absl::StrCat("k must be >= 1, got ", k));
  for (size_t i = 0; i < items.size(); ++i) {
    const SelectItem& it = items[i];
    const std::string name = absl::StrCat("items[", i, "]");
    if (it.slots == nullptr) return Bad(kOp, absl::StrCat(name, ".slots is null"));
    if (it.selected == nullptr) return Bad(kOp, absl::StrCat(name, ".selected is null"));
    if (it.miss_slot == nullptr) return Bad(kOp, absl::StrCat(name, ".miss_slot is null"));
    if (it.miss_chunk == nullptr) return Bad(kOp, absl::StrCat(name, ".miss_chunk is null"));
    if (it.miss_count == nullptr) return Bad(kOp, absl::StrCat(name, ".miss_count is null"));
    KVSHADE_RETURN_IF_ERROR(CheckView(kOp, name, it.view, k));
  }
  return CheckWorkspace(kOp, ws, ws_needed);
}

absl::Status Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                         const ValueCodecSpec& codec, absl::Span<const ReconstructItem> items,
                         const Workspace& ws, size_t ws_needed) {
  constexpr std::string_view kOp = "Reconstruct";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  if (C <= 0) return Bad(kOp, absl::StrCat("C must be > 0, got ", C));
  if (k < 1) return Bad(kOp, absl::StrCat("k must be >= 1, got ", k));
  if (auto table = MakeRopeTable(rope, shape.d); !table.ok()) {
    return Bad(kOp, std::string(table.status().message()));
  }
  size_t chunk_bytes = 0;
  KVSHADE_RETURN_IF_ERROR(CheckChunkBytes(kOp, codec, C, shape.d, &chunk_bytes));
  for (size_t i = 0; i < items.size(); ++i) {
    const ReconstructItem& it = items[i];
    const std::string name = absl::StrCat("items[", i, "]");
    if (it.miss_chunk == nullptr) return Bad(kOp, absl::StrCat(name, ".miss_chunk is null"));
    if (it.miss_count == nullptr) return Bad(kOp, absl::StrCat(name, ".miss_count is null"));
    if (it.keys == nullptr) return Bad(kOp, absl::StrCat(name, ".keys is null"));
    if (it.values == nullptr) return Bad(kOp, absl::StrCat(name, ".values is null"));
    KVSHADE_RETURN_IF_ERROR(CheckUnit(kOp, absl::StrCat(name, ".unit"), it.unit, C));
    const int per_chunk = it.unit > 0 && it.unit < C ? C / it.unit : 1;
    KVSHADE_RETURN_IF_ERROR(CheckView(kOp, name, it.view, k, per_chunk));
    for (int s = 0; s < it.view.n_segments; ++s) {
      const SegmentView& seg = it.view.segments[s];
      if (seg.n_chunks == 0) continue;
      const std::string sname = absl::StrCat(name, ".view.segments[", s, "]");
      if (seg.a == nullptr) return Bad(kOp, absl::StrCat(sname, ".a is null"));
      if (seg.values == nullptr) return Bad(kOp, absl::StrCat(sname, ".values is null"));
      if (seg.value_chunk_stride < int64_t(chunk_bytes)) {
        return Bad(kOp, absl::StrCat(sname, ".value_chunk_stride is ", seg.value_chunk_stride,
                                     " bytes, expected at least ValueChunkBytes = ",
                                     chunk_bytes));
      }
      if (seg.value_head_stride < 0 || (shape.h > 1 && seg.value_head_stride == 0)) {
        return Bad(kOp, absl::StrCat(sname, ".value_head_stride must be > 0, got ",
                                     seg.value_head_stride));
      }
    }
  }
  return CheckWorkspace(kOp, ws, ws_needed);
}

absl::Status Attend(const LayerShape& shape, float scale, absl::Span<const AttendItem> items,
                    const Workspace& ws, size_t ws_needed) {
  constexpr std::string_view kOp = "Attend";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  if (!std::isfinite(scale) || scale <= 0.0f) {
    return Bad(kOp, absl::StrCat("scale must be finite and > 0, got ", scale));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendItem& it = items[i];
    const std::string name = absl::StrCat("items[", i, "]");
    if (it.q == nullptr) return Bad(kOp, absl::StrCat(name, ".q is null"));
    if (it.out == nullptr) return Bad(kOp, absl::StrCat(name, ".out is null"));
    if (it.n_blocks < 1 || it.n_blocks > kMaxKvBlocks) {
      return Bad(kOp, absl::StrCat(name, ".n_blocks must be in [1, ", kMaxKvBlocks, "], got ",
                                   it.n_blocks));
    }
    for (int b = 0; b < it.n_blocks; ++b) {
      const KvBlock& blk = it.blocks[b];
      const std::string bname = absl::StrCat(name, ".blocks[", b, "]");
      if (blk.len < 0) return Bad(kOp, absl::StrCat(bname, ".len must be >= 0, got ", blk.len));
      if (blk.len == 0 && blk.len_per_head == nullptr) continue;  // empty block
      if (blk.k == nullptr || blk.v == nullptr) {
        return Bad(kOp, absl::StrCat(bname, ": k and v must be non-null"));
      }
      if (blk.token_stride < shape.d) {
        return Bad(kOp, absl::StrCat(bname, ".token_stride must be >= d = ", shape.d, ", got ",
                                     blk.token_stride));
      }
      if (blk.head_stride < 0 || (shape.h > 1 && blk.head_stride == 0)) {
        return Bad(kOp, absl::StrCat(bname, ".head_stride must be > 0, got ", blk.head_stride));
      }
    }
  }
  return CheckWorkspace(kOp, ws, ws_needed);
}

absl::Status FirstNonFinite(const void* x, size_t count, size_t first_size) {
  constexpr std::string_view kOp = "FirstNonFinite";
  if (first_size != 1) return Bad(kOp, absl::StrCat("first must hold 1 value, got ", first_size));
  if (count > 0 && x == nullptr) return Bad(kOp, absl::StrCat("x is null with ", count, " values"));
  return absl::OkStatus();
}

absl::Status CopyRows(const void* src, const void* dst, size_t row_bytes, int n,
                      const int64_t* src_rows, const int64_t* dst_rows) {
  constexpr std::string_view kOp = "CopyRows";
  if (n < 0) return Bad(kOp, absl::StrCat("n must be >= 0, got ", n));
  if (row_bytes == 0 || row_bytes % 16 != 0) {
    return Bad(kOp, absl::StrCat("row_bytes must be a positive multiple of 16, got ", row_bytes));
  }
  if (n == 0) return absl::OkStatus();
  if (src == nullptr || dst == nullptr || src_rows == nullptr || dst_rows == nullptr) {
    return Bad(kOp, "src, dst, src_rows and dst_rows must be non-null when n > 0");
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels::validate

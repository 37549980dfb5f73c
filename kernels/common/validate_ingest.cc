// Argument validation of the ingest-side ops (RoPE, factorization, projection, landmarks,
// top-k, observation mass, chunk sums), shared by the CPU and CUDA launchers so that both
// reject exactly the same inputs with the same messages. Only sizes and scalar options are
// checked here (no data is read): span sizes must equal the shapes exactly, and workspaces
// must hold at least `ws_needed` bytes.
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels::validate {
namespace {

absl::Status Invalid(const char* op, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", what));
}

// `name` must be >= lo.
absl::Status AtLeast(const char* op, const char* name, int64_t value, int64_t lo) {
  if (value < lo) return Invalid(op, absl::StrCat(name, " must be >= ", lo, ", got ", value));
  return absl::OkStatus();
}

// A span of `name` must hold exactly `expected` elements (`shape` describes it).
absl::Status SpanSize(const char* op, const char* name, size_t actual, uint64_t expected,
                      const std::string& shape) {
  if (actual != expected) {
    return Invalid(op, absl::StrCat(name, " must have ", expected, " elements (", shape,
                                    "), got ", actual));
  }
  return absl::OkStatus();
}

absl::Status WorkspaceOk(const char* op, const Workspace& ws, size_t ws_needed) {
  if (ws.bytes < ws_needed) {
    return Invalid(op, absl::StrCat("workspace must hold at least ", ws_needed,
                                    " bytes, got ", ws.bytes));
  }
  if (ws_needed > 0 && ws.data == nullptr) {
    return Invalid(op, absl::StrCat("workspace data is null but ", ws_needed,
                                    " bytes are needed"));
  }
  return absl::OkStatus();
}

absl::Status RankOk(const char* op, const char* name, int r, int D) {
  if (r < 8 || r % 8 != 0) {
    return Invalid(op, absl::StrCat(name, " must be a positive multiple of 8, got ", r));
  }
  if (r > D) return Invalid(op, absl::StrCat(name, " must be <= D = ", D, ", got ", r));
  return absl::OkStatus();
}

using u64 = uint64_t;

}  // namespace

absl::Status Shape(const LayerShape& shape) {
  constexpr const char* op = "LayerShape";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "h", shape.h, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "g", shape.g, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "d", shape.d, 1));
  // D = h*d and h*g are ints in the interface; keep products of them far from overflow.
  constexpr int64_t kMax = int64_t{1} << 24;
  if (int64_t{shape.h} * shape.d > kMax) {
    return Invalid(op, absl::StrCat("D = h*d must be <= ", kMax, ", got ",
                                    int64_t{shape.h} * shape.d));
  }
  if (int64_t{shape.h} * shape.g > kMax) {
    return Invalid(op, absl::StrCat("h*g must be <= ", kMax, ", got ",
                                    int64_t{shape.h} * shape.g));
  }
  return absl::OkStatus();
}

absl::Status ApplyRope(const RopeSpec& rope, size_t positions, int heads, int d, size_t x) {
  constexpr const char* op = "ApplyRope";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "heads", heads, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "d", d, 1));
  absl::StatusOr<RopeTable> table = MakeRopeTable(rope, d);
  if (!table.ok()) return Invalid(op, std::string(table.status().message()));
  // positions may be empty (nothing to rotate).
  return SpanSize(op, "x", x, u64(positions) * heads * d,
                  absl::StrCat("[n=", positions, ", heads=", heads, ", d=", d, "]"));
}

absl::Status Factorize(size_t k, int n, const LayerShape& shape, const FactorizeOptions& options,
                       size_t a, size_t b, size_t eigenvalues, const Workspace& ws,
                       size_t ws_needed) {
  constexpr const char* op = "Factorize";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n", n, 1));
  const int D = shape.D();
  KVSHADE_RETURN_IF_ERROR(RankOk(op, "options.rank", options.rank, D));
  if (options.rank > n) {
    return Invalid(op, absl::StrCat("options.rank must be <= n = ", n, ", got ", options.rank));
  }
  if (!(options.energy_target >= 0.0 && options.energy_target <= 1.0)) {
    return Invalid(op, absl::StrCat("options.energy_target must be in [0, 1], got ",
                                    options.energy_target));
  }
  if (options.host_subspace_min_tokens < 0) {
    return Invalid(op, absl::StrCat("options.host_subspace_min_tokens must be >= 0, got ",
                                    options.host_subspace_min_tokens));
  }
  if (options.subspace_iterations < 0 || options.subspace_iterations > 64) {
    return Invalid(op, absl::StrCat("options.subspace_iterations must be in [0, 64], got ",
                                    options.subspace_iterations));
  }
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "k", k, u64(n) * D, absl::StrCat("[n=", n, ", D=", D, "]")));
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "a", a, u64(n) * options.rank,
                                   absl::StrCat("[n=", n, ", rank=", options.rank, "]")));
  KVSHADE_RETURN_IF_ERROR(SpanSize(
      op, "b", b, u64(shape.h) * options.rank * shape.d,
      absl::StrCat("[h=", shape.h, ", rank=", options.rank, ", d=", shape.d, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "eigenvalues", eigenvalues, u64(D), absl::StrCat("[D=", D, "]")));
  return WorkspaceOk(op, ws, ws_needed);
}

absl::Status ProjectKeys(size_t k, int n, const LayerShape& shape, size_t b, int r, size_t a,
                         const Workspace& ws, size_t ws_needed) {
  constexpr const char* op = "ProjectKeys";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n", n, 1));
  const int D = shape.D();
  KVSHADE_RETURN_IF_ERROR(RankOk(op, "r", r, D));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "k", k, u64(n) * D, absl::StrCat("[n=", n, ", D=", D, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "b", b, u64(shape.h) * r * shape.d,
               absl::StrCat("[h=", shape.h, ", r=", r, ", d=", shape.d, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "a", a, u64(n) * r, absl::StrCat("[n=", n, ", r=", r, "]")));
  return WorkspaceOk(op, ws, ws_needed);
}

absl::Status BuildLandmarks(size_t kr, int n, int h, int d, int C, int n_chunks,
                            size_t landmarks, size_t min_cos) {
  constexpr const char* op = "BuildLandmarks";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n", n, 0));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "h", h, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "d", d, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "C", C, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n_chunks", n_chunks, 0));
  if (int64_t{n_chunks} * C > n) {
    return Invalid(op, absl::StrCat("n_chunks*C = ", int64_t{n_chunks} * C,
                                    " must be <= n = ", n));
  }
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "kr", kr, u64(n) * h * d,
                                   absl::StrCat("[n=", n, ", h=", h, ", d=", d, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "landmarks", landmarks, u64(n_chunks) * h * d,
               absl::StrCat("[n_chunks=", n_chunks, ", h=", h, ", d=", d, "]")));
  return SpanSize(op, "min_cos", min_cos, u64(h) * n_chunks,
                  absl::StrCat("[h=", h, ", n_chunks=", n_chunks, "]"));
}

absl::Status EncodeSignatures(size_t kr, size_t landmarks, int h, int d, int C, int n_chunks,
                              int bits, size_t sig_bytes) {
  constexpr const char* op = "EncodeSignatures";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "h", h, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "d", d, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "C", C, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n_chunks", n_chunks, 0));
  if (!ValidSignatureBits(bits)) {
    return Invalid(op, absl::StrCat("bits must be ", kSignatureBitsText, ", got ", bits));
  }
  if ((int64_t{d} * bits) % 32 != 0) {
    return Invalid(op, absl::StrCat("d*bits = ", int64_t{d} * bits, " must be a multiple of 32"));
  }
  const u64 tokens = u64(n_chunks) * C;
  if (kr < tokens * h * d) {
    return Invalid(op, absl::StrCat("kr has ", kr, " elements, needs at least [n_chunks*C=",
                                    tokens, ", h=", h, ", d=", d, "]"));
  }
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "landmarks", landmarks, u64(n_chunks) * h * d,
               absl::StrCat("[n_chunks=", n_chunks, ", h=", h, ", d=", d, "]")));
  return SpanSize(op, "sig", sig_bytes, tokens * h * SignatureRecordBytes(bits, d),
                  absl::StrCat("[n_chunks*C=", tokens, ", h=", h, ", record=",
                               SignatureRecordBytes(bits, d), " bytes]"));
}

absl::Status TopK(size_t scores, size_t mask, int rows, int cols, int k, size_t out,
                  const Workspace& ws, size_t ws_needed) {
  constexpr const char* op = "TopK";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "rows", rows, 0));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "cols", cols, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "k", k, 1));
  if (k > cols) return Invalid(op, absl::StrCat("k must be <= cols = ", cols, ", got ", k));
  const std::string shape = absl::StrCat("[rows=", rows, ", cols=", cols, "]");
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "scores", scores, u64(rows) * cols, shape));
  if (mask != 0) {
    KVSHADE_RETURN_IF_ERROR(SpanSize(op, "mask (or empty)", mask, u64(rows) * cols, shape));
  }
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "out", out, u64(rows) * k,
                                   absl::StrCat("[rows=", rows, ", k=", k, "]")));
  return WorkspaceOk(op, ws, ws_needed);
}

absl::Status ObservationMass(size_t qobs, size_t q_positions, int w, size_t kr,
                             size_t k_positions, int n, const LayerShape& shape, size_t mass,
                             const Workspace& ws, size_t ws_needed) {
  constexpr const char* op = "ObservationMass";
  KVSHADE_RETURN_IF_ERROR(Shape(shape));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "w", w, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n", n, 1));
  const int h = shape.h, hg = shape.query_heads(), d = shape.d;
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "qobs", qobs, u64(w) * hg * d,
                                   absl::StrCat("[w=", w, ", h*g=", hg, ", d=", d, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "q_positions", q_positions, u64(w), absl::StrCat("[w=", w, "]")));
  KVSHADE_RETURN_IF_ERROR(SpanSize(op, "kr", kr, u64(n) * h * d,
                                   absl::StrCat("[n=", n, ", h=", h, ", d=", d, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "k_positions", k_positions, u64(n), absl::StrCat("[n=", n, "]")));
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "mass", mass, u64(h) * n, absl::StrCat("[h=", h, ", n=", n, "]")));
  return WorkspaceOk(op, ws, ws_needed);
}

absl::Status ChunkSum(size_t mass, int h, int n, int C, int n_chunks, size_t chunk_mass) {
  constexpr const char* op = "ChunkSum";
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "h", h, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n", n, 0));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "C", C, 1));
  KVSHADE_RETURN_IF_ERROR(AtLeast(op, "n_chunks", n_chunks, 0));
  if (int64_t{n_chunks} * C > n) {
    return Invalid(op, absl::StrCat("n_chunks*C = ", int64_t{n_chunks} * C,
                                    " must be <= n = ", n));
  }
  KVSHADE_RETURN_IF_ERROR(
      SpanSize(op, "mass", mass, u64(h) * n, absl::StrCat("[h=", h, ", n=", n, "]")));
  return SpanSize(op, "chunk_mass", chunk_mass, u64(h) * n_chunks,
                  absl::StrCat("[h=", h, ", n_chunks=", n_chunks, "]"));
}

}  // namespace kvshade::kernels::validate

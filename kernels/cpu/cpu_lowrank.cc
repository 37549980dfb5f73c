// CPU low-rank key factorization (docs/ALGORITHM.md, shadow step 1) and projection onto an
// existing basis (later turns / generated tokens).
//
// Factorize, for pre-RoPE keys K [n, D] bf16 (D = h*d, one basis per layer):
//   1. G = K^T K [D, D] fp32: rows of K are converted to fp32 in blocks of kRowBlock rows
//      (workspace) and accumulated with cblas_ssyrk (upper triangle, row-major).
//   2. Eigendecomposition of G with LAPACKE_ssyevd_work (work arrays carved from the
//      workspace: 1 + 6D + 2D^2 floats and 3 + 5D ints); eigenvalues reported descending
//      (raw, may be slightly negative from rounding). With options.subspace_iterations > 0
//      only the top rank eigenpairs, by block subspace iteration (common/subspace_host.h,
//      the solver the CUDA backend runs on the host too: cblas_ssymm, shifted CholeskyQR3
//      with ssyrk + spotrf + strsm, Rayleigh-Ritz with ssyevd on P x P); the full solve
//      remains the fallback.
//   3. Rank: options.rank, or with energy_target > 0 the smallest multiple of 8 whose
//      captured energy sum(top r eigenvalues, each clamped at 0) / trace(G) reaches the
//      target, capped at options.rank. trace(G) is the sum of G's diagonal (double).
//      When trace(G) == 0 (K == 0) every rank captures everything: energy 1.
//   4. W [D, r] = the top-r eigenvectors, largest eigenvalue first.
//      SIGN CONVENTION (the CUDA backend must match it): each eigenvector is negated if
//      needed so that its entry of largest absolute value (the lowest index on ties) is
//      positive.
//   5. A [n, r] = K W (cblas_sgemm on fp32 blocks of K, rounded once to bf16);
//      B [h, r, d] with B[hh][i][c] = W[hh*d + c][i], rounded to bf16.
//   Outputs are dense at the chosen rank r: a holds [n, r] and b holds [h, r, d] at the
//   start of spans sized for options.rank; the remaining elements are untouched.
//
// ProjectKeys, for K [n, D] bf16 and an existing basis B [h, r, d] bf16:
//   W = B viewed back as [D, r] (bf16 -> fp32), a = K W rounded to bf16,
//   key_energy = ||K||^2, residual = max(0, 1 - ||K W||^2 / ||K||^2) with the unrounded
//   fp32 product and double accumulation (per row, then rows in order); 0 when K == 0.
//
// Neither op allocates: all scratch comes from the caller's workspace (64-byte aligned
// inside it, so any base address works). Summation orders are fixed, so repeated calls
// are bit-identical for a given OpenBLAS thread count.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <cblas.h>
#include <lapacke.h>

#include "absl/strings/str_cat.h"
#include "common/subspace.h"
#include "common/subspace_host.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_workspace.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

constexpr int kRowBlock = 256;  // rows of K converted to fp32 at a time
using cpu_internal::kWorkspaceAlign;
using cpu_internal::AlignUp;

// Sequential carving of a workspace into aligned arrays.
class Carver {
 public:
  explicit Carver(void* base)
      : base_(reinterpret_cast<std::byte*>(
            AlignUp(reinterpret_cast<uintptr_t>(base)))) {}
  template <typename T>
  T* Take(size_t count) {
    T* p = reinterpret_cast<T*>(base_ + offset_);
    offset_ += AlignUp(count * sizeof(T));
    return p;
  }

 private:
  std::byte* base_;
  size_t offset_ = 0;
};

// Byte counts of the arrays each op carves, in carving order; they include the slack
// for aligning the workspace base.
size_t Bytes(std::initializer_list<size_t> sizes) {
  size_t total = kWorkspaceAlign;  // base alignment slack
  for (size_t s : sizes) total += AlignUp(s);
  return total;
}

size_t SyevdWorkFloats(int D) { return 1 + 6 * size_t(D) + 2 * size_t(D) * D; }
size_t SyevdWorkInts(int D) { return 3 + 5 * size_t(D); }

// Rows [t0, t0 + rows) of k [n, D] bf16 -> out [rows, D] fp32.
void ToFloatRows(const bf16* k, int64_t t0, int rows, int D, float* out) {
#pragma omp parallel for schedule(static)
  for (int t = 0; t < rows; ++t) {
    const bf16* src = k + (t0 + t) * D;
    float* dst = out + int64_t{t} * D;
    for (int c = 0; c < D; ++c) dst[c] = Bf16ToFloat(src[c]);
  }
}

}  // namespace

size_t CpuBackend::FactorizeWorkspaceBytes(int n, const LayerShape& shape,
                                           const FactorizeOptions& options) const {
  if (n < 1 || shape.h < 1 || shape.d < 1) return 0;
  const size_t D = size_t(shape.h) * shape.d;
  const size_t r = size_t(std::clamp(options.rank, 0, int(D)));
  const size_t nb = size_t(std::min(n, kRowBlock));
  const size_t P = size_t(SubspaceColumns(n, int(D), int(r), options.subspace_iterations));
  return Bytes({P > 0 ? SubspaceHostFloats(int(D), int(P)) * sizeof(float) : 0,  // subspace solve
                P > 0 ? SubspaceHostInts(int(P)) * sizeof(int) : 0,
                D * D * sizeof(float),            // G, then its eigenvectors
                D * sizeof(float),                // eigenvalues, ascending
                r * D * sizeof(float),            // W^T [r, D]
                nb * D * sizeof(float),           // fp32 block of K
                nb * r * sizeof(float),           // fp32 block of A
                SyevdWorkFloats(int(D)) * sizeof(float),
                SyevdWorkInts(int(D)) * sizeof(lapack_int)});
}

absl::StatusOr<FactorizeResult> CpuBackend::Factorize(absl::Span<const bf16> k, int n,
                                                      const LayerShape& shape,
                                                      const FactorizeOptions& options,
                                                      absl::Span<bf16> a, absl::Span<bf16> b,
                                                      absl::Span<float> eigenvalues_host,
                                                      Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::Factorize(k.size(), n, shape, options, a.size(), b.size(),
                                              eigenvalues_host.size(), ws,
                                              FactorizeWorkspaceBytes(n, shape, options)));
  const int D = shape.D(), h = shape.h, d = shape.d;
  if (SyevdWorkFloats(D) > size_t(INT32_MAX)) {
    return absl::InvalidArgumentError(
        absl::StrCat("Factorize: D = ", D, " is too large for the LAPACK work array (cpu)"));
  }
  const int nb_max = std::min(n, kRowBlock);
  Carver carve(ws.data);
  const int P = SubspaceColumns(n, D, options.rank, options.subspace_iterations);
  float* sub = carve.Take<float>(P > 0 ? SubspaceHostFloats(D, P) : 0);
  int* isub = carve.Take<int>(P > 0 ? SubspaceHostInts(P) : 0);
  float* G = carve.Take<float>(size_t(D) * D);
  float* evals = carve.Take<float>(D);
  float* wt = carve.Take<float>(size_t(options.rank) * D);
  float* blk = carve.Take<float>(size_t(nb_max) * D);
  float* prod = carve.Take<float>(size_t(nb_max) * options.rank);
  const lapack_int lwork = static_cast<lapack_int>(SyevdWorkFloats(D));
  const lapack_int liwork = static_cast<lapack_int>(SyevdWorkInts(D));
  float* work = carve.Take<float>(lwork);
  lapack_int* iwork = carve.Take<lapack_int>(liwork);

  // 1. Gram matrix, upper triangle (row-major) == lower triangle (column-major).
  for (int64_t t0 = 0; t0 < n; t0 += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, n - t0));
    ToFloatRows(k.data(), t0, rows, D, blk);
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, D, rows, 1.0f, blk, D,
                t0 == 0 ? 0.0f : 1.0f, G, D);
  }
  double trace = 0;
  for (int i = 0; i < D; ++i) trace += G[int64_t{i} * D + i];

  // 2. Eigendecomposition: ascending eigenvalues; eigenvector j is column j (column-major),
  //    i.e. the contiguous D floats at G + j*D.
  const bool subspace =
      P > 0 && SubspaceEigenHost(G, D, P, options.rank, options.subspace_iterations, evals, sub,
                                 isub);
  const bool fallback = P > 0 && !subspace;
  if (!subspace) {
    const lapack_int info = LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'L', D, G, D, evals, work,
                                                lwork, iwork, liwork);
    if (info != 0) {
      return absl::InternalError(absl::StrCat("Factorize: LAPACKE_ssyevd failed, info = ", info));
    }
  }
  for (int i = 0; i < D; ++i) eigenvalues_host[i] = evals[D - 1 - i];

  // 3. Rank and captured energy.
  auto top_energy = [&](int r) {
    double s = 0;
    for (int i = 0; i < r; ++i) s += std::max(0.0, double(evals[D - 1 - i]));
    return s;
  };
  auto captured = [&](int r) {
    return trace > 0 ? std::min(1.0, top_energy(r) / trace) : 1.0;
  };
  int r = options.rank;
  if (options.energy_target > 0) {
    for (int cand = 8; cand <= options.rank; cand += 8) {
      if (captured(cand) >= options.energy_target) {
        r = cand;
        break;
      }
    }
  }

  // 4. W^T [r, D] with the sign convention.
  for (int i = 0; i < r; ++i) {
    const float* v = G + int64_t{D - 1 - i} * D;
    int arg = 0;
    float best = std::fabs(v[0]);
    for (int c = 1; c < D; ++c) {
      if (std::fabs(v[c]) > best) {
        best = std::fabs(v[c]);
        arg = c;
      }
    }
    const float sign = v[arg] < 0 ? -1.0f : 1.0f;
    float* row = wt + int64_t{i} * D;
    for (int c = 0; c < D; ++c) row[c] = sign * v[c];
  }

  // 5. B [h, r, d] and A [n, r].
  for (int hh = 0; hh < h; ++hh) {
    for (int i = 0; i < r; ++i) {
      const float* src = wt + int64_t{i} * D + int64_t{hh} * d;
      bf16* dst = b.data() + (int64_t{hh} * r + i) * d;
      for (int c = 0; c < d; ++c) dst[c] = FloatToBf16(src[c]);
    }
  }
  for (int64_t t0 = 0; t0 < n; t0 += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, n - t0));
    ToFloatRows(k.data(), t0, rows, D, blk);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, r, D, 1.0f, blk, D, wt, D, 0.0f,
                prod, r);
    bf16* dst = a.data() + t0 * r;
    const int64_t count = int64_t{rows} * r;
    for (int64_t e = 0; e < count; ++e) dst[e] = FloatToBf16(prod[e]);
  }

  FactorizeResult result;
  result.rank = r;
  result.captured_energy = captured(r);
  result.subspace_fallback = fallback;
  return result;
}

size_t CpuBackend::ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const {
  if (n < 1 || shape.h < 1 || shape.d < 1 || r < 0) return 0;
  const size_t D = size_t(shape.h) * shape.d;
  const size_t rr = size_t(std::min<int64_t>(r, D));
  const size_t nb = size_t(std::min(n, kRowBlock));
  return Bytes({rr * D * sizeof(float),       // W^T [r, D]
                nb * D * sizeof(float),       // fp32 block of K
                nb * rr * sizeof(float),      // fp32 block of K W
                2 * nb * sizeof(double)});    // per-row energies of the block
}

absl::StatusOr<ProjectionResult> CpuBackend::ProjectKeys(absl::Span<const bf16> k, int n,
                                                         const LayerShape& shape,
                                                         absl::Span<const bf16> b, int r,
                                                         absl::Span<bf16> a, Workspace ws,
                                                         Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ProjectKeys(k.size(), n, shape, b.size(), r, a.size(), ws,
                                                ProjectWorkspaceBytes(n, shape, r)));
  const int D = shape.D(), h = shape.h, d = shape.d;
  const int nb_max = std::min(n, kRowBlock);
  Carver carve(ws.data);
  float* wt = carve.Take<float>(size_t(r) * D);
  float* blk = carve.Take<float>(size_t(nb_max) * D);
  float* prod = carve.Take<float>(size_t(nb_max) * r);
  double* row_key = carve.Take<double>(nb_max);
  double* row_proj = carve.Take<double>(nb_max);

  // W^T [r, D]: W^T[i][hh*d + c] = B[hh][i][c].
  for (int hh = 0; hh < h; ++hh) {
    for (int i = 0; i < r; ++i) {
      const bf16* src = b.data() + (int64_t{hh} * r + i) * d;
      float* dst = wt + int64_t{i} * D + int64_t{hh} * d;
      for (int c = 0; c < d; ++c) dst[c] = Bf16ToFloat(src[c]);
    }
  }

  double key_energy = 0, proj_energy = 0;
  for (int64_t t0 = 0; t0 < n; t0 += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, n - t0));
    ToFloatRows(k.data(), t0, rows, D, blk);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, r, D, 1.0f, blk, D, wt, D, 0.0f,
                prod, r);
#pragma omp parallel for schedule(static)
    for (int t = 0; t < rows; ++t) {
      const float* kr = blk + int64_t{t} * D;
      const float* pr = prod + int64_t{t} * r;
      double ek = 0, ep = 0;
      for (int c = 0; c < D; ++c) ek += double(kr[c]) * kr[c];
      for (int i = 0; i < r; ++i) ep += double(pr[i]) * pr[i];
      row_key[t] = ek;
      row_proj[t] = ep;
      bf16* dst = a.data() + (t0 + t) * r;
      for (int i = 0; i < r; ++i) dst[i] = FloatToBf16(pr[i]);
    }
    for (int t = 0; t < rows; ++t) {
      key_energy += row_key[t];
      proj_energy += row_proj[t];
    }
  }

  ProjectionResult result;
  result.key_energy = key_energy;
  result.residual_energy = key_energy > 0 ? std::max(0.0, 1.0 - proj_energy / key_energy) : 0.0;
  return result;
}

}  // namespace kvshade::kernels

#include "common/subspace_host.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include <cblas.h>
#include <lapacke.h>

#include "common/subspace.h"

namespace kvshade::kernels {

static_assert(sizeof(lapack_int) == sizeof(int), "LAPACKE with 32-bit integers");

namespace {
size_t SyevdFloats(int P) { return 1 + 6 * size_t(P) + 2 * size_t(P) * P; }
size_t SyevdInts(int P) { return 3 + 5 * size_t(P); }
}  // namespace

size_t SubspaceHostFloats(int D, int P) {
  return 2 * size_t(D) * P + size_t(P) * P + size_t(P) + SyevdFloats(P);
}
size_t SubspaceHostInts(int P) { return SyevdInts(P); }

bool SubspaceEigenHost(float* G, int D, int P, int r, int iterations, float* evals,
                       float* scratch, int* iscratch) {
  float* Q = scratch;
  float* Y = Q + size_t(D) * P;
  float* S = Y + size_t(D) * P;
  float* theta = S + size_t(P) * P;
  float* work = theta + P;
  for (int64_t e = 0; e < int64_t{D} * P; ++e) Q[e] = SubspaceStart(uint64_t(e));
  auto orth = [&](float* X) {
    for (int pass = 0; pass < kSubspaceShiftedPasses + 2; ++pass) {
      cblas_ssyrk(CblasColMajor, CblasUpper, CblasTrans, P, D, 1.0f, X, D, 0.0f, S, P);
      if (pass < kSubspaceShiftedPasses) {  // shifted CholeskyQR
        double trace = 0;
        for (int j = 0; j < P; ++j) trace += S[int64_t{j} * P + j];
        const float shift = float(SubspaceShift(D, P) * trace);
        for (int j = 0; j < P; ++j) S[int64_t{j} * P + j] += shift;
      }
      if (LAPACKE_spotrf(LAPACK_COL_MAJOR, 'U', P, S, P) != 0) return false;
      cblas_strsm(CblasColMajor, CblasRight, CblasUpper, CblasNoTrans, CblasNonUnit, D, P, 1.0f,
                  S, P, X, D);
    }
    // Orthonormality check: max |X^T X - I| (NaN fails it).
    cblas_ssyrk(CblasColMajor, CblasUpper, CblasTrans, P, D, 1.0f, X, D, 0.0f, S, P);
    bool orthonormal = true;
    for (int j = 0; j < P; ++j) {
      for (int i = 0; i <= j; ++i) {
        const float dev = std::fabs(S[int64_t{j} * P + i] - (i == j ? 1.0f : 0.0f));
        if (!(dev <= kSubspaceOrthTolerance)) orthonormal = false;
      }
    }
    return orthonormal;
  };
  for (int it = 0; it < iterations; ++it) {
    cblas_ssymm(CblasColMajor, CblasLeft, CblasLower, D, P, 1.0f, G, D, Q, D, 0.0f, Y, D);
    if (!orth(Y)) return false;
    std::swap(Q, Y);
  }
  cblas_ssymm(CblasColMajor, CblasLeft, CblasLower, D, P, 1.0f, G, D, Q, D, 0.0f, Y, D);
  cblas_sgemm(CblasColMajor, CblasTrans, CblasNoTrans, P, P, D, 1.0f, Q, D, Y, D, 0.0f, S, P);
  if (LAPACKE_ssyevd_work(LAPACK_COL_MAJOR, 'V', 'L', P, S, P, theta, work,
                          lapack_int(SyevdFloats(P)), iscratch, lapack_int(SyevdInts(P))) != 0) {
    return false;
  }
  cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, D, r, P, 1.0f, Q, D,
              S + int64_t{P - r} * P, P, 0.0f, G + int64_t{D - r} * D, D);
  for (int i = 0; i < D - r; ++i) evals[i] = 0.0f;
  for (int j = 0; j < r; ++j) evals[D - r + j] = theta[P - r + j];
  return true;
}

}  // namespace kvshade::kernels

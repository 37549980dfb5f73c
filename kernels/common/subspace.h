// Block subspace iteration for the top eigenpairs of the Gram matrix (Factorize with
// FactorizeOptions::subspace_iterations > 0; docs/ALGORITHM.md "Prefill / ingest"). Shared by
// the CPU and CUDA backends so that both start from the same block.
//
//   P  = min(D, rank + kSubspaceOversample) columns; Q0[i, j] = SubspaceStart(j*D + i)
//   q times: Y = G Q, Q = orth(Y)          (shifted CholeskyQR: kSubspaceShiftedPasses
//                                           passes S = Y^T Y + s I = R^T R, Y R^-1 with
//                                           s = SubspaceShift(D, P) trace(Y^T Y), then two
//                                           unshifted ones S = Y^T Y = R^T R, Y R^-1)
//   Rayleigh-Ritz: T = Q^T G Q [P, P], T = U diag(theta) U^T; top-rank Ritz vectors Q U.
// The Ritz values are the eigenvalues the op reports (zeros below the top rank). The shifted
// passes (Fukaya et al., "Shifted Cholesky QR for computing the QR factorization of
// ill-conditioned matrices", 2020) keeps a block whose columns span very different scales
// orthonormalizable in fp32: keys with a steep spectrum (a few strong directions over a
// weak floor) leave Y with a condition number near 1e4, whose Gram matrix plain CholQR
// cannot factor in single precision. When the block is rank deficient even so (fewer
// independent keys than P, e.g. K = 0 or a few keys repeated), Cholesky fails or Q loses orthonormality (max |Q^T Q - I| >
// kSubspaceOrthTolerance): the op then falls back to the full solve
// (FactorizeResult::subspace_fallback), as it does when P would reach D or n < P.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVSHADE_HD __host__ __device__
#else
#define KVSHADE_HD
#endif

namespace kvshade::kernels {

inline constexpr int kSubspaceOversample = 32;
inline constexpr float kSubspaceOrthTolerance = 1e-3f;

// Columns of the iterated block, or 0 when the full solve is used instead.
inline int SubspaceColumns(int n, int D, int rank, int iterations) {
  const int p = rank + kSubspaceOversample;
  return iterations > 0 && p < D && p <= n ? p : 0;
}

// The shifted pass's shift relative to trace(Y^T Y) = ||Y||_F^2: large enough to cover the
// rounding error of the fp32 Gram matrix Y^T Y (about D u ||Y||^2 per entry), small enough
// that the weak directions come out of the pass only ~1/sqrt(shift) times weaker than the
// strong ones. (Fukaya et al. prove stability for 11 (m n + n (n + 1)) u, which at D = 1024
// would be a shift of 5% and leave a steep block about as ill-conditioned as before.)
inline double SubspaceShift(int D, int P) { return 4.0 * (double(D) + P) * 0x1p-24; }
// Each shifted pass divides the block's condition number by about sqrt(shift) / (weakest
// singular value); two bring a steep block (condition ~1e5) within plain CholQR's reach.
inline constexpr int kSubspaceShiftedPasses = 2;

// Element i of the start block: a fixed pseudo-random value in [-1, 1) (splitmix64), exact
// in fp32 (a multiple of 2^-23), identical on every backend.
KVSHADE_HD inline float SubspaceStart(uint64_t i) {
  uint64_t z = i + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return float(int32_t(z >> 40) - (1 << 23)) * (1.0f / float(1 << 23));
}

}  // namespace kvshade::kernels

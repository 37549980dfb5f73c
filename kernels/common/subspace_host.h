// The block subspace iteration of common/subspace.h on the host (OpenBLAS + LAPACKE). The
// CPU backend's Factorize solves with it, and so does the CUDA backend's: its Gram matrix
// comes down to the host for this step, because the step is a chain of small dependent
// solver calls that would hold the GPU for milliseconds per layer while using a few of its
// SMs, time the model's prefill on the same GPU then loses (docs/ALGORITHM.md "Prefill /
// ingest", step 1).
#pragma once

#include <cstddef>

namespace kvshade::kernels {

// Scratch of SubspaceEigenHost for a block of P columns over a D x D matrix: the blocks Q and
// Y [D, P], S [P, P], the Ritz values [P] and the P x P ssyevd's work, in floats; and its
// integer work, in ints.
size_t SubspaceHostFloats(int D, int P);
size_t SubspaceHostInts(int P);

// Top-r eigenpairs of G [D, D] (lower triangle, column-major) by block subspace iteration with
// P columns (common/subspace.h). On success the Ritz vectors are in columns D-r..D-1 of G and
// the Ritz values in evals[D-r..D-1], ascending like ssyevd, zeros below; false (G untouched)
// when the block is rank deficient. `scratch` and `iscratch` hold SubspaceHostFloats(D, P)
// floats and SubspaceHostInts(P) ints. Summation orders are fixed: repeated calls are bit for
// bit the same for a given OpenBLAS thread count.
bool SubspaceEigenHost(float* G, int D, int P, int r, int iterations, float* evals,
                       float* scratch, int* iscratch);

}  // namespace kvshade::kernels

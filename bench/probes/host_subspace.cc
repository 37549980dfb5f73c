// Host time of Factorize's subspace eigensolve (kernels/common/subspace_host.h), the step the
// CUDA backend runs on the host while the GPU is free for a model's prefill (docs/ALGORITHM.md
// "Prefill / ingest", step 1): the Gram matrix of n random keys [n, D], then
// SubspaceEigenHost at P = rank + 32 columns and q iterations, timed over several calls.
// The OpenBLAS thread count is the environment's (OPENBLAS_NUM_THREADS). Build from the
// repository root against a configured build tree and run:
//   g++ -O2 -std=c++17 -Ikernels -Ikernels/include bench/probes/host_subspace.cc \
//     build/kernels/libkvshade_kernels_common.a $(pkg-config --libs openblas lapacke) -o /tmp/host_subspace
//   /tmp/host_subspace [D=1024] [rank=160] [iterations=4] [calls=5]
#include <cblas.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/subspace.h"
#include "common/subspace_host.h"

int main(int argc, char** argv) {
  const int D = argc > 1 ? std::atoi(argv[1]) : 1024;
  const int rank = argc > 2 ? std::atoi(argv[2]) : 160;
  const int iterations = argc > 3 ? std::atoi(argv[3]) : 4;
  const int calls = argc > 4 ? std::atoi(argv[4]) : 5;
  const int n = 4 * D;
  const int P = kvshade::kernels::SubspaceColumns(n, D, rank, iterations);
  if (P == 0) {
    std::fprintf(stderr, "no subspace block for D=%d rank=%d iterations=%d\n", D, rank, iterations);
    return 2;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> k(size_t(n) * D);
  // Keys with a decaying spectrum: column j scaled by (j + 1)^-0.6.
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < D; ++j) k[size_t(t) * D + j] = normal(rng) / std::pow(float(j + 1), 0.6f);
  std::vector<float> gram(size_t(D) * D);
  cblas_ssyrk(CblasColMajor, CblasLower, CblasNoTrans, D, n, 1.0f, k.data(), D, 0.0f, gram.data(), D);
  std::vector<float> g(gram.size()), evals(D);
  std::vector<float> scratch(kvshade::kernels::SubspaceHostFloats(D, P));
  std::vector<int> iscratch(kvshade::kernels::SubspaceHostInts(P));
  for (int c = 0; c < calls; ++c) {
    g = gram;
    const auto t0 = std::chrono::steady_clock::now();
    const bool ok = kvshade::kernels::SubspaceEigenHost(g.data(), D, P, rank, iterations,
                                                        evals.data(), scratch.data(), iscratch.data());
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("D=%d P=%d q=%d: %s in %.2f ms (top eigenvalue %.4g)\n", D, P, iterations,
                ok ? "solved" : "fell back", ms, double(evals[D - 1]));
  }
  return 0;
}

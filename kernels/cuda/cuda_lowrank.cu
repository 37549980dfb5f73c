// Low-rank keys on the CUDA backend (docs/ALGORITHM.md, shadow ingest step 1): Factorize and
// ProjectKeys.
//
// Factorize(K [n, D] bf16):
//   1. Gram G = K^T K [D, D] fp32: cublasGemmEx over row blocks of kGramRowBlock, bf16
//      inputs, fp32 accumulation and output (tensor cores; bf16 x bf16 products are exact
//      in fp32, so the only error is accumulation). A full GEMM rather than a syrk: cuBLAS
//      has no bf16-input syrk, and the 2x flops (275 GFLOP at n = 128K, D = 1024) cost
//      ~0.5 ms on an H200.
//   2. trace(G) in double from the diagonal (before the solver overwrites G).
//   3. cusolverDnSsyevd on G (lower triangle): all D eigenvalues (ascending) and
//      eigenvectors, in place. Or, with options.subspace_iterations > 0, only the top rank
//      eigenpairs by block subspace iteration (common/subspace.h), in one of two places:
//      - on the device (n below options.host_subspace_min_tokens, or that 0): SGEMM with G,
//        shifted CholeskyQR3 with Ssyrk + Spotrf + Strsm, Rayleigh-Ritz with Ssyevd on
//        P x P; failures are flagged on the device and read once. About 5.7 ms per 128K
//        layer, a chain of small dependent calls on a few SMs.
//      - on the host (n >= options.host_subspace_min_tokens > 0; common/subspace_host.h, the
//        CPU backend's solver): G and the trace come down to page-locked host memory, the
//        host solves while the library lock is free, and the Ritz vectors go back up into
//        the columns Ssyevd would fill. A model prefilling on the same GPU then keeps the
//        time slices the device solve would take; the host's time (49-124 ms per layer on
//        an H100 machine's host, against a 128K layer's 365 ms of prefill) is off the GPU.
//      Either way the Ritz vectors land where Ssyevd puts the top eigenvectors, and a
//      rank-deficient block falls back to the full solve on the device (G there is
//      untouched). The host picks the rank (adaptive or fixed) and the captured energy from
//      the eigenvalues and the trace.
//   4. The top r' eigenvectors, sign-normalized like the CPU backend (the entry of largest
//      |.|, lowest index on ties, made positive), become B [h, r', d] bf16 and W^T split
//      into bf16 hi + lo parts (W = hi + lo to ~2^-17 relative).
//   5. A = K W in row tiles: two bf16 GEMMs (hi, then lo with beta = 1) into fp32 staging,
//      then one rounding to bf16. The hi/lo split makes A as accurate as an fp32 product
//      while staying on bf16 tensor cores.
// ProjectKeys(K, B): W^T from B (already bf16, so one GEMM per tile), ||K||^2 and
//   ||K W||^2 from the fp32 product, residual = max(0, 1 - ||K W||^2 / ||K||^2).
//
// Workspace (backend memory; both ops allocate nothing): Gram/eigenvectors D*D f32,
// eigenvalues, solver work (cuSOLVER's own size query), W^T hi/lo rank*D bf16, fp32 staging
// min(n, kRowTile)*rank, deterministic partial sums, and the cuBLAS workspace.
//
// Timing (128K tokens, D = 1024, r = 160, H200, measured): Gram ~0.5 ms, projection ~0.2 ms,
// Ssyevd 10.6-11.7 ms. Ssyevdx for the top 160 only is no faster (11.7 ms: its Ssytrd
// tridiagonal reduction alone takes 8.4 ms); subspace iteration with P = 192 on the GPU took
// 1.8 ms + 0.43 ms per iteration (3.1 ms at 4 iterations, 5.7 ms with the shifted passes).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/subspace.h"
#include "common/subspace_host.h"
#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"

namespace kvshade::kernels {
namespace {

using cuda::CeilDiv;
using cuda::WorkspaceCarver;

constexpr int kRowTile = 32768;       // K rows per projection GEMM: bounds the fp32 staging
constexpr int kGramRowBlock = 16384;  // K rows per Gram GEMM (accuracy; see Factorize)
constexpr int kSumBlocks = 264;    // fixed grid of the energy reductions (2 x 132 SMs)
constexpr int kReduceThreads = 256;

// Workspace of Factorize (and, with gram == 0 and lo == false, of ProjectKeys).
struct LowRankPlan {
  float* gram = nullptr;          // [D, D] f32 column-major; eigenvectors after the solver
  float* evals = nullptr;         // [D] f32 ascending
  int* info = nullptr;            // [1] solver status
  double* trace = nullptr;        // [1]
  float* solver_work = nullptr;   // [lwork] f32
  __nv_bfloat16* wt_hi = nullptr; // [rank, D] bf16: W^T (hi part)
  __nv_bfloat16* wt_lo = nullptr; // [rank, D] bf16: W^T - hi
  float* staging = nullptr;       // [min(n, kRowTile), rank] f32
  double* partial = nullptr;      // [2, kSumBlocks] f64: ||K||^2, ||KW||^2 per block
  void* blas_ws = nullptr;        // kCublasWorkspaceBytes
  // The subspace block when the iteration runs on the device (P = its columns, else 0).
  float* sub_q = nullptr;         // [D, P] f32
  float* sub_y = nullptr;         // [D, P] f32
  float* sub_s = nullptr;         // [P, P] f32 Cholesky factor / Rayleigh quotient
  float* sub_theta = nullptr;     // [P] f32 Ritz values, ascending
  int* sub_fail = nullptr;        // [1] nonzero when a Cholesky or the orthonormality failed
  size_t bytes = 0;
};

LowRankPlan PlanLowRank(void* base, int n, int D, int rank, bool factorize, int lwork, int P = 0) {
  WorkspaceCarver c(base);
  LowRankPlan p;
  if (factorize && P > 0) {
    p.sub_q = c.Take<float>(size_t(D) * P);
    p.sub_y = c.Take<float>(size_t(D) * P);
    p.sub_s = c.Take<float>(size_t(P) * P);
    p.sub_theta = c.Take<float>(P);
    p.sub_fail = c.Take<int>(1);
  }
  if (factorize) {
    p.gram = c.Take<float>(size_t(D) * D);
    p.evals = c.Take<float>(D);
    p.info = c.Take<int>(1);
    p.trace = c.Take<double>(1);
    p.solver_work = c.Take<float>(std::max(lwork, 1));
  }
  p.wt_hi = c.Take<__nv_bfloat16>(size_t(rank) * D);
  if (factorize) p.wt_lo = c.Take<__nv_bfloat16>(size_t(rank) * D);
  p.staging = c.Take<float>(size_t(std::min(n, kRowTile)) * rank);
  p.partial = c.Take<double>(2 * kSumBlocks);
  p.blas_ws = c.Take<std::byte>(cuda::kCublasWorkspaceBytes);
  p.bytes = c.bytes();
  return p;
}

// Shapes for which the size functions can plan; anything else is left to validation.
bool Plannable(int n, const LayerShape& shape, int rank) {
  return n > 0 && shape.h > 0 && shape.d > 0 && rank > 0 &&
         int64_t(shape.h) * shape.d <= (int64_t{1} << 24) && rank <= shape.h * shape.d;
}

// cuSOLVER's work size for Ssyevd on a D x D matrix (0 when the query fails; the op then
// reports the failure itself). The size query reads no matrix data, but the size
// functions have none to pass: a non-null placeholder keeps any null-pointer argument
// check quiet.
int SyevdLwork(cusolverDnHandle_t solver, int D) {
  alignas(16) static float placeholder[4] = {};
  int lwork = 0;
  if (cusolverDnSsyevd_bufferSize(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, D,
                                  placeholder, D, placeholder, &lwork) !=
      CUSOLVER_STATUS_SUCCESS) {
    return 0;
  }
  return lwork;
}

// Solver work size of Factorize: Ssyevd on D x D, and with a subspace block of P columns
// also Spotrf and Ssyevd on P x P (0 when a query fails).
int FactorizeLwork(cusolverDnHandle_t solver, int D, int P) {
  int lwork = SyevdLwork(solver, D);
  if (P > 0 && lwork > 0) {
    alignas(16) static float placeholder[4] = {};
    int lp = 0;
    if (cusolverDnSpotrf_bufferSize(solver, CUBLAS_FILL_MODE_UPPER, P, placeholder, P, &lp) !=
        CUSOLVER_STATUS_SUCCESS) {
      return 0;
    }
    const int ls = SyevdLwork(solver, P);
    if (ls <= 0) return 0;
    lwork = std::max({lwork, lp, ls});
  }
  return lwork;
}

// Host layout of Factorize's subspace solve (page-locked, from the backend's scratch): G
// [D, D] (then the Ritz vectors), the eigenvalues [D], the trace, and the solver's scratch.
struct HostSolvePlan {
  float* gram = nullptr;
  float* evals = nullptr;
  double* trace = nullptr;
  float* scratch = nullptr;
  int* iscratch = nullptr;
  size_t bytes = 0;
};

HostSolvePlan PlanHostSolve(void* base, int D, int P) {
  WorkspaceCarver c(base);
  HostSolvePlan h;
  h.gram = c.Take<float>(size_t(D) * D);
  h.evals = c.Take<float>(D);
  h.trace = c.Take<double>(1);
  h.scratch = c.Take<float>(SubspaceHostFloats(D, P));
  h.iscratch = c.Take<int>(SubspaceHostInts(P));
  h.bytes = c.bytes();
  return h;
}

__device__ __forceinline__ double BlockSumD(double x, double* shared32) {
  x = cuda::WarpSumD(x);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared32[warp] = x;
  __syncthreads();
  x = 0;
  if (warp == 0) {
    const int warps = blockDim.x >> 5;
    x = lane < warps ? shared32[lane] : 0.0;
    x = cuda::WarpSumD(x);
  }
  return x;  // valid in thread 0
}

// trace = sum of diag(G) in double, one block, fixed order (deterministic).
__global__ void TraceKernel(const float* __restrict__ gram, int D, double* __restrict__ trace) {
  __shared__ double s[32];
  double acc = 0;
  for (int j = threadIdx.x; j < D; j += blockDim.x) acc += gram[size_t(j) * D + j];
  acc = BlockSumD(acc, s);
  if (threadIdx.x == 0) *trace = acc;
}

// partial[block] += sum of squares of x [count] bf16 (grid-stride, fixed grid and order).
__global__ void __launch_bounds__(kReduceThreads)
    SumSquaresBf16Kernel(const __nv_bfloat16* __restrict__ x, size_t count,
                         double* __restrict__ partial) {
  __shared__ double s[32];
  double acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // 16-byte vector loads when x allows (a span may start anywhere inside a buffer).
  const size_t groups = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? count / 8 : 0;
  for (size_t g = tid; g < groups; g += stride) {
    float v[8];
    cuda::LoadBf16x8(x + g * 8, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += double(v[i]) * v[i];
  }
  for (size_t i = groups * 8 + tid; i < count; i += stride) {
    float f = __bfloat162float(x[i]);
    acc += double(f) * f;
  }
  acc = BlockSumD(acc, s);
  if (threadIdx.x == 0) partial[blockIdx.x] += acc;
}

// One block per kept eigenvector i in [0, rp): column D-1-i of the (ascending) solver
// output, sign-normalized, written as W^T hi/lo rows and as B [h, rp, d].
__global__ void SelectEigenvectorsKernel(const float* __restrict__ vecs, int D, int d, int rp,
                                         __nv_bfloat16* __restrict__ wt_hi,
                                         __nv_bfloat16* __restrict__ wt_lo,
                                         __nv_bfloat16* __restrict__ b) {
  __shared__ float s_abs[32];
  __shared__ int s_idx[32];
  const int i = blockIdx.x;
  const float* v = vecs + size_t(D - 1 - i) * D;
  float best = -1.0f;
  int best_idx = 0x7fffffff;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    const float a = fabsf(v[j]);
    if (a > best) {  // j increases per thread, so ties keep the lower index
      best = a;
      best_idx = j;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, best_idx, o);
    if (ob > best || (ob == best && oi < best_idx)) {
      best = ob;
      best_idx = oi;
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    s_abs[warp] = best;
    s_idx[warp] = best_idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      if (s_abs[w] > s_abs[0] || (s_abs[w] == s_abs[0] && s_idx[w] < s_idx[0])) {
        s_abs[0] = s_abs[w];
        s_idx[0] = s_idx[w];
      }
    }
  }
  __syncthreads();
  const float sign = (s_idx[0] < D && v[s_idx[0]] < 0.0f) ? -1.0f : 1.0f;
  for (int j = threadIdx.x; j < D; j += blockDim.x) {
    const float w = sign * v[j];
    const __nv_bfloat16 hi = __float2bfloat16_rn(w);
    wt_hi[size_t(i) * D + j] = hi;
    wt_lo[size_t(i) * D + j] = __float2bfloat16_rn(w - __bfloat162float(hi));
    const int hh = j / d, c = j - hh * d;
    b[(size_t(hh) * rp + i) * d + c] = hi;
  }
}

// W^T [r, D] bf16 from the per-head basis b [h, r, d] bf16: wt[i][hh*d + c] = b[hh][i][c].
__global__ void BasisToWtKernel(const __nv_bfloat16* __restrict__ b, int h, int r, int d,
                                __nv_bfloat16* __restrict__ wt) {
  const size_t total = size_t(h) * r * d;
  for (size_t e = size_t(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += size_t(gridDim.x) * blockDim.x) {
    const int c = int(e % d);
    const int i = int((e / d) % r);
    const int hh = int(e / (size_t(d) * r));
    wt[size_t(i) * h * d + size_t(hh) * d + c] = b[e];
  }
}

// a [count] bf16 = staging [count] f32 rounded once; optionally partial[block] += sum of
// squares of the fp32 values. count is a multiple of 4 (r is a multiple of 8).
__global__ void __launch_bounds__(kReduceThreads)
    StoreProjectionKernel(const float* __restrict__ staging, size_t count,
                          __nv_bfloat16* __restrict__ a, double* __restrict__ partial) {
  __shared__ double s[32];
  double acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const bool vec = (reinterpret_cast<uintptr_t>(a) & 7) == 0;  // staging is 256-aligned
  for (size_t q = size_t(blockIdx.x) * blockDim.x + threadIdx.x; q < count / 4; q += stride) {
    const float4 v = reinterpret_cast<const float4*>(staging)[q];
    if (vec) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y);
      __nv_bfloat162 hi = __floats2bfloat162_rn(v.z, v.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo);
      packed.y = *reinterpret_cast<uint32_t*>(&hi);
      reinterpret_cast<uint2*>(a)[q] = packed;
    } else {
      a[4 * q] = __float2bfloat16_rn(v.x);
      a[4 * q + 1] = __float2bfloat16_rn(v.y);
      a[4 * q + 2] = __float2bfloat16_rn(v.z);
      a[4 * q + 3] = __float2bfloat16_rn(v.w);
    }
    acc += double(v.x) * v.x + double(v.y) * v.y + double(v.z) * v.z + double(v.w) * v.w;
  }
  if (partial == nullptr) return;  // uniform across the grid
  acc = BlockSumD(acc, s);
  if (threadIdx.x == 0) partial[blockIdx.x] += acc;
}

// A [n, r] = K [n, D] . W [D, r] in row tiles through fp32 staging; W^T given as hi (and
// optionally lo) bf16 [r, D]. partial (optional) accumulates ||A_fp32||^2.
absl::Status ProjectRows(cublasHandle_t blas, cudaStream_t stream, const __nv_bfloat16* k,
                         int n, int D, const __nv_bfloat16* wt_hi, const __nv_bfloat16* wt_lo,
                         int r, float* staging, __nv_bfloat16* a, double* partial) {
  const float one = 1.0f, zero = 0.0f;
  for (int row0 = 0; row0 < n; row0 += kRowTile) {
    const int rows = std::min(kRowTile, n - row0);
    const __nv_bfloat16* ktile = k + size_t(row0) * D;
    // Column-major view: staging (cm [r, rows], ld r) = (W^T as op_T of cm [D, r]) x
    // (K tile as cm [D, rows]); that is row-major [rows, r] = K_tile W.
    KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
        blas, CUBLAS_OP_T, CUBLAS_OP_N, r, rows, D, &one, wt_hi, CUDA_R_16BF, D, ktile,
        CUDA_R_16BF, D, &zero, staging, CUDA_R_32F, r, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (wt_lo != nullptr) {
      KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(
          blas, CUBLAS_OP_T, CUBLAS_OP_N, r, rows, D, &one, wt_lo, CUDA_R_16BF, D, ktile,
          CUDA_R_16BF, D, &one, staging, CUDA_R_32F, r, CUBLAS_COMPUTE_32F,
          CUBLAS_GEMM_DEFAULT));
    }
    const size_t count = size_t(rows) * r;
    const int blocks = partial != nullptr
                           ? kSumBlocks
                           : int(std::min<size_t>(CeilDiv<size_t>(count / 4, kReduceThreads), 4096));
    StoreProjectionKernel<<<blocks, kReduceThreads, 0, stream>>>(
        staging, count, a + size_t(row0) * r, partial);
    KVSHADE_CUDA_LAUNCH_CHECK();
  }
  return absl::OkStatus();
}

// The subspace iteration on the device (FactorizeOptions::host_subspace_min_tokens not
// reached): the same steps as SubspaceEigenHost, as cuBLAS/cuSOLVER calls and small kernels.
__global__ void SubspaceStartKernel(float* q, int64_t count) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < count;
       i += int64_t(gridDim.x) * blockDim.x) {
    q[i] = SubspaceStart(uint64_t(i));
  }
}

__global__ void AccumulateFailKernel(const int* info, int* fail) {
  if (*info != 0) *fail = 1;
}

// Flags the block as failed when max |S - I| over S's upper triangle exceeds the tolerance
// (NaN included). One block.
__global__ void OrthCheckKernel(const float* S, int P, int* fail) {
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < int64_t(P) * P; e += blockDim.x) {
    const int j = int(e / P), i = int(e % P);
    if (i > j) continue;
    const float dev = fabsf(S[e] - (i == j ? 1.0f : 0.0f));
    if (!(dev <= kSubspaceOrthTolerance)) bad = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0 && bad) *fail = 1;
}

// S [P, P] += factor * trace(S) * I (the shifted CholeskyQR pass; P <= 1024, one block;
// the trace in double, summed in a fixed order).
__global__ void ShiftDiagonalKernel(float* S, int P, float factor) {
  __shared__ double part[1024];
  double t = 0;
  for (int j = threadIdx.x; j < P; j += blockDim.x) t += S[size_t(j) * P + j];
  part[threadIdx.x] = t;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  const float add = float(double(factor) * part[0]);
  for (int j = threadIdx.x; j < P; j += blockDim.x) S[size_t(j) * P + j] += add;
}

// Top-r eigenpairs of G by subspace iteration (common/subspace.h). Returns false, with G
// untouched, when the block was rank deficient; true with the Ritz vectors in columns
// D-r..D-1 of G and the Ritz values in evals[D-r..D-1] (zeros below).
absl::StatusOr<bool> SubspaceEigen(cublasHandle_t blas, cusolverDnHandle_t solver,
                                   cudaStream_t s, int D, int P, int r, int iterations,
                                   const LowRankPlan& p, int lwork) {
  const float one = 1.0f, zero = 0.0f;
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.sub_fail, 0, sizeof(int), s));
  SubspaceStartKernel<<<256, 256, 0, s>>>(p.sub_q, int64_t(D) * P);
  KVSHADE_CUDA_LAUNCH_CHECK();
  float* Q = p.sub_q;
  float* Y = p.sub_y;
  const float shift = float(SubspaceShift(D, P));
  auto orth = [&](float* X) -> absl::Status {
    for (int pass = 0; pass < kSubspaceShiftedPasses + 2; ++pass) {
      KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSsyrk(blas, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_T, P, D,
                                                 &one, X, D, &zero, p.sub_s, P));
      if (pass < kSubspaceShiftedPasses) {  // shifted CholeskyQR
        ShiftDiagonalKernel<<<1, 1024, 0, s>>>(p.sub_s, P, shift);
        KVSHADE_CUDA_LAUNCH_CHECK();
      }
      KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnSpotrf(solver, CUBLAS_FILL_MODE_UPPER, P, p.sub_s,
                                                        P, p.solver_work, lwork, p.info));
      AccumulateFailKernel<<<1, 1, 0, s>>>(p.info, p.sub_fail);
      KVSHADE_CUDA_LAUNCH_CHECK();
      KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasStrsm(blas, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_UPPER,
                                                 CUBLAS_OP_N, CUBLAS_DIAG_NON_UNIT, D, P, &one,
                                                 p.sub_s, P, X, D));
    }
    return absl::OkStatus();
  };
  for (int it = 0; it < iterations; ++it) {
    KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, D, P, D, &one,
                                               p.gram, D, Q, D, &zero, Y, D));
    KVSHADE_RETURN_IF_ERROR(orth(Y));
    std::swap(Q, Y);
  }
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSsyrk(blas, CUBLAS_FILL_MODE_UPPER, CUBLAS_OP_T, P, D, &one,
                                             Q, D, &zero, p.sub_s, P));
  OrthCheckKernel<<<1, 1024, 0, s>>>(p.sub_s, P, p.sub_fail);
  KVSHADE_CUDA_LAUNCH_CHECK();
  // Rayleigh-Ritz.
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, D, P, D, &one, p.gram,
                                             D, Q, D, &zero, Y, D));
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSgemm(blas, CUBLAS_OP_T, CUBLAS_OP_N, P, P, D, &one, Q, D,
                                             Y, D, &zero, p.sub_s, P));
  KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnSsyevd(solver, CUSOLVER_EIG_MODE_VECTOR,
                                                    CUBLAS_FILL_MODE_LOWER, P, p.sub_s, P,
                                                    p.sub_theta, p.solver_work, lwork, p.info));
  AccumulateFailKernel<<<1, 1, 0, s>>>(p.info, p.sub_fail);
  KVSHADE_CUDA_LAUNCH_CHECK();
  int fail = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(&fail, p.sub_fail, sizeof(int), cudaMemcpyDeviceToHost, s));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  if (fail != 0) return false;
  KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, D, r, P, &one, Q, D,
                                             p.sub_s + size_t(P - r) * P, P, &zero,
                                             p.gram + size_t(D - r) * D, D));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.evals, 0, sizeof(float) * (D - r), s));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.evals + (D - r), p.sub_theta + (P - r),
                                               sizeof(float) * r, cudaMemcpyDeviceToDevice, s));
  // p.info was last written by the successful Ssyevd: 0, as the caller expects.
  return true;
}

absl::Status SolveEigen(cusolverDnHandle_t solver, int D, const LowRankPlan& p, int lwork) {
  KVSHADE_CUSOLVER_RETURN_IF_ERROR(cusolverDnSsyevd(solver, CUSOLVER_EIG_MODE_VECTOR,
                                                    CUBLAS_FILL_MODE_LOWER, D, p.gram, D,
                                                    p.evals, p.solver_work, lwork, p.info));
  return absl::OkStatus();
}

// Whether Factorize runs its subspace iteration on the host (FactorizeOptions::
// host_subspace_min_tokens), and the columns of the block it then needs on the device (0
// on the host or without the iteration).
bool SubspaceOnHost(int n, int D, const FactorizeOptions& o) {
  return SubspaceColumns(n, D, o.rank, o.subspace_iterations) > 0 &&
         o.host_subspace_min_tokens > 0 && n >= o.host_subspace_min_tokens;
}
int DeviceSubspaceColumns(int n, int D, const FactorizeOptions& o) {
  return SubspaceOnHost(n, D, o) ? 0 : SubspaceColumns(n, D, o.rank, o.subspace_iterations);
}

}  // namespace

size_t CudaBackend::FactorizeWorkspaceBytes(int n, const LayerShape& shape,
                                            const FactorizeOptions& options) const {
  if (!Plannable(n, shape, options.rank)) return 0;
  const int P = DeviceSubspaceColumns(n, shape.D(), options);
  int lwork = 0;
  {
    std::lock_guard<std::mutex> lock(cuda::LibraryHandleMutex());
    if (cuda::UseDevice(device_).ok()) lwork = FactorizeLwork(cusolver_, shape.D(), P);
  }
  return PlanLowRank(nullptr, n, shape.D(), options.rank, /*factorize=*/true, lwork, P).bytes;
}

absl::StatusOr<Buffer> CudaBackend::TakeHostScratch(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(host_scratch_mu_);
    for (auto it = host_scratch_.begin(); it != host_scratch_.end(); ++it) {
      if (it->bytes() >= bytes) {
        Buffer found = std::move(*it);
        host_scratch_.erase(it);
        return found;
      }
    }
  }
  return AllocateStaging(bytes);
}

void CudaBackend::ReturnHostScratch(Buffer scratch) {
  std::lock_guard<std::mutex> lock(host_scratch_mu_);
  host_scratch_.push_back(std::move(scratch));
}

absl::StatusOr<FactorizeResult> CudaBackend::Factorize(
    absl::Span<const bf16> k, int n, const LayerShape& shape, const FactorizeOptions& options,
    absl::Span<bf16> a, absl::Span<bf16> b, absl::Span<float> eigenvalues_host, Workspace ws,
    Stream stream) {
  const size_t ws_needed = FactorizeWorkspaceBytes(n, shape, options);
  KVSHADE_RETURN_IF_ERROR(validate::Factorize(k.size(), n, shape, options, a.size(), b.size(),
                                              eigenvalues_host.size(), ws, ws_needed));
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const int D = shape.D();
  const cudaStream_t s = cuda::ToCudaStream(stream);
  const int P = SubspaceColumns(n, D, options.rank, options.subspace_iterations);
  const bool on_host = SubspaceOnHost(n, D, options);
  const int P_device = on_host ? 0 : P;

  // The host side of the subspace solve, given back to the backend once the Ritz vectors are
  // up (an early return frees it instead).
  Buffer scratch;
  HostSolvePlan host;
  if (on_host) {
    KVSHADE_ASSIGN_OR_RETURN(scratch, TakeHostScratch(PlanHostSolve(nullptr, D, P).bytes));
    host = PlanHostSolve(scratch.data(), D, P);
  }

  const __nv_bfloat16* kd = cuda::AsNv(k.data());
  const float one = 1.0f, zero = 0.0f;
  int lwork = 0;
  LowRankPlan p;
  bool solved = false;  // on the device: the Ritz vectors are in p.gram's top columns
  {
    cuda::ScopedLibraryStream lib(cublas_, cusolver_);
    lwork = FactorizeLwork(cusolver_, D, P_device);
    if (lwork <= 0) return absl::InternalError("Factorize: cuSOLVER work size query failed");
    p = PlanLowRank(ws.data, n, D, options.rank, /*factorize=*/true, lwork, P_device);
    if (p.bytes > ws.bytes) {  // the solver's size query changed between calls
      return absl::InternalError(absl::StrCat("Factorize: workspace plan needs ", p.bytes,
                                              " bytes, have ", ws.bytes));
    }
    KVSHADE_RETURN_IF_ERROR(lib.Bind(s, p.blas_ws, cuda::kCublasWorkspaceBytes));
    // G (cm [D, D]) = sum over row blocks of (K_blk^T as cm [D, rows]) x (its transpose).
    // Row blocks bound the number of accumulation steps inside one tensor-core GEMM (whose
    // internal fp32 adds need not round to nearest); blocks are summed by the GEMM epilogue
    // (beta = 1) in fixed order.
    for (int row0 = 0; row0 < n; row0 += kGramRowBlock) {
      const int rows = std::min(kGramRowBlock, n - row0);
      const __nv_bfloat16* kblk = kd + size_t(row0) * D;
      const float* beta = row0 == 0 ? &zero : &one;
      KVSHADE_CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, D, D, rows,
                                                  &one, kblk, CUDA_R_16BF, D, kblk, CUDA_R_16BF,
                                                  D, beta, p.gram, CUDA_R_32F, D,
                                                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    TraceKernel<<<1, 1024, 0, s>>>(p.gram, D, p.trace);
    KVSHADE_CUDA_LAUNCH_CHECK();
    if (on_host) {
      KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host.gram, p.gram, sizeof(float) * D * D,
                                                   cudaMemcpyDeviceToHost, s));
      KVSHADE_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(host.trace, p.trace, sizeof(double), cudaMemcpyDeviceToHost, s));
      // Also keeps the library lock until the handles' work is done.
      KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    } else if (P > 0) {
      KVSHADE_ASSIGN_OR_RETURN(solved, SubspaceEigen(cublas_, cusolver_, s, D, P, options.rank,
                                                     options.subspace_iterations, p, lwork));
    }
  }
  // The host solve, with the library lock free for other streams' ops.
  const bool host_solved = on_host && SubspaceEigenHost(host.gram, D, P, options.rank,
                                                        options.subspace_iterations, host.evals,
                                                        host.scratch, host.iscratch);

  cuda::ScopedLibraryStream lib(cublas_, cusolver_);
  KVSHADE_RETURN_IF_ERROR(lib.Bind(s, p.blas_ws, cuda::kCublasWorkspaceBytes));
  std::vector<float> evals(D);
  double trace = 0;
  if (host_solved) {
    // The Ritz vectors go where Ssyevd puts the top eigenvectors: columns D-rank..D-1.
    const size_t at = size_t(D - options.rank) * D;
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(p.gram + at, host.gram + at,
                                                 sizeof(float) * size_t(options.rank) * D,
                                                 cudaMemcpyHostToDevice, s));
    std::copy(host.evals, host.evals + D, evals.begin());
    trace = *host.trace;
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));  // the copy has read the scratch
  }
  if (on_host) ReturnHostScratch(std::move(scratch));
  if (!host_solved) {
    if (!solved) KVSHADE_RETURN_IF_ERROR(SolveEigen(cusolver_, D, p, lwork));
    int info = 0;
    KVSHADE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(evals.data(), p.evals, sizeof(float) * D, cudaMemcpyDeviceToHost, s));
    KVSHADE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&info, p.info, sizeof(int), cudaMemcpyDeviceToHost, s));
    KVSHADE_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(&trace, p.trace, sizeof(double), cudaMemcpyDeviceToHost, s));
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
    if (info != 0) {
      return absl::InternalError(absl::StrCat(
          "Factorize: cusolverDnSsyevd info = ", info,
          info > 0 ? " (eigensolver did not converge)" : " (bad parameter)"));
    }
  }
  for (int i = 0; i < D; ++i) eigenvalues_host[i] = evals[D - 1 - i];

  // Rank and captured energy on the host (double). A zero K (trace 0) captures everything.
  // Same rule as the CPU backend: eigenvalues clamped at 0, the ratio capped at 1.
  auto captured = [&](int r) {
    double top = 0;
    for (int i = 0; i < r; ++i) top += std::max(0.0, double(eigenvalues_host[i]));
    return trace > 0 ? std::min(1.0, top / trace) : 1.0;
  };
  int rp = options.rank;
  if (options.energy_target > 0) {
    for (int r = 8; r <= options.rank; r += 8) {
      if (captured(r) >= options.energy_target) {
        rp = r;
        break;
      }
    }
  }
  FactorizeResult result;
  result.rank = rp;
  result.captured_energy = captured(rp);
  result.subspace_fallback = P > 0 && !solved;

  SelectEigenvectorsKernel<<<rp, 256, 0, s>>>(p.gram, D, shape.d, rp, p.wt_hi, p.wt_lo,
                                              cuda::AsNv(b.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  KVSHADE_RETURN_IF_ERROR(ProjectRows(cublas_, s, kd, n, D, p.wt_hi, p.wt_lo, rp, p.staging,
                                      cuda::AsNv(a.data()), /*partial=*/nullptr));
  // Synchronous op: also keeps the library lock until the handles' work is done.
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  return result;
}

size_t CudaBackend::ProjectWorkspaceBytes(int n, const LayerShape& shape, int r) const {
  if (!Plannable(n, shape, r)) return 0;
  return PlanLowRank(nullptr, n, shape.D(), r, /*factorize=*/false, 0).bytes;
}

absl::StatusOr<ProjectionResult> CudaBackend::ProjectKeys(absl::Span<const bf16> k, int n,
                                                          const LayerShape& shape,
                                                          absl::Span<const bf16> b, int r,
                                                          absl::Span<bf16> a, Workspace ws,
                                                          Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ProjectKeys(k.size(), n, shape, b.size(), r, a.size(), ws,
                                                ProjectWorkspaceBytes(n, shape, r)));
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const int D = shape.D();
  const cudaStream_t s = cuda::ToCudaStream(stream);
  const LowRankPlan p = PlanLowRank(ws.data, n, D, r, /*factorize=*/false, 0);
  if (p.bytes > ws.bytes) {
    return absl::InternalError(absl::StrCat("ProjectKeys: workspace plan needs ", p.bytes,
                                            " bytes, have ", ws.bytes));
  }

  cuda::ScopedLibraryStream lib(cublas_, /*solver=*/nullptr);
  KVSHADE_RETURN_IF_ERROR(lib.Bind(s, p.blas_ws, cuda::kCublasWorkspaceBytes));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(p.partial, 0, sizeof(double) * 2 * kSumBlocks, s));

  const __nv_bfloat16* kd = cuda::AsNv(k.data());
  SumSquaresBf16Kernel<<<kSumBlocks, kReduceThreads, 0, s>>>(kd, size_t(n) * D, p.partial);
  KVSHADE_CUDA_LAUNCH_CHECK();
  const size_t basis = size_t(shape.h) * r * shape.d;
  BasisToWtKernel<<<int(std::min<size_t>(CeilDiv<size_t>(basis, 256), 1024)), 256, 0, s>>>(
      cuda::AsNv(b.data()), shape.h, r, shape.d, p.wt_hi);
  KVSHADE_CUDA_LAUNCH_CHECK();
  KVSHADE_RETURN_IF_ERROR(ProjectRows(cublas_, s, kd, n, D, p.wt_hi, /*wt_lo=*/nullptr, r,
                                      p.staging, cuda::AsNv(a.data()),
                                      p.partial + kSumBlocks));

  std::vector<double> partial(2 * kSumBlocks);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(partial.data(), p.partial,
                                               sizeof(double) * partial.size(),
                                               cudaMemcpyDeviceToHost, s));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(s));
  double key = 0, projected = 0;
  for (int i = 0; i < kSumBlocks; ++i) key += partial[i];
  for (int i = 0; i < kSumBlocks; ++i) projected += partial[kSumBlocks + i];
  ProjectionResult result;
  result.key_energy = key;
  result.residual_energy = key > 0 ? std::max(0.0, 1.0 - projected / key) : 0.0;
  return result;
}

}  // namespace kvshade::kernels

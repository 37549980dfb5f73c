// BuildLandmarks on the CUDA backend (docs/ALGORITHM.md, shadow steps 4-5), with the CPU
// backend's arithmetic (cpu_landmarks.cc):
//   mean      = fp32 sum of the chunk's C keys in token order, divided by C (fp32)
//   landmarks [j, hh, :] = mean rounded once to bf16
//   min_cos   [hh, j]    = min over the chunk's tokens of cos(mean, key) against the fp32
//                          mean, dot products and norms in double, clamped to [-1, 1];
//                          a zero vector has cosine 1 with a zero vector, 0 otherwise.
// Only the order of the double channel sums differs from the CPU (lanes, then a warp
// tree), so min_cos agrees to ~1 float ulp and landmarks bit for bit.
// One warp per (chunk, head); the fp32 mean lives in shared memory (d floats per warp),
// so any d up to the device's shared-memory limit works. Memory-bound: n*h*d bf16 read
// once from DRAM (the cosine pass re-reads the chunk from L1/L2).
#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"

namespace kvshade::kernels {
namespace {

//   kr        : [n, h, d] bf16, device (tokens >= n_chunks*C unused)
//   landmarks : [n_chunks, h, d] bf16 out
//   min_cos   : [h, n_chunks] f32 out
// Dynamic shared memory: [warps_per_block, d] f32.
__global__ void LandmarksKernel(const __nv_bfloat16* __restrict__ kr, int h, int d, int C,
                                int n_chunks, __nv_bfloat16* __restrict__ landmarks,
                                float* __restrict__ min_cos) {
  extern __shared__ float mean_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warps_per_block = blockDim.x >> 5;
  const long long job = static_cast<long long>(blockIdx.x) * warps_per_block + warp;
  if (job >= static_cast<long long>(n_chunks) * h) return;  // no block-wide sync below
  const long long j = job / h;
  const int hh = static_cast<int>(job % h);
  const long long token_stride = static_cast<long long>(h) * d;
  const __nv_bfloat16* first = kr + j * C * token_stride + static_cast<long long>(hh) * d;
  __nv_bfloat16* lm = landmarks + j * token_stride + static_cast<long long>(hh) * d;
  float* mean = mean_smem + static_cast<size_t>(warp) * d;

  double mean_sq = 0;
  for (int c = lane; c < d; c += 32) {
    float s = 0.0f;
    for (int t = 0; t < C; ++t) s += __bfloat162float(first[t * token_stride + c]);
    s = __fdiv_rn(s, static_cast<float>(C));
    mean[c] = s;
    lm[c] = __float2bfloat16_rn(s);
    mean_sq += double(s) * s;
  }
  mean_sq = cuda::WarpSumD(mean_sq);
  __syncwarp();

  float worst = 1.0f;
  for (int t = 0; t < C; ++t) {
    const __nv_bfloat16* key = first + t * token_stride;
    double dot = 0, kk = 0;
    for (int c = lane; c < d; c += 32) {
      const double x = __bfloat162float(key[c]);
      dot += double(mean[c]) * x;
      kk += x * x;
    }
    dot = cuda::WarpSumD(dot);
    kk = cuda::WarpSumD(kk);
    float cosine;
    if (mean_sq == 0 && kk == 0) {
      cosine = 1.0f;
    } else if (mean_sq == 0 || kk == 0) {
      cosine = 0.0f;
    } else {
      cosine = static_cast<float>(fmin(fmax(dot / sqrt(mean_sq * kk), -1.0), 1.0));
    }
    worst = fminf(worst, cosine);
  }
  if (lane == 0) min_cos[static_cast<long long>(hh) * n_chunks + j] = worst;
}

// Key signatures (backend.h; the CPU reference is codec.cc SignatureEncodeReference): one
// warp per (token, head), 8 per block. The residual's max |r| is a warp max (order does
// not change a max), the divisions and the rounding are IEEE round-to-nearest like the
// CPU's, so the records agree byte for byte. Lane w < d*bits/32 packs word w.
//   kr [tokens.., h, d], landmarks [n_chunks, h, d] bf16; sig [tokens, h, rec] bytes out.
__global__ void SignatureKernel(const __nv_bfloat16* __restrict__ kr,
                                const __nv_bfloat16* __restrict__ landmarks, int h, int d, int C,
                                long long jobs, int bits, int rec, uint8_t* __restrict__ sig) {
  const long long job = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (job >= jobs) return;
  const long long t = job / h;
  const int hh = static_cast<int>(job % h);
  const __nv_bfloat16* key = kr + job * d;
  const __nv_bfloat16* lm = landmarks + ((t / C) * h + hh) * d;
  float amax = 0.0f;
  for (int i = lane; i < d; i += 32) {
    amax = fmaxf(amax, fabsf(__fsub_rn(__bfloat162float(key[i]), __bfloat162float(lm[i]))));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int levels = (1 << bits) - 1;
  const float half = static_cast<float>(levels) / 2.0f;
  float scale = __fdiv_rn(amax, half);
  if (!(scale > 0.0f) || !isfinite(scale)) scale = 0.0f;
  const int per_word = 32 / bits;
  const int n_words = d / per_word;
  uint8_t* out = sig + job * rec;
  for (int w = lane; w < n_words; w += 32) {
    uint32_t word = 0;
    for (int j = 0; j < per_word && scale != 0.0f; ++j) {
      const int i = w * per_word + j;
      float v = __fadd_rn(
          __fdiv_rn(__fsub_rn(__bfloat162float(key[i]), __bfloat162float(lm[i])), scale), half);
      v = v > 0.0f ? v : 0.0f;
      v = v < static_cast<float>(levels) ? v : static_cast<float>(levels);
      word |= static_cast<uint32_t>(rintf(v)) << (bits * j);
    }
    reinterpret_cast<uint32_t*>(out)[w] = word;
  }
  if (lane == 0) *reinterpret_cast<float*>(out + n_words * 4) = scale;
}

}  // namespace

absl::Status CudaBackend::BuildLandmarks(absl::Span<const bf16> kr, int n, int h, int d, int C,
                                         int n_chunks, absl::Span<bf16> landmarks,
                                         absl::Span<float> min_cos, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::BuildLandmarks(kr.size(), n, h, d, C, n_chunks, landmarks.size(), min_cos.size()));
  if (n_chunks == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));

  // Up to 8 warps per block while their means fit the default 48 KB; beyond that one warp
  // with the dynamic limit raised to what the device allows.
  const size_t mean_bytes = sizeof(float) * size_t(d);
  int warps = static_cast<int>(std::clamp<size_t>((48 << 10) / mean_bytes, 1, 8));
  const size_t smem = mean_bytes * warps;
  if (smem > (48 << 10)) {
    int max_optin = 0;
    KVSHADE_CUDA_RETURN_IF_ERROR(
        cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
    if (smem > size_t(max_optin)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BuildLandmarks: d = ", d, " needs ", smem,
          " bytes of shared memory per warp; the CUDA backend supports at most ", max_optin));
    }
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
        LandmarksKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  const long long jobs = static_cast<long long>(n_chunks) * h;
  const long long blocks = cuda::CeilDiv<long long>(jobs, warps);
  if (blocks > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("BuildLandmarks: n_chunks*h = ", jobs, " exceeds the CUDA grid limit"));
  }
  LandmarksKernel<<<static_cast<unsigned>(blocks), 32 * warps, smem,
                    cuda::ToCudaStream(stream)>>>(cuda::AsNv(kr.data()), h, d, C, n_chunks,
                                                  cuda::AsNv(landmarks.data()), min_cos.data());
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

absl::Status CudaBackend::EncodeSignatures(absl::Span<const bf16> kr,
                                           absl::Span<const bf16> landmarks, int h, int d, int C,
                                           int n_chunks, int bits, absl::Span<std::byte> sig,
                                           Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::EncodeSignatures(kr.size(), landmarks.size(), h, d, C,
                                                     n_chunks, bits, sig.size()));
  if (n_chunks == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const long long jobs = static_cast<long long>(n_chunks) * C * h;
  const long long blocks = cuda::CeilDiv<long long>(jobs, 8);
  if (blocks > 0x7fffffffLL) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeSignatures: n_chunks*C*h = ", jobs, " exceeds the CUDA grid limit"));
  }
  SignatureKernel<<<static_cast<unsigned>(blocks), 256, 0, cuda::ToCudaStream(stream)>>>(
      cuda::AsNv(kr.data()), cuda::AsNv(landmarks.data()), h, d, C, jobs, bits,
      static_cast<int>(SignatureRecordBytes(bits, d)), reinterpret_cast<uint8_t*>(sig.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

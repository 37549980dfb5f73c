// CUDA value codecs (codec.h layouts): EncodeValueChunks / DecodeValueChunks for bf16, fp8
// e4m3 (per-chunk fp32 scale) and KIVI int4/int2 (per-token groups), and KiviQuantize /
// KiviDequantize on either axis. Bit-identical to the CPU backend (cpu_codec.cc,
// KiviQuantizeGroupReference): every rounding step is an explicit IEEE round-to-nearest
// intrinsic so that no compiler contraction or fast-math flag can change a code:
//   fp8  : scale = max|x| / 448, code = cvt_e4m3_satfinite(x / scale), scale 0 -> codes 0
//   kivi : mn_h = fp16(min), scale_h = fp16((max - min) / (2^bits - 1)),
//          q = rint(clamp((x - mn_h) / scale_h, 0, 2^bits - 1)), scale_h 0 -> q 0
//   decode: bf16(float(code) * scale), bf16(fmaf(q, scale_h, mn_h))
// min/max follow std::min/std::max (first operand kept on ties, so -0 vs +0 agree too).
#include <algorithm>
#include <cstdint>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_decode_common.cuh"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

using cuda::DevCodec;

constexpr int kCodecThreads = 128;
// Chunks staged per block in DecodeValueChunks (their loads are in flight together).
constexpr int kDecodeChunksPerBlock = 4;

__device__ __forceinline__ void StoreU32(uint8_t* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
  } else {
    p[0] = uint8_t(v);
    p[1] = uint8_t(v >> 8);
    p[2] = uint8_t(v >> 16);
    p[3] = uint8_t(v >> 24);
  }
}
__device__ __forceinline__ void StoreU16(uint8_t* p, uint16_t v) {
  p[0] = uint8_t(v);
  p[1] = uint8_t(v >> 8);
}

// One KIVI group of G values x[i*stride] (docs/ALGORITHM.md; KiviQuantizeGroupReference):
// words[G*bits/32] packed least significant first, scale and mn as fp16 bits.
__device__ void QuantizeGroup(const __nv_bfloat16* __restrict__ x, long long stride, int G,
                              int bits, uint8_t* words, uint16_t* scale_bits, uint16_t* mn_bits) {
  float lo = __bfloat162float(x[0]), hi = lo;
  for (int i = 1; i < G; ++i) {
    const float v = __bfloat162float(x[i * stride]);
    lo = v < lo ? v : lo;  // std::min(lo, v)
    hi = hi < v ? v : hi;  // std::max(hi, v)
  }
  const int levels = (1 << bits) - 1;
  const float flevels = static_cast<float>(levels);
  const __half mn_h = __float2half_rn(lo);
  const __half scale_h = __float2half_rn(__fdiv_rn(__fsub_rn(hi, lo), flevels));
  *mn_bits = __half_as_ushort(mn_h);
  *scale_bits = __half_as_ushort(scale_h);
  const float mn_f = __half2float(mn_h);
  const float scale_f = __half2float(scale_h);
  const int per_word = 32 / bits;
  for (int w = 0; w < G / per_word; ++w) {
    uint32_t word = 0;
    for (int j = 0; j < per_word; ++j) {
      uint32_t q = 0;
      if (scale_f != 0.0f) {
        const float xv = __bfloat162float(x[(w * per_word + j) * stride]);
        float v = __fdiv_rn(__fsub_rn(xv, mn_f), scale_f);
        v = v > 0.0f ? v : 0.0f;  // NaN -> 0 as well
        v = v < flevels ? v : flevels;
        q = static_cast<uint32_t>(rintf(v));
      }
      word |= q << (bits * j);
    }
    StoreU32(words + 4 * w, word);
  }
}

//   v   : [n, h, d] bf16, device; chunk j of head hh = tokens j*C.., token stride h*d
//   out : [h, n_chunks, chunk_bytes] u8, device
// Block (j, hh) encodes one chunk.
__global__ void __launch_bounds__(kCodecThreads)
    EncodeValueChunksKernel(const __nv_bfloat16* __restrict__ v, int h, int n_chunks,
                            const DevCodec cd, uint8_t* __restrict__ out) {
  const int j = blockIdx.x, hh = blockIdx.y;
  const long long token_stride = static_cast<long long>(h) * cd.d;
  const __nv_bfloat16* src =
      v + static_cast<long long>(j) * cd.C * token_stride + static_cast<long long>(hh) * cd.d;
  uint8_t* dst = out + (static_cast<long long>(hh) * n_chunks + j) * cd.chunk_bytes;
  const int elems = cd.C * cd.d;
  switch (cd.codec) {
    case static_cast<int>(ValueCodec::kBF16): {
      for (int i = threadIdx.x; i < elems; i += blockDim.x) {
        const int t = i / cd.d, c = i % cd.d;
        StoreU16(dst + 2 * i, __bfloat16_as_ushort(src[t * token_stride + c]));
      }
      return;
    }
    case static_cast<int>(ValueCodec::kFP8): {
      __shared__ float warp_max[kCodecThreads / 32];
      __shared__ float s_scale;
      float amax = 0.0f;
      for (int i = threadIdx.x; i < elems; i += blockDim.x) {
        const int t = i / cd.d, c = i % cd.d;
        amax = fmaxf(amax, fabsf(__bfloat162float(src[t * token_stride + c])));
      }
      amax = cuda::WarpMax(amax);
      if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
      __syncthreads();
      if (threadIdx.x == 0) {
        float m = 0.0f;
        for (int w = 0; w < kCodecThreads / 32; ++w) m = fmaxf(m, warp_max[w]);
        const float scale = __fdiv_rn(m, kFp8E4M3Max);
        s_scale = scale;
        StoreU32(dst, __float_as_uint(scale));
      }
      __syncthreads();
      const float scale = s_scale;
      for (int i = threadIdx.x; i < elems; i += blockDim.x) {
        const int t = i / cd.d, c = i % cd.d;
        uint8_t code = 0;
        if (scale != 0.0f) {
          const float x = __bfloat162float(src[t * token_stride + c]);
          code = static_cast<uint8_t>(
              __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3));
        }
        dst[4 + i] = code;
      }
      return;
    }
    default: {
      const int n_groups = cd.C * cd.groups;
      for (int gidx = threadIdx.x; gidx < n_groups; gidx += blockDim.x) {
        const int t = gidx / cd.groups, gi = gidx % cd.groups;
        uint16_t scale_bits, mn_bits;
        QuantizeGroup(src + t * token_stride + gi * cd.group, 1, cd.group, cd.bits,
                      dst + 4 * gidx * cd.wpg, &scale_bits, &mn_bits);
        StoreU16(dst + cd.code_bytes + 2 * gidx, scale_bits);
        StoreU16(dst + cd.code_bytes + 2 * (n_groups + gidx), mn_bits);
      }
      return;
    }
  }
}

//   encoded : [m, chunk_bytes] u8, device;  out : [m, C, d] bf16, device
// Block b decodes chunks [b*kDecodeChunksPerBlock, ...).
__global__ void __launch_bounds__(kCodecThreads)
    DecodeValueChunksKernel(const uint8_t* __restrict__ encoded, int m, const DevCodec cd,
                            int stage_stride, __nv_bfloat16* __restrict__ out) {
  extern __shared__ __align__(16) uint8_t stage[];
  const int first = blockIdx.x * kDecodeChunksPerBlock;
  const int n = min(kDecodeChunksPerBlock, m - first);
  const uint8_t* src[kDecodeChunksPerBlock];
  int offs[kDecodeChunksPerBlock];
#pragma unroll
  for (int i = 0; i < kDecodeChunksPerBlock; ++i) {
    src[i] = i < n ? encoded + static_cast<long long>(first + i) * cd.chunk_bytes : nullptr;
  }
  cuda::StageChunks<kDecodeChunksPerBlock>(src, n, cd.chunk_bytes, stage, stage_stride, offs);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kDecodeChunksPerBlock; ++i) {
    if (i < n) {
      cuda::DecodeStagedChunk(cd, stage + i * stage_stride + offs[i],
                              out + static_cast<long long>(first + i) * cd.C * cd.d);
    }
  }
}

//   x : [rows, cols] bf16;  codes [n_groups, wpg] u32;  scale, mn [n_groups] fp16
// One thread per group; group gidx = (outer o, inner in) as in codec.h.
__global__ void KiviQuantizeKernel(const __nv_bfloat16* __restrict__ x, int cols, int inner,
                                   long long n_groups, int group, int bits, int per_token,
                                   uint32_t* __restrict__ codes, uint16_t* __restrict__ scale,
                                   uint16_t* __restrict__ mn) {
  const long long gidx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gidx >= n_groups) return;
  const long long o = gidx / inner, in = gidx % inner;
  const int wpg = group * bits / 32;
  const __nv_bfloat16* src = per_token ? x + o * cols + in * group : x + o * group * cols + in;
  QuantizeGroup(src, per_token ? 1 : cols, group, bits,
                reinterpret_cast<uint8_t*>(codes + gidx * wpg), &scale[gidx], &mn[gidx]);
}

__global__ void KiviDequantizeKernel(const uint32_t* __restrict__ codes,
                                     const uint16_t* __restrict__ scale,
                                     const uint16_t* __restrict__ mn, int cols, int inner,
                                     long long n_groups, int group, int bits, int per_token,
                                     __nv_bfloat16* __restrict__ x) {
  const long long gidx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (gidx >= n_groups) return;
  const long long o = gidx / inner, in = gidx % inner;
  const int wpg = group * bits / 32, per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  const float sf = cuda::HalfBitsToFloat(scale[gidx]);
  const float mf = cuda::HalfBitsToFloat(mn[gidx]);
  __nv_bfloat16* dst = per_token ? x + o * cols + in * group : x + o * group * cols + in;
  const long long stride = per_token ? 1 : cols;
  for (int i = 0; i < group; ++i) {
    const uint32_t word = codes[gidx * wpg + i / per_word];
    const uint32_t q = (word >> (bits * (i % per_word))) & mask;
    dst[i * stride] = __float2bfloat16_rn(__fmaf_rn(static_cast<float>(q), sf, mf));
  }
}

}  // namespace

absl::Status CudaBackend::EncodeValueChunks(absl::Span<const bf16> v, int n, int h, int d, int C,
                                            int n_chunks, const ValueCodecSpec& spec,
                                            absl::Span<std::byte> out, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::EncodeValueChunks(v.size(), n, h, d, C, n_chunks, spec, out.size()));
  KVSHADE_ASSIGN_OR_RETURN(const DevCodec cd, cuda::MakeDevCodec(spec, C, d));
  if (n_chunks == 0) return absl::OkStatus();
  if (h > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("EncodeValueChunks: h = ", h, " exceeds the CUDA grid limit 65535"));
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  EncodeValueChunksKernel<<<dim3(n_chunks, h), kCodecThreads, 0, cuda::ToCudaStream(stream)>>>(
      cuda::AsNv(v.data()), h, n_chunks, cd, reinterpret_cast<uint8_t*>(out.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

absl::Status CudaBackend::DecodeValueChunks(absl::Span<const std::byte> encoded, int m, int C,
                                            int d, const ValueCodecSpec& spec, absl::Span<bf16> out,
                                            Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::DecodeValueChunks(encoded.size(), m, C, d, spec, out.size()));
  KVSHADE_ASSIGN_OR_RETURN(const DevCodec cd, cuda::MakeDevCodec(spec, C, d));
  if (m == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const int stage_stride = cuda::StageStride(cd);
  const size_t smem = size_t(stage_stride) * kDecodeChunksPerBlock;
  int optin = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  if (smem > size_t(optin)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DecodeValueChunks: value chunks of ", cd.chunk_bytes,
        " bytes are too large for the CUDA decoder (shared memory limit ", optin, ")"));
  }
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      DecodeValueChunksKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const int blocks = cuda::CeilDiv(m, kDecodeChunksPerBlock);
  DecodeValueChunksKernel<<<blocks, kCodecThreads, smem, cuda::ToCudaStream(stream)>>>(
      reinterpret_cast<const uint8_t*>(encoded.data()), m, cd, stage_stride,
      cuda::AsNv(out.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

absl::Status CudaBackend::KiviQuantize(absl::Span<const bf16> x, const KiviLayout& layout,
                                       absl::Span<uint32_t> codes, absl::Span<fp16> scale,
                                       absl::Span<fp16> mn, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::Kivi(x.size(), layout, codes.size(), scale.size(), mn.size()));
  const long long n_groups = static_cast<long long>(layout.n_groups());
  if (n_groups == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  constexpr int kThreads = 256;
  const long long blocks = cuda::CeilDiv<long long>(n_groups, kThreads);
  KiviQuantizeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, cuda::ToCudaStream(stream)>>>(
      cuda::AsNv(x.data()), layout.cols, layout.inner(), n_groups, layout.group, layout.bits,
      layout.axis == KiviAxis::kPerToken ? 1 : 0, codes.data(),
      reinterpret_cast<uint16_t*>(scale.data()), reinterpret_cast<uint16_t*>(mn.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

absl::Status CudaBackend::KiviDequantize(absl::Span<const uint32_t> codes,
                                         absl::Span<const fp16> scale, absl::Span<const fp16> mn,
                                         const KiviLayout& layout, absl::Span<bf16> x,
                                         Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::Kivi(x.size(), layout, codes.size(), scale.size(), mn.size()));
  const long long n_groups = static_cast<long long>(layout.n_groups());
  if (n_groups == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  constexpr int kThreads = 256;
  const long long blocks = cuda::CeilDiv<long long>(n_groups, kThreads);
  KiviDequantizeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, cuda::ToCudaStream(stream)>>>(
      codes.data(), reinterpret_cast<const uint16_t*>(scale.data()),
      reinterpret_cast<const uint16_t*>(mn.data()), layout.cols, layout.inner(), n_groups,
      layout.group, layout.bits, layout.axis == KiviAxis::kPerToken ? 1 : 0, cuda::AsNv(x.data()));
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// Device plumbing shared by the CUDA decode ops (cuda_codec.cu, cuda_select.cu,
// cuda_reconstruct.cu, cuda_attend.cu). Private to kernels/cuda; included from .cu files
// only (nvcc).
//   - Descriptors: per-item views flattened into plain structs that device code reads from
//     the op's workspace, and StageDescriptors, which puts them there without a host
//     synchronization and without keeping the caller's host array alive: the descriptors
//     travel as the argument of a tiny copy kernel (kernel arguments are captured when the
//     launch is enqueued), in packs of at most kStagePackBytes.
//   - Tensor-core fragments (mma.sync m16n8k16 bf16 -> fp32, ldmatrix) and cp.async.
//   - The value-chunk codecs' decode (codec.h layouts), shared by DecodeValueChunks and the
//     fused gather + decode of Reconstruct, bit-identical to the CPU reference:
//       fp8  : bf16(float(code) * scale)
//       int  : bf16(fmaf(q, float(scale_h), float(mn_h)))
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cuda/cuda_check.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"

namespace kvshade::kernels::cuda {

// ---------------------------------------------------------------------------------------
// Views

// One segment of a SessionLayerView. `begin` is the global id of its first chunk.
struct DevSegment {
  const __nv_bfloat16* landmarks;  // [n_chunks, h, d] bf16, device
  const uint8_t* excluded;         // [h, n_chunks] u8, device, or null
  const __nv_bfloat16* a;          // [n_chunks*C, r] bf16, device
  const uint8_t* values;           // host-visible encoded value chunks
  long long value_head_stride;     // bytes
  long long value_chunk_stride;    // bytes
  long long first_position;
  const uint8_t* sig;              // [n_chunks*C, h, rec] key signatures, device, or null
  int n_chunks;
  int begin;
};

struct DevView {
  DevSegment seg[kMaxSegments];
  const __nv_bfloat16* b;  // [h, r, d] bf16, device
  int n_segments;
  int total;  // chunks over all segments
  int r;
  int sig_bits;  // 0: no key signatures
};

// Flattens a validated view.
inline DevView MakeDevView(const SessionLayerView& v) {
  DevView out;
  std::memset(&out, 0, sizeof(out));
  int begin = 0;
  for (int s = 0; s < v.n_segments; ++s) {
    const SegmentView& in = v.segments[s];
    DevSegment& o = out.seg[s];
    o.landmarks = reinterpret_cast<const __nv_bfloat16*>(in.landmarks);
    o.excluded = in.excluded;
    o.a = reinterpret_cast<const __nv_bfloat16*>(in.a);
    o.values = reinterpret_cast<const uint8_t*>(in.values);
    o.value_head_stride = in.value_head_stride;
    o.value_chunk_stride = in.value_chunk_stride;
    o.first_position = in.first_position;
    o.sig = reinterpret_cast<const uint8_t*>(in.sig);
    o.n_chunks = in.n_chunks;
    o.begin = begin;
    begin += in.n_chunks;
  }
  out.b = reinterpret_cast<const __nv_bfloat16*>(v.b);
  out.n_segments = v.n_segments;
  out.total = begin;
  out.r = v.r;
  out.sig_bits = v.sig_bits;
  return out;
}

// Total chunks of a view whose counts are not validated yet (workspace sizing).
inline int64_t SafeTotalChunks(const SessionLayerView& view) {
  int64_t t = 0;
  const int n = std::clamp(view.n_segments, 0, kMaxSegments);
  for (int s = 0; s < n; ++s) t += std::max<int64_t>(view.segments[s].n_chunks, 0);
  return t;
}

__host__ __device__ inline bool Aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---------------------------------------------------------------------------------------
// Descriptor staging

inline constexpr size_t kStagePackBytes = 24 * 1024;  // < the 32 KB kernel-argument limit

template <typename T, int kCap>
struct StagePack {
  T items[kCap];
};

#ifdef __CUDACC__

template <typename T, int kCap>
__global__ void StageDescriptorsKernel(const __grid_constant__ StagePack<T, kCap> pack, int n,
                                       T* __restrict__ out) {
  static_assert(sizeof(T) % 4 == 0, "descriptors are copied as 32-bit words");
  const uint32_t* src = reinterpret_cast<const uint32_t*>(pack.items);
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  const int words = n * static_cast<int>(sizeof(T) / 4);
  for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
}

template <typename T, int kCap>
absl::Status LaunchStage(const T* host, int n, T* dev, cudaStream_t stream) {
  StagePack<T, kCap> pack;
  std::memcpy(static_cast<void*>(pack.items), host, size_t(n) * sizeof(T));
  StageDescriptorsKernel<T, kCap><<<1, 256, 0, stream>>>(pack, n, dev);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

// Copies host descriptors [n] into device memory `dev` on `stream`. Returns once the
// launches are enqueued; `host` may be freed right away. Small batches use a small pack
// (the launch copies the whole argument).
template <typename T>
absl::Status StageDescriptors(const T* host, int n, T* dev, cudaStream_t stream) {
  static_assert(std::is_trivially_copyable_v<T>);
  constexpr int kSmall = std::max<int>(1, int(2048 / sizeof(T)));
  constexpr int kLarge = std::max<int>(1, int(kStagePackBytes / sizeof(T)));
  int i = 0;
  while (i < n) {
    const int left = n - i;
    if (left <= kSmall) {
      KVSHADE_RETURN_IF_ERROR((LaunchStage<T, kSmall>(host + i, left, dev + i, stream)));
      i += left;
    } else {
      const int m = std::min(left, kLarge);
      KVSHADE_RETURN_IF_ERROR((LaunchStage<T, kLarge>(host + i, m, dev + i, stream)));
      i += m;
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Segment lookup: the segment holding global chunk `chunk` (chunk in [0, total)).
__device__ __forceinline__ int SegmentOf(const DevView& v, int chunk) {
  int s = 0;
  while (s + 1 < v.n_segments && chunk >= v.seg[s + 1].begin) ++s;
  return s;
}

// Whether head hh may select chunk c: in range and not excluded (static) for that head
// (cpu_select.cc SelectableChunk).
__device__ __forceinline__ bool SelectableChunk(const DevView& v, int hh, int c) {
  if (c < 0 || c >= v.total) return false;
  const DevSegment& sg = v.seg[SegmentOf(v, c)];
  return sg.excluded == nullptr ||
         sg.excluded[static_cast<long long>(hh) * sg.n_chunks + (c - sg.begin)] == 0;
}

// ---------------------------------------------------------------------------------------
// Tensor cores and async copies (sm_80+ instructions, all in plain sm_90).

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane i supplies the address of row (i % 8) of matrix (i / 8).
__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t r[4], const void* smem) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(smem)));
}

// c[16x8] += a[16x16] * b[16x8], bf16 inputs, fp32 accumulation. Fragments (g = lane/4,
// t = lane%4): a0 (g, 2t..), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// b0 (k 2t.., n g), b1 (k 2t+8.., n g); c0,c1 (g, 2t..), c2,c3 (g+8, 2t..).
__device__ __forceinline__ void MmaBf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte global -> shared copy; zero-fills the destination when !valid (src is then
// not read but must still be a valid global address).
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(smem)), "l"(gmem),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Bulk (TMA) copies completing on an mbarrier (plain sm_90; no tensor map needed for 1D).
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count));
}
// Makes barrier initialization visible to the async proxy (before the first bulk copy).
__device__ __forceinline__ void MbarInitFence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)),
               "r"(bytes)
               : "memory");
}
// Waits for the completion of the barrier's phase with the given parity.
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "LAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\n"
      "bra LAB_WAIT;\n"
      "DONE:\n"
      "}\n" ::"r"(SmemAddr(bar)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16) from global src to shared dst (both 16-byte aligned).
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes,
                                         uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(SmemAddr(dst)),
      "l"(src), "r"(bytes), "r"(SmemAddr(bar))
      : "memory");
}

#endif  // __CUDACC__

// ---------------------------------------------------------------------------------------
// Value codecs

struct DevCodec {
  int codec;  // ValueCodec
  int C, d;
  int bits, group;  // integer codecs
  int groups;       // d / group (integer codecs)
  int wpg;          // words per group
  int chunk_bytes;  // ValueChunkBytes
  int code_bytes;   // integer codecs: C * groups * wpg * 4 (scales follow, then mins)
};

inline absl::StatusOr<DevCodec> MakeDevCodec(const ValueCodecSpec& spec, int C, int d) {
  absl::StatusOr<size_t> bytes = ValueChunkBytes(spec, C, d);
  if (!bytes.ok()) return bytes.status();
  if (*bytes > size_t{1} << 30) {
    return absl::InvalidArgumentError(
        absl::StrCat("value chunk of ", *bytes, " bytes is too large"));
  }
  DevCodec c{};
  c.codec = static_cast<int>(spec.codec);
  c.C = C;
  c.d = d;
  c.bits = CodecBits(spec.codec);
  c.group = spec.group;
  if (c.bits > 0) {
    c.groups = d / spec.group;
    c.wpg = spec.group * c.bits / 32;
    c.code_bytes = C * c.groups * c.wpg * 4;
  }
  c.chunk_bytes = static_cast<int>(*bytes);
  return c;
}

// Bytes of smem one staged chunk takes (the 16-byte window around it, rounded up).
inline int StageStride(const DevCodec& c) { return (c.chunk_bytes + 32 + 15) / 16 * 16; }

#ifdef __CUDACC__

__device__ __forceinline__ uint32_t LoadU32(const uint8_t* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
__device__ __forceinline__ uint16_t LoadU16(const uint8_t* p) {
  return static_cast<uint16_t>(uint32_t(p[0]) | (uint32_t(p[1]) << 8));
}
__device__ __forceinline__ float HalfBitsToFloat(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ float Fp8ToFloat(uint8_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
}
__device__ __forceinline__ uint16_t FloatToBf16Bits(float x) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

// Copies up to kMax encoded chunks (each `bytes` long, any alignment) into shared memory:
// chunk i goes to stage + i*stride (stride a multiple of 16, >= bytes + 32) and starts at
// offset offs[i] there. Reads the 16-byte-aligned window covering each chunk, so it never
// touches a page the chunk does not touch. All loads of a round are issued before the
// stores. src[i] == null skips chunk i. Block-cooperative; the caller syncs afterwards.
template <int kMax>
__device__ __forceinline__ void StageChunks(const uint8_t* const (&src)[kMax], int n, int bytes,
                                            uint8_t* stage, int stride, int (&offs)[kMax]) {
  const uint4* base[kMax];
  int nvec[kMax];
  int most = 0;
#pragma unroll
  for (int i = 0; i < kMax; ++i) {
    nvec[i] = 0;
    base[i] = nullptr;
    offs[i] = 0;
    if (i < n && src[i] != nullptr) {
      const uintptr_t s = reinterpret_cast<uintptr_t>(src[i]);
      const uintptr_t a0 = s & ~uintptr_t{15};
      const uintptr_t a1 = (s + bytes + 15) & ~uintptr_t{15};
      base[i] = reinterpret_cast<const uint4*>(a0);
      nvec[i] = static_cast<int>((a1 - a0) / 16);
      offs[i] = static_cast<int>(s - a0);
      most = max(most, nvec[i]);
    }
  }
  for (int v = threadIdx.x; v < most; v += blockDim.x) {
    uint4 tmp[kMax];
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (v < nvec[i]) tmp[i] = __ldcg(base[i] + v);
    }
#pragma unroll
    for (int i = 0; i < kMax; ++i) {
      if (v < nvec[i]) reinterpret_cast<uint4*>(stage + i * stride)[v] = tmp[i];
    }
  }
}

// Decoded bf16 bits of element i (= t*d + c) of the chunk at e (shared memory).
__device__ __forceinline__ uint16_t DecodeElement(const DevCodec& cd, const uint8_t* e, int i) {
  switch (cd.codec) {
    case static_cast<int>(ValueCodec::kBF16):
      return LoadU16(e + 2 * i);
    case static_cast<int>(ValueCodec::kFP8): {
      const float scale = __uint_as_float(LoadU32(e));
      return FloatToBf16Bits(Fp8ToFloat(e[4 + i]) * scale);
    }
    default: {
      const int t = i / cd.d, c = i % cd.d;
      const int gi = c / cd.group, within = c % cd.group;
      const int gidx = t * cd.groups + gi;
      const int bit = within * cd.bits;
      const uint32_t word = LoadU32(e + (gidx * cd.wpg + bit / 32) * 4);
      const uint32_t q = (word >> (bit % 32)) & ((1u << cd.bits) - 1u);
      const int n_groups = cd.C * cd.groups;
      const float scale = HalfBitsToFloat(LoadU16(e + cd.code_bytes + 2 * gidx));
      const float mn = HalfBitsToFloat(LoadU16(e + cd.code_bytes + 2 * (n_groups + gidx)));
      return FloatToBf16Bits(__fmaf_rn(static_cast<float>(q), scale, mn));
    }
  }
}

// Eight decoded elements [8u, 8u+8) (one token row; needs d % 8 == 0) as 16 bytes.
__device__ __forceinline__ uint4 DecodeEight(const DevCodec& cd, const uint8_t* e, int u) {
  uint4 out;
  uint32_t* w = reinterpret_cast<uint32_t*>(&out);
  switch (cd.codec) {
    case static_cast<int>(ValueCodec::kBF16): {
      const uint8_t* p = e + 16 * u;
#pragma unroll
      for (int i = 0; i < 4; ++i) w[i] = LoadU32(p + 4 * i);
      return out;
    }
    case static_cast<int>(ValueCodec::kFP8): {
      const float scale = __uint_as_float(LoadU32(e));
      const uint8_t* p = e + 4 + 8 * u;
      const uint32_t lo = LoadU32(p), hi = LoadU32(p + 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t word = i < 2 ? lo : hi;
        const int sh = (i & 1) * 16;
        const uint16_t x0 = FloatToBf16Bits(Fp8ToFloat(static_cast<uint8_t>(word >> sh)) * scale);
        const uint16_t x1 =
            FloatToBf16Bits(Fp8ToFloat(static_cast<uint8_t>(word >> (sh + 8))) * scale);
        w[i] = uint32_t(x0) | (uint32_t(x1) << 16);
      }
      return out;
    }
    default: {
      const int i0 = 8 * u;
      const int t = i0 / cd.d, c = i0 % cd.d;
      const int gi = c / cd.group, within = c % cd.group;  // 8 | group: one group
      const int gidx = t * cd.groups + gi;
      const int bit = within * cd.bits;  // multiple of 8*bits: the 8 codes share a word
      const uint32_t word = LoadU32(e + (gidx * cd.wpg + bit / 32) * 4) >> (bit % 32);
      const int n_groups = cd.C * cd.groups;
      const float scale = HalfBitsToFloat(LoadU16(e + cd.code_bytes + 2 * gidx));
      const float mn = HalfBitsToFloat(LoadU16(e + cd.code_bytes + 2 * (n_groups + gidx)));
      const uint32_t mask = (1u << cd.bits) - 1u;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint32_t q0 = (word >> (cd.bits * (2 * i))) & mask;
        const uint32_t q1 = (word >> (cd.bits * (2 * i + 1))) & mask;
        const uint16_t x0 = FloatToBf16Bits(__fmaf_rn(static_cast<float>(q0), scale, mn));
        const uint16_t x1 = FloatToBf16Bits(__fmaf_rn(static_cast<float>(q1), scale, mn));
        w[i] = uint32_t(x0) | (uint32_t(x1) << 16);
      }
      return out;
    }
  }
}

// Decodes one staged chunk (e: shared memory) into out [C, d] bf16 (global).
// Block-cooperative.
__device__ __forceinline__ void DecodeStagedChunk(const DevCodec& cd, const uint8_t* e,
                                                  __nv_bfloat16* out) {
  const int elems = cd.C * cd.d;
  if (cd.d % 8 == 0 && Aligned16(out)) {
    uint4* o = reinterpret_cast<uint4*>(out);
    for (int u = threadIdx.x; u < elems / 8; u += blockDim.x) o[u] = DecodeEight(cd, e, u);
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out);
    for (int i = threadIdx.x; i < elems; i += blockDim.x) o[i] = DecodeElement(cd, e, i);
  }
}

#endif  // __CUDACC__

}  // namespace kvshade::kernels::cuda

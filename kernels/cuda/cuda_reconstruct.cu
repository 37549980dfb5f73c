// CUDA Reconstruct (docs/ALGORITHM.md decode step 4) for a batch of session items: for every
// miss of every KV head, the chunk's keys from the low-rank factors and its values from the
// host-visible store, in ONE kernel whose blocks split into two independent roles so that
// key math (HBM + tensor cores) and value reads (PCIe) overlap:
//   key blocks   : 64 miss tokens of one (item, head): k_hat = A[rows] . B[hh] with bf16
//                  tensor cores (mma m16n8k16, fp32 accumulation; A and B stream through a
//                  2-stage cp.async pipeline in rank slices of 64), then RoPE in fp32 at
//                  each token's absolute position, rounded once to bf16.
//   value blocks : up to 4 missed chunks of one (item, head): the encoded chunks are read
//                  from the mapped host store with 16-byte loads (all in flight together),
//                  staged in shared memory and decoded (cuda_decode_common.cuh; bit-identical
//                  to the CPU decode).
// Key and value blocks are interleaved evenly over the grid, so both kinds are resident
// at once. Miss counts stay on the device: the grid covers k misses per head and blocks
// past miss_count[hh] exit at once.
//
// Output rows: miss j of head hh goes to row (hh, j), or to row (hh, miss_slot[hh*k + j])
// when the item has miss_slot. A key block's 64 tokens can span several misses, so with
// miss_slot each token's destination row comes from its own miss index; without it the
// tile is one contiguous run of rows and is stored as such.
//
// Selection units (ReconstructItem::unit = u < C; any item of a call): the same kernel
// with kUnits, every item's misses being rows of T tokens (T = u, or C for an item of
// whole chunks): key blocks take 64 tokens of units (token i of unit j is token
// (j*T) % C + i of chunk (j*T) / C), value blocks read only the unit's byte ranges of its
// encoded chunk (UnitValueBlock) and decode them as a chunk of T tokens, bit-identical to
// the CPU's DecodeValueRows. Calls without units run the whole-chunk kernel as before.
//
// Accuracy vs the CPU reference (cpu_reconstruct.cc): the fp32 sums run in a different
// order (tensor-core accumulation) and cos/sin come from a double-precision argument
// reduction plus fp32 sincosf instead of double cos/sin, so keys agree to within about one
// bf16 ulp; values are bit-identical.
//
// Device-resident inputs cannot be checked from the host without a synchronization, so
// this backend does not fail the call on them (the CPU backend does): miss_count is
// clamped to [0, k], and a miss whose chunk id is outside [0, total_chunks) (unit id
// outside [0, total_chunks * C/u)) or whose slot is outside [0, k) is skipped (no output
// row is written for it). Slots named twice in one head race (the CPU backend rejects them).
//
// Limits of this backend: d in {64, 80, 96, 128, 256}, r % 8 == 0, A, B and the key
// output 16-byte aligned (InvalidArgument otherwise).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_decode_common.cuh"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

using cuda::DevCodec;
using cuda::DeviceRope;
using cuda::DevSegment;
using cuda::DevView;

constexpr int kReconThreads = 128;     // 4 warps
constexpr int kKeyRows = 64;           // tokens per key block (4 warps x 16 rows)
constexpr int kRankSlice = 64;         // rank columns per pipeline stage
constexpr int kMaxValuesPerBlock = 4;  // chunks decoded by one value block
constexpr int kValueStageTarget = 16 * 1024;

struct ReconDesc {
  DevView view;
  const int* miss_chunk;  // [h, k] int32
  const int* miss_count;  // [h] int32
  const int* miss_slot;   // [h, k] int32 output row of each miss, or null: row j
  __nv_bfloat16* keys;    // [h, k, C, d] bf16 out ([h, k, T, d] with units)
  __nv_bfloat16* values;  // [h, k, C, d] bf16 out ([h, k, T, d] with units)
  int tokens;             // units kernel only: T, tokens per miss (C for whole chunks)
  int pad;
};

struct ReconParams {
  int h, k, C;
  int key_tiles;     // key blocks per (item, head): ceil(k*C / kKeyRows)
  int value_groups;  // value blocks per (item, head): ceil(k / values_per_block)
  int values_per_block;
  int stage_stride;  // shared-memory bytes per staged value chunk (or unit, with units)
  int pad;
  long long n_key_blocks;
  long long n_value_blocks;
  DevCodec codec;
};

template <int kD>
constexpr size_t KeySmemBytes() {
  return size_t(2) * (kKeyRows * (kRankSlice + 8) + kRankSlice * (kD + 8)) * 2;
}
static_assert(KeySmemBytes<64>() >= size_t(kKeyRows) * (64 + 4) * 4);
static_assert(KeySmemBytes<256>() >= size_t(kKeyRows) * (256 + 4) * 4);

// cos and sin (times magnitude) of rotary pair i at position pos. The angle is formed and
// reduced modulo 2*pi in double precision, then sincosf runs on the reduced fp32 angle:
// within an fp32 ulp or two of the reference's double cos/sin, at a fraction of the cost.
__device__ __forceinline__ void FastRopeCosSin(const DeviceRope& rope, long long pos, int i,
                                               float* c, float* s) {
  const double angle = static_cast<double>(pos) * static_cast<double>(rope.position_scale) *
                       static_cast<double>(rope.inv_freq[i]);
  constexpr double kTwoPiHi = 6.283185307179586232;    // nearest double to 2*pi
  constexpr double kTwoPiLo = 2.4492935982947064e-16;  // 2*pi - kTwoPiHi
  constexpr double kInvTwoPi = 0.15915494309189535;
  const double n = rint(angle * kInvTwoPi);
  double r = fma(-n, kTwoPiHi, angle);
  r = fma(-n, kTwoPiLo, r);
  float sf, cf;
  sincosf(static_cast<float>(r), &sf, &cf);
  *c = cf * rope.magnitude;
  *s = sf * rope.magnitude;
}

// kUnits: misses are units of it.tokens tokens (ReconstructItem::unit; T = C is a whole
// chunk): token i of unit id is token (id*T) % C + i of chunk (id*T) / C, rows of T tokens.
template <int kD, bool kUnits>
__device__ __forceinline__ void KeyBlock(const ReconDesc* __restrict__ descs, const ReconParams& p,
                                         const DeviceRope& rope, long long kb, uint8_t* smem) {
  __shared__ const __nv_bfloat16* row_a[kKeyRows];  // A row of each token, null = skip
  __shared__ long long row_pos[kKeyRows];           // absolute position of each token
  __shared__ long long row_out[kKeyRows];           // with miss_slot: output token row,
                                                    // (hh*k + slot)*C + t
  const int tile = static_cast<int>(kb % p.key_tiles);
  const long long rest = kb / p.key_tiles;
  const int hh = static_cast<int>(rest % p.h);
  const ReconDesc& it = descs[rest / p.h];
  const int count = min(max(it.miss_count[hh], 0), p.k);
  const int u0 = tile * kKeyRows;
  const int T = kUnits ? it.tokens : p.C;  // tokens per miss
  const int n_tok = count * T;
  if (u0 >= n_tok) return;
  const int rows = min(kKeyRows, n_tok - u0);
  const int r = it.view.r;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x < kKeyRows) {
    const int row = threadIdx.x;
    const __nv_bfloat16* a = nullptr;
    long long pos = 0, out_row = 0;
    if (kUnits && row < rows) {
      const int u = u0 + row;
      const int j = u / T, i = u - j * T;
      const int id = it.miss_chunk[static_cast<long long>(hh) * p.k + j];
      const int slot =
          it.miss_slot != nullptr ? it.miss_slot[static_cast<long long>(hh) * p.k + j] : j;
      const long long first = static_cast<long long>(id) * T;  // the unit's first token
      if (id >= 0 && first < static_cast<long long>(it.view.total) * p.C && slot >= 0 &&
          slot < p.k) {
        const int chunk = static_cast<int>(first / p.C);
        const int t = static_cast<int>(first % p.C) + i;
        const DevSegment& sg = it.view.seg[cuda::SegmentOf(it.view, chunk)];
        const long long local = chunk - sg.begin;
        a = sg.a + (local * p.C + t) * r;
        pos = sg.first_position + local * p.C + t;
        out_row = (static_cast<long long>(hh) * p.k + slot) * T + i;
      }
    } else if (row < rows) {
      const int u = u0 + row;
      const int j = u / p.C, t = u - j * p.C;
      const int chunk = it.miss_chunk[static_cast<long long>(hh) * p.k + j];
      const int slot =
          it.miss_slot != nullptr ? it.miss_slot[static_cast<long long>(hh) * p.k + j] : j;
      if (chunk >= 0 && chunk < it.view.total && slot >= 0 && slot < p.k) {
        const DevSegment& sg = it.view.seg[cuda::SegmentOf(it.view, chunk)];
        const long long local = chunk - sg.begin;
        a = sg.a + (local * p.C + t) * r;
        pos = sg.first_position + local * p.C + t;
        out_row = (static_cast<long long>(hh) * p.k + slot) * p.C + t;
      }
    }
    row_a[row] = a;
    row_pos[row] = pos;
    row_out[row] = out_row;
  }
  __syncthreads();

  const __nv_bfloat16* bh = it.view.b + static_cast<long long>(hh) * r * kD;  // [r, kD]
  constexpr int kAStride = kRankSlice + 8;  // elements; padded rows: conflict-free ldmatrix
  constexpr int kBStride = kD + 8;
  constexpr int kStageElems = kKeyRows * kAStride + kRankSlice * kBStride;
  __nv_bfloat16* stages = reinterpret_cast<__nv_bfloat16*>(smem);

  auto load = [&](int slice, int stage) {
    __nv_bfloat16* as = stages + stage * kStageElems;
    __nv_bfloat16* bs = as + kKeyRows * kAStride;
    const int k0 = slice * kRankSlice;
    for (int v = threadIdx.x; v < kKeyRows * (kRankSlice / 8); v += blockDim.x) {
      const int row = v / (kRankSlice / 8), col = v % (kRankSlice / 8);
      const __nv_bfloat16* a = row_a[row];
      const bool valid = a != nullptr && k0 + col * 8 < r;  // r % 8 == 0: whole vectors
      cuda::CpAsync16(as + row * kAStride + col * 8, valid ? a + k0 + col * 8 : bh, valid);
    }
    for (int v = threadIdx.x; v < kRankSlice * (kD / 8); v += blockDim.x) {
      const int row = v / (kD / 8), col = v % (kD / 8);
      const bool valid = k0 + row < r;
      cuda::CpAsync16(bs + row * kBStride + col * 8,
                      valid ? bh + static_cast<long long>(k0 + row) * kD + col * 8 : bh, valid);
    }
  };

  float acc[kD / 8][4];
#pragma unroll
  for (int nt = 0; nt < kD / 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  const int n_slices = cuda::CeilDiv(r, kRankSlice);
  load(0, 0);
  cuda::CpAsyncCommit();
  for (int slice = 0; slice < n_slices; ++slice) {
    if (slice + 1 < n_slices) load(slice + 1, (slice + 1) & 1);
    cuda::CpAsyncCommit();
    cuda::CpAsyncWait<1>();
    __syncthreads();
    const __nv_bfloat16* as = stages + (slice & 1) * kStageElems;
    const __nv_bfloat16* bs = as + kKeyRows * kAStride;
#pragma unroll
    for (int ks = 0; ks < kRankSlice / 16; ++ks) {
      uint32_t a[4];
      cuda::LdMatrixX4(a, as + (warp * 16 + (lane & 15)) * kAStride + ks * 16 + (lane >> 4) * 8);
#pragma unroll
      for (int np = 0; np < kD / 16; ++np) {
        uint32_t b[4];
        cuda::LdMatrixX4Trans(b, bs + (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * kBStride +
                                     np * 16 + (lane >> 4) * 8);
        cuda::MmaBf16(acc[2 * np], a, b[0], b[1]);
        cuda::MmaBf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  // fp32 tile [kKeyRows, kD + 4] over the (now idle) pipeline buffers.
  constexpr int kOStride = kD + 4;
  float* os = reinterpret_cast<float*>(smem);
  {
    const int row0 = warp * 16 + (lane >> 2);
#pragma unroll
    for (int nt = 0; nt < kD / 8; ++nt) {
      const int col = nt * 8 + (lane & 3) * 2;
      *reinterpret_cast<float2*>(os + row0 * kOStride + col) = make_float2(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<float2*>(os + (row0 + 8) * kOStride + col) =
          make_float2(acc[nt][2], acc[nt][3]);
    }
  }
  __syncthreads();
  const int half = rope.rotary_dim / 2;
  for (int i = threadIdx.x; i < rows * half; i += blockDim.x) {
    const int row = i / half, pair = i - row * half;
    if (row_a[row] == nullptr) continue;
    float c, s;
    FastRopeCosSin(rope, row_pos[row], pair, &c, &s);
    const int2 dims = cuda::RopePairDims(rope, pair);
    float* o = os + row * kOStride;
    float x0 = o[dims.x], x1 = o[dims.y];
    cuda::RopeRotate(c, s, &x0, &x1);
    o[dims.x] = x0;
    o[dims.y] = x1;
  }
  __syncthreads();
  if (it.miss_slot == nullptr) {  // the tile is rows [u0, u0 + rows) of head hh
    __nv_bfloat16* out = it.keys + (static_cast<long long>(hh) * p.k * T + u0) * kD;
    for (int v = threadIdx.x; v < rows * (kD / 8); v += blockDim.x) {
      const int row = v / (kD / 8), col = v % (kD / 8);
      if (row_a[row] == nullptr) continue;
      cuda::StoreBf16x8(out + static_cast<long long>(row) * kD + col * 8,
                        os + row * kOStride + col * 8);
    }
  } else {  // each token to its miss's slot
    for (int v = threadIdx.x; v < rows * (kD / 8); v += blockDim.x) {
      const int row = v / (kD / 8), col = v % (kD / 8);
      if (row_a[row] == nullptr) continue;
      cuda::StoreBf16x8(it.keys + row_out[row] * kD + col * 8, os + row * kOStride + col * 8);
    }
  }
}

__device__ __forceinline__ void ValueBlock(const ReconDesc* __restrict__ descs,
                                           const ReconParams& p, long long vb, uint8_t* smem) {
  const int grp = static_cast<int>(vb % p.value_groups);
  const long long rest = vb / p.value_groups;
  const int hh = static_cast<int>(rest % p.h);
  const ReconDesc& it = descs[rest / p.h];
  const int count = min(max(it.miss_count[hh], 0), p.k);
  const int j0 = grp * p.values_per_block;
  if (j0 >= count) return;
  const int n = min(p.values_per_block, count - j0);
  const uint8_t* src[kMaxValuesPerBlock];
  int offs[kMaxValuesPerBlock];
  int dst[kMaxValuesPerBlock];  // output row of each chunk within head hh
#pragma unroll
  for (int i = 0; i < kMaxValuesPerBlock; ++i) {
    src[i] = nullptr;
    dst[i] = j0 + i;
    if (i < n) {
      const long long m = static_cast<long long>(hh) * p.k + j0 + i;
      const int chunk = it.miss_chunk[m];
      if (it.miss_slot != nullptr) dst[i] = it.miss_slot[m];
      if (chunk >= 0 && chunk < it.view.total && dst[i] >= 0 && dst[i] < p.k) {
        const DevSegment& sg = it.view.seg[cuda::SegmentOf(it.view, chunk)];
        src[i] = sg.values + hh * sg.value_head_stride +
                 static_cast<long long>(chunk - sg.begin) * sg.value_chunk_stride;
      }
    }
  }
  cuda::StageChunks<kMaxValuesPerBlock>(src, n, p.codec.chunk_bytes, smem, p.stage_stride, offs);
  __syncthreads();
  const long long chunk_elems = static_cast<long long>(p.C) * p.codec.d;
#pragma unroll
  for (int i = 0; i < kMaxValuesPerBlock; ++i) {
    if (i < n && src[i] != nullptr) {
      cuda::DecodeStagedChunk(
          p.codec, smem + i * p.stage_stride + offs[i],
          it.values + (static_cast<long long>(hh) * p.k + dst[i]) * chunk_elems);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Values of selection units (ReconstructItem::unit): tokens [t0, t0 + T) of an encoded chunk
// are the encoding of a T-token chunk (every codec is token-separable: fp8 keeps the chunk's
// one scale, KIVI groups lie within a token), laid out in up to three byte ranges of the
// chunk: bf16 its rows; fp8 the scale and the rows' codes; int4/int2 the rows' codes, scales
// and mins. A value block reads only those ranges (16-byte windows, as StageChunks), packs
// them into the T-token layout in shared memory and decodes that with DecodeStagedChunk
// (cpu_codec.cc DecodeValueRows: the same bits as the rows of a whole-chunk decode).
constexpr int kMaxUnitPieces = 3;

// The byte ranges of tokens [t0, t0 + T) of a chunk encoded with cd (C tokens): source
// offset in the chunk, length and destination offset in the T-token layout. Returns their
// count.
__host__ __device__ inline int UnitPieces(const DevCodec& cd, int T, int t0, int* src, int* len,
                                          int* dst) {
  if (cd.codec == static_cast<int>(ValueCodec::kBF16)) {
    src[0] = t0 * cd.d * 2;
    len[0] = T * cd.d * 2;
    dst[0] = 0;
    return 1;
  }
  if (cd.codec == static_cast<int>(ValueCodec::kFP8)) {
    src[0] = 0;
    len[0] = 4;
    dst[0] = 0;
    src[1] = 4 + t0 * cd.d;
    len[1] = T * cd.d;
    dst[1] = 4;
    return 2;
  }
  const int row_words = cd.groups * cd.wpg;  // code words of one token
  src[0] = t0 * row_words * 4;
  len[0] = T * row_words * 4;
  dst[0] = 0;
  src[1] = cd.code_bytes + t0 * cd.groups * 2;
  len[1] = T * cd.groups * 2;
  dst[1] = len[0];
  src[2] = cd.code_bytes + cd.C * cd.groups * 2 + t0 * cd.groups * 2;
  len[2] = T * cd.groups * 2;
  dst[2] = len[0] + len[1];
  return 3;
}

// The codec of a T-token chunk (the packed unit).
__host__ __device__ inline DevCodec UnitCodec(const DevCodec& cd, int T) {
  DevCodec u = cd;
  u.C = T;
  if (cd.codec == static_cast<int>(ValueCodec::kBF16)) {
    u.chunk_bytes = T * cd.d * 2;
  } else if (cd.codec == static_cast<int>(ValueCodec::kFP8)) {
    u.chunk_bytes = 4 + T * cd.d;
  } else {
    u.code_bytes = T * cd.groups * cd.wpg * 4;
    u.chunk_bytes = u.code_bytes + T * cd.groups * 4;
  }
  return u;
}

// Shared-memory bytes of one unit miss at T tokens: the packed unit, then one 16-byte
// window (plus slack) per piece.
__host__ __device__ inline int UnitStageBytes(const DevCodec& cd, int T) {
  int src[kMaxUnitPieces], len[kMaxUnitPieces], dst[kMaxUnitPieces];
  const int n = UnitPieces(cd, T, 0, src, len, dst);
  int bytes = (UnitCodec(cd, T).chunk_bytes + 15) / 16 * 16;
  for (int i = 0; i < n; ++i) bytes += (len[i] + 32 + 15) / 16 * 16;
  return bytes;
}

__device__ __forceinline__ void UnitValueBlock(const ReconDesc* __restrict__ descs,
                                               const ReconParams& p, long long vb,
                                               uint8_t* smem) {
  constexpr int kW = kMaxValuesPerBlock * kMaxUnitPieces;
  const int grp = static_cast<int>(vb % p.value_groups);
  const long long rest = vb / p.value_groups;
  const int hh = static_cast<int>(rest % p.h);
  const ReconDesc& it = descs[rest / p.h];
  const int count = min(max(it.miss_count[hh], 0), p.k);
  const int j0 = grp * p.values_per_block;
  if (j0 >= count) return;
  const int n = min(p.values_per_block, count - j0);
  const int T = it.tokens;
  const DevCodec ucd = UnitCodec(p.codec, T);
  const int packed = (ucd.chunk_bytes + 15) / 16 * 16;
  int dst_row[kMaxValuesPerBlock];
  bool valid[kMaxValuesPerBlock];
  int n_pieces = 0;
  int psrc[kMaxUnitPieces], plen[kMaxUnitPieces], pdst[kMaxUnitPieces];
  // Windows: miss i, piece q at w = i*kMaxUnitPieces + q.
  const uint4* wbase[kW];
  int nvec[kW], woff[kW];
  uint8_t* wstage[kW];
  int most = 0;
#pragma unroll
  for (int w = 0; w < kW; ++w) {
    wbase[w] = nullptr;
    nvec[w] = 0;
    woff[w] = 0;
    wstage[w] = nullptr;
  }
#pragma unroll
  for (int i = 0; i < kMaxValuesPerBlock; ++i) {
    valid[i] = false;
    dst_row[i] = j0 + i;
    if (i >= n) continue;
    const long long m = static_cast<long long>(hh) * p.k + j0 + i;
    const int id = it.miss_chunk[m];
    if (it.miss_slot != nullptr) dst_row[i] = it.miss_slot[m];
    const long long first = static_cast<long long>(id) * T;
    if (id < 0 || first >= static_cast<long long>(it.view.total) * p.C || dst_row[i] < 0 ||
        dst_row[i] >= p.k) {
      continue;
    }
    valid[i] = true;
    const int chunk = static_cast<int>(first / p.C), t0 = static_cast<int>(first % p.C);
    const DevSegment& sg = it.view.seg[cuda::SegmentOf(it.view, chunk)];
    const uint8_t* base = sg.values + hh * sg.value_head_stride +
                          static_cast<long long>(chunk - sg.begin) * sg.value_chunk_stride;
    n_pieces = UnitPieces(p.codec, T, t0, psrc, plen, pdst);
    uint8_t* region = smem + i * p.stage_stride + packed;
    for (int q = 0; q < n_pieces; ++q) {
      const int w = i * kMaxUnitPieces + q;
      const uintptr_t s = reinterpret_cast<uintptr_t>(base + psrc[q]);
      const uintptr_t a0 = s & ~uintptr_t{15};
      const uintptr_t a1 = (s + plen[q] + 15) & ~uintptr_t{15};
      wbase[w] = reinterpret_cast<const uint4*>(a0);
      nvec[w] = static_cast<int>((a1 - a0) / 16);
      woff[w] = static_cast<int>(s - a0);
      wstage[w] = region;
      region += (plen[q] + 32 + 15) / 16 * 16;
      most = max(most, nvec[w]);
    }
  }
  // Every window's loads of a round are in flight before any store.
  for (int v = threadIdx.x; v < most; v += blockDim.x) {
    uint4 tmp[kW];
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      if (v < nvec[w]) tmp[w] = __ldcg(wbase[w] + v);
    }
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      if (v < nvec[w]) reinterpret_cast<uint4*>(wstage[w])[v] = tmp[w];
    }
  }
  __syncthreads();
  // Pack the pieces into the T-token layout (the piece lengths are the same for every miss).
#pragma unroll
  for (int i = 0; i < kMaxValuesPerBlock; ++i) {
    if (!valid[i]) continue;
    uint8_t* unit = smem + i * p.stage_stride;
    for (int q = 0; q < n_pieces; ++q) {
      const int w = i * kMaxUnitPieces + q;
      const uint8_t* from = wstage[w] + woff[w];
      for (int b = threadIdx.x; b < plen[q]; b += blockDim.x) unit[pdst[q] + b] = from[b];
    }
  }
  __syncthreads();
  const long long unit_elems = static_cast<long long>(T) * p.codec.d;
#pragma unroll
  for (int i = 0; i < kMaxValuesPerBlock; ++i) {
    if (valid[i]) {
      cuda::DecodeStagedChunk(
          ucd, smem + i * p.stage_stride,
          it.values + (static_cast<long long>(hh) * p.k + dst_row[i]) * unit_elems);
    }
  }
}

// Block b is a key block when the even spread of n_key_blocks over the grid puts one
// there (floor((b+1)*NK/T) > floor(b*NK/T)); key index floor(b*NK/T), value index the rest.
// kUnits: every item's misses are units of its `tokens` tokens (UnitValueBlock).
template <int kD, bool kUnits>
__global__ void __launch_bounds__(kReconThreads)
    ReconstructKernel(const ReconDesc* __restrict__ descs, const ReconParams p,
                      const __grid_constant__ DeviceRope rope) {
  extern __shared__ __align__(16) uint8_t smem[];
  const long long b = blockIdx.x;
  const long long total = p.n_key_blocks + p.n_value_blocks;
  const long long keys_before = b * p.n_key_blocks / total;
  const long long keys_through = (b + 1) * p.n_key_blocks / total;
  if (keys_through > keys_before) {
    KeyBlock<kD, kUnits>(descs, p, rope, keys_before, smem);
  } else if constexpr (kUnits) {
    UnitValueBlock(descs, p, b - keys_before, smem);
  } else {
    ValueBlock(descs, p, b - keys_before, smem);
  }
}

template <int kD, bool kUnits = false>
absl::Status Launch(const ReconDesc* descs, const ReconParams& p, const DeviceRope& rope,
                    int value_smem, cudaStream_t stream) {
  const size_t smem = std::max<size_t>(KeySmemBytes<kD>(), size_t(value_smem));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      ReconstructKernel<kD, kUnits>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  const long long blocks = p.n_key_blocks + p.n_value_blocks;
  ReconstructKernel<kD, kUnits>
      <<<static_cast<unsigned>(blocks), kReconThreads, smem, stream>>>(descs, p, rope);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace

size_t CudaBackend::ReconstructWorkspaceBytes(const LayerShape& shape, int k,
                                              absl::Span<const ReconstructItem> items) const {
  (void)shape;
  (void)k;
  cuda::WorkspaceCarver c;
  c.Take<ReconDesc>(items.size());
  return c.bytes();
}

absl::Status CudaBackend::Reconstruct(const LayerShape& shape, int C, int k, const RopeSpec& rope,
                                      const ValueCodecSpec& codec,
                                      absl::Span<const ReconstructItem> items, Workspace ws,
                                      Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::Reconstruct(shape, C, k, rope, codec, items, ws,
                                                ReconstructWorkspaceBytes(shape, k, items)));
  if (items.empty()) return absl::OkStatus();
  const int h = shape.h, d = shape.d;
  if (d != 64 && d != 80 && d != 96 && d != 128 && d != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Reconstruct: the CUDA backend supports d in {64, 80, 96, 128, 256}, got d = ", d));
  }
  KVSHADE_ASSIGN_OR_RETURN(const DeviceRope table, cuda::MakeDeviceRope(rope, d));
  KVSHADE_ASSIGN_OR_RETURN(const DevCodec cd, cuda::MakeDevCodec(codec, C, d));
  for (size_t i = 0; i < items.size(); ++i) {
    const ReconstructItem& it = items[i];
    const std::string name = absl::StrCat("Reconstruct: items[", i, "]");
    if (it.view.r % 8 != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ".view.r must be a multiple of 8, got ", it.view.r));
    }
    if (!cuda::Aligned16(it.view.b) || !cuda::Aligned16(it.keys)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": view.b and keys must be 16-byte aligned on CUDA"));
    }
    for (int s = 0; s < it.view.n_segments; ++s) {
      if (it.view.segments[s].n_chunks > 0 && !cuda::Aligned16(it.view.segments[s].a)) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ".view.segments[", s, "].a must be 16-byte aligned on CUDA"));
      }
    }
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const cudaStream_t st = cuda::ToCudaStream(stream);

  // Selection units (ReconstructItem::unit below C) in any item: the units kernel for the
  // whole call (items of whole chunks in it are units of T = C tokens), sized for the
  // largest T of the call.
  bool units = false;
  int max_tokens = 0;
  for (const ReconstructItem& it : items) {
    const bool u = it.unit > 0 && it.unit < C;
    units = units || u;
    max_tokens = std::max(max_tokens, u ? it.unit : C);
  }
  ReconParams p{};
  p.h = h;
  p.k = k;
  p.C = C;
  p.key_tiles = static_cast<int>(
      cuda::CeilDiv<int64_t>(int64_t(k) * (units ? max_tokens : C), kKeyRows));
  p.stage_stride = units ? UnitStageBytes(cd, max_tokens) : cuda::StageStride(cd);
  p.values_per_block = std::clamp(kValueStageTarget / p.stage_stride, 1, kMaxValuesPerBlock);
  p.value_groups = cuda::CeilDiv(k, p.values_per_block);
  const long long heads = static_cast<long long>(items.size()) * h;
  p.n_key_blocks = heads * p.key_tiles;
  p.n_value_blocks = heads * p.value_groups;
  p.codec = cd;
  if (p.n_key_blocks + p.n_value_blocks > 0x7fffffffLL) {
    return absl::InvalidArgumentError("Reconstruct: batch too large for one CUDA grid");
  }
  const int value_smem = p.values_per_block * p.stage_stride;
  int optin = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  if (value_smem + 2048 > optin) {
    return absl::InvalidArgumentError(absl::StrCat("Reconstruct: value chunks of ", cd.chunk_bytes,
                                                   " bytes are too large for the CUDA ",
                                                   "decoder (shared memory limit ", optin, ")"));
  }

  cuda::WorkspaceCarver carver(ws.data);
  ReconDesc* dev_descs = carver.Take<ReconDesc>(items.size());
  std::vector<ReconDesc> descs(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const ReconstructItem& in = items[i];
    ReconDesc& o = descs[i];
    o.view = cuda::MakeDevView(in.view);
    o.miss_chunk = in.miss_chunk;
    o.miss_count = in.miss_count;
    o.miss_slot = in.miss_slot;
    o.keys = cuda::AsNv(in.keys);
    o.values = cuda::AsNv(in.values);
    o.tokens = in.unit > 0 && in.unit < C ? in.unit : C;
    o.pad = 0;
  }
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), dev_descs, st));
  if (units) {
    switch (d) {
      case 64:
        return Launch<64, true>(dev_descs, p, table, value_smem, st);
      case 80:
        return Launch<80, true>(dev_descs, p, table, value_smem, st);
      case 96:
        return Launch<96, true>(dev_descs, p, table, value_smem, st);
      case 128:
        return Launch<128, true>(dev_descs, p, table, value_smem, st);
      default:
        return Launch<256, true>(dev_descs, p, table, value_smem, st);
    }
  }
  switch (d) {
    case 64:
      return Launch<64>(dev_descs, p, table, value_smem, st);
    case 80:
      return Launch<80>(dev_descs, p, table, value_smem, st);
    case 96:
      return Launch<96>(dev_descs, p, table, value_smem, st);
    case 128:
      return Launch<128>(dev_descs, p, table, value_smem, st);
    default:
      return Launch<256>(dev_descs, p, table, value_smem, st);
  }
}

}  // namespace kvshade::kernels

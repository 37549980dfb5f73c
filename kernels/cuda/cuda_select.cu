// CUDA Select (docs/ALGORITHM.md decode steps 1-3) for a batch of session items: landmark
// scores, per-query-head softmax over the selectable chunks, GQA max, top-k per KV head
// and the temporal-cache slot diff, all on the device, with no host synchronization.
//
// Two kernels per call (after the descriptor copy, see cuda_decode_common.cuh):
//   1. ScoreKernel, grid (chunk slices, head groups, items): one pass over the landmarks
//      [n_chunks, h, d] (the HBM-bound part: 32 MiB per 128K-token session at h=8, d=128).
//      Tiles of 16 chunks x (up to 8 heads) stream through 3 shared-memory stages filled
//      by bulk (TMA) row copies;
//      each warp owns one KV head and computes the 16 x g logits of a tile with bf16 tensor
//      cores (mma m16n8k16, q as the 8-wide B operand, fp32 accumulation). It writes the
//      logits [h, total, g] f32 (NaN marks an excluded chunk) and a softmax partial
//      (max, sum of exp) per query head and slice.
//   2. TopKKernel, grid (h, items), 512 or 1024 threads: merges the partials into each
//      query head's (max, sum), turns logits into a 32-bit order key monotone in
//      s = max_g exp(x - max_g) / sum_g (computed in the log domain, see OrderKey), finds
//      the k-th largest key by a 4-pass 8-bit radix select, gathers the winners in chunk
//      order (ties at the threshold key go to the lowest chunk ids), sorts them by
//      (score desc, id asc) for `selected`, and does the slot diff with a sort of the slot
//      table and binary searches (docs/ALGORITHM.md T3; duplicate slot entries: first one hits).
//      As SelectEx's stage 1 it stops after the gather: the candidates, in chunk-id order.
// Arithmetic follows the CPU reference (cpu_select.cc): logit = dot * (1/sqrtf(d)), a NaN
// logit ranks as -inf, ranking by p = exp(x - max) / sum with NaN p last and underflowed
// p = 0 tied (ids break ties). The GPU ranks by log p = x - (max + log sum), which orders
// chunks the same way up to rounding, and accumulates dot products and softmax sums in a
// different order than the CPU's sequential loops: ids whose scores tie to within fp32
// rounding can swap. Everything is deterministic (fixed reduction trees, no atomics on
// values).
//
// Workspace (per item, 256-byte aligned pieces): logits [h, total, g] f32, partials
// [h*g, ceil(total/64)] float2, keys [h, total] u32 (used when they do not fit in shared
// memory), plus the item descriptors. At h=8, g=4 and 16384 chunks: 2 MiB + 64 KiB +
// 512 KiB per session.
//
// Limits of this backend: d % 16 == 0, g <= 16, k <= 4096, landmark pointers 16-byte
// aligned (InvalidArgument otherwise).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <cub/block/block_scan.cuh>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_decode_common.cuh"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

using cuda::DevSegment;
using cuda::DevView;

constexpr int kTileRows = 16;         // chunks per mma tile (the M dimension)
constexpr int kStages = 3;            // cp.async pipeline depth of the score kernel
constexpr int kMaxHeadsPerBlock = 8;  // warps of a score block, one KV head each
constexpr int kMinTilesPerBlock = 4;  // sizes the partials: slices are >= 64 chunks
constexpr int kMaxTilesPerBlock = 32;
// TopK block size: 1024 threads when the batch has fewer (item, head) pairs than SMs
// (latency), 512 otherwise (two blocks per SM: the whole batch in one wave).
constexpr int kMaxK = 4096;
constexpr int kMaxG = 16;
// Score-block shared memory above which fewer heads go into one block (2 blocks per SM).
constexpr size_t kScoreSmemTarget = 110 * 1024;
// Top-k shared memory (arrays + keys) up to which the keys are kept on chip (beyond, e.g.
// above ~45K chunks at k = 256, they stream from the workspace through L2).
constexpr size_t kTopKSmemKeysLimit = 200 * 1024;

struct SelectDesc {
  DevView view;
  const __nv_bfloat16* q;  // [h*g, d] bf16
  int* slots;              // [h, k] in/out
  int* selected;           // [h, k]
  int* miss_slot;          // [h, k]
  int* miss_chunk;         // [h, k]
  int* miss_count;         // [h]
  float* logits;           // [h, total, g] f32, workspace; NaN = excluded
  float2* partials;        // [h*g, n_blocks] (max, sum exp), workspace
  uint32_t* keys;          // [h, total] order keys, workspace
  int n_blocks;            // score slices of this item
  int pad;
};

int64_t MaxScoreBlocks(int64_t total) {
  return std::max<int64_t>(1, cuda::CeilDiv<int64_t>(total, kTileRows * kMinTilesPerBlock));
}

// Carves the workspace (base == nullptr: sizing only) and, when `descs` is given, fills
// the per-item workspace pointers.
size_t PlanSelect(const LayerShape& shape, absl::Span<const SelectItem> items, void* base,
                  SelectDesc** dev_descs, std::vector<SelectDesc>* descs) {
  const int64_t h = std::max(shape.h, 0), g = std::max(shape.g, 0);
  cuda::WorkspaceCarver c(base);
  SelectDesc* d = c.Take<SelectDesc>(items.size());
  if (dev_descs != nullptr) *dev_descs = d;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t total = cuda::SafeTotalChunks(items[i].view);
    float* logits = c.Take<float>(size_t(h * total * g));
    float2* partials = c.Take<float2>(size_t(h * g * MaxScoreBlocks(total)));
    uint32_t* keys = c.Take<uint32_t>(size_t(h * total));
    if (descs != nullptr) {
      SelectDesc& o = (*descs)[i];
      o.logits = logits;
      o.partials = partials;
      o.keys = keys;
    }
  }
  return c.bytes();
}

// (m, z) <- merge of two softmax partials (max, sum of exp(x - max)).
__device__ __forceinline__ void MergeSoftmax(float& m, float& z, float m2, float z2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) {
    m = mx;
    z = 0.0f;
    return;
  }
  z = z * expf(m - mx) + z2 * expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ void CopyView(const DevView& src, DevView& dst) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(&src);
  uint32_t* o = reinterpret_cast<uint32_t*>(&dst);
  for (int i = threadIdx.x; i < int(sizeof(DevView) / 4); i += blockDim.x) o[i] = s[i];
}

// One warp's share of a landmark tile: the 16 x g logits of its head (tensor cores),
// stored, and folded into the warp's running softmax partials.
template <int kNT, int kKS>
__device__ __forceinline__ void ScoreTile(const uint8_t* tile, int row_bytes,
                                          const uint32_t (&qf)[kKS][kNT][2], int ksteps, int warp,
                                          int lane, int d, int g, int hh, int total, int c0,
                                          int c_end, int c_begin, const uint8_t* ex, float scale,
                                          float* logits, float (&run_m)[kNT][2],
                                          float (&run_z)[kNT][2]) {
  float acc[kNT][4];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  const uint8_t* a_row = tile + (lane & 15) * row_bytes + (warp * d + (lane >> 4) * 8) * 2;
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks) {
    if (ks < ksteps) {
      uint32_t a[4];
      cuda::LdMatrixX4(a, a_row + ks * 32);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) cuda::MmaBf16(acc[nt], a, qf[ks][nt][0], qf[ks][nt][1]);
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int c = c0 + (lane >> 2) + half * 8;
    if (c >= c_end) continue;
    const bool excluded = ex[c - c_begin] != 0;
    float* out = logits + (static_cast<long long>(hh) * total + c) * g;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int n = nt * 8 + (lane & 3) * 2 + e;
        if (n >= g) continue;
        if (excluded) {
          out[n] = __int_as_float(0x7fc00000);  // NaN: not selectable
          continue;
        }
        float x = acc[nt][half * 2 + e] * scale;
        if (isnan(x)) x = -INFINITY;
        out[n] = x;
        if (x == -INFINITY) continue;  // weight 0
        float& m = run_m[nt][e];
        float& z = run_z[nt][e];
        if (x > m) {
          z = z * expf(m - x) + 1.0f;
          m = x;
        } else {
          z += expf(x - m);
        }
      }
    }
  }
}

//   landmarks (via descs) : [n_chunks, h, d] bf16 per segment
//   logits, partials      : see SelectDesc
// Block (slice x, head group y, item z): chunks [x*chunks_per_block, ...) of heads
// [y*heads_per_block, ...); warp w computes head y*heads_per_block + w.
// kNT: 8-wide n-tiles of query heads (g <= 8*kNT); kKS: max k-steps (d <= 16*kKS).
// Shared memory: q [hb*g, d+8] bf16 | excluded flags [hb, chunks_per_block] u8 |
// kStages landmark tiles [kTileRows, hb*d + 8] bf16, filled by bulk (TMA) copies, one
// per chunk row, issued by the lanes of warp 0 and completing on the stage's mbarrier.
template <int kNT, int kKS>
__global__ void __launch_bounds__(32 * kMaxHeadsPerBlock)
    ScoreKernel(const SelectDesc* __restrict__ descs, int h, int g, int d, int heads_per_block,
                int chunks_per_block, float scale) {
  __shared__ DevView view;
  __shared__ uint64_t bars[kStages];
  extern __shared__ __align__(16) uint8_t smem[];
  const SelectDesc& it = descs[blockIdx.z];
  const int total = it.view.total;
  const int c_begin = blockIdx.x * chunks_per_block;
  if (c_begin >= total) return;
  const int c_end = min(total, c_begin + chunks_per_block);
  const int h0 = blockIdx.y * heads_per_block;
  const int hb = min(heads_per_block, h - h0);
  const __nv_bfloat16* q = it.q;
  float* logits = it.logits;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  CopyView(it.view, view);

  const int q_stride = d + 8;  // padded rows: conflict-free B-fragment loads
  __nv_bfloat16* qs = reinterpret_cast<__nv_bfloat16*>(smem);
  const int q_bytes = (hb * g * q_stride * 2 + 15) / 16 * 16;
  uint8_t* ex_s = smem + q_bytes;
  uint8_t* tiles = ex_s + (hb * chunks_per_block + 15) / 16 * 16;
  for (int i = threadIdx.x; i < hb * g * d; i += blockDim.x) {
    const int row = i / d, col = i - row * d;
    qs[row * q_stride + col] = q[(static_cast<long long>(h0) * g + row) * d + col];
  }
  const int copy_bytes = hb * d * 2;      // one chunk row of the block's heads
  const int row_bytes = copy_bytes + 16;  // padded: conflict-free ldmatrix
  const int stage_bytes = kTileRows * row_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) cuda::MbarInit(&bars[s], 1);
    cuda::MbarInitFence();
  }
  __syncthreads();  // view, q, barriers

  // Called by warp 0: lane r copies row r (16 bulk copies in parallel). Rows past the
  // slice are not copied; their stale logits are never stored.
  auto issue_tile = [&](int tile, int stage) {
    const int c0 = c_begin + tile * kTileRows;
    const int rows = min(kTileRows, c_end - c0);
    if (lane == 0) {
      cuda::MbarArriveExpectTx(&bars[stage], static_cast<uint32_t>(rows * copy_bytes));
    }
    __syncwarp();
    if (lane < rows) {
      const int c = c0 + lane;
      const DevSegment& sg = view.seg[cuda::SegmentOf(view, c)];
      cuda::BulkCopy(tiles + stage * stage_bytes + lane * row_bytes,
                     sg.landmarks + (static_cast<long long>(c - sg.begin) * h + h0) * d,
                     static_cast<uint32_t>(copy_bytes), &bars[stage]);
    }
  };
  const int n_tiles = cuda::CeilDiv(c_end - c_begin, kTileRows);
  if (warp == 0) {
    for (int s = 0; s < kStages && s < n_tiles; ++s) issue_tile(s, s);
  }

  // Excluded flags of the whole slice, once (their latency overlaps the tile loads).
  for (int i = threadIdx.x; i < hb * chunks_per_block; i += blockDim.x) {
    const int w = i / chunks_per_block, c = c_begin + (i - w * chunks_per_block);
    uint8_t f = 0;
    if (c < c_end) {
      const DevSegment& sg = view.seg[cuda::SegmentOf(view, c)];
      if (sg.excluded != nullptr) {
        f = sg.excluded[static_cast<long long>(h0 + w) * sg.n_chunks + (c - sg.begin)] != 0;
      }
    }
    ex_s[i] = f;
  }
  __syncthreads();  // flags

  const bool has_head = warp < hb;
  const int hh = h0 + warp;
  const int ksteps = d / 16;
  // This warp's q as mma B fragments, for every k-step (constant over the slice).
  uint32_t qf[kKS][kNT][2];
#pragma unroll
  for (int ks = 0; ks < kKS; ++ks) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      const int n = nt * 8 + (lane >> 2);
      qf[ks][nt][0] = qf[ks][nt][1] = 0;
      if (has_head && ks < ksteps && n < g) {
        const __nv_bfloat16* qrow = qs + (warp * g + n) * q_stride + ks * 16 + (lane & 3) * 2;
        qf[ks][nt][0] = *reinterpret_cast<const uint32_t*>(qrow);
        qf[ks][nt][1] = *reinterpret_cast<const uint32_t*>(qrow + 8);
      }
    }
  }
  float run_m[kNT][2], run_z[kNT][2];
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    run_m[nt][0] = run_m[nt][1] = -INFINITY;
    run_z[nt][0] = run_z[nt][1] = 0.0f;
  }

  for (int t = 0; t < n_tiles; ++t) {
    cuda::MbarWait(&bars[t % kStages], static_cast<uint32_t>((t / kStages) & 1));
    if (has_head) {
      ScoreTile<kNT, kKS>(tiles + (t % kStages) * stage_bytes, row_bytes, qf, ksteps, warp, lane, d,
                          g, hh, total, c_begin + t * kTileRows, c_end, c_begin,
                          ex_s + warp * chunks_per_block, scale, logits, run_m, run_z);
    }
    __syncthreads();  // every warp is done with this stage
    if (warp == 0 && t + kStages < n_tiles) issue_tile(t + kStages, t % kStages);
  }
  if (!has_head) return;
  // Merge the 8 lanes that share a query-head column (same lane % 4), fixed tree.
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float m = run_m[nt][e], z = run_z[nt][e];
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float z2 = __shfl_xor_sync(0xffffffffu, z, o);
        MergeSoftmax(m, z, m2, z2);
      }
      const int n = nt * 8 + lane * 2 + e;
      if (lane < 4 && n < g) {
        it.partials[(static_cast<long long>(hh) * g + n) * it.n_blocks + blockIdx.x] =
            make_float2(m, z);
      }
    }
  }
}

// Adds 1 to hist[bin] for each active lane (warp-aggregated). Every lane of the warp calls.
__device__ __forceinline__ void HistAdd(uint32_t* hist, uint32_t bin, bool active) {
  const unsigned mask = __ballot_sync(0xffffffffu, active);
  if (active) {
    const unsigned peers = __match_any_sync(mask, bin);
    if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
  }
}

// In-place bitonic sorts of two arrays of n (a power of two) in shared memory, sharing
// one network: a descending, b ascending. Block-cooperative.
__device__ void BitonicSort2(uint64_t* a, uint64_t* b, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int pair = i % (n / 2);
        uint64_t* arr = i < n / 2 ? a : b;
        const bool descending = i < n / 2;
        const int lo = 2 * pair - (pair & (stride - 1));
        const int hi = lo + stride;
        const bool up = ((lo & size) == 0) != descending;
        const uint64_t x = arr[lo], y = arr[hi];
        if ((x > y) == up) {
          arr[lo] = y;
          arr[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

// Whether sorted ids[0, n) contain v.
__device__ __forceinline__ bool SortedContains(const int* ids, int n, int v) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (ids[mid] < v)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo < n && ids[lo] == v;
}

// Whether the slot pairs sp[0, n), sorted by their high word, hold chunk key `hi`.
__device__ __forceinline__ bool PairsContain(const uint64_t* sp, int n, uint32_t hi) {
  int lo = 0, top = n;
  while (lo < top) {
    const int mid = (lo + top) >> 1;
    if (static_cast<uint32_t>(sp[mid] >> 32) < hi)
      lo = mid + 1;
    else
      top = mid;
  }
  return lo < n && static_cast<uint32_t>(sp[lo] >> 32) == hi;
}

// Order key of one chunk from its g logits x, monotone in the CPU's score
// s = max_n exp(x_n - max_n) / sum_n (p = exp(x - c) with c = max + log(sum)), computed as
// s' = max_n (x_n - c_n) so that no exp or division runs per chunk:
//   0  excluded (NaN x[0]);  1  s = -inf (every head's softmax is empty: 0/0 on the CPU);
//   2  p underflows to 0 in fp32 (the CPU ties these, so ids break the tie);
//   else the order-preserving bit pattern of s' (> 2 for every s' >= kUnderflow).
// c_n = +inf marks a head whose softmax is empty.
constexpr float kUnderflow = -103.97f;  // exp below this is 0 in fp32

__device__ __forceinline__ uint32_t OrderKey(const float* x, int g, const float* c) {
  if (isnan(x[0])) return 0u;
  float s = -INFINITY;
  bool any = false;
  for (int n = 0; n < g; ++n) {
    if (c[n] == INFINITY) continue;
    any = true;
    s = fmaxf(s, x[n] - c[n]);
  }
  if (!any) return 1u;
  if (!(s >= kUnderflow)) return 2u;
  const uint32_t b = __float_as_uint(s);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Whether unit id (per units per chunk; per = 1: a chunk id) belongs to a chunk head hh
// may select (cpu_select.cc SelectableChunk).
__device__ __forceinline__ bool SelectableUnit(const DevView& v, int hh, int id, int per) {
  if (id < 0 || static_cast<long long>(id) >= static_cast<long long>(v.total) * per) return false;
  return cuda::SelectableChunk(v, hh, id / per);
}

// The CPU's slot diff (cpu_select.cc SlotDiff) on the whole block of kThreads threads, given
// the slot table sorted by (id, slot) in sp [k] ((slot id ^ 0x80000000) << 32 | slot): a slot
// hits when it is the lowest holding a chosen id, the misses (ids no slot holds) take the
// free slots in slot order, and free slots left over keep an id this step did not choose
// that the head may select (else -1). ids[0, kk) ascending and distinct, chunk ids (per =
// 1) or unit ids; shared memory: flag [k], free_list [k], miss_flag [k] int; scan:
// BlockScan storage. Every thread calls it.
template <int kThreads>
__device__ void SlotDiffSorted(const int* ids, int kk, int k, const DevView& v, int hh, int per,
                               int* slots, int* miss_slot, int* miss_chunk, int* miss_count,
                               const uint64_t* sp, int* flag, int* free_list, int* miss_flag,
                               typename cub::BlockScan<uint32_t, kThreads>::TempStorage& scan) {
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  const int tid = threadIdx.x;
  for (int i = tid; i < k; i += kThreads) {
    const uint64_t p = sp[i];
    const uint32_t hi = static_cast<uint32_t>(p >> 32);
    const int id = static_cast<int>(hi ^ 0x80000000u);
    const int slot = static_cast<int>(static_cast<uint32_t>(p));
    const bool first = i == 0 || static_cast<uint32_t>(sp[i - 1] >> 32) != hi;
    const bool chosen = id >= 0 && SortedContains(ids, kk, id);
    // 0: hit; 1: free, emptied unless a miss takes it; 2: free, keeps its id unless a miss
    // takes it.
    flag[slot] = first && chosen ? 0 : (!chosen && SelectableUnit(v, hh, id, per) ? 2 : 1);
  }
  for (int i = tid; i < kk; i += kThreads) {
    miss_flag[i] = PairsContain(sp, k, static_cast<uint32_t>(ids[i]) ^ 0x80000000u) ? 0 : 1;
  }
  __syncthreads();
  uint32_t n_free = 0;
  for (int b = 0; b < k; b += kThreads) {
    const int i = b + tid;
    const uint32_t f = i < k && flag[i] != 0 ? 1u : 0u;
    uint32_t excl, agg;
    BlockScan(scan).ExclusiveSum(f, excl, agg);
    if (f) free_list[n_free + excl] = i;
    n_free += agg;
    __syncthreads();
  }
  uint32_t n_miss = 0;
  for (int b = 0; b < kk; b += kThreads) {
    const int i = b + tid;
    const uint32_t f = i < kk ? static_cast<uint32_t>(miss_flag[i]) : 0u;
    uint32_t excl, agg;
    BlockScan(scan).ExclusiveSum(f, excl, agg);
    const uint32_t j = n_miss + excl;
    if (f && j < n_free) {  // j < n_free always holds for a well-formed table
      const int slot = free_list[j];
      slots[slot] = ids[i];
      miss_slot[j] = slot;
      miss_chunk[j] = ids[i];
    }
    n_miss += agg;
    __syncthreads();
  }
  n_miss = min(n_miss, n_free);
  for (uint32_t j = n_miss + tid; j < n_free; j += kThreads) {
    if (flag[free_list[j]] == 1) slots[free_list[j]] = -1;
  }
  for (int j = static_cast<int>(n_miss) + tid; j < k; j += kThreads) {
    miss_slot[j] = -1;
    miss_chunk[j] = -1;
  }
  if (tid == 0) *miss_count = static_cast<int>(n_miss);
}

// Bytes of TopKKernel's fixed shared arrays (the keys follow, 16-byte aligned). Without
// the slot diff (diff = 0) only sel_id is used.
__host__ __device__ inline int TopKArraysBytes(int k, int kpow2, int diff) {
  return diff ? (kpow2 * 16 + k * 20 + 15) / 16 * 16 : (k * 4 + 15) / 16 * 16;
}

// Block (hh, item): scores, top-k and slot diff of one KV head of one item (diff = 0:
// `selected` only, slots and miss lists untouched: SelectEx's stage 1).
// Dynamic shared memory: buf [kpow2] u64, sp [kpow2] u64, sel_id [k], sel_key [k],
// free_flag [k], free_list [k], miss_flag [k] (32-bit), then the order keys [total] u32
// when `smem_keys` (else they live in the workspace); kDiff false: sel_id [k], then the
// keys. Warp w owns the contiguous chunk range [w*per_warp, (w+1)*per_warp) and lane l reads
// chunk base + 32*i + l, so the passes over the keys need no block barrier and the warps'
// ranges are in chunk order. Two blocks of 512 threads fit an SM (at most 64 registers).
template <int kThreads, bool kDiff>
__global__ void __launch_bounds__(kThreads, kThreads <= 512 ? 2 : 1)
    TopKKernel(const SelectDesc* __restrict__ descs, int g, int k, int kpow2, int smem_keys) {
  constexpr int kWarps = kThreads / 32;
  using BlockScan = cub::BlockScan<uint32_t, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_tmp;
  __shared__ uint32_t hist[256];
  __shared__ float s_c[kMaxG];
  __shared__ uint32_t s_digit, s_rank, s_count;
  __shared__ uint32_t warp_gt[kWarps], warp_eq[kWarps];
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* buf = reinterpret_cast<uint64_t*>(smem);
  uint64_t* sp = buf + kpow2;
  int* sel_id = kDiff ? reinterpret_cast<int*>(sp + kpow2) : reinterpret_cast<int*>(smem);
  uint32_t* sel_key = reinterpret_cast<uint32_t*>(sel_id + k);
  int* free_flag = reinterpret_cast<int*>(sel_key + k);
  int* free_list = free_flag + k;
  int* miss_flag = free_list + k;

  const SelectDesc& it = descs[blockIdx.y];
  const int hh = blockIdx.x;
  const int total = it.view.total;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nb = it.n_blocks;
  uint32_t* keys = smem_keys ? reinterpret_cast<uint32_t*>(smem + TopKArraysBytes(k, kpow2, kDiff))
                             : it.keys + static_cast<long long>(hh) * total;
  const int per_warp = cuda::CeilDiv(total, kWarps * 128) * 128;  // 4 rounds of 32 at once
  const int w0 = warp * per_warp;
  const unsigned lt_mask = (1u << lane) - 1u;

  // 1. Per query head: (max, sum) over all slices, fixed merge order.
  if (warp < g) {
    float m = -INFINITY, z = 0.0f;
    const float2* part = it.partials + (static_cast<long long>(hh) * g + warp) * nb;
#pragma unroll 8
    for (int b = lane; b < nb; b += 32) {
      const float2 p = part[b];
      MergeSoftmax(m, z, p.x, p.y);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float z2 = __shfl_xor_sync(0xffffffffu, z, o);
      MergeSoftmax(m, z, m2, z2);
    }
    if (lane == 0) s_c[warp] = (m == -INFINITY || !(z > 0.0f)) ? INFINITY : m + logf(z);
  }
  for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
  if (tid == 0) s_count = 0;
  __syncthreads();

  // 2. Order keys, the histogram of their top byte, and the count of selectable chunks.
  // Four elements per lane per round, their logits loaded before any is used.
  const float* lg = it.logits + static_cast<long long>(hh) * total * g;
  uint32_t n_pos = 0;
  for (int i = 0; i < per_warp; i += 128) {
    uint32_t key[4];
    if (g == 4) {
      float4 x[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = w0 + i + 32 * u + lane;
        if (c < total) x[u] = *reinterpret_cast<const float4*>(lg + static_cast<long long>(c) * 4);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = w0 + i + 32 * u + lane;
        key[u] = 0;
        if (c < total) {
          const float xs[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
          key[u] = OrderKey(xs, 4, s_c);
          keys[c] = key[u];
        }
      }
    } else {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int c = w0 + i + 32 * u + lane;
        key[u] = 0;
        if (c < total) {
          key[u] = OrderKey(lg + static_cast<long long>(c) * g, g, s_c);
          keys[c] = key[u];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = w0 + i + 32 * u + lane;
      HistAdd(hist, key[u] >> 24, c < total);
      n_pos += __popc(__ballot_sync(0xffffffffu, c < total && key[u] > 0));
    }
  }
  if (lane == 0) atomicAdd(&s_count, n_pos);
  __syncthreads();
  const int kk = min(k, static_cast<int>(s_count));

  // 3. Radix select: the kk-th largest key T, and how many keys equal to T to take.
  uint32_t prefix = 0, pmask = 0, rank = static_cast<uint32_t>(kk);
  if (kk > 0) {
    for (int pass = 0; pass < 4; ++pass) {
      const int shift = 24 - 8 * pass;
      if (pass > 0) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        for (int i = 0; i < per_warp; i += 32) {
          const int c = w0 + i + lane;
          const uint32_t key = c < total ? keys[c] : 0u;
          HistAdd(hist, (key >> shift) & 255u, c < total && (key & pmask) == prefix);
        }
        __syncthreads();
      }
      if (warp == 0) {
        uint32_t cnt[8], sum = 0;
#pragma unroll
        for (int b = 0; b < 8; ++b) {
          cnt[b] = hist[lane * 8 + b];
          sum += cnt[b];
        }
        uint32_t incl = sum;  // bins of lanes >= lane
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const uint32_t v = __shfl_down_sync(0xffffffffu, incl, o);
          if (lane + o < 32) incl += v;
        }
        const uint32_t above = incl - sum;
        if (above < rank && rank <= incl) {
          uint32_t cum = above;
          bool found = false;
#pragma unroll
          for (int b = 7; b >= 0; --b) {
            if (!found && cum + cnt[b] >= rank) {
              s_digit = static_cast<uint32_t>(lane * 8 + b);
              s_rank = rank - cum;
              found = true;
            }
            cum += cnt[b];
          }
        }
      }
      __syncthreads();
      prefix |= s_digit << shift;
      pmask |= 255u << shift;
      rank = s_rank;
      __syncthreads();
    }
  }
  const uint32_t threshold = prefix;
  const uint32_t need_eq = rank;  // keys == threshold to take (lowest chunk ids)

  // 4. Winners in chunk-id order: per-warp counts, then positions from ballots.
  if (kk > 0) {
    uint32_t gt_n = 0, eq_n = 0;
    for (int i = 0; i < per_warp; i += 32) {
      const int c = w0 + i + lane;
      const uint32_t key = c < total ? keys[c] : 0u;
      gt_n += __popc(__ballot_sync(0xffffffffu, c < total && key > threshold));
      eq_n += __popc(__ballot_sync(0xffffffffu, c < total && key == threshold));
    }
    if (lane == 0) {
      warp_gt[warp] = gt_n;
      warp_eq[warp] = eq_n;
    }
    __syncthreads();
    uint32_t gt_off = 0, eq_off = 0;
    for (int w = 0; w < warp; ++w) {
      gt_off += warp_gt[w];
      eq_off += warp_eq[w];
    }
    for (int i = 0; i < per_warp; i += 32) {
      const int c = w0 + i + lane;
      const uint32_t key = c < total ? keys[c] : 0u;
      const bool gt = c < total && key > threshold;
      const bool eq = c < total && key == threshold;
      const unsigned bg = __ballot_sync(0xffffffffu, gt);
      const unsigned be = __ballot_sync(0xffffffffu, eq);
      const uint32_t gt_before = gt_off + __popc(bg & lt_mask);
      const uint32_t eq_before = eq_off + __popc(be & lt_mask);
      if (gt || (eq && eq_before < need_eq)) {
        const uint32_t pos = gt_before + min(eq_before, need_eq);
        sel_id[pos] = c;
        if constexpr (kDiff) sel_key[pos] = key;
      }
      gt_off += __popc(bg);
      eq_off += __popc(be);
    }
  }
  __syncthreads();

  // 5. `selected`: (score desc, id asc), -1 padded. SelectEx's stage 1 (no diff) keeps its
  // candidates in chunk-id order instead: every consumer ranks them again, and the sort of
  // k1 (up to 4096) keys would be most of this kernel's time.
  if constexpr (!kDiff) {
    int* cand = it.selected + static_cast<long long>(hh) * k;
    for (int i = tid; i < k; i += blockDim.x) cand[i] = i < kk ? sel_id[i] : -1;
  } else {
    for (int i = tid; i < kpow2; i += blockDim.x) {
      buf[i] = i < kk ? (static_cast<uint64_t>(sel_key[i]) << 32) |
                            (0xffffffffu - static_cast<uint32_t>(sel_id[i]))
                      : 0ull;
    }
    int* slots = it.slots + static_cast<long long>(hh) * k;
    for (int i = tid; i < kpow2; i += blockDim.x) {
      sp[i] = i < k ? (static_cast<uint64_t>(static_cast<uint32_t>(slots[i]) ^ 0x80000000u) << 32) |
                          static_cast<uint32_t>(i)
                    : ~0ull;
    }
    __syncthreads();
    BitonicSort2(buf, sp, kpow2);
    int* selected = it.selected + static_cast<long long>(hh) * k;
    for (int i = tid; i < k; i += blockDim.x) {
      selected[i] = i < kk ? static_cast<int>(0xffffffffu - static_cast<uint32_t>(buf[i])) : -1;
    }

    // 6. Slot diff (sp sorted above with the selection).
    SlotDiffSorted<kThreads>(sel_id, kk, k, it.view, hh, 1, slots,
                             it.miss_slot + static_cast<long long>(hh) * k,
                             it.miss_chunk + static_cast<long long>(hh) * k, it.miss_count + hh, sp,
                             free_flag, free_list, miss_flag, scan_tmp);
  }
}

size_t ScoreSmemBytes(int hb, int g, int d, int chunks_per_block) {
  const size_t q_bytes = (size_t(hb) * g * (d + 8) * 2 + 15) / 16 * 16;
  const size_t ex_bytes = (size_t(hb) * chunks_per_block + 15) / 16 * 16;
  return q_bytes + ex_bytes + size_t(kStages) * kTileRows * (size_t(hb) * d * 2 + 16);
}

template <int kNT, int kKS>
absl::Status LaunchScore(dim3 grid, int hb, size_t smem, cudaStream_t st, const SelectDesc* descs,
                         int h, int g, int d, int chunks_per_block, float scale) {
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      ScoreKernel<kNT, kKS>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  ScoreKernel<kNT, kKS><<<grid, 32 * hb, smem, st>>>(descs, h, g, d, hb, chunks_per_block, scale);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

template <int kThreads, bool kDiff>
absl::Status LaunchTopKAs(dim3 grid, size_t smem, cudaStream_t st, const SelectDesc* descs, int g,
                          int k, int kpow2, bool smem_keys) {
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      TopKKernel<kThreads, kDiff>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  TopKKernel<kThreads, kDiff><<<grid, kThreads, smem, st>>>(descs, g, k, kpow2, smem_keys ? 1 : 0);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

template <int kThreads>
absl::Status LaunchTopK(dim3 grid, size_t smem, cudaStream_t st, const SelectDesc* descs, int g,
                        int k, int kpow2, bool smem_keys, bool diff) {
  return diff ? LaunchTopKAs<kThreads, true>(grid, smem, st, descs, g, k, kpow2, smem_keys)
              : LaunchTopKAs<kThreads, false>(grid, smem, st, descs, g, k, kpow2, smem_keys);
}

int NextPow2(int x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Checks this backend's limits for Select at width k.
absl::Status CheckSelectLimits(const LayerShape& shape, int k, absl::Span<const SelectItem> items) {
  const int h = shape.h, g = shape.g, d = shape.d;
  if (d % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("Select: the CUDA backend needs d % 16 == 0, got d = ", d));
  }
  if (g > kMaxG) {
    return absl::InvalidArgumentError(
        absl::StrCat("Select: the CUDA backend supports g <= ", kMaxG, ", got g = ", g));
  }
  if (k > kMaxK) {
    return absl::InvalidArgumentError(
        absl::StrCat("Select: the CUDA backend supports k <= ", kMaxK, ", got k = ", k));
  }
  if (h > 65535 || items.size() > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("Select: h (", h, ") and the item count (",
                                                   items.size(), ") must be <= 65535"));
  }
  for (size_t i = 0; i < items.size(); ++i) {
    for (int s = 0; s < items[i].view.n_segments; ++s) {
      const SegmentView& seg = items[i].view.segments[s];
      if (seg.n_chunks > 0 && !cuda::Aligned16(seg.landmarks)) {
        return absl::InvalidArgumentError(absl::StrCat("Select: items[", i, "].view.segments[", s,
                                                       "].landmarks must be 16-byte aligned"));
      }
    }
  }
  return absl::OkStatus();
}

// Select's kernels over validated items (ws sized by PlanSelect); `out` receives the
// item descriptors (workspace pointers) when given.
// diff = false: `selected` only, in chunk-id order (SelectEx's stage 1: the items' slots and
// miss lists are neither read nor written, and the candidates are ranked again after it).
absl::Status LaunchSelect(int device_, const LayerShape& shape, int k,
                          absl::Span<const SelectItem> items, void* ws_data, cudaStream_t st,
                          std::vector<SelectDesc>* out, bool diff = true) {
  const int h = shape.h, g = shape.g, d = shape.d;
  int sms = 0, optin = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_));
  const size_t smem_limit = size_t(optin) - sizeof(DevView);

  // Heads per score block: up to 8, fewer when their tiles would not leave room for two
  // blocks per SM.
  constexpr int kMaxChunksPerBlock = kMaxTilesPerBlock * kTileRows;
  int hb = std::min(h, kMaxHeadsPerBlock);
  while (hb > 1 && ScoreSmemBytes(hb, g, d, kMaxChunksPerBlock) > kScoreSmemTarget) --hb;
  if (ScoreSmemBytes(hb, g, d, kMaxChunksPerBlock) > smem_limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("Select: head dim ", d, " with g = ", g, " needs ",
                     ScoreSmemBytes(hb, g, d, kMaxChunksPerBlock),
                     " bytes of shared memory per block, above the device limit ", smem_limit));
  }
  const int head_groups = cuda::CeilDiv(h, hb);

  // Chunk slices: about 4 blocks per SM over the whole batch, 2..32 tiles each.
  int64_t total_tiles = 0;
  for (const SelectItem& it : items) {
    total_tiles += cuda::CeilDiv<int64_t>(it.view.total_chunks(), kTileRows) * head_groups;
  }
  const int tiles_per_block = static_cast<int>(
      std::clamp<int64_t>(cuda::CeilDiv<int64_t>(total_tiles, int64_t(4) * std::max(sms, 1)),
                          kMinTilesPerBlock, kMaxTilesPerBlock));
  const int chunks_per_block = tiles_per_block * kTileRows;
  const size_t score_smem = ScoreSmemBytes(hb, g, d, chunks_per_block);

  std::vector<SelectDesc> descs(items.size());
  SelectDesc* dev_descs = nullptr;
  PlanSelect(shape, items, ws_data, &dev_descs, &descs);
  int max_blocks = 1;
  for (size_t i = 0; i < items.size(); ++i) {
    const SelectItem& in = items[i];
    SelectDesc& o = descs[i];
    o.view = cuda::MakeDevView(in.view);
    o.q = cuda::AsNv(in.q);
    o.slots = in.slots;
    o.selected = in.selected;
    o.miss_slot = in.miss_slot;
    o.miss_chunk = in.miss_chunk;
    o.miss_count = in.miss_count;
    o.n_blocks = cuda::CeilDiv(o.view.total, chunks_per_block);
    o.pad = 0;
    max_blocks = std::max(max_blocks, o.n_blocks);
  }
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), dev_descs, st));

  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const dim3 score_grid(max_blocks, head_groups, static_cast<unsigned>(items.size()));
  if (g <= 8 && d <= 128) {
    KVSHADE_RETURN_IF_ERROR((LaunchScore<1, 8>(score_grid, hb, score_smem, st, dev_descs, h, g, d,
                                               chunks_per_block, scale)));
  } else if (g <= 8) {
    KVSHADE_RETURN_IF_ERROR((LaunchScore<1, 16>(score_grid, hb, score_smem, st, dev_descs, h, g, d,
                                                chunks_per_block, scale)));
  } else if (d <= 128) {
    KVSHADE_RETURN_IF_ERROR((LaunchScore<2, 8>(score_grid, hb, score_smem, st, dev_descs, h, g, d,
                                               chunks_per_block, scale)));
  } else {
    KVSHADE_RETURN_IF_ERROR((LaunchScore<2, 16>(score_grid, hb, score_smem, st, dev_descs, h, g, d,
                                                chunks_per_block, scale)));
  }

  // Top-k: the order keys stay in shared memory when the longest item's fit.
  const int kpow2 = NextPow2(k);
  int max_total = 0;
  for (const SelectDesc& o : descs) max_total = std::max(max_total, o.view.total);
  const size_t arrays = size_t(TopKArraysBytes(k, kpow2, diff ? 1 : 0));
  const size_t keys_bytes = size_t(max_total) * 4;
  const bool smem_keys = arrays + keys_bytes <= std::min<size_t>(kTopKSmemKeysLimit, optin);
  const size_t topk_smem = arrays + (smem_keys ? keys_bytes : 0);
  const dim3 topk_grid(h, static_cast<unsigned>(items.size()));
  if (int64_t(h) * int64_t(items.size()) < sms) {
    KVSHADE_RETURN_IF_ERROR(
        LaunchTopK<1024>(topk_grid, topk_smem, st, dev_descs, g, k, kpow2, smem_keys, diff));
  } else {
    KVSHADE_RETURN_IF_ERROR(
        LaunchTopK<512>(topk_grid, topk_smem, st, dev_descs, g, k, kpow2, smem_keys, diff));
  }
  if (out != nullptr) *out = std::move(descs);
  return absl::OkStatus();
}

}  // namespace

size_t CudaBackend::SelectWorkspaceBytes(const LayerShape& shape, int k,
                                         absl::Span<const SelectItem> items) const {
  (void)k;
  return PlanSelect(shape, items, nullptr, nullptr, nullptr);
}

absl::Status CudaBackend::Select(const LayerShape& shape, int k, absl::Span<const SelectItem> items,
                                 Workspace ws, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Select(shape, k, items, ws, SelectWorkspaceBytes(shape, k, items)));
  if (items.empty()) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(CheckSelectLimits(shape, k, items));
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  return LaunchSelect(device_, shape, k, items, ws.data, cuda::ToCudaStream(stream), nullptr);
}

// ---------------------------------------------------------------------------------------
// SelectEx and AssignSlots (SelectOptions in backend.h; the CPU reference is cpu_select.cc).
//   Candidates per (item, head), m of them (row width `width`):
//     - two-stage items whose total chunks <= candidates ("all" items): every selectable
//       chunk (FillAllKernel), width = total;
//     - every other item: Select's two kernels at k1 = max(candidates, k) (or k in one
//       stage) into a scratch slot table, their `selected` rows being the candidates.
//   Stage2Kernel (two stages): one warp per candidate reconstructs its C keys (fp32 sums,
//     RoPE as the reference, bf16 rounding) and, per query head n of the group, keeps the
//     max M and S = sum_t exp(l - M) of the logits l = q_n . k / sqrt(d) over its tokens
//     (lane n, in token order, rescaled when the max grows, as cpu_select.cc ChunkStats):
//     stats [h, width, g] (M, S).
//   Stage2SigTokenKernel (two stages, `signatures`; Stage2SigKernel, a warp per candidate,
//     when C is not a power of two <= 32 or g > 16): the same stats, each token's logit
//     from its chunk's landmark and its key signature instead of a reconstructed key, a
//     lane per token: the CPU's logits bit for bit (an int8 query's integer dot with the
//     codes, __dp4a where specialised, and the base's two channel-order halves).
//   One stage: FinalKernel (block per item and head) scores each candidate by Select's
//     landmark probability s (from the stage-1 logits and softmax partials), ranks them by
//     (score desc, id asc) with a bitonic sort in shared memory, cuts at the mass budget
//     (thread 0 sums in rank order, as the CPU does), writes `selected`, and does the slot
//     diff exactly as the CPU (sorted ids, binary search, first slot hits).
//   Two stages: LsePartKernel and FinalUnitKernel (below, with the selection units: whole
//     chunks are units of C tokens, one per candidate) form per query head LSE_n = log sum
//     over the candidates of S exp(M), score m = max_n exp(M - LSE_n) and mass w = max_n
//     exp(M + log S - LSE_n) (cpu_select.cc StageTwoScores), and rank by (m desc, id asc).
//   Sums run in a different order than the CPU's, so ids whose scores tie to within fp32
//   rounding can swap (the parity tests allow it). Limits: Select's, plus k1 <= 4096 and,
//   for "all" items, total <= 16384 chunks (the shared-memory sort).
//   Selection units (SelectOptions::unit below C) have stage-2 kernels of their own
//   (SelectExUnits, below the whole-chunk kernels).
namespace {

constexpr int kMaxAllChunks = 16384;
constexpr int kStage2Warps = 8;

struct ExDesc {
  DevView view;
  const __nv_bfloat16* q;
  int* cand;            // [h, width] candidate ids (-1 = none)
  float2* stats;        // [h, width, g] stage-2 (M, S) per candidate and query head (two
                        // stages)
  float2* lse_part;     // [h, lse_blocks, g] (max, sum) of M + log S per block of
                        // candidate units and query head (two stages; LsePartKernel)
  int lse_blocks;
  const float* logits;  // stage 1: [h, total, g] (one stage only)
  const float2* partials;
  int n_blocks;
  int width;
  int kpow2;            // >= width, power of two
  int all;              // 1: candidates are every selectable chunk
  int* slots;
  int* selected;
  int* miss_slot;
  int* miss_chunk;
  int* miss_count;
};

struct ExPlan {
  ExDesc* dev_descs = nullptr;
  std::vector<SelectItem> stage1;      // items that run Select's kernels (at width k1)
  std::vector<size_t> stage1_index;    // their index in the batch
  void* stage1_ws = nullptr;
  size_t bytes = 0;
};

int ExK1(int k, const SelectOptions& o) { return o.two_stage() ? std::max(o.candidates, k) : k; }

// LsePartKernel: a block reduces kLseElems (candidate unit, query head) statistics.
constexpr int kLseThreads = 256;
constexpr int kLseElems = 4096;

// Blocks of LsePartKernel per head row of `units` candidate units (at least one).
int LseBlocks(int64_t units, int64_t g) {
  const int64_t span = kLseElems / std::max<int64_t>(g, 1);
  return static_cast<int>(std::max<int64_t>(1, (units + span - 1) / span));
}

// Carves SelectEx's workspace (whole chunks: per = 1; units: per = C/u units per chunk,
// stage-2 statistics per unit) for stage-1 width k1; with base set, fills descs (host)
// and plan. An item is "all" (no stage 1: every selectable chunk is a candidate) when two
// stages would keep at least its chunk count.
size_t PlanCandidates(const LayerShape& shape, int k1, int64_t per, bool two_stage,
                      absl::Span<const SelectItem> items, void* base, std::vector<ExDesc>* descs,
                      ExPlan* plan) {
  if (items.empty()) return 0;  // nothing to select: no workspace (a caller's probe)
  const int64_t h = std::max(shape.h, 0), g = std::max(shape.g, 0);
  cuda::WorkspaceCarver c(base);
  ExDesc* dd = c.Take<ExDesc>(items.size());
  std::vector<SelectItem> s1;
  std::vector<size_t> s1_index;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t total = cuda::SafeTotalChunks(items[i].view);
    const bool all = two_stage && total <= k1;
    const int64_t width = all ? total : k1;
    int* cand = c.Take<int>(size_t(h * width));
    float2* stats = two_stage ? c.Take<float2>(size_t(h * width * per * g)) : nullptr;
    const int lse_blocks = two_stage ? LseBlocks(width * per, g) : 0;
    float2* lse_part = two_stage ? c.Take<float2>(size_t(h * lse_blocks * g)) : nullptr;
    if (descs != nullptr) {
      ExDesc& e = (*descs)[i];
      e.cand = cand;
      e.stats = stats;
      e.lse_part = lse_part;
      e.lse_blocks = lse_blocks;
      e.width = static_cast<int>(width);
      e.all = all ? 1 : 0;
    }
    if (!all) {
      SelectItem si = items[i];
      si.selected = cand;
      // Stage 1 keeps its candidates only (LaunchSelect with diff = false): no slot table.
      si.slots = si.miss_slot = si.miss_chunk = si.miss_count = nullptr;
      s1.push_back(si);
      s1_index.push_back(i);
    }
  }
  void* s1_ws = c.Take<std::byte>(PlanSelect(shape, s1, nullptr, nullptr, nullptr));
  if (plan != nullptr) {
    plan->dev_descs = dd;
    plan->stage1 = std::move(s1);
    plan->stage1_index = std::move(s1_index);
    plan->stage1_ws = s1_ws;
  }
  return c.bytes();
}

size_t PlanSelectEx(const LayerShape& shape, int k, const SelectOptions& o,
                    absl::Span<const SelectItem> items, void* base, std::vector<ExDesc>* descs,
                    ExPlan* plan) {
  return PlanCandidates(shape, ExK1(std::max(k, 0), o), 1, o.two_stage(), items, base, descs,
                        plan);
}

// Block (item), "all" items only: cand[hh, c] = c for selectable chunks, -1 for static ones.
__global__ void FillAllKernel(const ExDesc* __restrict__ descs, int h) {
  const ExDesc& e = descs[blockIdx.x];
  if (!e.all) return;  // stage 1 chose this item's candidates
  const DevView& v = e.view;
  for (long long i = threadIdx.x; i < static_cast<long long>(h) * e.width; i += blockDim.x) {
    const int hh = static_cast<int>(i / e.width), c = static_cast<int>(i % e.width);
    const DevSegment& sg = v.seg[cuda::SegmentOf(v, c)];
    const bool ex = sg.excluded != nullptr &&
                    sg.excluded[static_cast<long long>(hh) * sg.n_chunks + (c - sg.begin)] != 0;
    e.cand[i] = ex ? -1 : c;
  }
}

// One stage-2 logit into a candidate's running (M, S) of one query head, in token order
// (cpu_select.cc FoldLogit): non-finite logits carry no weight.
__device__ __forceinline__ void FoldLogit(float logit, float* m, float* sum) {
  if (!isfinite(logit)) return;
  if (logit > *m) {
    *sum = __fadd_rn(__fmul_rn(*sum, expf(*m - logit)), 1.0f);
    *m = logit;
  } else {
    *sum = __fadd_rn(*sum, expf(logit - *m));
  }
}

// Grid (candidate groups, h, items); warp w scores candidate blockIdx.x*kStage2Warps + w.
// Dynamic shared memory: kStage2Warps rows of d floats. Lane n (< g <= 32) keeps query head
// n's (M, S); non-finite logits carry no weight (M = -inf, S = 0 for a head without one).
__global__ void __launch_bounds__(32 * kStage2Warps)
    Stage2Kernel(const ExDesc* __restrict__ descs, int g, int d, int C, float scale,
                 const __grid_constant__ cuda::DeviceRope rope) {
  extern __shared__ __align__(16) float rows[];
  const ExDesc& e = descs[blockIdx.z];
  const int hh = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kStage2Warps + warp;
  if (i >= e.width) return;
  const long long at = static_cast<long long>(hh) * e.width + i;
  float2* stats = e.stats + at * g;
  const int c = e.cand[at];
  if (c < 0) {
    if (lane < g) stats[lane] = make_float2(-INFINITY, 0.0f);
    return;
  }
  const DevView& v = e.view;
  const DevSegment& sg = v.seg[cuda::SegmentOf(v, c)];
  const int local = c - sg.begin, r = v.r;
  const __nv_bfloat16* b = v.b + static_cast<long long>(hh) * r * d;
  float* acc = rows + warp * d;
  float run_m = -INFINITY, run_s = 0.0f;  // this lane's query head (lane < g)
  for (int t = 0; t < C; ++t) {
    const __nv_bfloat16* a = sg.a + (static_cast<long long>(local) * C + t) * r;
    for (int ch = lane; ch < d; ch += 32) {
      float x = 0.0f;
      for (int j = 0; j < r; ++j) {
        x = __fadd_rn(x, __fmul_rn(__bfloat162float(a[j]),
                                    __bfloat162float(b[static_cast<long long>(j) * d + ch])));
      }
      acc[ch] = x;
    }
    __syncwarp();
    const long long pos = sg.first_position + static_cast<long long>(local) * C + t;
    for (int pr = lane; pr < rope.rotary_dim / 2; pr += 32) {
      float cs, sn;
      cuda::RopeCosSin(rope, pos, pr, &cs, &sn);
      const int2 dims = cuda::RopePairDims(rope, pr);
      cuda::RopeRotate(cs, sn, &acc[dims.x], &acc[dims.y]);
    }
    __syncwarp();
    for (int n = 0; n < g; ++n) {
      const __nv_bfloat16* qv = e.q + static_cast<long long>(hh * g + n) * d;
      float part = 0.0f;
      for (int ch = lane; ch < d; ch += 32) {
        const float kv = __bfloat162float(__float2bfloat16_rn(acc[ch]));
        part = __fadd_rn(part, __fmul_rn(__bfloat162float(qv[ch]), kv));
      }
      // Butterfly: every lane ends with the same sum.
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
      const float logit = __fmul_rn(part, scale);
      if (lane == n) FoldLogit(logit, &run_m, &run_s);
    }
    __syncwarp();
  }
  if (lane < g) stats[lane] = make_float2(run_m, run_s);
}

// The group's query rows for stage 2 from key signatures, in shared memory (LoadSigQuery):
// per (query head n, channel half) a row of the bf16 query as f32, for the base
// dot(q_n, L[c]) (SignatureBaseReference: the two halves' fp32 sums), rows of d/2 + 4
// floats (16-byte aligned; the 8 rows a candidate's lanes read at once fall in different
// banks); then the int8 rows of SignatureQueryReference, in channel order ([g, d]) or, for
// the kernels specialised for kBits, packed as the codes unpack (SigPackedIndex); then per
// head hs = query scale / 2 (NaN for a non-finite row) and qsum = the sum of its int8 row.
struct SigQuery {
  const float* qf;
  const int8_t* q8;
  const float* hs;
  const int* qsum;
  int hq;  // floats per row of qf

  __host__ __device__ static int HalfStride(int d) { return d / 2 + 4; }
  __host__ __device__ static size_t Bytes(int g, int d) {
    return size_t(2) * g * HalfStride(d) * sizeof(float) + size_t(g) * d + size_t(g) * 8;
  }
  // The row of query head n, channel half (0 or 1).
  __device__ const float* Row(int n, int half) const { return qf + (2 * n + half) * hq; }
  // Query head n's signature dot from its integer sum D = sum q8 * code:
  // float(2*D - levels*qsum) * hs, one rounding (SignatureDotReference).
  __device__ float Dot(int n, int dot, int levels) const {
    return __fmul_rn(static_cast<float>(2 * dot - levels * qsum[n]), hs[n]);
  }
};

// Byte index of query head n's int8 at channel ch in the packed layout of kBits-bit codes:
// record word w holds channels [w*P, (w+1)*P) (P = 32 / kBits); shifting it right by
// kBits*s and masking every byte's low kBits gives 4 codes, byte j holding channel
// w*P + j*(8/kBits) + s; the int8 rows are packed in the same order, one int32 per
// (n, w, s), so that one __dp4a takes 4 products.
template <int kBits>
__device__ __forceinline__ int SigPackedIndex(int n, int ch, int d) {
  constexpr int kP = 32 / kBits, kS = 8 / kBits;
  const int w = ch / kP, p = ch - w * kP;
  return ((n * (d / kP) + w) * kS + p % kS) * 4 + p / kS;
}

// Fills the SigQuery of KV head hh's query group (rows q [g, d] bf16) in smem (SigQuery::
// Bytes) with the block, the int8 rows as SignatureQueryReference forms them (the maximum
// and flags by warp reductions, which are exact). Ends with a block barrier.
template <int kBits>
__device__ SigQuery LoadSigQuery(const __nv_bfloat16* q, int g, int d, uint8_t* smem) {
  SigQuery s;
  s.hq = SigQuery::HalfStride(d);
  float* qf = reinterpret_cast<float*>(smem);
  int8_t* q8 = reinterpret_cast<int8_t*>(smem + size_t(2) * g * s.hq * sizeof(float));
  float* hs = reinterpret_cast<float*>(q8 + size_t(g) * d);
  int* qsum = reinterpret_cast<int*>(hs + g);
  const int half_d = d / 2;
  for (int x = threadIdx.x; x < g * d; x += blockDim.x) {
    const int n = x / d, ch = x - n * d, half = ch >= half_d;
    qf[(2 * n + half) * s.hq + ch - half * half_d] = __bfloat162float(q[x]);
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int n = warp; n < g; n += warps) {
    auto at = [&](int ch) {
      const int half = ch >= half_d;
      return qf[(2 * n + half) * s.hq + ch - half * half_d];
    };
    float amax = 0.0f;
    bool finite = true;
    for (int ch = lane; ch < d; ch += 32) {
      const float x = at(ch);
      finite = finite && isfinite(x);
      amax = fmaxf(amax, fabsf(x));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    finite = __all_sync(0xffffffffu, finite);
    const bool zero = !finite || amax == 0.0f;
    const float inv = zero ? 0.0f : __fdiv_rn(127.0f, amax);
    int sum = 0;
    for (int ch = lane; ch < d; ch += 32) {
      const int v = zero ? 0 : __float2int_rn(__fmul_rn(at(ch), inv));
      if constexpr (kBits > 0) {
        q8[SigPackedIndex<kBits>(n, ch, d)] = static_cast<int8_t>(v);
      } else {
        q8[n * d + ch] = static_cast<int8_t>(v);
      }
      sum += v;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      hs[n] = !finite ? __int_as_float(0x7fc00000)
                      : (amax == 0.0f ? 0.0f : __fmul_rn(__fdiv_rn(amax, 127.0f), 0.5f));
      qsum[n] = sum;
    }
  }
  __syncthreads();
  s.qf = qf;
  s.q8 = q8;
  s.hs = hs;
  s.qsum = qsum;
  return s;
}

// One half of a signature base (SignatureBaseReference): the fp32 sum of row[i] * lm[i]
// over i in [0, n) in order, each product and sum rounded. kVec: lm 16-byte aligned and n
// a multiple of 8 (read 8 channels at a time; the same sum).
template <bool kVec>
__device__ __forceinline__ float SigBaseHalf(const float* row, const __nv_bfloat16* lm, int n) {
  float b = 0.0f;
  if constexpr (kVec) {
    for (int i = 0; i < n; i += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(lm + i);
      const __nv_bfloat162* xb = reinterpret_cast<const __nv_bfloat162*>(&raw);
      const float4 q0 = *reinterpret_cast<const float4*>(row + i);
      const float4 q1 = *reinterpret_cast<const float4*>(row + i + 4);
      b = __fadd_rn(b, __fmul_rn(q0.x, __low2float(xb[0])));
      b = __fadd_rn(b, __fmul_rn(q0.y, __high2float(xb[0])));
      b = __fadd_rn(b, __fmul_rn(q0.z, __low2float(xb[1])));
      b = __fadd_rn(b, __fmul_rn(q0.w, __high2float(xb[1])));
      b = __fadd_rn(b, __fmul_rn(q1.x, __low2float(xb[2])));
      b = __fadd_rn(b, __fmul_rn(q1.y, __high2float(xb[2])));
      b = __fadd_rn(b, __fmul_rn(q1.z, __low2float(xb[3])));
      b = __fadd_rn(b, __fmul_rn(q1.w, __high2float(xb[3])));
    }
  } else {
    for (int i = 0; i < n; ++i) b = __fadd_rn(b, __fmul_rn(row[i], __bfloat162float(lm[i])));
  }
  return b;
}

// Stage 2 from key signatures (SelectOptions::signatures; cpu_select.cc ChunkStatsSig):
// same grid and outputs as Stage2Kernel, for the shapes the token-per-lane kernels do not
// take. Per query head n, lanes 0 and 1 form the base's two halves and the warp sums each
// token's integer dot (lane l reads channels l, l+32, ..; integer sums are exact in any
// order); lane n folds l = (base + scale_t * dot) * scale in token order. Dynamic shared
// memory: the SigQuery (channel order).
__global__ void __launch_bounds__(32 * kStage2Warps)
    Stage2SigKernel(const ExDesc* __restrict__ descs, int g, int d, int C, float scale) {
  extern __shared__ __align__(16) uint8_t sigw_smem[];
  const ExDesc& e = descs[blockIdx.z];
  const int hh = blockIdx.y, h = gridDim.y;
  const SigQuery sq = LoadSigQuery<0>(e.q + static_cast<long long>(hh) * g * d, g, d, sigw_smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kStage2Warps + warp;
  if (i >= e.width) return;
  const long long at = static_cast<long long>(hh) * e.width + i;
  float2* stats = e.stats + at * g;
  const int c = e.cand[at];
  if (c < 0) {
    if (lane < g) stats[lane] = make_float2(-INFINITY, 0.0f);
    return;
  }
  const DevView& v = e.view;
  const DevSegment& sg = v.seg[cuda::SegmentOf(v, c)];
  const int local = c - sg.begin;
  const int bits = v.sig_bits, levels = (1 << bits) - 1, per_word = 32 / bits;
  const long long rec = static_cast<long long>(d) * bits / 8 + 4;
  const __nv_bfloat16* lm = sg.landmarks + (static_cast<long long>(local) * h + hh) * d;
  float run_m = -INFINITY, run_s = 0.0f;  // this lane's query head (lane < g)
  for (int n = 0; n < g; ++n) {
    float part = lane < 2 ? SigBaseHalf<false>(sq.Row(n, lane), lm + lane * (d / 2), d / 2) : 0.0f;
    const float base = __fadd_rn(__shfl_sync(0xffffffffu, part, 0),
                                 __shfl_sync(0xffffffffu, part, 1));
    const int8_t* q8 = sq.q8 + n * d;
    for (int t = 0; t < C; ++t) {
      const uint8_t* r = sg.sig + ((static_cast<long long>(local) * C + t) * h + hh) * rec;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(r);
      int dot = 0;
      for (int ch = lane; ch < d; ch += 32) {
        const int code = static_cast<int>((words[ch / per_word] >> (bits * (ch % per_word))) &
                                          static_cast<uint32_t>(levels));
        dot += static_cast<int>(q8[ch]) * code;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      const float sc = *reinterpret_cast<const float*>(r + static_cast<long long>(d) * bits / 8);
      const float logit = __fmul_rn(__fadd_rn(base, __fmul_rn(sc, sq.Dot(n, dot, levels))), scale);
      if (lane == n) FoldLogit(logit, &run_m, &run_s);
    }
  }
  if (lane < g) stats[lane] = make_float2(run_m, run_s);
}

// Stage 2 from key signatures, token-parallel (C a power of two <= 32, g <= kMaxG; the
// launcher falls back to Stage2SigKernel otherwise): each lane scores one token, a warp
// 32 / C candidates, each logit the CPU's bit for bit (SigSums). Block
// (candidate group, hh, item) of kSigWarps warps, the group's SigQuery in shared memory.
constexpr int kSigWarps = 8;

// This lane's candidate (a warp holds 32 / kC of them) and token, the signature layout,
// and where the candidate's landmark and the token's signature record are.
template <int kC>
struct SigLane {
  int t;           // the lane's token in its candidate
  bool active;     // the candidate is inside the item's width
  long long at;    // the candidate's index in cand (0 for an inactive lane)
  int c;           // the candidate chunk (-1: padding or inactive)
  int bits, levels, per_word;
  // For a candidate (c >= 0): its landmark row of head hh, the token's record and scale.
  const __nv_bfloat16* lm = nullptr;
  const uint32_t* words = nullptr;
  float sc = 0.0f;

  __device__ SigLane(const ExDesc& e, int hh, int h, int d) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int i = (blockIdx.x * kSigWarps + warp) * (32 / kC) + lane / kC;
    t = lane % kC;
    active = i < e.width;
    at = static_cast<long long>(hh) * e.width + (active ? i : 0);
    c = active ? e.cand[at] : -1;
    bits = e.view.sig_bits;
    levels = (1 << bits) - 1;
    per_word = 32 / bits;
    const long long rec = static_cast<long long>(d) * bits / 8 + 4;
    if (c >= 0) {
      const DevSegment& sg = e.view.seg[cuda::SegmentOf(e.view, c)];
      const int local = c - sg.begin;
      lm = sg.landmarks + (static_cast<long long>(local) * h + hh) * d;
      const uint8_t* r = sg.sig + ((static_cast<long long>(local) * kC + t) * h + hh) * rec;
      words = reinterpret_cast<const uint32_t*>(r);
      sc = *reinterpret_cast<const float*>(r + static_cast<long long>(d) * bits / 8);
    }
  }
};

// The per-lane sums of the token-per-lane kernels, g <= kG query heads: dot[n] = the
// integer sum q8_n . code_t of this lane's token, and the base halves (SigQuery::Row) this
// lane forms for its candidate: job j = 2n + half is lane j % kC's own[j / kC], so each
// half is formed once per candidate and Base(n) hands it to the candidate's lanes. kBits
// 2, 4 or 8: the packed int8 rows, one __dp4a per 4 channels, landmarks read 8 channels at
// a time (d a multiple of 32, landmark rows 16-byte aligned); 8-bit codes (0..255) go in
// as signed bytes code - 128 (the word XOR 0x80808080), the sum corrected by 128 * qsum;
// kBits 0: the view's bits at run time, channel order.
template <int kC, int kBits, int kG>
struct SigSums {
  static constexpr int kOwn = (2 * kG + kC - 1) / kC;
  int dot[kG];
  float own[kOwn];

  __device__ void Run(const SigLane<kC>& sl, const SigQuery& q, int g, int d) {
#pragma unroll
    for (int n = 0; n < kG; ++n) dot[n] = 0;
#pragma unroll
    for (int o = 0; o < kOwn; ++o) own[o] = 0.0f;
    if (sl.c < 0) return;
    const int half_d = d / 2;
#pragma unroll
    for (int o = 0; o < kOwn; ++o) {
      const int j = sl.t + o * kC;
      if (j < 2 * g) {
        own[o] = SigBaseHalf<(kBits > 0)>(q.Row(j >> 1, j & 1), sl.lm + (j & 1) * half_d, half_d);
      }
    }
    if constexpr (kBits == 8) {
      const int n_words = d / 4;
      const int* qp = reinterpret_cast<const int*>(q.q8);
      for (int w = 0; w < n_words; ++w) {
        const int word = static_cast<int>(sl.words[w] ^ 0x80808080u);
#pragma unroll
        for (int n = 0; n < kG; ++n) dot[n] = __dp4a(qp[n * n_words + w], word, dot[n]);
      }
#pragma unroll
      for (int n = 0; n < kG; ++n) {
        if (n < g) dot[n] += 128 * q.qsum[n];
      }
    } else if constexpr (kBits > 0) {
      constexpr int kP = 32 / kBits, kS = 8 / kBits;
      constexpr uint32_t kMask = kBits == 4 ? 0x0f0f0f0fu : 0x03030303u;
      const int n_words = d / kP;
      const int* qp = reinterpret_cast<const int*>(q.q8);
      for (int w = 0; w < n_words; ++w) {
        const uint32_t word = sl.words[w];
#pragma unroll
        for (int n = 0; n < kG; ++n) {
          const int* qw = qp + (n * n_words + w) * kS;
          if constexpr (kS == 2) {
            const int2 qq = *reinterpret_cast<const int2*>(qw);
            dot[n] = __dp4a(qq.x, static_cast<int>(word & kMask), dot[n]);
            dot[n] = __dp4a(qq.y, static_cast<int>((word >> kBits) & kMask), dot[n]);
          } else {
            const int4 qq = *reinterpret_cast<const int4*>(qw);
            dot[n] = __dp4a(qq.x, static_cast<int>(word & kMask), dot[n]);
            dot[n] = __dp4a(qq.y, static_cast<int>((word >> kBits) & kMask), dot[n]);
            dot[n] = __dp4a(qq.z, static_cast<int>((word >> (2 * kBits)) & kMask), dot[n]);
            dot[n] = __dp4a(qq.w, static_cast<int>((word >> (3 * kBits)) & kMask), dot[n]);
          }
        }
      }
    } else {
      for (int w = 0; w < d / sl.per_word; ++w) {
        const uint32_t word = sl.words[w];
        for (int jj = 0; jj < sl.per_word; ++jj) {
          const int ch = w * sl.per_word + jj;
          const int code =
              static_cast<int>((word >> (sl.bits * jj)) & static_cast<uint32_t>(sl.levels));
#pragma unroll
          for (int n = 0; n < kG; ++n) {
            if (n < g) dot[n] += static_cast<int>(q.q8[n * d + ch]) * code;
          }
        }
      }
    }
  }

  // dot(q_n, L[c]) of this lane's candidate: its two halves summed; every lane of the warp
  // calls it with the same n (an unrolled index).
  __device__ float Base(int n) const {
    const int group = (threadIdx.x & 31) & ~(kC - 1);
    const float lo = __shfl_sync(0xffffffffu, own[(2 * n) / kC], group + (2 * n) % kC);
    const float hi = __shfl_sync(0xffffffffu, own[(2 * n + 1) / kC], group + (2 * n + 1) % kC);
    return __fadd_rn(lo, hi);
  }

  // The logit of query head n for this lane's token.
  __device__ float Logit(int n, const SigQuery& q, const SigLane<kC>& sl, float scale) const {
    const float b = Base(n);
    return __fmul_rn(__fadd_rn(b, __fmul_rn(sl.sc, q.Dot(n, dot[n], sl.levels))), scale);
  }
};

// Stage 2 over whole chunks from key signatures, a lane per token, the CPU's logits
// (SigSums); (M, S) of each query head over the candidate's tokens by the group's max and
// sum of expf, not the CPU's fold in token order (M the same, S may differ in its last
// bits). kBits and kG as SigSums.
template <int kC, int kBits, int kG>
__global__ void __launch_bounds__(32 * kSigWarps)
    Stage2SigTokenKernel(const ExDesc* __restrict__ descs, int g, int d, float scale) {
  extern __shared__ __align__(16) uint8_t sigt_smem[];
  const ExDesc& e = descs[blockIdx.z];
  const SigQuery q =
      LoadSigQuery<kBits>(e.q + static_cast<long long>(blockIdx.y) * g * d, g, d, sigt_smem);
  const SigLane<kC> sl(e, blockIdx.y, gridDim.y, d);
  SigSums<kC, kBits, kG> s;
  s.Run(sl, q, g, d);
#pragma unroll
  for (int n = 0; n < kG; ++n) {
    if (n >= g) break;
    float l = s.Logit(n, q, sl, scale);
    if (sl.c < 0 || !isfinite(l)) l = -INFINITY;
    float m = l;
#pragma unroll
    for (int o = kC / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float x = m == -INFINITY ? 0.0f : expf(l - m);
#pragma unroll
    for (int o = kC / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (sl.active && sl.t == 0) {
      e.stats[sl.at * g + n] = make_float2(m, m == -INFINITY ? 0.0f : x);
    }
  }
}

// Order-preserving bits of a float (NaN -> 0, below every number).
__device__ __forceinline__ uint32_t FloatOrder(float x) {
  if (isnan(x)) return 0u;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float OrderFloat(uint32_t k) {
  const uint32_t b = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
  return __uint_as_float(b);
}

// Ascending bitonic sort of n (power of two) u64 in shared memory, block-cooperative; with
// `payload` ([n] int), each key's int moves with it.
__device__ void BitonicSortAsc(uint64_t* a, int n, int* payload = nullptr) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const int lo = 2 * i - (i & (stride - 1));
        const int hi = lo + stride;
        const bool up = (lo & size) == 0;
        const uint64_t x = a[lo], y = a[hi];
        if ((x > y) == up) {
          a[lo] = y;
          a[hi] = x;
          if (payload != nullptr) {
            const int t = payload[lo];
            payload[lo] = payload[hi];
            payload[hi] = t;
          }
        }
      }
    }
  }
  __syncthreads();
}


// The CPU's slot diff (cpu_select.cc SlotDiff), run by one thread: ids[0, kk) ascending and
// distinct, chunk ids (per = 1) or unit ids (per = C/u units per chunk); scratch claimed
// [kk], free_slots [k].
__device__ void SlotDiffSerial(const int* ids, int kk, int k, const DevView& v, int hh, int per,
                               int* slots, int* miss_slot, int* miss_chunk, int* miss_count,
                               int* claimed, int* free_slots) {
  for (int i = 0; i < kk; ++i) claimed[i] = 0;
  int n_free = 0;
  for (int slot = 0; slot < k; ++slot) {
    const int c = slots[slot];
    int lo = 0, hi = kk;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (ids[mid] < c)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo < kk && ids[lo] == c && !claimed[lo]) {
      claimed[lo] = 1;
    } else {
      free_slots[n_free++] = slot;
    }
  }
  int n_miss = 0;
  for (int i = 0; i < kk; ++i) {
    if (claimed[i]) continue;
    const int slot = free_slots[n_miss];
    slots[slot] = ids[i];
    miss_slot[n_miss] = slot;
    miss_chunk[n_miss] = ids[i];
    ++n_miss;
  }
  // Unused free slots keep a chunk (unit) this step did not select, of a chunk the head may
  // select (cpu_select.cc SlotDiff).
  for (int i = n_miss; i < n_free; ++i) {
    int& c = slots[free_slots[i]];
    if (SortedContains(ids, kk, c) || !SelectableUnit(v, hh, c, per)) c = -1;
  }
  for (int i = n_miss; i < k; ++i) miss_slot[i] = miss_chunk[i] = -1;
  *miss_count = n_miss;
}

// SlotDiffSorted after sorting the slot table into sp [p2k] u64 (p2k a power of two >= k,
// shared memory); the other arguments as SlotDiffSorted's.
template <int kThreads>
__device__ void SlotDiffBlock(const int* ids, int kk, int k, const DevView& v, int hh, int per,
                              int* slots, int* miss_slot, int* miss_chunk, int* miss_count,
                              uint64_t* sp, int p2k, int* flag, int* free_list, int* miss_flag,
                              typename cub::BlockScan<uint32_t, kThreads>::TempStorage& scan) {
  for (int i = threadIdx.x; i < p2k; i += kThreads) {
    sp[i] = i < k ? (static_cast<uint64_t>(static_cast<uint32_t>(slots[i]) ^ 0x80000000u) << 32) |
                        static_cast<uint32_t>(i)
                  : ~0ull;
  }
  BitonicSortAsc(sp, p2k);
  SlotDiffSorted<kThreads>(ids, kk, k, v, hh, per, slots, miss_slot, miss_chunk, miss_count, sp,
                           flag, free_list, miss_flag, scan);
}

// Ranking key of candidate chunk c with score sc: valid candidates rank above padding, the
// key being (order bits + 1) so that a NaN score (bits 0) still beats an empty entry (0).
__device__ __forceinline__ uint64_t CandidateKey(float sc, int c) {
  return (static_cast<uint64_t>(FloatOrder(sc)) + 1ull) << 32 |
         (0xffffffffu - static_cast<uint32_t>(c));
}

// Shared memory of FinalKernel: keys [max_pow2] u64, the slot diff's
// sp [pow2(k)] u64, then ids, claimed, free and miss [k] int each.
size_t FinalSmemBytes(int max_pow2, int k) {
  return size_t(max_pow2) * 8 + size_t(NextPow2(std::max(k, 1))) * 8 + size_t(4) * k * sizeof(int);
}

constexpr int kFinalThreads = 256;

// Block (hh, item), one stage. Dynamic shared memory (FinalSmemBytes): keys [max_pow2] u64,
// sp [pow2(k)] u64, then ids [k], claimed [k], free [k], miss [k] int.
__global__ void __launch_bounds__(kFinalThreads)
    FinalKernel(const ExDesc* __restrict__ descs, int g, int k, float top_p, int min_k,
                int max_pow2) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float s_m[kMaxG], s_z[kMaxG];  // each query head's (max, sum)
  __shared__ int s_valid, s_kk;
  __shared__ typename cub::BlockScan<uint32_t, kFinalThreads>::TempStorage scan;
  int p2k = 1;
  while (p2k < k) p2k <<= 1;
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  uint64_t* sp = keys + max_pow2;
  int* ids = reinterpret_cast<int*>(sp + p2k);
  int* claimed = ids + k;
  int* free_slots = claimed + k;
  int* miss = free_slots + k;
  const ExDesc& e = descs[blockIdx.y];
  const int hh = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int total = e.view.total;
  const long long row = static_cast<long long>(hh) * e.width;
  // Each query head's softmax (max, sum) from Select's partials, as TopKKernel does.
  if (warp < g) {
    float m = -INFINITY, z = 0.0f;
    const float2* part = e.partials + (static_cast<long long>(hh) * g + warp) * e.n_blocks;
    for (int b = lane; b < e.n_blocks; b += 32) MergeSoftmax(m, z, part[b].x, part[b].y);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
      const float z2 = __shfl_xor_sync(0xffffffffu, z, o);
      MergeSoftmax(m, z, m2, z2);
    }
    if (lane == 0) {
      s_m[warp] = m;
      s_z[warp] = z;
    }
  }
  if (tid == 0) s_valid = 0;
  __syncthreads();
  const int kpow2 = e.kpow2;
  int valid = 0;
  for (int i = tid; i < kpow2; i += blockDim.x) {
    uint64_t key = 0;
    if (i < e.width) {
      const int c = e.cand[row + i];
      if (c >= 0) {
        // s = max over the group of exp(x - max) / sum, NaN -> -inf (the CPU's rule).
        float sc = -INFINITY;
        const float* x = e.logits + (static_cast<long long>(hh) * total + c) * g;
        for (int n = 0; n < g; ++n) {
          const float mx = s_m[n];
          float p = (mx == -INFINITY ? 0.0f : expf(x[n] - mx)) / s_z[n];
          if (isnan(p)) p = -INFINITY;
          sc = fmaxf(sc, p);
        }
        key = CandidateKey(sc, c);
        ++valid;
      }
    }
    keys[i] = ~key;  // ascending sort of ~key: best first
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) valid += __shfl_xor_sync(0xffffffffu, valid, o);
  if (lane == 0 && valid > 0) atomicAdd(&s_valid, valid);
  BitonicSortAsc(keys, kpow2);  // starts and ends with a barrier
  const int k_cap = min(k, s_valid);
  if (tid == 0) {
    int kk = k_cap;
    if (top_p > 0.0f && kk > 0) {
      float cum = 0.0f;
      int n = kk;
      for (int i = 0; i < kk; ++i) {
        const float w = OrderFloat(static_cast<uint32_t>((~keys[i]) >> 32) - 1u);
        cum += isfinite(w) && w > 0.0f ? w : 0.0f;
        if (cum >= top_p) {
          n = i + 1;
          break;
        }
      }
      kk = min(kk, max(n, min_k));
    }
    s_kk = kk;
  }
  __syncthreads();
  const int kk = s_kk;
  int* selected = e.selected + static_cast<long long>(hh) * k;
  for (int i = tid; i < k; i += blockDim.x) {
    selected[i] = i < kk ? static_cast<int>(0xffffffffu - static_cast<uint32_t>(~keys[i])) : -1;
  }
  __syncthreads();
  // The chosen ids ascending, for the slot diff: reuse keys[0, pow2(kk)).
  int p2 = 1;
  while (p2 < kk) p2 <<= 1;
  for (int i = tid; i < p2; i += blockDim.x) {
    keys[i] = i < kk ? static_cast<uint64_t>(selected[i]) : ~0ull;
  }
  BitonicSortAsc(keys, p2);
  for (int i = tid; i < kk; i += blockDim.x) ids[i] = static_cast<int>(keys[i]);
  __syncthreads();
  SlotDiffBlock<kFinalThreads>(ids, kk, k, e.view, hh, 1, e.slots + static_cast<long long>(hh) * k,
                               e.miss_slot + static_cast<long long>(hh) * k,
                               e.miss_chunk + static_cast<long long>(hh) * k, e.miss_count + hh,
                               sp, p2k, claimed, free_slots, miss, scan);
}

// Block (hh, item): AssignSlots. Dynamic shared memory: keys [kpow2] u64, ids [k],
// claimed [k], free [k] int.
__global__ void __launch_bounds__(256)
    AssignKernel(const ExDesc* __restrict__ descs, int k, int kpow2) {
  extern __shared__ __align__(16) uint8_t smem[];
  uint64_t* keys = reinterpret_cast<uint64_t*>(smem);
  int* ids = reinterpret_cast<int*>(keys + kpow2);
  int* claimed = ids + k;
  int* free_slots = claimed + k;
  const ExDesc& e = descs[blockIdx.y];
  const int hh = blockIdx.x;
  const DevView& v = e.view;
  const int* in = e.selected + static_cast<long long>(hh) * k;
  for (int i = threadIdx.x; i < kpow2; i += blockDim.x) {
    uint64_t key = ~0ull;
    if (i < k) {
      const int c = in[i];
      if (cuda::SelectableChunk(v, hh, c)) key = static_cast<uint64_t>(c);
    }
    keys[i] = key;
  }
  BitonicSortAsc(keys, kpow2);
  if (threadIdx.x == 0) {
    int n = 0;
    for (int i = 0; i < k && keys[i] != ~0ull; ++i) {
      if (n > 0 && ids[n - 1] == static_cast<int>(keys[i])) continue;
      ids[n++] = static_cast<int>(keys[i]);
    }
    SlotDiffSerial(ids, n, k, v, hh, 1, e.slots + static_cast<long long>(hh) * k,
                   e.miss_slot + static_cast<long long>(hh) * k,
                   e.miss_chunk + static_cast<long long>(hh) * k, e.miss_count + hh, claimed,
                   free_slots);
  }
}

// ---------------------------------------------------------------------------------------
// Selection units (SelectOptions::unit = u, 0 < u < C; cpu_select.cc is the reference).
// A path of its own beside the whole-chunk one above, which it leaves as it is:
//   Stage 1 is the same: items whose total chunks <= k1 = max(candidates, ceil(k*u/C)) take
//     every selectable chunk (FillAllKernel), the others Select's kernels at width k1.
//   Stage2SigUnitTokenKernel (signatures, C a power of two <= 32): the same logits and
//     folds with a lane per token (the first lane of each unit folds the unit's logits).
//   Stage2UnitKernel<kSig>: a warp per candidate chunk, its C tokens in order; the key of
//     token t reconstructed as Stage2Kernel does (or, kSig, its signature unpacked as the
//     CPU's ChunkStatsSig does), then lane n (< g) forms query head n's logit with the
//     CPU's arithmetic (fp32 dot in channel order, each product and sum rounded, no FMA;
//     for signatures the int8 query's integer dot and the base's halves) and folds it
//     into the running (M, S) of the token's unit, in token order with the CPU's
//     rescaling sequence; the unit's pair is stored after its last token and the fold
//     restarts: stats [h, width * C/u, g], unit p of candidate i at i * C/u + p.
//   LsePartKernel (blocks of kLseElems statistics per head row): partial LSE_n sums, which
//     FinalUnitKernel (block per head and item) merges into LSE_n over every candidate
//     unit; then m per unit as cpu_select.cc StageTwoScores, the k best by (m desc, unit id
//     asc, NaN last) with a radix select in shared memory (RadixSelectTop) and a sort of
//     those k only, w of the ranks kept for the mass budget (thread 0, in rank order),
//     `selected`, and the CPU's slot diff on unit ids (SlotDiffBlock).
// exp and log run in double and are rounded once to fp32 (ExpRef, LogRef): closer to the
// CPU's std::exp/std::log on floats (glibc, correctly rounded in nearly all cases) than
// the fp32 intrinsics. The LSE sums run in another order than the CPU's, so units whose
// scores tie to within fp32 rounding could still swap.
// Limits (InvalidArgument naming them): k <= kMaxK units; stage-1 width k1 <= kMaxK chunks;
// candidate units per head (stage-1 width, or total chunks for items scored whole, times
// C/u) <= kMaxCandidateUnits; g <= kMaxG; d % 16 == 0.
constexpr int kMaxCandidateUnits = 16384;
constexpr int kUnitFinalThreads = 512;

__device__ __forceinline__ float ExpRef(float x) {
  return static_cast<float>(exp(static_cast<double>(x)));
}
__device__ __forceinline__ float LogRef(float x) {
  return static_cast<float>(log(static_cast<double>(x)));
}

// cpu_select.cc FoldLogit with ExpRef.
// The first finite logit (m = -inf, sum = 0) sets sum = 1 without an exp: the value
// 0 * exp(-inf) + 1 the CPU computes.
__device__ __forceinline__ void FoldLogitRef(float logit, float* m, float* sum) {
  if (!isfinite(logit)) return;
  if (logit > *m) {
    *sum = *m == -INFINITY ? 1.0f
                           : __fadd_rn(__fmul_rn(*sum, ExpRef(__fsub_rn(*m, logit))), 1.0f);
    *m = logit;
  } else {
    *sum = __fadd_rn(*sum, ExpRef(__fsub_rn(logit, *m)));
  }
}

// Stage-1 width in chunks with units: max(candidates, ceil(k / units per chunk)).
int UnitK1(int k, const SelectOptions& o) {
  const int per = o.units_per_chunk();
  return std::max(o.candidates, k / per + (k % per != 0));
}

// Carves the workspace of SelectEx with units (PlanCandidates, statistics per unit).
size_t PlanSelectExUnits(const LayerShape& shape, int k, const SelectOptions& o,
                         absl::Span<const SelectItem> items, void* base,
                         std::vector<ExDesc>* descs, ExPlan* plan) {
  return PlanCandidates(shape, UnitK1(std::max(k, 0), o), std::max(o.units_per_chunk(), 1),
                        o.two_stage(), items, base, descs, plan);
}

// Grid (candidate groups, h, items); warp w scores candidate chunk blockIdx.x*kStage2Warps
// + w, unit by unit (u tokens each). Dynamic shared memory: the head's query rows [g, d+1]
// f32 (padded: lanes read different rows; kSig: the SigQuery instead), then kStage2Warps
// rows of d f32 (the current token's key, or its signature codes as int).
template <bool kSig>
__global__ void __launch_bounds__(32 * kStage2Warps)
    Stage2UnitKernel(const ExDesc* __restrict__ descs, int g, int d, int C, int u, float scale,
                     const __grid_constant__ cuda::DeviceRope rope) {
  extern __shared__ __align__(16) float unit_smem[];
  const ExDesc& e = descs[blockIdx.z];
  const int hh = blockIdx.y, h = gridDim.y;
  const int qd = d + 1;
  float* qs = unit_smem;
  float* rows = unit_smem + g * qd;
  SigQuery sq{};
  if constexpr (kSig) {
    sq = LoadSigQuery<0>(e.q + static_cast<long long>(hh) * g * d, g, d,
                         reinterpret_cast<uint8_t*>(unit_smem));
    rows = unit_smem + SigQuery::Bytes(g, d) / sizeof(float);
  } else {
    for (int x = threadIdx.x; x < g * d; x += blockDim.x) {
      const int n = x / d, ch = x - n * d;
      qs[n * qd + ch] = __bfloat162float(e.q[static_cast<long long>(hh * g) * d + x]);
    }
    __syncthreads();
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i = blockIdx.x * kStage2Warps + warp;
  if (i >= e.width) return;
  const int per = C / u;
  const long long at = static_cast<long long>(hh) * e.width + i;
  float2* stats = e.stats + at * per * g;
  const int c = e.cand[at];
  if (c < 0) {
    for (int x = lane; x < per * g; x += 32) stats[x] = make_float2(-INFINITY, 0.0f);
    return;
  }
  const DevView& v = e.view;
  const DevSegment& sg = v.seg[cuda::SegmentOf(v, c)];
  const int local = c - sg.begin;
  float* acc = rows + warp * d;
  // kSig: the signature layout and base = dot(q_n, L[c]) of this lane's query head.
  int bits = 0, levels = 0, per_word = 1;
  float base = 0.0f;
  long long rec = 0;
  if constexpr (kSig) {
    bits = v.sig_bits;
    levels = (1 << bits) - 1;
    per_word = 32 / bits;
    rec = static_cast<long long>(d) * bits / 8 + 4;
    const __nv_bfloat16* lm = sg.landmarks + (static_cast<long long>(local) * h + hh) * d;
    if (lane < g) {
      base = __fadd_rn(SigBaseHalf<false>(sq.Row(lane, 0), lm, d / 2),
                       SigBaseHalf<false>(sq.Row(lane, 1), lm + d / 2, d / 2));
    }
  }
  float run_m = -INFINITY, run_s = 0.0f;  // this lane's query head (lane < g), current unit
  for (int t = 0; t < C; ++t) {
    float sc = 0.0f;
    if constexpr (kSig) {
      const uint8_t* r = sg.sig + ((static_cast<long long>(local) * C + t) * h + hh) * rec;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(r);
      int* codes = reinterpret_cast<int*>(acc);
      for (int ch = lane; ch < d; ch += 32) {
        codes[ch] = static_cast<int>((words[ch / per_word] >> (bits * (ch % per_word))) &
                                     static_cast<uint32_t>(levels));
      }
      sc = *reinterpret_cast<const float*>(r + static_cast<long long>(d) * bits / 8);
    } else {
      const int r = v.r;
      const __nv_bfloat16* b = v.b + static_cast<long long>(hh) * r * d;
      const __nv_bfloat16* a = sg.a + (static_cast<long long>(local) * C + t) * r;
      for (int ch = lane; ch < d; ch += 32) {
        float x = 0.0f;
        for (int j = 0; j < r; ++j) {
          x = __fadd_rn(x, __fmul_rn(__bfloat162float(a[j]),
                                      __bfloat162float(b[static_cast<long long>(j) * d + ch])));
        }
        acc[ch] = x;
      }
      __syncwarp();
      const long long pos = sg.first_position + static_cast<long long>(local) * C + t;
      for (int pr = lane; pr < rope.rotary_dim / 2; pr += 32) {
        float cs, sn;
        cuda::RopeCosSin(rope, pos, pr, &cs, &sn);
        const int2 dims = cuda::RopePairDims(rope, pr);
        cuda::RopeRotate(cs, sn, &acc[dims.x], &acc[dims.y]);
      }
      __syncwarp();
      for (int ch = lane; ch < d; ch += 32) {
        acc[ch] = __bfloat162float(__float2bfloat16_rn(acc[ch]));
      }
    }
    __syncwarp();
    if (lane < g) {
      float logit;
      if constexpr (kSig) {
        const int* codes = reinterpret_cast<const int*>(acc);
        const int8_t* q8 = sq.q8 + lane * d;
        int dot = 0;
        for (int ch = 0; ch < d; ++ch) dot += static_cast<int>(q8[ch]) * codes[ch];
        logit = __fmul_rn(__fadd_rn(base, __fmul_rn(sc, sq.Dot(lane, dot, levels))), scale);
      } else {
        const float* qn = qs + lane * qd;  // this lane's query row
        float dot = 0.0f;
        for (int ch = 0; ch < d; ++ch) dot = __fadd_rn(dot, __fmul_rn(qn[ch], acc[ch]));
        logit = __fmul_rn(dot, scale);
      }
      FoldLogitRef(logit, &run_m, &run_s);
      if ((t + 1) % u == 0) {
        stats[(t / u) * g + lane] = make_float2(run_m, run_s);
        run_m = -INFINITY;
        run_s = 0.0f;
      }
    }
    __syncwarp();
  }
}

// Stage 2 over units from key signatures, a lane per token (C a power of two <= 32,
// g <= kMaxG; the launcher falls back to Stage2UnitKernel<true> otherwise), with the CPU's
// arithmetic (SigSums), so the same stats bit for bit: the first lane of each unit folds
// its unit's u logits in token order (FoldLogitRef) and stores the unit's (M, S). Block
// (candidate group, hh, item) of kSigWarps warps, the group's SigQuery in shared memory.
template <int kC, int kBits, int kG>
__global__ void __launch_bounds__(32 * kSigWarps)
    Stage2SigUnitTokenKernel(const ExDesc* __restrict__ descs, int g, int d, int u,
                             float scale) {
  extern __shared__ __align__(16) uint8_t sigu_smem[];
  const ExDesc& e = descs[blockIdx.z];
  const SigQuery q =
      LoadSigQuery<kBits>(e.q + static_cast<long long>(blockIdx.y) * g * d, g, d, sigu_smem);
  const SigLane<kC> sl(e, blockIdx.y, gridDim.y, d);
  SigSums<kC, kBits, kG> s;
  s.Run(sl, q, g, d);
  const int t = sl.t;
  const int per = kC / u;
  const bool first = t % u == 0;  // this lane folds its unit
  float2* stats = e.stats + (sl.at * per + t / u) * g;
#pragma unroll
  for (int n = 0; n < kG; ++n) {
    if (n >= g) break;
    const float logit = s.Logit(n, q, sl, scale);
    const float l = sl.c >= 0 ? logit : -INFINITY;
    float run_m = -INFINITY, run_s = 0.0f;
    for (int j = 0; j < u; ++j) {
      // Lanes of one unit are consecutive and inside the candidate's group of kC.
      const float x = __shfl_down_sync(0xffffffffu, l, j);
      if (first) FoldLogitRef(x, &run_m, &run_s);
    }
    if (sl.active && first) stats[n] = make_float2(run_m, run_s);
  }
}

// The token-per-lane stage-2 kernels from key signatures for (C, bits, g, d): specialised
// for chunks of 8 or 16 tokens, 2- or 4-bit codes and 4 or 8 query heads per KV head with
// d a multiple of 32 (bits: the items' common bits, CommonSigBits; 0 when they differ or
// a landmark row is not 16-byte aligned), else the generic ones (bits read at run time) for
// C a power of two <= 32 and g <= kMaxG; nullptr for the other shapes, which the
// warp-per-candidate kernels serve.
using SigTokenKernel = void (*)(const ExDesc*, int, int, float);
using SigUnitTokenKernel = void (*)(const ExDesc*, int, int, int, float);
template <int kC, int kBits>
void PickSigKernelsG(int g, SigTokenKernel* chunk, SigUnitTokenKernel* unit) {
  if (g == 4) {
    *chunk = Stage2SigTokenKernel<kC, kBits, 4>;
    *unit = Stage2SigUnitTokenKernel<kC, kBits, 4>;
  } else {
    *chunk = Stage2SigTokenKernel<kC, kBits, 8>;
    *unit = Stage2SigUnitTokenKernel<kC, kBits, 8>;
  }
}
template <int kC>
void PickSigKernels(int bits, int g, int d, SigTokenKernel* chunk, SigUnitTokenKernel* unit) {
  if constexpr (kC == 8 || kC == 16) {
    if (d % 32 == 0 && (g == 4 || g == 8) && ValidSignatureBits(bits)) {
      if (bits == 8) {
        PickSigKernelsG<kC, 8>(g, chunk, unit);
      } else if (bits == 4) {
        PickSigKernelsG<kC, 4>(g, chunk, unit);
      } else {
        PickSigKernelsG<kC, 2>(g, chunk, unit);
      }
      return;
    }
  }
  *chunk = Stage2SigTokenKernel<kC, 0, kMaxG>;
  *unit = Stage2SigUnitTokenKernel<kC, 0, kMaxG>;
}
void SigKernels(int C, int bits, int g, int d, SigTokenKernel* chunk, SigUnitTokenKernel* unit) {
  *chunk = nullptr;
  *unit = nullptr;
  if (g > kMaxG) return;
  switch (C) {
    case 1: return PickSigKernels<1>(bits, g, d, chunk, unit);
    case 2: return PickSigKernels<2>(bits, g, d, chunk, unit);
    case 4: return PickSigKernels<4>(bits, g, d, chunk, unit);
    case 8: return PickSigKernels<8>(bits, g, d, chunk, unit);
    case 16: return PickSigKernels<16>(bits, g, d, chunk, unit);
    case 32: return PickSigKernels<32>(bits, g, d, chunk, unit);
    default: return;
  }
}

// The items' signature bits when they all share them and every segment's landmark rows
// start on 16 bytes (the specialised kernels read them 8 channels at a time), else 0.
int CommonSigBits(absl::Span<const SelectItem> items) {
  int bits = -1;
  for (const SelectItem& it : items) {
    if (bits >= 0 && it.view.sig_bits != bits) return 0;
    bits = it.view.sig_bits;
    for (int sgi = 0; sgi < it.view.n_segments; ++sgi) {
      if (reinterpret_cast<uintptr_t>(it.view.segments[sgi].landmarks) % 16 != 0) return 0;
    }
  }
  return bits < 0 ? 0 : bits;
}

// m of one unit from its stats [g] and the heads' LSE (cpu_select.cc StageTwoScores: the
// max over the heads with a finite M of exp(M - LSE); 0 for a unit without any). exp is
// monotone, so the max is taken before the one exp: the same value as the max of the exps.
__device__ __forceinline__ float UnitScore(const float2* st, int g, const float* lse) {
  float a = -INFINITY;
  for (int n = 0; n < g; ++n) {
    const float2 x = st[n];
    if (x.x == -INFINITY) continue;
    a = fmaxf(a, __fsub_rn(x.x, lse[n]));  // a NaN term is skipped, as std::max skips it
  }
  return ExpRef(a);  // exp(-inf) = 0: no finite head
}

// w of one unit (StageTwoScores): the max over the heads with a finite M of
// exp(M + log S - LSE); 0 for a unit without any.
__device__ __forceinline__ float UnitMass(const float2* st, int g, const float* lse) {
  float mass = 0.0f;
  for (int n = 0; n < g; ++n) {
    const float2 x = st[n];
    if (x.x == -INFINITY) continue;
    mass = fmaxf(mass, ExpRef(__fsub_rn(__fadd_rn(x.x, LogRef(x.y)), lse[n])));
  }
  return mass;
}

// Unit id at candidate-unit position i of head row `row` (-1 for padding).
__device__ __forceinline__ int UnitAt(const ExDesc& e, long long row, int per, int i) {
  const int c = e.cand[row + i / per];
  return c < 0 ? -1 : c * per + i % per;
}

// The kk largest of n distinct keys key(i) (0 = padding, never taken; kk <= the nonzero
// keys), block-wide: an MSD radix select, 8 bits a pass (a 256-bin histogram of the keys
// that still match the prefix, warp-aggregated), stopping once the boundary bin's keys are
// all taken. Key i is among the kk largest iff (key(i) & *mask) >= *prefix. kk = 0 leaves
// *mask = *prefix = 0 (the caller takes nothing). key_hi(i) is key(i)'s high word, which
// the passes over the high word read instead (it may be cheaper to form).
template <int kThreads, typename KeyFn, typename HiFn>
__device__ void RadixSelectTop(int n, int kk, const KeyFn& key, const HiFn& key_hi,
                               uint64_t* prefix_out, uint64_t* mask_out) {
  __shared__ uint32_t hist[256];
  __shared__ uint64_t s_prefix, s_mask;
  __shared__ uint32_t s_need;
  __shared__ int s_done;
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    s_prefix = 0;
    s_mask = 0;
    s_need = static_cast<uint32_t>(max(kk, 0));
    s_done = kk <= 0;
  }
  __syncthreads();
  for (int shift = 56; shift >= 0 && !s_done; shift -= 8) {
    for (int b = tid; b < 256; b += kThreads) hist[b] = 0;
    __syncthreads();
    const uint64_t prefix = s_prefix, mask = s_mask;
    for (int base = 0; base < n; base += kThreads) {  // the warp's lanes iterate together
      const int i = base + tid;
      int digit = -1;
      if (i < n) {
        const uint64_t kv = shift >= 32 ? static_cast<uint64_t>(key_hi(i)) << 32 : key(i);
        if (kv != 0 && (kv & mask) == prefix) digit = static_cast<int>((kv >> shift) & 0xff);
      }
      const unsigned peers = __match_any_sync(0xffffffffu, digit);
      if (digit >= 0 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
    }
    __syncthreads();
    if (tid < 32) {
      // Lane l holds bins 255 - 8l down to 248 - 8l; the bins above a lane's are the lower
      // lanes' (an inclusive scan over lanes).
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - 8 * lane - j];
        sum += c[j];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
      }
      const uint32_t need = s_need;
      uint32_t above = incl - sum;
      if (above < need && need <= incl) {  // one lane: the bin of the kk-th key
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above + c[j] >= need) {
            s_need = need - above;
            s_prefix = prefix | (static_cast<uint64_t>(255 - 8 * lane - j) << shift);
            s_mask = mask | (0xffull << shift);
            s_done = c[j] == need - above;
            break;
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
  }
  *prefix_out = s_prefix;
  *mask_out = s_mask;
}

// Grid (LSE blocks, h, items), two stages: block b of head row hh reduces the statistics of
// candidate units [b*span, (b+1)*span), span = kLseElems / g, per query head n (thread t
// serves head t % g): with L = M + log S over the units with a finite M, the block's max
// and sum of exp(L - max) into lse_part[hh, b, n] ((-inf, 0) without any). FinalUnitKernel
// merges the blocks into LSE_n. Elements are [unit, g] in the row, so a block's span is
// contiguous and its L values stay in shared memory between the two passes.
__global__ void __launch_bounds__(kLseThreads) LsePartKernel(const ExDesc* __restrict__ descs,
                                                             int g, int per) {
  __shared__ float sl[kLseElems];
  __shared__ float red[kLseThreads];
  __shared__ float s_mx[kMaxG];
  const ExDesc& e = descs[blockIdx.z];
  const int b = blockIdx.x, hh = blockIdx.y, tid = threadIdx.x;
  if (b >= e.lse_blocks) return;
  const long long units = static_cast<long long>(e.width) * per;
  const long long span = kLseElems / g;
  const long long lo = b * span;
  const int n = static_cast<int>(max(0ll, min(span, units - lo))) * g;
  const float2* st = e.stats + (static_cast<long long>(hh) * units + lo) * g;
  const int active = kLseThreads / g * g;  // thread t < active: head t % g, stride active
  float mx = -INFINITY;
  if (tid < active) {
    for (int j = tid; j < n; j += active) {
      const float2 x = st[j];
      float l = -INFINITY;  // no finite M: not counted
      if (x.x != -INFINITY) {
        l = __fadd_rn(x.x, LogRef(x.y));
        mx = fmaxf(mx, l);
      }
      sl[j] = l;
    }
  }
  red[tid] = mx;
  __syncthreads();
  if (tid < g) {
    float m = -INFINITY;
    for (int j = tid; j < active; j += g) m = fmaxf(m, red[j]);
    s_mx[tid] = m;
  }
  __syncthreads();
  float z = 0.0f;
  if (tid < active) {
    const float m = s_mx[tid % g];
    for (int j = tid; j < n; j += active) {
      const float l = sl[j];
      if (l != -INFINITY) z = __fadd_rn(z, ExpRef(__fsub_rn(l, m)));
    }
  }
  red[tid] = z;
  __syncthreads();
  if (tid < g) {
    float zz = 0.0f;
    for (int j = tid; j < active; j += g) zz = __fadd_rn(zz, red[j]);
    e.lse_part[(static_cast<long long>(hh) * e.lse_blocks + b) * g + tid] =
        make_float2(s_mx[tid], s_mx[tid] == -INFINITY ? 0.0f : zz);
  }
}

// Shared memory of FinalUnitKernel: the units' score bits hi [max_units] u32 (rounded up
// to 8 bytes), the ranked keys rk [pow2(k)] u64 (then the slot diff's sp), their positions
// ri [pow2(k)] int, then ids, claimed, free and miss [k] int each.
size_t FinalUnitSmemBytes(int max_units, int k) {
  const size_t p2k = size_t(NextPow2(std::max(k, 1)));
  return (size_t(max_units) * 4 + 7) / 8 * 8 + p2k * 12 + size_t(4) * k * sizeof(int);
}

// Block (hh, item); dynamic shared memory as FinalUnitSmemBytes says (claimed holds
// the masses w of the first k ranks before the slot diff). LSE_n from LsePartKernel's
// blocks (merged in block order by thread n), each unit's score m into hi as CandidateKey's high word, the k best keys by RadixSelectTop, sorted
// (bitonic, k entries), w of those ranks for the mass budget, `selected`, the slot diff.
__global__ void __launch_bounds__(kUnitFinalThreads)
    FinalUnitKernel(const ExDesc* __restrict__ descs, int g, int k, int per, float top_p,
                    int min_k, int max_units) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float s_lse[kMaxG];
  __shared__ int s_valid, s_kk, s_count;
  __shared__ typename cub::BlockScan<uint32_t, kUnitFinalThreads>::TempStorage scan;
  int p2k = 1;
  while (p2k < k) p2k <<= 1;
  uint32_t* hi = reinterpret_cast<uint32_t*>(smem);
  uint64_t* rk = reinterpret_cast<uint64_t*>(smem + (size_t(max_units) * 4 + 7) / 8 * 8);
  int* ri = reinterpret_cast<int*>(rk + p2k);
  int* ids = ri + p2k;
  int* claimed = ids + k;
  int* free_slots = claimed + k;
  int* miss = free_slots + k;
  const ExDesc& e = descs[blockIdx.y];
  const int hh = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31;
  const long long row = static_cast<long long>(hh) * e.width;  // of cand
  const int n_units = e.width * per;
  const float2* stats = e.stats + row * per * g;                // [n_units, g]
  // LSE_n from LsePartKernel's blocks, merged in block order.
  if (tid == 0) s_valid = 0;
  if (tid < g) {
    const float2* part = e.lse_part + static_cast<long long>(hh) * e.lse_blocks * g + tid;
    float mx = -INFINITY;
    for (int b = 0; b < e.lse_blocks; ++b) mx = fmaxf(mx, part[b * g].x);
    float z = 0.0f;
    if (mx != -INFINITY) {
      for (int b = 0; b < e.lse_blocks; ++b) {
        const float2 p = part[b * g];
        if (p.x != -INFINITY) z = __fadd_rn(z, __fmul_rn(p.y, ExpRef(__fsub_rn(p.x, mx))));
      }
    }
    s_lse[tid] = mx == -INFINITY ? -INFINITY : __fadd_rn(mx, LogRef(z));
  }
  __syncthreads();
  // Each unit's CandidateKey high word (FloatOrder(m) + 1; 0 for padding), and the count of
  // valid units.
  int valid = 0;
  for (int i = tid; i < n_units; i += kUnitFinalThreads) {
    const int id = UnitAt(e, row, per, i);
    uint32_t hv = 0;
    if (id >= 0) {
      hv = FloatOrder(UnitScore(stats + static_cast<long long>(i) * g, g, s_lse)) + 1u;
      ++valid;
    }
    hi[i] = hv;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) valid += __shfl_xor_sync(0xffffffffu, valid, o);
  if (lane == 0 && valid > 0) atomicAdd(&s_valid, valid);
  __syncthreads();
  const int k_cap = min(k, s_valid);
  auto key = [&](int i) -> uint64_t {
    const uint32_t hv = hi[i];
    if (hv == 0) return 0ull;
    return static_cast<uint64_t>(hv) << 32 |
           (0xffffffffu - static_cast<uint32_t>(UnitAt(e, row, per, i)));
  };
  uint64_t prefix = 0, mask = 0;
  RadixSelectTop<kUnitFinalThreads>(n_units, k_cap, key, [&](int i) { return hi[i]; }, &prefix,
                                    &mask);
  // The k_cap best keys (as ~key, so that an ascending sort ranks them best first) with
  // their candidate positions, then sorted.
  int p2 = 1;
  while (p2 < k_cap) p2 <<= 1;
  if (tid == 0) s_count = 0;
  for (int i = tid; i < p2; i += kUnitFinalThreads) {
    rk[i] = ~0ull;
    ri[i] = -1;
  }
  __syncthreads();
  if (k_cap > 0) {
    for (int i = tid; i < n_units; i += kUnitFinalThreads) {
      // The high word alone rules out most keys (with any low word they stay below).
      const uint32_t hv = hi[i];
      if (hv == 0 || (((static_cast<uint64_t>(hv) << 32) | 0xffffffffull) & mask) < prefix) {
        continue;
      }
      const uint64_t kv = key(i);
      if ((kv & mask) >= prefix) {
        const int at = atomicAdd(&s_count, 1);
        rk[at] = ~kv;
        ri[at] = i;
      }
    }
  }
  BitonicSortAsc(rk, p2, ri);
  // With a budget: the masses w of ranks [0, k_cap) into wrank.
  float* wrank = reinterpret_cast<float*>(claimed);
  if (top_p > 0.0f) {
    for (int r = tid; r < k; r += kUnitFinalThreads) {
      wrank[r] = r < k_cap ? UnitMass(stats + static_cast<long long>(ri[r]) * g, g, s_lse) : 0.0f;
    }
    __syncthreads();
  }
  if (tid == 0) {
    int kk = k_cap;
    if (top_p > 0.0f && kk > 0) {
      float cum = 0.0f;
      int n = kk;
      for (int i = 0; i < kk; ++i) {
        const float w = wrank[i];
        cum = __fadd_rn(cum, isfinite(w) && w > 0.0f ? w : 0.0f);
        if (cum >= top_p) {
          n = i + 1;
          break;
        }
      }
      kk = min(kk, max(n, min_k));
    }
    s_kk = kk;
  }
  __syncthreads();
  const int kk = s_kk;
  int* selected = e.selected + static_cast<long long>(hh) * k;
  for (int i = tid; i < k; i += kUnitFinalThreads) {
    const int id = i < kk ? static_cast<int>(0xffffffffu - static_cast<uint32_t>(~rk[i])) : -1;
    selected[i] = id;
    if (i < kk) ids[i] = id;
  }
  __syncthreads();
  // The chosen unit ids ascending, for the slot diff (in rk, free from here).
  int p2kk = 1;
  while (p2kk < kk) p2kk <<= 1;
  for (int i = tid; i < p2kk; i += kUnitFinalThreads) {
    rk[i] = i < kk ? static_cast<uint64_t>(ids[i]) : ~0ull;
  }
  BitonicSortAsc(rk, p2kk);
  for (int i = tid; i < kk; i += kUnitFinalThreads) ids[i] = static_cast<int>(rk[i]);
  __syncthreads();
  SlotDiffBlock<kUnitFinalThreads>(ids, kk, k, e.view, hh, per,
                                   e.slots + static_cast<long long>(hh) * k,
                                   e.miss_slot + static_cast<long long>(hh) * k,
                                   e.miss_chunk + static_cast<long long>(hh) * k,
                                   e.miss_count + hh, rk, p2k, claimed, free_slots, miss, scan);
}

// After stage 2 (stats filled for every item): LsePartKernel, then FinalUnitKernel at
// `per` units per candidate chunk (1: whole chunks), over at most max_units candidate units
// per head row.
absl::Status LaunchStageTwoFinal(const ExDesc* dev_descs, int h, unsigned n_items, int g, int k,
                                 int per, const SelectOptions& o, int max_units,
                                 cudaStream_t st) {
  LsePartKernel<<<dim3(LseBlocks(max_units, g), h, n_items), kLseThreads, 0, st>>>(dev_descs, g,
                                                                                  per);
  KVSHADE_CUDA_LAUNCH_CHECK();
  const size_t smem = FinalUnitSmemBytes(max_units, k);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      FinalUnitKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  FinalUnitKernel<<<dim3(h, n_items), kUnitFinalThreads, smem, st>>>(dev_descs, g, k, per,
                                                                      o.top_p, o.min_k, max_units);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

// SelectEx with selection units (options.units()): checks, stage 1, stage 2 per unit, the
// final ranking and slot diff.
absl::Status SelectExUnits(int device, const LayerShape& shape, int k, const SelectOptions& o,
                           absl::Span<const SelectItem> items, Workspace ws, cudaStream_t st) {
  KVSHADE_RETURN_IF_ERROR(validate::SelectEx(
      shape, k, o, items, ws, PlanSelectExUnits(shape, k, o, items, nullptr, nullptr, nullptr)));
  if (o.candidates < 0 || !(o.top_p >= 0.0f && o.top_p <= 1.0f) || o.min_k < 0 ||
      o.min_k > k) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectEx: options need candidates >= 0, top_p in [0, 1], min_k in [0, k = ", k,
        "] and C >= 1 with two stages; got candidates ", o.candidates, ", top_p ", o.top_p,
        ", min_k ", o.min_k, ", C ", o.C));
  }
  if (items.empty()) return absl::OkStatus();
  const int h = shape.h, g = shape.g, d = shape.d;
  const int per = o.units_per_chunk();
  const int k1 = UnitK1(k, o);
  if (k > kMaxK) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectEx: the CUDA backend supports k <= ", kMaxK, " selection units, got k = ", k));
  }
  KVSHADE_RETURN_IF_ERROR(CheckSelectLimits(shape, std::min(k1, kMaxK), items));
  cuda::DeviceRope rope{};
  if (!o.signatures) {
    KVSHADE_ASSIGN_OR_RETURN(rope, cuda::MakeDeviceRope(o.rope, d));
  }
  std::vector<ExDesc> descs(items.size());
  ExPlan plan;
  PlanSelectExUnits(shape, k, o, items, ws.data, &descs, &plan);
  int max_units = 1, max_width = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    ExDesc& e = descs[i];
    if (!e.all && k1 > kMaxK) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectEx: the CUDA backend keeps at most ", kMaxK,
          " stage-1 candidate chunks, got max(candidates, ceil(k*unit/C)) = ", k1));
    }
    const int64_t units = int64_t(e.width) * per;
    if (units > kMaxCandidateUnits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectEx: the CUDA backend ranks at most ", kMaxCandidateUnits,
          " candidate units per head (kMaxCandidateUnits), items[", i, "] has ", e.width,
          " candidate chunks x ", per, " units per chunk = ", units,
          " (fewer candidates or a larger unit)"));
    }
    if (o.signatures) {
      const SessionLayerView& v = items[i].view;
      if (!ValidSignatureBits(v.sig_bits) || (int64_t{d} * v.sig_bits) % 32 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SelectEx: items[", i, "].view.sig_bits = ", v.sig_bits,
            " (stage 2 from key signatures needs ", kSignatureBitsText,
            ", with d*bits a multiple of 32)"));
      }
      for (int sgi = 0; sgi < v.n_segments; ++sgi) {
        if (v.segments[sgi].n_chunks > 0 && v.segments[sgi].sig == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("SelectEx: items[", i, "].view.segments[", sgi,
                           "].sig is null (stage 2 scores key signatures)"));
        }
      }
    } else if (items[i].view.b == nullptr || items[i].view.r < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("SelectEx: items[", i, "].view needs b and r >= 1 for two stages"));
    }
    e.view = cuda::MakeDevView(items[i].view);
    e.q = cuda::AsNv(items[i].q);
    e.slots = items[i].slots;
    e.selected = items[i].selected;
    e.miss_slot = items[i].miss_slot;
    e.miss_chunk = items[i].miss_chunk;
    e.miss_count = items[i].miss_count;
    e.logits = nullptr;
    e.partials = nullptr;
    e.n_blocks = 0;
    e.kpow2 = NextPow2(static_cast<int>(std::max<int64_t>(units, 1)));
    max_units = std::max(max_units, static_cast<int>(units));
    max_width = std::max(max_width, e.width);
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device));
  int optin = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t final_smem = FinalUnitSmemBytes(max_units, k);
  const size_t stage2_smem =
      (o.signatures ? SigQuery::Bytes(g, d) : size_t(g) * (d + 1) * sizeof(float)) +
      size_t(kStage2Warps) * d * sizeof(float);
  if (final_smem > size_t(optin) || stage2_smem > size_t(optin)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectEx: selection units at k = ", k, " over ", max_units,
        " candidate units per head (or g = ", g, ", d = ", d, ") need ",
        std::max(final_smem, stage2_smem), " bytes of shared memory per block, above the "
        "device limit ", optin));
  }
  if (!plan.stage1.empty()) {
    // Stage 1 keeps its candidates (`selected`) only: no slot table of its own.
    KVSHADE_RETURN_IF_ERROR(LaunchSelect(device, shape, k1, plan.stage1, plan.stage1_ws, st,
                                         nullptr, /*diff=*/false));
  }
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), plan.dev_descs, st));
  const unsigned n_items = static_cast<unsigned>(items.size());
  if (plan.stage1.size() < items.size()) {
    FillAllKernel<<<n_items, 256, 0, st>>>(plan.dev_descs, h);
    KVSHADE_CUDA_LAUNCH_CHECK();
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const dim3 grid2(cuda::CeilDiv(max_width, kStage2Warps), h, n_items);
  auto stage2 = [&](auto kernel) -> absl::Status {
    if (stage2_smem > (48 << 10)) {
      KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(stage2_smem)));
    }
    kernel<<<grid2, 32 * kStage2Warps, stage2_smem, st>>>(plan.dev_descs, g, d, o.C, o.unit,
                                                          scale, rope);
    KVSHADE_CUDA_LAUNCH_CHECK();
    return absl::OkStatus();
  };
  // Signatures with C a power of two <= 32: a lane per token (the same arithmetic).
  SigTokenKernel unused = nullptr;
  SigUnitTokenKernel sig_unit = nullptr;
  if (o.signatures) SigKernels(o.C, CommonSigBits(items), g, d, &unused, &sig_unit);
  if (sig_unit != nullptr) {
    const int per_block = kSigWarps * (32 / o.C);
    const dim3 grid(cuda::CeilDiv(max_width, per_block), h, n_items);
    const size_t smem = SigQuery::Bytes(g, d);
    if (smem > (48 << 10)) {
      KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
          sig_unit, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    sig_unit<<<grid, 32 * kSigWarps, smem, st>>>(plan.dev_descs, g, d, o.unit, scale);
    KVSHADE_CUDA_LAUNCH_CHECK();
  } else if (o.signatures) {
    KVSHADE_RETURN_IF_ERROR(stage2(Stage2UnitKernel<true>));
  } else {
    KVSHADE_RETURN_IF_ERROR(stage2(Stage2UnitKernel<false>));
  }
  return LaunchStageTwoFinal(plan.dev_descs, h, n_items, g, k, per, o, max_units, st);
}

}  // namespace

size_t CudaBackend::SelectExWorkspaceBytes(const LayerShape& shape, int k,
                                           const SelectOptions& options,
                                           absl::Span<const SelectItem> items) const {
  if (options.units()) {
    return PlanSelectExUnits(shape, k, options, items, nullptr, nullptr, nullptr);
  }
  return PlanSelectEx(shape, k, options, items, nullptr, nullptr, nullptr);
}

absl::Status CudaBackend::SelectEx(const LayerShape& shape, int k, const SelectOptions& options,
                                   absl::Span<const SelectItem> items, Workspace ws,
                                   Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::SelectUnit(options));
  if (options.units()) {
    return SelectExUnits(device_, shape, k, options, items, ws, cuda::ToCudaStream(stream));
  }
  KVSHADE_RETURN_IF_ERROR(validate::Select(shape, k, items, ws,
                                           SelectExWorkspaceBytes(shape, k, options, items)));
  if (options.candidates < 0 || !(options.top_p >= 0.0f && options.top_p <= 1.0f) ||
      options.min_k < 0 || options.min_k > k || (options.two_stage() && options.C < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SelectEx: options need candidates >= 0, top_p in [0, 1], min_k in [0, k = ", k,
        "] and C >= 1 with two stages; got candidates ", options.candidates, ", top_p ",
        options.top_p, ", min_k ", options.min_k, ", C ", options.C));
  }
  if (items.empty()) return absl::OkStatus();
  const int h = shape.h, g = shape.g, d = shape.d;
  const int k1 = ExK1(k, options);
  KVSHADE_RETURN_IF_ERROR(CheckSelectLimits(shape, std::min(k1, kMaxK), items));
  cuda::DeviceRope rope{};
  if (options.two_stage() && !options.signatures) {
    KVSHADE_ASSIGN_OR_RETURN(rope, cuda::MakeDeviceRope(options.rope, d));
  }
  std::vector<ExDesc> descs(items.size());
  ExPlan plan;
  PlanSelectEx(shape, k, options, items, ws.data, &descs, &plan);
  int max_pow2 = 1, max_width = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    ExDesc& e = descs[i];
    const int total = items[i].view.total_chunks();
    if (e.all && total > kMaxAllChunks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectEx: the CUDA backend scores at most ", kMaxAllChunks,
          " chunks per head in one two-stage call, items[", i, "] has ", total));
    }
    if (!e.all && k1 > kMaxK) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SelectEx: the CUDA backend keeps at most ", kMaxK, " stage-1 candidates, got ", k1));
    }
    if (options.two_stage() && options.signatures) {
      const SessionLayerView& v = items[i].view;
      if (!ValidSignatureBits(v.sig_bits) || (int64_t{d} * v.sig_bits) % 32 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SelectEx: items[", i, "].view.sig_bits = ", v.sig_bits,
            " (stage 2 from key signatures needs ", kSignatureBitsText,
            ", with d*bits a multiple of 32)"));
      }
      for (int sgi = 0; sgi < v.n_segments; ++sgi) {
        if (v.segments[sgi].n_chunks > 0 && v.segments[sgi].sig == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("SelectEx: items[", i, "].view.segments[", sgi,
                           "].sig is null (stage 2 scores key signatures)"));
        }
      }
    } else if (options.two_stage() && (items[i].view.b == nullptr || items[i].view.r < 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("SelectEx: items[", i, "].view needs b and r >= 1 for two stages"));
    }
    e.view = cuda::MakeDevView(items[i].view);
    e.q = cuda::AsNv(items[i].q);
    e.slots = items[i].slots;
    e.selected = items[i].selected;
    e.miss_slot = items[i].miss_slot;
    e.miss_chunk = items[i].miss_chunk;
    e.miss_count = items[i].miss_count;
    e.logits = nullptr;
    e.partials = nullptr;
    e.n_blocks = 0;
    e.kpow2 = NextPow2(std::max(e.width, 1));
    max_pow2 = std::max(max_pow2, e.kpow2);
    max_width = std::max(max_width, e.width);
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const cudaStream_t st = cuda::ToCudaStream(stream);
  if (!plan.stage1.empty()) {
    // Stage 1 keeps its candidates (`selected`) only: no slot table of its own.
    std::vector<SelectDesc> s1;
    KVSHADE_RETURN_IF_ERROR(LaunchSelect(device_, shape, k1, plan.stage1, plan.stage1_ws, st,
                                         &s1, /*diff=*/false));
    for (size_t j = 0; j < plan.stage1_index.size(); ++j) {
      ExDesc& e = descs[plan.stage1_index[j]];
      e.logits = s1[j].logits;
      e.partials = s1[j].partials;
      e.n_blocks = s1[j].n_blocks;
    }
  }
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), plan.dev_descs, st));
  const unsigned n_items = static_cast<unsigned>(items.size());
  if (plan.stage1.size() < items.size()) {
    FillAllKernel<<<n_items, 256, 0, st>>>(plan.dev_descs, h);
    KVSHADE_CUDA_LAUNCH_CHECK();
  }
  if (options.two_stage() && options.signatures) {
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    const int C = options.C;
    const size_t smem = SigQuery::Bytes(g, d);
    SigTokenKernel sig_chunk = nullptr;
    SigUnitTokenKernel unused = nullptr;
    SigKernels(C, CommonSigBits(items), g, d, &sig_chunk, &unused);
    if (sig_chunk != nullptr) {
      const int per_block = kSigWarps * (32 / C);
      const dim3 grid(cuda::CeilDiv(max_width, per_block), h, n_items);
      if (smem > (48 << 10)) {
        KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
            sig_chunk, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      }
      sig_chunk<<<grid, 32 * kSigWarps, smem, st>>>(plan.dev_descs, g, d, scale);
      KVSHADE_CUDA_LAUNCH_CHECK();
    } else {
      const dim3 grid(cuda::CeilDiv(max_width, kStage2Warps), h, n_items);
      if (smem > (48 << 10)) {
        KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
            Stage2SigKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
            static_cast<int>(smem)));
      }
      Stage2SigKernel<<<grid, 32 * kStage2Warps, smem, st>>>(plan.dev_descs, g, d, C, scale);
      KVSHADE_CUDA_LAUNCH_CHECK();
    }
  } else if (options.two_stage()) {
    const dim3 grid(cuda::CeilDiv(max_width, kStage2Warps), h, n_items);
    const size_t smem = size_t(kStage2Warps) * d * sizeof(float);
    Stage2Kernel<<<grid, 32 * kStage2Warps, smem, st>>>(
        plan.dev_descs, g, d, options.C, 1.0f / std::sqrt(static_cast<float>(d)), rope);
    KVSHADE_CUDA_LAUNCH_CHECK();
  }
  if (options.two_stage()) {
    return LaunchStageTwoFinal(plan.dev_descs, h, n_items, g, k, 1, options, max_width, st);
  }
  const size_t smem = FinalSmemBytes(max_pow2, k);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      FinalKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  FinalKernel<<<dim3(h, n_items), kFinalThreads, smem, st>>>(plan.dev_descs, g, k, options.top_p,
                                                             options.min_k, max_pow2);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

size_t CudaBackend::AssignSlotsWorkspaceBytes(const LayerShape& shape, int k,
                                              absl::Span<const SelectItem> items) const {
  (void)shape;
  (void)k;
  cuda::WorkspaceCarver c(nullptr);
  c.Take<ExDesc>(items.size());
  return c.bytes();
}

absl::Status CudaBackend::AssignSlots(const LayerShape& shape, int k,
                                      absl::Span<const SelectItem> items, Workspace ws,
                                      Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::AssignSlots(shape, k, items, ws,
                                                AssignSlotsWorkspaceBytes(shape, k, items)));
  if (items.empty()) return absl::OkStatus();
  if (k > kMaxK) {
    return absl::InvalidArgumentError(
        absl::StrCat("AssignSlots: the CUDA backend supports k <= ", kMaxK, ", got k = ", k));
  }
  cuda::WorkspaceCarver c(ws.data);
  ExDesc* dev = c.Take<ExDesc>(items.size());
  std::vector<ExDesc> descs(items.size());
  std::memset(static_cast<void*>(descs.data()), 0, descs.size() * sizeof(ExDesc));
  for (size_t i = 0; i < items.size(); ++i) {
    ExDesc& e = descs[i];
    e.view = cuda::MakeDevView(items[i].view);
    e.slots = items[i].slots;
    e.selected = items[i].selected;
    e.miss_slot = items[i].miss_slot;
    e.miss_chunk = items[i].miss_chunk;
    e.miss_count = items[i].miss_count;
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const cudaStream_t st = cuda::ToCudaStream(stream);
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), dev, st));
  const int kpow2 = NextPow2(k);
  const size_t smem = size_t(kpow2) * 8 + size_t(3) * k * sizeof(int);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      AssignKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  AssignKernel<<<dim3(shape.h, static_cast<unsigned>(items.size())), 256, smem, st>>>(dev, k,
                                                                                      kpow2);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

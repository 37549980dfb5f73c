// CUDA decode attention (Backend::Attend), flash-decoding style, for a batch of items:
//   1. AttendSplitKernel, grid (splits, KV heads, items), 128 threads: one CTA attends
//      the g query heads of one KV head over one split (a token range of one KV block),
//      loading each K/V tile of 64 tokens once for the whole GQA group. fp32 online softmax
//      per tile; writes the split's (max, sum) and unnormalized output row per query head.
//   2. AttendCombineKernel, grid (query heads, items): merges the splits in order.
// Each KV block is cut into splits of S tokens (S a multiple of 64 chosen so that the
// batch fills the GPU about 8 CTAs per SM). Deterministic: fixed split boundaries and
// fixed reduction orders.
//
// len_per_head (device memory) cannot be read on the host without a synchronization, so
// splits are planned from `len`; the last split of a block with len_per_head runs to
// max(len_per_head[hh], 0) whatever `len` says, so every attended token is covered (pass
// the block's capacity as `len` to spread long heads over several splits). A head with no
// attended token outputs zeros (as the CPU backend).
//
// Workspace: per item, partial rows [h*g, splits, d] f32 and (max, sum) [h*g, splits],
// with splits planned at the smallest split size (64 tokens), plus the descriptors.
// Limits of this backend: d even and <= 256, g <= 16.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_decode_common.cuh"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

constexpr int kTile = 64;  // tokens per K/V tile
constexpr int kAttendThreads = 128;
constexpr int kMaxG = 16;
constexpr int kMaxD = 256;

struct DevKvBlock {
  const __nv_bfloat16* k;
  const __nv_bfloat16* v;
  const int* len_per_head;  // [h] or null
  long long len;
  long long head_stride;   // elements
  long long token_stride;  // elements
  int split_begin;         // first split of this block in the item
  int n_splits;
  int aligned;  // 16-byte loads possible (pointers and strides)
  int pad;
};

struct AttendDesc {
  const __nv_bfloat16* q;  // [h*g, d]
  float* out;              // [h*g, d]
  float* lse;              // [h*g] or null
  float* part_acc;         // [h*g, max_splits, d] workspace
  float2* part_ml;         // [h*g, max_splits] workspace
  DevKvBlock blocks[kMaxKvBlocks];
  int n_blocks;
  int n_splits;
  int max_splits;  // row stride of the partials
  int pad;
};

// Splits of one block for split size `split_tokens`.
int BlockSplits(const KvBlock& b, int64_t split_tokens) {
  const int64_t len = std::max<int64_t>(b.len, 0);
  int64_t n = cuda::CeilDiv<int64_t>(len, split_tokens);
  if (n == 0 && b.len_per_head != nullptr) n = 1;  // its length is only known on the device
  return static_cast<int>(n);
}

int ItemSplits(const AttendItem& it, int64_t split_tokens) {
  int n = 0;
  const int nb = std::clamp(it.n_blocks, 0, kMaxKvBlocks);
  for (int b = 0; b < nb; ++b) n += BlockSplits(it.blocks[b], split_tokens);
  return n;
}

size_t PlanAttend(const LayerShape& shape, absl::Span<const AttendItem> items, void* base,
                  AttendDesc** dev_descs, std::vector<AttendDesc>* descs) {
  const int64_t heads = int64_t(std::max(shape.h, 0)) * std::max(shape.g, 0);
  const int64_t d = std::max(shape.d, 0);
  cuda::WorkspaceCarver c(base);
  AttendDesc* dd = c.Take<AttendDesc>(items.size());
  if (dev_descs != nullptr) *dev_descs = dd;
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t splits = std::max(1, ItemSplits(items[i], kTile));
    float* acc = c.Take<float>(size_t(heads * splits * d));
    float2* ml = c.Take<float2>(size_t(heads * splits));
    if (descs != nullptr) {
      (*descs)[i].part_acc = acc;
      (*descs)[i].part_ml = ml;
      (*descs)[i].max_splits = static_cast<int>(splits);
    }
  }
  return c.bytes();
}

// Shared-memory layout of AttendSplitKernel (byte offsets, 16-byte aligned): q [g, d] f32,
// then the K and V tiles (later reused for the token-group reduction [groups, g, d] f32),
// then the scores [g, kTile] f32.
struct SplitSmem {
  int kv, scores, bytes;
};
__host__ __device__ inline SplitSmem SplitSmemLayout(int g, int d) {
  const int groups = kAttendThreads / (d / 2);
  const int tiles = 2 * 2 * kTile * (d + 8) * 2;  // two buffers of K and V
  const int red = groups * g * d * 4;
  SplitSmem l;
  l.kv = (g * d * 4 + 15) / 16 * 16;
  l.scores = l.kv + ((tiles > red ? tiles : red) + 15) / 16 * 16;
  l.bytes = l.scores + g * kTile * 4;
  return l;
}

//   per block of the item: k, v [.., tokens, d] bf16 at hh*head_stride + t*token_stride
// Block (split, hh, item). Shared memory: q [g, d] f32, two buffers of K and V tiles
// [kTile, d + 8] bf16 (double-buffered cp.async), scores/probabilities [g, kTile] f32.
__global__ void __launch_bounds__(kAttendThreads)
    AttendSplitKernel(const AttendDesc* __restrict__ descs, int g, int d, float scale,
                      int split_tokens) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float s_m[kMaxG], s_l[kMaxG], s_corr[kMaxG];
  const AttendDesc& it = descs[blockIdx.z];
  const int split = blockIdx.x;
  if (split >= it.n_splits) return;
  const int hh = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

  int bi = 0;
  while (bi + 1 < it.n_blocks && split >= it.blocks[bi + 1].split_begin) ++bi;
  const DevKvBlock& blk = it.blocks[bi];
  const long long eff_len = blk.len_per_head != nullptr ? max(blk.len_per_head[hh], 0) : blk.len;
  const int ls = split - blk.split_begin;
  const long long t_begin = static_cast<long long>(ls) * split_tokens;
  const long long t_end = ls == blk.n_splits - 1 ? eff_len : min(eff_len, t_begin + split_tokens);

  const int kv_stride = d + 8;  // elements
  const SplitSmem lay = SplitSmemLayout(g, d);
  float* qs = reinterpret_cast<float*>(smem);  // [g, d]
  // Two buffers, each K [kTile, d+8] then V [kTile, d+8] bf16: tile i+1 loads during tile i.
  __nv_bfloat16* kv0 = reinterpret_cast<__nv_bfloat16*>(smem + lay.kv);
  const int buf_elems = 2 * kTile * kv_stride;
  float* ss = reinterpret_cast<float*>(smem + lay.scores);  // [g, kTile]

  for (int i = tid; i < g * d; i += blockDim.x) {
    qs[i] = __bfloat162float(it.q[static_cast<long long>(hh) * g * d + i]);
  }
  if (tid < g) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.0f;
  }
  // PV mapping: thread -> channel pair cp, token group tg (tokens tg, tg + n_groups, ...).
  const int pairs = d / 2;
  const int n_groups = kAttendThreads / pairs;
  const int cp = tid % pairs, tg = tid / pairs;
  float acc[kMaxG][2];
#pragma unroll
  for (int gi = 0; gi < kMaxG; ++gi) acc[gi][0] = acc[gi][1] = 0.0f;

  const __nv_bfloat16* kbase = blk.k + static_cast<long long>(hh) * blk.head_stride;
  const __nv_bfloat16* vbase = blk.v + static_cast<long long>(hh) * blk.head_stride;
  const int vec_per_row = d / 8;
  __syncthreads();

  // Issues the cp.async loads of the tile at t0 into buffer `b` (aligned blocks only).
  // Thread -> fixed 16-byte column, rows row0, row0 + rows_per_pass, ...: pointer bumps only.
  const int rows_per_pass = kAttendThreads / vec_per_row;
  const int col = tid % vec_per_row, row0 = tid / vec_per_row;
  auto prefetch = [&](long long t0, int b) {
    if (row0 >= rows_per_pass) return;
    const int n = static_cast<int>(min(static_cast<long long>(kTile), t_end - t0));
    __nv_bfloat16* kd = kv0 + b * buf_elems + row0 * kv_stride + col * 8;
    __nv_bfloat16* vd = kd + kTile * kv_stride;
    const long long off0 = (t0 + row0) * blk.token_stride + col * 8;
    const __nv_bfloat16* ksrc = kbase + off0;
    const __nv_bfloat16* vsrc = vbase + off0;
    const long long src_step = rows_per_pass * blk.token_stride;
    const int dst_step = rows_per_pass * kv_stride;
    for (int row = row0; row < n; row += rows_per_pass) {
      cuda::CpAsync16(kd, ksrc, true);
      cuda::CpAsync16(vd, vsrc, true);
      kd += dst_step;
      vd += dst_step;
      ksrc += src_step;
      vsrc += src_step;
    }
  };
  if (blk.aligned && t_begin < t_end) prefetch(t_begin, 0);
  cuda::CpAsyncCommit();

  int ti = 0;
  for (long long t0 = t_begin; t0 < t_end; t0 += kTile, ++ti) {
    const int n = static_cast<int>(min(static_cast<long long>(kTile), t_end - t0));
    const __nv_bfloat16* ks = kv0 + (blk.aligned ? (ti & 1) * buf_elems : 0);
    const __nv_bfloat16* vs = ks + kTile * kv_stride;
    if (blk.aligned) {
      if (t0 + kTile < t_end) prefetch(t0 + kTile, (ti + 1) & 1);
      cuda::CpAsyncCommit();
      cuda::CpAsyncWait<1>();
    } else {
      __nv_bfloat16* kd = kv0;
      __nv_bfloat16* vd = kv0 + kTile * kv_stride;
      for (int i = tid; i < n * d; i += blockDim.x) {
        const int row = i / d, col = i - row * d;
        const long long off = (t0 + row) * blk.token_stride + col;
        kd[row * kv_stride + col] = kbase[off];
        vd[row * kv_stride + col] = vbase[off];
      }
    }
    __syncthreads();

    // Scores: thread -> token tt, query heads gi = hp, hp + 2, ...
    {
      const int tt = tid % kTile, hp = tid / kTile;
      for (int gi = hp; gi < g; gi += kAttendThreads / kTile) {
        float dot = 0.0f;
        if (tt < n) {
          const __nv_bfloat16* krow = ks + tt * kv_stride;
          const float* qrow = qs + gi * d;
          if (d % 8 == 0) {
            for (int c = 0; c < d; c += 8) {
              float kf[8];
              cuda::LoadBf16x8(krow + c, kf);
              const float4 q0 = *reinterpret_cast<const float4*>(qrow + c);
              const float4 q1 = *reinterpret_cast<const float4*>(qrow + c + 4);
              dot = fmaf(q0.x, kf[0], dot);
              dot = fmaf(q0.y, kf[1], dot);
              dot = fmaf(q0.z, kf[2], dot);
              dot = fmaf(q0.w, kf[3], dot);
              dot = fmaf(q1.x, kf[4], dot);
              dot = fmaf(q1.y, kf[5], dot);
              dot = fmaf(q1.z, kf[6], dot);
              dot = fmaf(q1.w, kf[7], dot);
            }
          } else {
            for (int c = 0; c < d; ++c) dot = fmaf(qrow[c], __bfloat162float(krow[c]), dot);
          }
        }
        ss[gi * kTile + tt] = tt < n ? dot * scale : -INFINITY;
      }
    }
    __syncthreads();

    // Online softmax per query head: warp w takes heads w, w + 4, ...
    for (int gi = warp; gi < g; gi += kAttendThreads / 32) {
      const float x0 = ss[gi * kTile + lane], x1 = ss[gi * kTile + lane + 32];
      const float tile_max = cuda::WarpMax(fmaxf(x0, x1));
      const float m_old = s_m[gi];
      const float m_new = fmaxf(m_old, tile_max);
      float p0 = 0.0f, p1 = 0.0f, corr = 1.0f;
      if (m_new != -INFINITY) {
        corr = expf(m_old - m_new);  // 0 on the first non-empty tile
        p0 = expf(x0 - m_new);
        p1 = expf(x1 - m_new);
      }
      const float tile_sum = cuda::WarpSum(p0 + p1);
      ss[gi * kTile + lane] = p0;
      ss[gi * kTile + lane + 32] = p1;
      if (lane == 0) {
        s_corr[gi] = corr;
        s_m[gi] = m_new;
        s_l[gi] = s_l[gi] * corr + tile_sum;
      }
    }
    __syncthreads();

    // P V for this thread's channel pair and token group.
    if (tg < n_groups) {
#pragma unroll
      for (int gi = 0; gi < kMaxG; ++gi) {
        if (gi < g) {
          const float corr = s_corr[gi];
          acc[gi][0] *= corr;
          acc[gi][1] *= corr;
        }
      }
      for (int tt = tg; tt < n; tt += n_groups) {
        const float2 v = __bfloat1622float2(
            *reinterpret_cast<const __nv_bfloat162*>(vs + tt * kv_stride + 2 * cp));
#pragma unroll
        for (int gi = 0; gi < kMaxG; ++gi) {
          if (gi < g) {
            const float pw = ss[gi * kTile + tt];
            acc[gi][0] = fmaf(pw, v.x, acc[gi][0]);
            acc[gi][1] = fmaf(pw, v.y, acc[gi][1]);
          }
        }
      }
    }
    __syncthreads();  // the next prefetch overwrites this buffer; the scores are reused
  }
  cuda::CpAsyncWait<0>();

  // Sum the token groups (fixed order) through shared memory, then write the partials.
  float* red = reinterpret_cast<float*>(kv0);  // [n_groups, g, d]; the layout makes room
  if (tg < n_groups) {
#pragma unroll
    for (int gi = 0; gi < kMaxG; ++gi) {
      if (gi < g) {
        red[(tg * g + gi) * d + 2 * cp] = acc[gi][0];
        red[(tg * g + gi) * d + 2 * cp + 1] = acc[gi][1];
      }
    }
  }
  __syncthreads();
  for (int i = tid; i < g * d; i += blockDim.x) {
    float s = 0.0f;
    for (int t = 0; t < n_groups; ++t) s += red[t * g * d + i];
    const int gi = i / d, c = i - gi * d;
    const long long row = (static_cast<long long>(hh) * g + gi) * it.max_splits + split;
    it.part_acc[row * d + c] = s;
  }
  if (tid < g) {
    it.part_ml[(static_cast<long long>(hh) * g + tid) * it.max_splits + split] =
        make_float2(s_m[tid], s_l[tid]);
  }
}

// Block (query head qh, item): out[qh] = sum_s acc_s e^{m_s - M} / sum_s l_s e^{m_s - M}.
__global__ void __launch_bounds__(kAttendThreads)
    AttendCombineKernel(const AttendDesc* __restrict__ descs, int d) {
  const AttendDesc& it = descs[blockIdx.y];
  const int qh = blockIdx.x;
  const float2* ml = it.part_ml + static_cast<long long>(qh) * it.max_splits;
  const int ns = it.n_splits;
  float mx = -INFINITY;
  for (int s = 0; s < ns; ++s) mx = fmaxf(mx, ml[s].x);
  float l = 0.0f;
  for (int s = 0; s < ns; ++s) {
    if (ml[s].x != -INFINITY) l += ml[s].y * expf(ml[s].x - mx);
  }
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  if (it.lse != nullptr && threadIdx.x == 0) it.lse[qh] = l > 0.0f ? mx + logf(l) : -INFINITY;
  const float* acc = it.part_acc + static_cast<long long>(qh) * it.max_splits * d;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < ns; ++s) {
      if (ml[s].x != -INFINITY) o += acc[static_cast<long long>(s) * d + c] * expf(ml[s].x - mx);
    }
    it.out[static_cast<long long>(qh) * d + c] = o * inv;
  }
}

}  // namespace

size_t CudaBackend::AttendWorkspaceBytes(const LayerShape& shape,
                                         absl::Span<const AttendItem> items) const {
  return PlanAttend(shape, items, nullptr, nullptr, nullptr);
}

absl::Status CudaBackend::Attend(const LayerShape& shape, float scale,
                                 absl::Span<const AttendItem> items, Workspace ws, Stream stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::Attend(shape, scale, items, ws, AttendWorkspaceBytes(shape, items)));
  if (items.empty()) return absl::OkStatus();
  const int h = shape.h, g = shape.g, d = shape.d;
  if (d % 2 != 0 || d > kMaxD) {
    return absl::InvalidArgumentError(
        absl::StrCat("Attend: the CUDA backend needs an even d <= ", kMaxD, ", got d = ", d));
  }
  if (g > kMaxG) {
    return absl::InvalidArgumentError(
        absl::StrCat("Attend: the CUDA backend supports g <= ", kMaxG, ", got g = ", g));
  }
  if (h > 65535 || items.size() > 65535 || int64_t(h) * g > 0x7fffffff) {
    return absl::InvalidArgumentError(absl::StrCat("Attend: h (", h, ") and the item count (",
                                                   items.size(), ") must be <= 65535"));
  }
  KVSHADE_RETURN_IF_ERROR(cuda::UseDevice(device_));
  const cudaStream_t st = cuda::ToCudaStream(stream);
  int sms = 0;
  KVSHADE_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));

  // Split size: tiles per split so that the batch makes about 8 CTAs per SM.
  int64_t total_tiles = 0;
  for (const AttendItem& it : items) {
    for (int b = 0; b < it.n_blocks; ++b) {
      total_tiles += cuda::CeilDiv<int64_t>(std::max<int64_t>(it.blocks[b].len, 0), kTile) * h;
    }
  }
  const int64_t tiles_per_split = std::clamp<int64_t>(
      cuda::CeilDiv<int64_t>(total_tiles, int64_t(8) * std::max(sms, 1)), 1, 1 << 20);
  const int64_t split_tokens = tiles_per_split * kTile;
  if (split_tokens > 0x7fffffff) {
    return absl::InvalidArgumentError("Attend: KV blocks too long for one CUDA grid");
  }

  std::vector<AttendDesc> descs(items.size());
  AttendDesc* dev_descs = nullptr;
  PlanAttend(shape, items, ws.data, &dev_descs, &descs);
  int max_splits = 1;
  for (size_t i = 0; i < items.size(); ++i) {
    const AttendItem& in = items[i];
    AttendDesc& o = descs[i];
    o.q = cuda::AsNv(in.q);
    o.out = in.out;
    o.lse = in.lse;
    o.n_blocks = in.n_blocks;
    int next = 0;
    for (int b = 0; b < kMaxKvBlocks; ++b) {
      DevKvBlock& ob = o.blocks[b];
      ob = DevKvBlock{};
      if (b >= in.n_blocks) continue;
      const KvBlock& ib = in.blocks[b];
      ob.k = cuda::AsNv(ib.k);
      ob.v = cuda::AsNv(ib.v);
      ob.len_per_head = ib.len_per_head;
      ob.len = ib.len;
      ob.head_stride = ib.head_stride;
      ob.token_stride = ib.token_stride;
      ob.split_begin = next;
      ob.n_splits = BlockSplits(ib, split_tokens);
      ob.aligned = d % 8 == 0 && cuda::Aligned16(ib.k) && cuda::Aligned16(ib.v) &&
                   (ib.head_stride * 2) % 16 == 0 && (ib.token_stride * 2) % 16 == 0;
      next += ob.n_splits;
    }
    o.n_splits = next;
    o.pad = 0;
    max_splits = std::max(max_splits, next);
  }
  KVSHADE_RETURN_IF_ERROR(
      cuda::StageDescriptors(descs.data(), static_cast<int>(descs.size()), dev_descs, st));

  const size_t smem = size_t(SplitSmemLayout(g, d).bytes);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      AttendSplitKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  AttendSplitKernel<<<dim3(max_splits, h, static_cast<unsigned>(items.size())), kAttendThreads,
                      smem, st>>>(dev_descs, g, d, scale, static_cast<int>(split_tokens));
  KVSHADE_CUDA_LAUNCH_CHECK();
  AttendCombineKernel<<<dim3(h * g, static_cast<unsigned>(items.size())), kAttendThreads, 0, st>>>(
      dev_descs, d);
  KVSHADE_CUDA_LAUNCH_CHECK();
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

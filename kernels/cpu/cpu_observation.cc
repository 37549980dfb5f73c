// CPU ObservationMass and ChunkSum (docs/ALGORITHM.md, shadow step 6 / MiniKV heavy hitters).
//
// ObservationMass: for observation queries qobs [w, h*g, d] bf16 at q_positions [w] and
// keys kr [n, h, d] bf16 at k_positions [n] (both post-RoPE), query head qh reads KV head
// qh / g and
//   logit(t, qh, j) = (q[t, qh] . k[j, qh/g]) * scale,  scale = 1/sqrt(d)   (fp32, the dot
//                     accumulated in fp32 in channel order)
//   visible(t, j)   = k_positions[j] <= q_positions[t]                      (causal)
//   p(t, qh, j)     = exp(logit - max_visible_logit) / sum_visible exp(...)  (exp in fp32,
//                     the denominator accumulated in double)
//   mass[hh, j]     = sum over t (ascending) and qh in hh's group (ascending) of p,
//                     accumulated in double, rounded to f32.
// A query row that sees no key contributes nothing.
// Two passes: pass 1 computes each row's max and denominator (OpenMP over rows x query
// heads); pass 2 recomputes the logits with the same arithmetic and accumulates mass per
// (head, key) (OpenMP over those), so that no thread shares an output and the summation
// order does not depend on the thread count.
// Workspace (f32/f64): qobs and kr converted to fp32, then per-row max and denominator.
//
// ChunkSum: chunk_mass[hh, j] = sum of mass[hh, j*C .. j*C + C - 1] in token order
// (double accumulation, rounded to f32).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_workspace.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

using cpu_internal::kWorkspaceAlign;
using cpu_internal::AlignUp;

struct ObsLayout {
  size_t qf = 0, kf = 0, row_max = 0, row_sum = 0, total = 0;  // byte offsets / size
};

ObsLayout Layout(int w, int n, const LayerShape& shape) {
  ObsLayout l;
  const size_t hg = size_t(shape.h) * shape.g;
  l.qf = 0;
  l.kf = l.qf + AlignUp(size_t(w) * hg * shape.d * sizeof(float));
  l.row_max = l.kf + AlignUp(size_t(n) * shape.h * shape.d * sizeof(float));
  l.row_sum = l.row_max + AlignUp(size_t(w) * hg * sizeof(float));
  l.total = l.row_sum + AlignUp(size_t(w) * hg * sizeof(double)) + kWorkspaceAlign;  // + base slack
  return l;
}

inline float Logit(const float* q, const float* k, int d, float scale) {
  float acc = 0.0f;
  for (int c = 0; c < d; ++c) acc += q[c] * k[c];
  return acc * scale;
}

}  // namespace

size_t CpuBackend::ObservationWorkspaceBytes(int w, int n, const LayerShape& shape) const {
  if (w < 1 || n < 1 || shape.h < 1 || shape.g < 1 || shape.d < 1) return 0;
  return Layout(w, n, shape).total;
}

absl::Status CpuBackend::ObservationMass(absl::Span<const bf16> qobs,
                                         absl::Span<const int64_t> q_positions, int w,
                                         absl::Span<const bf16> kr,
                                         absl::Span<const int64_t> k_positions, int n,
                                         const LayerShape& shape, absl::Span<float> mass,
                                         Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::ObservationMass(
      qobs.size(), q_positions.size(), w, kr.size(), k_positions.size(), n, shape, mass.size(),
      ws, ObservationWorkspaceBytes(w, n, shape)));
  const int h = shape.h, g = shape.g, d = shape.d, hg = shape.query_heads();
  const ObsLayout l = Layout(w, n, shape);
  std::byte* base = reinterpret_cast<std::byte*>(
      AlignUp(reinterpret_cast<uintptr_t>(ws.data)));
  float* qf = reinterpret_cast<float*>(base + l.qf);
  float* kf = reinterpret_cast<float*>(base + l.kf);
  float* row_max = reinterpret_cast<float*>(base + l.row_max);
  double* row_sum = reinterpret_cast<double*>(base + l.row_sum);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int64_t* qpos = q_positions.data();
  const int64_t* kpos = k_positions.data();

  const int64_t q_elems = int64_t{w} * hg * d, k_elems = int64_t{n} * h * d;
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < q_elems; ++e) qf[e] = Bf16ToFloat(qobs[e]);
#pragma omp parallel for schedule(static)
  for (int64_t e = 0; e < k_elems; ++e) kf[e] = Bf16ToFloat(kr[e]);

  // Pass 1: per (row t, query head qh): max visible logit and the softmax denominator.
  const int64_t row_jobs = int64_t{w} * hg;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t job = 0; job < row_jobs; ++job) {
    const int64_t t = job / hg;
    const int qh = static_cast<int>(job % hg);
    const int hh = qh / g;
    const float* q = qf + job * d;
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < n; ++j) {
      if (kpos[j] > qpos[t]) continue;
      mx = std::max(mx, Logit(q, kf + (int64_t{j} * h + hh) * d, d, scale));
    }
    double sum = 0;
    if (mx != -std::numeric_limits<float>::infinity()) {
      for (int j = 0; j < n; ++j) {
        if (kpos[j] > qpos[t]) continue;
        sum += std::exp(Logit(q, kf + (int64_t{j} * h + hh) * d, d, scale) - mx);
      }
    }
    row_max[job] = mx;
    row_sum[job] = sum;  // 0: the row sees no key (or only -inf logits)
  }

  // Pass 2: per (KV head hh, key j): sum of probabilities over rows and the group.
  const int64_t key_jobs = int64_t{h} * n;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < key_jobs; ++job) {
    const int hh = static_cast<int>(job / n);
    const int j = static_cast<int>(job % n);
    const float* k = kf + (int64_t{j} * h + hh) * d;
    double acc = 0;
    for (int t = 0; t < w; ++t) {
      if (kpos[j] > qpos[t]) continue;
      for (int qq = 0; qq < g; ++qq) {
        const int64_t row = int64_t{t} * hg + int64_t{hh} * g + qq;
        if (!(row_sum[row] > 0)) continue;
        const float p = std::exp(Logit(qf + row * d, k, d, scale) - row_max[row]);
        acc += double(p) / row_sum[row];
      }
    }
    mass[job] = static_cast<float>(acc);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::ChunkSum(absl::Span<const float> mass, int h, int n, int C,
                                  int n_chunks, absl::Span<float> chunk_mass, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::ChunkSum(mass.size(), h, n, C, n_chunks, chunk_mass.size()));
  const int64_t jobs = int64_t{h} * n_chunks;
#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < jobs; ++job) {
    const int64_t hh = job / n_chunks, j = job % n_chunks;
    const float* src = mass.data() + hh * n + j * C;
    double acc = 0;
    for (int c = 0; c < C; ++c) acc += src[c];
    chunk_mass[job] = static_cast<float>(acc);
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

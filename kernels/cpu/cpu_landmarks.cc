// CPU BuildLandmarks (docs/ALGORITHM.md, shadow steps 4-5): per chunk j and head hh of post-RoPE
// keys kr [n, h, d] bf16,
//   mean      = fp32 sum of the chunk's C keys in token order, divided by C (fp32)
//   landmarks [j, hh, :] = mean rounded once to bf16
//   min_cos   [hh, j]    = min over the chunk's tokens of cos(mean, key), computed against
//                          the fp32 (unrounded) mean with double dot products and norms,
//                          clamped to [-1, 1]. A zero vector has cosine 1 with another zero
//                          vector and 0 with any nonzero vector.
// Tokens >= n_chunks*C are ignored. OpenMP over (chunk, head); no allocation (stack tiles).
#include <algorithm>
#include <cmath>

#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/codec.h"

namespace kvshade::kernels {
namespace {
constexpr int kChannelTile = 256;
constexpr int kTokenGroup = 64;
}

absl::Status CpuBackend::BuildLandmarks(absl::Span<const bf16> kr, int n, int h, int d, int C,
                                        int n_chunks, absl::Span<bf16> landmarks,
                                        absl::Span<float> min_cos, Stream) {
  KVSHADE_RETURN_IF_ERROR(
      validate::BuildLandmarks(kr.size(), n, h, d, C, n_chunks, landmarks.size(), min_cos.size()));
  const int64_t jobs = int64_t{n_chunks} * h;
  const int64_t token_stride = int64_t{h} * d;

#pragma omp parallel for schedule(static)
  for (int64_t job = 0; job < jobs; ++job) {
    const int64_t j = job / h;
    const int hh = static_cast<int>(job % h);
    const bf16* first = kr.data() + j * C * token_stride + int64_t{hh} * d;
    bf16* lm = landmarks.data() + j * token_stride + int64_t{hh} * d;
    // Channels in tiles of kChannelTile (the fp32 mean of a tile lives on the stack) and tokens
    // in groups of kTokenGroup (their dot products and norms live on the stack); the mean
    // is recomputed per token group only when C > kTokenGroup, with the same arithmetic.
    float mean[kChannelTile];
    double dot[kTokenGroup], key_sq[kTokenGroup];
    double mean_sq = 0;
    float worst = 1.0f;
    for (int t0 = 0; t0 < C; t0 += kTokenGroup) {
      const int t1 = std::min(C, t0 + kTokenGroup);
      for (int t = t0; t < t1; ++t) dot[t - t0] = key_sq[t - t0] = 0;
      for (int c0 = 0; c0 < d; c0 += kChannelTile) {
        const int c1 = std::min(d, c0 + kChannelTile);
        for (int c = c0; c < c1; ++c) mean[c - c0] = 0.0f;
        for (int t = 0; t < C; ++t) {
          const bf16* key = first + t * token_stride;
          for (int c = c0; c < c1; ++c) mean[c - c0] += Bf16ToFloat(key[c]);
        }
        for (int c = c0; c < c1; ++c) mean[c - c0] /= static_cast<float>(C);
        if (t0 == 0) {
          for (int c = c0; c < c1; ++c) {
            lm[c] = FloatToBf16(mean[c - c0]);
            mean_sq += double(mean[c - c0]) * mean[c - c0];
          }
        }
        for (int t = t0; t < t1; ++t) {
          const bf16* key = first + t * token_stride;
          double dt = 0, kk = 0;
          for (int c = c0; c < c1; ++c) {
            const double x = Bf16ToFloat(key[c]);
            dt += double(mean[c - c0]) * x;
            kk += x * x;
          }
          dot[t - t0] += dt;
          key_sq[t - t0] += kk;
        }
      }
      for (int t = t0; t < t1; ++t) {
        float cosine;
        const double kk = key_sq[t - t0];
        if (mean_sq == 0 && kk == 0) {
          cosine = 1.0f;
        } else if (mean_sq == 0 || kk == 0) {
          cosine = 0.0f;
        } else {
          cosine = static_cast<float>(
              std::clamp(dot[t - t0] / std::sqrt(mean_sq * kk), -1.0, 1.0));
        }
        worst = std::min(worst, cosine);
      }
    }
    min_cos[int64_t{hh} * n_chunks + j] = worst;
  }
  return absl::OkStatus();
}

// Key signatures (backend.h): one SignatureEncodeReference per (token, head), OpenMP over
// tokens.
absl::Status CpuBackend::EncodeSignatures(absl::Span<const bf16> kr,
                                          absl::Span<const bf16> landmarks, int h, int d, int C,
                                          int n_chunks, int bits, absl::Span<std::byte> sig,
                                          Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::EncodeSignatures(kr.size(), landmarks.size(), h, d, C,
                                                     n_chunks, bits, sig.size()));
  const int64_t tokens = int64_t{n_chunks} * C;
  const size_t rec = SignatureRecordBytes(bits, d);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int hh = 0; hh < h; ++hh) {
      SignatureEncodeReference(kr.data() + (t * h + hh) * d,
                               landmarks.data() + ((t / C) * h + hh) * d, d, bits,
                               sig.data() + size_t(t * h + hh) * rec);
    }
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// CompressShadowLayer on the CUDA backend against the CPU backend: the whole ingest
// composite (factorize, RoPE, landmarks, outliers, heavy INT2 chunks, values, static set,
// tail), whose gathers run in device memory (Copy/Copy2D) and whose values are encoded
// straight into a caller-given host-visible block. Chunk choices must agree exactly; the
// value-side outputs (codes, exact V rows) bit for bit; post-RoPE key rows within the
// ApplyRope parity tolerance (2 bf16 ulps).
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/shadow_layer.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace shadow_layer_gpu_test {
namespace {

using testing::Cpu;
using testing::MakeRng;
using testing::RandomBf16;

int Ulps(bf16 a, bf16 b) {
  auto ord = [](uint16_t x) { return (x & 0x8000) ? -int(x & 0x7FFF) : int(x); };
  return std::abs(ord(a.bits) - ord(b.bits));
}

template <typename T>
std::vector<T> Read(Backend& be, const Buffer& b) {
  return testing::Download<T>(be, b.data(), b.bytes() / sizeof(T));
}

TEST(ShadowLayerGpu, CompressMatchesCpuWithDeviceGathersAndStoreValues) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(71);
  const LayerShape shape{8, 4, 128};
  const int n = 8192 + 37, w = 16;
  const std::vector<bf16> k = RandomBf16(size_t(n) * shape.D(), rng, 1.0f);
  const std::vector<bf16> v = RandomBf16(size_t(n) * shape.D(), rng, 1.0f);
  const std::vector<bf16> qobs = RandomBf16(size_t(w) * shape.query_heads() * shape.d, rng, 3.0f);
  std::vector<int64_t> qpos(w);
  std::iota(qpos.begin(), qpos.end(), int64_t(n - w));
  RopeSpec rope;
  rope.theta = 500000.0f;
  ShadowParams p;
  p.rank = 64;
  p.subspace_iterations = 4;
  p.outliers = 12;
  p.heavy_chunks = 6;
  p.codec = {ValueCodec::kINT4, 16};

  ShadowObservation cobs{qobs, qpos, w};
  auto lc = CompressShadowLayer(*cpu, shape, rope, p, k, v, n, 0, &cobs);
  ASSERT_TRUE(lc.ok()) << lc.status();

  Buffer kg = testing::Upload(*gpu, k), vg = testing::Upload(*gpu, v), qg = testing::Upload(*gpu, qobs);
  ShadowObservation gobs{absl::Span<const bf16>(static_cast<const bf16*>(qg.data()), qobs.size()), qpos, w};
  const size_t value_bytes = size_t(shape.h) * lc->n_chunks * lc->value_chunk_bytes;
  auto home = gpu->AllocateHostVisible(value_bytes);
  ASSERT_TRUE(home.ok()) << home.status();
  auto lg = CompressShadowLayer(
      *gpu, shape, rope, p, absl::Span<const bf16>(static_cast<const bf16*>(kg.data()), k.size()),
      absl::Span<const bf16>(static_cast<const bf16*>(vg.data()), v.size()), n, 0, &gobs, {},
      nullptr, absl::Span<std::byte>(static_cast<std::byte*>(home->data()), value_bytes));
  ASSERT_TRUE(lg.ok()) << lg.status();
  EXPECT_EQ(lg->values.bytes(), 0u) << "values were not encoded into the given block";

  ASSERT_EQ(lg->n_chunks, lc->n_chunks);
  ASSERT_EQ(lg->n_tail, lc->n_tail);
  EXPECT_EQ(lg->outlier_chunks, lc->outlier_chunks);
  EXPECT_EQ(lg->heavy_chunks, lc->heavy_chunks);
  EXPECT_EQ(lg->static_chunks, lc->static_chunks);
  // Values: the codecs are bit-identical across backends.
  EXPECT_EQ(std::memcmp(home->data(), lc->values.data(), value_bytes), 0);
  // V rows of the static set (exact and dequantized INT2) and the tail: bit for bit.
  const auto svg = Read<bf16>(*gpu, lg->static_v), svc = Read<bf16>(*cpu, lc->static_v);
  const auto tvg = Read<bf16>(*gpu, lg->tail_v), tvc = Read<bf16>(*cpu, lc->tail_v);
  ASSERT_EQ(svg.size(), svc.size());
  ASSERT_EQ(tvg.size(), tvc.size());
  size_t vdiff = 0;
  for (size_t i = 0; i < svg.size(); ++i) vdiff += svg[i].bits != svc[i].bits;
  for (size_t i = 0; i < tvg.size(); ++i) vdiff += tvg[i].bits != tvc[i].bits;
  EXPECT_EQ(vdiff, 0u);
  // Post-RoPE K rows: exact sink/outlier rows and the tail within the RoPE tolerance.
  const auto skg = Read<bf16>(*gpu, lg->static_k), skc = Read<bf16>(*cpu, lc->static_k);
  const auto tkg = Read<bf16>(*gpu, lg->tail_k), tkc = Read<bf16>(*cpu, lc->tail_k);
  const size_t exact_rows = size_t(1 + lc->n_outliers) * lc->C;
  const size_t rows_per_head = size_t(lc->static_capacity) * lc->C;
  int worst = 0;
  for (int hh = 0; hh < shape.h; ++hh)
    for (size_t e = 0; e < exact_rows * shape.d; ++e) {
      const size_t i = hh * rows_per_head * shape.d + e;
      worst = std::max(worst, Ulps(skg[i], skc[i]));
    }
  for (size_t i = 0; i < tkg.size(); ++i) worst = std::max(worst, Ulps(tkg[i], tkc[i]));
  EXPECT_LE(worst, 2);
  std::printf("[shadow layer parity] n=%d: %d outlier + %d heavy chunks per head agree, values "
              "and V rows bit-identical (%zu differing), K rows max %d ulps (tol 2)\n",
              n, lc->n_outliers, lc->n_heavy, vdiff, worst);
}

}  // namespace
}  // namespace shadow_layer_gpu_test
}  // namespace kvshade::kernels

// The host value codecs through the service: a shadow session ingested with each
// value_codec hands back, for every chunk a select reconstructs, values within the bound
// that codec allows (codec_bounds.h derives them), and the bounds are tight enough that a
// coarser codec's values fall outside a finer codec's bound, so that a session stored in
// the wrong codec is caught. GetSession reports the codec and the host bytes each takes.
#include <map>
#include <tuple>

#include "codec_bounds.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace value_codec_test {
namespace {

constexpr int kN = 512, kC = 8, kLocal = 32, kOutliers = 2;
constexpr int kChunks = (kN - kLocal) / kC;  // 60 chunks per head, 3 of them static
constexpr int kSelectable = kChunks - 1 - kOutliers;

using kernels::ValueCodec;

struct CodecCase {
  ValueCodec codec;
  v1::ValueCodec proto;
};
constexpr CodecCase kCodecs[] = {{ValueCodec::kBF16, v1::VALUE_CODEC_BF16},
                                 {ValueCodec::kFP8, v1::VALUE_CODEC_FP8},
                                 {ValueCodec::kINT4, v1::VALUE_CODEC_INT4},
                                 {ValueCodec::kINT2, v1::VALUE_CODEC_INT2}};

v1::Profile CodecProfile(v1::ValueCodec codec) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_chunk_size(kC);
  p.set_local_window(kLocal);
  p.set_outliers(kOutliers);
  p.set_sparse_budget(kChunks);  // every selectable chunk: one select returns them all
  p.set_value_codec(codec);
  return p;
}

// The exact values of chunk `chunk` of head `hh` at `layer`: [C, d] floats.
std::vector<float> ExactChunk(const Stream& s, int layer, int hh, int chunk) {
  std::vector<float> out(size_t(kC) * s.d);
  for (int r = 0; r < kC; ++r) {
    const size_t t = size_t(chunk) * kC + r;
    for (int c = 0; c < s.d; ++c) out[size_t(r) * s.d + c] = kernels::Bf16ToFloat(s.v[layer][(t * s.h + hh) * s.d + c]);
  }
  return out;
}

using ChunkKey = std::tuple<int, int, int>;  // layer, head, chunk

TEST(ValueCodecService, SelectedValuesWithinTheCodecsBoundAndHostBytesShrink) {
  Harness hx;
  const Stream s = MakeStream(kN, hx.model, 41);
  const int L = hx.model.num_layers(), h = hx.model.num_kv_heads(), d = hx.model.head_dim();
  // The profiles leave kivi_group unset: the server's default group, which divides d here.
  const int G = int(ProfileDefaults().kivi_group);
  ASSERT_EQ(d % G, 0);
  // Per codec: the values every select delta carried, by (layer, head, chunk).
  std::map<ValueCodec, std::map<ChunkKey, std::vector<float>>> got;
  std::map<ValueCodec, uint64_t> host_bytes;
  for (const CodecCase& cc : kCodecs) {
    SCOPED_TRACE(std::string(kernels::ValueCodecName(cc.codec)));
    auto o = hx.Open(s, CodecProfile(cc.proto));
    ASSERT_FALSE(o.attachment.empty());
    ASSERT_EQ(o.reused, 0u);  // the codec is part of the prefix key: nothing shared
    v1::GetSessionRequest gr;
    gr.set_session_id(o.session);
    auto info = hx.engine->GetSession(hx.tenant, gr);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->value_codec(), cc.proto);
    host_bytes[cc.codec] = info->host_bytes();
    for (int l = 0; l < L; ++l) {
      auto delta = hx.Select(o.attachment, l, hx.Query(500 + l));
      ASSERT_TRUE(delta.ok()) << delta.status();
      ASSERT_EQ(delta->head_size(), h * kSelectable) << "layer " << l;
      const std::vector<bf16> values = TensorBf16(delta->values());
      ASSERT_EQ(values.size(), size_t(delta->head_size()) * kC * d);
      for (int i = 0; i < delta->head_size(); ++i) {
        std::vector<float> v(size_t(kC) * d);
        for (size_t e = 0; e < v.size(); ++e) v[e] = kernels::Bf16ToFloat(values[i * v.size() + e]);
        got[cc.codec][{l, int(delta->head(i)), delta->chunk(i)}] = std::move(v);
      }
    }
    ASSERT_EQ(got[cc.codec].size(), size_t(L) * h * kSelectable);
  }

  // worst[data][bound]: the largest error / bound of `data`'s values under `bound`'s bound.
  std::map<ValueCodec, std::map<ValueCodec, double>> worst;
  for (const CodecCase& data : kCodecs) {
    for (const auto& [key, v] : got[data.codec]) {
      const auto [l, hh, chunk] = key;
      const std::vector<float> want = ExactChunk(s, l, hh, chunk);
      for (const CodecCase& bound : kCodecs) {
        double& w = worst[data.codec][bound.codec];
        w = std::max(w, WorstRatio(v, want, ValueChunkBounds(bound.codec, want, kC, d, G)));
      }
    }
  }
  for (const CodecCase& data : kCodecs) {
    const std::string name(kernels::ValueCodecName(data.codec));
    // Within its own bound...
    EXPECT_LE(worst[data.codec][data.codec], 1.0) << name << " values outside the " << name << " bound";
    // ...which is tight (some element uses at least half of it; bf16 is exact).
    if (data.codec != ValueCodec::kBF16) {
      EXPECT_GE(worst[data.codec][data.codec], 0.5) << name << ": the bound is loose";
    }
  }
  // A coarser codec's values break a finer codec's bound: int2 data at the int4 bound, int4
  // at fp8's, fp8 (and everything lossy) at bf16's.
  EXPECT_GT(worst[ValueCodec::kINT2][ValueCodec::kINT4], 1.0);
  EXPECT_GT(worst[ValueCodec::kINT4][ValueCodec::kFP8], 1.0);
  EXPECT_GT(worst[ValueCodec::kFP8][ValueCodec::kBF16], 1.0);
  EXPECT_GT(worst[ValueCodec::kINT2][ValueCodec::kFP8], 1.0);
  EXPECT_GT(worst[ValueCodec::kINT4][ValueCodec::kBF16], 1.0);
  for (const auto& [data, row] : worst) {
    for (const auto& [bound, w] : row) {
      ::testing::Test::RecordProperty(absl::StrCat("worst_", std::string(kernels::ValueCodecName(data)), "_at_",
                                                   std::string(kernels::ValueCodecName(bound))),
                                      absl::StrCat(w));
    }
  }

  // Host bytes (docs/ALGORITHM.md "Values"): every chunk of every head and layer, C*d values,
  // in slots of the codec's chunk bytes rounded up to 16: bf16 2 bytes a value; fp8 1 byte
  // plus a 4-byte scale; int4 and int2 their codes plus an fp16 scale and minimum per group
  // of G values (at G = 32: 5/16 and 3/16 of bf16; at 16: 3/8 and 1/4).
  const uint64_t chunks = uint64_t(L) * h * kChunks;
  const uint64_t bf16_bytes = chunks * kC * d * 2;
  auto kivi = [&](int bits) { return chunks * ((kC * d * bits / 8 + kC * (d / G) * 4 + 15) / 16 * 16); };
  EXPECT_EQ(host_bytes[ValueCodec::kBF16], bf16_bytes);
  EXPECT_EQ(host_bytes[ValueCodec::kFP8], chunks * ((4 + kC * d + 15) / 16 * 16));
  EXPECT_EQ(host_bytes[ValueCodec::kINT4], kivi(4));
  EXPECT_EQ(host_bytes[ValueCodec::kINT2], kivi(2));
  EXPECT_LE(host_bytes[ValueCodec::kINT4], bf16_bytes * 3 / 8);
  EXPECT_LT(host_bytes[ValueCodec::kINT2], host_bytes[ValueCodec::kINT4]);
}

}  // namespace
}  // namespace value_codec_test
}  // namespace kvshade::service::testing

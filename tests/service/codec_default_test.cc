// The server's default value codec "auto": int4 host values for long shadow sessions,
// bf16 for shorter ones and for the mini profile; an explicit request or server setting
// wins. Also what GetSession reports.
#include <gtest/gtest.h>

#include "kvshade/service/config.h"
#include "kvshade/service/model.h"

namespace kvshade::service {
namespace {

v1::ModelSpec Llama8bShape() {
  v1::ModelSpec m;
  m.set_model_id("test/llama3-8b-shape");
  m.set_num_layers(32);
  m.set_num_query_heads(32);
  m.set_num_kv_heads(8);
  m.set_head_dim(128);
  m.set_dtype(v1::DTYPE_BF16);
  return m;
}

kernels::ValueCodec Resolve(const v1::Profile& p, const ProfileDefaults& def, uint64_t n) {
  auto model = ResolveModel(Llama8bShape(), LimitsConfig());
  EXPECT_TRUE(model.ok()) << model.status();
  auto r = ResolveProfile(p, def, *model, n);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->codec.codec : kernels::ValueCodec::kFP8;
}

TEST(CodecDefault, AutoIsInt4ForLongShadowSessionsAndBf16Otherwise) {
  ProfileDefaults def;
  ASSERT_EQ(def.value_codec, "auto");
  v1::Profile shadow;
  shadow.set_kind(v1::PROFILE_KIND_SHADOW);
  EXPECT_EQ(Resolve(shadow, def, def.int4_from_tokens - 1), kernels::ValueCodec::kBF16);
  EXPECT_EQ(Resolve(shadow, def, def.int4_from_tokens), kernels::ValueCodec::kINT4);
  EXPECT_EQ(Resolve(shadow, def, 131072), kernels::ValueCodec::kINT4);
  v1::Profile mini;
  mini.set_kind(v1::PROFILE_KIND_MINI);
  EXPECT_EQ(Resolve(mini, def, 131072), kernels::ValueCodec::kBF16);
  v1::Profile autokind;  // auto kind: shadow from min_tokens on
  EXPECT_EQ(Resolve(autokind, def, 131072), kernels::ValueCodec::kINT4);
  EXPECT_EQ(Resolve(autokind, def, def.min_tokens - 1), kernels::ValueCodec::kBF16);
}

TEST(CodecDefault, ExplicitChoicesWin) {
  ProfileDefaults def;
  v1::Profile p;
  p.set_kind(v1::PROFILE_KIND_SHADOW);
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  EXPECT_EQ(Resolve(p, def, 131072), kernels::ValueCodec::kBF16);
  p.set_value_codec(v1::VALUE_CODEC_INT2);
  EXPECT_EQ(Resolve(p, def, 1024), kernels::ValueCodec::kINT2);
  ProfileDefaults bf16_server;
  bf16_server.value_codec = "bf16";
  p.clear_value_codec();
  EXPECT_EQ(Resolve(p, bf16_server, 131072), kernels::ValueCodec::kBF16);
  ProfileDefaults low;
  low.int4_from_tokens = 1000;
  EXPECT_EQ(Resolve(p, low, 1000), kernels::ValueCodec::kINT4);
}

}  // namespace
}  // namespace kvshade::service

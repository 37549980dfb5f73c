// The server's default value codec "auto": int4 host values for long shadow sessions,
// bf16 for shorter ones and for the mini profile; an explicit request or server setting
// wins. Also what GetSession reports. And the profile fields that take 0 as a value of
// their own: set to 0 they are 0, left unset they are the server's default.
#include <gtest/gtest.h>

#include "kvshade/service/config.h"
#include "kvshade/service/model.h"

namespace kvshade::service {
namespace codec_default_test {
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

// The KIVI group: the server's (32) where it divides the head dim, halved down to 16 until
// it does; the mini profile's at most 16 (INT2 keys and values); a group asked for is taken
// as it is (and refused by the profile if it does not fit).
TEST(KiviGroupDefault, TheServersGroupHalvedUntilItDividesTheHeadDim) {
  ProfileDefaults def;
  ASSERT_EQ(def.kivi_group, 32u);
  auto group = [&](int head_dim, uint32_t asked, v1::ProfileKind kind) -> absl::StatusOr<int> {
    v1::ModelSpec m = Llama8bShape();
    m.set_head_dim(head_dim);
    auto model = ResolveModel(m, LimitsConfig());
    if (!model.ok()) return model.status();
    v1::Profile p;
    p.set_kind(kind);
    if (kind == v1::PROFILE_KIND_SHADOW) p.set_value_codec(v1::VALUE_CODEC_INT4);
    if (asked != 0) p.set_kivi_group(asked);
    auto r = ResolveProfile(p, def, *model, 131072);
    if (!r.ok()) return r.status();
    return r->kivi_group;
  };
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_MINI}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    const int unset = kind == v1::PROFILE_KIND_MINI ? 16 : 32;
    EXPECT_EQ(group(128, 0, kind).value_or(-1), unset);
    EXPECT_EQ(group(64, 0, kind).value_or(-1), unset);
    EXPECT_EQ(group(96, 0, kind).value_or(-1), unset);
    EXPECT_EQ(group(80, 0, kind).value_or(-1), 16);  // 80 = 5 x 16
    EXPECT_EQ(group(48, 0, kind).value_or(-1), 16);
    EXPECT_EQ(group(128, 16, kind).value_or(-1), 16);  // asked for: kept
    EXPECT_EQ(group(128, 64, kind).value_or(-1), 64);
    auto bad = group(80, 32, kind);  // asked for and not dividing d: refused, not changed
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  }
  ProfileDefaults g16;  // a server configured with 16 keeps 16
  g16.kivi_group = 16;
  v1::Profile p;
  p.set_kind(v1::PROFILE_KIND_SHADOW);
  auto model = ResolveModel(Llama8bShape(), LimitsConfig());
  ASSERT_TRUE(model.ok()) << model.status();
  auto r = ResolveProfile(p, g16, *model, 131072);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kivi_group, 16);
}

TEST(ProfilePresence, ZeroIsAValueWhereItMeansSomethingAndUnsetIsTheDefault) {
  ProfileDefaults def;
  auto model = ResolveModel(Llama8bShape(), LimitsConfig());
  ASSERT_TRUE(model.ok()) << model.status();
  v1::Profile unset;
  unset.set_kind(v1::PROFILE_KIND_AUTO);
  auto d = ResolveProfile(unset, def, *model, 1024);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->outliers, int(def.outliers));
  EXPECT_EQ(d->min_tokens, int(def.min_tokens));
  EXPECT_EQ(d->kind, v1::PROFILE_KIND_MINI);  // 1024 < min_tokens
  EXPECT_FLOAT_EQ(d->refactor_threshold, def.refactor_threshold);
  EXPECT_FLOAT_EQ(d->mini_recent_ratio, def.mini_recent_ratio);
  EXPECT_FLOAT_EQ(d->recall_floor, def.recall_floor);
  EXPECT_EQ(d->mass_min_chunks, int(def.mass_min_chunks));
  ASSERT_GT(def.outliers, 0u);
  ASSERT_GT(def.min_tokens, 0u);
  ASSERT_GT(def.refactor_threshold, 0.0f);

  v1::Profile zeros = unset;
  zeros.set_outliers(0);
  zeros.set_heavy_chunks(0);
  zeros.set_min_tokens(0);
  zeros.set_refactor_threshold(0);
  zeros.set_energy_target(0);
  zeros.set_mini_recent_ratio(0);
  zeros.set_mini_heavy_ratio(0);
  zeros.set_mass_min_chunks(0);
  zeros.set_recall_sample_rate(0);
  zeros.set_recall_floor(0);
  auto z = ResolveProfile(zeros, def, *model, 1024);
  ASSERT_TRUE(z.ok()) << z.status();
  EXPECT_EQ(z->outliers, 0);
  EXPECT_EQ(z->heavy_chunks, 0);
  EXPECT_EQ(z->min_tokens, 0);
  EXPECT_EQ(z->kind, v1::PROFILE_KIND_SHADOW);  // min_tokens 0: shadow whatever the length
  EXPECT_EQ(z->refactor_threshold, 0.0f);
  EXPECT_EQ(z->mini_recent_ratio, 0.0f);
  EXPECT_EQ(z->mini_heavy_ratio, 0.0f);
  EXPECT_EQ(z->mass_min_chunks, 0);
  EXPECT_EQ(z->recall_floor, 0.0f);
  // The effective profile reports what was resolved, 0 included, and resolves to itself.
  const v1::Profile back = z->ToProto();
  EXPECT_TRUE(back.has_outliers());
  EXPECT_EQ(back.outliers(), 0u);
  auto again = ResolveProfile(back, def, *model, 1024);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->outliers, 0);
  EXPECT_EQ(again->min_tokens, 0);
  // Fields where 0 is not valid keep 0 as "the default".
  v1::Profile rank0 = unset;
  rank0.set_rank(0);
  rank0.set_local_window(0);
  auto r = ResolveProfile(rank0, def, *model, 1024);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rank, int(def.rank));
  EXPECT_EQ(r->local_window, int(def.local_window));
}

}  // namespace
}  // namespace codec_default_test
}  // namespace kvshade::service

// AppendTokens: the exact tail, whole chunks migrating out of it (projected keys, values,
// landmarks), slot tables growing with the session, the writer rule, and every profile's
// Attend against exact attention over all tokens.
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace append_test {
namespace {

constexpr int kG = 2, kH = 2, kD = 64;

int TailLength(Harness& hx, const std::string& attachment, int layer) {
  const v1::GetStaticSetResponse st = hx.StaticSet(attachment, layer);
  return st.tail_k().shape_size() > 0 ? static_cast<int>(st.tail_k().shape(0)) : -1;
}

TEST(AppendTest, ShadowChunksMigrateOutOfTheTail) {
  Harness hx;
  Stream s = MakeStream(560, hx.model, 21);
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_sparse_budget(64);  // more than the 46 chunks at first: k grows with the session
  p.set_outliers(2);
  auto o = hx.Open(s, p, 400);
  EXPECT_EQ(TailLength(hx, o.attachment, 0), 32);
  auto d0 = hx.Select(o.attachment, 0, hx.Query(1));
  ASSERT_TRUE(d0.ok());
  EXPECT_EQ(d0->selected(), uint32_t(kH * (46 - 3)));  // every selectable chunk
  int pos = 400;
  // One token at a time, then a block of 100.
  for (; pos < 460; ++pos) {
    auto r = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, pos, pos + 1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->tokens(), uint64_t(pos + 1));
    // 400 prompt tokens keep a 32-token remainder, one tail with the appended tokens:
    // at most local_window + C.
    const int tail = TailLength(hx, o.attachment, 1);
    EXPECT_LE(tail, 32 + 8);
  }
  auto r = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 460, 560));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->tokens(), 560u);
  // 32 remainder and 160 appended tokens: (192 - 32) / 8 = 20 chunks left the tail, 32
  // remain.
  EXPECT_EQ(TailLength(hx, o.attachment, 0), 32);
  auto d1 = hx.Select(o.attachment, 0, hx.Query(1));
  ASSERT_TRUE(d1.ok()) << d1.status();
  EXPECT_EQ(d1->selected(), uint32_t(kH * 63));  // min(64, 43 + 20) per head
  for (int i = 0; i < d1->slot_size(); ++i) EXPECT_LT(d1->slot(i), 64u);
  // Full rank and full budget: Attend over everything equals exact attention.
  for (int l = 0; l < 2; ++l) {
    auto q = hx.Query(50 + l);
    auto out = hx.Attend(o.attachment, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LT(RelErr(*out, ExactAttend(s, l, kG, q, 560)), 2e-2) << l;
  }
}

TEST(AppendTest, ExactAndMiniAppend) {
  Harness hx;
  Stream s = MakeStream(400, hx.model, 22);
  auto e = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT), 100);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(e.session, s, 100, 103)).ok());
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(e.session, s, 103, 400)).ok());
  auto q = hx.Query(60);
  auto out = hx.Attend(e.attachment, 1, q);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_LT(RelErr(*out, ExactAttend(s, 1, kG, q, 400)), 1e-2);

  v1::Profile mp = ProfileOf(v1::PROFILE_KIND_MINI);
  mp.set_mini_recent_ratio(1.0f);  // keep the whole prompt: only INT2 error remains
  auto m = hx.Open(s, mp, 100);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(m.session, s, 100, 250)).ok());
  // 150 appended: 128 quantized into the open segment, 22 in the bf16 residual.
  v1::GetStaticSetRequest sr;
  sr.set_attachment_id(m.attachment);
  sr.set_layer(0);
  auto st = hx.engine->GetStaticSet(hx.tenant, sr);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_EQ(st->tail_k().shape(0), 150);
  const std::vector<bf16> tk = TensorBf16(st->tail_k()), tv = TensorBf16(st->tail_v());
  const std::vector<float> kr = PostRope(s, 0);
  const size_t tok = size_t(kH) * kD;
  constexpr int kGroup = 16;  // the KIVI group of a mini profile that names none
  // The INT2 rows' error bound, from the codec (docs/ALGORITHM.md "INT2 / INT4 codec"): a
  // group of G values with range [lo, hi] stores lo and scale = (hi - lo) / 3 in fp16 and
  // 2-bit codes rounded to nearest, so a decoded element is within scale/2 of its input;
  // fp16 rounding of lo and scale (relative 2^-11, the scale times at most 3 codes) adds at
  // most 4 * 2^-11 * (|lo| + |hi|), and the bf16 output rounds by 2^-8 of the value.
  // Keys group G tokens per channel; values G channels per token.
  auto bound = [](double lo, double hi, double got) {
    return (hi - lo) / 6 + 4.0 / 2048 * (std::abs(lo) + std::abs(hi)) + std::abs(got) / 256 + 1e-6;
  };
  const std::vector<float> vin = [&] {
    std::vector<float> x(s.v[0].size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = kernels::Bf16ToFloat(s.v[0][i]);
    return x;
  }();
  int checked = 0;
  for (int g0 = 0; g0 < 128; g0 += kGroup) {
    for (int hh = 0; hh < kH; ++hh) {
      for (int c = 0; c < kD; ++c) {  // keys: channel c of tokens g0 .. g0 + G
        double lo = 1e30, hi = -1e30;
        for (int t = g0; t < g0 + kGroup; ++t) {
          const double x = kr[size_t(100 + t) * tok + hh * kD + c];
          lo = std::min(lo, x), hi = std::max(hi, x);
        }
        for (int t = g0; t < g0 + kGroup; ++t) {
          const size_t i = size_t(t) * tok + hh * kD + c;
          const double got = kernels::Bf16ToFloat(tk[i]), ref = kr[100 * tok + i];
          ASSERT_LE(std::abs(got - ref), bound(lo, hi, got)) << "key token " << 100 + t << " head " << hh << " ch " << c;
          ++checked;
        }
      }
    }
  }
  for (int t = 0; t < 128; ++t) {
    for (int hh = 0; hh < kH; ++hh) {
      for (int c0 = 0; c0 < kD; c0 += kGroup) {  // values: channels c0 .. c0 + G of one token
        const size_t at = size_t(t) * tok + hh * kD + c0;
        double lo = 1e30, hi = -1e30;
        for (int c = 0; c < kGroup; ++c) lo = std::min<double>(lo, vin[100 * tok + at + c]), hi = std::max<double>(hi, vin[100 * tok + at + c]);
        for (int c = 0; c < kGroup; ++c) {
          const double got = kernels::Bf16ToFloat(tv[at + c]), ref = vin[100 * tok + at + c];
          ASSERT_LE(std::abs(got - ref), bound(lo, hi, got)) << "value token " << 100 + t << " head " << hh;
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 2 * 128 * kH * kD);
  // The bf16 residual rows: the appended values exactly, the keys rotated and rounded to
  // bf16 (one rounding: within 2^-8 of the value).
  for (size_t i = 128 * tok; i < 150 * tok; ++i) {
    const double ref = kr[100 * tok + i];
    EXPECT_LE(std::abs(kernels::Bf16ToFloat(tk[i]) - ref), std::abs(ref) / 256 + 1e-6) << i;
    EXPECT_EQ(kernels::Bf16ToFloat(tv[i]), vin[100 * tok + i]) << i;
  }
  // Attend over the mini session is attention over exactly the rows it holds (the prompt's
  // kept rows in the static set, the tail): the reference is computed here in double from
  // GetStaticSet's rows; the output differs from it only by fp32 accumulation (7e-7 seen).
  for (int l = 0; l < 2; ++l) {
    sr.set_layer(l);
    auto held = hx.engine->GetStaticSet(hx.tenant, sr);
    ASSERT_TRUE(held.ok()) << held.status();
    EXPECT_EQ(held->tail_k().shape(0), 150);
    auto mo = hx.Attend(m.attachment, l, q);
    ASSERT_TRUE(mo.ok()) << mo.status();
    EXPECT_LT(RelErr(*mo, HeldAttend(*held, kG, kD, q)), 1e-5) << l;
  }
}

TEST(AppendTest, OneWriterAtATime) {
  Harness hx;
  Stream s = MakeStream(200, hx.model, 23);
  auto o = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT), 100);
  // No writer attachment: the owner may append without one.
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 100, 101)).ok());
  const std::string w = hx.AttachTo(o.session, /*writer=*/true);
  v1::AttachRequest second;
  second.set_session_id(o.session);
  second.set_writer(true);
  EXPECT_EQ(hx.engine->Attach(hx.tenant, second).status().code(), absl::StatusCode::kFailedPrecondition);
  auto anon = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 101, 102));
  EXPECT_EQ(anon.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(anon.status().message().find("writer"), std::string::npos);
  auto reader = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 101, 102, o.attachment));
  EXPECT_EQ(reader.status().code(), absl::StatusCode::kPermissionDenied);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 101, 102, w)).ok());
  // The writer's lease runs out: the role is free again.
  hx.now_ms += 31'000;
  EXPECT_EQ(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 102, 103, w)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 102, 103)).ok());
  const std::string w2 = hx.AttachTo(o.session, /*writer=*/true);
  EXPECT_FALSE(w2.empty());
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->tokens(), 103u);
}

}  // namespace
}  // namespace append_test
}  // namespace kvshade::service::testing

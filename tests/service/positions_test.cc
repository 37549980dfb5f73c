// Token positions in what a worker receives: every static row and tail row of
// GetStaticSet, and every miss of a SlotDelta, names the absolute position of the token it
// holds. Checked by content: at full rank every row's post-RoPE key is the input's key at
// the position it names (a row of another token differs by O(1)), on a session of two
// segments whose second starts mid-chunk (a reused 515-token prompt, C = 8), so that
// positions do not follow from chunk ids alone; across a restart of the durable session;
// after appends; and for exact (appended tokens included) and mini sessions.
#include <algorithm>
#include <cmath>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace positions_test {
namespace {

constexpr int kC = 8;

v1::Profile FullRankShadow(int budget) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);  // h * d: reconstructed keys are the keys, to bf16
  p.set_sparse_budget(budget);
  p.set_outliers(2);
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  p.set_rerank_factor(1);
  return p;
}

// Whether `key` (d bf16) is the post-RoPE key of token `pos`, head hh: within one bf16
// rounding (2^-8 relative) plus 2e-3 for the rotation and, for reconstructed rows, the
// low-rank factors' own bf16 roundings.
bool KeyOf(const std::vector<float>& ref, int h, int d, const bf16* key, int64_t pos, int hh) {
  if (pos < 0 || size_t(pos + 1) * h * d > ref.size()) return false;
  const float* r = ref.data() + (size_t(pos) * h + hh) * d;
  for (int c = 0; c < d; ++c) {
    if (std::abs(double(kernels::Bf16ToFloat(key[c])) - r[c]) > std::ldexp(std::abs(r[c]), -7) + 2e-2) {
      return false;
    }
  }
  return true;
}

// Checks that every static and tail row holds the token its position names, that the
// tail's positions rise and end at the session's last token; returns the positions seen.
std::vector<int64_t> CheckStaticSet(const v1::GetStaticSetResponse& st, const std::vector<float>& ref, int h,
                                    int d, int64_t tokens, const std::string& what) {
  std::vector<int64_t> seen;
  const int64_t srows = st.k().shape_size() == 3 ? st.k().shape(1) : 0;
  EXPECT_EQ(st.positions_size(), h * srows) << what;
  const std::vector<bf16> sk = TensorBf16(st.k()), tk = TensorBf16(st.tail_k());
  for (int hh = 0; hh < h && st.positions_size() == h * srows; ++hh) {
    for (int64_t i = 0; i < srows; ++i) {
      const int64_t pos = st.positions(int(hh * srows + i));
      if (i >= int64_t(st.lengths(hh))) {
        EXPECT_EQ(pos, -1) << what << ": head " << hh << " row " << i << " past the length";
        continue;
      }
      EXPECT_TRUE(KeyOf(ref, h, d, &sk[(size_t(hh) * srows + i) * d], pos, hh))
          << what << ": static row " << i << " of head " << hh << " is not token " << pos;
      seen.push_back(pos);
    }
  }
  const int64_t t = st.tail_k().shape_size() == 3 ? st.tail_k().shape(0) : 0;
  EXPECT_EQ(st.tail_positions_size(), t) << what;
  for (int i = 0; i < st.tail_positions_size(); ++i) {
    const int64_t pos = st.tail_positions(i);
    if (i > 0) EXPECT_GT(pos, st.tail_positions(i - 1)) << what << ": tail row " << i;
    for (int hh = 0; hh < h; ++hh) {
      EXPECT_TRUE(KeyOf(ref, h, d, &tk[(size_t(i) * h + hh) * d], pos, hh))
          << what << ": tail row " << i << " (head " << hh << ") is not token " << pos;
    }
  }
  if (t > 0) EXPECT_EQ(st.tail_positions(int(t) - 1), tokens - 1) << what;
  return seen;
}

// Selects every chunk (budget >= chunks) with a fresh attachment: each miss's C rows are
// the tokens from its position on. Returns the misses' positions.
std::vector<int64_t> CheckDeltaPositions(Harness& hx, const std::string& attachment, int layer,
                                         const std::vector<float>& ref, int h, int d) {
  auto delta = hx.Select(attachment, layer, hx.Query(7));
  EXPECT_TRUE(delta.ok()) << delta.status();
  if (!delta.ok()) return {};
  EXPECT_EQ(delta->position_size(), delta->chunk_size());
  const std::vector<bf16> keys = TensorBf16(delta->keys());
  std::vector<int64_t> out;
  for (int x = 0; x < delta->chunk_size() && x < delta->position_size(); ++x) {
    const int64_t pos = delta->position(x);
    for (int i = 0; i < kC; ++i) {
      EXPECT_TRUE(KeyOf(ref, h, d, &keys[(size_t(x) * kC + i) * d], pos + i, int(delta->head(x))))
          << "miss " << x << " (chunk " << delta->chunk(x) << ", head " << delta->head(x) << ") row " << i
          << " is not token " << pos + i;
    }
    out.push_back(pos);
  }
  return out;
}

TEST(Positions, NameTheTokenOfEveryRowAcrossSegmentsAppendsAndRestarts) {
  TempDir dir;
  Harness hx(dir.path());
  const int h = 2, d = 64, layer = 1;
  const Stream s = MakeStream(640, hx.model, 21);
  const std::vector<float> ref = PostRope(s, layer);
  auto doc = hx.Open(s, FullRankShadow(128), 515, /*durable=*/true);
  auto qa = hx.Open(s, FullRankShadow(128), 600, /*durable=*/true);
  ASSERT_EQ(qa.reused, 515u);

  const std::vector<int64_t> statics = CheckStaticSet(hx.StaticSet(qa.attachment, layer), ref, h, d, 600, "2 segments");
  EXPECT_TRUE(std::count(statics.begin(), statics.end(), 0)) << "the sink's first token";
  const std::vector<int64_t> misses = CheckDeltaPositions(hx, qa.attachment, layer, ref, h, d);
  // The second segment's chunks start at its first token, 515: mid-chunk for C = 8.
  EXPECT_TRUE(std::any_of(misses.begin(), misses.end(), [](int64_t p) { return p >= 515 && (p - 515) % kC == 0; }));
  EXPECT_TRUE(std::none_of(misses.begin(), misses.end(), [](int64_t p) { return p > 512 && p < 515; }));

  // A restart restores the durable session with its positions.
  const v1::GetStaticSetResponse before = hx.StaticSet(qa.attachment, layer);
  hx.Restart();
  const v1::GetStaticSetResponse after = hx.StaticSet(hx.AttachTo(qa.session), layer);
  EXPECT_EQ(std::vector<int64_t>(after.positions().begin(), after.positions().end()),
            std::vector<int64_t>(before.positions().begin(), before.positions().end()));
  EXPECT_EQ(std::vector<int64_t>(after.tail_positions().begin(), after.tail_positions().end()),
            std::vector<int64_t>(before.tail_positions().begin(), before.tail_positions().end()));
  CheckStaticSet(after, ref, h, d, 600, "after a restart");

  // Appends: 40 more tokens (some leave the tail as chunks of an open segment).
  v1::AppendTokensRequest ar = AppendOf(qa.session, s, 600, 640);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, ar).ok());
  CheckStaticSet(hx.StaticSet(hx.AttachTo(qa.session), layer), ref, h, d, 640, "after appends");
  const std::vector<int64_t> later = CheckDeltaPositions(hx, hx.AttachTo(qa.session), layer, ref, h, d);
  EXPECT_GT(*std::max_element(later.begin(), later.end()), *std::max_element(misses.begin(), misses.end()));
}

TEST(Positions, MiniAndExactRowsNameTheirTokens) {
  Harness hx;
  const int h = 2, d = 64, layer = 0;
  const Stream s = MakeStream(300, hx.model, 22);
  const std::vector<float> ref = PostRope(s, layer);
  auto ex = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT), 290);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(ex.session, s, 290, 300)).ok());
  const v1::GetStaticSetResponse es = hx.StaticSet(ex.attachment, layer);
  ASSERT_EQ(es.tail_positions_size(), 300);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(es.tail_positions(i), i);
  CheckStaticSet(es, ref, h, d, 300, "exact, 10 of its tokens appended");
  // Mini: the retained tokens' keys are INT2 (direction only), so the check is on which
  // tokens: per head, distinct ascending positions ending with the recent window.
  auto mi = hx.Open(s, ProfileOf(v1::PROFILE_KIND_MINI));
  const v1::GetStaticSetResponse ms = hx.StaticSet(mi.attachment, layer);
  const int64_t srows = ms.k().shape(1);
  ASSERT_EQ(ms.positions_size(), h * srows);
  for (int hh = 0; hh < h; ++hh) {
    const int len = int(ms.lengths(hh));
    ASSERT_GT(len, 0);
    for (int i = 1; i < len; ++i) EXPECT_GT(ms.positions(int(hh * srows + i)), ms.positions(int(hh * srows + i - 1)));
    // The newest prompt token is in the static rows (the recent window) or the tail.
    const int64_t last = ms.positions(int(hh * srows + len - 1));
    EXPECT_TRUE(last == 299 || (ms.tail_positions_size() > 0 && ms.tail_positions(ms.tail_positions_size() - 1) == 299));
  }
}

}  // namespace
}  // namespace positions_test
}  // namespace kvshade::service::testing

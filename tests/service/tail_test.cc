// The exact tail of shadow sessions (docs/ALGORITHM.md "Later tokens and turns"): one
// tail, whatever mix of the prompt's remainder and appended tokens it holds, of at most
// local_window + C tokens; whole chunks leave it oldest first, so chunk ids follow token
// order and every chunk is reconstructed at its own positions. Checked after every append
// for prompts of every length mod C, fresh and as short suffixes after a cached document,
// across a fork at the end, a background refactorization and durable restarts (drained,
// and as after kill -9).
//
// Accuracy bounds. Rank r = h*d = D (full rank) and a budget covering every chunk make
// Attend equal exact attention up to bf16 rounding (unit roundoff u = 2^-9 ~ 2e-3):
// values are bf16 in and out (bit-exact), tail and static keys are the post-RoPE keys
// rounded once, and a selected chunk's keys are RoPE(bf16(A) bf16(B)) rounded: within
// about (2 + sqrt(D))u |k| of the exact key (A's rounding, B's amplified by at most
// sqrt(D) = 4 for D = 16, the output's rounding), <= 6u ~ 1.2e-2 relative (measured per
// chunk, over 12 seeds: <= 6.5e-3). kChunkKeyBound = 2e-2 holds a chunk's reconstructed
// keys to its own tokens' post-RoPE keys; any other token range is ~1.4 away.
// Attend: a key error dk moves a logit q.k/sqrt(d) by |q||dk|/sqrt(d) <= 6u sqrt(d) ~
// 3.4e-2 for these unit-variance heads (|q| ~ |k| ~ sqrt(d), d = 8) in the worst
// alignment, ~6u ~ 1.2e-2 typically; the output o = sum p_i v_i then moves by about that
// times the spread of the values around o, which relative to |o| (an average of ~100
// diffuse tokens' values, smaller than they are) is up to a few times more. kAttendBound =
// 4e-2 (measured over 12 seeds: <= 1.7e-2).
#include <cstdlib>
#include <filesystem>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace tail_test {
namespace {

constexpr int kLocal = 32, kC = 8, kG = 2;
constexpr double kAttendBound = 4e-2;
constexpr double kChunkKeyBound = 2e-2;
// Worst errors seen in a test, reported as its properties (the XML report).
double g_worst_key = 0, g_worst_attend = 0;

void ReportWorstErrors() {
  ::testing::Test::RecordProperty("worst_chunk_key_error", std::to_string(g_worst_key));
  ::testing::Test::RecordProperty("worst_attend_error", std::to_string(g_worst_attend));
  g_worst_key = g_worst_attend = 0;
}


v1::Profile TailProfile(int rank) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(rank);
  p.set_chunk_size(kC);
  p.set_local_window(kLocal);
  p.set_sparse_budget(4096);  // covers every chunk of these sessions
  p.set_outliers(2);
  return p;
}

// The tail that `t` exact tokens leave: whole chunks go while it exceeds local + C.
int Trimmed(int t) { return t > kLocal + kC ? t - (t - kLocal) / kC * kC : t; }

absl::StatusOr<v1::GetStaticSetResponse> StaticSet(Harness& hx, const std::string& attachment,
                                                   int layer) {
  v1::GetStaticSetRequest r;
  r.set_attachment_id(attachment);
  r.set_layer(layer);
  return hx.engine->GetStaticSet(hx.tenant, r);
}

int TailOf(Harness& hx, const std::string& attachment, int layer = 0) {
  auto st = StaticSet(hx, attachment, layer);
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() ? static_cast<int>(st->tail_k().shape(0)) : -1;
}

void Detach(Harness& hx, const std::string& attachment) {
  v1::DetachRequest dr;
  dr.set_attachment_id(attachment);
  EXPECT_TRUE(hx.engine->Detach(hx.tenant, dr).ok());
}

double RelErrF(const float* got, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    num += double(got[i] - ref[i]) * (got[i] - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The session holds tokens [0, n) of `s` as chunks 0..m-1 then an exact tail of the last
// t tokens, chunk j holding tokens [j*C, (j+1)*C) at their own positions: for every layer
// the tail equals the last t post-RoPE keys (values bit-exact), and every selectable chunk,
// all selected by a fresh attachment whose budget covers them, reconstructs to its own
// tokens' post-RoPE keys and decodes to their values (bit-exact, bf16 codec).
void ExpectChunksFollowTokens(Harness& hx, const Stream& s, const std::string& session, int n,
                              const std::string& what) {
  SCOPED_TRACE(what);
  const std::string att = hx.AttachTo(session);
  const int h = s.h, d = s.d;
  const size_t tok = size_t(h) * d;
  for (int l = 0; l < s.L; ++l) {
    SCOPED_TRACE(::testing::Message() << "layer " << l);
    auto ss = StaticSet(hx, att, l);
    ASSERT_TRUE(ss.ok()) << ss.status();
    const int t = static_cast<int>(ss->tail_k().shape(0));
    EXPECT_LE(t, kLocal + kC);
    ASSERT_EQ((n - t) % kC, 0) << "tail " << t;
    const int chunks = (n - t) / kC;
    const std::vector<float> kr = PostRope(s, l);
    const std::vector<bf16> tk = TensorBf16(ss->tail_k()), tv = TensorBf16(ss->tail_v());
    ASSERT_EQ(tk.size(), size_t(t) * tok);
    const std::vector<float> tkf = kernels::testing::ToFloat(tk);
    EXPECT_LT(RelErrF(tkf.data(), kr.data() + size_t(n - t) * tok, tkf.size()), 1e-2)
        << "the tail is not the last " << t << " tokens";
    EXPECT_EQ(std::memcmp(tv.data(), s.v[l].data() + size_t(n - t) * tok, tv.size() * 2), 0)
        << "the tail's values are not the last " << t << " tokens'";
    uint32_t selectable = 0;
    for (int hh = 0; hh < h; ++hh) selectable += chunks - ss->lengths(hh) / kC;
    auto delta = hx.Select(att, l, hx.Query(900 + l));
    ASSERT_TRUE(delta.ok()) << delta.status();
    EXPECT_EQ(delta->selected(), selectable);
    ASSERT_EQ(delta->chunk_size(), int(selectable));
    const std::vector<bf16> keys = TensorBf16(delta->keys()), values = TensorBf16(delta->values());
    ASSERT_EQ(keys.size(), size_t(selectable) * kC * d);
    std::vector<std::set<int>> seen(h);
    double worst = 0;
    int bad_values = 0, bad_keys = 0;
    std::string first_bad;
    for (int i = 0; i < delta->chunk_size(); ++i) {
      const int c = delta->chunk(i), hh = static_cast<int>(delta->head(i));
      ASSERT_GE(c, 0);
      ASSERT_LT(c, chunks);
      EXPECT_TRUE(seen[hh].insert(c).second) << "chunk " << c << " twice for head " << hh;
      std::vector<float> got(size_t(kC) * d), ref(got.size());
      for (int j = 0; j < kC; ++j) {
        const size_t src = (size_t(c) * kC + j) * tok + size_t(hh) * d;
        for (int x = 0; x < d; ++x) {
          got[size_t(j) * d + x] = kernels::Bf16ToFloat(keys[(size_t(i) * kC + j) * d + x]);
          ref[size_t(j) * d + x] = kr[src + x];
        }
        const bf16* got_v = values.data() + (size_t(i) * kC + j) * d;
        bad_values += std::memcmp(got_v, s.v[l].data() + src, size_t(d) * 2) != 0;
      }
      const double err = RelErrF(got.data(), ref.data(), got.size());
      if (err >= kChunkKeyBound && bad_keys++ == 0) {
        first_bad = absl::StrCat("chunk ", c, " (head ", hh, ") does not hold tokens [", c * kC, ", ",
                                 (c + 1) * kC, "): relative key error ", err);
      }
      worst = std::max(worst, err);
    }
    EXPECT_EQ(bad_keys, 0) << "selected chunks whose keys are not their tokens' (of " << delta->chunk_size()
                           << "); first: " << first_bad;
    EXPECT_EQ(bad_values, 0) << "value rows of selected chunks that are not their tokens'";
    g_worst_key = std::max(g_worst_key, worst);
  }
  Detach(hx, att);
}

void ExpectAttendIsExact(Harness& hx, const Stream& s, const std::string& session, int n,
                         const std::string& what) {
  SCOPED_TRACE(what);
  const std::string att = hx.AttachTo(session);
  for (int l = 0; l < s.L; ++l) {
    const auto q = hx.Query(700 + l);
    auto out = hx.Attend(att, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    const double err = RelErr(*out, ExactAttend(s, l, kG, q, n));
    EXPECT_LT(err, kAttendBound) << "layer " << l;
    g_worst_attend = std::max(g_worst_attend, err);
  }
  Detach(hx, att);
}

// Appends tokens [from, to) of `s` in pieces of `sizes` (cycled), checking the tail after
// every append against the rule, starting from `tail` exact tokens.
void AppendChecked(Harness& hx, const Stream& s, const std::string& session,
                   const std::string& att, int from, int to, const std::vector<int>& sizes,
                   int* tail, const std::string& what) {
  SCOPED_TRACE(what);
  size_t i = 0;
  int over = 0, wrong = 0;
  std::string first;
  for (int pos = from; pos < to;) {
    const int n = std::min(sizes[i++ % sizes.size()], to - pos);
    auto r = hx.engine->AppendTokens(hx.tenant, AppendOf(session, s, pos, pos + n));
    ASSERT_TRUE(r.ok()) << r.status();
    pos += n;
    ASSERT_EQ(r->tokens(), uint64_t(pos));
    *tail = Trimmed(*tail + n);
    const int got = TailOf(hx, att, static_cast<int>(i % s.L));
    over += got > kLocal + kC;
    wrong += got != *tail;
    if (got != *tail && first.empty()) {
      first = absl::StrCat("after the append ending at ", pos, ": tail ", got, ", expected ", *tail);
    }
  }
  EXPECT_EQ(over, 0) << "appends after which the tail exceeded local_window + C; first " << first;
  EXPECT_EQ(wrong, 0) << "appends after which the tail was not the expected length; first " << first;
}

std::vector<int> VaryingSizes(uint64_t seed) {
  std::mt19937_64 rng = kernels::testing::MakeRng(seed);
  std::uniform_int_distribution<int> size(1, 20);
  std::vector<int> out(64);
  for (int& x : out) x = size(rng);
  return out;
}

// The smallest case: a 40-token prompt keeps a 32-token remainder; with 9 single-token
// appends the tail holds 41 tokens, so one chunk (the remainder's oldest 8 tokens) leaves.
TEST(TailTest, PromptRemainderLeavesTheTailWithAppendedTokens) {
  Harness hx;
  hx.model = TestModel(/*L=*/1, /*h=*/1, /*g=*/kG, /*d=*/8);
  Stream s = MakeStream(49, hx.model, 81, /*key_rank=*/8);
  auto o = hx.Open(s, TailProfile(8), 40);
  ASSERT_EQ(TailOf(hx, o.attachment), 32);
  const int expected[9] = {33, 34, 35, 36, 37, 38, 39, 40, 33};
  for (int i = 0; i < 9; ++i) {
    auto r = hx.engine->AppendTokens(hx.tenant, AppendOf(o.session, s, 40 + i, 41 + i));
    ASSERT_TRUE(r.ok()) << r.status();
    const int tail = TailOf(hx, o.attachment);
    EXPECT_LE(tail, kLocal + kC) << "after append " << i + 1;
    EXPECT_EQ(tail, expected[i]) << "after append " << i + 1;
  }
  // Chunk 1 is tokens 8..15, the remainder's first chunk, not the first appended tokens.
  ExpectChunksFollowTokens(hx, s, o.session, 49, "after 9 appends");
  ExpectAttendIsExact(hx, s, o.session, 49, "after 9 appends");
  ReportWorstErrors();
}

// Fresh prompts of every length mod C (40..47, and 296..303), 300 single-token appends and
// ~300 tokens in appends of 1..20 tokens.
TEST(TailTest, LongAppendRunsAfterFreshPromptsOfEveryRemainder) {
  Harness hx;
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/kG, /*d=*/8);
  Stream s = MakeStream(620, hx.model, 82);
  for (int base : {40, 296}) {
    for (int r = 0; r < kC; ++r) {
      const int n = base + r;
      for (bool single : {true, false}) {
        const std::string what = absl::StrCat("prompt ", n, single ? ", single tokens" : ", 1..20 tokens");
        auto o = hx.Open(s, TailProfile(16), n);
        int tail = kLocal + (n - kLocal) % kC;
        ASSERT_EQ(TailOf(hx, o.attachment), tail) << what;
        const std::vector<int> sizes = single ? std::vector<int>{1} : VaryingSizes(83 + n);
        AppendChecked(hx, s, o.session, o.attachment, n, n + 150, sizes, &tail, what);
        if (HasFatalFailure()) return;
        ExpectChunksFollowTokens(hx, s, o.session, n + 150, what + ", half way");
        AppendChecked(hx, s, o.session, o.attachment, n + 150, n + 300, sizes, &tail, what);
        if (HasFatalFailure()) return;
        ExpectChunksFollowTokens(hx, s, o.session, n + 300, what);
        ExpectAttendIsExact(hx, s, o.session, n + 300, what);
        v1::CloseSessionRequest cr;
        cr.set_session_id(o.session);
        ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok());
      }
    }
  }
  ReportWorstErrors();
}

// Suffixes after a cached 256-token document (28 chunks and a 32-token remainder) that are
// shorter than local_window + C, so all exact: the document's remainder and the suffix
// are one tail (longer than local_window + C from 9 suffix tokens on), cut back at the
// commit; suffix lengths below local_window (1..15) and above it (32..39) cover every
// remainder mod C.
TEST(TailTest, LongAppendRunsAfterShortSuffixesOfACachedDocument) {
  Harness hx;
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/kG, /*d=*/8);
  Stream s = MakeStream(620, hx.model, 84);
  auto doc = hx.Open(s, TailProfile(16), 256);
  ASSERT_EQ(TailOf(hx, doc.attachment), 32);
  std::vector<int> suffixes;
  for (int x = 1; x < 16; ++x) suffixes.push_back(x);
  for (int x = 32; x < 40; ++x) suffixes.push_back(x);
  for (int suffix : suffixes) {
    const int n = 256 + suffix;
    for (bool single : {true, false}) {
      const std::string what =
          absl::StrCat("suffix ", suffix, single ? ", single tokens" : ", 1..20 tokens");
      auto o = hx.Open(s, TailProfile(16), n);
      ASSERT_EQ(o.reused, 256u) << what;
      int tail = Trimmed(32 + suffix);
      ASSERT_EQ(TailOf(hx, o.attachment), tail) << what << ", after the commit";
      ExpectChunksFollowTokens(hx, s, o.session, n, what + ", after the commit");
      const std::vector<int> sizes = single ? std::vector<int>{1} : VaryingSizes(85 + suffix);
      AppendChecked(hx, s, o.session, o.attachment, n, n + 160, sizes, &tail, what);
      if (HasFatalFailure()) return;
      ExpectChunksFollowTokens(hx, s, o.session, n + 160, what);
      ExpectAttendIsExact(hx, s, o.session, n + 160, what);
      v1::CloseSessionRequest cr;
      cr.set_session_id(o.session);
      ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, cr).ok());
    }
  }
  // The cached document itself was never changed by its users' appends.
  ExpectChunksFollowTokens(hx, s, doc.session, 256, "document");
  ReportWorstErrors();
}

// A fork at the end shares the sealed open segment (whose first chunks are the prompt's
// remainder) and the tail; both go on independently. A fork at the prompt's end gets the
// whole remainder back.
TEST(TailTest, ForkAtTheEndKeepsOneTailInBoth) {
  Harness hx;
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/kG, /*d=*/8);
  Stream s = MakeStream(400, hx.model, 86);
  auto o = hx.Open(s, TailProfile(16), 45);
  int tail = kLocal + 5;
  AppendChecked(hx, s, o.session, o.attachment, 45, 70, {3}, &tail, "parent");
  v1::ForkSessionRequest fr;
  fr.set_parent_session_id(o.session);
  fr.set_at_token(70);
  auto f = hx.engine->ForkSession(hx.tenant, fr);
  ASSERT_TRUE(f.ok()) << f.status();
  const std::string fa = hx.AttachTo(f->session_id());
  EXPECT_EQ(TailOf(hx, fa), tail);
  int child_tail = tail;
  AppendChecked(hx, s, o.session, o.attachment, 70, 200, {1}, &tail, "parent after the fork");
  AppendChecked(hx, s, f->session_id(), fa, 70, 230, {7}, &child_tail, "child");
  ExpectChunksFollowTokens(hx, s, o.session, 200, "parent");
  ExpectChunksFollowTokens(hx, s, f->session_id(), 230, "child");
  ExpectAttendIsExact(hx, s, f->session_id(), 230, "child");
  // The sealed open segment's chunks (tokens 8..31) end inside the prompt's remainder: it
  // adds no tokens to the chain, so 45 is still a segment boundary, and a fork there has
  // the prompt's whole remainder as its tail.
  fr.set_at_token(45);
  auto b = hx.engine->ForkSession(hx.tenant, fr);
  ASSERT_TRUE(b.ok()) << b.status();
  const std::string ba = hx.AttachTo(b->session_id());
  int boundary_tail = kLocal + 5;
  EXPECT_EQ(TailOf(hx, ba), boundary_tail);
  AppendChecked(hx, s, b->session_id(), ba, 45, 150, {2}, &boundary_tail, "child at 45");
  ExpectChunksFollowTokens(hx, s, b->session_id(), 150, "child at 45");
  ExpectChunksFollowTokens(hx, s, o.session, 200, "parent after the second fork");
  ReportWorstErrors();
}

// A stream whose first `n1` tokens have rank-8 keys in one subspace and the rest in
// another (a later turn on another topic), with little noise (2e-3) outside them.
Stream TwoTopics(const v1::ModelSpec& m, int n1, int n2) {
  Stream a = MakeStream(n1, m, 90, /*key_rank=*/8, 100, /*noise=*/2e-3f);
  Stream b = MakeStream(n2, m, 91, /*key_rank=*/8, 100 + n1, /*noise=*/2e-3f);
  for (int l = 0; l < a.L; ++l) {
    a.k[l].insert(a.k[l].end(), b.k[l].begin(), b.k[l].end());
    a.v[l].insert(a.v[l].end(), b.v[l].begin(), b.v[l].end());
  }
  a.tokens.insert(a.tokens.end(), b.tokens.begin(), b.tokens.end());
  return a;
}

// A short suffix on another topic after a cached document: its commit moves chunks of the
// document's remainder into the open segment, and the background refactorization that the
// suffix's residual schedules moves the open segment's rows to the new basis with the
// rest; later chunks (the suffix's remainder's first) come from the refactorized
// segments' coordinates. Rank 16 holds both rank-8 topics (what it drops is the noise,
// ~1e-3 of a key, under the chunk key bound with bf16 rounding).
TEST(TailTest, RefactorizationKeepsTheTailsChunks) {
  Harness hx;
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/kG, /*d=*/16);
  Stream s = TwoTopics(hx.model, 512, 200);
  v1::Profile p = TailProfile(16);
  p.set_refactor_threshold(0.01f);  // the 20-token suffix is 3.8% of the session
  auto doc = hx.Open(s, p, 512);
  auto turn = hx.Open(s, p, 532);
  ASSERT_EQ(turn.reused, 512u);
  EXPECT_TRUE(turn.ingest.refactorization_scheduled());
  int tail = Trimmed(32 + 20);
  ASSERT_EQ(TailOf(hx, turn.attachment), tail);
  ASSERT_EQ(hx.engine->RunMaintenance(), 1);
  EXPECT_EQ(TailOf(hx, turn.attachment), tail);
  ExpectChunksFollowTokens(hx, s, turn.session, 532, "after the refactorization");
  AppendChecked(hx, s, turn.session, turn.attachment, 532, 700, {1, 3, 11}, &tail, "appended");
  ExpectChunksFollowTokens(hx, s, turn.session, 700, "appended after the refactorization");
  ExpectAttendIsExact(hx, s, turn.session, 700, "appended after the refactorization");
  ExpectChunksFollowTokens(hx, s, doc.session, 512, "document");
  ReportWorstErrors();
}

// Durable sessions: a drained restart restores the tail, static set and chunks exactly; a
// restart as after kill -9 restores the session as of its commit, with the same tail.
TEST(TailTest, DurableRestartKeepsTheTail) {
  TempDir dir;
  Harness hx(dir.path());
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/kG, /*d=*/8);
  Stream s = MakeStream(600, hx.model, 87);
  auto o = hx.Open(s, TailProfile(16), 45, /*durable=*/true);
  int tail = kLocal + 5;
  AppendChecked(hx, s, o.session, o.attachment, 45, 122, VaryingSizes(88), &tail, "before the drain");
  std::vector<v1::GetStaticSetResponse> sets;
  std::vector<std::vector<float>> outs;
  const auto q = hx.Query(89);
  for (int l = 0; l < 2; ++l) {
    auto ss = StaticSet(hx, o.attachment, l);
    ASSERT_TRUE(ss.ok()) << ss.status();
    sets.push_back(*ss);
    auto out = hx.Attend(o.attachment, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    outs.push_back(*out);
  }
  ASSERT_TRUE(hx.engine->Drain().ok());
  hx.Restart();
  const std::string a = hx.AttachTo(o.session);
  for (int l = 0; l < 2; ++l) {
    auto ss = StaticSet(hx, a, l);
    ASSERT_TRUE(ss.ok()) << ss.status();
    EXPECT_EQ(ss->SerializeAsString(), sets[l].SerializeAsString()) << "layer " << l;
    auto out = hx.Attend(a, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(std::memcmp(out->data(), outs[l].data(), out->size() * 4), 0) << "layer " << l;
  }
  ExpectChunksFollowTokens(hx, s, o.session, 122, "after the drained restart");
  AppendChecked(hx, s, o.session, a, 122, 300, {1, 5, 13}, &tail, "after the drained restart");
  ExpectChunksFollowTokens(hx, s, o.session, 300, "appended after the drained restart");
  ExpectAttendIsExact(hx, s, o.session, 300, "appended after the drained restart");

  // A durable document and a 20-token suffix: 52 exact tokens at the commit, cut to 36.
  auto doc = hx.Open(s, TailProfile(16), 256, /*durable=*/true);
  auto qa = hx.Open(s, TailProfile(16), 276, /*durable=*/true);
  ASSERT_EQ(qa.reused, 256u);
  int qa_tail = Trimmed(52);
  ASSERT_EQ(TailOf(hx, qa.attachment), qa_tail);
  int lost = qa_tail;
  AppendChecked(hx, s, qa.session, qa.attachment, 276, 300, {1}, &lost, "appended, then lost");
  hx.Restart();  // no drain: as after kill -9, the session is as of its commit
  const std::string qa2 = hx.AttachTo(qa.session);
  v1::GetSessionRequest gr;
  gr.set_session_id(qa.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->tokens(), 276u);
  EXPECT_EQ(TailOf(hx, qa2), qa_tail);
  ExpectChunksFollowTokens(hx, s, qa.session, 276, "as of the commit");
  AppendChecked(hx, s, qa.session, qa2, 276, 420, {1, 2, 17}, &qa_tail, "after the kill -9 restart");
  ExpectChunksFollowTokens(hx, s, qa.session, 420, "appended after the kill -9 restart");
  ExpectAttendIsExact(hx, s, qa.session, 420, "appended after the kill -9 restart");
  ReportWorstErrors();
}

}  // namespace
}  // namespace tail_test
}  // namespace kvshade::service::testing

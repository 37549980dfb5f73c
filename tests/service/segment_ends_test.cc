// Segment ends (docs/DESIGN.md "Segment ends"): a prompt cut at segment ends commits one
// segment per range, each cached on its own, so that a second question over the same
// document reuses the document; the reuse answers bit for bit as a fresh ingest with the
// same ends; bad ends are refused and create nothing; the automatic end at the divergence
// point; the cap; durable restarts and forks at the new boundaries; a document range
// compressed apart from its layer during a chunked prefill, dropped streams included.
#include "gmock/gmock.h"
#include "ingest_test_util.h"

namespace kvshade::service::testing {
namespace segment_ends_test {
namespace {

using ::testing::HasSubstr;

constexpr int kDoc = 512;  // two prefix blocks

v1::Profile DocProfile(v1::ProfileKind kind = v1::PROFILE_KIND_SHADOW) {
  v1::Profile p = ProfileOf(kind);
  if (kind == v1::PROFILE_KIND_SHADOW) {
    p.set_rank(128);
    p.set_sparse_budget(16);
    p.set_outliers(2);
  }
  return p;
}

// The first `at` tokens of `doc` (ids and K/V) followed by the rest of `other`, whose token
// ids differ from doc's: the same document with another question.
Stream Splice(const Stream& doc, const Stream& other, int at) {
  Stream s = doc;
  const size_t tok = size_t(doc.h) * doc.d;
  for (int t = at; t < other.n(); ++t) {
    if (t < s.n()) s.tokens[t] = other.tokens[t];
    else s.tokens.push_back(other.tokens[t]);
  }
  s.tokens.resize(other.n());
  for (int l = 0; l < doc.L; ++l) {
    s.k[l].resize(size_t(at) * tok);
    s.v[l].resize(size_t(at) * tok);
    s.k[l].insert(s.k[l].end(), other.k[l].begin() + at * tok, other.k[l].end());
    s.v[l].insert(s.v[l].end(), other.v[l].begin() + at * tok, other.v[l].end());
  }
  return s;
}

struct Created {
  v1::CreateSessionResponse created;
  v1::IngestResponse ingest;
  std::string attachment;
};

// CreateSession over tokens [0, n) of `s` with `ends`, ingest what is not reused, attach.
Created OpenWithEnds(Harness& hx, const Stream& s, const v1::Profile& profile, int n,
                     std::vector<uint64_t> ends, bool durable = false) {
  Created o;
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = profile;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + n);
  for (uint64_t e : ends) cr.add_segment_ends(e);
  cr.set_durable(durable);
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  EXPECT_TRUE(c.ok()) << c.status();
  if (!c.ok()) return o;
  o.created = *c;
  if (c->tokens_to_ingest() > 0) {
    auto ing = hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), s, int(c->reused_tokens()), n));
    EXPECT_TRUE(ing.ok()) << ing.status();
    if (ing.ok()) o.ingest = *ing;
  }
  o.attachment = hx.AttachTo(c->session_id());
  return o;
}

std::vector<uint64_t> EndsOf(const v1::CreateSessionResponse& r) {
  return std::vector<uint64_t>(r.segment_ends().begin(), r.segment_ends().end());
}

absl::StatusOr<v1::ForkSessionResponse> Fork(Harness& hx, const std::string& parent, uint64_t at) {
  v1::ForkSessionRequest fr;
  fr.set_parent_session_id(parent);
  fr.set_at_token(at);
  return hx.engine->ForkSession(hx.tenant, fr);
}

v1::LookupPrefixResponse Lookup(Harness& hx, const Stream& s, const v1::Profile& profile, int n) {
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = hx.model;
  *lr.mutable_profile() = profile;
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + n);
  auto r = hx.engine->LookupPrefix(hx.tenant, lr);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : v1::LookupPrefixResponse();
}

// kvshade_prefix_splits_total{source}.
double Splits(Harness& hx, const std::string& source) {
  const auto m = MetricSample(hx.metrics, "kvshade_prefix_splits_total", {{"source", source}});
  if (!m) ADD_FAILURE() << "no kvshade_prefix_splits_total{source=\"" << source << "\"}";
  return m ? m->counter.value : -1;
}

// Both layers' attention and selection of two attachments, bit for bit.
void ExpectSameAnswers(Harness& ha, const std::string& a, Harness& hb, const std::string& b,
                       uint64_t query_stream) {
  const auto q = ha.Query(query_stream);
  for (int l = 0; l < 2; ++l) {
    auto oa = ha.Attend(a, l, q), ob = hb.Attend(b, l, q);
    ASSERT_TRUE(oa.ok() && ob.ok()) << oa.status() << " " << ob.status();
    ExpectSameBits(*oa, *ob);
    auto da = ha.Select(a, l, q), db = hb.Select(b, l, q);
    ASSERT_TRUE(da.ok() && db.ok()) << da.status() << " " << db.status();
    EXPECT_EQ(std::vector<int32_t>(da->chunk().begin(), da->chunk().end()),
              std::vector<int32_t>(db->chunk().begin(), db->chunk().end()));
    EXPECT_EQ(da->keys().data(), db->keys().data());
    EXPECT_EQ(da->values().data(), db->values().data());
  }
}

TEST(SegmentEnds, AHintedPromptCommitsOneSegmentPerRange) {
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_EXACT}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    Harness hx;
    Stream s = MakeStream(1100, hx.model, 61);
    auto o = OpenWithEnds(hx, s, DocProfile(kind), 1100, {256, 768});
    EXPECT_EQ(o.created.reused_tokens(), 0u);
    EXPECT_EQ(EndsOf(o.created), (std::vector<uint64_t>{256, 768}));
    EXPECT_EQ(o.created.automatic_segment_end(), 0u);
    EXPECT_EQ(o.ingest.tokens(), 1100u);
    EXPECT_EQ(Splits(hx, "hint"), 2);
    // Three segments, each registered: the prefix index knows both ends and the whole.
    auto whole = Lookup(hx, s, DocProfile(kind), 1100);
    EXPECT_EQ(whole.reusable_tokens(), 1100u);
    EXPECT_EQ(whole.cached_segments(), 3u);
    EXPECT_EQ(Lookup(hx, s, DocProfile(kind), 800).reusable_tokens(), 768u);
    EXPECT_EQ(Lookup(hx, s, DocProfile(kind), 700).reusable_tokens(), 256u);
    // The ends are segment boundaries: forks there work, inside a range they do not.
    EXPECT_TRUE(Fork(hx, o.created.session_id(), 256).ok());
    EXPECT_TRUE(Fork(hx, o.created.session_id(), 768).ok());
    EXPECT_EQ(Fork(hx, o.created.session_id(), 512).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(SegmentEnds, ASecondQuestionReusesTheDocumentAsAFreshIngestWithTheSameEndsWould) {
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_SHADOW, v1::PROFILE_KIND_EXACT}) {
    SCOPED_TRACE(v1::ProfileKind_Name(kind));
    Harness hx, fresh;
    Stream q1 = MakeStream(620, hx.model, 62);
    Stream q2 = Splice(q1, MakeStream(650, hx.model, 63, 16, 90000), kDoc);
    auto a = OpenWithEnds(hx, q1, DocProfile(kind), 620, {kDoc});
    EXPECT_EQ(EndsOf(a.created), (std::vector<uint64_t>{kDoc}));
    // The same document with another question: the document is reused, the end at the
    // document's end is already a boundary.
    auto b = OpenWithEnds(hx, q2, DocProfile(kind), 650, {kDoc});
    EXPECT_EQ(b.created.reused_tokens(), uint64_t(kDoc));
    EXPECT_EQ(b.created.tokens_to_ingest(), 650u - kDoc);
    EXPECT_TRUE(b.created.segment_ends().empty());
    // A daemon that never saw q1 ingests q2 whole, cut at the same end.
    auto c = OpenWithEnds(fresh, q2, DocProfile(kind), 650, {kDoc});
    EXPECT_EQ(c.created.reused_tokens(), 0u);
    EXPECT_EQ(EndsOf(c.created), (std::vector<uint64_t>{kDoc}));
    ExpectSameAnswers(hx, b.attachment, fresh, c.attachment, 71);
    ExpectSameAnswers(hx, b.attachment, fresh, c.attachment, 72);
    if (kind == v1::PROFILE_KIND_SHADOW) {
      // The question was projected onto the document's basis in both.
      ASSERT_EQ(b.ingest.residual_energy_size(), 2);
      ASSERT_EQ(c.ingest.residual_energy_size(), 2);
      for (int l = 0; l < 2; ++l) EXPECT_EQ(b.ingest.residual_energy(l), c.ingest.residual_energy(l));
    }
    // The document of q1's session is the document of q2's.
    ExpectSameAnswers(hx, hx.AttachTo(Fork(hx, a.created.session_id(), kDoc)->session_id()), fresh,
                      fresh.AttachTo(Fork(fresh, c.created.session_id(), kDoc)->session_id()), 73);
  }
}

TEST(SegmentEnds, BadEndsAreRefusedNamingTheRuleAndCreateNothing) {
  Harness hx;
  Stream s = MakeStream(2000, hx.model, 64);
  v1::Profile wide = DocProfile();
  wide.set_local_window(300);  // a shadow segment before an end needs 308 tokens
  struct Case {
    std::vector<uint64_t> ends;
    v1::Profile profile;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{768, 512}, DocProfile(), "strictly increasing"},
      {{512, 512}, DocProfile(), "strictly increasing"},
      {{2048}, DocProfile(), "must be inside (0, 2000)"},
      {{0}, DocProfile(), "must be inside (0, 2000)"},
      {{300}, DocProfile(), "must be a multiple of 256"},
      {{256, 512, 768, 1024, 1280, 1536}, DocProfile(), "at most 5"},
      {{256}, wide, "local_window + chunk_size = 308"},
      {{512, 768}, wide, "local_window + chunk_size = 308"},
  };
  for (const Case& c : cases) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = c.profile;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    for (uint64_t e : c.ends) cr.add_segment_ends(e);
    auto r = hx.engine->CreateSession(hx.tenant, cr);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.says;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("segment_ends")) << c.says;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.says));
  }
  // A chunk size that 256 is not a multiple of: the alignment is both.
  v1::Profile c24 = DocProfile();
  c24.set_chunk_size(24);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = c24;
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  cr.add_segment_ends(512);
  auto r = hx.engine->CreateSession(hx.tenant, cr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("multiple of 768"));
  cr.set_segment_ends(0, 768);
  EXPECT_TRUE(hx.engine->CreateSession(hx.tenant, cr).ok());
  // Only that last one created a session; the refused ones left no trace.
  auto listed = hx.engine->ListSessions(hx.tenant, v1::ListSessionsRequest());
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->sessions_size(), 1);
  EXPECT_EQ(Lookup(hx, s, DocProfile(), 2000).reusable_tokens(), 0u);
  EXPECT_EQ(Splits(hx, "hint"), 1);
}

TEST(SegmentEnds, TheSecondPromptSplitsAtTheDivergenceAndTheThirdReusesTheDocument) {
  Harness hx;
  Stream q1 = MakeStream(600, hx.model, 65);
  Stream q2 = Splice(q1, MakeStream(640, hx.model, 66, 16, 70000), kDoc);
  Stream q3 = Splice(q1, MakeStream(580, hx.model, 67, 16, 80000), kDoc);
  auto a = OpenWithEnds(hx, q1, DocProfile(), 600, {});
  EXPECT_TRUE(a.created.segment_ends().empty());
  EXPECT_EQ(a.created.automatic_segment_end(), 0u);
  // q1's segment is doc + q1 whole: q2 matches its first two blocks and no whole segment.
  auto b = OpenWithEnds(hx, q2, DocProfile(), 640, {});
  EXPECT_EQ(b.created.reused_tokens(), 0u);
  EXPECT_EQ(b.created.automatic_segment_end(), uint64_t(kDoc));
  EXPECT_EQ(EndsOf(b.created), (std::vector<uint64_t>{kDoc}));
  EXPECT_EQ(Splits(hx, "automatic"), 1);
  EXPECT_EQ(Splits(hx, "hint"), 0);
  // q3 reuses the document that q2's session sealed.
  auto c = OpenWithEnds(hx, q3, DocProfile(), 580, {});
  EXPECT_EQ(c.created.reused_tokens(), uint64_t(kDoc));
  EXPECT_EQ(c.created.automatic_segment_end(), 0u);
  EXPECT_TRUE(c.created.segment_ends().empty());
  EXPECT_EQ(Splits(hx, "automatic"), 1);
  // The document's blocks lead to the document's segment now; q1's segment had no whole
  // block past them, so q1 again reuses the document and ingests its question.
  EXPECT_EQ(Lookup(hx, q1, DocProfile(), 600).reusable_tokens(), uint64_t(kDoc));
  // ... and answers as a daemon that cut q3 at the document's end itself.
  Harness fresh;
  auto f = OpenWithEnds(fresh, q3, DocProfile(), 580, {kDoc});
  ExpectSameAnswers(hx, c.attachment, fresh, f.attachment, 74);
  // A prompt that diverges inside the first block has nothing worth a segment.
  Stream early = Splice(q1, MakeStream(600, hx.model, 68, 16, 60000), 200);
  Harness hy;
  OpenWithEnds(hy, q1, DocProfile(), 600, {});
  auto e = OpenWithEnds(hy, early, DocProfile(), 600, {});
  EXPECT_EQ(e.created.automatic_segment_end(), 0u);
  EXPECT_TRUE(e.created.segment_ends().empty());
}

TEST(SegmentEnds, EndsPastTheSegmentCapAreDroppedAndMiniIgnoresThem) {
  Harness hx;
  Stream s = MakeStream(1700, hx.model, 69);
  auto a = OpenWithEnds(hx, s, DocProfile(), 1700, {256, 512, 768, 1024, 1280});
  EXPECT_EQ(EndsOf(a.created), (std::vector<uint64_t>{256, 512, 768, 1024, 1280}));
  // A session reuses at most five of the six.
  auto all = Lookup(hx, s, DocProfile(), 1700);
  EXPECT_EQ(all.reusable_tokens(), 1280u);
  EXPECT_EQ(all.cached_segments(), 5u);
  // Another continuation after the first 1280 tokens: 5 segments reused, room for one of its
  // own, so its end at 1536 is dropped (and those up to the reused end are boundaries already).
  Stream t = Splice(s, MakeStream(1700, hx.model, 70, 16, 50000), 1280);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = DocProfile();
  cr.mutable_token_ids()->Add(t.tokens.begin(), t.tokens.end());
  for (uint64_t e : {256, 512, 768, 1024, 1536}) cr.add_segment_ends(e);
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->reused_tokens(), 1280u);
  EXPECT_TRUE(c->segment_ends().empty());
  ASSERT_TRUE(hx.engine->Ingest(hx.tenant, IngestStreamOf(c->session_id(), t, 1280, 1700)).ok());
  const std::string at = hx.AttachTo(c->session_id());
  for (int l = 0; l < 2; ++l) EXPECT_TRUE(hx.Attend(at, l, hx.Query(75)).ok());
  // Appends and a fork at the end still fit beside the six prompt segments.
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(c->session_id(), MakeStream(1800, hx.model, 76), 1700, 1800)).ok());
  EXPECT_TRUE(Fork(hx, c->session_id(), 1800).ok());
  // mini segments are not cached: the ends are ignored, the prompt is one segment.
  auto m = OpenWithEnds(hx, s, DocProfile(v1::PROFILE_KIND_MINI), 600, {256});
  EXPECT_EQ(m.created.effective_profile(), v1::PROFILE_KIND_MINI);
  EXPECT_TRUE(m.created.segment_ends().empty());
  EXPECT_EQ(Fork(hx, m.created.session_id(), 256).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SegmentEnds, ADurableSplitSessionSurvivesARestart) {
  TempDir dir;
  Harness hx(dir.path());
  Stream s = MakeStream(700, hx.model, 77);
  auto a = OpenWithEnds(hx, s, DocProfile(), 700, {kDoc}, /*durable=*/true);
  const std::string id = a.created.session_id();
  const auto q = hx.Query(78);
  std::vector<std::vector<float>> before;
  for (int l = 0; l < 2; ++l) before.push_back(*hx.Attend(a.attachment, l, q));
  hx.Restart();
  const std::string at = hx.AttachTo(id);
  for (int l = 0; l < 2; ++l) {
    auto out = hx.Attend(at, l, q);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectSameBits(before[size_t(l)], *out);
  }
  // Both segments are cached again: the document alone is reusable, and the end is still a
  // boundary.
  EXPECT_EQ(Lookup(hx, s, DocProfile(), 600).reusable_tokens(), uint64_t(kDoc));
  EXPECT_TRUE(Fork(hx, id, kDoc).ok());
}

TEST(SegmentEnds, AForkAtAnEndIsTheDocumentAlone) {
  Harness hx, solo;
  Stream s = MakeStream(700, hx.model, 79);
  auto a = OpenWithEnds(hx, s, DocProfile(), 700, {kDoc});
  auto child = Fork(hx, a.created.session_id(), kDoc);
  ASSERT_TRUE(child.ok()) << child.status();
  EXPECT_EQ(child->shared_tokens(), uint64_t(kDoc));
  // The document's segment is built as an ingest of the document alone.
  auto doc = OpenWithEnds(solo, s, DocProfile(), kDoc, {});
  ExpectSameAnswers(hx, hx.AttachTo(child->session_id()), solo, doc.attachment, 80);
  // The child takes appends of its own; the parent is unchanged.
  const auto q = hx.Query(81);
  auto parent_before = hx.Attend(a.attachment, 0, q);
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(child->session_id(), s, kDoc, kDoc + 40)).ok());
  ExpectSameBits(*parent_before, *hx.Attend(a.attachment, 0, q));
}

// Samples of kvshade_stage_duration_seconds{stage}: how many times the stage ran (0 for
// a stage that has not run yet).
uint64_t StageRuns(Harness& hx, const std::string& stage) {
  const auto m = MetricSample(hx.metrics, "kvshade_stage_duration_seconds", {{"stage", stage}});
  return m ? m->histogram.sample_count : 0;
}

// A range that is not the last compresses as soon as its rows are in, before the layer's
// later parts arrive (docs/DESIGN.md "Ingest: compression beside arrival"): a chunked
// prefill of a document and its question has every layer's document range factorized
// once the document's chunks are in, before any part of the question is sent. The session
// is the one the same K/V give in one part per layer, bit for bit, whether the chunks end
// at the document's end (the ranges' rows wait in host memory, all but one layer's) or a
// chunk holds the document's end and the question's start, and in two parts per layer.
TEST(SegmentEnds, ADocumentRangeCompressesBeforeTheQuestionArrives) {
  const int n = 620;
  Harness ref;
  ref.model = TestModel(5);  // the copies' two pairs of blocks each serve several layers
  Stream s = MakeStream(n, ref.model, 82);
  auto whole = [&](Harness& hx) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hx.model;
    *cr.mutable_profile() = DocProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    cr.add_segment_ends(kDoc);
    auto c = hx.engine->CreateSession(hx.tenant, cr);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->session_id() : std::string();
  };
  // One part per layer: no layer is incomplete when its document range is.
  const std::string ref_id = whole(ref);
  auto ref_ingest = ref.engine->Ingest(ref.tenant, IngestStreamOf(ref_id, s, 0, n, nullptr, 0, n));
  ASSERT_TRUE(ref_ingest.ok()) << ref_ingest.status();
  for (const int chunk : {128, 200, 0}) {
    SCOPED_TRACE(chunk == 0 ? std::string("two parts per layer") : absl::StrCat("chunks of ", chunk));
    Harness hx;
    hx.model = ref.model;
    const std::string id = whole(hx);
    const auto msgs = IngestStreamOf(id, s, 0, n, nullptr, 0, chunk);
    auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
    ASSERT_TRUE(st.ok()) << st.status();
    size_t i = 1;
    if (chunk == 128) {
      // Every part of the document: then each layer's document range is factorized
      // (the compression thread's, waited for here) while no question token was sent.
      for (; i <= size_t(kDoc / chunk) * s.L; ++i) ASSERT_TRUE((*st)->Add(msgs[i]).ok()) << i;
      for (int wait = 0; wait < 500 && StageRuns(hx, "ingest_factorize") < uint64_t(s.L); ++wait) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      EXPECT_EQ(StageRuns(hx, "ingest_factorize"), uint64_t(s.L));
    }
    for (; i < msgs.size(); ++i) ASSERT_TRUE((*st)->Add(msgs[i]).ok()) << i;
    auto r = (*st)->Finish();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->SerializeAsString(), ref_ingest->SerializeAsString());
    // (Fresh attachments: a selection is what the attachment does not hold yet.)
    ExpectSameAnswers(ref, ref.AttachTo(ref_id), hx, hx.AttachTo(id), 83);
    // Each layer's document range, once.
    EXPECT_EQ(StageRuns(hx, "ingest_factorize"), uint64_t(s.L));
  }
}

// A chunked prefill with a document range compressed apart, dropped after any of its
// messages (the compression thread at work on a range or not), leaves the session
// ingesting with 0 tokens and the device and host tiers and the staging pool as they were
// before it; then the whole stream still commits.
TEST(SegmentEnds, AStreamDroppedWhileARangeCompressesApartLeavesNothingBehind) {
  const int n = 620;
  Harness hx;
  hx.model = TestModel(3);
  Stream s = MakeStream(n, hx.model, 84);
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = DocProfile();
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  cr.add_segment_ends(kDoc);
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  ASSERT_TRUE(c.ok()) << c.status();
  const auto msgs = IngestStreamOf(c->session_id(), s, 0, n, nullptr, 0, 128);
  const double device0 = TierTotal(hx, "device"), host0 = TierTotal(hx, "host");
  for (size_t cut = 1; cut <= msgs.size(); ++cut) {
    {
      auto st = hx.engine->BeginIngest(hx.tenant, msgs[0]);
      ASSERT_TRUE(st.ok()) << "cut " << cut << ": " << st.status();
      for (size_t i = 1; i < cut; ++i) ASSERT_TRUE((*st)->Add(msgs[i]).ok()) << cut << " " << i;
    }  // dropped without an end
    ExpectDroppedStreamLeftNothing(hx, c->session_id(), device0, host0, absl::StrCat("cut ", cut));
  }
  auto ing = hx.engine->Ingest(hx.tenant, msgs);
  ASSERT_TRUE(ing.ok()) << ing.status();
  EXPECT_EQ(ing->tokens(), uint64_t(n));
}

}  // namespace
}  // namespace segment_ends_test
}  // namespace kvshade::service::testing

// Key signatures in the service (docs/ALGORITHM.md "Key signatures"): a shadow profile with
// key_signature_bits keeps them for every chunked token (ingest, appended chunks, merged
// segments, forks, a durable restart), the daemon's two-stage selection scores them (it
// selects what SelectEx with options.signatures selects on the same view), and bad values
// are refused.
#include <set>

#include "absl/strings/match.h"
#include "engine_internals.h"
#include "kvshade/kernels/decode_step.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace key_signatures_test {
namespace {

constexpr int kC = 8;

v1::Profile SigProfile(int bits) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(32);
  p.set_sparse_budget(4);
  p.set_outliers(2);
  p.set_value_codec(v1::VALUE_CODEC_BF16);
  p.set_rerank_factor(4);
  p.set_key_signature_bits(bits);
  return p;
}

std::shared_ptr<Session> SessionOf(Harness& hs, const std::string& id) {
  auto s = EngineInternals(*hs.engine).FindSession(hs.tenant.name, id);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : nullptr;
}

using Picks = std::set<std::pair<int, int>>;  // (head, chunk)

// What SelectEx selects on the session's view of `layer` from an empty slot table, with
// the profile's options; `signatures`: whether the view keeps them (and so stage 2 scores
// them).
Picks Reference(Harness& hs, const std::string& id, int layer, const std::vector<bf16>& q,
                bool* signatures) {
  std::shared_ptr<Session> s = SessionOf(hs, id);
  if (!s) return {};
  std::shared_lock<std::shared_mutex> lock(s->mu);
  auto hold = EngineInternals(*hs.engine).BuildView(*s, layer);
  EXPECT_TRUE(hold.ok()) << hold.status();
  if (!hold.ok()) return {};
  const int h = s->model.shape.h;
  const int k = std::min(s->profile.sparse_budget, hold->total_chunks);
  *signatures = decode::HasSignatures(hold->view);
  const kernels::SelectOptions o =
      s->profile.Policy().OptionsAt(k, s->profile.chunk_size, s->model.rope, *signatures);
  std::vector<int32_t> slots(size_t(h) * k, -1), sel(slots.size()), ms(slots.size()), mc(slots.size()), cnt(h);
  kernels::SelectItem it;
  it.view = hold->view;
  it.q = q.data();
  it.slots = slots.data();
  it.selected = sel.data();
  it.miss_slot = ms.data();
  it.miss_chunk = mc.data();
  it.miss_count = cnt.data();
  const std::vector<kernels::SelectItem> items = {it};
  kernels::Backend& be = *hs.backend;
  auto ws = be.Allocate(std::max<size_t>(be.SelectExWorkspaceBytes(s->model.shape, k, o, items), 1));
  EXPECT_TRUE(ws.ok());
  if (!ws.ok()) return {};
  absl::Status st = be.SelectEx(s->model.shape, k, o, items, ws->workspace());
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(be.Synchronize().ok());
  Picks out;
  for (int hh = 0; hh < h; ++hh) {
    for (int i = 0; i < k; ++i) {
      if (sel[size_t(hh) * k + i] >= 0) out.insert({hh, sel[size_t(hh) * k + i]});
    }
  }
  return out;
}

// The daemon's selection for a fresh attachment (every selected chunk is a miss).
Picks DaemonPicks(Harness& hs, const std::string& id, int layer, const std::vector<bf16>& q) {
  const std::string a = hs.AttachTo(id);
  auto d = hs.Select(a, layer, q);
  EXPECT_TRUE(d.ok()) << d.status();
  Picks out;
  if (d.ok()) {
    for (int i = 0; i < d->head_size(); ++i) out.insert({int(d->head(i)), d->chunk(i)});
  }
  v1::DetachRequest dr;
  dr.set_attachment_id(a);
  EXPECT_TRUE(hs.engine->Detach(hs.tenant, dr).ok());
  return out;
}

// The daemon selects what SelectEx with signatures selects, at every layer, over a few
// queries.
void ExpectDaemonUsesSignatures(Harness& hs, const std::string& id, uint64_t seed) {
  for (int layer = 0; layer < hs.model.num_layers(); ++layer) {
    for (int i = 0; i < 3; ++i) {
      const std::vector<bf16> q = hs.Query(seed + 10 * layer + i, 2.0f);
      bool sig = false;
      const Picks want = Reference(hs, id, layer, q, &sig);
      EXPECT_TRUE(sig) << "layer " << layer;
      EXPECT_FALSE(want.empty());
      EXPECT_EQ(DaemonPicks(hs, id, layer, q), want) << "layer " << layer << " query " << i;
    }
  }
}

// Key signatures of `rows` tokens from position `first` of `s` at one layer, encoded by the
// backend from their post-RoPE keys and the given landmarks (what the daemon stores).
std::vector<std::byte> EncodeRef(Harness& hs, const Stream& s, int layer, int64_t first, int n_chunks,
                                 const std::byte* landmarks, int bits) {
  const int h = s.h, d = s.d, rows = n_chunks * kC;
  const size_t tok = size_t(h) * d;
  std::vector<bf16> k(s.k[layer].begin() + first * tok, s.k[layer].begin() + (first + rows) * tok);
  std::vector<int64_t> pos(rows);
  for (int t = 0; t < rows; ++t) pos[t] = first + t;
  kernels::Backend& be = *hs.backend;
  auto model = ResolveModel(hs.model, hs.config.limits);
  EXPECT_TRUE(model.ok()) << model.status();
  EXPECT_TRUE(be.ApplyRope(model->rope, pos, h, d, absl::MakeSpan(k)).ok());
  std::vector<std::byte> out(size_t(rows) * h * kernels::SignatureRecordBytes(bits, d));
  EXPECT_TRUE(be.EncodeSignatures(k, absl::MakeConstSpan(reinterpret_cast<const bf16*>(landmarks),
                                                         size_t(n_chunks) * tok),
                                  h, d, kC, n_chunks, bits, absl::MakeSpan(out))
                  .ok());
  EXPECT_TRUE(be.Synchronize().ok());
  return out;
}

TEST(KeySignatures, IngestKeepsThemAndTheDaemonSelectsWithThem) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 21);
  auto o = hs.Open(s, SigProfile(2));
  {
    std::shared_ptr<Session> ss = SessionOf(hs, o.session);
    ASSERT_TRUE(ss);
    EXPECT_EQ(ss->profile.key_signature_bits, 2);
    ASSERT_EQ(ss->chain.size(), 1u);
    const Segment& seg = *ss->chain[0];
    for (int l = 0; l < hs.model.num_layers(); ++l) {
      const LayerData& ld = seg.data(l);
      EXPECT_EQ(ld.sig_bits, 2);
      EXPECT_GE(ld.sig.bytes(), size_t(ld.n_chunks) * kC * 2 * kernels::SignatureRecordBytes(2, 64));
      // Ingested signatures are those of the exact keys and the stored landmarks.
      const std::vector<std::byte> want =
          EncodeRef(hs, s, l, 0, ld.n_chunks, static_cast<const std::byte*>(ld.landmarks.data()), 2);
      EXPECT_EQ(std::memcmp(ld.sig.data(), want.data(), want.size()), 0) << "layer " << l;
    }
  }
  ExpectDaemonUsesSignatures(hs, o.session, 100);
  // The resolved profile says so, and the session's device bytes count the signatures: the
  // same prompt without them holds exactly their bytes less.
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  auto info = hs.engine->GetSession(hs.tenant, gr);
  ASSERT_TRUE(info.ok()) << info.status();
  auto plain = hs.Open(s, SigProfile(0));
  EXPECT_EQ(plain.reused, 0u);  // signatures are part of the prefix key
  gr.set_session_id(plain.session);
  auto info0 = hs.engine->GetSession(hs.tenant, gr);
  ASSERT_TRUE(info0.ok()) << info0.status();
  size_t sig_bytes = 0;
  for (int l = 0; l < hs.model.num_layers(); ++l) sig_bytes += SessionOf(hs, o.session)->chain[0]->data(l).sig.bytes();
  EXPECT_GT(sig_bytes, 0u);
  EXPECT_EQ(info->gpu_bytes(), info0->gpu_bytes() + sig_bytes);
  // Without signatures the same two-stage profile reconstructs keys.
  bool sig = true;
  Reference(hs, plain.session, 0, hs.Query(5), &sig);
  EXPECT_FALSE(sig);
}

TEST(KeySignatures, AppendsForksAndMergesKeepThem) {
  Harness hs;
  const int n0 = 512, n = 1024;
  const Stream s = MakeStream(n, hs.model, 22);
  auto o = hs.Open(s, SigProfile(2), n0);
  int end = n0;
  auto append = [&](int to) {
    for (; end < to; end += 16) {
      auto a = hs.engine->AppendTokens(hs.tenant, AppendOf(o.session, s, end, std::min(end + 16, to)));
      ASSERT_TRUE(a.ok()) << a.status();
    }
    end = to;
  };
  append(560);
  {
    std::shared_ptr<Session> ss = SessionOf(hs, o.session);
    ASSERT_TRUE(ss && ss->open);
    for (int l = 0; l < hs.model.num_layers(); ++l) {
      const LayerData& ld = ss->open->layers[l];
      ASSERT_GT(ld.n_chunks, 0);
      EXPECT_EQ(ld.sig_bits, 2);
      // The appended chunks' records are EncodeSignatures of their exact post-RoPE keys and
      // their landmarks.
      const std::vector<std::byte> want = EncodeRef(hs, s, l, ss->open->first_position, ld.n_chunks,
                                                    static_cast<const std::byte*>(ld.landmarks.data()), 2);
      EXPECT_EQ(std::memcmp(ld.sig.data(), want.data(), want.size()), 0) << "layer " << l;
    }
  }
  ExpectDaemonUsesSignatures(hs, o.session, 200);
  // Forks at the end seal the open segment; the second seal (more chunks than the first
  // sealed) merges the appended segments.
  std::vector<std::string> forks;
  for (int to : {560, 900}) {
    append(to);
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id(o.session);
    fr.set_at_token(to);
    auto f = hs.engine->ForkSession(hs.tenant, fr);
    ASSERT_TRUE(f.ok()) << f.status();
    forks.push_back(f->session_id());
  }
  {
    std::shared_ptr<Session> ss = SessionOf(hs, o.session);
    ASSERT_TRUE(ss);
    ASSERT_EQ(ss->chain.size(), 2u) << "the appended segments merged into one";
    const Segment& merged = *ss->chain[1];
    for (int l = 0; l < hs.model.num_layers(); ++l) {
      const LayerData& ld = merged.data(l);
      EXPECT_EQ(ld.sig_bits, 2);
      const std::vector<std::byte> want = EncodeRef(hs, s, l, merged.first_position, ld.n_chunks,
                                                    static_cast<const std::byte*>(ld.landmarks.data()), 2);
      EXPECT_EQ(std::memcmp(ld.sig.data(), want.data(), want.size()), 0) << "layer " << l;
    }
  }
  append(1000);
  ExpectDaemonUsesSignatures(hs, o.session, 300);
  for (const std::string& f : forks) ExpectDaemonUsesSignatures(hs, f, 400);
}

// Every segment of the session (chain and open) keeps `bits`-bit signatures equal to those of
// its exact keys and stored landmarks.
void ExpectSignaturesOfTheKeys(Harness& hs, const Stream& s, const std::string& id, int bits) {
  std::shared_ptr<Session> ss = SessionOf(hs, id);
  ASSERT_TRUE(ss);
  std::vector<const Segment*> segs;
  for (const auto& seg : ss->chain) segs.push_back(seg.get());
  if (ss->open) segs.push_back(ss->open.get());
  int with_chunks = 0;
  for (const Segment* seg : segs) {
    for (int l = 0; l < hs.model.num_layers(); ++l) {
      const LayerData& ld = seg->data(l);
      if (ld.n_chunks == 0) continue;
      ++with_chunks;
      ASSERT_EQ(ld.sig_bits, bits) << "segment at " << seg->first_position << " layer " << l;
      const std::vector<std::byte> want = EncodeRef(hs, s, l, seg->first_position, ld.n_chunks,
                                                    static_cast<const std::byte*>(ld.landmarks.data()), bits);
      EXPECT_EQ(std::memcmp(ld.sig.data(), want.data(), want.size()), 0)
          << "segment at " << seg->first_position << " layer " << l;
    }
  }
  EXPECT_GE(with_chunks, 2 * hs.model.num_layers()) << "the prompt's and the appended chunks";
}

// Each width restores as it was written (the restore reads the width from the record size).
TEST(KeySignatures, ADurableRestartRestoresThem) {
  for (int bits : {4, 8}) {
    SCOPED_TRACE(bits);
    TempDir dir;
    Harness hs(dir.path());
    const Stream s = MakeStream(768, hs.model, 23);
    auto o = hs.Open(s, SigProfile(bits), 512, /*durable=*/true);
    for (int at = 512; at < 768; at += 32) {
      auto a = hs.engine->AppendTokens(hs.tenant, AppendOf(o.session, s, at, at + 32));
      ASSERT_TRUE(a.ok()) << a.status();
    }
    v1::ForkSessionRequest fr;  // seals the open segment (durable: written through)
    fr.set_parent_session_id(o.session);
    fr.set_at_token(768);
    ASSERT_TRUE(hs.engine->ForkSession(hs.tenant, fr).ok());
    ExpectSignaturesOfTheKeys(hs, s, o.session, bits);
    std::vector<Picks> picks;
    for (int layer = 0; layer < hs.model.num_layers(); ++layer) {
      picks.push_back(DaemonPicks(hs, o.session, layer, hs.Query(50 + layer, 2.0f)));
    }
    ASSERT_TRUE(hs.engine->Drain().ok());  // the appended tokens' record, then a restart
    hs.Restart();
    std::shared_ptr<Session> ss = SessionOf(hs, o.session);
    ASSERT_TRUE(ss);
    EXPECT_EQ(ss->profile.key_signature_bits, uint32_t(bits));
    ExpectSignaturesOfTheKeys(hs, s, o.session, bits);
    for (int layer = 0; layer < hs.model.num_layers(); ++layer) {
      EXPECT_EQ(DaemonPicks(hs, o.session, layer, hs.Query(50 + layer, 2.0f)), picks[layer]);
    }
    ExpectDaemonUsesSignatures(hs, o.session, 500);
  }
}

// A tier in front of the RocksDB tier that writes segments as a version before key
// signatures did: without their factor.
class WithoutSignatures final : public ForwardingSpillTier {
 public:
  explicit WithoutSignatures(storage::SpillTier& base) : ForwardingSpillTier(base) {}
  absl::Status WriteSegment(const storage::SegmentWrite& s) override {
    storage::SegmentWrite w = s;
    w.factors.clear();
    for (const storage::FactorBlob& f : s.factors) {
      if (f.kind != storage::FactorKind::kSignatures) w.factors.push_back(f);
    }
    return base_.WriteSegment(w);
  }
  absl::Status AddFactors(const storage::SegmentId& id, absl::Span<const storage::FactorBlob> f) override {
    std::vector<storage::FactorBlob> kept;
    for (const storage::FactorBlob& x : f) {
      if (x.kind != storage::FactorKind::kSignatures) kept.push_back(x);
    }
    return base_.AddFactors(id, kept);
  }
};

// A record written before signatures existed restores without them: the session serves,
// and two-stage selection reconstructs keys (what SelectEx without signatures selects).
TEST(KeySignatures, ARecordWithoutThemRestoresWithout) {
  TempDir dir;
  SpillSetup setup;
  setup.front = [](storage::SpillTier& base) { return std::make_unique<WithoutSignatures>(base); };
  Harness hs(dir.path(), setup);
  const Stream s = MakeStream(512, hs.model, 27);
  auto o = hs.Open(s, SigProfile(2), -1, /*durable=*/true);
  ExpectDaemonUsesSignatures(hs, o.session, 700);  // in memory they are there
  hs.Restart();
  std::shared_ptr<Session> ss = SessionOf(hs, o.session);
  ASSERT_TRUE(ss);
  EXPECT_EQ(ss->profile.key_signature_bits, 2);
  for (int l = 0; l < hs.model.num_layers(); ++l) {
    EXPECT_EQ(ss->chain[0]->data(l).sig_bits, 0);
    EXPECT_FALSE(ss->chain[0]->data(l).sig);
  }
  for (int layer = 0; layer < hs.model.num_layers(); ++layer) {
    const std::vector<bf16> q = hs.Query(800 + layer, 2.0f);
    bool sig = true;
    const Picks want = Reference(hs, o.session, layer, q, &sig);
    EXPECT_FALSE(sig);
    EXPECT_FALSE(want.empty());
    EXPECT_EQ(DaemonPicks(hs, o.session, layer, q), want);
  }
}

TEST(KeySignatures, BadValuesAreRefused) {
  Harness hs;
  const Stream s = MakeStream(512, hs.model, 24);
  auto create = [&](v1::Profile p) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = hs.model;
    *cr.mutable_profile() = p;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    return hs.engine->CreateSession(hs.tenant, cr);
  };
  for (int bits : {1, 3, 5, 16}) {
    auto c = create(SigProfile(bits));
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bits;
    EXPECT_TRUE(absl::StrContains(c.status().message(), "key_signature_bits")) << c.status();
  }
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_MINI, v1::PROFILE_KIND_EXACT}) {
    v1::Profile p = ProfileOf(kind);
    p.set_key_signature_bits(2);
    auto c = create(p);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << kind;
    EXPECT_TRUE(absl::StrContains(c.status().message(), "shadow")) << c.status();
    p.set_key_signature_bits(0);  // none is fine for every kind
    EXPECT_TRUE(create(p).ok()) << kind;
  }
  // The server's default: 0, 2, 4 or 8.
  for (uint32_t bits : {1u, 3u, 5u, 16u}) {
    ServerConfig c = hs.config;
    c.profile.key_signature_bits = bits;
    const absl::Status st = ValidateConfig(c);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bits;
    EXPECT_TRUE(absl::StrContains(st.message(), "key_signature_bits")) << st;
  }
  for (uint32_t bits : {2u, 4u, 8u}) {
    ServerConfig c = hs.config;
    c.profile.key_signature_bits = bits;
    EXPECT_TRUE(ValidateConfig(c).ok()) << bits;
  }
}

// The server's default applies to shadow sessions (and only to them).
TEST(KeySignatures, TheServerDefaultAppliesToShadowSessions) {
  Harness hs;
  hs.config.profile.key_signature_bits = 2;
  hs.Restart();
  v1::Profile p = SigProfile(0);
  p.clear_key_signature_bits();
  auto o = hs.Open(MakeStream(512, hs.model, 25), p);
  EXPECT_EQ(SessionOf(hs, o.session)->profile.key_signature_bits, 2);
  ExpectDaemonUsesSignatures(hs, o.session, 600);
  auto m = hs.Open(MakeStream(128, hs.model, 26), ProfileOf(v1::PROFILE_KIND_MINI));
  EXPECT_EQ(SessionOf(hs, m.session)->profile.key_signature_bits, 0);
}

}  // namespace
}  // namespace key_signatures_test
}  // namespace kvshade::service::testing

// Same-node decode (client::LocalDecoder) against the daemon's Attend RPC on the same
// inputs, CPU backend: the worker maps the daemon's shared memory and must attend over
// exactly the tokens the daemon would (static set + selected chunks + exact tail), plus
// the new token. Also: batching, refresh after appends (chunks leaving the tail into the
// open segment), lease expiry, and a generation held through memory pressure.
//
// Tolerance: both sides run the same CPU kernels over the same bf16 inputs; only the order
// in which the attention blocks are merged differs (fp32 online softmax), so outputs agree
// to a few fp32 ulps of the largest value: 1e-5 relative to the output's max magnitude.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "harness.h"
#include "kvshade/client/local_decoder.h"
#include "kvshade/client/tensor.h"
#include "kvshade/kernels/types.h"

namespace kvshade::integration {
namespace local_decoder_test {
namespace {

using kernels::bf16;

struct Fixture {
  ServerProcess server;
  std::unique_ptr<client::Client> c;
  synthetic::Document doc{SmallDoc(1024)};
};

// A session of `doc` (its question `question`; -1: the document alone) created, ingested
// with `profile` and attached as a reader: the attachment's id.
absl::StatusOr<std::string> IngestAndAttach(client::Client& c, const synthetic::Document& doc,
                                            const v1::Profile& profile, int question) {
  absl::StatusOr<v1::CreateSessionResponse> cs = CreateAndIngest(c, doc, profile, question);
  if (!cs.ok()) return cs.status();
  v1::AttachRequest ar;
  ar.set_session_id(cs->session_id());
  absl::StatusOr<v1::AttachResponse> att = c.Attach(ar);
  if (!att.ok()) return att.status();
  return att->attachment_id();
}

// Appends token `pos` of `question` to the session, then reads back its post-RoPE K and V
// for every layer from the daemon's exact tail (GetStaticSet): [L][h*d] each.
void AppendAndReadNew(client::Client& c, const synthetic::Document& doc, const std::string& session,
                      const std::string& attachment, int question, int64_t pos,
                      std::vector<std::vector<bf16>>* k_new, std::vector<std::vector<bf16>>* v_new) {
  v1::AppendTokensRequest req = synthetic::MakeAppend(doc, session, question, pos, pos + 1);
  req.set_attachment_id(attachment);
  auto ap = c.AppendTokens(req);
  ASSERT_TRUE(ap.ok()) << ap.status();
  const int L = doc.spec().layers, hd = doc.spec().kv_heads * doc.spec().head_dim;
  k_new->assign(L, {});
  v_new->assign(L, {});
  for (int l = 0; l < L; ++l) {
    auto ss = c.GetStaticSet(attachment, l);
    ASSERT_TRUE(ss.ok()) << ss.status();
    const int t = static_cast<int>(ss->tail_k().shape(0));
    ASSERT_GT(t, 0);
    const auto* kb = reinterpret_cast<const bf16*>(ss->tail_k().data().data());
    const auto* vb = reinterpret_cast<const bf16*>(ss->tail_v().data().data());
    (*k_new)[l].assign(kb + size_t(t - 1) * hd, kb + size_t(t) * hd);
    (*v_new)[l].assign(vb + size_t(t - 1) * hd, vb + size_t(t) * hd);
  }
}


TEST(LocalDecoder, MatchesAttendRpcAcrossAppendsAndRefreshes) {
  Fixture f;
  // Sixty appended tokens, all within question 0's timeline.
  synthetic::DocSpec doc_spec = SmallDoc(1024);
  doc_spec.question_tokens = 64;
  const synthetic::Document doc(doc_spec);
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const int q = 0;
  // local 32 + C 8: chunks leave the exact tail during the run (open segment exported).
  v1::Profile profile = ShadowProfile(16, 8, 4);
  // The document alone; the appended tokens are question q's (positions the synthetic
  // timeline defines: doc_tokens .. doc_tokens + question_tokens).
  KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, doc, profile, -1));
  v1::AttachRequest ar;
  ar.set_session_id(cs.session_id());
  ar.set_writer(true);
  KV_ASSERT_OK_AND_ASSIGN(att, f.c->Attach(ar));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.local_capacity = 16;
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {att.attachment_id()}, opt));
  const auto& spec = doc.spec();
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim;
  int64_t pos = doc.spec().doc_tokens;
  std::vector<float> out(size_t(hq) * d);
  // Each step appends the token to the daemon first (so the RPC side attends over it too)
  // and reads its post-RoPE K/V back. While no chunk left the daemon's exact tail since
  // the decoder's generation, the decoder holds that token locally (k_new) and both sides
  // attend over the same tokens; when one did (the daemon's tail is shorter than the
  // generation's plus the local tokens), the decoder refreshes first and attends with no
  // new token, since its new generation holds it.
  auto daemon_tail = [&]() {
    auto ss = f.c->GetStaticSet(att.attachment_id(), 0);
    EXPECT_TRUE(ss.ok()) << ss.status();
    return ss.ok() ? static_cast<int64_t>(ss->tail_k().shape(0)) : -1;
  };
  int64_t gen_tail = daemon_tail();
  int local = 0, refreshes = 0, local_steps = 0;
  for (int step = 0; step < 60; ++step, ++pos) {
    std::vector<std::vector<bf16>> kn, vn;
    AppendAndReadNew(*f.c, doc, cs.session_id(), att.attachment_id(), q, pos, &kn, &vn);
    ASSERT_FALSE(HasFatalFailure());
    const bool migrated = daemon_tail() != gen_tail + local + 1;
    if (migrated || local == opt.local_capacity - 1) {
      KV_ASSERT_OK(dec->Refresh());
      ++refreshes;
      EXPECT_EQ(dec->tokens()[0], uint64_t(pos + 1));
      gen_tail = daemon_tail();
      local = 0;
    }
    const bool with_new = dec->tokens()[0] == uint64_t(pos);
    for (int l = 0; l < L; ++l) {
      std::vector<bf16> qb = QueryBf16(doc, l, q, step, pos);
      KV_ASSERT_OK(dec->Attend(l, qb.data(), with_new ? kn[l].data() : nullptr,
                               with_new ? vn[l].data() : nullptr, out.data()));
      std::vector<float> ref = AttendRpc(*f.c, att.attachment_id(), l, qb, hq, d);
      ASSERT_EQ(ref.size(), out.size());
      EXPECT_LT(MaxRelDiff(ref, out.data(), out.size()), 1e-5)
          << "step " << step << " layer " << l << (with_new ? " (new token local)" : "");
    }
    if (with_new) {
      KV_ASSERT_OK(dec->Advance());
      ++local;
      ++local_steps;
    }
  }
  EXPECT_GE(local_steps, 20);
  EXPECT_GE(refreshes, 4);
  KV_ASSERT_OK_AND_ASSIGN(st, dec->Stats());
  EXPECT_EQ(st.steps, uint64_t(local_steps));
  dec.reset();
  KV_ASSERT_OK(f.c->Detach(att.attachment_id()));
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// Sessions one after another, each over another document, each read by a new decoder
// and then closed (the daemon reuses the freed value memory for the next one): with the
// shared host regions kept mapped between decoders (the default) and unmapped at once
// (idle_mapped_bytes = 0), every decoder attends exactly like the Attend RPC, so a kept
// mapping never shows a decoder another session's bytes.
TEST(LocalDecoder, KeptMappingsServeLaterSessionsExactly) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  for (size_t idle : {size_t{64} << 30, size_t{0}}) {
    for (uint64_t seed = 11; seed < 14; ++seed) {
      const synthetic::Document doc(SmallDoc(1024, seed));
      KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, doc, profile, 0));
      v1::AttachRequest ar;
      ar.set_session_id(cs.session_id());
      KV_ASSERT_OK_AND_ASSIGN(att, f.c->Attach(ar));
      client::LocalDecoderOptions opt;
      opt.backend = "cpu";
      opt.idle_mapped_bytes = idle;
      KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {att.attachment_id()}, opt));
      const auto& spec = doc.spec();
      const int64_t pos = static_cast<int64_t>(doc.SessionTokens(0).size());
      std::vector<float> out(size_t(spec.q_heads) * spec.head_dim);
      for (int l = 0; l < spec.layers; ++l) {
        std::vector<bf16> qb = QueryBf16(doc, l, 0, 0, pos);
        KV_ASSERT_OK(dec->Attend(l, qb.data(), nullptr, nullptr, out.data()));
        std::vector<float> ref = AttendRpc(*f.c, att.attachment_id(), l, qb, spec.q_heads, spec.head_dim);
        ASSERT_EQ(ref.size(), out.size());
        EXPECT_LT(MaxRelDiff(ref, out.data(), out.size()), 1e-5)
            << "seed " << seed << " layer " << l << " idle_mapped_bytes " << idle;
      }
      dec.reset();
      KV_ASSERT_OK(f.c->Detach(att.attachment_id()));
      KV_ASSERT_OK(f.c->CloseSession(cs.session_id()));
    }
  }
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// KVSHADE_DECODER_TRACE=1: Open, Prepare and Join each print one line naming where their
// time went (docs/OPERATIONS.md "Worker-side trace"); unset, they print nothing.
TEST(LocalDecoder, TraceNamesWhereOpenPrepareAndJoinSpendTheirTime) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<std::string> ids;
  for (uint64_t seed = 61; seed < 63; ++seed) {
    KV_ASSERT_OK_AND_ASSIGN(id, IngestAndAttach(*f.c, synthetic::Document(SmallDoc(1024, seed)), profile, 0));
    ids.push_back(id);
  }
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.idle_mapped_bytes = 0;  // every open maps its regions afresh
  for (const bool on : {true, false}) {
    if (on) {
      ASSERT_EQ(setenv("KVSHADE_DECODER_TRACE", "1", 1), 0);
    } else {
      ASSERT_EQ(unsetenv("KVSHADE_DECODER_TRACE"), 0);
    }
    testing::internal::CaptureStderr();
    {
      auto dec = client::LocalDecoder::Open(f.c.get(), {ids[0]}, opt);
      ASSERT_TRUE(dec.ok()) << dec.status();
      auto prepared = (*dec)->Prepare(ids[1]);
      ASSERT_TRUE(prepared.ok()) << prepared.status();
      auto joined = (*dec)->Join(std::move(*prepared));
      ASSERT_TRUE(joined.ok()) << joined.status();
      EXPECT_EQ(*joined, 1);
    }
    if (on) {
      // A second decoder of the same geometry and profile: the probe passed already.
      auto again = client::LocalDecoder::Open(f.c.get(), {ids[0]}, opt);
      ASSERT_TRUE(again.ok()) << again.status();
    }
    const std::string err = testing::internal::GetCapturedStderr();
    if (!on) {
      EXPECT_EQ(err.find("kvshade decoder"), std::string::npos) << err;
      continue;
    }
    const auto line = [&](const std::string& what) {
      const size_t at = err.find("kvshade decoder " + what + ": ");
      if (at == std::string::npos) return std::string();
      return err.substr(at, err.find('\n', at) - at);
    };
    const std::string open = line("open"), prepare = line("prepare"), join = line("join");
    for (const char* phase : {" export ", " geometry ", " map ", " translate ", " slots ", " add ", " probe "}) {
      EXPECT_NE(open.find(phase), std::string::npos) << phase << " missing from: " << err;
    }
    // The first open maps the daemon's regions (none kept: idle_mapped_bytes 0).
    EXPECT_NE(open.find("imported 0 device + "), std::string::npos) << open;
    EXPECT_EQ(open.find("imported 0 device + 0 host"), std::string::npos) << open;
    for (const char* phase : {" export ", " map ", " slots "}) {
      EXPECT_NE(prepare.find(phase), std::string::npos) << phase << " missing from: " << err;
    }
    const size_t second = err.rfind("kvshade decoder open: ");
    ASSERT_NE(second, err.find("kvshade decoder open: ")) << err;
    EXPECT_NE(err.find(" probe ", second), std::string::npos) << err;
    EXPECT_NE(err.find("(passed earlier in this process)", second), std::string::npos) << err;
    // A prepared sequence joins without the daemon or the mapping; the probe ran at open.
    EXPECT_NE(join.find(" add "), std::string::npos) << err;
    EXPECT_EQ(join.find(" export "), std::string::npos) << err;
    EXPECT_EQ(join.find(" probe "), std::string::npos) << err;
  }
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// The daemon's shared memory mapped into this process (memfd regions named "kvshade").
int MappedDaemonRegions() {
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);) n += line.find("memfd:kvshade") != std::string::npos;
  return n;
}

// Kept mappings hold the daemon's memory only while that daemon lives: after a restart,
// the first decoder of the new daemon closes the idle mappings of the old one.
TEST(LocalDecoder, KeptMappingsOfARestartedDaemonAreClosed) {
  const synthetic::Document doc(SmallDoc(1024, 31));
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  const int before = MappedDaemonRegions();
  int kept = 0;
  for (int daemon = 0; daemon < 2; ++daemon) {
    ServerProcess server;
    KV_ASSERT_OK(server.Start({"--backend", "cpu"}));
    auto c = server.Connect();
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*c, doc, profile, 0));
    v1::AttachRequest ar;
    ar.set_session_id(cs.session_id());
    KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
    KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(c.get(), {att.attachment_id()}, opt));
    dec.reset();
    if (daemon == 0) {
      kept = MappedDaemonRegions() - before;
      EXPECT_GT(kept, 0) << "the first daemon's regions stay mapped after the decoder closed";
    } else {
      // Only the second daemon's regions are left: as many as the first one had.
      EXPECT_EQ(MappedDaemonRegions() - before, kept);
    }
    KV_ASSERT_OK(c->Detach(att.attachment_id()));
    EXPECT_EQ(server.Stop(), 0) << server.log();
  }
}

TEST(LocalDecoder, BatchEqualsEachSequenceAlone) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<std::string> atts;
  for (int q = 0; q < 2; ++q) {
    KV_ASSERT_OK_AND_ASSIGN(id, IngestAndAttach(*f.c, f.doc, profile, q));
    atts.push_back(id);
  }
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  KV_ASSERT_OK_AND_ASSIGN(both, client::LocalDecoder::Open(f.c.get(), atts, opt));
  const auto& spec = f.doc.spec();
  const int hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  const int64_t pos = static_cast<int64_t>(f.doc.SessionTokens(0).size());
  std::vector<std::vector<float>> alone(2);
  std::vector<bf16> kn(hd), vn(hd);
  for (int i = 0; i < hd; ++i) {
    kn[i] = kernels::FloatToBf16(0.01f * float(i % 17) - 0.08f);
    vn[i] = kernels::FloatToBf16(0.02f * float(i % 13) - 0.1f);
  }
  for (int b = 0; b < 2; ++b) {
    KV_ASSERT_OK_AND_ASSIGN(one, client::LocalDecoder::Open(f.c.get(), {atts[b]}, opt));
    std::vector<bf16> qb = QueryBf16(f.doc, 1, b, 0, pos);
    alone[b].resize(size_t(hq) * d);
    KV_ASSERT_OK(one->Attend(1, qb.data(), kn.data(), vn.data(), alone[b].data()));
  }
  std::vector<bf16> qs = QueryBf16(f.doc, 1, 0, 0, pos);
  std::vector<bf16> q1 = QueryBf16(f.doc, 1, 1, 0, pos);
  qs.insert(qs.end(), q1.begin(), q1.end());
  std::vector<bf16> k2 = kn, v2 = vn;
  k2.insert(k2.end(), kn.begin(), kn.end());
  v2.insert(v2.end(), vn.begin(), vn.end());
  std::vector<float> out(size_t(2) * hq * d);
  KV_ASSERT_OK(both->Attend(1, qs.data(), k2.data(), v2.data(), out.data()));
  for (int b = 0; b < 2; ++b) {
    for (size_t i = 0; i < alone[b].size(); ++i) {
      ASSERT_EQ(alone[b][i], out[size_t(b) * hq * d + i]) << "sequence " << b << " element " << i;
    }
  }
  both.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// A token of step `step` for sequence `seq`: deterministic, distinct per sequence and step.
std::vector<bf16> StepToken(int hd, int seq, int step, float scale) {
  std::vector<bf16> t(hd);
  for (int i = 0; i < hd; ++i) {
    t[i] = kernels::FloatToBf16(scale * std::sin(0.37f * float(i) + 1.3f * float(seq) + 0.71f * float(step)));
  }
  return t;
}

// Each document ingested as a session of `profile` and attached twice: once for a batch
// (batch[i]) and once for a decoder of that sequence alone (solo[i]).
void IngestAndAttachTwice(client::Client& c, const std::vector<synthetic::Document>& docs,
                          const v1::Profile& profile, std::vector<std::string>* batch,
                          std::vector<std::string>* solo) {
  for (const synthetic::Document& doc : docs) {
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(c, doc, profile, -1));
    v1::AttachRequest ar;
    ar.set_session_id(cs.session_id());
    KV_ASSERT_OK_AND_ASSIGN(a, c.Attach(ar));
    KV_ASSERT_OK_AND_ASSIGN(b, c.Attach(ar));
    batch->push_back(a.attachment_id());
    solo->push_back(b.attachment_id());
  }
}

// Continuous batching: sequences of different sessions and lengths join and leave a
// decoder between steps; every step, each sequence's output equals a decoder of that
// sequence alone fed the same tokens since it joined (bit for bit on the CPU backend:
// the same kernels over the same rows), and a sequence that left frees its place.
TEST(LocalDecoder, SequencesJoinAndLeaveBetweenSteps) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<synthetic::Document> docs;
  for (int i = 0; i < 3; ++i) docs.emplace_back(SmallDoc(1024 + 512 * i, 20 + i));
  std::vector<std::string> batch_att, solo_att;
  ASSERT_NO_FATAL_FAILURE(IngestAndAttachTwice(*f.c, docs, profile, &batch_att, &solo_att));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.local_capacity = 16;
  // An empty decoder: sequences join as they arrive.
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {}, opt));
  EXPECT_EQ(dec->batch(), 0);
  std::vector<float> none(64);
  std::vector<bf16> q0(64);
  EXPECT_TRUE(absl::IsFailedPrecondition(dec->Attend(0, q0.data(), nullptr, nullptr, none.data())));
  std::vector<std::unique_ptr<client::LocalDecoder>> solo(3);
  const auto& spec = docs[0].spec();
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  // Step at which each sequence joins and leaves (-1: stays).
  const int join_at[3] = {0, 2, 4}, leave_at[3] = {7, -1, 9};
  std::vector<int> members;  // sequence ids in batch order
  for (int step = 0; step < 10; ++step) {
    for (int i = 0; i < 3; ++i) {
      if (leave_at[i] == step) {
        const auto it = std::find(members.begin(), members.end(), i);
        ASSERT_NE(it, members.end());
        KV_ASSERT_OK(dec->Leave(static_cast<int>(it - members.begin())));
        members.erase(it);
        solo[i].reset();
      }
      if (join_at[i] == step) {
        KV_ASSERT_OK_AND_ASSIGN(b, dec->Join(batch_att[i]));
        EXPECT_EQ(b, static_cast<int>(members.size()));
        members.push_back(i);
        KV_ASSERT_OK_AND_ASSIGN(one, client::LocalDecoder::Open(f.c.get(), {solo_att[i]}, opt));
        solo[i] = std::move(one);
      }
    }
    const int B = static_cast<int>(members.size());
    ASSERT_EQ(dec->batch(), B);
    std::vector<std::string> ids;
    for (int i : members) ids.push_back(batch_att[i]);
    EXPECT_EQ(dec->attachment_ids(), ids);
    EXPECT_TRUE(absl::IsAlreadyExists(dec->Join(batch_att[members[0]]).status()));
    for (int l = 0; l < L; ++l) {
      std::vector<bf16> qs, ks, vs;
      std::vector<std::vector<float>> want(B);
      for (int b = 0; b < B; ++b) {
        const int i = members[b];
        const std::vector<bf16> q = QueryBf16(docs[i], l, 0, step, spec.doc_tokens);
        const std::vector<bf16> k = StepToken(hd, i, step * L + l, 0.5f), v = StepToken(hd, i + 7, step * L + l, 1.0f);
        want[b].resize(size_t(hq) * d);
        KV_ASSERT_OK(solo[i]->Attend(l, q.data(), k.data(), v.data(), want[b].data()));
        qs.insert(qs.end(), q.begin(), q.end());
        ks.insert(ks.end(), k.begin(), k.end());
        vs.insert(vs.end(), v.begin(), v.end());
      }
      std::vector<float> out(size_t(B) * hq * d);
      KV_ASSERT_OK(dec->Attend(l, qs.data(), ks.data(), vs.data(), out.data()));
      for (int b = 0; b < B; ++b) {
        for (size_t x = 0; x < want[b].size(); ++x) {
          ASSERT_EQ(want[b][x], out[size_t(b) * hq * d + x])
              << "step " << step << " layer " << l << " sequence " << members[b] << " element " << x;
        }
      }
    }
    KV_ASSERT_OK(dec->Advance());
    for (int i : members) KV_ASSERT_OK(solo[i]->Advance());
    const std::vector<uint64_t> tokens = dec->tokens();
    for (int b = 0; b < B; ++b) {
      const int i = members[b];
      EXPECT_EQ(tokens[b], uint64_t(docs[i].spec().doc_tokens + step + 1 - join_at[i])) << "sequence " << i;
    }
  }
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Leave(5)));
  EXPECT_TRUE(absl::IsNotFound(dec->Leave("no-such-attachment")));
  dec.reset();
  for (auto& s : solo) s.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// A join in two parts: Prepare on another thread while the batch steps, then Join between
// steps. The joined sequence attends exactly as one joined at once (a decoder of its own);
// a prepared sequence that never joins lets go of its generation; Prepare fails as Join
// does; before a decoder's first sequence it only exports and Join maps.
TEST(LocalDecoder, PreparedJoinsEqualPlainJoins) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<synthetic::Document> docs;
  for (int i = 0; i < 3; ++i) docs.emplace_back(SmallDoc(1024 + 256 * i, 40 + i));
  std::vector<std::string> batch_att, solo_att;
  ASSERT_NO_FATAL_FAILURE(IngestAndAttachTwice(*f.c, docs, profile, &batch_att, &solo_att));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.local_capacity = 16;
  const auto& spec = docs[0].spec();
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  // One step of `dec` over sequences `members` (doc ids, batch order), each at its own step
  // number `at[b]` (its query and new token); out[l] holds layer l's outputs, batch-major.
  const auto step = [&](client::LocalDecoder& dec, const std::vector<int>& members, const std::vector<int>& at,
                        std::vector<std::vector<float>>* out) {
    const int B = static_cast<int>(members.size());
    out->assign(L, std::vector<float>(size_t(B) * hq * d));
    for (int l = 0; l < L; ++l) {
      std::vector<bf16> qs, ks, vs;
      for (int b = 0; b < B; ++b) {
        const int i = members[b], t = at[b];
        const std::vector<bf16> q = QueryBf16(docs[i], l, 0, t, spec.doc_tokens);
        const std::vector<bf16> k = StepToken(hd, i, t * L + l, 0.5f), v = StepToken(hd, i + 7, t * L + l, 1.0f);
        qs.insert(qs.end(), q.begin(), q.end());
        ks.insert(ks.end(), k.begin(), k.end());
        vs.insert(vs.end(), v.begin(), v.end());
      }
      ASSERT_TRUE(dec.Attend(l, qs.data(), ks.data(), vs.data(), (*out)[l].data()).ok());
    }
    ASSERT_TRUE(dec.Advance().ok());
  };
  // Prepared before the decoder's first sequence: exported only; Join maps it.
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {}, opt));
  KV_ASSERT_OK_AND_ASSIGN(first, dec->Prepare(batch_att[0]));
  EXPECT_EQ(first->attachment_id(), batch_att[0]);
  KV_ASSERT_OK_AND_ASSIGN(b0, dec->Join(std::move(first)));
  EXPECT_EQ(b0, 0);
  EXPECT_TRUE(absl::IsAlreadyExists(dec->Prepare(batch_att[0]).status()));
  // Sequence 1 is prepared on another thread while sequence 0 decodes.
  absl::StatusOr<std::unique_ptr<client::PreparedSequence>> prepared = absl::UnknownError("not run");
  std::vector<std::vector<float>> out;
  {
    std::thread t([&] { prepared = dec->Prepare(batch_att[1]); });
    for (int s = 0; s < 3; ++s) step(*dec, {0}, {s}, &out);
    t.join();
  }
  KV_ASSERT_OK(prepared.status());
  // Held until it joins: one generation more than the batch's.
  const double held = MetricSum(f.server, "kvshade_export_generations");
  EXPECT_GE(held, 2);
  KV_ASSERT_OK_AND_ASSIGN(b1, dec->Join(std::move(*prepared)));
  EXPECT_EQ(b1, 1);
  EXPECT_EQ(dec->attachment_ids(), (std::vector<std::string>{batch_att[0], batch_att[1]}));
  EXPECT_EQ(MetricSum(f.server, "kvshade_export_generations"), held) << "the join keeps the generation it prepared";
  // Its steps equal a decoder of its own given the same tokens, bit for bit.
  KV_ASSERT_OK_AND_ASSIGN(solo, client::LocalDecoder::Open(f.c.get(), {solo_att[1]}, opt));
  for (int s = 0; s < 3; ++s) {
    std::vector<std::vector<float>> want;
    step(*solo, {1}, {s}, &want);
    step(*dec, {0, 1}, {3 + s, s}, &out);  // sequence 0 is at its step 3 + s
    for (int l = 0; l < L; ++l) {
      for (size_t x = 0; x < want[l].size(); ++x) {
        ASSERT_EQ(want[l][x], out[l][size_t(hq) * d + x]) << "step " << s << " layer " << l << " element " << x;
      }
    }
  }
  // A prepared sequence that never joins lets go of its generation (its attachment stays).
  const double before = MetricSum(f.server, "kvshade_export_generations");
  {
    KV_ASSERT_OK_AND_ASSIGN(unused, dec->Prepare(batch_att[2]));
    EXPECT_EQ(MetricSum(f.server, "kvshade_export_generations"), before + 1);
  }
  EXPECT_EQ(MetricSum(f.server, "kvshade_export_generations"), before);
  // Joined by another decoder than the one that prepared it: refused, and released.
  KV_ASSERT_OK_AND_ASSIGN(other, client::LocalDecoder::Open(f.c.get(), {}, opt));
  KV_ASSERT_OK_AND_ASSIGN(foreign, dec->Prepare(batch_att[2]));
  EXPECT_TRUE(absl::IsInvalidArgument(other->Join(std::move(foreign)).status()));
  EXPECT_EQ(MetricSum(f.server, "kvshade_export_generations"), before);
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Join(std::unique_ptr<client::PreparedSequence>()).status()));
  // Another geometry fails at Prepare, as at Join.
  synthetic::DocSpec wide = SmallDoc(1024, 90);
  wide.head_dim = 2 * spec.head_dim;
  wide.model_id = "synthetic/doc-qa-wide";
  const synthetic::Document odd(wide);
  KV_ASSERT_OK_AND_ASSIGN(ocs, CreateAndIngest(*f.c, odd, profile, -1));
  v1::AttachRequest oar;
  oar.set_session_id(ocs.session_id());
  KV_ASSERT_OK_AND_ASSIGN(oatt, f.c->Attach(oar));
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Prepare(oatt.attachment_id()).status()));
  EXPECT_EQ(MetricSum(f.server, "kvshade_export_generations"), before);
  other.reset();
  solo.reset();
  dec.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// Extend: tokens added to one sequence's local tail between steps are attended as if
// earlier steps had given them (against a decoder stepped through the same tokens: the same
// rows, merged in another order where its earlier selections left the slots in another
// order, so within 1e-5 of the largest value), the other sequence of the batch is
// untouched (bit for bit), and tokens() counts them; bad calls and an overfull tail are
// refused without adding anything.
TEST(LocalDecoder, ExtendEqualsSteppingTheSameTokens) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<synthetic::Document> docs;
  for (int i = 0; i < 2; ++i) docs.emplace_back(SmallDoc(1024 + 512 * i, 40 + i));
  std::vector<std::string> batch_att(2), solo_att(2);
  for (int i = 0; i < 2; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, docs[i], profile, -1));
    v1::AttachRequest ar;
    ar.set_session_id(cs.session_id());
    KV_ASSERT_OK_AND_ASSIGN(a, f.c->Attach(ar));
    KV_ASSERT_OK_AND_ASSIGN(b, f.c->Attach(ar));
    batch_att[i] = a.attachment_id();
    solo_att[i] = b.attachment_id();
  }
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.local_capacity = 16;
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), batch_att, opt));
  KV_ASSERT_OK_AND_ASSIGN(solo0, client::LocalDecoder::Open(f.c.get(), {solo_att[0]}, opt));
  KV_ASSERT_OK_AND_ASSIGN(solo1, client::LocalDecoder::Open(f.c.get(), {solo_att[1]}, opt));
  const auto& spec = docs[0].spec();
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  // n tokens: the solo decoder takes them one step each; the batch's sequence 0 in one
  // Extend ([L, n, h, d], layer-major).
  const int n = 5;
  std::vector<bf16> ext_k(size_t(L) * n * hd), ext_v(size_t(L) * n * hd);
  std::vector<float> scratch(size_t(hq) * d);
  for (int t = 0; t < n; ++t) {
    for (int l = 0; l < L; ++l) {
      const std::vector<bf16> k = StepToken(hd, 0, t * L + l, 0.5f), v = StepToken(hd, 7, t * L + l, 1.0f);
      std::copy(k.begin(), k.end(), ext_k.begin() + (size_t(l) * n + t) * hd);
      std::copy(v.begin(), v.end(), ext_v.begin() + (size_t(l) * n + t) * hd);
      const std::vector<bf16> q = QueryBf16(docs[0], l, 0, 100 + t, spec.doc_tokens);
      KV_ASSERT_OK(solo0->Attend(l, q.data(), k.data(), v.data(), scratch.data()));
    }
    KV_ASSERT_OK(solo0->Advance());
  }
  // Refused: a sequence out of the batch, no tokens, null rows, more than the tail holds.
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Extend(2, n, ext_k.data(), ext_v.data())));
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Extend(0, 0, ext_k.data(), ext_v.data())));
  EXPECT_TRUE(absl::IsInvalidArgument(dec->Extend(0, n, nullptr, ext_v.data())));
  std::vector<bf16> too_many(size_t(L) * 17 * hd);
  EXPECT_TRUE(absl::IsResourceExhausted(dec->Extend(0, 17, too_many.data(), too_many.data())));
  EXPECT_EQ(dec->tokens()[0], uint64_t(spec.doc_tokens));
  KV_ASSERT_OK(dec->Extend(0, n, ext_k.data(), ext_v.data()));
  EXPECT_EQ(dec->tokens()[0], uint64_t(spec.doc_tokens + n));
  EXPECT_EQ(dec->tokens()[1], uint64_t(docs[1].spec().doc_tokens));
  // Two steps of the batch against the solo decoders: equal bit for bit.
  for (int step = 0; step < 2; ++step) {
    for (int l = 0; l < L; ++l) {
      std::vector<bf16> qs, ks, vs;
      std::vector<std::vector<float>> want(2, std::vector<float>(size_t(hq) * d));
      for (int b = 0; b < 2; ++b) {
        const std::vector<bf16> q = QueryBf16(docs[b], l, 0, step, docs[b].spec().doc_tokens);
        const std::vector<bf16> k = StepToken(hd, b + 2, step * L + l, 0.5f);
        const std::vector<bf16> v = StepToken(hd, b + 9, step * L + l, 1.0f);
        KV_ASSERT_OK((b == 0 ? solo0 : solo1)->Attend(l, q.data(), k.data(), v.data(), want[b].data()));
        qs.insert(qs.end(), q.begin(), q.end());
        ks.insert(ks.end(), k.begin(), k.end());
        vs.insert(vs.end(), v.begin(), v.end());
      }
      std::vector<float> out(size_t(2) * hq * d);
      KV_ASSERT_OK(dec->Attend(l, qs.data(), ks.data(), vs.data(), out.data()));
      EXPECT_LT(MaxRelDiff(want[0], out.data(), want[0].size()), 1e-5)
          << "step " << step << " layer " << l;
      for (size_t x = 0; x < want[1].size(); ++x) {
        ASSERT_EQ(want[1][x], out[size_t(hq) * d + x])
            << "step " << step << " layer " << l << " sequence 1 element " << x;
      }
    }
    KV_ASSERT_OK(dec->Advance());
    KV_ASSERT_OK(solo0->Advance());
    KV_ASSERT_OK(solo1->Advance());
  }
  EXPECT_EQ(dec->tokens()[0], uint64_t(spec.doc_tokens + n + 2));
  // The tail holds 16: 7 used, so 9 more fit and a 10th does not.
  EXPECT_TRUE(absl::IsResourceExhausted(dec->Extend(0, 10, too_many.data(), too_many.data())));
  KV_ASSERT_OK(dec->Extend(0, 9, too_many.data(), too_many.data()));
  EXPECT_TRUE(absl::IsResourceExhausted(dec->Advance()));
  dec.reset();
  solo0.reset();
  solo1.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// Sequences refresh independently: one whose session gained its decoded token drops it from
// its local tail, another that appended nothing keeps its own; both go on attending as a
// decoder of each alone does.
TEST(LocalDecoder, RefreshDropsEachSequencesOwnCoveredTokens) {
  Fixture f;
  synthetic::DocSpec spec = SmallDoc(1024);
  spec.question_tokens = 16;
  const synthetic::Document doc(spec);
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  std::vector<std::string> sessions, batch_att, solo_att;
  for (int i = 0; i < 2; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, doc, profile, -1));
    sessions.push_back(cs.session_id());
    v1::AttachRequest ar;
    ar.set_session_id(cs.session_id());
    ar.set_writer(i == 0);
    KV_ASSERT_OK_AND_ASSIGN(a, f.c->Attach(ar));
    ar.set_writer(false);
    KV_ASSERT_OK_AND_ASSIGN(b, f.c->Attach(ar));
    batch_att.push_back(a.attachment_id());
    solo_att.push_back(b.attachment_id());
  }
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), batch_att, opt));
  std::vector<std::unique_ptr<client::LocalDecoder>> solo(2);
  for (int i = 0; i < 2; ++i) {
    KV_ASSERT_OK_AND_ASSIGN(one, client::LocalDecoder::Open(f.c.get(), {solo_att[i]}, opt));
    solo[i] = std::move(one);
  }
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  int64_t pos = spec.doc_tokens;
  for (int step = 0; step < 4; ++step, ++pos) {
    // Session 0 appends its step token (read back post-RoPE); session 1 appends nothing.
    std::vector<std::vector<bf16>> kn0, vn0;
    AppendAndReadNew(*f.c, doc, sessions[0], batch_att[0], 0, pos, &kn0, &vn0);
    ASSERT_FALSE(HasFatalFailure());
    for (int l = 0; l < L; ++l) {
      std::vector<bf16> qs, ks, vs;
      std::vector<std::vector<float>> want(2);
      for (int i = 0; i < 2; ++i) {
        const std::vector<bf16> q = QueryBf16(doc, l, 0, step, pos);
        const std::vector<bf16> k = i == 0 ? kn0[l] : StepToken(hd, 1, step * L + l, 0.5f);
        const std::vector<bf16> v = i == 0 ? vn0[l] : StepToken(hd, 9, step * L + l, 1.0f);
        want[i].resize(size_t(hq) * d);
        KV_ASSERT_OK(solo[i]->Attend(l, q.data(), k.data(), v.data(), want[i].data()));
        qs.insert(qs.end(), q.begin(), q.end());
        ks.insert(ks.end(), k.begin(), k.end());
        vs.insert(vs.end(), v.begin(), v.end());
      }
      std::vector<float> out(size_t(2) * hq * d);
      KV_ASSERT_OK(dec->Attend(l, qs.data(), ks.data(), vs.data(), out.data()));
      for (int i = 0; i < 2; ++i) {
        for (size_t x = 0; x < want[i].size(); ++x) {
          ASSERT_EQ(want[i][x], out[size_t(i) * hq * d + x]) << "step " << step << " layer " << l << " seq " << i;
        }
      }
    }
    KV_ASSERT_OK(dec->Advance());
    for (auto& s : solo) KV_ASSERT_OK(s->Advance());
    if (step % 2 == 1) {
      // Different gains (1 or 2 tokens vs none): each sequence drops what its session holds.
      KV_ASSERT_OK(dec->Refresh());
      for (auto& s : solo) KV_ASSERT_OK(s->Refresh());
      const std::vector<uint64_t> t = dec->tokens();
      EXPECT_EQ(t[0], uint64_t(pos + 1));
      EXPECT_EQ(t[1], uint64_t(spec.doc_tokens + step + 1));
      EXPECT_EQ(t, (std::vector<uint64_t>{solo[0]->tokens()[0], solo[1]->tokens()[0]}));
    }
  }
  dec.reset();
  for (auto& s : solo) s.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

TEST(LocalDecoder, ExpiredLeaseIsAnErrorNotFreedMemory) {
  Fixture f;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu"}));
  f.c = f.server.Connect();
  KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, f.doc, ShadowProfile(16, 8, 4), 0));
  v1::AttachRequest ar;
  ar.set_session_id(cs.session_id());
  ar.set_lease_ms(1500);
  KV_ASSERT_OK_AND_ASSIGN(att, f.c->Attach(ar));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  opt.renew_leases = false;
  opt.lease_margin = absl::Milliseconds(500);
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {att.attachment_id()}, opt));
  const auto& spec = f.doc.spec();
  const int hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  std::vector<bf16> qb = QueryBf16(f.doc, 0, 0, 0, 1100), kn(hd, bf16{}), vn(hd, bf16{});
  std::vector<float> out(size_t(hq) * d);
  KV_ASSERT_OK(dec->Attend(0, qb.data(), kn.data(), vn.data(), out.data()));
  // Past the lease minus the margin: refused, whatever the daemon did meanwhile. (The
  // lease is time itself; waiting for it is the behaviour under test.)
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  absl::Status st = dec->Attend(0, qb.data(), kn.data(), vn.data(), out.data());
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("lease"), std::string::npos) << st;

  // With renewal on, a decoder outlives several leases.
  v1::AttachRequest ar2;
  ar2.set_session_id(cs.session_id());
  ar2.set_lease_ms(900);
  KV_ASSERT_OK_AND_ASSIGN(att2, f.c->Attach(ar2));
  opt.renew_leases = true;
  opt.lease_margin = absl::Milliseconds(200);
  KV_ASSERT_OK_AND_ASSIGN(dec2, client::LocalDecoder::Open(f.c.get(), {att2.attachment_id()}, opt));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  KV_ASSERT_OK(dec2->Attend(0, qb.data(), kn.data(), vn.data(), out.data()));
  dec.reset();
  dec2.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

// A generation pins what it maps: the values of the exported session stay resident and in
// place while other sessions push the host store past its budget (they spill instead).
TEST(LocalDecoder, GenerationHoldsThroughMemoryPressure) {
  Fixture f;
  TempDir spill;
  KV_ASSERT_OK(f.server.Start({"--backend", "cpu", "--host-budget", "2MiB", "--spill-path", spill.path()}));
  f.c = f.server.Connect();
  v1::Profile profile = ShadowProfile(16, 8, 4);
  KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*f.c, f.doc, profile, 0));
  v1::AttachRequest ar;
  ar.set_session_id(cs.session_id());
  KV_ASSERT_OK_AND_ASSIGN(att, f.c->Attach(ar));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(f.c.get(), {att.attachment_id()}, opt));
  const auto& spec = f.doc.spec();
  const int hq = spec.q_heads, d = spec.head_dim, hd = spec.kv_heads * d;
  const int64_t pos = static_cast<int64_t>(f.doc.SessionTokens(0).size());
  std::vector<bf16> kn(hd, kernels::FloatToBf16(0.05f)), vn(hd, kernels::FloatToBf16(-0.03f));
  std::vector<std::vector<float>> before(spec.layers, std::vector<float>(size_t(hq) * d));
  for (int l = 0; l < spec.layers; ++l) {
    std::vector<bf16> qb = QueryBf16(f.doc, l, 0, 0, pos);
    KV_ASSERT_OK(dec->Attend(l, qb.data(), kn.data(), vn.data(), before[l].data()));
  }
  // Other documents, each about the size of the budget: the store must spill to fit them.
  for (uint64_t seed = 100; seed < 112; ++seed) {
    synthetic::Document other(SmallDoc(1024, seed));
    auto r = CreateAndIngest(*f.c, other, profile, -1);
    ASSERT_TRUE(r.ok()) << r.status();
  }
  // Thirteen documents' values (bf16 V: half the dense bytes each) against a 2 MiB budget:
  // the store had to spill others to admit them, never the pinned one.
  KV_ASSERT_OK_AND_ASSIGN(stats, f.c->Stats());
  ASSERT_GT(13 * f.doc.DenseBytes(1024) / 2, stats.host_bytes_budget());
  EXPECT_LE(stats.host_bytes_used(), stats.host_bytes_budget());
  std::vector<float> after(size_t(hq) * d);
  for (int l = 0; l < spec.layers; ++l) {
    std::vector<bf16> qb = QueryBf16(f.doc, l, 0, 0, pos);
    // Same step again (the slot table now hits everything): same answer, bit for bit
    // except block order, which is the same here.
    KV_ASSERT_OK(dec->Attend(l, qb.data(), kn.data(), vn.data(), after.data()));
    EXPECT_LT(MaxRelDiff(before[l], after.data(), after.size()), 1e-6) << "layer " << l;
  }
  dec.reset();
  EXPECT_EQ(f.server.Stop(), 0) << f.server.log();
}

}  // namespace
}  // namespace local_decoder_test
}  // namespace kvshade::integration

namespace kvshade::integration {
namespace local_decoder_test {
namespace {

// The daemon's descriptor broker: every host region of an export names it, the socket is
// private to the daemon's user and gone after exit, and a decoder that takes descriptors
// through it attends exactly as the daemon does. With the broker off the exports name
// none and the decoder takes the same memory through /proc.
TEST(LocalDecoder, DescriptorsComeFromTheDaemonsBrokerOrProc) {
  for (const bool broker : {true, false}) {
    SCOPED_TRACE(broker ? "broker at a socket path" : "broker off");
    TempDir dir;
    const std::string sock = dir.path() + "/fd.sock", cfg = dir.path() + "/kvshade.yaml";
    std::ofstream(cfg) << "same_node:\n  descriptor_broker: " << (broker ? sock : "off") << "\n";
    ServerProcess server;
    KV_ASSERT_OK(server.Start({"--backend", "cpu", "-c", cfg}));
    struct stat st;
    ASSERT_EQ(lstat(sock.c_str(), &st) == 0, broker);
    if (broker) {
      EXPECT_EQ(st.st_mode & 0777, 0600u);
    }
    auto c = server.Connect();
    synthetic::Document doc(SmallDoc(1024));
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*c, doc, ShadowProfile(16, 8, 4), 0));
    v1::AttachRequest ar;
    ar.set_session_id(cs.session_id());
    KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
    v1::ExportSessionRequest er;
    er.set_attachment_id(att.attachment_id());
    KV_ASSERT_OK_AND_ASSIGN(exp, c->ExportSession(er));
    ASSERT_GT(exp.regions_size(), 0);
    for (const v1::SharedRegion& r : exp.regions()) {
      EXPECT_EQ(r.descriptor_broker(), broker ? sock : "") << "region " << r.id();
    }
    er.set_renew_only(true);
    er.add_release_generations(exp.generation());
    KV_ASSERT_OK(c->ExportSession(er).status());
    client::LocalDecoderOptions opt;
    opt.backend = "cpu";
    KV_ASSERT_OK_AND_ASSIGN(dec, client::LocalDecoder::Open(c.get(), {att.attachment_id()}, opt));
    const auto& spec = doc.spec();
    const int64_t pos = static_cast<int64_t>(doc.SessionTokens(0).size());
    std::vector<float> out(size_t(spec.q_heads) * spec.head_dim);
    for (int l = 0; l < spec.layers; ++l) {
      std::vector<bf16> qb = QueryBf16(doc, l, 0, 0, pos);
      KV_ASSERT_OK(dec->Attend(l, qb.data(), nullptr, nullptr, out.data()));
      std::vector<float> ref = AttendRpc(*c, att.attachment_id(), l, qb, spec.q_heads, spec.head_dim);
      ASSERT_EQ(ref.size(), out.size());
      EXPECT_LT(MaxRelDiff(ref, out.data(), out.size()), 1e-5) << "layer " << l;
    }
    dec.reset();
    EXPECT_EQ(server.Stop(), 0) << server.log();
    EXPECT_NE(lstat(sock.c_str(), &st), 0);  // removed at exit
  }
}

// same_node.export: false keeps the daemon's memory private: ExportSession is refused and
// a decoder cannot open; the RPC path still serves the attachment.
TEST(LocalDecoder, ExportOffIsRefusedAndTheRpcPathServes) {
  TempDir dir;
  const std::string cfg = dir.path() + "/kvshade.yaml";
  {
    FILE* f = std::fopen(cfg.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("same_node:\n  export: false\n", f);
    std::fclose(f);
  }
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu", "-c", cfg}));
  auto c = server.Connect();
  synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*c, doc, ShadowProfile(16, 8, 4), 0));
  v1::AttachRequest ar;
  ar.set_session_id(cs.session_id());
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  auto dec = client::LocalDecoder::Open(c.get(), {att.attachment_id()}, opt);
  ASSERT_FALSE(dec.ok());
  EXPECT_EQ(dec.status().code(), absl::StatusCode::kFailedPrecondition) << dec.status();
  EXPECT_NE(dec.status().message().find("same_node.export"), std::string::npos) << dec.status();
  const auto& spec = doc.spec();
  std::vector<bf16> qb = QueryBf16(doc, 0, 0, 0, 1100);
  std::vector<float> out = AttendRpc(*c, att.attachment_id(), 0, qb, spec.q_heads, spec.head_dim);
  EXPECT_EQ(out.size(), size_t(spec.q_heads) * spec.head_dim);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace local_decoder_test
}  // namespace kvshade::integration

namespace kvshade::integration {
namespace local_decoder_test {
namespace {

// Same-node ingest names the worker's GPU memory; a daemon on the cpu backend cannot read
// it: the part is refused with the reason, the stream commits nothing, and the session
// can still be ingested inline.
TEST(SameNodeIngest, CudaIpcPartsNeedAGpuDaemon) {
  // Over gRPC and over the UCX data plane (which takes the same message path for a part
  // in GPU memory): the same refusal, the session left ingesting and still usable.
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu", "-c", UcxConfig(dir, "tcp,self", "")}));
  v1::Profile profile = ShadowProfile(16, 8, 4);
  for (bool ucx : {false, true}) {
    SCOPED_TRACE(ucx ? "ucx" : "grpc");
    synthetic::Document doc(SmallDoc(1024, ucx ? 61 : 60));  // no prefix to reuse
    auto c = ucx ? server.Connect(UcxClientOptions("tcp,self")) : server.Connect();
    KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(synthetic::MakeCreate(doc, profile, 0)));
    {
      KV_ASSERT_OK_AND_ASSIGN(w, c->StartIngest(created.session_id()));
      EXPECT_EQ(c->ucx_connected(), ucx);
      v1::IngestLayer part;
      part.set_layer(0);
      part.set_last_part(true);
      const int64_t n = static_cast<int64_t>(created.tokens_to_ingest());
      for (v1::Tensor* t : {part.mutable_k(), part.mutable_v()}) {
        t->add_shape(n);
        t->add_shape(doc.spec().kv_heads);
        t->add_shape(doc.spec().head_dim);
        t->set_dtype(v1::DTYPE_BF16);
        t->mutable_cuda_ipc()->set_handle(std::string(64, '\x01'));
      }
      absl::Status st = w->Write(part);
      absl::StatusOr<v1::IngestResponse> r = st.ok() ? w->Commit() : absl::StatusOr<v1::IngestResponse>(st);
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
      EXPECT_NE(r.status().message().find("GPU backend"), std::string::npos) << r.status();
    }
    KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(created.session_id()));
    EXPECT_EQ(info.state(), "ingesting");
    KV_ASSERT_OK(synthetic::IngestRange(*c, doc, created.session_id(), 0, created.reused_tokens(),
                                        static_cast<int64_t>(doc.SessionTokens(0).size()))
                     .status());
    KV_ASSERT_OK_AND_ASSIGN(ready, c->GetSession(created.session_id()));
    EXPECT_EQ(ready.state(), "ready");
    KV_ASSERT_OK(c->CloseSession(created.session_id()));
  }
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace local_decoder_test
}  // namespace kvshade::integration

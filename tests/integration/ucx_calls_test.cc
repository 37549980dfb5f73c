// Integration: the UCX data plane's AppendTokens, Attend (sync and async), staged decode
// (SelectAndReconstruct and Attend frames carrying the new token) and pipelined Ingest
// against the real kvshade-server on loopback. Every call over UCX must give the
// same result as the same call over gRPC inline, bit for bit; an error in the middle of a
// pipelined ingest returns the stream's first error and leaves nothing behind; a payload
// over the daemon's limit is refused, not dropped; 64 clients on their own UCX
// connections get what a sequential gRPC client gets.
#include <fstream>
#include <thread>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"
#include "kvshade/client/ucx_data_plane.h"

namespace kvshade::integration {
namespace ucx_calls_test {
namespace {

v1::AttendRequest MakeAttend(const synthetic::Document& doc, uint32_t layer,
                             const std::vector<std::string>& attachments, int question, int step,
                             int64_t position) {
  const v1::SelectAndReconstructRequest s =
      MakeSelect(doc, layer, attachments, question, step, position);
  v1::AttendRequest r;
  r.set_layer(layer);
  for (const auto& q : s.queries()) {
    auto* a = r.add_queries();
    a->set_attachment_id(q.attachment_id());
    *a->mutable_q() = q.q();
  }
  return r;
}

std::string Canonical(v1::SelectAndReconstructResponse r) {
  for (auto& d : *r.mutable_deltas()) d.clear_attachment_id();
  return r.SerializeAsString();
}

// The Ingest stream of `doc` for `session_id`: header, each layer in parts of at most
// `part_tokens` tokens (parts over 64 KiB go by rendezvous, smaller ones eagerly, so their
// completions can overtake each other), commit.
std::vector<v1::IngestRequest> IngestMessages(const synthetic::Document& doc,
                                              const std::string& session_id, int64_t part_tokens) {
  std::vector<v1::IngestRequest> msgs(1);
  msgs[0].mutable_header()->set_session_id(session_id);
  const auto& sp = doc.spec();
  const int64_t n = static_cast<int64_t>(doc.tokens().size());
  for (int l = 0; l < sp.layers; ++l) {
    for (int64_t t0 = 0; t0 < n; t0 += part_tokens) {
      const int64_t t1 = std::min(n, t0 + part_tokens);
      std::vector<uint16_t> k, v;
      doc.KeysValues(l, -1, t0, t1, &k, &v);
      v1::IngestRequest m;
      auto* part = m.mutable_layer();
      part->set_layer(l);
      part->set_token_offset(t0);
      part->set_last_part(t1 == n);
      *part->mutable_k() = client::MakeBf16Tensor({t1 - t0, sp.kv_heads, sp.head_dim}, absl::MakeConstSpan(k));
      *part->mutable_v() = client::MakeBf16Tensor({t1 - t0, sp.kv_heads, sp.head_dim}, absl::MakeConstSpan(v));
      msgs.push_back(std::move(m));
    }
  }
  msgs.emplace_back().mutable_commit();
  return msgs;
}

class UcxCallsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxCallsTest, AppendAndAttendOverUcxEqualGrpcInline) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  auto g = server.Connect();
  auto u = server.Connect(UcxClientOptions(GetParam()));
  const synthetic::Document doc(SmallDoc(1024));
  // Session A is ingested over UCX (IngestWriter); B reuses A's segment (prefix cache), so
  // both start from the same state.
  KV_ASSERT_OK_AND_ASSIGN(sa, CreateAndIngest(*u, doc, ShadowProfile(), -1));
  KV_ASSERT_OK_AND_ASSIGN(sb, CreateAndIngest(*g, doc, ShadowProfile(), -1));
  EXPECT_EQ(sb.reused_tokens(), 1024u);
  ASSERT_TRUE(u->ucx_connected());
  v1::AttachRequest ar;
  ar.set_session_id(sa.session_id());
  KV_ASSERT_OK_AND_ASSIGN(au, u->Attach(ar));
  ar.set_session_id(sb.session_id());
  KV_ASSERT_OK_AND_ASSIGN(ag, g->Attach(ar));

  const int L = doc.spec().layers;
  int64_t tokens = 1024;
  for (int round = 0; round < 3; ++round) {
    // Appends of 5 tokens: the tail fills and whole chunks (C = 8) leave it.
    KV_ASSERT_OK_AND_ASSIGN(pu, u->AppendTokens(synthetic::MakeAppend(doc, sa.session_id(), 0, tokens, tokens + 5)));
    KV_ASSERT_OK_AND_ASSIGN(pg, g->AppendTokens(synthetic::MakeAppend(doc, sb.session_id(), 0, tokens, tokens + 5)));
    tokens += 5;
    EXPECT_EQ(pu.SerializeAsString(), pg.SerializeAsString());
    EXPECT_EQ(pu.tokens(), static_cast<uint64_t>(tokens));
    for (int l = 0; l < L; ++l) {
      const auto ru = u->Attend(MakeAttend(doc, l, {au.attachment_id()}, 0, round, tokens));
      const auto rg = g->Attend(MakeAttend(doc, l, {ag.attachment_id()}, 0, round, tokens));
      auto fu = u->AttendAsync(MakeAttend(doc, l, {au.attachment_id()}, 0, round, tokens));
      KV_ASSERT_OK(ru.status());
      KV_ASSERT_OK(rg.status());
      KV_ASSERT_OK_AND_ASSIGN(au_async, fu.get());
      ASSERT_EQ(ru->outputs_size(), 1);
      EXPECT_EQ(ru->SerializeAsString(), rg->SerializeAsString()) << "layer " << l << " round " << round;
      EXPECT_EQ(au_async.SerializeAsString(), rg->SerializeAsString());
      KV_ASSERT_OK_AND_ASSIGN(su, u->SelectAndReconstruct(MakeSelect(doc, l, {au.attachment_id()}, 0, round, tokens)));
      KV_ASSERT_OK_AND_ASSIGN(sg, g->SelectAndReconstruct(MakeSelect(doc, l, {ag.attachment_id()}, 0, round, tokens)));
      EXPECT_EQ(Canonical(su), Canonical(sg)) << "layer " << l << " round " << round;
    }
  }
  // The daemon's errors travel unchanged (and are no reason to fall back).
  auto bad_append = synthetic::MakeAppend(doc, sa.session_id(), 0, tokens, tokens + 2);
  bad_append.mutable_layers(0)->mutable_k()->set_shape(1, 3);  // h = 3, data for h = 2
  auto eu = u->AppendTokens(bad_append);
  bad_append.set_session_id(sb.session_id());
  auto eg = g->AppendTokens(bad_append);
  ASSERT_FALSE(eu.ok());
  EXPECT_EQ(eu.status().code(), absl::StatusCode::kInvalidArgument) << eu.status();
  EXPECT_EQ(eu.status(), eg.status());
  auto nu = u->AttendAsync(MakeAttend(doc, 0, {"no-such-attachment"}, 0, 0, tokens)).get();
  auto ng = g->AttendAsync(MakeAttend(doc, 0, {"no-such-attachment"}, 0, 0, tokens)).get();
  ASSERT_FALSE(nu.ok());
  EXPECT_EQ(nu.status(), ng.status());
  auto wrong = u->AppendTokens(synthetic::MakeAppend(doc, "no-such-session", 0, tokens, tokens + 1));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kNotFound) << wrong.status();
  EXPECT_EQ(u->ucx_fallbacks(), 0u);
  EXPECT_TRUE(u->ucx_connected());
}

// A decode loop that hands each layer's new token to the daemon as it goes: staged by
// SelectAndReconstruct (every layer but one) and Attend (layer 1), appended by the call
// that stages the last layer. Over the UCX frames and over gRPC the answers are the same,
// bit for bit, and each step grows the session by one token.
TEST_P(UcxCallsTest, StagedDecodeOverUcxFramesEqualsGrpc) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  auto g = server.Connect();
  auto u = server.Connect(UcxClientOptions(GetParam()));
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(sa, CreateAndIngest(*u, doc, ShadowProfile(), -1));
  KV_ASSERT_OK_AND_ASSIGN(sb, CreateAndIngest(*g, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_writer(true);
  ar.set_session_id(sa.session_id());
  KV_ASSERT_OK_AND_ASSIGN(au, u->Attach(ar));
  ar.set_session_id(sb.session_id());
  KV_ASSERT_OK_AND_ASSIGN(ag, g->Attach(ar));
  ASSERT_TRUE(u->ucx_connected());
  const int L = doc.spec().layers;
  ASSERT_GE(L, 2);
  int64_t tokens = 512;
  for (int step = 0; step < 3; ++step, ++tokens) {
    // The step's token: its pre-RoPE K and V per layer, [h, d].
    const v1::AppendTokensRequest next = synthetic::MakeAppend(doc, "", 0, tokens, tokens + 1);
    auto token_of = [&](int l, bool v) {
      v1::Tensor t = v ? next.layers(l).v() : next.layers(l).k();
      t.mutable_shape()->erase(t.mutable_shape()->begin());  // [1, h, d] -> [h, d]
      return t;
    };
    for (int l = 0; l < L; ++l) {
      const bool last = l == L - 1;
      for (auto* c : {u.get(), g.get()}) {
        const std::string& att = c == u.get() ? au.attachment_id() : ag.attachment_id();
        if (l == 1) {
          v1::AttendRequest r = MakeAttend(doc, l, {att}, 0, step, tokens);
          *r.mutable_queries(0)->mutable_k_new() = token_of(l, false);
          *r.mutable_queries(0)->mutable_v_new() = token_of(l, true);
          r.mutable_queries(0)->set_stage_token_id(next.token_ids(0));
          KV_ASSERT_OK_AND_ASSIGN(resp, c->Attend(r));
          EXPECT_EQ(resp.tokens(0), uint64_t(last ? tokens + 1 : tokens));
        } else {
          v1::SelectAndReconstructRequest r = MakeSelect(doc, l, {att}, 0, step, tokens);
          *r.mutable_queries(0)->mutable_k_new() = token_of(l, false);
          *r.mutable_queries(0)->mutable_v_new() = token_of(l, true);
          r.mutable_queries(0)->set_stage_token_id(next.token_ids(0));
          KV_ASSERT_OK_AND_ASSIGN(resp, c->SelectAndReconstruct(r));
          EXPECT_EQ(resp.deltas(0).tokens(), uint64_t(last ? tokens + 1 : tokens)) << "layer " << l;
        }
      }
    }
    for (int l = 0; l < L; ++l) {
      KV_ASSERT_OK_AND_ASSIGN(ru, u->Attend(MakeAttend(doc, l, {au.attachment_id()}, 1, step, tokens + 1)));
      KV_ASSERT_OK_AND_ASSIGN(rg, g->Attend(MakeAttend(doc, l, {ag.attachment_id()}, 1, step, tokens + 1)));
      EXPECT_EQ(ru.SerializeAsString(), rg.SerializeAsString()) << "layer " << l << " step " << step;
      EXPECT_EQ(ru.tokens(0), uint64_t(tokens + 1));
      KV_ASSERT_OK_AND_ASSIGN(su, u->SelectAndReconstruct(MakeSelect(doc, l, {au.attachment_id()}, 1, step, tokens + 1)));
      KV_ASSERT_OK_AND_ASSIGN(sg, g->SelectAndReconstruct(MakeSelect(doc, l, {ag.attachment_id()}, 1, step, tokens + 1)));
      EXPECT_EQ(Canonical(su), Canonical(sg)) << "layer " << l << " step " << step;
    }
  }
  EXPECT_EQ(u->ucx_fallbacks(), 0u);
}

TEST_P(UcxCallsTest, PipelinedIngestEqualsGrpcIngest) {
  // The same two documents ingested over UCX (daemon A: the IngestWriter with small parts,
  // and Client::Ingest) and over gRPC (daemon B).
  TempDir dir;
  ServerProcess a, b;
  KV_ASSERT_OK(a.Start({"-c", UcxConfig(dir, GetParam())}));
  KV_ASSERT_OK(b.Start({}));
  client::ClientOptions uo = UcxClientOptions(GetParam());
  uo.ucx_ingest_window = 3;
  auto ca = a.Connect(uo);
  auto cb = b.Connect();
  const synthetic::Document doc(SmallDoc(1024)), doc2(SmallDoc(1024, 8));
  const auto& sp = doc.spec();
  const v1::CreateSessionRequest create = synthetic::MakeCreate(doc, ShadowProfile(), -1);
  KV_ASSERT_OK_AND_ASSIGN(sa, ca->CreateSession(create));
  KV_ASSERT_OK_AND_ASSIGN(sb, cb->CreateSession(create));
  std::vector<v1::IngestResponse> responses;
  for (auto* c : {ca.get(), cb.get()}) {
    KV_ASSERT_OK_AND_ASSIGN(w, c->StartIngest(c == ca.get() ? sa.session_id() : sb.session_id()));
    for (int l = sp.layers - 1; l >= 0; --l) {  // any layer order
      std::vector<uint16_t> k, v;
      doc.KeysValues(l, -1, 0, 1024, &k, &v);
      // 96 KiB parts: 384 tokens (rendezvous), the last 256 tokens (eager).
      KV_ASSERT_OK(w->WriteLayer(l, 1024, sp.kv_heads, sp.head_dim, k, v, {}, 0, 0, 96 << 10));
    }
    KV_ASSERT_OK_AND_ASSIGN(r, w->Commit());
    responses.push_back(r);
  }
  ASSERT_TRUE(ca->ucx_connected()) << "the UCX client fell back";
  EXPECT_EQ(responses[0].SerializeAsString(), responses[1].SerializeAsString());
  EXPECT_EQ(responses[0].tokens(), 1024u);

  const v1::CreateSessionRequest create2 = synthetic::MakeCreate(doc2, ShadowProfile(), -1);
  KV_ASSERT_OK_AND_ASSIGN(sa2, ca->CreateSession(create2));
  KV_ASSERT_OK_AND_ASSIGN(sb2, cb->CreateSession(create2));
  KV_ASSERT_OK_AND_ASSIGN(ra2, ca->Ingest(IngestMessages(doc2, sa2.session_id(), 300)));
  KV_ASSERT_OK_AND_ASSIGN(rb2, cb->Ingest(IngestMessages(doc2, sb2.session_id(), 300)));
  EXPECT_EQ(ra2.SerializeAsString(), rb2.SerializeAsString());
  EXPECT_EQ(ca->ucx_fallbacks(), 0u);

  v1::AttachRequest ar;
  std::vector<std::string> att;
  for (auto [c, sid] : {std::pair{ca.get(), sa.session_id()}, std::pair{cb.get(), sb.session_id()},
                        std::pair{ca.get(), sa2.session_id()}, std::pair{cb.get(), sb2.session_id()}}) {
    ar.set_session_id(sid);
    KV_ASSERT_OK_AND_ASSIGN(x, c->Attach(ar));
    att.push_back(x.attachment_id());
  }
  for (int l = 0; l < sp.layers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(xa, ca->SelectAndReconstruct(MakeSelect(doc, l, {att[0]}, 0, 0, 1024)));
    KV_ASSERT_OK_AND_ASSIGN(xb, cb->SelectAndReconstruct(MakeSelect(doc, l, {att[1]}, 0, 0, 1024)));
    EXPECT_EQ(Canonical(xa), Canonical(xb)) << "layer " << l;
    KV_ASSERT_OK_AND_ASSIGN(ya, ca->SelectAndReconstruct(MakeSelect(doc2, l, {att[2]}, 0, 0, 1024)));
    KV_ASSERT_OK_AND_ASSIGN(yb, cb->SelectAndReconstruct(MakeSelect(doc2, l, {att[3]}, 0, 0, 1024)));
    EXPECT_EQ(Canonical(ya), Canonical(yb)) << "doc2 layer " << l;
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxCallsTest,
                         ::testing::Values(std::string("tcp,self"), std::string("shm,self")),
                         [](const auto& info) {
                           return info.param == "tcp,self" ? std::string("Tcp") : std::string("Shm");
                         });

TEST(UcxIngestErrors, FirstErrorMidStreamIsReturnedAndNothingIsKept) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self")}));
  auto u = server.Connect(UcxClientOptions("tcp,self"));
  const synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK_AND_ASSIGN(s, u->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  auto msgs = IngestMessages(doc, s.session_id(), 128);  // 8 parts per layer
  ASSERT_GT(msgs.size(), 12u);
  // Part 3 claims 3 KV heads for data of 2: the engine rejects it while parts 4..6 are
  // already on their way (window 4).
  auto bad = msgs;
  bad[3].mutable_layer()->mutable_k()->set_shape(1, 3);
  auto r = u->Ingest(bad);
  ASSERT_TRUE(u->ucx_connected());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_EQ(r.status().message().find("earlier message"), std::string::npos)
      << "the first error must be the rejected part's own: " << r.status();
  KV_ASSERT_OK_AND_ASSIGN(info, u->GetSession(s.session_id()));
  EXPECT_EQ(info.tokens(), 0u);
  EXPECT_EQ(info.layers_ingested(), 0u);

  // The same through an IngestWriter: the error surfaces by the commit at the latest.
  {
    KV_ASSERT_OK_AND_ASSIGN(w, u->StartIngest(s.session_id()));
    absl::Status st;
    for (size_t i = 1; i + 1 < bad.size() && st.ok(); ++i) st = w->Write(bad[i].layer());
    auto c = w->Commit();
    ASSERT_FALSE(c.ok());
    EXPECT_EQ((st.ok() ? c.status() : st).code(), absl::StatusCode::kInvalidArgument);
  }
  // A writer dropped without commit discards its stream too.
  {
    KV_ASSERT_OK_AND_ASSIGN(w, u->StartIngest(s.session_id()));
    KV_ASSERT_OK(w->Write(msgs[1].layer()));
  }
  // Nothing of the failed streams is left: the session ingests afresh, over UCX.
  KV_ASSERT_OK_AND_ASSIGN(ok, u->Ingest(msgs));
  EXPECT_EQ(ok.tokens(), 1024u);
  EXPECT_EQ(u->ucx_fallbacks(), 0u);
}

TEST(UcxIngestErrors, PayloadOverTheDaemonLimitIsRefusedNotDropped) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self", "limits:\n  max_message_bytes: 1MiB\n")}));
  auto u = server.Connect(UcxClientOptions("tcp,self"));
  const synthetic::Document doc(SmallDoc(8192));
  KV_ASSERT_OK_AND_ASSIGN(s, u->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  auto msgs = IngestMessages(doc, s.session_id(), 8192);  // 2 MiB parts
  auto r = u->Ingest(msgs);
  ASSERT_TRUE(u->ucx_connected());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
}

TEST(UcxConcurrency, SixtyFourClientsEqualASequentialGrpcClient) {
  // 64 clients, each its own UCX connection and attachment, select and attend at once
  // (half of them through the async calls); a gRPC client then replays every client's
  // calls on twin attachments, one after another. Every result must match.
  constexpr int kClients = 64, kSteps = 2;
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start(
      {"-c", UcxConfig(dir, "tcp,self", "limits:\n  max_attachments_per_session: 256\n")}));
  auto g = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*g, doc, ShadowProfile(), -1));
  const int L = doc.spec().layers;

  struct Result {
    absl::Status status;
    std::vector<std::string> outputs;  // per (step, layer): select then attend
    bool connected = false;
  };
  std::vector<Result> results(kClients);
  std::vector<std::thread> threads;
  std::mutex mu;
  std::condition_variable cv;
  int ready = 0;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      Result& res = results[i];
      client::ClientOptions o = UcxClientOptions("tcp,self");
      o.target = server.target();
      auto c = client::Client::Connect(o);
      absl::StatusOr<v1::AttachResponse> att = absl::UnknownError("not attached");
      if (!c.ok()) {
        att = c.status();
      } else {
        v1::AttachRequest ar;
        ar.set_session_id(created.session_id());
        ar.set_worker_id("w" + std::to_string(i));
        att = (*c)->Attach(ar);
        res.connected = (*c)->ucx_connected();
      }
      {
        // Start the calls together (every thread gets here, failed or not).
        std::unique_lock<std::mutex> lock(mu);
        ++ready;
        cv.notify_all();
        cv.wait(lock, [&] { return ready == kClients; });
      }
      if (!att.ok()) {
        res.status = att.status();
        return;
      }
      const std::string id = att->attachment_id();
      for (int step = 0; step < kSteps; ++step) {
        for (int l = 0; l < L; ++l) {
          const auto sel = MakeSelect(doc, l, {id}, i % 4, step, 512);
          const auto att_req = MakeAttend(doc, l, {id}, i % 4, step, 512);
          absl::StatusOr<v1::SelectAndReconstructResponse> s;
          absl::StatusOr<v1::AttendResponse> a;
          if (i % 2 == 0) {
            s = (*c)->SelectAndReconstruct(sel);
            a = (*c)->Attend(att_req);
          } else {
            auto fs = (*c)->SelectAndReconstructAsync(sel);
            auto fa = (*c)->AttendAsync(att_req);
            s = fs.get();
            a = fa.get();
          }
          if (!s.ok() || !a.ok()) {
            res.status = !s.ok() ? s.status() : a.status();
            return;
          }
          res.outputs.push_back(Canonical(*s));
          res.outputs.push_back(a->SerializeAsString());
        }
      }
      if ((*c)->ucx_fallbacks() != 0) res.status = absl::InternalError("fell back to gRPC");
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) {
    KV_ASSERT_OK(results[i].status);
    ASSERT_TRUE(results[i].connected) << "client " << i;
    v1::AttachRequest ar;
    ar.set_session_id(created.session_id());
    KV_ASSERT_OK_AND_ASSIGN(twin, g->Attach(ar));
    size_t k = 0;
    for (int step = 0; step < kSteps; ++step) {
      for (int l = 0; l < L; ++l) {
        KV_ASSERT_OK_AND_ASSIGN(s, g->SelectAndReconstruct(MakeSelect(doc, l, {twin.attachment_id()}, i % 4, step, 512)));
        KV_ASSERT_OK_AND_ASSIGN(a, g->Attend(MakeAttend(doc, l, {twin.attachment_id()}, i % 4, step, 512)));
        ASSERT_EQ(results[i].outputs.at(k++), Canonical(s)) << "client " << i << " step " << step << " layer " << l;
        ASSERT_EQ(results[i].outputs.at(k++), a.SerializeAsString()) << "client " << i;
      }
    }
  }
}

}  // namespace
}  // namespace ucx_calls_test
}  // namespace kvshade::integration

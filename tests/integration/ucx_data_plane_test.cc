// Integration: the UCX data plane against the real kvshade-server on loopback (UCX_TLS
// tcp,self and shm,self). SelectAndReconstruct over UCX must equal the gRPC inline call
// bit for bit; the admission token is one-time and enforced for every message id; a
// client whose daemon has no data plane falls back to gRPC loudly (counted), never
// silently; a client vanishing mid-ingest leaves no partial segment. RMA delivery:
// ucx_rma_test.cc; append, attend, pipelined ingest and 64 clients: ucx_calls_test.cc.
#include <fstream>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"
#include "kvshade/client/ucx_data_plane.h"
#include "kvshade/transport/decode_frame.h"
#include "kvshade/transport/ucx_core.h"

namespace kvshade::integration {
namespace ucx_data_plane_test {
namespace {

// Writes a config enabling the data plane with `transports`; returns its path.
// A delta without its attachment id (the two transports use different attachments).
std::string Canonical(v1::SelectAndReconstructResponse r) {
  for (auto& d : *r.mutable_deltas()) d.clear_attachment_id();
  std::string out;
  EXPECT_TRUE(r.SerializeToString(&out));
  return out;
}

class UcxDataPlaneTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxDataPlaneTest, SelectOverUcxEqualsGrpcInlineBitForBit) {
  TempDir dir;
  ServerProcess server;
  // Batches of one run on the progress thread, batches of two on the engine threads: both
  // paths are compared.
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam(), "  inline_max_batch: 1\n")}));
  auto grpc_client = server.Connect();
  client::ClientOptions uo = UcxClientOptions(GetParam());
  auto ucx_client = server.Connect(uo);
  ASSERT_NE(grpc_client, nullptr);
  ASSERT_NE(ucx_client, nullptr);

  const synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*grpc_client, doc, ShadowProfile(), -1));
  auto attach = [&](client::Client& c, const std::string& worker) -> std::string {
    v1::AttachRequest ar;
    ar.set_session_id(created.session_id());
    ar.set_worker_id(worker);
    auto a = c.Attach(ar);
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return "";
    EXPECT_FALSE(a->data_plane_address().empty());
    EXPECT_FALSE(a->data_plane_token().empty());
    return a->attachment_id();
  };
  // Two attachments per transport: batches of one and of two queries.
  const std::string g1 = attach(*grpc_client, "g1"), g2 = attach(*grpc_client, "g2");
  const std::string u1 = attach(*ucx_client, "u1"), u2 = attach(*ucx_client, "u2");
  ASSERT_TRUE(ucx_client->ucx_connected());
  EXPECT_FALSE(grpc_client->ucx_connected());

  const int L = doc.spec().layers;
  int with_keys = 0;
  for (int step = 0; step < 4; ++step) {
    for (int l = 0; l < L; ++l) {
      KV_ASSERT_OK_AND_ASSIGN(rg, grpc_client->SelectAndReconstruct(MakeSelect(doc, l, {g1}, 0, step, 1024)));
      KV_ASSERT_OK_AND_ASSIGN(ru, ucx_client->SelectAndReconstruct(MakeSelect(doc, l, {u1}, 0, step, 1024)));
      ASSERT_EQ(ru.deltas_size(), 1);
      EXPECT_EQ(ru.deltas(0).attachment_id(), u1);
      ASSERT_EQ(Canonical(rg), Canonical(ru)) << "layer " << l << " step " << step;
      if (ru.deltas(0).keys().data().size() > 0) ++with_keys;

      KV_ASSERT_OK_AND_ASSIGN(bg, grpc_client->SelectAndReconstruct(MakeSelect(doc, l, {g2, g1}, 1, step, 1024)));
      KV_ASSERT_OK_AND_ASSIGN(bu, ucx_client->SelectAndReconstruct(MakeSelect(doc, l, {u2, u1}, 1, step, 1024)));
      ASSERT_EQ(bu.deltas_size(), 2);
      ASSERT_EQ(Canonical(bg), Canonical(bu)) << "batch, layer " << l << " step " << step;
    }
  }
  EXPECT_GT(with_keys, 0) << "no call moved K/V; the comparison would be vacuous";
  // Errors travel too: an unknown attachment is NOT_FOUND on both transports, and a UCX
  // error is not a transport failure (no fallback).
  auto eg = grpc_client->SelectAndReconstruct(MakeSelect(doc, 0, {"no-such-attachment"}, 0, 0, 1024));
  auto eu = ucx_client->SelectAndReconstruct(MakeSelect(doc, 0, {"no-such-attachment"}, 0, 0, 1024));
  ASSERT_FALSE(eg.ok());
  ASSERT_FALSE(eu.ok());
  EXPECT_EQ(eg.status().code(), eu.status().code()) << eg.status() << " vs " << eu.status();
  EXPECT_EQ(ucx_client->ucx_fallbacks(), 0u);
  EXPECT_TRUE(ucx_client->ucx_connected());
}

TEST_P(UcxDataPlaneTest, AdmissionTokenIsOneTimeAndEnforced) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  client::UcxOptions o;
  o.transports = GetParam();
  o.timeout = absl::Seconds(20);
  const auto sel = MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 512);

  // A made-up token is refused.
  auto bad = client::UcxDataPlane::Connect(att.data_plane_address(), "not-a-token-0123", o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kPermissionDenied) << bad.status();

  // The real token admits once ...
  KV_ASSERT_OK_AND_ASSIGN(dp, client::UcxDataPlane::Connect(att.data_plane_address(),
                                                            att.data_plane_token(), o));
  KV_ASSERT_OK(dp->SelectAndReconstruct(sel).status());
  // ... and never again.
  auto again = client::UcxDataPlane::Connect(att.data_plane_address(), att.data_plane_token(), o);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kPermissionDenied) << again.status();

  // An endpoint that never said HELLO, or guesses a key, never reaches the engine, with
  // any message id (the payloads would be valid requests).
  KV_ASSERT_OK_AND_ASSIGN(raw, client::UcxDataPlane::ConnectWithoutHello(att.data_plane_address(), o));
  v1::AttendRequest attend;
  attend.set_layer(0);
  *attend.add_queries()->mutable_q() = sel.queries(0).q();
  attend.mutable_queries(0)->set_attachment_id(att.attachment_id());
  v1::UcxSlotBuffers bufs;
  bufs.set_attachment_id(att.attachment_id());
  const std::vector<std::pair<unsigned, std::string>> requests = {
      {transport::ucx::kAppend, ""},
      {transport::ucx::kIngest, ""},
      {transport::ucx::kRegister, bufs.SerializeAsString()},
      {transport::ucx::kUnregister, bufs.SerializeAsString()}};
  std::string select_body, attend_body;
  {
    const auto& q = sel.queries(0);
    transport::frame::QueryRef ref;
    ref.attachment_id = q.attachment_id();
    ref.q = {static_cast<uint8_t>(q.q().dtype()), static_cast<uint32_t>(q.q().shape(0)),
             static_cast<uint32_t>(q.q().shape(1)), q.q().data()};
    transport::frame::AppendQuery(ref, &select_body);
    transport::frame::AppendQuery(ref, &attend_body);
  }
  // The frames are valid: the admitted client gets answers to them.
  KV_ASSERT_OK(dp->RawAdmittedFrameRequest(transport::frame::kSelect, 0, 1, select_body).status());
  KV_ASSERT_OK(dp->RawAdmittedFrameRequest(transport::frame::kAttend, 0, 1, attend_body).status());
  for (const std::string& key : {std::string(), std::string(16, 'x')}) {
    for (const auto& [id, payload] : requests) {
      auto r = raw->RawRequest(id, key, payload);
      ASSERT_FALSE(r.ok()) << "message " << id;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << "message " << id << ": " << r.status();
    }
    for (auto [kind, body] : {std::pair{transport::frame::kSelect, select_body},
                              std::pair{transport::frame::kAttend, attend_body}}) {
      auto r = raw->RawFrameRequest(kind, key, 0, 1, body);
      ASSERT_FALSE(r.ok()) << "frame " << kind;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied) << "frame " << kind << ": " << r.status();
    }
  }
  // The admitted client still works, and so does gRPC.
  KV_ASSERT_OK(dp->SelectAndReconstruct(sel).status());
  KV_ASSERT_OK(c->SelectAndReconstruct(sel).status());
  dp.reset();
}

// Malformed binary frames from an admitted client get INVALID_ARGUMENT (or the limit's
// code) naming what is wrong, and harm neither that connection nor the session.
TEST_P(UcxDataPlaneTest, MalformedFramesAreRefusedAndHarmNothing) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  client::UcxOptions o;
  o.transports = GetParam();
  o.timeout = absl::Seconds(20);
  KV_ASSERT_OK_AND_ASSIGN(dp, client::UcxDataPlane::Connect(att.data_plane_address(),
                                                            att.data_plane_token(), o));
  const auto sel = MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 512);
  const v1::Tensor& q = sel.queries(0).q();
  auto body_of = [&](uint8_t dtype, uint32_t rows, uint32_t cols, std::string_view data) {
    transport::frame::QueryRef ref;
    ref.attachment_id = att.attachment_id();
    ref.q = {dtype, rows, cols, data};
    std::string b;
    transport::frame::AppendQuery(ref, &b);
    return b;
  };
  const uint32_t hq = static_cast<uint32_t>(q.shape(0)), d = static_cast<uint32_t>(q.shape(1));
  const std::string good = body_of(1, hq, d, q.data());
  auto repeated = [](const std::string& entry, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += entry;
    return out;
  };
  KV_ASSERT_OK_AND_ASSIGN(first, dp->SelectAndReconstruct(sel));
  struct Bad {
    std::string what;
    uint32_t count;
    std::string body;
    absl::StatusCode code;
    std::string needle;
  };
  const std::vector<Bad> bad = {
      {"truncated", 1, good.substr(0, good.size() - 3), absl::StatusCode::kInvalidArgument, "q needs"},
      {"count over the entries", 2, good, absl::StatusCode::kInvalidArgument, "entry 1"},
      {"trailing bytes", 1, good + "xyz", absl::StatusCode::kInvalidArgument, "bytes after the last"},
      {"unknown dtype", 1, body_of(9, hq, d, q.data()), absl::StatusCode::kInvalidArgument, "unknown dtype 9"},
      {"wrong shape", 1, body_of(1, hq / 2, d * 2, q.data()), absl::StatusCode::kInvalidArgument,
       "queries[0].q.shape"},
      {"wrong dtype", 1, body_of(3, hq / 2, d, q.data()), absl::StatusCode::kInvalidArgument,
       "queries[0].q.dtype"},
      {"a count the payload cannot hold", 100000, good, absl::StatusCode::kInvalidArgument,
       "queries cannot fit"},
      {"over max_batch", 300, repeated(good, 300), absl::StatusCode::kInvalidArgument,
       "over the limit max_batch = 256"},
  };
  for (const Bad& b : bad) {
    for (auto kind : {transport::frame::kSelect, transport::frame::kAttend}) {
      auto r = dp->RawAdmittedFrameRequest(kind, 0, b.count, b.body);
      ASSERT_FALSE(r.ok()) << b.what;
      EXPECT_EQ(r.status().code(), b.code) << b.what << ": " << r.status();
      EXPECT_NE(std::string(r.status().message()).find(b.needle), std::string::npos)
          << b.what << ": " << r.status();
    }
  }
  // A layer out of range is the engine's INVALID_ARGUMENT, as over gRPC.
  auto layer = dp->RawAdmittedFrameRequest(transport::frame::kSelect, 1000, 1, good);
  ASSERT_FALSE(layer.ok());
  EXPECT_EQ(layer.status().code(), absl::StatusCode::kInvalidArgument) << layer.status();
  // The connection and the session are fine: the same step again hits every chunk the
  // first call delivered, over UCX and over gRPC alike.
  KV_ASSERT_OK_AND_ASSIGN(again, dp->SelectAndReconstruct(sel));
  ASSERT_EQ(again.deltas_size(), 1);
  EXPECT_EQ(again.deltas(0).hits(), again.deltas(0).selected());
  EXPECT_EQ(again.deltas(0).selected(), first.deltas(0).selected());
  KV_ASSERT_OK(c->SelectAndReconstruct(sel).status());
  dp.reset();
}

// The whole Ingest stream of `doc` for `session_id`: header, one part per layer (the
// first layer in two parts), commit.
std::vector<v1::IngestRequest> IngestMessages(const synthetic::Document& doc,
                                              const std::string& session_id) {
  std::vector<v1::IngestRequest> msgs(1);
  msgs[0].mutable_header()->set_session_id(session_id);
  const auto& sp = doc.spec();
  const int64_t n = static_cast<int64_t>(doc.tokens().size());
  for (int l = 0; l < sp.layers; ++l) {
    const std::vector<int64_t> cuts = l == 0 ? std::vector<int64_t>{0, n / 2, n}
                                             : std::vector<int64_t>{0, n};
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      std::vector<uint16_t> k, v;
      doc.KeysValues(l, -1, cuts[c], cuts[c + 1], &k, &v);
      v1::IngestRequest m;
      auto* part = m.mutable_layer();
      part->set_layer(l);
      part->set_token_offset(cuts[c]);
      part->set_last_part(c + 2 == cuts.size());
      const int64_t len = cuts[c + 1] - cuts[c];
      *part->mutable_k() = client::MakeBf16Tensor({len, sp.kv_heads, sp.head_dim}, absl::MakeConstSpan(k));
      *part->mutable_v() = client::MakeBf16Tensor({len, sp.kv_heads, sp.head_dim}, absl::MakeConstSpan(v));
      msgs.push_back(std::move(m));
    }
  }
  msgs.emplace_back().mutable_commit();
  return msgs;
}

// Connects a UcxDataPlane through a fresh attachment of `session_id`.
absl::StatusOr<std::unique_ptr<client::UcxDataPlane>> DataPlaneFor(client::Client& c,
                                                                   const std::string& session_id,
                                                                   const std::string& transports) {
  v1::AttachRequest ar;
  ar.set_session_id(session_id);
  ar.set_worker_id("ingest");
  auto att = c.Attach(ar);
  if (!att.ok()) return att.status();
  client::UcxOptions o;
  o.transports = transports;
  o.timeout = absl::Seconds(30);
  return client::UcxDataPlane::Connect(att->data_plane_address(), att->data_plane_token(), o);
}

TEST_P(UcxDataPlaneTest, IngestOverUcxEqualsGrpcIngest) {
  // The same document ingested over UCX (daemon A) and over gRPC (daemon B) gives the same
  // ingest response and the same selections afterwards.
  TempDir dir;
  ServerProcess a, b;
  KV_ASSERT_OK(a.Start({"-c", UcxConfig(dir, GetParam())}));
  KV_ASSERT_OK(b.Start({"-c", UcxConfig(dir, GetParam())}));
  auto ca = a.Connect();
  auto cb = b.Connect();
  const synthetic::Document doc(SmallDoc(1024));
  const v1::CreateSessionRequest create = synthetic::MakeCreate(doc, ShadowProfile(), -1);
  KV_ASSERT_OK_AND_ASSIGN(sa, ca->CreateSession(create));
  KV_ASSERT_OK_AND_ASSIGN(sb, cb->CreateSession(create));
  KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneFor(*ca, sa.session_id(), GetParam()));
  const auto ma = IngestMessages(doc, sa.session_id());
  const auto mb = IngestMessages(doc, sb.session_id());
  KV_ASSERT_OK_AND_ASSIGN(ra, dp->Ingest(ma));
  KV_ASSERT_OK_AND_ASSIGN(rb, cb->Ingest(mb));
  EXPECT_EQ(ra.SerializeAsString(), rb.SerializeAsString());
  EXPECT_EQ(ra.tokens(), 1024u);
  // Committed once: a second stream over UCX on the same session is refused by the engine.
  auto again = dp->Ingest(ma);
  EXPECT_FALSE(again.ok());

  v1::AttachRequest ar;
  ar.set_worker_id("w");
  ar.set_session_id(sa.session_id());
  KV_ASSERT_OK_AND_ASSIGN(wa, ca->Attach(ar));
  ar.set_session_id(sb.session_id());
  KV_ASSERT_OK_AND_ASSIGN(wb, cb->Attach(ar));
  for (int l = 0; l < doc.spec().layers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(xa, ca->SelectAndReconstruct(MakeSelect(doc, l, {wa.attachment_id()}, 0, 0, 1024)));
    KV_ASSERT_OK_AND_ASSIGN(xb, cb->SelectAndReconstruct(MakeSelect(doc, l, {wb.attachment_id()}, 0, 0, 1024)));
    ASSERT_EQ(Canonical(xa), Canonical(xb)) << "layer " << l;
  }
}

// kvshade_ucx_receive_pool_misses_total of a daemon, or -1 when the series is missing.
double PoolMisses(const ServerProcess& server) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return -1;
  const std::string name = "\nkvshade_ucx_receive_pool_misses_total ";
  const size_t at = body->find(name);
  return at == std::string::npos ? -1 : std::stod(body->substr(at + name.size()));
}

TEST_P(UcxDataPlaneTest, IngestPartsGiveTheSameSessionInPoolBuffersOrOutside) {
  // Ingest parts land in the daemon's receive pool, or, when none fits (one buffer of 64 KiB,
  // parts of 128-256 KiB here) or none is free, in allocations of their own; both give the
  // session gRPC ingest gives, and the misses are counted.
  TempDir dir, dir_small;
  ServerProcess pooled, unpooled, grpc;
  KV_ASSERT_OK(pooled.Start({"-c", UcxConfig(dir, GetParam())}));
  KV_ASSERT_OK(unpooled.Start(
      {"-c", UcxConfig(dir_small, GetParam(), "  receive_buffers: 1\n  receive_buffer_bytes: 64KiB\n")}));
  KV_ASSERT_OK(grpc.Start({}));
  const synthetic::Document doc(SmallDoc(1024));
  const v1::CreateSessionRequest create = synthetic::MakeCreate(doc, ShadowProfile(), -1);
  std::vector<std::string> replies;
  std::vector<std::vector<std::string>> selections;
  for (ServerProcess* server : {&pooled, &unpooled, &grpc}) {
    auto c = server->Connect();
    KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(create));
    const auto msgs = IngestMessages(doc, created.session_id());
    if (server == &grpc) {
      KV_ASSERT_OK_AND_ASSIGN(r, c->Ingest(msgs));
      replies.push_back(r.SerializeAsString());
    } else {
      KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneFor(*c, created.session_id(), GetParam()));
      KV_ASSERT_OK_AND_ASSIGN(r, dp->Ingest(msgs));
      replies.push_back(r.SerializeAsString());
    }
    v1::AttachRequest ar;
    ar.set_worker_id("w");
    ar.set_session_id(created.session_id());
    KV_ASSERT_OK_AND_ASSIGN(w, c->Attach(ar));
    selections.emplace_back();
    for (int l = 0; l < doc.spec().layers; ++l) {
      KV_ASSERT_OK_AND_ASSIGN(x, c->SelectAndReconstruct(MakeSelect(doc, l, {w.attachment_id()}, 0, 0, 1024)));
      selections.back().push_back(Canonical(x));
    }
  }
  EXPECT_EQ(replies[0], replies[2]);
  EXPECT_EQ(replies[1], replies[2]);
  EXPECT_EQ(selections[0], selections[2]);
  EXPECT_EQ(selections[1], selections[2]);
  EXPECT_EQ(PoolMisses(pooled), 0);
  // Every layer part of the stream was larger than the small daemon's one buffer.
  size_t parts = 0;
  for (const auto& m : IngestMessages(doc, "x")) parts += m.has_layer() ? 1 : 0;
  ASSERT_GT(parts, 0u);
  EXPECT_EQ(PoolMisses(unpooled), static_cast<double>(parts));
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxDataPlaneTest,
                         ::testing::Values(std::string("tcp,self"), std::string("shm,self")),
                         [](const auto& info) {
                           return info.param == "tcp,self" ? std::string("Tcp") : std::string("Shm");
                         });

TEST(UcxFallback, NoDataPlaneFallsBackToGrpcLoudlyAndCounts) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));  // ucx.enable off
  client::ClientOptions uo = UcxClientOptions("tcp,self");
  auto c = server.Connect(uo);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  EXPECT_TRUE(att.data_plane_address().empty());
  EXPECT_TRUE(att.data_plane_token().empty());
  EXPECT_FALSE(c->ucx_connected());
  EXPECT_EQ(c->ucx_fallbacks(), 1u);
  KV_ASSERT_OK(c->SelectAndReconstruct(MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 512)).status());
}

TEST(UcxFallback, DaemonGoneFailsOverToGrpcErrorNotHang) {
  // The data plane dies with its daemon: the next call notices the dead endpoint, counts a
  // fallback and tries gRPC (which, the daemon being gone, reports UNAVAILABLE).
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self")}));
  client::ClientOptions uo = UcxClientOptions("tcp,self");
  uo.timeout = absl::Seconds(20);
  auto c = server.Connect(uo);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  ASSERT_TRUE(c->ucx_connected());
  const auto sel = MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 512);
  KV_ASSERT_OK(c->SelectAndReconstruct(sel).status());
  server.Kill9();
  auto r = c->SelectAndReconstruct(sel);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(c->ucx_fallbacks(), 1u) << r.status();
  EXPECT_FALSE(c->ucx_connected());
}

TEST(UcxIngest, ClientVanishingMidIngestLeavesNoPartialSegment) {
  // tcp only: UCX 1.13's shm transports cannot notice a vanished peer.
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self")}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(synthetic::MakeCreate(doc, ShadowProfile(), -1)));
  const std::string sid = created.session_id();
  const auto msgs = IngestMessages(doc, sid);
  {
    KV_ASSERT_OK_AND_ASSIGN(dp, DataPlaneFor(*c, sid, "tcp,self"));
    KV_ASSERT_OK(dp->IngestMessage(msgs[0]).status());  // header
    KV_ASSERT_OK(dp->IngestMessage(msgs[1]).status());  // half of layer 0
    // The stream is open: a gRPC ingest of the same session is refused meanwhile.
    auto busy = c->Ingest(msgs);
    ASSERT_FALSE(busy.ok());
    EXPECT_NE(busy.status().message().find("in progress"), std::string::npos) << busy.status();
    dp->AbandonForTest();  // no BYE: the client just goes away
  }
  // Nothing of the abandoned stream is visible.
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.tokens(), 0u);
  EXPECT_EQ(info.layers_ingested(), 0u);
  // The daemon notices the vanished endpoint and discards the stream; the session can
  // then be ingested afresh (poll with a deadline: detection is asynchronous).
  absl::StatusOr<v1::IngestResponse> r = absl::UnknownError("not tried");
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    r = c->Ingest(msgs);
    if (r.ok() || r.status().message().find("in progress") == std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  KV_ASSERT_OK(r.status());
  EXPECT_EQ(r->tokens(), 512u);
}

TEST(UcxCore, RegisteredMemoryTakesAnRmaPutThroughRaiiHandles) {
  // Two workers in this process over tcp: A puts into B's registered buffer with B's
  // packed rkey; every handle is an RAII owner released on its worker's thread.
  namespace ucx = transport::ucx;
  KV_ASSERT_OK_AND_ASSIGN(a, ucx::UcxLoop::Start("tcp,self", {}));
  KV_ASSERT_OK_AND_ASSIGN(b, ucx::UcxLoop::Start("tcp,self", {}));
  std::vector<uint8_t> target(4096, 0), source(4096);
  for (size_t i = 0; i < source.size(); ++i) source[i] = static_cast<uint8_t>(i * 7 + 3);
  // B's handles are made and released on B's thread (the context is not shared-safe).
  std::unique_ptr<ucx::UcxMemHandle> memh;
  std::string packed;
  KV_ASSERT_OK(b->CallStatus([&]() -> absl::Status {
    auto m = ucx::UcxMemHandle::Map(b->context(), target.data(), target.size());
    if (!m.ok()) return m.status();
    memh = *std::move(m);
    auto pk = memh->PackRkey();
    if (!pk.ok()) return pk.status();
    packed = *std::move(pk);
    return absl::OkStatus();
  }));
  const std::string b_addr = b->address();
  KV_ASSERT_OK(a->CallStatus([&]() -> absl::Status {
    auto ep = ucx::UcxEndpoint::Connect(a->worker(), b_addr);
    if (!ep.ok()) return ep.status();
    auto rkey = ucx::UcxRemoteKey::Unpack(**ep, packed);
    if (!rkey.ok()) return rkey.status();
    ucp_request_param_t p{};
    absl::Status st = ucx::WaitRequest(
        a->worker().get(),
        ucp_put_nbx((*ep)->get(), source.data(), source.size(), memh->address(), (*rkey)->get(), &p),
        "ucp_put_nbx");
    if (!st.ok()) return st;
    return ucx::WaitRequest(a->worker().get(), ucp_ep_flush_nbx((*ep)->get(), &p), "ucp_ep_flush_nbx");
  }));
  EXPECT_EQ(target, source);
  // Bad input is a Status, not a crash.
  KV_ASSERT_OK(b->CallStatus([&]() -> absl::Status {
    EXPECT_EQ(ucx::UcxMemHandle::Map(b->context(), nullptr, 0).status().code(),
              absl::StatusCode::kInvalidArgument);
    memh.reset();
    return absl::OkStatus();
  }));
  EXPECT_EQ(ucx::DecodeWorkerAddress("garbage").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ucx_data_plane_test
}  // namespace kvshade::integration

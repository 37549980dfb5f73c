// Integration: every RPC of kvshade.v1.KvShade against the real kvshade-server binary,
// plus grpc.health.v1, server reflection, /metrics, graceful SIGTERM, and a table of
// malformed requests with the gRPC code each must get (and proof that none of them
// disturbed a healthy session).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>
#include <thread>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"

namespace kvshade::integration {
namespace rpc_test {
namespace {

using client::MakeBf16Tensor;

// Raw bytes of the first ServerReflectionResponse to list_services (hand-encoded request:
// field 7 "list_services", empty string), over the v1alpha reflection service.
std::string ReflectionListServices(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  if (!cq.Next(&tag, &ok) || !ok) return "";
  const std::string req("\x3a\x00", 2);
  grpc::Slice slice(req);
  grpc::ByteBuffer buf(&slice, 1);
  call->Write(buf, reinterpret_cast<void*>(2));
  if (!cq.Next(&tag, &ok) || !ok) return "";
  call->WritesDone(reinterpret_cast<void*>(3));
  cq.Next(&tag, &ok);
  grpc::ByteBuffer resp;
  call->Read(&resp, reinterpret_cast<void*>(4));
  std::string out;
  if (cq.Next(&tag, &ok) && ok) {
    std::vector<grpc::Slice> slices;
    if (resp.Dump(&slices).ok()) {
      for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(5));
  cq.Next(&tag, &ok);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return out;
}

TEST(Rpc, EveryRpcHealthReflectionMetricsAndCleanShutdown) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);

  // Health, for the server and for the service by name.
  KV_ASSERT_OK_AND_ASSIGN(h_all, c->CheckHealth());
  EXPECT_EQ(h_all, client::HealthStatus::kServing);
  KV_ASSERT_OK_AND_ASSIGN(h_svc, c->CheckHealth("kvshade.v1.KvShade"));
  EXPECT_EQ(h_svc, client::HealthStatus::kServing);
  // Reflection lists our service (grpcurl relies on this).
  const std::string services = ReflectionListServices(c->channel());
  EXPECT_NE(services.find("kvshade.v1.KvShade"), std::string::npos) << "reflection answer: " << services.size()
                                                                     << " bytes";

  const synthetic::Document doc(SmallDoc(1024));
  const v1::Profile profile = ShadowProfile();
  const int h = doc.spec().kv_heads, hq = doc.spec().q_heads, d = doc.spec().head_dim;

  // LookupPrefix before anything is cached.
  v1::LookupPrefixRequest lookup;
  *lookup.mutable_model() = doc.Model();
  *lookup.mutable_profile() = profile;
  lookup.mutable_token_ids()->Assign(doc.tokens().begin(), doc.tokens().end());
  KV_ASSERT_OK_AND_ASSIGN(l0, c->LookupPrefix(lookup));
  EXPECT_EQ(l0.reusable_tokens(), 0u);

  // CreateSession + Ingest.
  KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
  EXPECT_FALSE(created.session_id().empty());
  EXPECT_EQ(created.reused_tokens(), 0u);
  EXPECT_EQ(created.tokens_to_ingest(), 1024u);
  EXPECT_EQ(created.effective_profile(), v1::PROFILE_KIND_SHADOW);
  KV_ASSERT_OK_AND_ASSIGN(before, c->GetSession(created.session_id()));
  EXPECT_EQ(before.state(), "ingesting");
  KV_ASSERT_OK_AND_ASSIGN(ing, synthetic::IngestRange(*c, doc, created.session_id(), -1, 0, 1024));
  EXPECT_EQ(ing.response.tokens(), 1024u);
  ASSERT_EQ(ing.response.captured_energy_size(), doc.spec().layers);
  for (float e : ing.response.captured_energy()) {
    EXPECT_GT(e, 0.5f);
    EXPECT_LE(e, 1.0f + 1e-5f);
  }

  // GetSession / ListSessions.
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(created.session_id()));
  EXPECT_EQ(info.state(), "ready");
  EXPECT_EQ(info.tokens(), 1024u);
  EXPECT_EQ(info.layers_ingested(), static_cast<uint32_t>(doc.spec().layers));
  EXPECT_EQ(info.model_id(), doc.spec().model_id);
  EXPECT_EQ(info.profile(), v1::PROFILE_KIND_SHADOW);
  // (gpu_bytes/host_bytes count a session's own, unshared segments; the document's segment
  // is a shared prefix once committed, so they are not checked here: Stats is, below.)
  KV_ASSERT_OK_AND_ASSIGN(list, c->ListSessions());
  bool listed = false;
  for (const auto& s : list.sessions()) listed |= s.session_id() == created.session_id();
  EXPECT_TRUE(listed);

  // LookupPrefix now finds the document.
  KV_ASSERT_OK_AND_ASSIGN(l1, c->LookupPrefix(lookup));
  EXPECT_EQ(l1.reusable_tokens(), 1024u);
  EXPECT_GE(l1.cached_segments(), 1u);

  // ForkSession at the end of the committed tokens.
  KV_ASSERT_OK_AND_ASSIGN(fork, c->ForkSession(created.session_id(), 1024));
  EXPECT_EQ(fork.shared_tokens(), 1024u);
  EXPECT_NE(fork.session_id(), created.session_id());

  // Attach as the writer of the fork.
  v1::AttachRequest ar;
  ar.set_session_id(fork.session_id());
  ar.set_worker_id("it-worker");
  ar.set_writer(true);
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  EXPECT_FALSE(att.attachment_id().empty());
  EXPECT_EQ(att.chunk_size(), 8u);
  EXPECT_EQ(att.slots_per_head(), 8u);
  EXPECT_TRUE(att.writer());
  const int64_t now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  EXPECT_GT(static_cast<int64_t>(att.lease_expires_unix_ms()), now_ms);

  // GetStaticSet: [h, s_max, d] keys and values, lengths per head, the exact tail.
  KV_ASSERT_OK_AND_ASSIGN(st, c->GetStaticSet(att.attachment_id(), 0));
  ASSERT_EQ(st.k().shape_size(), 3);
  EXPECT_EQ(st.k().shape(0), h);
  EXPECT_EQ(st.k().shape(2), d);
  ASSERT_EQ(st.lengths_size(), h);
  for (uint32_t len : st.lengths()) EXPECT_GE(len, 8u);  // at least the sink chunk
  ASSERT_EQ(st.tail_k().shape_size(), 3);
  EXPECT_GE(st.tail_k().shape(0), 32);
  EXPECT_EQ(st.tail_k().shape(1), h);

  // SelectAndReconstruct: first call misses everything, the same query again hits all.
  const auto sel = MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 1024);
  KV_ASSERT_OK_AND_ASSIGN(r1, c->SelectAndReconstruct(sel));
  ASSERT_EQ(r1.deltas_size(), 1);
  const auto& d1 = r1.deltas(0);
  EXPECT_EQ(d1.attachment_id(), att.attachment_id());
  EXPECT_EQ(d1.selected(), static_cast<uint32_t>(h * 8));
  EXPECT_EQ(d1.hits(), 0u);
  const int m = d1.chunk_size();
  EXPECT_EQ(m, h * 8);
  EXPECT_EQ(d1.head_size(), m);
  EXPECT_EQ(d1.slot_size(), m);
  ASSERT_EQ(d1.keys().shape_size(), 3);
  EXPECT_EQ(d1.keys().shape(0), m);
  EXPECT_EQ(d1.keys().shape(1), 8);
  EXPECT_EQ(d1.keys().shape(2), d);
  EXPECT_EQ(d1.keys().data().size(), static_cast<size_t>(m) * 8 * d * 2);
  EXPECT_EQ(d1.values().data().size(), static_cast<size_t>(m) * 8 * d * 2);
  KV_ASSERT_OK_AND_ASSIGN(r2, c->SelectAndReconstruct(sel));
  ASSERT_EQ(r2.deltas_size(), 1);
  EXPECT_EQ(r2.deltas(0).hits(), r2.deltas(0).selected());
  EXPECT_EQ(r2.deltas(0).chunk_size(), 0);

  // Attend: [hq, d] fp32, finite.
  v1::AttendRequest atr;
  atr.set_layer(1);
  auto* aq = atr.add_queries();
  aq->set_attachment_id(att.attachment_id());
  *aq->mutable_q() = MakeBf16Tensor({hq, d}, absl::MakeConstSpan(doc.Query(1, 0, 0, 1024)));
  KV_ASSERT_OK_AND_ASSIGN(ao, c->Attend(atr));
  ASSERT_EQ(ao.outputs_size(), 1);
  KV_ASSERT_OK_AND_ASSIGN(out, client::TensorToFloats(ao.outputs(0)));
  ASSERT_EQ(out.size(), static_cast<size_t>(hq * d));
  for (float x : out) ASSERT_TRUE(std::isfinite(x));

  // AppendTokens through the writer attachment.
  v1::AppendTokensRequest app = synthetic::MakeAppend(doc, fork.session_id(), 0, 1024, 1032);
  app.set_attachment_id(att.attachment_id());
  KV_ASSERT_OK_AND_ASSIGN(appended, c->AppendTokens(app));
  EXPECT_EQ(appended.tokens(), 1032u);
  KV_ASSERT_OK_AND_ASSIGN(finfo, c->GetSession(fork.session_id()));
  EXPECT_EQ(finfo.tokens(), 1032u);
  EXPECT_EQ(finfo.attachments(), 1u);

  // Stats.
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_EQ(stats.backend(), "cpu");
  EXPECT_FALSE(stats.version().empty());
  EXPECT_GE(stats.sessions(), 2u);
  EXPECT_GE(stats.attachments(), 1u);
  EXPECT_GE(stats.segments(), 1u);
  EXPECT_GE(stats.prefix_lookups(), 2u);
  EXPECT_GE(stats.prefix_hits(), 1u);
  EXPECT_GE(stats.chunks_selected(), static_cast<uint64_t>(2 * h * 8));
  EXPECT_GE(stats.chunk_hits(), static_cast<uint64_t>(h * 8));
  EXPECT_GT(stats.device_bytes_used(), 0u);
  EXPECT_GT(stats.device_bytes_budget(), 0u);

  // Detach; the attachment is gone.
  KV_ASSERT_OK(c->Detach(att.attachment_id()));
  EXPECT_EQ(c->SelectAndReconstruct(sel).status().code(), absl::StatusCode::kNotFound);

  // /metrics carries the documented families with low-cardinality labels.
  KV_ASSERT_OK_AND_ASSIGN(metrics, HttpGet(server.metrics_port(), "/metrics"));
  for (const char* name :
       {"kvshade_rpc_duration_seconds_bucket{method=\"SelectAndReconstruct\"", "kvshade_rpc_total{",
        "kvshade_stage_duration_seconds_bucket{stage=\"select\"", "kvshade_sessions ", "kvshade_attachments ",
        "kvshade_segments ", "kvshade_prefix_lookups_total{reason=\"full\",result=\"hit\"} ",
        "kvshade_prefix_tokens_total{kind=\"reused\"} ", "kvshade_prefix_probes_total{result=\"hit\"} ",
        "kvshade_chunks_selected_total ", "kvshade_chunk_hits_total ",
        "kvshade_captured_energy_ratio_count ", "kvshade_ingested_tokens_total ", "kvshade_tier_bytes{",
        "kvshade_errors_total{code=\"NOT_FOUND\"}"}) {
    EXPECT_NE(metrics.find(name), std::string::npos) << "missing in /metrics: " << name;
  }

  // CloseSession; both are gone.
  KV_ASSERT_OK(c->CloseSession(fork.session_id()));
  KV_ASSERT_OK(c->CloseSession(created.session_id()));
  EXPECT_EQ(c->GetSession(created.session_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c->CloseSession(created.session_id()).code(), absl::StatusCode::kNotFound);

  // SIGTERM: drain and exit 0.
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// --- Malformed requests ------------------------------------------------------------------

struct BadCase {
  std::string name;
  absl::StatusCode expected;
  std::vector<std::string> names;  // what the error message must contain
  std::function<absl::Status()> call;
};

// "[a, b, c]", as the service prints a shape.
std::string Shape(std::initializer_list<int64_t> dims) {
  std::string out = "[";
  for (int64_t x : dims) out += (out.size() > 1 ? ", " : "") + std::to_string(x);
  return out + "]";
}

TEST(Rpc, MalformedRequestsGetTheirCodesAndHarmNoOtherSession) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--max-message-bytes", "1MiB", "--max-batch", "4", "--max-tokens-per-session",
                             "4096", "--max-lease-ms", "60000"}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(1024));
  const v1::Profile profile = ShadowProfile();
  const int h = doc.spec().kv_heads, hq = doc.spec().q_heads, d = doc.spec().head_dim;
  KV_ASSERT_OK_AND_ASSIGN(good, CreateAndIngest(*c, doc, profile, -1));
  const std::string sid = good.session_id();
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("control");
  KV_ASSERT_OK_AND_ASSIGN(control, c->Attach(ar));
  const auto control_sel = MakeSelect(doc, 1, {control.attachment_id()}, 1, 3, 1024);
  KV_ASSERT_OK_AND_ASSIGN(control_before, c->SelectAndReconstruct(control_sel));
  ar.set_worker_id("victim");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  const std::string aid = att.attachment_id();
  // A second session left mid-ingest, for the ingest-order cases.
  KV_ASSERT_OK_AND_ASSIGN(pending, c->CreateSession(synthetic::MakeCreate(doc, profile, 0)));
  ASSERT_GT(pending.tokens_to_ingest(), 0u);

  auto create = [&](std::function<void(v1::CreateSessionRequest&)> edit) {
    return [&c, &doc, &profile, edit]() {
      v1::CreateSessionRequest r = synthetic::MakeCreate(doc, profile, -1);
      r.mutable_token_ids()->Truncate(256);
      edit(r);
      return c->CreateSession(r).status();
    };
  };
  auto select = [&](std::function<void(v1::SelectAndReconstructRequest&)> edit) {
    return [&c, &doc, aid, edit]() {
      v1::SelectAndReconstructRequest r = MakeSelect(doc, 0, {aid}, 0, 0, 1024);
      edit(r);
      return c->SelectAndReconstruct(r).status();
    };
  };
  auto ingest = [&](std::function<void(std::vector<v1::IngestRequest>&)> build) {
    return [&c, build]() {
      std::vector<v1::IngestRequest> msgs;
      build(msgs);
      return c->Ingest(msgs).status();
    };
  };
  auto layer_msg = [&](const std::string& session, uint32_t layer, int64_t n) {
    std::vector<uint16_t> k, v;
    doc.KeysValues(static_cast<int>(layer), 0, 1024, 1024 + n, &k, &v);
    v1::IngestRequest m;
    auto* l = m.mutable_layer();
    l->set_layer(layer);
    l->set_token_offset(0);
    *l->mutable_k() = MakeBf16Tensor({n, h, d}, absl::MakeConstSpan(k));
    *l->mutable_v() = MakeBf16Tensor({n, h, d}, absl::MakeConstSpan(v));
    l->set_last_part(true);
    (void)session;
    return m;
  };
  auto header = [](const std::string& session) {
    v1::IngestRequest m;
    m.mutable_header()->set_session_id(session);
    return m;
  };
  auto commit = []() {
    v1::IngestRequest m;
    m.mutable_commit();
    return m;
  };
  const int64_t pending_n = static_cast<int64_t>(pending.tokens_to_ingest());
  const std::string psid = pending.session_id();

  using C = absl::StatusCode;
  std::vector<BadCase> cases = {
      {"create: no model", C::kInvalidArgument, {"model is required"}, create([](auto& r) { r.clear_model(); })},
      {"create: empty model_id", C::kInvalidArgument, {"model.model_id", "empty"}, create([](auto& r) { r.mutable_model()->clear_model_id(); })},
      {"create: zero layers", C::kInvalidArgument, {"model.num_layers", "[1, 256]", "got 0"}, create([](auto& r) { r.mutable_model()->set_num_layers(0); })},
      {"create: layers over limit", C::kInvalidArgument, {"model.num_layers", "[1, 256]", "got 100000"},
       create([](auto& r) { r.mutable_model()->set_num_layers(100000); })},
      {"create: q heads not a multiple of kv heads", C::kInvalidArgument, {"model.num_query_heads", "num_kv_heads = " + std::to_string(h), "got 3"},
       create([](auto& r) { r.mutable_model()->set_num_query_heads(3); })},
      {"create: odd head_dim", C::kInvalidArgument, {"model.head_dim", "even", "got 33"}, create([](auto& r) { r.mutable_model()->set_head_dim(33); })},
      {"create: head_dim over limit", C::kInvalidArgument, {"model.head_dim", "[2, 256]", "got 1024"},
       create([](auto& r) { r.mutable_model()->set_head_dim(1024); })},
      {"create: int32 dtype", C::kInvalidArgument, {"model.dtype", "BF16", "got DTYPE_INT32"},
       create([](auto& r) { r.mutable_model()->set_dtype(v1::DTYPE_INT32); })},
      {"create: NaN rope theta", C::kInvalidArgument, {"model.rope.theta", "finite", "got nan"},
       create([](auto& r) { r.mutable_model()->mutable_rope()->set_theta(NAN); })},
      {"create: empty token_ids", C::kInvalidArgument, {"token_ids", "empty"}, create([](auto& r) { r.clear_token_ids(); })},
      {"create: negative token id", C::kInvalidArgument, {"token_ids[3]", ">= 0", "got -5"}, create([](auto& r) { r.set_token_ids(3, -5); })},
      {"create: tokens over max_tokens_per_session", C::kResourceExhausted, {"token_ids", "max_tokens_per_session = 4096", "5256 tokens"},
       create([](auto& r) {
         for (int i = 0; i < 5000; ++i) r.add_token_ids(i);
       })},
      {"create: rank not a multiple of 8", C::kInvalidArgument, {"profile.rank", "multiple of 8", "h*d = " + std::to_string(h * d), "got 12"},
       create([](auto& r) { r.mutable_profile()->set_rank(12); })},
      {"create: rank above h*d", C::kInvalidArgument, {"profile.rank", "h*d = " + std::to_string(h * d), "got 128"}, create([](auto& r) { r.mutable_profile()->set_rank(128); })},
      {"create: unknown profile kind", C::kInvalidArgument, {"profile.kind", "42"},
       create([](auto& r) { r.mutable_profile()->set_kind(static_cast<v1::ProfileKind>(42)); })},
      {"create: refactor_threshold > 1", C::kInvalidArgument, {"profile.refactor_threshold", "[0, 1]", "got 3"},
       create([](auto& r) { r.mutable_profile()->set_refactor_threshold(3.0f); })},
      {"create: label over 256 bytes", C::kInvalidArgument, {"label", "<= 256 bytes", "got 300"}, create([](auto& r) { r.set_label(std::string(300, 'x')); })},
      {"create: durable without a spill tier", C::kFailedPrecondition, {"durable", "spill_path"}, create([](auto& r) { r.set_durable(true); })},
      {"create: shadow prompt shorter than window + chunk", C::kInvalidArgument, {"token_ids", "local_window + chunk_size = 40", "got 20"},
       create([](auto& r) { r.mutable_token_ids()->Truncate(20); })},
      {"get: unknown session", C::kNotFound, {"session 'no-such-session'"}, [&] { return c->GetSession("no-such-session").status(); }},
      {"close: unknown session", C::kNotFound, {"session 'no-such-session'"}, [&] { return c->CloseSession("no-such-session"); }},
      {"fork: unknown parent", C::kNotFound, {"session 'no-such-session'"}, [&] { return c->ForkSession("no-such-session", 8).status(); }},
      {"fork: at_token not a boundary", C::kInvalidArgument, {"at_token", "[1024]", "got 77"}, [&] { return c->ForkSession(sid, 77).status(); }},
      {"fork: at_token past the end", C::kInvalidArgument, {"at_token", "(1024)", "got 5000"}, [&] { return c->ForkSession(sid, 5000).status(); }},
      {"fork: session still ingesting", C::kFailedPrecondition, {"session '" + psid + "' is ingesting"}, [&] { return c->ForkSession(psid, 8).status(); }},
      {"attach: unknown session", C::kNotFound, {"session 'no-such-session'"},
       [&] {
         v1::AttachRequest r;
         r.set_session_id("no-such-session");
         return c->Attach(r).status();
       }},
      {"attach: lease over max_lease_ms", C::kInvalidArgument, {"lease_ms", "max_lease_ms = 60000", "got 3600000"},
       [&] {
         v1::AttachRequest r;
         r.set_session_id(sid);
         r.set_lease_ms(3600000);
         return c->Attach(r).status();
       }},
      {"attach: second writer", C::kFailedPrecondition, {"session '" + sid + "'", "writer"},
       [&] {
         v1::AttachRequest r;
         r.set_session_id(sid);
         r.set_writer(true);
         auto first = c->Attach(r);
         if (!first.ok()) return first.status();
         auto second = c->Attach(r);
         c->Detach(first->attachment_id()).IgnoreError();
         return second.status();
       }},
      {"detach: unknown attachment", C::kNotFound, {"attachment 'no-such-attachment'"}, [&] { return c->Detach("no-such-attachment"); }},
      {"static set: layer out of range", C::kInvalidArgument, {"layer", "num_layers = 2", "got 9"}, [&] { return c->GetStaticSet(aid, 9).status(); }},
      {"select: unknown attachment", C::kNotFound, {"queries[0]", "attachment 'no-such-attachment'"},
       select([](auto& r) { r.mutable_queries(0)->set_attachment_id("no-such-attachment"); })},
      {"select: layer out of range", C::kInvalidArgument, {"layer", "num_layers = 2", "got 2"}, select([](auto& r) { r.set_layer(2); })},
      {"select: q wrong shape", C::kInvalidArgument, {"queries[0].q.shape", Shape({hq, d}), "got [2, " + std::to_string(d) + "]"},
       select([](auto& r) { r.mutable_queries(0)->mutable_q()->set_shape(0, 2); })},
      {"select: q wrong dtype", C::kInvalidArgument, {"queries[0].q.dtype", "DTYPE_BF16", "got DTYPE_INT32"},
       select([](auto& r) { r.mutable_queries(0)->mutable_q()->set_dtype(v1::DTYPE_INT32); })},
      {"select: q data short", C::kInvalidArgument, {"queries[0].q.data", std::to_string(hq * d * 2) + " bytes", "got 10"},
       select([](auto& r) { r.mutable_queries(0)->mutable_q()->mutable_data()->resize(10); })},
      {"select: q holds NaN", C::kInvalidArgument, {"queries[0].q", "non-finite", "flat index 0"},
       select([](auto& r) {
         std::string* data = r.mutable_queries(0)->mutable_q()->mutable_data();
         (*data)[0] = '\xc0';
         (*data)[1] = '\x7f';  // bf16 0x7fc0 = NaN
       })},
      {"select: q holds inf", C::kInvalidArgument, {"queries[0].q", "non-finite", "flat index 1"},
       select([](auto& r) {
         std::string* data = r.mutable_queries(0)->mutable_q()->mutable_data();
         (*data)[2] = '\x80';
         (*data)[3] = '\x7f';  // bf16 0x7f80 = +inf
       })},
      {"select: attachment twice in a batch", C::kInvalidArgument, {"queries[1]", "attachment '" + aid + "'", "more than once"},
       select([](auto& r) { *r.add_queries() = r.queries(0); })},
      {"select: batch over max_batch", C::kInvalidArgument, {"queries", "5 entries", "max_batch = 4"},
       select([](auto& r) {
         for (int i = 0; i < 4; ++i) {
           *r.add_queries() = r.queries(0);
           r.mutable_queries(i + 1)->set_attachment_id("a" + std::to_string(i));
         }
       })},
      {"attend: q wrong shape", C::kInvalidArgument, {"queries[0].q.shape", Shape({hq, d}), "got " + Shape({hq * d})},
       [&] {
         v1::AttendRequest r;
         auto* q = r.add_queries();
         q->set_attachment_id(aid);
         std::vector<float> x(static_cast<size_t>(hq) * d, 0.5f);
         *q->mutable_q() = MakeBf16Tensor({hq * d}, absl::MakeConstSpan(x));
         return c->Attend(r).status();
       }},
      {"ingest: no header first", C::kInvalidArgument, {"first message", "IngestHeader"},
       ingest([&](auto& m) { m.push_back(layer_msg(psid, 0, pending_n)); })},
      {"ingest: unknown session", C::kNotFound, {"session 'no-such-session'"}, ingest([&](auto& m) { m.push_back(header("no-such-session")); })},
      {"ingest: into a ready session", C::kFailedPrecondition, {"session '" + sid + "' is ready"},
       ingest([&](auto& m) {
         m.push_back(header(sid));
         m.push_back(commit());
       })},
      {"ingest: k with the wrong shape", C::kInvalidArgument, {"layer 0 k.shape", Shape({pending_n, h, d}), "got " + Shape({pending_n, h, d / 2})},
       ingest([&](auto& m) {
         m.push_back(header(psid));
         m.push_back(layer_msg(psid, 0, pending_n));
         m.back().mutable_layer()->mutable_k()->set_shape(2, d / 2);
       })},
      {"ingest: layer out of range", C::kInvalidArgument, {"layer", "num_layers = 2", "got 7"},
       ingest([&](auto& m) {
         m.push_back(header(psid));
         m.push_back(layer_msg(psid, 0, pending_n));
         m.back().mutable_layer()->set_layer(7);
       })},
      {"ingest: more tokens than the session expects", C::kInvalidArgument, {"layer 0: k.shape", "(" + std::to_string(pending_n) + " tokens to ingest, 0 received)", "got " + Shape({pending_n + 8, h, d})},
       ingest([&](auto& m) {
         m.push_back(header(psid));
         m.push_back(layer_msg(psid, 0, pending_n + 8));
       })},
      {"ingest: non-finite value", C::kInvalidArgument, {"layer 0 v", "non-finite", "flat index 0"},
       ingest([&](auto& m) {
         m.push_back(header(psid));
         m.push_back(layer_msg(psid, 0, pending_n));
         std::string* data = m.back().mutable_layer()->mutable_v()->mutable_data();
         (*data)[0] = '\x80';
         (*data)[1] = '\x7f';
       })},
      {"ingest: commit before every layer", C::kInvalidArgument, {"IngestCommit", "incomplete layers: [1]"},
       ingest([&](auto& m) {
         m.push_back(header(psid));
         m.push_back(layer_msg(psid, 0, pending_n));
         m.push_back(commit());
       })},
      {"append: unknown session", C::kNotFound, {"session 'no-such-session'"},
       [&] { return c->AppendTokens(synthetic::MakeAppend(doc, "no-such-session", 0, 1024, 1028)).status(); }},
      {"append: wrong layer count", C::kInvalidArgument, {"layers", "num_layers = 2", "got 1"},
       [&] {
         auto r = synthetic::MakeAppend(doc, sid, 0, 1024, 1028);
         r.mutable_layers()->RemoveLast();
         return c->AppendTokens(r).status();
       }},
      {"append: token count differs from k rows", C::kInvalidArgument, {"layers[0].k.shape", Shape({5, h, d}), "got " + Shape({4, h, d})},
       [&] {
         auto r = synthetic::MakeAppend(doc, sid, 0, 1024, 1028);
         r.add_token_ids(5);
         return c->AppendTokens(r).status();
       }},
      {"append: into a session still ingesting", C::kFailedPrecondition, {"session '" + psid + "' is ingesting"},
       [&] { return c->AppendTokens(synthetic::MakeAppend(doc, psid, 0, 1024, 1028)).status(); }},
      {"lookup: no model", C::kInvalidArgument, {"model is required"},
       [&] {
         v1::LookupPrefixRequest r;
         r.add_token_ids(1);
         return c->LookupPrefix(r).status();
       }},
      {"message over max_message_bytes", C::kResourceExhausted, {"larger than max", "1048576"},
       [&] {
         v1::CreateSessionRequest r = synthetic::MakeCreate(doc, profile, -1);
         r.set_label(std::string(2 << 20, 'x'));
         return c->CreateSession(r).status();
       }},
  };
  for (const BadCase& bc : cases) {
    const absl::Status s = bc.call();
    EXPECT_EQ(s.code(), bc.expected) << bc.name << ": got " << s;
    // Every refusal names what was wrong (docs/API.md "Errors": the field, and the expected
    // vs the actual value; for an unknown id, the id; gRPC's own size check, the limit).
    for (const std::string& part : bc.names) {
      EXPECT_NE(s.message().find(part), std::string_view::npos)
          << bc.name << ": \"" << s.message() << "\" does not name \"" << part << "\"";
    }
  }

  // The healthy session is untouched: a fresh attachment sees exactly the same selection
  // and bytes as before the barrage, and the server still serves.
  ar.set_worker_id("control-2");
  KV_ASSERT_OK_AND_ASSIGN(control2, c->Attach(ar));
  auto sel2 = MakeSelect(doc, 1, {control2.attachment_id()}, 1, 3, 1024);
  KV_ASSERT_OK_AND_ASSIGN(control_after, c->SelectAndReconstruct(sel2));
  ASSERT_EQ(control_after.deltas_size(), 1);
  const auto& a = control_before.deltas(0);
  const auto& b = control_after.deltas(0);
  EXPECT_EQ(std::vector<int32_t>(a.chunk().begin(), a.chunk().end()),
            std::vector<int32_t>(b.chunk().begin(), b.chunk().end()));
  EXPECT_EQ(a.keys().data(), b.keys().data());
  EXPECT_EQ(a.values().data(), b.values().data());
  KV_ASSERT_OK_AND_ASSIGN(health, c->CheckHealth());
  EXPECT_EQ(health, client::HealthStatus::kServing);
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.tokens(), 1024u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}


// --- Ingest: the commit takes effect only when the stream ends cleanly ---------------------

// The whole of layer `layer` of the document's first `n` tokens as one ingest part.
v1::IngestRequest WholeLayer(const synthetic::Document& doc, uint32_t layer, int64_t n) {
  const int h = doc.spec().kv_heads, d = doc.spec().head_dim;
  std::vector<uint16_t> k, v;
  doc.KeysValues(static_cast<int>(layer), -1, 0, n, &k, &v);
  v1::IngestRequest m;
  auto* l = m.mutable_layer();
  l->set_layer(layer);
  l->set_token_offset(0);
  *l->mutable_k() = MakeBf16Tensor({n, h, d}, absl::MakeConstSpan(k));
  *l->mutable_v() = MakeBf16Tensor({n, h, d}, absl::MakeConstSpan(v));
  l->set_last_part(true);
  return m;
}

TEST(Rpc, IngestCommitTakesEffectOnlyWhenTheStreamEndsCleanly) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const int64_t n = 512;
  const synthetic::Document doc(SmallDoc(n));
  const v1::Profile profile = ShadowProfile();
  const int layers = doc.spec().layers;
  KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
  ASSERT_EQ(created.tokens_to_ingest(), static_cast<uint64_t>(n));
  const std::string sid = created.session_id();
  std::vector<v1::IngestRequest> good(1);
  good[0].mutable_header()->set_session_id(sid);
  for (int l = 0; l < layers; ++l) good.push_back(WholeLayer(doc, l, n));
  good.emplace_back().mutable_commit();
  auto stub = v1::KvShade::NewStub(c->channel());
  auto expect_nothing_committed = [&](const std::string& what) {
    auto info = c->GetSession(sid);
    ASSERT_TRUE(info.ok()) << what << ": " << info.status();
    EXPECT_EQ(info->state(), "ingesting") << what;
    EXPECT_EQ(info->tokens(), 0u) << what;
  };

  // [header, layer 0, layer 1, commit, layer 0]: the stream fails, and so nothing is
  // committed; the client may simply send the stream again.
  {
    std::vector<v1::IngestRequest> msgs = good;
    msgs.push_back(WholeLayer(doc, 0, n));
    grpc::ClientContext ctx;
    v1::IngestResponse resp;
    auto w = stub->Ingest(&ctx, &resp);
    for (const auto& m : msgs) {
      if (!w->Write(m)) break;
    }
    w->WritesDone();
    const grpc::Status st = w->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("IngestCommit"), std::string::npos) << st.error_message();
    expect_nothing_committed("a message after the commit");
  }

  // Every message including the commit, but the client cancels instead of half-closing:
  // the stream did not end cleanly, so the commit never takes effect.
  {
    grpc::ClientContext ctx;
    v1::IngestResponse resp;
    auto w = stub->Ingest(&ctx, &resp);
    for (const auto& m : good) ASSERT_TRUE(w->Write(m));
    // Wait until the server has processed every layer, then give it time to act on the
    // commit if it (wrongly) did so before the stream's end.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      auto info = c->GetSession(sid);
      ASSERT_TRUE(info.ok()) << info.status();
      if (info->state() != "ingesting" || info->layers_ingested() == static_cast<uint32_t>(layers)) break;
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the server never processed the layers";
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    expect_nothing_committed("commit sent, stream still open");
    ctx.TryCancel();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::CANCELLED);
    expect_nothing_committed("commit sent, stream cancelled");
  }

  // The same messages, half-closed: committed. The client sees CANCELLED at once, but the
  // server lets go of the cancelled stream only when its handler observes the cancellation,
  // so a retry may briefly find it still in progress (FAILED_PRECONDITION): retry then.
  absl::StatusOr<v1::IngestResponse> retried;
  const auto retry_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    retried = c->Ingest(good);
    if (retried.ok() || retried.status().code() != absl::StatusCode::kFailedPrecondition ||
        retried.status().message().find("in progress") == std::string::npos ||
        std::chrono::steady_clock::now() > retry_deadline) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  KV_ASSERT_OK_AND_ASSIGN(ing, std::move(retried));
  EXPECT_EQ(ing.tokens(), static_cast<uint64_t>(n));
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.state(), "ready");
  EXPECT_EQ(info.tokens(), static_cast<uint64_t>(n));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// --- Ids in errors: bounded, and over the maximum length refused ---------------------------

TEST(Rpc, OversizedIdsGetInvalidArgumentWithAShortMessage) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(512));
  const v1::Profile profile = ShadowProfile();
  KV_ASSERT_OK_AND_ASSIGN(good, CreateAndIngest(*c, doc, profile, -1));
  const std::string huge(10 << 10, 'x');  // far over the id limit and gRPC's metadata limit
  using C = absl::StatusCode;
  struct IdCase {
    std::string name;
    C expected;
    std::function<absl::Status()> call;
  };
  auto select_with = [&](std::vector<std::string> attachments) {
    return [&c, &doc, attachments] {
      return c->SelectAndReconstruct(MakeSelect(doc, 0, attachments, 0, 0, 512)).status();
    };
  };
  const std::vector<IdCase> cases = {
      {"get", C::kInvalidArgument, [&] { return c->GetSession(huge).status(); }},
      {"close", C::kInvalidArgument, [&] { return c->CloseSession(huge); }},
      {"fork", C::kInvalidArgument, [&] { return c->ForkSession(huge, 512).status(); }},
      {"attach", C::kInvalidArgument,
       [&] {
         v1::AttachRequest r;
         r.set_session_id(huge);
         return c->Attach(r).status();
       }},
      {"detach", C::kInvalidArgument, [&] { return c->Detach(huge); }},
      {"static set", C::kInvalidArgument, [&] { return c->GetStaticSet(huge, 0).status(); }},
      {"select", C::kInvalidArgument, select_with({huge})},
      {"select: the same long id twice", C::kInvalidArgument, select_with({huge, huge})},
      {"append", C::kInvalidArgument,
       [&] { return c->AppendTokens(synthetic::MakeAppend(doc, huge, 0, 512, 516)).status(); }},
      {"append: attachment", C::kInvalidArgument,
       [&] {
         auto r = synthetic::MakeAppend(doc, good.session_id(), 0, 512, 516);
         r.set_attachment_id(huge);
         return c->AppendTokens(r).status();
       }},
      {"ingest", C::kInvalidArgument,
       [&] {
         std::vector<v1::IngestRequest> msgs(1);
         msgs[0].mutable_header()->set_session_id(huge);
         return c->Ingest(msgs).status();
       }},
      // Within the limit but unknown: NOT_FOUND, naming at most a bounded piece of the id.
      {"get: 128-byte unknown id", C::kNotFound, [&] { return c->GetSession(std::string(128, 'y')).status(); }},
  };
  for (const IdCase& ic : cases) {
    const absl::Status s = ic.call();
    EXPECT_EQ(s.code(), ic.expected) << ic.name << ": got " << s.code() << " with "
                                     << s.message().size() << " bytes of message";
    EXPECT_LE(s.message().size(), 1024u) << ic.name;
    EXPECT_EQ(s.message().find(std::string(65, 'x')), std::string::npos) << ic.name;
    EXPECT_EQ(s.message().find(std::string(65, 'y')), std::string::npos) << ic.name;
  }
  // The server is unharmed.
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(good.session_id()));
  EXPECT_EQ(info.tokens(), 512u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace rpc_test
}  // namespace kvshade::integration

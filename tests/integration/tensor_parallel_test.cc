// Integration: a tensor-parallel session (docs/DESIGN.md "Tensor-parallel sessions") on a
// daemon of two CPU devices, through the C++ client: two ranks, each ingesting and
// appending its half of the KV heads on its own device, attend as a whole-model session on
// their heads; after kill -9 and a restart the durable logical session is back whole, with
// its appends, each shard on its device answering bit for bit as before.
#include <cstring>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace tensor_parallel_test {
namespace {

// KV heads [b, e) of a bf16 [n, h, d] tensor.
v1::Tensor SliceHeads(const v1::Tensor& t, int b, int e) {
  const int64_t n = t.shape(0), h = t.shape(1), d = t.shape(2);
  v1::Tensor o;
  o.add_shape(n);
  o.add_shape(e - b);
  o.add_shape(d);
  o.set_dtype(t.dtype());
  std::string data;
  for (int64_t i = 0; i < n; ++i) data.append(t.data(), size_t((i * h + b) * d * 2), size_t((e - b) * d * 2));
  o.set_data(std::move(data));
  return o;
}

v1::AppendTokensRequest SliceAppend(v1::AppendTokensRequest r, const std::string& session, int b, int e) {
  r.set_session_id(session);
  for (auto& l : *r.mutable_layers()) {
    *l.mutable_k() = SliceHeads(l.k(), b, e);
    *l.mutable_v() = SliceHeads(l.v(), b, e);
  }
  return r;
}

TEST(TensorParallel, TwoRanksOnTwoDevicesAttendAsTheWholeAndSurviveKillNine) {
  TempDir spill;
  const std::vector<std::string> args = {"--backend", "cpu:0,cpu:1", "--spill-path",
                                         spill.path() + "/rocks", "--append-fsync", "always"};
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(1024));
  const v1::ModelSpec model = doc.Model();
  const int h = int(model.num_kv_heads()), g = int(model.num_query_heads() / h), d = int(model.head_dim());
  ASSERT_EQ(h, 2);
  const int64_t n = int64_t(doc.tokens().size()), extra = 4;
  KV_ASSERT_OK_AND_ASSIGN(whole, CreateAndIngest(*c, doc, ShadowProfile(), -1, /*durable=*/true));
  ASSERT_TRUE(c->AppendTokens(synthetic::MakeAppend(doc, whole.session_id(), -1, n, n + extra)).ok());

  std::string logical, shard[2];
  for (int r = 0; r < 2; ++r) {
    v1::CreateSessionRequest cr = synthetic::MakeCreate(doc, ShadowProfile(), -1, /*durable=*/true);
    cr.set_device(r == 0 ? "cpu:0" : "cpu:1");
    KV_ASSERT_OK_AND_ASSIGN(created, c->CreateTensorParallelRank(cr, 2, r, r, r + 1, logical));
    logical = created.tensor_parallel().session_id();
    shard[r] = created.session_id();
    EXPECT_EQ(created.device(), cr.device());
    ASSERT_EQ(created.reused_tokens(), 0u);
    KV_ASSERT_OK_AND_ASSIGN(w, c->StartIngest(shard[r]));
    for (uint32_t l = 0; l < model.num_layers(); ++l) {
      std::vector<uint16_t> k, v, ks, vs;
      doc.KeysValues(int(l), -1, 0, n, &k, &v);
      for (int64_t t = 0; t < n; ++t) {
        ks.insert(ks.end(), k.begin() + (t * h + r) * d, k.begin() + (t * h + r + 1) * d);
        vs.insert(vs.end(), v.begin() + (t * h + r) * d, v.begin() + (t * h + r + 1) * d);
      }
      KV_ASSERT_OK(w->WriteLayer(l, n, 1, d, ks, vs));
    }
    ASSERT_TRUE(w->Commit().ok());
    const v1::AppendTokensRequest app = synthetic::MakeAppend(doc, "", -1, n, n + extra);
    ASSERT_TRUE(c->AppendTokens(SliceAppend(app, shard[r], r, r + 1)).ok());
  }
  KV_ASSERT_OK_AND_ASSIGN(shards, c->TensorParallelShards(logical));
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_EQ(shards[1].device(), "cpu:1");
  EXPECT_EQ(c->TensorParallelShards(whole.session_id()).status().code(), absl::StatusCode::kInvalidArgument);

  // Each rank attends its query heads as the whole session does.
  auto attach = [&](client::Client& cl, const std::string& s) {
    v1::AttachRequest ar;
    ar.set_session_id(s);
    ar.set_worker_id("tp");
    auto a = cl.Attach(ar);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : std::string();
  };
  const std::vector<kernels::bf16> q = QueryBf16(doc, 1, -1, 0, n + extra);
  const std::vector<float> want = AttendRpc(*c, attach(*c, whole.session_id()), 1, q, h * g, d);
  std::vector<float> before[2];
  for (int r = 0; r < 2; ++r) {
    const std::vector<kernels::bf16> qr(q.begin() + r * g * d, q.begin() + (r + 1) * g * d);
    before[r] = AttendRpc(*c, attach(*c, shard[r]), 1, qr, g, d);
    ASSERT_EQ(before[r].size(), size_t(g * d));
    EXPECT_LT(MaxRelDiff(before[r], want.data() + r * g * d, size_t(g * d)), 0.02) << "rank " << r;
  }

  server.Kill9();
  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  auto c2 = again.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(logical));
  EXPECT_EQ(info.state(), "ready");
  EXPECT_EQ(info.tokens(), uint64_t(n + extra));
  ASSERT_EQ(info.tensor_parallel().shards_size(), 2);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(info.tensor_parallel().shards(r).session_id(), shard[r]);
    EXPECT_EQ(info.tensor_parallel().shards(r).device(), r == 0 ? "cpu:0" : "cpu:1");
    const std::vector<kernels::bf16> qr(q.begin() + r * g * d, q.begin() + (r + 1) * g * d);
    const std::vector<float> after = AttendRpc(*c2, attach(*c2, shard[r]), 1, qr, g, d);
    ASSERT_EQ(after.size(), before[r].size());
    EXPECT_EQ(std::memcmp(after.data(), before[r].data(), after.size() * 4), 0) << "rank " << r;
  }
  KV_ASSERT_OK(c2->CloseSession(logical));
  EXPECT_EQ(c2->GetSession(shard[0]).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace tensor_parallel_test
}  // namespace kvshade::integration

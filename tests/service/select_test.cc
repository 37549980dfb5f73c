// The select engine over several decode steps: per-attachment slot tables, deltas that a
// worker can apply, reconstructed chunks, batching, and agreement between a worker's own
// attention (static set + its slots + tail) and the service's Attend.
#include <prometheus/text_serializer.h>

#include <map>
#include <set>
#include <thread>

#include "service_test_util.h"

namespace kvshade::service::testing {
namespace select_test {
namespace {

constexpr int kG = 2, kH = 2, kD = 64, kC = 8;

// What a worker keeps: per head, slot -> (chunk, K [C, d], V [C, d]).
struct WorkerSlots {
  struct Slot {
    int chunk = -1;
    std::vector<bf16> k, v;
  };
  explicit WorkerSlots(int k) : slots(kH, std::vector<Slot>(k)) {}
  void Apply(const v1::SlotDelta& d) {
    const std::vector<bf16> keys = TensorBf16(d.keys()), values = TensorBf16(d.values());
    const size_t row = size_t(kC) * kD;
    for (int i = 0; i < d.head_size(); ++i) {
      Slot& s = slots[d.head(i)][d.slot(i)];
      s.chunk = d.chunk(i);
      s.k.assign(keys.begin() + i * row, keys.begin() + (i + 1) * row);
      s.v.assign(values.begin() + i * row, values.begin() + (i + 1) * row);
    }
  }
  std::vector<std::vector<Slot>> slots;
};

// Attention of q [hq, d] over, per KV head, static rows + the worker's slots + tail.
std::vector<float> WorkerAttend(const v1::GetStaticSetResponse& st, const WorkerSlots& w,
                                const std::vector<bf16>& q) {
  const std::vector<bf16> sk = TensorBf16(st.k()), sv = TensorBf16(st.v());
  const std::vector<bf16> tk = TensorBf16(st.tail_k()), tv = TensorBf16(st.tail_v());
  const int s_max = static_cast<int>(st.k().shape(1));
  const int t = static_cast<int>(st.tail_k().shape(0));
  std::vector<float> out(size_t(kH) * kG * kD, 0.0f);
  for (int qh = 0; qh < kH * kG; ++qh) {
    const int hh = qh / kG;
    std::vector<const bf16*> ks, vs;
    for (uint32_t r = 0; r < st.lengths(hh); ++r) {
      ks.push_back(sk.data() + (size_t(hh) * s_max + r) * kD);
      vs.push_back(sv.data() + (size_t(hh) * s_max + r) * kD);
    }
    for (const auto& slot : w.slots[hh]) {
      if (slot.chunk < 0) continue;
      for (int r = 0; r < kC; ++r) {
        ks.push_back(slot.k.data() + r * kD);
        vs.push_back(slot.v.data() + r * kD);
      }
    }
    for (int r = 0; r < t; ++r) {
      ks.push_back(tk.data() + (size_t(r) * kH + hh) * kD);
      vs.push_back(tv.data() + (size_t(r) * kH + hh) * kD);
    }
    std::vector<double> logit(ks.size());
    double mx = -1e300;
    for (size_t j = 0; j < ks.size(); ++j) {
      double dot = 0;
      for (int c = 0; c < kD; ++c) {
        dot += double(kernels::Bf16ToFloat(q[size_t(qh) * kD + c])) * kernels::Bf16ToFloat(ks[j][c]);
      }
      logit[j] = dot / std::sqrt(double(kD));
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (double& x : logit) sum += (x = std::exp(x - mx));
    for (size_t j = 0; j < ks.size(); ++j) {
      for (int c = 0; c < kD; ++c) {
        out[size_t(qh) * kD + c] += float(logit[j] / sum * kernels::Bf16ToFloat(vs[j][c]));
      }
    }
  }
  return out;
}

v1::Profile SparseShadow(int budget) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);  // = h*d: reconstruction is exact up to bf16
  p.set_sparse_budget(budget);
  p.set_outliers(2);
  return p;
}

TEST(SelectTest, SlotTablesOverSeveralSteps) {
  Harness hx;
  Stream s = MakeStream(512, hx.model, 11);
  auto o = hx.Open(s, SparseShadow(8));
  const int layer = 1;
  v1::GetStaticSetRequest sr;
  sr.set_attachment_id(o.attachment);
  sr.set_layer(layer);
  auto st = hx.engine->GetStaticSet(hx.tenant, sr);
  ASSERT_TRUE(st.ok()) << st.status();
  const std::vector<float> kr = PostRope(s, layer);
  WorkerSlots w(8);
  const std::vector<bf16> q1 = hx.Query(100), q2 = hx.Query(101);
  const std::vector<std::vector<bf16>> steps = {q1, q2, q1, q1, q2};
  for (size_t step = 0; step < steps.size(); ++step) {
    auto d = hx.Select(o.attachment, layer, steps[step]);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->selected(), uint32_t(kH * 8)) << step;
    EXPECT_EQ(d->hits() + uint32_t(d->head_size()), d->selected()) << step;
    if (step == 0) EXPECT_EQ(d->hits(), 0u);
    if (step == 3) {
      // Same query twice in a row: everything hits, nothing moves (T3).
      EXPECT_EQ(d->head_size(), 0);
      EXPECT_EQ(d->keys().shape(0), 0);
    }
    std::set<std::pair<int, int>> slots_seen;
    for (int i = 0; i < d->head_size(); ++i) {
      EXPECT_LT(d->head(i), uint32_t(kH));
      EXPECT_LT(d->slot(i), 8u);
      EXPECT_GE(d->chunk(i), 0);
      EXPECT_LT(d->chunk(i), (512 - 32) / 8);
      EXPECT_TRUE(slots_seen.insert({int(d->head(i)), int(d->slot(i))}).second);
    }
    // Reconstructed keys are the chunk's post-RoPE keys (rank = D), values are exact.
    const std::vector<bf16> keys = TensorBf16(d->keys()), values = TensorBf16(d->values());
    for (int i = 0; i < d->head_size(); ++i) {
      for (int r = 0; r < kC; ++r) {
        const int tok = d->chunk(i) * kC + r;
        for (int c = 0; c < kD; ++c) {
          const size_t src = (size_t(tok) * kH + d->head(i)) * kD + c;
          EXPECT_NEAR(kernels::Bf16ToFloat(keys[(size_t(i) * kC + r) * kD + c]), kr[src],
                      0.06 + 0.02 * std::abs(kr[src]));
          ASSERT_EQ(values[(size_t(i) * kC + r) * kD + c].bits, s.v[layer][src].bits);
        }
      }
    }
    w.Apply(*d);
    // The worker's own attention equals the service's Attend for the same query.
    auto out = hx.Attend(o.attachment, layer, steps[step]);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_LT(RelErr(WorkerAttend(*st, w, steps[step]), *out), 1e-3) << step;
  }
  v1::StatsRequest sreq;
  auto stats = hx.engine->Stats(hx.tenant, sreq);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->chunks_selected(), uint64_t(steps.size()) * kH * 8);
  EXPECT_GT(stats->chunk_hits(), 0u);
}

TEST(SelectTest, AttachmentsHaveIndependentSlotTablesAndBatch) {
  Harness hx;
  Stream s1 = MakeStream(400, hx.model, 12, 16, 100);
  Stream s2 = MakeStream(300, hx.model, 13, 16, 5000);
  auto a = hx.Open(s1, SparseShadow(4));
  auto b = hx.Open(s2, SparseShadow(6));
  const std::string a2 = hx.AttachTo(a.session);
  const auto q = hx.Query(200);
  auto d1 = hx.Select(a.attachment, 0, q);
  ASSERT_TRUE(d1.ok());
  auto again = hx.Select(a.attachment, 0, q);
  EXPECT_EQ(again->head_size(), 0);
  auto fresh = hx.Select(a2, 0, q);  // another worker: its own, empty slot table
  ASSERT_TRUE(fresh.ok());
  EXPECT_EQ(fresh->hits(), 0u);
  EXPECT_EQ(fresh->head_size(), d1->head_size());
  // One batch over two sessions with different budgets.
  v1::SelectAndReconstructRequest r;
  r.set_layer(1);
  for (const std::string& id : {a.attachment, b.attachment}) {
    auto* sq = r.add_queries();
    sq->set_attachment_id(id);
    *sq->mutable_q() = ToTensor(q, {4, kD});
  }
  auto resp = hx.engine->SelectAndReconstruct(hx.tenant, r);
  ASSERT_TRUE(resp.ok()) << resp.status();
  ASSERT_EQ(resp->deltas_size(), 2);
  EXPECT_EQ(resp->deltas(0).attachment_id(), a.attachment);
  EXPECT_EQ(resp->deltas(0).selected(), uint32_t(kH * 4));
  EXPECT_EQ(resp->deltas(1).selected(), uint32_t(kH * 6));
  // The same as selecting one by one on fresh attachments.
  const std::string b2 = hx.AttachTo(b.session);
  auto single = hx.Select(b2, 1, q);
  ASSERT_TRUE(single.ok());
  EXPECT_EQ(single->chunk().size(), resp->deltas(1).chunk().size());
  for (int i = 0; i < single->chunk_size(); ++i) EXPECT_EQ(single->chunk(i), resp->deltas(1).chunk(i));
  EXPECT_EQ(single->keys().data(), resp->deltas(1).keys().data());
}

// The domain-type entry point the UCX frames use (Engine::Select over views, decode.h)
// against the v1 form gRPC uses, on twin attachments: the same deltas bit for bit, with
// one SelectResult reused across calls of different batch sizes (nothing of an earlier,
// larger call survives in it).
// The purpose a worker gives its selects is counted per purpose (a speculating worker's
// correction rate) and changes nothing else; an unknown one is refused and not counted.
TEST(SelectTest, PurposesAreCountedAndChangeNothingElse) {
  Harness hx;
  Stream s1 = MakeStream(400, hx.model, 23, 16, 100);
  auto a = hx.Open(s1, SparseShadow(4));
  const std::string twin = hx.AttachTo(a.session);
  auto count = [&](const std::string& purpose) {
    prometheus::TextSerializer ser;
    const std::string text = ser.Serialize(hx.metrics.registry()->Collect());
    const std::string key = "kvshade_decode_selects_total{purpose=\"" + purpose + "\"} ";
    const size_t at = text.find(key);
    return at == std::string::npos ? -1.0 : std::stod(text.substr(at + key.size()));
  };
  EXPECT_EQ(count("synchronous"), 0);  // every series exists from the start
  EXPECT_EQ(count("speculative"), 0);
  EXPECT_EQ(count("correction"), 0);
  const v1::SelectPurpose order[] = {v1::SELECT_PURPOSE_UNSPECIFIED, v1::SELECT_PURPOSE_SPECULATIVE,
                                     v1::SELECT_PURPOSE_SPECULATIVE, v1::SELECT_PURPOSE_CORRECTION};
  for (int step = 0; step < 4; ++step) {
    const auto q = hx.Query(300 + 41 * step);
    v1::SelectAndReconstructRequest r;
    r.set_layer(0);
    auto* sq = r.add_queries();
    sq->set_attachment_id(a.attachment);
    *sq->mutable_q() = ToTensor(q, {4, kD});
    sq->set_purpose(order[step]);
    v1::SelectAndReconstructRequest t = r;
    t.mutable_queries(0)->set_attachment_id(twin);
    t.mutable_queries(0)->clear_purpose();
    auto ra = hx.engine->SelectAndReconstruct(hx.tenant, r);
    auto rt = hx.engine->SelectAndReconstruct(hx.tenant, t);
    ASSERT_TRUE(ra.ok() && rt.ok());
    ra->mutable_deltas(0)->clear_attachment_id();
    rt->mutable_deltas(0)->clear_attachment_id();
    EXPECT_EQ(ra->SerializeAsString(), rt->SerializeAsString()) << "step " << step;
  }
  EXPECT_EQ(count("synchronous"), 1 + 4);  // the twin's four and step 0
  EXPECT_EQ(count("speculative"), 2);
  EXPECT_EQ(count("correction"), 1);
  v1::SelectAndReconstructRequest bad;
  bad.set_layer(0);
  auto* sq = bad.add_queries();
  sq->set_attachment_id(a.attachment);
  *sq->mutable_q() = ToTensor(hx.Query(9), {4, kD});
  sq->set_purpose(static_cast<v1::SelectPurpose>(7));
  auto refused = hx.engine->SelectAndReconstruct(hx.tenant, bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("queries[0].purpose"), std::string::npos)
      << refused.status();
  EXPECT_EQ(count("synchronous") + count("speculative") + count("correction"), 5 + 2 + 1);
}

TEST(SelectTest, DomainSelectEqualsTheV1FormWithAReusedResult) {
  Harness hx;
  Stream s1 = MakeStream(400, hx.model, 21, 16, 100);
  auto a = hx.Open(s1, SparseShadow(4));
  const std::string twin_a = hx.AttachTo(a.session);
  const std::string b = hx.AttachTo(a.session), twin_b = hx.AttachTo(a.session);
  SelectResult reused;
  for (int step = 0; step < 4; ++step) {
    const auto q = hx.Query(200 + 37 * step);
    const v1::Tensor tq = ToTensor(q, {4, kD});
    // Steps 0 and 2 batch two attachments, 1 and 3 one.
    std::vector<std::string> ids = {a.attachment}, twins = {twin_a};
    if (step % 2 == 0) {
      ids.push_back(b);
      twins.push_back(twin_b);
    }
    std::vector<SelectQueryView> views;
    for (const std::string& id : ids) views.push_back({id, ViewOf(tq), {}});
    ASSERT_TRUE(hx.engine->Select(hx.tenant, SelectRequestView{1, views}, &reused).ok());
    v1::SelectAndReconstructRequest r;
    r.set_layer(1);
    for (const std::string& id : twins) {
      auto* sq = r.add_queries();
      sq->set_attachment_id(id);
      *sq->mutable_q() = tq;
    }
    auto resp = hx.engine->SelectAndReconstruct(hx.tenant, r);
    ASSERT_TRUE(resp.ok()) << resp.status();
    ASSERT_EQ(reused.deltas.size(), ids.size()) << "step " << step;
    for (size_t i = 0; i < ids.size(); ++i) {
      const SlotDeltaResult& d = reused.deltas[i];
      const v1::SlotDelta& w = resp->deltas(static_cast<int>(i));
      ASSERT_EQ(d.misses(), static_cast<uint32_t>(w.head_size())) << "step " << step;
      for (uint32_t x = 0; x < d.misses(); ++x) {
        EXPECT_EQ(d.head[x], w.head(x));
        EXPECT_EQ(d.slot[x], w.slot(x));
        EXPECT_EQ(d.chunk[x], w.chunk(x));
      }
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(d.keys.data()), d.keys.size() * 2),
                w.keys().data());
      EXPECT_EQ(std::string(reinterpret_cast<const char*>(d.values.data()), d.values.size() * 2),
                w.values().data());
      EXPECT_EQ(d.selected, w.selected());
      EXPECT_EQ(d.hits, w.hits());
      EXPECT_EQ(d.chunk_size, static_cast<uint32_t>(kC));
      EXPECT_EQ(d.head_dim, static_cast<uint32_t>(kD));
      EXPECT_FALSE(d.delivered);
      if (step == 0) EXPECT_GT(d.misses(), 0u);  // the comparison moves rows
    }
  }
  // A bad view is refused with the field named, as over the wire.
  const auto q = hx.Query(200);
  const v1::Tensor tq = ToTensor(q, {4, kD});
  TensorView bad = ViewOf(tq);
  bad.shape[0] = 2;
  std::vector<SelectQueryView> views = {{a.attachment, bad, {}}};
  absl::Status st = hx.engine->Select(hx.tenant, SelectRequestView{1, views}, &reused);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("queries[0].q.shape"), std::string::npos) << st;
}

// Rows the device row copy cannot move (C 1 x d 4 bf16 = 8 bytes) reach the reply row by
// row: each miss carries its own token's values.
TEST(SelectTest, NarrowRowsReachTheReply) {
  Harness hx;
  hx.model = TestModel(/*L=*/2, /*h=*/2, /*g=*/2, /*d=*/4);
  Stream s = MakeStream(300, hx.model, 17);
  v1::Profile p = SparseShadow(8);
  p.set_chunk_size(1);
  p.set_rank(8);  // = h*d
  auto o = hx.Open(s, p);
  const int layer = 1, d = 4;
  for (int step = 0; step < 2; ++step) {
    auto delta = hx.Select(o.attachment, layer, hx.Query(100 + step));
    ASSERT_TRUE(delta.ok()) << delta.status();
    ASSERT_GT(delta->head_size(), 0) << step;
    const std::vector<bf16> values = TensorBf16(delta->values());
    ASSERT_EQ(values.size(), size_t(delta->head_size()) * d);
    for (int i = 0; i < delta->head_size(); ++i) {
      const int tok = delta->chunk(i);  // C = 1: chunk c is token c
      for (int c = 0; c < d; ++c) {
        ASSERT_EQ(values[size_t(i) * d + c].bits,
                  s.v[layer][(size_t(tok) * kH + delta->head(i)) * d + c].bits)
            << "miss " << i << " step " << step;
      }
    }
  }
}

TEST(SelectTest, ConcurrentReadersOnOneSession) {
  Harness hx;
  Stream s = MakeStream(400, hx.model, 14);
  auto o = hx.Open(s, SparseShadow(8));
  std::vector<std::string> workers;
  for (int i = 0; i < 4; ++i) workers.push_back(hx.AttachTo(o.session));
  const auto q = hx.Query(300);
  auto ref = hx.Attend(o.attachment, 0, q);
  ASSERT_TRUE(ref.ok());
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (const std::string& w : workers) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < 5; ++step) {
        auto d = hx.Select(w, step % 2, q);
        auto out = hx.Attend(w, 0, q);
        if (!d.ok() || !out.ok() || out->size() != ref->size() ||
            std::memcmp(out->data(), ref->data(), ref->size() * 4) != 0) {
          ++failures;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(SelectTest, ReadersAndAWriterConcurrently) {
  Harness hx;
  Stream s = MakeStream(600, hx.model, 15);
  auto o = hx.Open(s, SparseShadow(8), 400);
  const std::string writer = hx.AttachTo(o.session, /*writer=*/true);
  std::vector<std::string> readers;
  for (int i = 0; i < 3; ++i) readers.push_back(hx.AttachTo(o.session));
  const auto q = hx.Query(301);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  threads.emplace_back([&] {
    const size_t tok = size_t(kH) * kD;
    for (int pos = 400; pos < 600; pos += 20) {
      v1::AppendTokensRequest r;
      r.set_session_id(o.session);
      r.set_attachment_id(writer);
      for (int t = pos; t < pos + 20; ++t) r.add_token_ids(s.tokens[t]);
      for (int l = 0; l < 2; ++l) {
        auto* lk = r.add_layers();
        lk->set_layer(l);
        *lk->mutable_k() = ToTensor({s.k[l].begin() + pos * tok, s.k[l].begin() + (pos + 20) * tok}, {20, kH, kD});
        *lk->mutable_v() = ToTensor({s.v[l].begin() + pos * tok, s.v[l].begin() + (pos + 20) * tok}, {20, kH, kD});
      }
      if (!hx.engine->AppendTokens(hx.tenant, r).ok()) ++failures;
    }
  });
  for (const std::string& w : readers) {
    threads.emplace_back([&, w] {
      for (int step = 0; step < 10; ++step) {
        auto d = hx.Select(w, step % 2, q);
        auto out = hx.Attend(w, 0, q);
        v1::GetStaticSetRequest sr;
        sr.set_attachment_id(w);
        if (!d.ok() || !out.ok() || !hx.engine->GetStaticSet(hx.tenant, sr).ok()) ++failures;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  // Every appended token arrived, and readers see the same state now.
  v1::GetSessionRequest gr;
  gr.set_session_id(o.session);
  EXPECT_EQ(hx.engine->GetSession(hx.tenant, gr)->tokens(), 600u);
  auto a = hx.Attend(readers[0], 1, q), b = hx.Attend(readers[1], 1, q);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size() * 4), 0);
}

// Delivery modes on Attach: UCX RMA is granted with the slot-buffer size the worker must
// register; CUDA IPC needs its buffers, a selecting profile and a backend that can map
// them (the cpu backend cannot: FAILED_PRECONDITION, and no attachment is left behind).
TEST(SelectTest, AttachDeliveryModesAndSlotGeometry) {
  Harness hx;
  Stream s = MakeStream(512, hx.model, 13);
  auto o = hx.Open(s, SparseShadow(8));
  const uint64_t want = uint64_t(hx.model.num_layers()) * kH * 8 * kC * kD * 2;

  v1::AttachRequest ar;
  ar.set_session_id(o.session);
  ar.set_delivery(v1::DELIVERY_MODE_UCX_RMA);
  auto rma = hx.engine->Attach(hx.tenant, ar);
  ASSERT_TRUE(rma.ok()) << rma.status();
  EXPECT_EQ(rma->delivery(), v1::DELIVERY_MODE_UCX_RMA);
  EXPECT_EQ(rma->slot_buffer_bytes(), want);
  auto g = hx.engine->AttachmentSlots(hx.tenant, rma->attachment_id());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->BufferBytes(), want);
  EXPECT_EQ(g->slots_per_head, 8u);
  EXPECT_EQ(g->heads, uint32_t(kH));
  EXPECT_EQ(g->delivery, v1::DELIVERY_MODE_UCX_RMA);
  EXPECT_EQ(hx.engine->AttachmentSlots(hx.other, rma->attachment_id()).status().code(),
            absl::StatusCode::kNotFound);

  auto stats_before = hx.engine->Stats(hx.tenant, {});
  ASSERT_TRUE(stats_before.ok());
  struct Case {
    v1::DeliveryMode mode;
    bool buffers;
    absl::StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {v1::DELIVERY_MODE_CUDA_IPC, false, absl::StatusCode::kInvalidArgument, "needs cuda_ipc"},
      {v1::DELIVERY_MODE_INLINE, true, absl::StatusCode::kInvalidArgument, "only for delivery"},
      {v1::DELIVERY_MODE_CUDA_IPC, true, absl::StatusCode::kFailedPrecondition, "CUDA backend"},
      {static_cast<v1::DeliveryMode>(9), false, absl::StatusCode::kInvalidArgument, "delivery must"},
  };
  for (const Case& c : cases) {
    v1::AttachRequest r;
    r.set_session_id(o.session);
    r.set_delivery(c.mode);
    if (c.buffers) {
      r.mutable_cuda_ipc()->set_k_handle(std::string(64, '\1'));
      r.mutable_cuda_ipc()->set_v_handle(std::string(64, '\2'));
      r.mutable_cuda_ipc()->set_bytes(want);
    }
    auto a = hx.engine->Attach(hx.tenant, r);
    ASSERT_FALSE(a.ok()) << c.says;
    EXPECT_EQ(a.status().code(), c.code) << a.status();
    EXPECT_NE(a.status().message().find(c.says), std::string_view::npos) << a.status();
  }
  // Too small a buffer is refused before any mapping is tried.
  v1::AttachRequest small;
  small.set_session_id(o.session);
  small.set_delivery(v1::DELIVERY_MODE_CUDA_IPC);
  small.mutable_cuda_ipc()->set_k_handle(std::string(64, '\1'));
  small.mutable_cuda_ipc()->set_v_handle(std::string(64, '\2'));
  small.mutable_cuda_ipc()->set_bytes(want - 16);
  auto sm = hx.engine->Attach(hx.tenant, small);
  EXPECT_EQ(sm.status().code(), absl::StatusCode::kInvalidArgument) << sm.status();
  EXPECT_NE(sm.status().message().find("cuda_ipc.bytes must be >= "), std::string_view::npos);
  auto stats_after = hx.engine->Stats(hx.tenant, {});
  ASSERT_TRUE(stats_after.ok());
  EXPECT_EQ(stats_after->attachments(), stats_before->attachments());

  // A session that selects nothing (exact profile) has no slots to deliver into.
  auto exact = hx.Open(s, ProfileOf(v1::PROFILE_KIND_EXACT), 256);
  v1::AttachRequest ex = small;
  ex.set_session_id(exact.session);
  ex.mutable_cuda_ipc()->set_bytes(1 << 20);
  auto ea = hx.engine->Attach(hx.tenant, ex);
  EXPECT_EQ(ea.status().code(), absl::StatusCode::kInvalidArgument) << ea.status();
}

}  // namespace
}  // namespace select_test
}  // namespace kvshade::service::testing

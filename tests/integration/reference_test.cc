// Integration: end-to-end select and attend over gRPC equal the kernels' reference for the
// same inputs. The test regenerates the document the server ingested, computes post-RoPE
// keys, landmarks and the top-k selection with the CPU backend's own ops (and exact
// attention with kernels::reference), and compares with what the server answered:
//   - the chunk ids selected per head (exactly: same ops, same inputs, deterministic);
//   - the reconstructed keys at full rank (r = h*d) against the exact post-RoPE keys, and
//     the values bit for bit (bf16 codec);
//   - Attend with a budget covering every chunk against exact attention over all tokens
//     (docs/ALGORITHM.md T1: relative error < 1e-2).
#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/reference.h"

namespace kvshade::integration {
namespace reference_test {
namespace {

using kernels::bf16;

constexpr int64_t kN = 512;
constexpr int kC = 8, kWindow = 32;
constexpr int kChunks = (kN - kWindow) / kC;  // 60

v1::Profile FullRank(int budget) {
  v1::Profile p = ShadowProfile(/*rank=*/64, budget, /*outliers=*/4);
  p.set_chunk_size(kC);
  p.set_local_window(kWindow);
  return p;
}

TEST(Reference, SelectAndAttendOverGrpcEqualTheKernelReference) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(kN, 11));
  const int h = doc.spec().kv_heads, hq = doc.spec().q_heads, d = doc.spec().head_dim, g = hq / h;
  ASSERT_EQ(h * d, 64);

  // Session A: budget = every chunk (what is returned per head is its selectable pool).
  KV_ASSERT_OK_AND_ASSIGN(full, CreateAndIngest(*c, doc, FullRank(kChunks), -1));
  // Session B: same document and factors (reused), budget 8.
  KV_ASSERT_OK_AND_ASSIGN(small, c->CreateSession(synthetic::MakeCreate(doc, FullRank(8), -1)));
  ASSERT_EQ(small.reused_tokens(), static_cast<uint64_t>(kN));
  auto attach = [&](const std::string& sid) {
    v1::AttachRequest ar;
    ar.set_session_id(sid);
    auto a = c->Attach(ar);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : std::string();
  };
  const std::string a_full = attach(full.session_id()), a_small = attach(small.session_id());

  // --- The reference, with the CPU backend's ops on the same inputs.
  auto backend_or = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend_or.ok()) << backend_or.status();
  kernels::Backend& be = **backend_or;
  kernels::RopeSpec rope;  // theta 10000, full rotary dim, half-split: doc.Model()'s RoPE
  rope.theta = doc.spec().rope_theta;
  rope.rotary_dim = d;
  std::vector<uint16_t> kbits, vbits;
  const int layer = 1;
  doc.KeysValues(layer, -1, 0, kN, &kbits, &vbits);
  std::vector<bf16> kr(kbits.size());
  for (size_t i = 0; i < kbits.size(); ++i) kr[i].bits = kbits[i];
  std::vector<int64_t> positions(kN);
  for (int64_t t = 0; t < kN; ++t) positions[t] = t;
  KV_ASSERT_OK(be.ApplyRope(rope, positions, h, d, absl::MakeSpan(kr)));
  std::vector<bf16> landmarks(static_cast<size_t>(kChunks) * h * d);
  std::vector<float> min_cos(static_cast<size_t>(h) * kChunks);
  KV_ASSERT_OK(be.BuildLandmarks(kr, kN, h, d, kC, kChunks, absl::MakeSpan(landmarks), absl::MakeSpan(min_cos)));
  KV_ASSERT_OK(be.Synchronize());

  const std::vector<float> qf = doc.Query(layer, 0, 0, kN);
  std::vector<bf16> qb(qf.size());
  for (size_t i = 0; i < qf.size(); ++i) qb[i] = kernels::FloatToBf16(qf[i]);
  v1::SelectAndReconstructRequest sel_full = MakeSelect(doc, layer, {a_full}, 0, 0, kN);

  // --- Full budget: each head's selectable pool; keys ~ exact, values exact.
  KV_ASSERT_OK_AND_ASSIGN(rf, c->SelectAndReconstruct(sel_full));
  ASSERT_EQ(rf.deltas_size(), 1);
  const auto& df = rf.deltas(0);
  const int m = df.chunk_size();
  std::vector<std::set<int32_t>> pool(h);
  KV_ASSERT_OK_AND_ASSIGN(keys, client::TensorToFloats(df.keys()));
  ASSERT_EQ(keys.size(), static_cast<size_t>(m) * kC * d);
  ASSERT_EQ(df.values().data().size(), static_cast<size_t>(m) * kC * d * 2);
  double err2 = 0, ref2 = 0;
  for (int i = 0; i < m; ++i) {
    const int hh = static_cast<int>(df.head(i));
    const int32_t chunk = df.chunk(i);
    ASSERT_GE(chunk, 0);
    ASSERT_LT(chunk, kChunks);
    pool[hh].insert(chunk);
    for (int t = 0; t < kC; ++t) {
      const int64_t tok = static_cast<int64_t>(chunk) * kC + t;
      for (int ch = 0; ch < d; ++ch) {
        const float exact = kernels::Bf16ToFloat(kr[(tok * h + hh) * d + ch]);
        const float got = keys[(static_cast<size_t>(i) * kC + t) * d + ch];
        err2 += (got - exact) * (got - exact);
        ref2 += exact * exact;
        uint16_t vb;
        std::memcpy(&vb, df.values().data().data() + ((static_cast<size_t>(i) * kC + t) * d + ch) * 2, 2);
        ASSERT_EQ(vb, vbits[(tok * h + hh) * d + ch]) << "value of chunk " << chunk << " head " << hh;
      }
    }
  }
  EXPECT_LT(std::sqrt(err2 / ref2), 1e-2) << "full-rank reconstructed keys vs exact post-RoPE keys";
  for (int hh = 0; hh < h; ++hh) {
    // Sink and outliers (>= 1 + 4 chunks) are static; everything else is selectable.
    EXPECT_LE(pool[hh].size(), static_cast<size_t>(kChunks - 5)) << "head " << hh;
    EXPECT_GE(pool[hh].size(), static_cast<size_t>(kChunks - 5 - 4)) << "head " << hh;
    EXPECT_FALSE(pool[hh].count(0)) << "the sink chunk must be static";
  }

  // --- Budget 8: the server's top-k equals the backend's Select over the same landmarks
  // with the same static chunks excluded.
  std::vector<uint8_t> excluded(static_cast<size_t>(h) * kChunks, 1);
  for (int hh = 0; hh < h; ++hh) {
    for (int32_t j : pool[hh]) excluded[static_cast<size_t>(hh) * kChunks + j] = 0;
  }
  constexpr int kK = 8;
  kernels::SelectItem item;
  // Select reads only the landmarks; the basis must merely be present (validation).
  std::vector<bf16> basis(static_cast<size_t>(h) * 64 * d);
  item.view.r = 64;
  item.view.b = basis.data();
  item.view.n_segments = 1;
  item.view.segments[0].n_chunks = kChunks;
  item.view.segments[0].first_position = 0;
  item.view.segments[0].landmarks = landmarks.data();
  item.view.segments[0].excluded = excluded.data();
  std::vector<int32_t> slots(h * kK, -1), selected(h * kK), miss_slot(h * kK), miss_chunk(h * kK), miss_count(h);
  item.q = qb.data();
  item.slots = slots.data();
  item.selected = selected.data();
  item.miss_slot = miss_slot.data();
  item.miss_chunk = miss_chunk.data();
  item.miss_count = miss_count.data();
  kernels::LayerShape shape{h, g, d};
  std::vector<kernels::SelectItem> items = {item};
  std::vector<uint8_t> ws(std::max<size_t>(1, be.SelectWorkspaceBytes(shape, kK, items)));
  KV_ASSERT_OK(be.Select(shape, kK, items, kernels::Workspace{ws.data(), ws.size()}));
  KV_ASSERT_OK(be.Synchronize());

  KV_ASSERT_OK_AND_ASSIGN(rs, c->SelectAndReconstruct(MakeSelect(doc, layer, {a_small}, 0, 0, kN)));
  ASSERT_EQ(rs.deltas_size(), 1);
  const auto& ds = rs.deltas(0);
  EXPECT_EQ(ds.selected(), static_cast<uint32_t>(h * kK));
  std::vector<std::set<int32_t>> got(h), want(h);
  for (int i = 0; i < ds.chunk_size(); ++i) got[ds.head(i)].insert(ds.chunk(i));
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < kK; ++j) want[hh].insert(selected[hh * kK + j]);
    EXPECT_EQ(got[hh], want[hh]) << "head " << hh;
  }
  // The same chunks come back with the same bytes as in the full-budget answer.
  KV_ASSERT_OK_AND_ASSIGN(small_keys, client::TensorToFloats(ds.keys()));
  std::map<std::pair<int, int32_t>, int> full_row;
  for (int i = 0; i < m; ++i) full_row[{static_cast<int>(df.head(i)), df.chunk(i)}] = i;
  for (int i = 0; i < ds.chunk_size(); ++i) {
    auto it = full_row.find({static_cast<int>(ds.head(i)), ds.chunk(i)});
    ASSERT_NE(it, full_row.end());
    for (int e = 0; e < kC * d; ++e) {
      ASSERT_EQ(small_keys[static_cast<size_t>(i) * kC * d + e], keys[static_cast<size_t>(it->second) * kC * d + e]);
    }
  }

  // --- Attend with every chunk attended (static + all selectable + tail) = exact
  // attention over all n tokens (T1).
  v1::AttendRequest at;
  at.set_layer(layer);
  auto* aq = at.add_queries();
  aq->set_attachment_id(a_full);
  *aq->mutable_q() = sel_full.queries(0).q();
  KV_ASSERT_OK_AND_ASSIGN(ao, c->Attend(at));
  ASSERT_EQ(ao.outputs_size(), 1);
  KV_ASSERT_OK_AND_ASSIGN(out, client::TensorToFloats(ao.outputs(0)));
  std::vector<float> kf(kr.size()), vf(vbits.size()), qq(qb.size()), ref(static_cast<size_t>(hq) * d);
  for (size_t i = 0; i < kr.size(); ++i) kf[i] = kernels::Bf16ToFloat(kr[i]);
  for (size_t i = 0; i < vbits.size(); ++i) vf[i] = client::Bf16BitsToFloat(vbits[i]);
  for (size_t i = 0; i < qb.size(); ++i) qq[i] = kernels::Bf16ToFloat(qb[i]);
  kernels::reference::ExactAttention(shape, qq.data(), kf.data(), vf.data(), static_cast<int>(kN),
                                     1.0f / std::sqrt(static_cast<float>(d)), ref.data());
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  EXPECT_LT(std::sqrt(num / den), 1e-2) << "Attend over every chunk vs exact attention";
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace reference_test
}  // namespace kvshade::integration

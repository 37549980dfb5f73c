// One decode core, every path (docs/ALGORITHM.md "Where this runs"): the daemon's
// SelectAndReconstruct and Attend, and same-node decode (client::LocalDecoder), run the
// same selection for every selection option (selection units included), the same recall
// guard, and attend the same rows. CPU backend, a real server.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "harness.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/client/local_decoder.h"
#include "kvshade/client/tensor.h"
#include "kvshade/kernels/types.h"

namespace kvshade::integration {
namespace decode_paths_test {
namespace {

using kernels::bf16;

// The daemon's selection of one query, per KV head: SelectAndReconstruct on a fresh
// attachment (empty slot tables), whose misses are then exactly the selection.
std::vector<std::set<int32_t>> DaemonSelection(client::Client& c, const std::string& session, int layer,
                                               const std::vector<bf16>& q, int h, int hq, int d) {
  v1::AttachRequest ar;
  ar.set_session_id(session);
  auto att = c.Attach(ar);
  EXPECT_TRUE(att.ok()) << att.status();
  if (!att.ok()) return {};
  v1::SelectAndReconstructRequest req;
  req.set_layer(layer);
  auto* sq = req.add_queries();
  sq->set_attachment_id(att->attachment_id());
  *sq->mutable_q() = Bf16Tensor(q, hq, d);
  auto r = c.SelectAndReconstruct(req);
  EXPECT_TRUE(r.ok()) << r.status();
  std::vector<std::set<int32_t>> out(h);
  if (r.ok()) {
    const v1::SlotDelta& dl = r->deltas(0);
    EXPECT_FALSE(dl.fallback());
    for (int i = 0; i < dl.head_size(); ++i) out[dl.head(i)].insert(dl.chunk(i));
  }
  EXPECT_TRUE(c.Detach(att->attachment_id()).ok());
  return out;
}

std::vector<std::set<int32_t>> Rows(const std::vector<int32_t>& selected, int h) {
  std::vector<std::set<int32_t>> out(h);
  const size_t k = selected.size() / std::max(h, 1);
  for (int hh = 0; hh < h; ++hh) {
    for (size_t x = 0; x < k; ++x) {
      if (selected[hh * k + x] >= 0) out[hh].insert(selected[hh * k + x]);
    }
  }
  return out;
}

double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? integration::MaxRelDiff(a, b.data(), a.size()) : 1e30;
}

struct Decoded {
  v1::CreateSessionResponse session;
  v1::AttachResponse attachment;
  std::unique_ptr<client::LocalDecoder> decoder;
};

client::LocalDecoderOptions CpuDecoder() {
  client::LocalDecoderOptions opt;
  opt.backend = "cpu";
  return opt;
}

// A session of `doc` under `profile`, one attachment, and a same-node decoder over it.
absl::StatusOr<Decoded> OpenDecoded(client::Client& c, const synthetic::Document& doc,
                                    const v1::Profile& profile) {
  Decoded d;
  KVSHADE_ASSIGN_OR_RETURN(d.session, CreateAndIngest(c, doc, profile, -1));
  v1::AttachRequest ar;
  ar.set_session_id(d.session.session_id());
  KVSHADE_ASSIGN_OR_RETURN(d.attachment, c.Attach(ar));
  KVSHADE_ASSIGN_OR_RETURN(d.decoder, client::LocalDecoder::Open(&c, {d.attachment.attachment_id()}, CpuDecoder()));
  return d;
}

struct Options {
  const char* name;
  int rerank = 1;
  float top_p = 0;
  int min_chunks = 0;
  int signature_bits = 0;  // key signatures: stage 2 scores them on both paths
  int unit = 0;            // selection units of this many tokens (0: whole chunks)
};

class DecodePaths : public ::testing::TestWithParam<Options> {};

// Every selection option (key signatures included) selects the same chunks through the daemon and through same-node
// decode, step after step (the decoder's slot tables carry over, the daemon's selection is
// read from a fresh attachment); where every slot is the selection (no mass budget) the
// attention outputs agree too.
TEST_P(DecodePaths, SameSelectionEveryOption) {
  const Options o = GetParam();
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(2048, 5));
  v1::Profile profile = ShadowProfile(16, 8, 4);
  profile.set_rerank_factor(o.rerank);
  profile.set_mass_top_p(o.top_p);
  profile.set_mass_min_chunks(o.min_chunks);
  profile.set_key_signature_bits(o.signature_bits);
  if (o.unit > 0) profile.set_selection_unit(o.unit);
  KV_ASSERT_OK_AND_ASSIGN(one, OpenDecoded(*c, doc, profile));
  auto& [cs, att, dec] = one;
  // Slots of units: the same token budget (8 chunks of C = 8 tokens) in units of u.
  const int upc = o.unit > 0 ? 8 / o.unit : 1;
  EXPECT_EQ(att.slots_per_head(), uint32_t(8 * upc));
  EXPECT_EQ(att.slot_tokens(), uint32_t(8 / upc));
  const auto& spec = doc.spec();
  const int L = spec.layers, h = spec.kv_heads, hq = spec.q_heads, d = spec.head_dim;
  const int64_t pos = spec.doc_tokens;
  std::vector<float> out(size_t(hq) * d);
  int fewer = 0;  // head-steps that selected fewer than k chunks (the mass budget at work)
  for (int step = 0; step < 6; ++step) {
    for (int l = 0; l < L; ++l) {
      const std::vector<bf16> q = QueryBf16(doc, l, 0, step, pos);
      KV_ASSERT_OK(dec->Attend(l, q.data(), nullptr, nullptr, out.data()));
      KV_ASSERT_OK_AND_ASSIGN(sel, dec->Selected(0, l));
      const auto local = Rows(sel, h);
      const auto daemon = DaemonSelection(*c, cs.session_id(), l, q, h, hq, d);
      ASSERT_EQ(daemon.size(), local.size());
      for (int hh = 0; hh < h; ++hh) {
        EXPECT_EQ(local[hh], daemon[hh]) << o.name << " step " << step << " layer " << l << " head " << hh;
        fewer += int(local[hh].size()) < dec->slots_per_head(0, l);
      }
      if (o.top_p == 0) {
        const std::vector<float> ref = AttendRpc(*c, att.attachment_id(), l, q, hq, d);
        EXPECT_LT(MaxRelDiff(ref, out), 1e-5) << o.name << " step " << step << " layer " << l;
      }
    }
  }
  if (o.top_p > 0) {
    EXPECT_GT(fewer, 0) << "the mass budget never cut below k";
  }
  dec.reset();
  KV_ASSERT_OK(c->Detach(att.attachment_id()));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

INSTANTIATE_TEST_SUITE_P(Options, DecodePaths,
                         ::testing::Values(Options{"one_stage"}, Options{"rerank4", 4},
                                           Options{"top_p", 1, 0.5f, 1},
                                           Options{"rerank4_top_p", 4, 0.6f, 2},
                                           Options{"rerank4_sig2", 4, 0, 0, 2},
                                           Options{"rerank4_sig4_top_p", 4, 0.6f, 2, 4},
                                           Options{"rerank4_unit2", 4, 0, 0, 0, 2},
                                           Options{"rerank2_unit1", 2, 0, 0, 0, 1},
                                           Options{"rerank4_unit4_top_p", 4, 0.6f, 4, 0, 4},
                                           Options{"rerank4_sig2_unit2", 4, 0, 0, 2, 2},
                                           Options{"rerank8_sig8_unit2", 8, 0, 0, 8, 2}),
                         [](const auto& info) { return std::string(info.param.name); });

// The recall guard acts alike on both paths: same samples, same recall, same widened
// budgets, and the decoder attends a widened layer as the daemon's Attend does. With
// selection units (`unit` > 0, two stages) recall is counted in units and the budgets in
// chunks: a widened layer has budget * C/u slots.
void GuardWidensAlike(int unit) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(2048, 9));
  v1::Profile profile = ShadowProfile(16, 2, 4);
  const int upc = unit > 0 ? 8 / unit : 1;
  if (unit > 0) {
    profile.set_rerank_factor(2);
    profile.set_selection_unit(unit);
  }
  profile.set_recall_sample_rate(1.0f);
  profile.set_recall_floor(1.0f);  // any sample below full recall counts against the layer
  profile.set_recall_action(v1::RECALL_ACTION_WIDEN);
  KV_ASSERT_OK_AND_ASSIGN(one, OpenDecoded(*c, doc, profile));
  auto& [cs, att, dec] = one;
  const auto& spec = doc.spec();
  const int L = spec.layers, hq = spec.q_heads, d = spec.head_dim;
  const int64_t pos = spec.doc_tokens;
  std::vector<float> out(size_t(hq) * d);
  // Two stages recall the document's queries fully here; with units (two stages) random
  // queries, whose attention the landmarks predict poorly, give the guard low recall.
  std::mt19937_64 rng(77);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto query = [&](int l, int step) {
    if (unit == 0) return QueryBf16(doc, l, 0, step, pos);
    std::vector<bf16> q(size_t(hq) * d);
    for (bf16& x : q) x = kernels::FloatToBf16(2.0f * nd(rng));
    return q;
  };
  for (int step = 0; step < 12; ++step) {
    for (int l = 0; l < L; ++l) {
      const std::vector<bf16> q = query(l, step);
      KV_ASSERT_OK(dec->Attend(l, q.data(), nullptr, nullptr, out.data()));
      const std::vector<float> ref = AttendRpc(*c, att.attachment_id(), l, q, hq, d);
      EXPECT_LT(MaxRelDiff(ref, out), 1e-5) << "step " << step << " layer " << l;
    }
  }
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(cs.session_id(), /*include_selection=*/true));
  KV_ASSERT_OK_AND_ASSIGN(local, dec->Selection(0));
  ASSERT_EQ(int(local.size()), info.selection().layers_size());
  int widened = 0;
  for (size_t i = 0; i < local.size(); ++i) {
    const v1::LayerSelection& dl = info.selection().layers(static_cast<int>(i));
    EXPECT_EQ(uint32_t(local[i].layer), dl.layer());
    EXPECT_EQ(local[i].samples, dl.samples());
    EXPECT_NEAR(local[i].recall, dl.recall(), 1e-12);
    EXPECT_EQ(uint32_t(local[i].budget), dl.budget());
    EXPECT_EQ(static_cast<int>(local[i].fallback), static_cast<int>(dl.fallback()));
    EXPECT_EQ(dec->slots_per_head(0, local[i].layer), std::max<int>(2, local[i].budget) * upc);
    widened += local[i].budget > 2;
  }
  EXPECT_GT(widened, 0) << "the guard never widened a layer: the test proves nothing";
  // The worst layer first.
  for (size_t i = 1; i < local.size(); ++i) EXPECT_LE(local[i - 1].recall, local[i].recall);

  // A select on a widened layer is a fallback: nothing selected or delivered.
  v1::SelectAndReconstructRequest req;
  req.set_layer(static_cast<uint32_t>(local[0].layer));
  auto* sq = req.add_queries();
  sq->set_attachment_id(att.attachment_id());
  *sq->mutable_q() = Bf16Tensor(QueryBf16(doc, local[0].layer, 0, 0, pos), hq, d);
  if (local[0].budget > 2) {
    KV_ASSERT_OK_AND_ASSIGN(r, c->SelectAndReconstruct(req));
    EXPECT_TRUE(r.deltas(0).fallback());
    EXPECT_EQ(r.deltas(0).head_size(), 0);
    EXPECT_EQ(r.deltas(0).selected(), 0u);
  }
  // A new decoder starts from the daemon's widened budgets (carried by the export).
  dec.reset();
  KV_ASSERT_OK_AND_ASSIGN(dec2, client::LocalDecoder::Open(c.get(), {att.attachment_id()}, CpuDecoder()));
  for (const auto& l : local) {
    EXPECT_EQ(dec2->slots_per_head(0, l.layer), std::max<int>(2, l.budget) * upc) << "layer " << l.layer;
  }
  dec2.reset();
  KV_ASSERT_OK(c->Detach(att.attachment_id()));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(DecodePathsGuard, WidensAlikeAndAttendsTheWiderSelection) { GuardWidensAlike(0); }

TEST(DecodePathsGuard, WidensAlikeWithSelectionUnits) { GuardWidensAlike(2); }

// Model-native ids on the same-node path: attending the chunks a step of the profile's
// selection chose gives that step's output; a later step with other ids serves them
// through the slot table (hits stay).
TEST(DecodePathsNative, CallerIdsAttendAsTheirSelection) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(2048, 3));
  const v1::Profile profile = ShadowProfile(16, 8, 4);
  KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*c, doc, profile, -1));
  v1::AttachRequest ar;
  ar.set_session_id(cs.session_id());
  KV_ASSERT_OK_AND_ASSIGN(a1, c->Attach(ar));
  KV_ASSERT_OK_AND_ASSIGN(a2, c->Attach(ar));
  KV_ASSERT_OK_AND_ASSIGN(plain, client::LocalDecoder::Open(c.get(), {a1.attachment_id()}, CpuDecoder()));
  KV_ASSERT_OK_AND_ASSIGN(native, client::LocalDecoder::Open(c.get(), {a2.attachment_id()}, CpuDecoder()));
  const auto& spec = doc.spec();
  const int L = spec.layers, h = spec.kv_heads, hq = spec.q_heads, d = spec.head_dim;
  std::vector<float> o1(size_t(hq) * d), o2(size_t(hq) * d);
  for (int step = 0; step < 4; ++step) {
    for (int l = 0; l < L; ++l) {
      const std::vector<bf16> q = QueryBf16(doc, l, 0, step, spec.doc_tokens);
      KV_ASSERT_OK(plain->Attend(l, q.data(), nullptr, nullptr, o1.data()));
      KV_ASSERT_OK_AND_ASSIGN(sel, plain->Selected(0, l));
      const int k = plain->slots_per_head(0, l);
      ASSERT_EQ(sel.size(), size_t(h) * k);
      KV_ASSERT_OK(native->AttendChunks(l, q.data(), sel.data(), k, nullptr, nullptr, o2.data()));
      EXPECT_LT(MaxRelDiff(o1, o2), 1e-5) << "step " << step << " layer " << l;
    }
  }
  // More ids than slots is refused.
  const std::vector<int32_t> wide(size_t(h) * 64, -1);
  const std::vector<bf16> q = QueryBf16(doc, 0, 0, 0, spec.doc_tokens);
  EXPECT_TRUE(absl::IsInvalidArgument(native->AttendChunks(0, q.data(), wide.data(), 64, nullptr, nullptr,
                                                           o2.data())));
  plain.reset();
  native.reset();
  KV_ASSERT_OK(c->Detach(a1.attachment_id()));
  KV_ASSERT_OK(c->Detach(a2.attachment_id()));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// Model-native ids name whole chunks: a session that selects units refuses them on both
// paths (the daemon's SelectAndReconstruct, the same-node decoder's AttendChunks).
TEST(DecodePathsNative, RefusedWithSelectionUnits) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(2048, 3));
  v1::Profile profile = ShadowProfile(16, 8, 4);
  profile.set_rerank_factor(4);
  profile.set_selection_unit(2);
  KV_ASSERT_OK_AND_ASSIGN(one, OpenDecoded(*c, doc, profile));
  auto& [cs, att, dec] = one;
  const auto& spec = doc.spec();
  const int h = spec.kv_heads, hq = spec.q_heads, d = spec.head_dim;
  const std::vector<int32_t> ids(size_t(h) * 2, 5);
  std::vector<float> out(size_t(hq) * d);
  const std::vector<bf16> q = QueryBf16(doc, 0, 0, 0, spec.doc_tokens);
  const absl::Status local = dec->AttendChunks(0, q.data(), ids.data(), 2, nullptr, nullptr, out.data());
  EXPECT_TRUE(absl::IsInvalidArgument(local)) << local;
  EXPECT_NE(local.message().find("selection_unit"), std::string::npos) << local;
  v1::SelectAndReconstructRequest req;
  req.set_layer(0);
  auto* sq = req.add_queries();
  sq->set_attachment_id(att.attachment_id());
  std::vector<int32_t> one_each = {5, 6};
  v1::Tensor* t = sq->mutable_chunks();
  t->add_shape(h);
  t->add_shape(int64_t(one_each.size()) / h);
  t->set_dtype(v1::DTYPE_INT32);
  t->set_data(reinterpret_cast<const char*>(one_each.data()), one_each.size() * 4);
  auto r = c->SelectAndReconstruct(req);
  EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << r.status();
  EXPECT_NE(r.status().message().find("selection_unit"), std::string::npos) << r.status();
  dec.reset();
  KV_ASSERT_OK(c->Detach(att.attachment_id()));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace decode_paths_test
}  // namespace kvshade::integration

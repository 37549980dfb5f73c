// Slot tables read back and reset (Engine::SlotTable): the table is what the deltas told
// the worker, and after a reset the next select delivers everything again, bit for bit as
// a fresh attachment gets it (the resynchronisation of a worker that lost a response).
#include "kvshade/service/slot_layout.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace slot_table_test {
namespace {

v1::Profile Sparse(int budget) {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(128);
  p.set_sparse_budget(budget);
  return p;
}

absl::StatusOr<v1::SlotTableResponse> Table(Harness& hx, const std::string& att, bool reset) {
  v1::SlotTableRequest r;
  r.set_attachment_id(att);
  r.set_reset(reset);
  return hx.engine->SlotTable(hx.tenant, r);
}

TEST(SlotTableTest, ReadBackIsWhatTheDeltasSaidAndResetRedeliversEverything) {
  Harness hx;
  Stream s = MakeStream(512, hx.model, 21);
  constexpr int kBudget = 8;
  auto o = hx.Open(s, Sparse(kBudget));
  const int h = s.h;

  auto empty = Table(hx, o.attachment, false);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->layers_size(), 0);  // nothing selected yet

  // Two steps on layer 1: the worker's view of its slots, from the deltas.
  std::vector<int32_t> worker(size_t(h) * kBudget, -1);
  const auto q1 = hx.Query(400), q2 = hx.Query(401);
  v1::SlotDelta first;
  for (const auto& q : {q1, q2}) {
    auto d = hx.Select(o.attachment, 1, q);
    ASSERT_TRUE(d.ok()) << d.status();
    if (first.selected() == 0) first = *d;
    for (int i = 0; i < d->head_size(); ++i) {
      worker[size_t(d->head(i)) * kBudget + d->slot(i)] = d->chunk(i);
    }
  }
  auto table = Table(hx, o.attachment, false);
  ASSERT_TRUE(table.ok()) << table.status();
  ASSERT_EQ(table->layers_size(), 1);
  EXPECT_EQ(table->layers(0).layer(), 1u);
  EXPECT_EQ(table->layers(0).slots_per_head(), uint32_t(kBudget));
  ASSERT_EQ(table->layers(0).chunk_size(), h * kBudget);
  for (int i = 0; i < h * kBudget; ++i) EXPECT_EQ(table->layers(0).chunk(i), worker[i]) << i;

  // Reading does not move the table: the same query still hits everything.
  auto again = hx.Select(o.attachment, 1, q2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->head_size(), 0);

  // Reset: the read-back still shows the table as it was; afterwards it is empty and the
  // next select of q1 is what a fresh attachment's first select of q1 was, bit for bit.
  auto before_reset = Table(hx, o.attachment, true);
  ASSERT_TRUE(before_reset.ok());
  ASSERT_EQ(before_reset->layers_size(), 1);
  EXPECT_EQ(before_reset->layers(0).chunk(0), worker[0]);
  auto after = Table(hx, o.attachment, false);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->layers_size(), 0);
  auto redo = hx.Select(o.attachment, 1, q1);
  ASSERT_TRUE(redo.ok()) << redo.status();
  EXPECT_EQ(redo->hits(), 0u);
  EXPECT_EQ(redo->head_size(), first.head_size());
  for (int i = 0; i < first.head_size(); ++i) {
    EXPECT_EQ(redo->head(i), first.head(i));
    EXPECT_EQ(redo->slot(i), first.slot(i));
    EXPECT_EQ(redo->chunk(i), first.chunk(i));
  }
  EXPECT_EQ(redo->keys().data(), first.keys().data());
  EXPECT_EQ(redo->values().data(), first.values().data());
}

TEST(SlotTableTest, OtherTenantsAndUnknownAttachmentsAreRefused) {
  Harness hx;
  Stream s = MakeStream(256, hx.model, 22);
  auto o = hx.Open(s, Sparse(4));
  ASSERT_TRUE(hx.Select(o.attachment, 0, hx.Query(402)).ok());
  Tenant other;
  other.name = "someone-else";
  v1::SlotTableRequest r;
  r.set_attachment_id(o.attachment);
  r.set_reset(true);
  auto theirs = hx.engine->SlotTable(other, r);
  EXPECT_FALSE(theirs.ok());
  EXPECT_EQ(theirs.status().code(), absl::StatusCode::kNotFound) << theirs.status();
  // Their reset did not touch ours.
  auto ours = Table(hx, o.attachment, false);
  ASSERT_TRUE(ours.ok());
  EXPECT_EQ(ours->layers_size(), 1);
  r.set_attachment_id("00000000000000000000000000000000");
  EXPECT_EQ(hx.engine->SlotTable(hx.tenant, r).status().code(), absl::StatusCode::kNotFound);
  r.set_attachment_id(std::string(1000, 'a'));
  EXPECT_EQ(hx.engine->SlotTable(hx.tenant, r).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The slot-buffer layout every delivery writes by: [L, h, slots_per_head] rows of C x d bf16,
// row-major, exactly filling BufferBytes; what Attach reports for a session.
TEST(SlotLayoutTest, RowsAreRowMajorAndFillTheBuffer) {
  ModelInfo model;
  model.layers = 3;
  model.shape.h = 2;
  model.shape.d = 64;
  ProfileInfo profile;
  profile.kind = v1::PROFILE_KIND_SHADOW;
  profile.sparse_budget = 5;
  profile.chunk_size = 8;
  const SlotLayout l = SlotLayout::Of(model, profile);
  EXPECT_EQ(l.RowBytes(), 8u * 64 * 2);
  uint64_t expect = 0;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    for (uint32_t head = 0; head < 2; ++head) {
      for (uint32_t slot = 0; slot < 5; ++slot) EXPECT_EQ(l.Row(layer, head, slot), expect++);
    }
  }
  EXPECT_EQ(l.BufferBytes(), expect * l.RowBytes());
  // Selection units of 2 tokens: 5*8/2 slots of 2 rows, the same bytes.
  profile.selection_unit = 2;
  const SlotLayout u = SlotLayout::Of(model, profile);
  EXPECT_EQ(u.slots_per_head, 20u);
  EXPECT_EQ(u.slot_tokens, 2u);
  EXPECT_EQ(u.RowBytes(), 2u * 64 * 2);
  EXPECT_EQ(u.Row(1, 1, 3), (1u * 2 + 1) * 20 + 3);
  EXPECT_EQ(u.BufferBytes(), l.BufferBytes());
  profile.selection_unit = 0;
  profile.kind = v1::PROFILE_KIND_EXACT;  // selects nothing: no slots, no buffer
  EXPECT_EQ(SlotLayout::Of(model, profile).slots_per_head, 0u);
  EXPECT_EQ(SlotLayout::Of(model, profile).BufferBytes(), 0u);

  // Attach reports the same for a session.
  Harness hx;
  Stream s = MakeStream(256, hx.model, 23);
  auto o = hx.Open(s, Sparse(4));
  v1::AttachRequest ar;
  ar.set_session_id(o.session);
  auto a = hx.engine->Attach(hx.tenant, ar);
  ASSERT_TRUE(a.ok()) << a.status();
  auto g = hx.engine->AttachmentSlots(hx.tenant, a->attachment_id());
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->slots_per_head, 4u);
  EXPECT_EQ(a->slots_per_head(), 4u);
  EXPECT_EQ(a->slot_buffer_bytes(), g->BufferBytes());
  EXPECT_EQ(g->BufferBytes(), uint64_t{uint32_t(hx.model.num_layers())} * s.h * 4 *
                                 a->chunk_size() * s.d * 2);
}

}  // namespace
}  // namespace slot_table_test
}  // namespace kvshade::service::testing

// Integration: RMA delivery of select results over the UCX data plane (tcp,self and
// shm,self), against the real kvshade-server. A worker attached with
// DELIVERY_MODE_UCX_RMA registers host K and V slot buffers; every SelectAndReconstruct
// over UCX must leave them byte-equal to buffers filled by applying the gRPC-inline deltas
// of a twin attachment (same session, same queries), over several decode steps with hits
// and misses. REGISTER is refused for another tenant's attachment, the wrong delivery
// mode, a too-small buffer, and without admission.
#include <fstream>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"
#include "kvshade/client/ucx_data_plane.h"
#include "kvshade/transport/ucx_core.h"

namespace kvshade::integration {
namespace ucx_rma_test {
namespace {

// Slot-buffer geometry of an attachment ([L, h, k, C, d] bf16).
struct Geometry {
  int layers = 0, heads = 0, slots = 0, chunk = 0, dim = 0;
  size_t row() const { return static_cast<size_t>(chunk) * dim; }  // elements per slot
  size_t elements() const { return static_cast<size_t>(layers) * heads * slots * row(); }
};

// Writes an inline delta's keys and values into `k`/`v` at their slots (what a worker
// does with a gRPC reply).
void ApplyInline(const v1::SlotDelta& d, int layer, const Geometry& g, std::vector<uint16_t>* k,
                 std::vector<uint16_t>* v) {
  ASSERT_FALSE(d.delivered());
  const size_t row_bytes = g.row() * 2;
  ASSERT_EQ(d.keys().data().size(), d.head_size() * row_bytes);
  ASSERT_EQ(d.values().data().size(), d.head_size() * row_bytes);
  for (int i = 0; i < d.head_size(); ++i) {
    const size_t row = (static_cast<size_t>(layer) * g.heads + d.head(i)) * g.slots + d.slot(i);
    std::memcpy(k->data() + row * g.row(), d.keys().data().data() + i * row_bytes, row_bytes);
    std::memcpy(v->data() + row * g.row(), d.values().data().data() + i * row_bytes, row_bytes);
  }
}

// Everything of a delta but its id and its bytes (RMA and inline deltas must agree on it).
std::string Shape(v1::SlotDelta d) {
  d.clear_attachment_id();
  d.mutable_keys()->clear_data();
  d.mutable_values()->clear_data();
  d.clear_delivered();
  return d.SerializeAsString();
}

class UcxRmaTest : public ::testing::TestWithParam<std::string> {};

TEST_P(UcxRmaTest, RmaDeliveredSlotBuffersEqualInlineDeltasOfATwin) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  auto g = server.Connect();
  client::ClientOptions uo = UcxClientOptions(GetParam());
  auto u = server.Connect(uo);
  const synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*g, doc, ShadowProfile(), -1));

  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("rma");
  ar.set_delivery(v1::DELIVERY_MODE_UCX_RMA);
  KV_ASSERT_OK_AND_ASSIGN(rma, u->Attach(ar));
  ASSERT_TRUE(u->ucx_connected());
  EXPECT_EQ(rma.delivery(), v1::DELIVERY_MODE_UCX_RMA);
  ar.set_delivery(v1::DELIVERY_MODE_INLINE);
  ar.set_worker_id("inline-on-ucx");
  KV_ASSERT_OK_AND_ASSIGN(plain, u->Attach(ar));   // inline, same UCX connection
  ar.set_worker_id("twin");
  KV_ASSERT_OK_AND_ASSIGN(twin, g->Attach(ar));    // the reference, over gRPC
  ar.set_worker_id("twin2");
  KV_ASSERT_OK_AND_ASSIGN(twin2, g->Attach(ar));

  Geometry geo{doc.spec().layers, doc.spec().kv_heads, static_cast<int>(rma.slots_per_head()),
               static_cast<int>(rma.chunk_size()), doc.spec().head_dim};
  ASSERT_EQ(rma.slot_buffer_bytes(), geo.elements() * 2);
  // A sentinel fill: a slot RMA forgot would differ from the reference only if written.
  std::vector<uint16_t> rk(geo.elements(), 0xBEEF), rv(geo.elements(), 0xBEEF);
  std::vector<uint16_t> ik = rk, iv = rv;
  KV_ASSERT_OK(u->RegisterSlotBuffers(rma.attachment_id(), rk.data(), rv.data(),
                                      rma.slot_buffer_bytes()));

  int misses = 0, hits = 0, misses_inline = 0;
  for (int step = 0; step < 4; ++step) {
    // All layers of a step in flight at once (async), as a pipelined decode would do.
    std::vector<std::future<absl::StatusOr<v1::SelectAndReconstructResponse>>> pending;
    for (int l = 0; l < geo.layers; ++l) {
      pending.push_back(u->SelectAndReconstructAsync(
          MakeSelect(doc, l, {rma.attachment_id(), plain.attachment_id()}, 0, step, 1024)));
    }
    for (int l = 0; l < geo.layers; ++l) {
      KV_ASSERT_OK_AND_ASSIGN(ru, pending[l].get());
      KV_ASSERT_OK_AND_ASSIGN(rg, g->SelectAndReconstruct(MakeSelect(
                                      doc, l, {twin.attachment_id(), twin2.attachment_id()}, 0, step, 1024)));
      ASSERT_EQ(ru.deltas_size(), 2);
      ASSERT_EQ(rg.deltas_size(), 2);
      const v1::SlotDelta& d = ru.deltas(0);
      EXPECT_TRUE(d.delivered()) << "layer " << l << " step " << step;
      EXPECT_TRUE(d.keys().data().empty());
      EXPECT_TRUE(d.values().data().empty());
      EXPECT_EQ(Shape(d), Shape(rg.deltas(0))) << "layer " << l << " step " << step;
      ApplyInline(rg.deltas(0), l, geo, &ik, &iv);
      misses += d.head_size();
      hits += static_cast<int>(d.hits());
      // The unregistered attachment of the same call stays inline, bit for bit.
      EXPECT_FALSE(ru.deltas(1).delivered());
      v1::SlotDelta a = ru.deltas(1), b = rg.deltas(1);
      a.clear_attachment_id();
      b.clear_attachment_id();
      EXPECT_EQ(a.SerializeAsString(), b.SerializeAsString());
      misses_inline += a.head_size();
    }
    ASSERT_TRUE(rk == ik) << "K slot buffers differ after step " << step;
    ASSERT_TRUE(rv == iv) << "V slot buffers differ after step " << step;
  }
  EXPECT_GT(misses, 0) << "no miss was delivered; the comparison would be vacuous";
  EXPECT_GT(hits, 0) << "no step reused a slot";
  EXPECT_GT(misses_inline, 0);
  EXPECT_NE(rk, std::vector<uint16_t>(geo.elements(), 0xBEEF));

  // After Detach (which unregisters first) the buffers are left alone.
  KV_ASSERT_OK(u->Detach(rma.attachment_id()));
  const std::vector<uint16_t> before = rk;
  KV_ASSERT_OK_AND_ASSIGN(after, u->SelectAndReconstruct(
                                     MakeSelect(doc, 0, {plain.attachment_id()}, 1, 7, 1024)));
  EXPECT_FALSE(after.deltas(0).delivered());
  EXPECT_EQ(rk, before);
  EXPECT_EQ(u->ucx_fallbacks(), 0u);
}

TEST_P(UcxRmaTest, RegisterIsRefusedForOthersWrongModeSmallBuffersAndStrangers) {
  TempDir dir;
  ServerProcess server;
  const std::string alice_token = "alice-token-0123456789", bob_token = "bob-token-9876543210";
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam()), "--tenant-token",
                             "alice:" + alice_token, "--tenant-token", "bob:" + bob_token}));
  client::ClientOptions ao, bo;
  ao.bearer_token = alice_token;
  bo.bearer_token = bob_token;
  ao.use_ucx = bo.use_ucx = true;
  ao.ucx_transports = bo.ucx_transports = GetParam();
  auto alice = server.Connect(ao), bob = server.Connect(bo);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(sa, CreateAndIngest(*alice, doc, ShadowProfile(), -1));
  KV_ASSERT_OK_AND_ASSIGN(sb, CreateAndIngest(*bob, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_delivery(v1::DELIVERY_MODE_UCX_RMA);
  ar.set_session_id(sa.session_id());
  KV_ASSERT_OK_AND_ASSIGN(a_rma, alice->Attach(ar));
  ar.set_session_id(sb.session_id());
  KV_ASSERT_OK_AND_ASSIGN(b_rma, bob->Attach(ar));
  ar.set_delivery(v1::DELIVERY_MODE_INLINE);
  KV_ASSERT_OK_AND_ASSIGN(b_inline, bob->Attach(ar));
  ASSERT_TRUE(alice->ucx_connected());
  ASSERT_TRUE(bob->ucx_connected());
  const size_t bytes = b_rma.slot_buffer_bytes();
  ASSERT_GT(bytes, 0u);
  std::vector<uint16_t> k(bytes / 2 + 8), v(bytes / 2 + 8);

  // Alice's attachment, from Bob's connection: unknown to him.
  absl::Status st = bob->RegisterSlotBuffers(a_rma.attachment_id(), k.data(), v.data(), bytes);
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound) << st;
  // An inline attachment cannot take RMA.
  st = bob->RegisterSlotBuffers(b_inline.attachment_id(), k.data(), v.data(), bytes);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  EXPECT_NE(st.message().find("DELIVERY_MODE_UCX_RMA"), std::string::npos) << st;
  // One byte short of the layout.
  st = bob->RegisterSlotBuffers(b_rma.attachment_id(), k.data(), v.data(), bytes - 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find(std::to_string(bytes)), std::string::npos) << st;
  // Garbage instead of rkeys, sent by hand: refused, and the daemon keeps serving.
  auto dp = bob->ucx_data_plane();
  ASSERT_NE(dp, nullptr);
  v1::UcxSlotBuffers junk;
  junk.set_attachment_id(b_rma.attachment_id());
  junk.set_k_address(reinterpret_cast<uint64_t>(k.data()));
  junk.set_v_address(reinterpret_cast<uint64_t>(v.data()));
  junk.set_bytes(bytes);
  junk.set_k_rkey(std::string(9000, '\xff'));
  junk.set_v_rkey("x");
  auto raw = dp->RawAdmittedRequest(transport::ucx::kRegister, junk.SerializeAsString());
  EXPECT_EQ(raw.status().code(), absl::StatusCode::kInvalidArgument) << raw.status();
  // A key-sized blob of 0xff (every md bit set, every length 255) does not frame.
  junk.set_k_rkey(std::string(64, '\xff'));
  junk.set_v_rkey(std::string(64, '\xff'));
  raw = dp->RawAdmittedRequest(transport::ucx::kRegister, junk.SerializeAsString());
  EXPECT_EQ(raw.status().code(), absl::StatusCode::kInvalidArgument) << raw.status();
  // The right one works, and select then delivers.
  KV_ASSERT_OK(bob->RegisterSlotBuffers(b_rma.attachment_id(), k.data(), v.data(), bytes));
  KV_ASSERT_OK_AND_ASSIGN(r, bob->SelectAndReconstruct(MakeSelect(doc, 0, {b_rma.attachment_id()}, 0, 0, 512)));
  EXPECT_TRUE(r.deltas(0).delivered());
  EXPECT_GT(r.deltas(0).head_size(), 0);

  // Without admission, REGISTER and UNREGISTER never reach the engine.
  client::UcxOptions o;
  o.transports = GetParam();
  KV_ASSERT_OK_AND_ASSIGN(stranger, client::UcxDataPlane::ConnectWithoutHello(a_rma.data_plane_address(), o));
  v1::UcxSlotBuffers good;
  good.set_attachment_id(a_rma.attachment_id());
  for (unsigned id : {unsigned{transport::ucx::kRegister}, unsigned{transport::ucx::kUnregister}}) {
    auto denied = stranger->RawRequest(id, std::string(16, 'k'), good.SerializeAsString());
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied) << denied.status();
  }
  // Registration needs the UCX data plane on the client.
  auto grpc_only = server.Connect([&] {
    client::ClientOptions o2;
    o2.bearer_token = bob_token;
    return o2;
  }());
  st = grpc_only->RegisterSlotBuffers(b_rma.attachment_id(), k.data(), v.data(), bytes);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxRmaTest,
                         ::testing::Values(std::string("tcp,self"), std::string("shm,self")),
                         [](const auto& info) {
                           return info.param == "tcp,self" ? std::string("Tcp") : std::string("Shm");
                         });

}  // namespace
}  // namespace ucx_rma_test
}  // namespace kvshade::integration

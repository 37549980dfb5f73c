// The framing of tensor-carrying data-plane messages (kvshade/transport/frame.h): what the
// client's FrameWriter sends, the daemon's AttachParts rebuilds bit for bit, and payloads
// that part_bytes does not describe are refused with a clear error.
#include "kvshade/transport/frame.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>

#include <google/protobuf/util/message_differencer.h>

#include "absl/status/statusor.h"

namespace kvshade::transport {
namespace {

using google::protobuf::util::MessageDifferencer;

v1::Tensor RandomTensor(std::mt19937& rng, int64_t tokens, int64_t heads, int64_t dim) {
  v1::Tensor t;
  t.add_shape(tokens);
  t.add_shape(heads);
  t.add_shape(dim);
  t.set_dtype(v1::DTYPE_BF16);
  std::string data(static_cast<size_t>(tokens * heads * dim * 2), '\0');
  for (char& c : data) c = static_cast<char>(rng());
  t.set_data(std::move(data));
  return t;
}

// What the receiving side does with a frame: parse the body, take the payload (the iov's
// parts back to back, as the active message delivers it), attach.
template <typename M>
absl::StatusOr<M> Unframe(const v1::DataPlaneHeader& h, const FrameWriter::Iov& iov) {
  M body;
  if (!body.ParseFromString(h.body())) return absl::InternalError("body does not parse");
  std::string payload;
  for (const auto& [p, n] : iov) payload.append(static_cast<const char*>(p), n);
  absl::Status st = AttachParts(h, payload, BodyTensors(&body), "test");
  if (!st.ok()) return st;
  return body;
}

v1::AppendTokensRequest SomeAppend(std::mt19937& rng) {
  v1::AppendTokensRequest req;
  req.set_session_id("0123456789abcdef0123456789abcdef");
  req.set_attachment_id("fedcba9876543210fedcba9876543210");
  for (int t : {11, 12, 13}) req.add_token_ids(t);
  for (uint32_t l = 0; l < 4; ++l) {
    v1::LayerKV* kv = req.add_layers();
    kv->set_layer(l);
    *kv->mutable_k() = RandomTensor(rng, 3, 2, 8);
    if (l != 2) *kv->mutable_v() = RandomTensor(rng, 3, 2, 8);  // a tensor left out
  }
  return req;
}

TEST(Frame, AppendRoundTripsBitForBitWithTheBytesOutsideTheBody) {
  std::mt19937 rng(7);
  const v1::AppendTokensRequest req = SomeAppend(rng);
  v1::DataPlaneHeader h;
  FrameWriter::Iov iov = FrameWriter::Frame(req, &h);
  ASSERT_EQ(iov.size(), 7u);  // k of 4 layers, v of 3
  ASSERT_EQ(h.part_bytes_size(), 7);
  EXPECT_LT(h.body().size(), 200u);  // no tensor bytes in the body
  // The parts point into the caller's message (sent from there, not copied).
  EXPECT_EQ(iov[0].first, req.layers(0).k().data().data());
  auto back = Unframe<v1::AppendTokensRequest>(h, iov);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*back, req));
}

TEST(Frame, IngestLayerRoundTripsAndOtherMessagesTravelWhole) {
  std::mt19937 rng(8);
  v1::IngestRequest layer;
  v1::IngestLayer* l = layer.mutable_layer();
  l->set_layer(5);
  l->set_token_offset(1024);
  l->set_last_part(true);
  *l->mutable_k() = RandomTensor(rng, 16, 2, 8);
  *l->mutable_v() = RandomTensor(rng, 16, 2, 8);
  *l->mutable_observation_queries() = RandomTensor(rng, 4, 8, 8);
  v1::DataPlaneHeader h;
  FrameWriter::Iov iov = FrameWriter::Frame(layer, &h);
  ASSERT_EQ(iov.size(), 3u);
  auto back = Unframe<v1::IngestRequest>(h, iov);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*back, layer));

  v1::IngestRequest header;
  header.mutable_header()->set_session_id("abc");
  v1::DataPlaneHeader hh;
  EXPECT_TRUE(FrameWriter::Frame(header, &hh).empty());
  EXPECT_EQ(hh.part_bytes_size(), 0);
  auto hb = Unframe<v1::IngestRequest>(hh, {});
  ASSERT_TRUE(hb.ok()) << hb.status();
  EXPECT_TRUE(MessageDifferencer::Equals(*hb, header));
}

// The sender's order is the receiver's: each part lands in the tensor it came from.
TEST(Frame, PartsFollowBodyTensorsOrder) {
  std::mt19937 rng(9);
  v1::AppendTokensRequest req = SomeAppend(rng);
  v1::DataPlaneHeader h;
  FrameWriter::Iov iov = FrameWriter::Frame(req, &h);
  std::vector<v1::Tensor*> order = BodyTensors(&req);
  ASSERT_EQ(order.size(), iov.size());
  for (size_t i = 0; i < iov.size(); ++i) {
    EXPECT_EQ(iov[i].first, order[i]->data().data()) << i;
    EXPECT_EQ(h.part_bytes(static_cast<int>(i)), order[i]->data().size()) << i;
  }
}

TEST(Frame, PayloadsThatPartBytesDoesNotDescribeAreRefused) {
  std::mt19937 rng(10);
  const v1::AppendTokensRequest req = SomeAppend(rng);
  v1::DataPlaneHeader good;
  FrameWriter::Iov iov = FrameWriter::Frame(req, &good);
  std::string payload;
  for (const auto& [p, n] : iov) payload.append(static_cast<const char*>(p), n);

  auto attach = [&](const v1::DataPlaneHeader& h, std::string bytes) {
    v1::AppendTokensRequest body;
    EXPECT_TRUE(body.ParseFromString(h.body()));
    return AttachParts(h, bytes, BodyTensors(&body), "AppendTokens");
  };
  ASSERT_TRUE(attach(good, payload).ok());

  // Truncated payload.
  absl::Status st = attach(good, payload.substr(0, payload.size() - 1));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("ucx AppendTokens: part_bytes"), std::string::npos) << st;
  // Trailing bytes.
  EXPECT_EQ(attach(good, payload + "x").code(), absl::StatusCode::kInvalidArgument);
  // One part too few, one too many.
  v1::DataPlaneHeader fewer = good;
  fewer.mutable_part_bytes()->RemoveLast();
  EXPECT_EQ(attach(fewer, payload).code(), absl::StatusCode::kInvalidArgument);
  v1::DataPlaneHeader more = good;
  more.add_part_bytes(0);
  EXPECT_EQ(attach(more, payload).code(), absl::StatusCode::kInvalidArgument);
  // Sizes whose sum wraps around 2^64 to the payload's size.
  v1::DataPlaneHeader wrap = good;
  wrap.set_part_bytes(0, UINT64_MAX);
  wrap.set_part_bytes(1, good.part_bytes(0) + good.part_bytes(1) + 1);
  st = attach(wrap, payload);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("more than the payload's"), std::string::npos) << st;
}

}  // namespace
}  // namespace kvshade::transport

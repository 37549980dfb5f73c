// The binary decode frames (kvshade/transport/decode_frame.h): what one side writes the
// other reads back bit for bit, and malformed frames (truncated, wrong lengths, unknown
// dtypes, counts the payload cannot hold, trailing bytes) are refused with an error that
// names the entry and field, never read past the payload.
#include "kvshade/transport/decode_frame.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace kvshade::transport::frame {
namespace {

std::string RandomBytes(std::mt19937& rng, size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng());
  return s;
}

TEST(DecodeFrame, HeaderRoundTripsAndRejectsGarbage) {
  FrameHeader h;
  h.kind = kSelect;
  h.request_id = 0x0123456789abcdefull;
  h.key = std::string(kKeyBytes, 'k');
  h.code = 5;
  h.layer = 31;
  h.count = 24;
  const std::string bytes = EncodeHeader(h);
  ASSERT_EQ(bytes.size(), kHeaderBytes);
  auto back = DecodeHeader(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->kind, h.kind);
  EXPECT_EQ(back->request_id, h.request_id);
  EXPECT_EQ(back->key, h.key);
  EXPECT_EQ(back->code, h.code);
  EXPECT_EQ(back->layer, h.layer);
  EXPECT_EQ(back->count, h.count);

  EXPECT_FALSE(DecodeHeader(bytes.substr(0, kHeaderBytes - 1)).ok());  // truncated
  std::string bad_magic = bytes;
  bad_magic[0] ^= 1;
  EXPECT_FALSE(DecodeHeader(bad_magic).ok());
  std::string bad_kind = bytes;
  bad_kind[4] = 9;
  auto k = DecodeHeader(bad_kind);
  ASSERT_FALSE(k.ok());
  EXPECT_NE(k.status().message().find("unknown kind 9"), std::string::npos) << k.status();
  // A protobuf header (what the other data-plane messages carry) is not a frame header.
  EXPECT_FALSE(DecodeHeader(std::string("\x08\x01\x1a\x10", 4) + std::string(16, 'k')).ok());
}

TEST(DecodeFrame, QueriesRoundTrip) {
  std::mt19937 rng(7);
  const std::string q0 = RandomBytes(rng, 32 * 128 * 2), chunks = RandomBytes(rng, 8 * 5 * 4);
  const std::string q1 = RandomBytes(rng, 4 * 64 * 4);
  std::string body;
  QueryRef a;
  a.attachment_id = "attachment-a";
  a.q = {1, 32, 128, q0};
  QueryRef b;
  b.attachment_id = "b";
  b.q = {3, 4, 64, q1};
  b.chunks = {4, 8, 5, chunks};
  AppendQuery(a, &body);
  AppendQuery(b, &body);
  auto qs = ParseQueries(body, 2, kSelect);
  ASSERT_TRUE(qs.ok()) << qs.status();
  ASSERT_EQ(qs->size(), 2u);
  EXPECT_EQ((*qs)[0].attachment_id, "attachment-a");
  EXPECT_EQ((*qs)[0].q.dtype, 1);
  EXPECT_EQ((*qs)[0].q.rows, 32u);
  EXPECT_EQ((*qs)[0].q.cols, 128u);
  EXPECT_EQ((*qs)[0].q.data, q0);
  EXPECT_FALSE((*qs)[0].chunks.present());
  EXPECT_FALSE((*qs)[0].k_new.present());
  EXPECT_EQ((*qs)[1].attachment_id, "b");
  EXPECT_EQ((*qs)[1].q.data, q1);
  EXPECT_EQ((*qs)[1].chunks.dtype, 4);
  EXPECT_EQ((*qs)[1].chunks.rows, 8u);
  EXPECT_EQ((*qs)[1].chunks.cols, 5u);
  EXPECT_EQ((*qs)[1].chunks.data, chunks);

  // ATTEND: q, k_new, v_new.
  const std::string kn = RandomBytes(rng, 8 * 128 * 2), vn = RandomBytes(rng, 8 * 128 * 2);
  QueryRef c;
  c.attachment_id = "c";
  c.q = {1, 32, 128, q0};
  c.k_new = {1, 8, 128, kn};
  c.v_new = {1, 8, 128, vn};
  c.stage = true;
  c.stage_token_id = 1234;
  std::string abody;
  AppendQuery(c, &abody);
  auto as = ParseQueries(abody, 1, kAttend);
  ASSERT_TRUE(as.ok()) << as.status();
  EXPECT_EQ((*as)[0].k_new.data, kn);
  EXPECT_EQ((*as)[0].v_new.data, vn);
  EXPECT_FALSE((*as)[0].chunks.present());
  EXPECT_TRUE((*as)[0].stage);
  EXPECT_EQ((*as)[0].stage_token_id, 1234);
  EXPECT_FALSE((*qs)[1].stage);
  // A select query may stage too, beside model-native chunks: all four tensors.
  QueryRef d = c;
  d.chunks = {4, 8, 5, chunks};
  std::string sbody;
  AppendQuery(d, &sbody);
  auto ss = ParseQueries(sbody, 1, kSelect);
  ASSERT_TRUE(ss.ok()) << ss.status();
  EXPECT_EQ((*ss)[0].q.data, q0);
  EXPECT_EQ((*ss)[0].chunks.data, chunks);
  EXPECT_EQ((*ss)[0].k_new.data, kn);
  EXPECT_EQ((*ss)[0].v_new.data, vn);
  EXPECT_TRUE((*ss)[0].stage);
  EXPECT_EQ((*ss)[0].stage_token_id, 1234);
  // The select's purpose travels in the flags.
  for (uint8_t purpose : {0, 1, 2}) {
    QueryRef e = d;
    e.purpose = purpose;
    std::string pbody;
    AppendQuery(e, &pbody);
    auto ps = ParseQueries(pbody, 1, kSelect);
    ASSERT_TRUE(ps.ok()) << ps.status();
    EXPECT_EQ((*ps)[0].purpose, purpose);
    EXPECT_TRUE((*ps)[0].stage);
    EXPECT_FALSE((*ps)[0].hold);
    // A held staged token (stage_hold) travels beside the purpose.
    e.hold = true;
    std::string hbody;
    AppendQuery(e, &hbody);
    auto hs = ParseQueries(hbody, 1, kSelect);
    ASSERT_TRUE(hs.ok()) << hs.status();
    EXPECT_TRUE((*hs)[0].hold);
    EXPECT_EQ((*hs)[0].purpose, purpose);
    if (purpose != 0) EXPECT_FALSE(ParseQueries(pbody, 1, kAttend).ok());  // attend has none
  }
  // An attend query carries no chunks.
  auto wrong = ParseQueries(sbody, 1, kAttend);
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(std::string(wrong.status().message()).find("carries no chunks"), std::string::npos) << wrong.status();
}

TEST(DecodeFrame, MalformedQueriesAreRefusedWithoutOverreading) {
  std::mt19937 rng(11);
  const std::string q = RandomBytes(rng, 4 * 16 * 2);
  QueryRef a;
  a.attachment_id = "att";
  a.q = {1, 4, 16, q};
  std::string body;
  AppendQuery(a, &body);
  ASSERT_TRUE(ParseQueries(body, 1, kSelect).ok());

  auto expect_bad = [](absl::StatusOr<std::vector<QueryRef>> r, std::string_view needle) {
    ASSERT_FALSE(r.ok()) << needle;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(r.status().message()).find(needle), std::string::npos) << r.status();
  };
  // Every truncation of a valid frame is refused (and, under ASan, reads nothing past it).
  for (size_t n = 0; n < body.size(); ++n) {
    auto r = ParseQueries(std::string_view(body).substr(0, n), 1, kSelect);
    EXPECT_FALSE(r.ok()) << "truncated to " << n;
  }
  expect_bad(ParseQueries(body.substr(0, body.size() - 1), 1, kSelect), "entry 0: q needs 128 bytes");
  expect_bad(ParseQueries(body + "x", 1, kSelect), "1 bytes after the last of 1 queries");
  expect_bad(ParseQueries(body, 2, kSelect), "entry 1: the entry needs 44 bytes, 0 left");
  expect_bad(ParseQueries(body, 0xffffffffu, kSelect), "queries cannot fit");
  // A shape larger than the bytes: rows say 4000.
  std::string big = body;
  const uint32_t rows = 4000;
  std::memcpy(big.data() + 8, &rows, 4);
  expect_bad(ParseQueries(big, 1, kSelect), "entry 0: q needs 128000 bytes");
  // An id longer than the payload.
  std::string long_id = body;
  const uint16_t id_len = 60000;
  std::memcpy(long_id.data(), &id_len, 2);
  expect_bad(ParseQueries(long_id, 1, kSelect), "entry 0: attachment_id needs 60000 bytes");
  // Unknown dtype; an absent tensor with a shape.
  std::string dt = body;
  dt[2] = 9;
  expect_bad(ParseQueries(dt, 1, kSelect), "q has unknown dtype 9");
  std::string flagged = body;
  flagged[6] = 16;
  expect_bad(ParseQueries(flagged, 1, kSelect), "unknown flags 16/0");
  std::string hold_alone = body;
  hold_alone[6] = 8;  // hold without stage
  expect_bad(ParseQueries(hold_alone, 1, kSelect), "unknown flags 8/0");
  std::string no_purpose = body;
  no_purpose[6] = 6;  // purpose bits 3
  expect_bad(ParseQueries(no_purpose, 1, kSelect), "unknown flags 6/0");
  std::string reserved = body;
  reserved[7] = 1;
  expect_bad(ParseQueries(reserved, 1, kSelect), "unknown flags 0/1");
  std::string ghost = body;
  const uint32_t one = 1;
  std::memcpy(ghost.data() + 16, &one, 4);  // chunks rows, chunks dtype 0
  expect_bad(ParseQueries(ghost, 1, kSelect), "chunks is absent (dtype 0) but has a shape");
}

TEST(DecodeFrame, DeltasRoundTripAndTruncationsFail) {
  std::mt19937 rng(3);
  const std::vector<uint32_t> head = {0, 0, 1}, slot = {2, 3, 0};
  const std::vector<int32_t> chunk = {10, 11, 40};
  const std::vector<int64_t> position = {80, 88, int64_t{3} << 33};  // past 32 bits
  const std::string keys = RandomBytes(rng, 3 * 8 * 64 * 2), values = RandomBytes(rng, 3 * 8 * 64 * 2);
  std::string body;
  DeltaRef rows;
  rows.chunk_size = 8;
  rows.head_dim = 64;
  rows.selected = 16;
  rows.hits = 13;
  rows.misses = 3;
  rows.head = head.data();
  rows.slot = slot.data();
  rows.chunk = chunk.data();
  rows.position = position.data();
  rows.keys = keys;
  rows.values = values;
  rows.fallback = true;
  rows.tokens = uint64_t{5} << 33;  // past 32 bits
  AppendDelta(rows, &body);
  DeltaRef delivered = rows;
  delivered.keys = delivered.values = {};
  delivered.delivered = true;
  delivered.fallback = false;
  AppendDelta(delivered, &body);
  DeltaRef empty;
  empty.chunk_size = 8;
  empty.head_dim = 64;
  AppendDelta(empty, &body);

  auto ds = ParseDeltas(body, 3);
  ASSERT_TRUE(ds.ok()) << ds.status();
  ASSERT_EQ(ds->size(), 3u);
  const Delta& a = (*ds)[0];
  EXPECT_EQ(a.head, head);
  EXPECT_EQ(a.slot, slot);
  EXPECT_EQ(a.chunk, chunk);
  EXPECT_EQ(a.position, position);
  EXPECT_EQ(a.keys, keys);
  EXPECT_EQ(a.values, values);
  EXPECT_EQ(a.selected, 16u);
  EXPECT_EQ(a.hits, 13u);
  EXPECT_TRUE(a.fallback);
  EXPECT_FALSE(a.delivered);
  EXPECT_EQ(a.tokens, uint64_t{5} << 33);
  const Delta& b = (*ds)[1];
  EXPECT_TRUE(b.delivered);
  EXPECT_TRUE(b.keys.empty());
  EXPECT_EQ(b.head, head);
  EXPECT_EQ(b.position, position);
  EXPECT_TRUE((*ds)[2].head.empty());
  EXPECT_EQ((*ds)[2].tokens, 0u);
  EXPECT_EQ((*ds)[2].chunk_size, 8u);

  for (size_t n = 0; n < body.size(); n += 7) {
    EXPECT_FALSE(ParseDeltas(std::string_view(body).substr(0, n), 3).ok()) << n;
  }
  EXPECT_FALSE(ParseDeltas(body, 4).ok());
  EXPECT_FALSE(ParseDeltas(body + "zz", 3).ok());
}

TEST(DecodeFrame, OutputsRoundTrip) {
  std::mt19937 rng(5);
  const std::string out = RandomBytes(rng, 32 * 128 * 4), lse = RandomBytes(rng, 32 * 4);
  std::string body;
  AppendOutput({32, 128, 7, out, lse}, &body);
  AppendOutput({32, 128, 8, out, lse}, &body);
  auto os = ParseOutputs(body, 2);
  ASSERT_TRUE(os.ok()) << os.status();
  EXPECT_EQ((*os)[1].query_heads, 32u);
  EXPECT_EQ((*os)[1].head_dim, 128u);
  EXPECT_EQ((*os)[0].tokens, 7u);
  EXPECT_EQ((*os)[1].tokens, 8u);
  EXPECT_EQ((*os)[1].output, out);
  EXPECT_EQ((*os)[1].lse, lse);
  EXPECT_FALSE(ParseOutputs(std::string_view(body).substr(0, body.size() - 4), 2).ok());
  EXPECT_FALSE(ParseOutputs(body, 3).ok());
}

}  // namespace
}  // namespace kvshade::transport::frame

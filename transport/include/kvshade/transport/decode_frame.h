// Binary frames of the UCX data plane's decode calls (SELECT_FRAME, ATTEND_FRAME and their
// FRAME_REPLY): a fixed little-endian header as the active message's header and the
// entries as its payload, no protobuf on either side. The one definition both the client
// (writer of requests, reader of replies) and the daemon (reader of requests, writer of
// replies) use; docs/API.md "UCX data plane" documents the layout for other clients.
//
// Requests: FrameHeader{kind SELECT or ATTEND, request_id, connection key, layer, count}
// then `count` query entries, each a 44-byte fixed part (id length, dtypes, flags, rows and
// cols of four tensors, the staged token id) followed by its attachment id and its
// tensors' bytes in the order q, chunks (SELECT only), k_new, v_new; absent ones take none.
// Replies: FrameHeader{kind REPLY, request_id, code, count}; on code 0 `count` entries
// (SELECT: a 32-byte DeltaEntry (counts, flags, the session's length) + head[m] u32 +
// slot[m] u32 + chunk[m] i32 + position[m] i64 (each chunk's first token) + keys and
// values [m, C, d] bf16 when the rows travel;
// ATTEND: a 16-byte entry (hq, d, the session's length) + output [hq, d] f32 + lse [hq]
// f32), else the error message.
//
// Readers check every length against the bytes at hand and return INVALID_ARGUMENT naming
// the entry and field; parsed views point into the caller's buffer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvshade::transport::frame {

constexpr uint32_t kMagic = 0x3246564b;  // "KVF2" (KVF1: deltas without positions)
constexpr size_t kKeyBytes = 16;         // the connection key HELLO hands out

enum Kind : uint16_t { kSelect = 1, kAttend = 2, kReply = 3 };

// Element types: the values of v1.DType (BF16 1, FP16 2, FP32 3, INT32 4) so that either
// side maps them without a table.
struct FrameHeader {
  uint16_t kind = 0;
  uint64_t request_id = 0;
  std::string key;        // requests: kKeyBytes of connection key
  int32_t code = 0;       // replies: absl status code (0 = entries follow)
  uint32_t layer = 0;     // requests
  uint32_t count = 0;     // queries (requests) or entries (replies)
};
constexpr size_t kHeaderBytes = 48;
std::string EncodeHeader(const FrameHeader& h);
absl::StatusOr<FrameHeader> DecodeHeader(std::string_view bytes);

// A tensor inside a frame: dtype, up to two dimensions, and its bytes (a view).
struct TensorRef {
  uint8_t dtype = 0;  // 0: absent
  uint32_t rows = 0, cols = 0;
  std::string_view data;
  bool present() const { return dtype != 0; }
};

struct QueryRef {
  std::string_view attachment_id;
  TensorRef q;
  TensorRef chunks;        // SELECT only: model-native selection, INT32 [h, m]
  TensorRef k_new, v_new;  // the step's new token, [h, d] (ATTEND: attended; both: staged)
  bool stage = false;      // stage the new token as `stage_token_id`
  int32_t stage_token_id = 0;
  bool hold = false;       // with stage: hold the token for CommitStaged (stage_hold)
  uint8_t purpose = 0;     // SELECT only: v1.SelectPurpose (0 synchronous, 1 speculative, 2 correction)
};

// Requests. The writer appends one query's entry to `body`; the reader parses `count`
// queries of `body` (views into it).
void AppendQuery(const QueryRef& q, std::string* body);
absl::StatusOr<std::vector<QueryRef>> ParseQueries(std::string_view body, uint32_t count,
                                                   Kind kind);

// SELECT replies: one delta per query, in request order.
struct DeltaRef {
  uint32_t chunk_size = 0, head_dim = 0;  // chunk_size: rows per miss (C, or the selection unit)
  uint32_t selected = 0, hits = 0;
  bool delivered = false, fallback = false;
  uint64_t tokens = 0;  // the session's length after the call
  uint32_t misses = 0;
  const uint32_t* head = nullptr;  // the writer's arrays / views into the reader's buffer
  const uint32_t* slot = nullptr;  // (unaligned on the reader's side: read with memcpy,
  const int32_t* chunk = nullptr;  // or use the copies ParseDeltas makes)
  const int64_t* position = nullptr;
  std::string_view keys, values;  // [misses, chunk_size, d] bf16, or empty when not carried
};
void AppendDelta(const DeltaRef& d, std::string* body);
struct Delta {
  uint32_t chunk_size = 0, head_dim = 0, selected = 0, hits = 0;
  bool delivered = false, fallback = false;
  uint64_t tokens = 0;
  std::vector<uint32_t> head, slot;
  std::vector<int32_t> chunk;
  std::vector<int64_t> position;
  std::string_view keys, values;
};
absl::StatusOr<std::vector<Delta>> ParseDeltas(std::string_view body, uint32_t count);

// ATTEND replies: one output per query.
struct OutputRef {
  uint32_t query_heads = 0, head_dim = 0;
  uint64_t tokens = 0;           // the session's length after the call
  std::string_view output, lse;  // f32 [hq, d] and [hq]
};
void AppendOutput(const OutputRef& o, std::string* body);
absl::StatusOr<std::vector<OutputRef>> ParseOutputs(std::string_view body, uint32_t count);

// Bytes of one element of a frame dtype (0 for an unknown one).
size_t ElementBytes(uint8_t dtype);

}  // namespace kvshade::transport::frame

// Fuzz target: the UCX data plane's message parsing on the daemon's side (service/
// ucx_server.cc), the bytes a connected client controls: the DataPlaneHeader of an active
// message, the request in its body, and the binary frame that gives the body's tensors their
// bytes from the payload (transport/frame.cc, SplitParts and AttachParts); and the worker
// address a client decodes (DecodeWorkerAddress). Every input must parse or be refused with a status; a frame
// that is accepted must give each tensor exactly its part of the payload, and framing the
// result again (FrameWriter, the client's side) must give back the same part sizes and bytes.
//
// The same input also goes through the binary decode frames (transport/decode_frame.cc):
// the header as a frame header, the payload as `byte 0 >> 2` SELECT queries (byte 0 bit 1
// clear) or ATTEND queries (set), and as that many SELECT-reply deltas and ATTEND-reply
// outputs (the client's side). Whatever parses must stay inside the payload and come back
// the same when written again and re-read.
//
// Input: byte 0 picks the body (even: IngestRequest, odd: AppendTokensRequest); u16 header
// length (little-endian); the header bytes; the rest is the payload.
//
// KVSHADE_FUZZ_WRITE_SEED=<dir>: writes framed INGEST and APPEND messages (as the client
// frames them) into <dir> and exits (fuzz/corpus/ucx_fuzzer/).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvshade/transport/decode_frame.h"
#include "kvshade/transport/frame.h"
#include "kvshade/transport/ucx_core.h"
#include "kvshade/v1/kvshade.pb.h"

namespace {

using namespace kvshade;

template <typename Req>
void CheckFrame(const v1::DataPlaneHeader& h, const std::string& payload) {
  Req body;
  if (!body.ParseFromString(h.body())) return;  // refused before framing (ucx_server.cc)
  std::string consumed = payload;
  const std::vector<v1::Tensor*> parts = transport::BodyTensors(&body);
  // The daemon's ingest path takes views (SplitParts); append copies (AttachParts). Both
  // accept and refuse the same frames, and the views tile the payload in order.
  auto views = transport::SplitParts(h, payload, parts.size(), "fuzz");
  absl::Status st = transport::AttachParts(h, consumed, parts, "fuzz");
  if (views.ok() != st.ok()) std::abort();
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument || st.message().empty()) std::abort();
    return;
  }
  size_t at = 0;
  for (std::string_view v : *views) {
    if (v.data() != payload.data() + at && !v.empty()) std::abort();
    at += v.size();
  }
  if (at != payload.size() || views->size() != parts.size()) std::abort();
  // Accepted: the parts are the payload, in order, part_bytes each.
  size_t off = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& data = parts[i]->data();
    if (data.size() != h.part_bytes(int(i))) std::abort();
    if (payload.compare(off, data.size(), data) != 0) std::abort();
    off += data.size();
  }
  if (off != payload.size()) std::abort();
  // The client's framing of the same request gives the same parts.
  v1::DataPlaneHeader again;
  const transport::FrameWriter::Iov iov = transport::FrameWriter::Frame(body, &again);
  if (again.part_bytes_size() != h.part_bytes_size() || iov.size() != parts.size()) std::abort();
  std::string joined;
  for (size_t i = 0; i < iov.size(); ++i) {
    if (again.part_bytes(int(i)) != h.part_bytes(int(i)) || iov[i].second != h.part_bytes(int(i))) {
      std::abort();
    }
    joined.append(static_cast<const char*>(iov[i].first), iov[i].second);
  }
  if (joined != payload) std::abort();
}

namespace frame = transport::frame;

bool Inside(std::string_view part, const std::string& payload) {
  return part.empty() || (part.data() >= payload.data() &&
                          part.data() + part.size() <= payload.data() + payload.size());
}

bool SameTensor(const frame::TensorRef& a, const frame::TensorRef& b) {
  return a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols && a.data == b.data;
}

void CheckDecodeFrames(uint8_t pick, const std::string& header, const std::string& payload) {
  if (auto h = frame::DecodeHeader(header); h.ok()) {
    auto again = frame::DecodeHeader(frame::EncodeHeader(*h));
    if (!again.ok() || again->kind != h->kind || again->request_id != h->request_id ||
        again->key != h->key || again->code != h->code || again->layer != h->layer ||
        again->count != h->count) {
      std::abort();
    }
  }
  const uint32_t count = pick >> 2;
  const frame::Kind kind = (pick & 2) ? frame::kAttend : frame::kSelect;
  if (auto qs = frame::ParseQueries(payload, count, kind); qs.ok()) {
    std::string body;
    for (const frame::QueryRef& q : *qs) {
      if (!Inside(q.attachment_id, payload) || !Inside(q.q.data, payload) || !Inside(q.chunks.data, payload) ||
          !Inside(q.k_new.data, payload) || !Inside(q.v_new.data, payload) ||
          (kind == frame::kAttend && q.chunks.present())) {
        std::abort();
      }
      frame::AppendQuery(q, &body);
    }
    auto again = frame::ParseQueries(body, count, kind);
    if (!again.ok() || again->size() != qs->size()) std::abort();
    for (size_t i = 0; i < qs->size(); ++i) {
      const frame::QueryRef &a = (*qs)[i], &b = (*again)[i];
      if (a.attachment_id != b.attachment_id || !SameTensor(a.q, b.q) || !SameTensor(a.chunks, b.chunks) ||
          !SameTensor(a.k_new, b.k_new) || !SameTensor(a.v_new, b.v_new) || a.stage != b.stage ||
          a.stage_token_id != b.stage_token_id || a.purpose != b.purpose || a.purpose > 2) {
        std::abort();
      }
    }
  } else if (qs.status().code() != absl::StatusCode::kInvalidArgument) {
    std::abort();
  }
  if (auto ds = frame::ParseDeltas(payload, count); ds.ok()) {
    for (const frame::Delta& d : *ds) {
      if (d.slot.size() != d.head.size() || d.chunk.size() != d.head.size() ||
          d.position.size() != d.head.size() ||
          !Inside(d.keys, payload) || !Inside(d.values, payload) || d.keys.size() != d.values.size()) {
        std::abort();
      }
    }
  }
  if (auto os = frame::ParseOutputs(payload, count); os.ok()) {
    for (const frame::OutputRef& o : *os) {
      if (!Inside(o.output, payload) || !Inside(o.lse, payload) ||
          o.output.size() != uint64_t{o.query_heads} * o.head_dim * 4 || o.lse.size() != uint64_t{o.query_heads} * 4) {
        std::abort();
      }
    }
  }
}

void WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

template <typename Req>
std::string Seed(uint8_t kind, const Req& msg) {
  v1::DataPlaneHeader h;
  h.set_request_id(7);
  h.set_connection_key("0123456789abcdef");
  const transport::FrameWriter::Iov iov = transport::FrameWriter::Frame(msg, &h);
  const std::string header = h.SerializeAsString();
  std::string out(1, char(kind));
  out.push_back(char(header.size() & 0xff));
  out.push_back(char(header.size() >> 8));
  out += header;
  for (const auto& [p, n] : iov) out.append(static_cast<const char*>(p), n);
  return out;
}

v1::Tensor Tensor(std::vector<int64_t> shape, char fill) {
  v1::Tensor t;
  size_t n = 2;
  for (int64_t s : shape) {
    t.add_shape(s);
    n *= size_t(s);
  }
  t.set_dtype(v1::DTYPE_BF16);
  t.set_data(std::string(n, fill));
  return t;
}

void WriteSeeds(const std::string& dir) {
  v1::IngestRequest layer;
  v1::IngestLayer* il = layer.mutable_layer();
  il->set_layer(1);
  il->set_token_offset(4);
  *il->mutable_k() = Tensor({4, 2, 8}, 'k');
  *il->mutable_v() = Tensor({4, 2, 8}, 'v');
  *il->mutable_observation_queries() = Tensor({2, 4, 8}, 'q');
  il->set_last_part(true);
  WriteFile(dir + "/ingest_layer", Seed(0, layer));
  v1::IngestRequest header;
  header.mutable_header()->set_session_id("0123456789abcdef0123456789abcdef");
  WriteFile(dir + "/ingest_header", Seed(0, header));
  v1::AppendTokensRequest ap;
  ap.set_session_id("0123456789abcdef0123456789abcdef");
  ap.add_token_ids(5);
  for (int l = 0; l < 2; ++l) {
    v1::LayerKV* kv = ap.add_layers();
    kv->set_layer(l);
    *kv->mutable_k() = Tensor({1, 2, 8}, char('a' + l));
    *kv->mutable_v() = Tensor({1, 2, 8}, char('c' + l));
  }
  WriteFile(dir + "/append", Seed(1, ap));
  {
    // A SELECT frame of one query and an ATTEND frame of one query with k_new and v_new.
    frame::FrameHeader fh;
    fh.kind = frame::kSelect;
    fh.request_id = 9;
    fh.key = "0123456789abcdef";
    fh.count = 1;
    const std::string q(4 * 8 * 2, 'q'), kv(2 * 8 * 2, 'k');
    frame::QueryRef ref;
    ref.attachment_id = "0123456789abcdef0123456789abcdef";
    ref.q = {1, 4, 8, q};
    std::string body;
    frame::AppendQuery(ref, &body);
    const std::string h = frame::EncodeHeader(fh);
    auto seed = [&](uint8_t pick, const std::string& hdr, const std::string& payload) {
      std::string out(1, char(pick));
      out.push_back(char(hdr.size() & 0xff));
      out.push_back(char(hdr.size() >> 8));
      return out + hdr + payload;
    };
    WriteFile(dir + "/select_frame", seed(1 << 2, h, body));
    ref.k_new = {1, 2, 8, kv};
    ref.v_new = {1, 2, 8, kv};
    ref.stage = true;
    ref.stage_token_id = 42;
    std::string sbody;
    frame::AppendQuery(ref, &sbody);
    WriteFile(dir + "/select_stage_frame", seed(1 << 2, h, sbody));
    std::string abody;
    frame::AppendQuery(ref, &abody);
    fh.kind = frame::kAttend;
    WriteFile(dir + "/attend_frame", seed((1 << 2) | 2, frame::EncodeHeader(fh), abody));
    const uint32_t head[2] = {0, 1}, slot[2] = {3, 4};
    const int32_t chunk[2] = {7, 9};
    const int64_t position[2] = {56, 72};
    const std::string rows(2 * 8 * 8 * 2, 'r');
    frame::DeltaRef d;
    d.chunk_size = 8;
    d.head_dim = 8;
    d.selected = 4;
    d.hits = 2;
    d.misses = 2;
    d.head = head;
    d.slot = slot;
    d.chunk = chunk;
    d.position = position;
    d.keys = rows;
    d.values = rows;
    d.tokens = 4097;
    std::string dbody;
    frame::AppendDelta(d, &dbody);
    fh.kind = frame::kReply;
    WriteFile(dir + "/select_reply", seed(1 << 2, frame::EncodeHeader(fh), dbody));
  }
  WriteFile(dir + "/worker_address",
            std::string(1, char(2)) + std::string(2, '\0') + transport::ucx::EncodeWorkerAddress("\x01\x02raw"));
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("KVSHADE_FUZZ_WRITE_SEED")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  const size_t header_len = std::min<size_t>(size - 3, data[1] | (size_t(data[2]) << 8));
  const std::string header_bytes(reinterpret_cast<const char*>(data) + 3, header_len);
  const std::string payload(reinterpret_cast<const char*>(data) + 3 + header_len,
                            size - 3 - header_len);
  // The worker address a client decodes from AttachResponse.data_plane_address.
  auto address = transport::ucx::DecodeWorkerAddress(payload);
  if (address.ok() && transport::ucx::EncodeWorkerAddress(*address) != payload) {
    // Not every accepted text is canonical; the decoded bytes must round-trip.
    auto again = transport::ucx::DecodeWorkerAddress(transport::ucx::EncodeWorkerAddress(*address));
    if (!again.ok() || *again != *address) std::abort();
  }
  CheckDecodeFrames(data[0], header_bytes, payload);
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(header_bytes)) return 0;  // refused: "not a DataPlaneHeader"
  if (data[0] % 2 == 0) {
    CheckFrame<v1::IngestRequest>(h, payload);
  } else {
    CheckFrame<v1::AppendTokensRequest>(h, payload);
  }
  return 0;
}

// Fuzz target: the UCX data plane's message parsing on the daemon's side (service/
// ucx_server.cc), the bytes a connected client controls: the DataPlaneHeader of an active
// message, the request in its body, and the binary frame that gives the body's tensors their
// bytes from the payload (transport/frame.cc, AttachParts); and the worker address a client
// decodes (DecodeWorkerAddress). Every input must parse or be refused with a status; a frame
// that is accepted must give each tensor exactly its part of the payload, and framing the
// result again (FrameWriter, the client's side) must give back the same part sizes and bytes.
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
  absl::Status st = transport::AttachParts(h, consumed, parts, "fuzz");
  if (!st.ok()) {
    if (st.code() != absl::StatusCode::kInvalidArgument || st.message().empty()) std::abort();
    return;
  }
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
  v1::DataPlaneHeader h;
  if (!h.ParseFromString(header_bytes)) return 0;  // refused: "not a DataPlaneHeader"
  if (data[0] % 2 == 0) {
    CheckFrame<v1::IngestRequest>(h, payload);
  } else {
    CheckFrame<v1::AppendTokensRequest>(h, payload);
  }
  return 0;
}

// Framing of the data plane's tensor-carrying messages (frame.h).
#include "kvshade/transport/frame.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include <google/protobuf/field_mask.pb.h>
#include <google/protobuf/util/field_mask_util.h>

#include "absl/strings/str_cat.h"

namespace kvshade::transport {
namespace {

// `t` without its bytes (shape, dtype, a CUDA IPC reference if any) into `out`; its bytes
// become the next payload part.
void FrameTensor(const v1::Tensor& t, v1::Tensor* out, v1::DataPlaneHeader* header,
                 FrameWriter::Iov* iov) {
  *out->mutable_shape() = t.shape();
  out->set_dtype(t.dtype());
  if (t.has_cuda_ipc()) *out->mutable_cuda_ipc() = t.cuda_ipc();
  iov->emplace_back(t.data().data(), t.data().size());
  header->add_part_bytes(t.data().size());
}

// Every field of `src` but those named in `except` (the tensors, framed separately) into
// `dst`: fields added to the request later travel in the body without a change here.
void CopyAllBut(const google::protobuf::Message& src,
                std::initializer_list<std::string_view> except, google::protobuf::Message* dst) {
  google::protobuf::FieldMask mask;
  const google::protobuf::Descriptor* d = src.GetDescriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    const std::string& name = d->field(i)->name();
    if (std::find(except.begin(), except.end(), name) == except.end()) mask.add_paths(name);
  }
  google::protobuf::util::FieldMaskUtil::MergeMessageTo(
      src, mask, google::protobuf::util::FieldMaskUtil::MergeOptions(), dst);
}

}  // namespace

std::vector<v1::Tensor*> BodyTensors(v1::IngestRequest* msg) {
  std::vector<v1::Tensor*> parts;
  if (!msg->has_layer()) return parts;
  v1::IngestLayer* l = msg->mutable_layer();
  if (l->has_k()) parts.push_back(l->mutable_k());
  if (l->has_v()) parts.push_back(l->mutable_v());
  if (l->has_observation_queries()) parts.push_back(l->mutable_observation_queries());
  return parts;
}

std::vector<v1::Tensor*> BodyTensors(v1::AppendTokensRequest* msg) {
  std::vector<v1::Tensor*> parts;
  for (v1::LayerKV& l : *msg->mutable_layers()) {
    if (l.has_k()) parts.push_back(l.mutable_k());
    if (l.has_v()) parts.push_back(l.mutable_v());
  }
  return parts;
}

// The two Frame()s visit the tensors in BodyTensors order (the framing test checks it
// against BodyTensors of the parsed body).
FrameWriter::Iov FrameWriter::Frame(const v1::IngestRequest& msg, v1::DataPlaneHeader* header) {
  Iov iov;
  if (!msg.has_layer()) {  // only a layer part carries tensors
    header->set_body(msg.SerializeAsString());
    return iov;
  }
  v1::IngestRequest framed;  // built field by field: the bytes are the bulk of the message
  const v1::IngestLayer& l = msg.layer();
  v1::IngestLayer* fl = framed.mutable_layer();
  CopyAllBut(l, {"k", "v", "observation_queries"}, fl);
  if (l.has_k()) FrameTensor(l.k(), fl->mutable_k(), header, &iov);
  if (l.has_v()) FrameTensor(l.v(), fl->mutable_v(), header, &iov);
  if (l.has_observation_queries()) {
    FrameTensor(l.observation_queries(), fl->mutable_observation_queries(), header, &iov);
  }
  header->set_body(framed.SerializeAsString());
  return iov;
}

FrameWriter::Iov FrameWriter::Frame(const v1::AppendTokensRequest& msg,
                                    v1::DataPlaneHeader* header) {
  Iov iov;
  v1::AppendTokensRequest framed;
  CopyAllBut(msg, {"layers"}, &framed);
  for (const v1::LayerKV& l : msg.layers()) {
    v1::LayerKV* fl = framed.add_layers();
    CopyAllBut(l, {"k", "v"}, fl);
    if (l.has_k()) FrameTensor(l.k(), fl->mutable_k(), header, &iov);
    if (l.has_v()) FrameTensor(l.v(), fl->mutable_v(), header, &iov);
  }
  header->set_body(framed.SerializeAsString());
  return iov;
}

absl::StatusOr<std::vector<std::string_view>> SplitParts(const v1::DataPlaneHeader& h,
                                                         std::string_view payload,
                                                         size_t n_parts, std::string_view what) {
  uint64_t total = 0;
  for (uint64_t b : h.part_bytes()) {
    if (b > payload.size() - std::min<uint64_t>(total, payload.size())) {
      total = UINT64_MAX;  // more than the payload holds (also keeps the sum from overflowing)
      break;
    }
    total += b;
  }
  if (static_cast<size_t>(h.part_bytes_size()) != n_parts || total != payload.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx ", std::string(what), ": part_bytes (", h.part_bytes_size(), " parts, ",
        total == UINT64_MAX ? std::string("more than the payload's") : absl::StrCat(total),
        " bytes) does not describe the payload (", n_parts, " tensors in the body, ",
        payload.size(), " bytes)"));
  }
  std::vector<std::string_view> out;
  out.reserve(n_parts);
  size_t off = 0;
  for (uint64_t b : h.part_bytes()) {
    out.push_back(payload.substr(off, b));
    off += b;
  }
  return out;
}

absl::Status AttachParts(const v1::DataPlaneHeader& h, std::string& payload,
                         const std::vector<v1::Tensor*>& parts, std::string_view what) {
  auto views = SplitParts(h, payload, parts.size(), what);
  if (!views.ok()) return views.status();
  // Every part but the first is copied out; the first takes the payload's buffer itself
  // (truncated in place): one copy less of the largest message the daemon receives.
  for (size_t i = 1; i < parts.size(); ++i) parts[i]->set_data((*views)[i].data(), (*views)[i].size());
  if (!parts.empty()) {
    payload.resize(h.part_bytes(0));
    parts[0]->set_data(std::move(payload));
  }
  payload.clear();
  return absl::OkStatus();
}

}  // namespace kvshade::transport

// The framing of the UCX data plane's tensor-carrying messages (INGEST, APPEND), defined
// once for both sides: the client frames with FrameWriter, the daemon unframes with
// SplitParts (views) or AttachParts (into the message), and both walk a message's tensors in the order BodyTensors gives.
//
// A framed message is a DataPlaneHeader whose `body` is the request with every tensor's
// shape and dtype but no data, and whose payload is the tensors' bytes concatenated in
// BodyTensors order, part_bytes[i] bytes each (sent by rendezvous straight from the
// caller's buffers, no copy on the sending side).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/v1/kvshade.pb.h"

namespace kvshade::transport {

// The tensors of a message in wire order; the pointers point into `msg`.
// IngestRequest: the layer's k, v, observation_queries (those present, in that order);
// nothing for a header, commit or any other message.
std::vector<v1::Tensor*> BodyTensors(v1::IngestRequest* msg);
// AppendTokensRequest: k then v (those present) of each layer, in layer-list order.
std::vector<v1::Tensor*> BodyTensors(v1::AppendTokensRequest* msg);

// Sender side. Frames one request: Frame() copies it into the body without tensor bytes
// and records where the bytes are; the caller's message must stay alive (and unchanged)
// until the send has completed.
class FrameWriter {
 public:
  using Iov = std::vector<std::pair<const void*, size_t>>;
  // Fills header->body and header->part_bytes; returns the payload parts (the tensors'
  // bytes, in place in `msg`).
  static Iov Frame(const v1::IngestRequest& msg, v1::DataPlaneHeader* header);
  static Iov Frame(const v1::AppendTokensRequest& msg, v1::DataPlaneHeader* header);
};

// Receiver side, without copies: the `n_parts` byte ranges part_bytes describes, as views
// of `payload`. INVALID_ARGUMENT naming `what` when part_bytes does not describe the
// payload (a different number of parts than `n_parts`, the body's tensor count, or sizes
// that do not add up to the payload's).
absl::StatusOr<std::vector<std::string_view>> SplitParts(const v1::DataPlaneHeader& header,
                                                         std::string_view payload,
                                                         size_t n_parts, std::string_view what);

// Receiver side, into a message. Gives each tensor of `parts` (BodyTensors of the parsed body) its bytes:
// part_bytes[i] bytes each, in order, from `payload`, which is consumed. INVALID_ARGUMENT
// naming `what` when part_bytes does not describe the payload (a different number of parts
// than the body's tensors, or sizes that do not add up to the payload's).
absl::Status AttachParts(const v1::DataPlaneHeader& header, std::string& payload,
                         const std::vector<v1::Tensor*>& parts, std::string_view what);

}  // namespace kvshade::transport

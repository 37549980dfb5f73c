// The one place where absl::Status becomes grpc::Status (and back, for tests): Abseil's
// codes are gRPC's codes one to one, so the mapping is a cast; the message is kept, cut to
// kMaxErrorMessageBytes. Also the bounds on what an error may echo of a request
// (docs/API.md "Errors").
#pragma once

#include <cstddef>
#include <string>

#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvshade::service {

// Session and attachment ids are 32 hex digits; a request naming a longer id than this is
// INVALID_ARGUMENT (before any lookup, so existence is not revealed either way).
inline constexpr size_t kMaxIdBytes = 128;
// At most this much of an id is echoed in an error message.
inline constexpr size_t kEchoedIdBytes = 64;
// An error message travels in gRPC trailers, which clients cap (8 KiB by default; over it
// the client sees RESOURCE_EXHAUSTED instead of the real code): messages are cut here.
inline constexpr size_t kMaxErrorMessageBytes = 1024;

// An id as an error message shows it: C-escaped (printable), and past kEchoedIdBytes cut,
// with an ellipsis and the id's length: "0123...cdef... (10240 bytes)".
inline std::string BoundedId(absl::string_view id) {
  if (id.size() <= kEchoedIdBytes) return absl::CHexEscape(id);
  return absl::StrCat(absl::CHexEscape(id.substr(0, kEchoedIdBytes)), "... (", id.size(),
                      " bytes)");
}

// INVALID_ARGUMENT when `id` is longer than kMaxIdBytes; `what` names it ("session id").
inline absl::Status CheckIdLength(absl::string_view id, absl::string_view what) {
  if (id.size() <= kMaxIdBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, " must be at most ", kMaxIdBytes,
                                                 " bytes, got ", id.size(), " bytes ('",
                                                 BoundedId(id), "')"));
}

// `message` cut to kMaxErrorMessageBytes (at a UTF-8 character boundary), saying so.
inline std::string BoundedMessage(absl::string_view message) {
  if (message.size() <= kMaxErrorMessageBytes) return std::string(message);
  size_t n = kMaxErrorMessageBytes - 64;  // room for the note
  while (n > 0 && (static_cast<unsigned char>(message[n]) & 0xC0) == 0x80) --n;
  return absl::StrCat(message.substr(0, n), "... (message cut; ", message.size(), " bytes)");
}

inline grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())),
                      BoundedMessage(s.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(static_cast<int>(s.error_code())),
                      s.error_message());
}

}  // namespace kvshade::service

// The daemon's log (spdlog's default logger, on stderr): text or JSON lines, and structured
// events. docs/OPERATIONS.md ("Logs") lists every event and its fields.
//
//   log::Event(spdlog::level::info, "session_created").Str("session", id).Uint("tokens", n);
//
// emits one line when the full expression ends (nothing is formatted when the level is off):
//   text: 2026-12-01T10:00:00.123 info kvshade-server: session_created session=ab.. tokens=5
//   json: {"ts":"2026-12-01T10:00:00.123Z","level":"info","logger":"kvshade-server",
//          "event":"session_created","session":"ab..","tokens":5}
// Plain spdlog::info(...) lines stay valid in JSON: {"ts":...,"level":...,"msg":"..."}.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvshade::service::log {

enum class Format { kText, kJson };

// "text" or "json".
absl::StatusOr<Format> ParseFormat(std::string_view name);
std::string_view FormatName(Format f);

// Installs the format and level on spdlog's default logger (stderr). Call once at start-up,
// before threads log; `program` names the logger ("kvshade-server").
void Configure(spdlog::level::level_enum level, Format format, std::string_view program);
Format CurrentFormat();

// Routes UCX's own messages (ucs log) into this log instead of UCX's fprintf to stderr, at
// the matching level, as event "ucx" with the UCX source file and line. UCX's level follows
// ours where UCX_LOG_LEVEL is not set: warn at info and above, info at debug, debug at trace.
// Idempotent.
void InstallUcxLogHandler();

// Routes gRPC's own messages (gpr_log) into this log, as event "grpc" with gRPC's source file
// and line, instead of gRPC's stderr format. gRPC's verbosity follows ours where
// GRPC_VERBOSITY is not set: error at info and above, info at debug, debug at trace. Call
// before the first gRPC object. Idempotent.
void InstallGrpcLogHandler();

// One structured line (see the file comment). Keys are plain identifiers; string values are
// escaped (JSON) or quoted when they hold spaces, quotes or '=' (text).
class Event {
 public:
  Event(spdlog::level::level_enum level, std::string_view name);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  Event& Str(std::string_view key, std::string_view value);
  Event& Int(std::string_view key, int64_t value);
  Event& Uint(std::string_view key, uint64_t value);
  Event& Num(std::string_view key, double value);
  Event& Bool(std::string_view key, bool value);
  // code (the gRPC code name) and error (the message) of a non-OK status.
  Event& Status(const absl::Status& s);
  // The human-readable part: "msg" in JSON, the end of the line in text.
  Event& Msg(std::string_view text);

 private:
  void Key(std::string_view key);
  spdlog::level::level_enum level_;
  bool on_;
  std::string line_;
  std::string msg_;
};

// One finished RPC (gRPC or the UCX data plane): debug for OK and for the caller's own
// errors (INVALID_ARGUMENT, NOT_FOUND, ...), warn for refusals under load or state
// (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ABORTED), error for an internal cause
// (INTERNAL, UNKNOWN, DATA_LOSS, UNIMPLEMENTED). Event "rpc": method, code, ms, tenant,
// error.
void Rpc(std::string_view method, const absl::Status& st, double seconds, std::string_view tenant);

// The level Rpc() uses for a code.
spdlog::level::level_enum RpcLevel(absl::StatusCode code);

}  // namespace kvshade::service::log

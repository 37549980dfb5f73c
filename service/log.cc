// The daemon's log format (log.h): a pattern per format on spdlog's default logger, a custom
// flag that writes the JSON payload (an event's fields, or a plain line's escaped text),
// the event builder and UCX's log handler.
#include "kvshade/service/log.h"

#include <grpc/support/log.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/ansicolor_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include "absl/strings/str_cat.h"

namespace kvshade::service::log {
namespace {

// An event's payload in JSON mode starts with this byte: the flag formatter then copies
// the fields as they are (they are already JSON) instead of escaping the text.
constexpr char kFieldsMark = '\x1e';

std::atomic<Format> g_format{Format::kText};

void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out->append("\\\""); break;
      case '\\': out->append("\\\\"); break;
      case '\n': out->append("\\n"); break;
      case '\r': out->append("\\r"); break;
      case '\t': out->append("\\t"); break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out->append(buf);
        } else {
          out->push_back(ch);
        }
    }
  }
  out->push_back('"');
}

bool NeedsQuotes(std::string_view s) {
  if (s.empty()) return true;
  for (const char c : s) {
    if (c == ' ' || c == '"' || c == '=' || c == '\\' || static_cast<unsigned char>(c) < 0x20) return true;
  }
  return false;
}

// %* in the JSON pattern: "event":..,fields.. for an event, "msg":"<escaped>" otherwise.
class JsonPayloadFlag : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    const std::string_view p(msg.payload.data(), msg.payload.size());
    if (!p.empty() && p.front() == kFieldsMark) {
      dest.append(p.data() + 1, p.data() + p.size());
      return;
    }
    std::string s = "\"msg\":";
    AppendJsonString(p, &s);
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonPayloadFlag>(); }
};

spdlog::level::level_enum FromUcs(ucs_log_level_t l) {
  switch (l) {
    case UCS_LOG_LEVEL_FATAL: return spdlog::level::critical;
    case UCS_LOG_LEVEL_ERROR: return spdlog::level::err;
    case UCS_LOG_LEVEL_WARN: return spdlog::level::warn;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO:
    case UCS_LOG_LEVEL_PRINT: return spdlog::level::info;
    case UCS_LOG_LEVEL_DEBUG: return spdlog::level::debug;
    default: return spdlog::level::trace;
  }
}

ucs_log_func_rc_t UcxHandler(const char* file, unsigned line, const char* /*function*/, ucs_log_level_t level,
                             const ucs_log_component_config_t* comp, const char* format, va_list ap) {
  if (comp != nullptr && level > comp->log_level && level != UCS_LOG_LEVEL_PRINT) {
    return UCS_LOG_FUNC_RC_CONTINUE;  // below UCX's own threshold: nothing to say
  }
  char text[1024];
  va_list copy;
  va_copy(copy, ap);
  std::vsnprintf(text, sizeof(text), format, copy);
  va_end(copy);
  const char* base = file == nullptr ? "" : file;
  if (const char* slash = std::strrchr(base, '/')) base = slash + 1;
  Event(FromUcs(level), "ucx").Str("component", comp != nullptr ? comp->name : "").Str("file", base)
      .Uint("line", line).Msg(text);
  return UCS_LOG_FUNC_RC_STOP;  // not also UCX's fprintf
}

void GrpcHandler(gpr_log_func_args* args) {
  const spdlog::level::level_enum level = args->severity == GPR_LOG_SEVERITY_ERROR  ? spdlog::level::err
                                          : args->severity == GPR_LOG_SEVERITY_INFO ? spdlog::level::info
                                                                                    : spdlog::level::debug;
  const char* base = args->file == nullptr ? "" : args->file;
  if (const char* slash = std::strrchr(base, '/')) base = slash + 1;
  Event(level, "grpc").Str("file", base).Uint("line", static_cast<uint64_t>(args->line))
      .Msg(args->message == nullptr ? "" : args->message);
}

}  // namespace

absl::StatusOr<Format> ParseFormat(std::string_view name) {
  if (name == "text") return Format::kText;
  if (name == "json") return Format::kJson;
  return absl::InvalidArgumentError(absl::StrCat("log format must be text or json, got '", std::string(name), "'"));
}

std::string_view FormatName(Format f) { return f == Format::kJson ? "json" : "text"; }

Format CurrentFormat() { return g_format.load(std::memory_order_relaxed); }

void Configure(spdlog::level::level_enum level, Format format, std::string_view program) {
  g_format.store(format, std::memory_order_relaxed);
  std::shared_ptr<spdlog::logger> logger;
  if (format == Format::kJson) {
    // No colours: every line is one JSON object, timestamps in UTC.
    logger = std::make_shared<spdlog::logger>(std::string(program),
                                              std::make_shared<spdlog::sinks::stderr_sink_mt>());
    auto f = std::make_unique<spdlog::pattern_formatter>(spdlog::pattern_time_type::utc);
    f->add_flag<JsonPayloadFlag>('*').set_pattern(
        R"({"ts":"%Y-%m-%dT%H:%M:%S.%fZ","level":"%l","logger":"%n","pid":%P,"thread":%t,%*})");
    logger->set_formatter(std::move(f));
  } else {
    logger = std::make_shared<spdlog::logger>(std::string(program),
                                              std::make_shared<spdlog::sinks::ansicolor_stderr_sink_mt>());
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ %n: %v");
  }
  logger->set_level(level);
  // Errors are rare and matter: they reach stderr at once even when it is a file or pipe.
  logger->flush_on(spdlog::level::warn);
  spdlog::set_default_logger(std::move(logger));
}

void InstallUcxLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("UCX_LOG_LEVEL") == nullptr) {
      const auto ours = spdlog::default_logger_raw()->level();
      ucs_global_opts.log_component.log_level = ours <= spdlog::level::trace   ? UCS_LOG_LEVEL_DEBUG
                                                : ours <= spdlog::level::debug ? UCS_LOG_LEVEL_INFO
                                                                               : UCS_LOG_LEVEL_WARN;
    }
    ucs_log_push_handler(&UcxHandler);
  });
}

void InstallGrpcLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (std::getenv("GRPC_VERBOSITY") == nullptr) {
      const auto ours = spdlog::default_logger_raw()->level();
      gpr_set_log_verbosity(ours <= spdlog::level::trace   ? GPR_LOG_SEVERITY_DEBUG
                            : ours <= spdlog::level::debug ? GPR_LOG_SEVERITY_INFO
                                                           : GPR_LOG_SEVERITY_ERROR);
    }
    gpr_set_log_function(&GrpcHandler);
  });
}

// --- Event --------------------------------------------------------------------------------

Event::Event(spdlog::level::level_enum level, std::string_view name)
    : level_(level), on_(spdlog::default_logger_raw()->should_log(level)) {
  if (!on_) return;
  if (CurrentFormat() == Format::kJson) {
    line_.push_back(kFieldsMark);
    line_.append("\"event\":");
    AppendJsonString(name, &line_);
  } else {
    line_.append(name);
  }
}

void Event::Key(std::string_view key) {
  if (CurrentFormat() == Format::kJson) {
    line_.push_back(',');
    AppendJsonString(key, &line_);
    line_.push_back(':');
  } else {
    line_.push_back(' ');
    line_.append(key);
    line_.push_back('=');
  }
}

Event& Event::Str(std::string_view key, std::string_view value) {
  if (!on_) return *this;
  Key(key);
  if (CurrentFormat() == Format::kJson || NeedsQuotes(value)) {
    AppendJsonString(value, &line_);
  } else {
    line_.append(value);
  }
  return *this;
}

Event& Event::Int(std::string_view key, int64_t value) {
  if (!on_) return *this;
  Key(key);
  absl::StrAppend(&line_, value);
  return *this;
}

Event& Event::Uint(std::string_view key, uint64_t value) {
  if (!on_) return *this;
  Key(key);
  absl::StrAppend(&line_, value);
  return *this;
}

Event& Event::Num(std::string_view key, double value) {
  if (!on_) return *this;
  Key(key);
  if (!std::isfinite(value)) {
    line_.append(CurrentFormat() == Format::kJson ? "null" : "nan");
  } else {
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", value);
    line_.append(buf);
  }
  return *this;
}

Event& Event::Bool(std::string_view key, bool value) {
  if (!on_) return *this;
  Key(key);
  line_.append(value ? "true" : "false");
  return *this;
}

Event& Event::Status(const absl::Status& s) {
  if (!on_ || s.ok()) return *this;
  Str("code", absl::StatusCodeToString(s.code()));
  Str("error", std::string_view(s.message().data(), s.message().size()));
  return *this;
}

Event& Event::Msg(std::string_view text) {
  if (on_) msg_.assign(text);
  return *this;
}

Event::~Event() {
  if (!on_) return;
  if (!msg_.empty()) {
    if (CurrentFormat() == Format::kJson) {
      line_.append(",\"msg\":");
      AppendJsonString(msg_, &line_);
    } else {
      absl::StrAppend(&line_, " -- ", msg_);
    }
  }
  spdlog::default_logger_raw()->log(level_, "{}", line_);
}

// --- RPCs ---------------------------------------------------------------------------------

spdlog::level::level_enum RpcLevel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kUnimplemented:
      return spdlog::level::err;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kAborted:
    case absl::StatusCode::kUnauthenticated:
    case absl::StatusCode::kPermissionDenied:
      return spdlog::level::warn;
    default:
      return spdlog::level::debug;
  }
}

void Rpc(std::string_view method, const absl::Status& st, double seconds, std::string_view tenant) {
  Event e(RpcLevel(st.code()), "rpc");
  e.Str("method", method).Str("code", absl::StatusCodeToString(st.code())).Num("ms", seconds * 1e3);
  if (!tenant.empty()) e.Str("tenant", tenant);
  if (!st.ok()) e.Str("error", std::string_view(st.message().data(), st.message().size()));
}

}  // namespace kvshade::service::log

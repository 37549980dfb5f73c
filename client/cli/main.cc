// `kvshade`: the command-line tool of the kvshade KV-cache service.
//   kvshade serve [server flags...]        exec kvshade-server with the same flags
//   kvshade status [--wait [SECONDS]]      health (grpc.health.v1) and server stats; --wait
//                                          alone waits up to 30 s for SERVING
//   kvshade sessions list|info ID|close ID
//   kvshade lookup --layers ... --tokens 1,2,3
//   kvshade demo [...]                     synthetic prefix-cached document QA (demo.h),
//                                          over the UCX data plane when the daemon offers
//                                          it (--ucx requires it, --no-ucx: gRPC inline)
//   kvshade doctor [--local]               UCX transports, CUDA visibility, memlock limit,
//                                          test transfer to the daemon (doctor.h)
// Connection flags (before or after the command): --target (env KVSHADE_TARGET),
// --token (env KVSHADE_TOKEN), --tls, --ca, --cert, --key, --server-name, --timeout,
// --ucx-transports (env KVSHADE_UCX_TRANSPORTS; UCX_TLS of the client's UCX worker).
// Exit codes: 0 success, 1 an RPC (or a check) failed, 2 bad usage, 3 the server is not
// SERVING, 4 the demo was given --ucx and ran over gRPC (fallback).
#include <unistd.h>

#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "demo.h"
#include "doctor.h"
#include "kvshade/client/client.h"
#include "kvshade/version.h"

namespace {

using kvshade::client::Client;
using kvshade::client::ClientOptions;

std::string Env(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v ? std::string(v) : fallback;
}

// --json output: the proto3 JSON mapping as protobuf prints it (field names as in the
// .proto, every field, enums by name, bytes in base64, one space of indent per level),
// except that integers of every width are JSON numbers. Protobuf's printer quotes 64-bit
// integers (exact beyond 2^53 for JavaScript readers), so `jq '.sessions > 0'` and friends
// compared strings; the CLI's figures are counts and bytes, well below 2^53.
void AppendJsonString(std::string_view s, std::string* out) {
  out->push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': *out += "\\\""; break;
      case '\\': *out += "\\\\"; break;
      case '\b': *out += "\\b"; break;
      case '\f': *out += "\\f"; break;
      case '\n': *out += "\\n"; break;
      case '\r': *out += "\\r"; break;
      case '\t': *out += "\\t"; break;
      default:
        if (c < 0x20 || c == 0x7f) {
          *out += absl::StrFormat("\\u%04x", c);
        } else {
          out->push_back(ch);  // UTF-8 passes through
        }
    }
  }
  out->push_back('"');
}

// A finite float or double in the shortest form that reads back to the same value; NaN and
// the infinities as the strings the proto3 mapping uses.
template <typename T>
void AppendJsonFloat(T v, std::string* out) {
  if (std::isnan(v)) {
    *out += "\"NaN\"";
  } else if (std::isinf(v)) {
    *out += v > 0 ? "\"Infinity\"" : "\"-Infinity\"";
  } else {
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof(buf), v);
    out->append(buf, r.ptr);
  }
}

void AppendJsonMessage(const google::protobuf::Message& m, int indent, std::string* out);

// One value of field `f` of `m` (element `index` of a repeated field; -1: singular).
void AppendJsonValue(const google::protobuf::Message& m, const google::protobuf::FieldDescriptor* f,
                     int index, int indent, std::string* out) {
  using FD = google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FD::CPPTYPE_INT32: absl::StrAppend(out, rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f)); break;
    case FD::CPPTYPE_INT64: absl::StrAppend(out, rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f)); break;
    case FD::CPPTYPE_UINT32: absl::StrAppend(out, rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f)); break;
    case FD::CPPTYPE_UINT64: absl::StrAppend(out, rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f)); break;
    case FD::CPPTYPE_DOUBLE: AppendJsonFloat(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f), out); break;
    case FD::CPPTYPE_FLOAT: AppendJsonFloat(rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f), out); break;
    case FD::CPPTYPE_BOOL: *out += (rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false"; break;
    case FD::CPPTYPE_ENUM: {
      const int v = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const google::protobuf::EnumValueDescriptor* e = f->enum_type()->FindValueByNumber(v);
      if (e != nullptr) {
        AppendJsonString(e->name(), out);
      } else {
        absl::StrAppend(out, v);  // a value this build does not know: its number
      }
      break;
    }
    case FD::CPPTYPE_STRING: {
      const std::string v = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      AppendJsonString(f->type() == FD::TYPE_BYTES ? absl::Base64Escape(v) : v, out);
      break;
    }
    case FD::CPPTYPE_MESSAGE:
      AppendJsonMessage(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f), indent, out);
      break;
  }
}

void AppendJsonMessage(const google::protobuf::Message& m, int indent, std::string* out) {
  using FD = google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  if (d->file()->name().rfind("google/protobuf/", 0) == 0) {
    // Well-known types (Timestamp, Duration, wrappers, ...) have JSON forms of their own.
    std::string wkt;
    google::protobuf::util::JsonPrintOptions opts;
    opts.always_print_primitive_fields = true;
    opts.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(m, &wkt, opts);
    *out += wkt;
    return;
  }
  const google::protobuf::Reflection* r = m.GetReflection();
  const std::string pad(indent + 1, ' ');
  bool first = true;
  *out += "{";
  for (int i = 0; i < d->field_count(); ++i) {
    const FD* f = d->field(i);
    // Unset messages, oneof members and proto3 optionals are left out, as protobuf does.
    if (!f->is_repeated() && f->has_presence() && !r->HasField(m, f)) continue;
    *out += first ? "\n" : ",\n";
    first = false;
    *out += pad;
    AppendJsonString(f->name(), out);
    *out += ": ";
    if (f->is_map()) {
      const int n = r->FieldSize(m, f);
      if (n == 0) {
        *out += "{}";
        continue;
      }
      const std::string inner(indent + 2, ' ');
      *out += "{";
      for (int j = 0; j < n; ++j) {
        const google::protobuf::Message& entry = r->GetRepeatedMessage(m, f, j);
        const FD* key = entry.GetDescriptor()->map_key();
        std::string key_text;
        if (key->cpp_type() == FD::CPPTYPE_STRING) {
          key_text = entry.GetReflection()->GetString(entry, key);
        } else {
          AppendJsonValue(entry, key, -1, 0, &key_text);  // a number or true/false
        }
        *out += j == 0 ? "\n" : ",\n";
        *out += inner;
        AppendJsonString(key_text, out);
        *out += ": ";
        AppendJsonValue(entry, entry.GetDescriptor()->map_value(), -1, indent + 2, out);
      }
      *out += "\n" + pad + "}";
    } else if (f->is_repeated()) {
      const int n = r->FieldSize(m, f);
      if (n == 0) {
        *out += "[]";
        continue;
      }
      const std::string inner(indent + 2, ' ');
      *out += "[";
      for (int j = 0; j < n; ++j) {
        *out += j == 0 ? "\n" : ",\n";
        *out += inner;
        AppendJsonValue(m, f, j, indent + 2, out);
      }
      *out += "\n" + pad + "]";
    } else {
      AppendJsonValue(m, f, -1, indent + 1, out);
    }
  }
  *out += first ? "}" : "\n" + std::string(indent, ' ') + "}";
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  AppendJsonMessage(m, 0, &out);
  out += "\n";
  return out;
}

int RpcFail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "kvshade: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

std::string ProfileName(kvshade::v1::ProfileKind k) {
  std::string name = kvshade::v1::ProfileKind_Name(k);
  const std::string prefix = "PROFILE_KIND_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

void PrintSessionRow(const kvshade::v1::SessionInfo& s) {
  std::printf("%-36s %-10s %-8s %10llu %10llu %4u %-5s %12llu %12llu %s\n", s.session_id().c_str(),
              s.state().c_str(), ProfileName(s.profile()).c_str(), static_cast<unsigned long long>(s.tokens()),
              static_cast<unsigned long long>(s.reused_tokens()), s.attachments(), s.durable() ? "yes" : "no",
              static_cast<unsigned long long>(s.gpu_bytes()), static_cast<unsigned long long>(s.host_bytes()),
              s.label().c_str());
}

// Where kvshade-server lives: $KVSHADE_SERVER, beside this binary, the build tree's
// service/ directory, then PATH.
std::string ServerBinary() {
  if (const char* env = std::getenv("KVSHADE_SERVER"); env != nullptr && *env) return env;
  char self[PATH_MAX];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (len > 0) {
    self[len] = '\0';
    std::string dir(self);
    dir = dir.substr(0, dir.rfind('/'));
    for (const std::string& cand : {dir + "/kvshade-server", dir + "/../service/kvshade-server"}) {
      if (access(cand.c_str(), X_OK) == 0) return cand;
    }
  }
  return "kvshade-server";
}

}  // namespace

int main(int argc, char** argv) {
  // `serve` hands every remaining argument to the server untouched (CLI11 would try to
  // parse them), so it is handled before the parser.
  if (argc >= 2 && std::string(argv[1]) == "serve") {
    const std::string server = ServerBinary();
    std::vector<char*> args;
    args.push_back(const_cast<char*>(server.c_str()));
    for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
    args.push_back(nullptr);
    execvp(server.c_str(), args.data());
    std::perror(("kvshade serve: cannot exec " + server).c_str());
    return 127;
  }

  CLI::App app{"kvshade: command-line tool of the kvshade KV-cache service"};
  app.require_subcommand(1);
  app.set_version_flag("--version", kvshade::VersionLine("kvshade"));
  ClientOptions co;
  co.target = Env("KVSHADE_TARGET", co.target);
  co.bearer_token = Env("KVSHADE_TOKEN", "");
  double timeout_s = 60;
  app.add_option("-t,--target", co.target, "Server address HOST:PORT (env KVSHADE_TARGET)")->capture_default_str();
  app.add_option("--token", co.bearer_token, "Bearer token of your tenant (env KVSHADE_TOKEN)");
  app.add_flag("--tls", co.tls, "Use TLS");
  app.add_option("--ca", co.ca_file, "PEM CA certificate that verifies the server (implies --tls)");
  app.add_option("--cert", co.cert_file, "PEM client certificate for mTLS (implies --tls)");
  app.add_option("--key", co.key_file, "PEM client key for mTLS");
  app.add_option("--server-name", co.tls_server_name, "Expected server name in its certificate");
  app.add_option("--timeout", timeout_s, "Per-call deadline in seconds")->check(CLI::Range(0.001, 86400.0));
  co.ucx_transports = Env("KVSHADE_UCX_TRANSPORTS", "");
  app.add_option("--ucx-transports", co.ucx_transports,
                 "UCX_TLS of this client's UCX worker, e.g. tcp,self or shm,self (env KVSHADE_UCX_TRANSPORTS; "
                 "default: UCX's choice)");
  for (auto* opt : app.get_options()) opt->configurable(false);
  // Connection flags may also follow the subcommand.
  app.fallthrough();

  app.add_subcommand("serve", "Run kvshade-server with the given flags (see kvshade-server --help)");

  auto* status = app.add_subcommand("status", "Server health and statistics");
  // `--wait` alone waits kDefaultWaitS; without it, one health check.
  constexpr double kDefaultWaitS = 30;
  double wait_s = 0;
  bool status_json = false;
  status->add_option("--wait", wait_s, "Wait up to SECONDS for SERVING (30 when given without a value)")
      ->expected(0, 1)
      ->default_str(absl::StrFormat("%g", kDefaultWaitS))
      ->type_name("[SECONDS]")
      ->check(CLI::Range(0.0, 86400.0));
  status->add_flag("--json", status_json, "Print the statistics as JSON");

  auto* sessions = app.add_subcommand("sessions", "List, inspect or close sessions");
  sessions->require_subcommand(1);
  bool sessions_json = false;
  sessions->add_flag("--json", sessions_json, "JSON output");
  auto* s_list = sessions->add_subcommand("list", "Sessions of your tenant");
  std::string session_id;
  auto* s_info = sessions->add_subcommand("info", "One session");
  s_info->add_option("session_id", session_id, "Session id")->required();
  auto* s_close = sessions->add_subcommand("close", "Close a session (its shared prefix stays cached)");
  s_close->add_option("session_id", session_id, "Session id")->required();

  auto* lookup = app.add_subcommand("lookup", "How much of a prompt the server can reuse");
  kvshade::v1::LookupPrefixRequest lreq;
  std::string model_id = "synthetic/doc-qa", tokens_csv, tokens_file, profile_name = "auto";
  uint32_t layers = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  lookup->add_option("--model-id", model_id, "Model id (part of the prefix key)");
  lookup->add_option("--layers", layers, "Layers")->required();
  lookup->add_option("--q-heads", q_heads, "Query heads")->required();
  lookup->add_option("--kv-heads", kv_heads, "KV heads")->required();
  lookup->add_option("--head-dim", head_dim, "Head dim")->required();
  lookup->add_option("--profile", profile_name, "Profile")->check(CLI::IsMember({"auto", "shadow", "mini", "exact"}));
  // The prefix key covers the profile's shape (rank, chunk, outliers, window, ...): give
  // the same values the session was created with (left out: the server's default).
  uint32_t l_rank = 0, l_chunk = 0, l_outliers = 0, l_window = 0, l_heavy = 0;
  lookup->add_option("--rank", l_rank, "Profile rank (0 = server default)");
  lookup->add_option("--chunk-size", l_chunk, "Profile chunk size (0 = server default)");
  auto* outliers_opt = lookup->add_option("--outliers", l_outliers, "Profile outliers (left out: server default)");
  lookup->add_option("--local-window", l_window, "Profile local window (0 = server default)");
  auto* heavy_opt = lookup->add_option("--heavy-chunks", l_heavy, "Profile heavy chunks (left out: server default)");
  auto* tok_opt = lookup->add_option("--tokens", tokens_csv, "Token ids, comma separated");
  lookup->add_option("--tokens-file", tokens_file, "File of whitespace-separated token ids")
      ->check(CLI::ExistingFile)
      ->excludes(tok_opt);

  auto* demo = app.add_subcommand("demo", "Synthetic prefix-cached document-QA workload");
  kvshade::cli::DemoOptions demo_opts;
  kvshade::cli::AddDemoOptions(demo, &demo_opts);
  double demo_wait_s = 10;
  demo->add_option("--wait", demo_wait_s,
                   "Wait up to SECONDS for the server to be SERVING first (10 without the flag, 30 given without a "
                   "value)")
      ->expected(0, 1)
      ->default_str(absl::StrFormat("%g", kDefaultWaitS))
      ->type_name("[SECONDS]")
      ->check(CLI::Range(0.0, 86400.0));

  auto* doctor = app.add_subcommand("doctor", "Check UCX, CUDA, pinned-memory limits and a test transfer to the daemon");
  kvshade::cli::DoctorOptions doctor_opts;
  kvshade::cli::AddDoctorOptions(doctor, &doctor_opts);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  co.timeout = absl::Milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (doctor->parsed()) return kvshade::cli::RunDoctor(co, doctor_opts);
  // The demo's data calls go over the UCX data plane when the daemon offers one, unless
  // --no-ucx (with --ucx a fallback to gRPC fails the demo).
  if (demo->parsed()) co.use_ucx = demo_opts.ucx;
  auto client = Client::Connect(co);
  if (!client.ok()) return RpcFail("connect", client.status());
  Client& c = **client;

  if (status->parsed()) {
    if (wait_s > 0) {
      absl::Status s = c.WaitForServing(absl::Milliseconds(static_cast<int64_t>(wait_s * 1000)));
      if (!s.ok()) {
        std::fprintf(stderr, "kvshade: %s\n", std::string(s.message()).c_str());
        return 3;
      }
    }
    auto h = c.CheckHealth();
    if (!h.ok()) return RpcFail("health check", h.status());
    if (*h != kvshade::client::HealthStatus::kServing) {
      std::printf("%s %s\n", co.target.c_str(), std::string(HealthStatusName(*h)).c_str());
      return 3;
    }
    auto st = c.Stats();
    if (!st.ok() && st.status().code() == absl::StatusCode::kUnauthenticated) {
      // Health is open; statistics are per tenant. Serving is what was asked.
      std::printf("%s SERVING (statistics need a tenant token: --token or KVSHADE_TOKEN)\n", co.target.c_str());
      return 0;
    }
    if (!st.ok()) return RpcFail("Stats", st.status());
    if (status_json) {
      std::printf("%s", Json(*st).c_str());
      return 0;
    }
    std::printf("%s SERVING (kvshade %s, backend %s)\n", co.target.c_str(), st->version().c_str(),
                st->backend().c_str());
    std::printf("  sessions %llu, attachments %llu, segments %llu\n",
                static_cast<unsigned long long>(st->sessions()), static_cast<unsigned long long>(st->attachments()),
                static_cast<unsigned long long>(st->segments()));
    std::printf("  device %llu / %llu bytes, host %llu / %llu bytes, spilled %llu bytes\n",
                static_cast<unsigned long long>(st->device_bytes_used()),
                static_cast<unsigned long long>(st->device_bytes_budget()),
                static_cast<unsigned long long>(st->host_bytes_used()),
                static_cast<unsigned long long>(st->host_bytes_budget()),
                static_cast<unsigned long long>(st->spilled_bytes()));
    std::printf("  prefix lookups %llu (hits %llu), chunks selected %llu (hits %llu)\n",
                static_cast<unsigned long long>(st->prefix_lookups()),
                static_cast<unsigned long long>(st->prefix_hits()),
                static_cast<unsigned long long>(st->chunks_selected()),
                static_cast<unsigned long long>(st->chunk_hits()));
    return 0;
  }

  if (sessions->parsed()) {
    if (s_list->parsed()) {
      auto r = c.ListSessions();
      if (!r.ok()) return RpcFail("ListSessions", r.status());
      if (sessions_json) {
        std::printf("%s", Json(*r).c_str());
        return 0;
      }
      std::printf("%-36s %-10s %-8s %10s %10s %4s %-5s %12s %12s %s\n", "SESSION", "STATE", "PROFILE", "TOKENS",
                  "REUSED", "ATT", "DUR", "GPU_BYTES", "HOST_BYTES", "LABEL");
      for (const auto& s : r->sessions()) PrintSessionRow(s);
      return 0;
    }
    if (s_info->parsed()) {
      auto r = c.GetSession(session_id);
      if (!r.ok()) return RpcFail("GetSession", r.status());
      std::printf("%s", Json(*r).c_str());
      return 0;
    }
    if (s_close->parsed()) {
      absl::Status s = c.CloseSession(session_id);
      if (!s.ok()) return RpcFail("CloseSession", s);
      std::printf("closed %s\n", session_id.c_str());
      return 0;
    }
  }

  if (lookup->parsed()) {
    std::vector<int32_t> tokens;
    std::string text = tokens_csv;
    if (!tokens_file.empty()) {
      std::ifstream in(tokens_file);
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    for (absl::string_view part : absl::StrSplit(text, absl::ByAnyChar(", \t\n"), absl::SkipEmpty())) {
      int32_t t;
      if (!absl::SimpleAtoi(part, &t)) {
        std::fprintf(stderr, "kvshade lookup: '%s' is not a token id\n", std::string(part).c_str());
        return 2;
      }
      tokens.push_back(t);
    }
    if (tokens.empty()) {
      std::fprintf(stderr, "kvshade lookup: give --tokens or --tokens-file\n");
      return 2;
    }
    auto* m = lreq.mutable_model();
    m->set_model_id(model_id);
    m->set_num_layers(layers);
    m->set_num_query_heads(q_heads);
    m->set_num_kv_heads(kv_heads);
    m->set_head_dim(head_dim);
    m->set_dtype(kvshade::v1::DTYPE_BF16);
    kvshade::v1::ProfileKind kind = kvshade::v1::PROFILE_KIND_AUTO;
    std::string upper = "PROFILE_KIND_" + profile_name;
    for (auto& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    kvshade::v1::ProfileKind_Parse(upper, &kind);
    lreq.mutable_profile()->set_kind(kind);
    lreq.mutable_profile()->set_rank(l_rank);
    lreq.mutable_profile()->set_chunk_size(l_chunk);
    if (outliers_opt->count() > 0) lreq.mutable_profile()->set_outliers(l_outliers);
    lreq.mutable_profile()->set_local_window(l_window);
    if (heavy_opt->count() > 0) lreq.mutable_profile()->set_heavy_chunks(l_heavy);
    lreq.mutable_token_ids()->Assign(tokens.begin(), tokens.end());
    auto r = c.LookupPrefix(lreq);
    if (!r.ok()) return RpcFail("LookupPrefix", r.status());
    std::printf("%llu of %zu tokens reusable (%llu cached segments)\n",
                static_cast<unsigned long long>(r->reusable_tokens()), tokens.size(),
                static_cast<unsigned long long>(r->cached_segments()));
    return 0;
  }

  if (demo->parsed()) {
    absl::Status s = c.WaitForServing(absl::Milliseconds(static_cast<int64_t>(demo_wait_s * 1000)));
    if (!s.ok()) {
      std::fprintf(stderr, "kvshade demo: %s\n", std::string(s.message()).c_str());
      return 3;
    }
    return kvshade::cli::RunDemo(c, demo_opts);
  }
  return 2;
}

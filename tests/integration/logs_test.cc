// Integration: the daemon's log (docs/OPERATIONS.md "Logs") on the real kvshade-server. With
// --log-format json every line of a small workload parses as one JSON object and each
// documented event appears with its fields; --log-level debug adds the per-RPC lines that
// info leaves out; text format keeps the events; UCX's own messages arrive as "ucx" events.
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace logs_test {
namespace {

using google::protobuf::Struct;

// Every non-empty line of `log` as a JSON object; a line that does not parse fails the test.
std::vector<Struct> ParseJsonLines(const std::string& log) {
  std::vector<Struct> out;
  for (absl::string_view line : absl::StrSplit(log, '\n', absl::SkipEmpty())) {
    Struct s;
    const auto st = google::protobuf::util::JsonStringToMessage(std::string(line), &s);
    EXPECT_TRUE(st.ok()) << "not a JSON object: " << line;
    if (st.ok()) out.push_back(std::move(s));
  }
  return out;
}

std::string Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  if (it == s.fields().end()) return "";
  if (it->second.has_string_value()) return it->second.string_value();
  if (it->second.has_number_value()) {
    std::ostringstream o;
    o << it->second.number_value();
    return o.str();
  }
  if (it->second.has_bool_value()) return it->second.bool_value() ? "true" : "false";
  return "";
}

// The lines of one event.
std::vector<Struct> Events(const std::vector<Struct>& lines, const std::string& event) {
  std::vector<Struct> out;
  for (const Struct& s : lines) {
    if (Field(s, "event") == event) out.push_back(s);
  }
  return out;
}

bool Has(const std::vector<Struct>& lines, const std::string& event,
         const std::map<std::string, std::string>& fields) {
  for (const Struct& s : Events(lines, event)) {
    bool all = true;
    for (const auto& [k, v] : fields) all = all && Field(s, k) == v;
    if (all) return true;
  }
  return false;
}

// Waits until the server's log holds `needle` (events of the maintenance thread).
bool WaitForLog(const ServerProcess& server, const std::string& needle, absl::Duration limit) {
  const absl::Time end = absl::Now() + limit;
  while (absl::Now() < end) {
    if (absl::StrContains(server.log(), needle)) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

TEST(Logs, JsonLinesCarryEveryLifecycleEvent) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--log-format", "json", "--log-level", "debug", "--tenant-token", "acme:token-of-acme",
                             "--spill-path", dir.path() + "/spill", "--session-idle-ttl-s", "1"},
                            [] {
                              client::ClientOptions o;
                              o.bearer_token = "token-of-acme";
                              return o;
                            }()));
  client::ClientOptions opts;
  opts.bearer_token = "token-of-acme";
  auto c = server.Connect(opts);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  KV_ASSERT_OK_AND_ASSIGN(fork, c->ForkSession(created.session_id(), 512));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w1");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  KV_ASSERT_OK(c->Detach(att.attachment_id()));
  ar.set_lease_ms(100);  // left to expire
  KV_ASSERT_OK_AND_ASSIGN(short_lease, c->Attach(ar));
  KV_ASSERT_OK(c->CloseSession(fork.session_id()));
  // A caller error (debug) and an authentication failure (warn).
  EXPECT_EQ(c->GetSession("no-such-session").status().code(), absl::StatusCode::kNotFound);
  client::ClientOptions wrong;
  wrong.bearer_token = "not-a-token";
  auto intruder = server.Connect(wrong);
  EXPECT_EQ(intruder->ListSessions().status().code(), absl::StatusCode::kUnauthenticated);
  // An ingest stream that fails: its commit comes before any layer.
  const synthetic::Document other(SmallDoc(256, 9));
  KV_ASSERT_OK_AND_ASSIGN(pending, c->CreateSession(synthetic::MakeCreate(other, ShadowProfile(), -1, false)));
  {
    KV_ASSERT_OK_AND_ASSIGN(w, c->StartIngest(pending.session_id()));
    EXPECT_EQ(w->Commit().status().code(), absl::StatusCode::kInvalidArgument);
  }
  // The lease runs out, then the session (no live attachment, untouched for 1 s) expires.
  ASSERT_TRUE(WaitForLog(server, "\"event\":\"lease_expired\"", absl::Seconds(15))) << server.log();
  ASSERT_TRUE(WaitForLog(server, "\"event\":\"session_expired\"", absl::Seconds(15))) << server.log();
  ASSERT_EQ(server.Stop(), 0);

  const std::vector<Struct> lines = ParseJsonLines(server.log());
  ASSERT_FALSE(lines.empty());
  for (const Struct& s : lines) {
    EXPECT_FALSE(Field(s, "ts").empty());
    EXPECT_FALSE(Field(s, "level").empty());
    EXPECT_TRUE(s.fields().count("msg") || s.fields().count("event")) << "neither msg nor event";
  }
  const std::string sid = created.session_id();
  EXPECT_TRUE(Has(lines, "restore_summary", {{"sessions", "0"}})) << server.log();
  EXPECT_TRUE(Has(lines, "session_created", {{"level", "info"}, {"session", sid}, {"tenant", "acme"}, {"tokens", "512"}}));
  EXPECT_TRUE(Has(lines, "ingest_committed", {{"level", "info"}, {"session", sid}, {"tokens", "512"}}));
  EXPECT_TRUE(Has(lines, "session_forked", {{"level", "info"}, {"session", fork.session_id()}, {"parent", sid}}));
  EXPECT_TRUE(Has(lines, "attached", {{"level", "info"}, {"attachment", att.attachment_id()}, {"session", sid}, {"worker", "w1"}}));
  EXPECT_TRUE(Has(lines, "detached", {{"level", "info"}, {"attachment", att.attachment_id()}}));
  EXPECT_TRUE(Has(lines, "lease_expired", {{"level", "info"}, {"attachment", short_lease.attachment_id()}, {"session", sid}}));
  EXPECT_TRUE(Has(lines, "session_closed", {{"level", "info"}, {"session", fork.session_id()}}));
  EXPECT_TRUE(Has(lines, "session_expired", {{"level", "info"}, {"session", sid}, {"tenant", "acme"}}));
  EXPECT_TRUE(Has(lines, "auth_failed", {{"level", "warning"}, {"reason", "unknown bearer token"}}));
  EXPECT_TRUE(Has(lines, "ingest_failed",
                  {{"session", pending.session_id()}, {"level", "warning"}, {"code", "INVALID_ARGUMENT"}}))
      << server.log();
  // Per-RPC lines at debug: OK and caller errors at debug, refusals at warning.
  EXPECT_TRUE(Has(lines, "rpc", {{"method", "CreateSession"}, {"code", "OK"}, {"tenant", "acme"}, {"level", "debug"}}));
  EXPECT_TRUE(Has(lines, "rpc", {{"method", "GetSession"}, {"code", "NOT_FOUND"}, {"level", "debug"}}));
  EXPECT_TRUE(Has(lines, "rpc", {{"method", "ListSessions"}, {"code", "UNAUTHENTICATED"}, {"level", "warning"}}));
  // A plain line (start-up) is a JSON object too, its text under "msg".
  bool serving = false;
  for (const Struct& s : lines) serving = serving || absl::StrContains(Field(s, "msg"), "serving on");
  EXPECT_TRUE(serving);
  // Tokens never reach the log.
  EXPECT_FALSE(absl::StrContains(server.log(), "token-of-acme"));
  EXPECT_FALSE(absl::StrContains(server.log(), "not-a-token"));
}

TEST(Logs, InfoLeavesOutRpcLinesAndTextKeepsTheEvents) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));  // text, info
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(256));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  KV_ASSERT_OK(c->CloseSession(created.session_id()));
  ASSERT_EQ(server.Stop(), 0);
  const std::string log = server.log();
  EXPECT_TRUE(absl::StrContains(log, "session_created session=" + created.session_id())) << log;
  EXPECT_TRUE(absl::StrContains(log, "session_closed session=" + created.session_id())) << log;
  EXPECT_FALSE(absl::StrContains(log, " rpc method=")) << log;
  EXPECT_FALSE(absl::StrContains(log, "{\"ts\"")) << log;
}

TEST(Logs, RestoreSummaryCountsDurableSessions) {
  TempDir dir;
  const std::vector<std::string> args = {"--log-format", "json", "--spill-path", dir.path() + "/spill"};
  std::string sid;
  {
    ServerProcess server;
    KV_ASSERT_OK(server.Start(args));
    auto c = server.Connect();
    const synthetic::Document doc(SmallDoc(512));
    v1::Profile p = ShadowProfile();
    KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, p, -1, /*durable=*/true));
    sid = created.session_id();
    ASSERT_EQ(server.Stop(), 0);
  }
  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  ASSERT_EQ(again.Stop(), 0);
  const std::vector<Struct> lines = ParseJsonLines(again.log());
  EXPECT_TRUE(Has(lines, "restore_summary", {{"sessions", "1"}, {"level", "info"}})) << again.log();
}

TEST(Logs, UcxMessagesGoThroughTheSameLogger) {
  TempDir dir;
  ServerProcess server;
  // At trace the daemon asks UCX for its debug messages: plenty at worker creation.
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self"), "--log-format", "json", "--log-level", "trace"}));
  ASSERT_EQ(server.Stop(), 0);
  const std::vector<Struct> lines = ParseJsonLines(server.log());
  const std::vector<Struct> ucx = Events(lines, "ucx");
  ASSERT_FALSE(ucx.empty()) << server.log().substr(0, 4000);
  EXPECT_FALSE(Field(ucx.front(), "file").empty());
  EXPECT_FALSE(Field(ucx.front(), "msg").empty());
  // Nothing of UCX's own format ("[1700000000.123456] [host:pid:tid] file:line UCX ...")
  // reaches stderr beside the JSON lines (ParseJsonLines fails on any such line).
}

TEST(Logs, GrpcMessagesGoThroughTheSameLogger) {
  ServerProcess server;
  // At trace the daemon asks gRPC for its debug messages (polling engine, ports, ...).
  KV_ASSERT_OK(server.Start({"--log-format", "json", "--log-level", "trace"}));
  ASSERT_EQ(server.Stop(), 0);
  const std::vector<Struct> lines = ParseJsonLines(server.log());
  const std::vector<Struct> grpc = Events(lines, "grpc");
  ASSERT_FALSE(grpc.empty()) << server.log().substr(0, 4000);
  EXPECT_FALSE(Field(grpc.front(), "file").empty());
  EXPECT_FALSE(Field(grpc.front(), "msg").empty());
  // None of gRPC's own format ("D1202 12:00:00.000000000 123 file.cc:45] ...") reaches
  // stderr beside the JSON lines (ParseJsonLines fails on any such line).
}

}  // namespace
}  // namespace logs_test
}  // namespace kvshade::integration

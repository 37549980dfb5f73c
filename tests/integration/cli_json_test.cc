// Integration: the `kvshade` CLI's --json output against a real kvshade-server prints
// integers as JSON numbers (protobuf's JSON printer quotes 64-bit integers), strings as
// strings (a label made of digits stays quoted), and parses back to the same messages.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <regex>
#include <string>

#include <google/protobuf/util/json_util.h>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace cli_json_test {
namespace {

using JsonRun = CommandRun;

JsonRun Cli(const std::string& args) {
  return RunCommand(std::string(KVSHADE_CLI_PATH) + " " + args + " 2>/dev/null");
}

// A quoted run of digits as a member's value, `"key": "123"`, of any member but the label
// (a string, set to digits below).
const std::regex& QuotedInteger() {
  static const std::regex* re = new std::regex(R"re("(?!label")[a-z_]+": *"-?[0-9]+")re");
  return *re;
}

template <typename M>
M Parse(const std::string& json) {
  M m;
  const auto st = google::protobuf::util::JsonStringToMessage(json, &m);
  EXPECT_TRUE(st.ok()) << st.ToString() << "\n" << json;
  return m;
}

TEST(CliJson, StatusAndSessionsListPrintIntegersAsNumbers) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(1024));
  v1::CreateSessionRequest create = synthetic::MakeCreate(doc, ShadowProfile(), -1, false);
  create.set_label("4096");  // a string of digits: must stay a string
  KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(create));
  KV_ASSERT_OK(synthetic::IngestRange(*c, doc, created.session_id(), -1, 0, 1024).status());
  const std::string target = "--target " + server.target();

  const JsonRun status = Cli(target + " status --json");
  ASSERT_EQ(status.exit_code, 0) << status.output;
  EXPECT_FALSE(std::regex_search(status.output, QuotedInteger())) << status.output;
  EXPECT_NE(status.output.find("\"sessions\": 1"), std::string::npos) << status.output;
  EXPECT_NE(status.output.find("\"device_bytes_budget\": " + std::to_string(8ull << 30)), std::string::npos)
      << status.output;
  EXPECT_NE(status.output.find("\"backend\": \"cpu\""), std::string::npos) << status.output;
  const auto stats = Parse<v1::StatsResponse>(status.output);
  KV_ASSERT_OK_AND_ASSIGN(direct, c->Stats());
  EXPECT_EQ(stats.sessions(), direct.sessions());
  EXPECT_EQ(stats.device_bytes_budget(), direct.device_bytes_budget());
  EXPECT_EQ(stats.host_bytes_budget(), direct.host_bytes_budget());
  EXPECT_EQ(stats.version(), direct.version());

  for (const std::string args : {" sessions list --json", " sessions --json list"}) {
    const JsonRun list = Cli(target + args);
    ASSERT_EQ(list.exit_code, 0) << args << ": " << list.output;
    EXPECT_FALSE(std::regex_search(list.output, QuotedInteger())) << list.output;
    EXPECT_NE(list.output.find("\"tokens\": 1024"), std::string::npos) << list.output;
    EXPECT_NE(list.output.find("\"label\": \"4096\""), std::string::npos) << list.output;
    EXPECT_NE(list.output.find("\"profile\": \"PROFILE_KIND_SHADOW\""), std::string::npos) << list.output;
    const auto sessions = Parse<v1::ListSessionsResponse>(list.output);
    ASSERT_EQ(sessions.sessions_size(), 1) << list.output;
    KV_ASSERT_OK_AND_ASSIGN(direct_list, c->ListSessions());
    ASSERT_EQ(direct_list.sessions_size(), 1);
    EXPECT_EQ(sessions.sessions(0).SerializeAsString(), direct_list.sessions(0).SerializeAsString())
        << list.output;
  }

  // `sessions info` prints the same object.
  const JsonRun info = Cli(target + " sessions info " + created.session_id());
  ASSERT_EQ(info.exit_code, 0) << info.output;
  EXPECT_FALSE(std::regex_search(info.output, QuotedInteger())) << info.output;
  EXPECT_NE(info.output.find("\"tokens\": 1024"), std::string::npos) << info.output;

  // No session: an empty list, still valid JSON.
  KV_ASSERT_OK(c->CloseSession(created.session_id()));
  const JsonRun empty = Cli(target + " sessions list --json");
  ASSERT_EQ(empty.exit_code, 0) << empty.output;
  EXPECT_EQ(Parse<v1::ListSessionsResponse>(empty.output).sessions_size(), 0) << empty.output;
}

}  // namespace
}  // namespace cli_json_test
}  // namespace kvshade::integration

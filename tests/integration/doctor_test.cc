// Integration: `kvshade doctor` (the CLI binary) against real kvshade-servers with the UCX
// data plane on (tcp and shm) and off, and against no server at all. Checks the exit code,
// the report lines that matter, and that the throwaway test session is cleaned up.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace doctor_test {
namespace {

using CliRun = CommandRun;

CliRun Doctor(const std::string& args) {
  return RunCommand(std::string(KVSHADE_CLI_PATH) + " " + args + " 2>&1");
}

bool Has(const CliRun& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

// No session of the doctor's may be left behind.
void ExpectNoSessions(const ServerProcess& server) {
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  auto list = c->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->sessions_size(), 0);
  auto stats = c->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->attachments(), 0u);
}

class DoctorUcxTest : public ::testing::TestWithParam<std::string> {};

TEST_P(DoctorUcxTest, TestTransferOverUcxMatchesGrpcAndCleansUp) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam())}));
  const CliRun r = Doctor("--target " + server.target() + " --ucx-transports " + GetParam() +
                       " doctor --repeats 20 --require-ucx");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r, "UCX library 1.")) << r.output;
  EXPECT_TRUE(Has(r, "transports: ")) << r.output;
  EXPECT_TRUE(Has(r, "[cuda]")) << r.output;
  EXPECT_TRUE(Has(r, "RLIMIT_MEMLOCK")) << r.output;
  EXPECT_TRUE(Has(r, "UCX connect + admission")) << r.output;
  EXPECT_TRUE(Has(r, "select over UCX equals gRPC bit for bit")) << r.output;
  EXPECT_TRUE(Has(r, "select round trip")) << r.output;
  EXPECT_TRUE(Has(r, "result: OK")) << r.output;
  EXPECT_FALSE(Has(r, "FAIL")) << r.output;
  ExpectNoSessions(server);
}

INSTANTIATE_TEST_SUITE_P(Loopback, DoctorUcxTest, ::testing::Values("tcp,self", "shm,self"),
                         [](const auto& info) { return info.param == "tcp,self" ? "Tcp" : "Shm"; });

TEST(Doctor, DaemonWithoutUcxWarnsOrFailsWhenUcxIsRequired) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  const CliRun plain = Doctor("--target " + server.target() + " doctor --repeats 10");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_TRUE(Has(plain, "offers no UCX data plane")) << plain.output;
  EXPECT_TRUE(Has(plain, "select over gRPC")) << plain.output;
  EXPECT_TRUE(Has(plain, "result: OK")) << plain.output;

  const CliRun strict = Doctor("--target " + server.target() + " doctor --repeats 10 --require-ucx");
  EXPECT_EQ(strict.exit_code, 1) << strict.output;
  EXPECT_TRUE(Has(strict, "FAIL  the daemon offers no UCX data plane")) << strict.output;
  EXPECT_TRUE(Has(strict, "result: FAILED")) << strict.output;
  ExpectNoSessions(server);
}

TEST(Doctor, NoDaemonFailsAndLocalChecksStillRun) {
  const int port = FreePort();  // nothing listens there
  const CliRun r = Doctor("--target 127.0.0.1:" + std::to_string(port) + " doctor --wait 1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r, "UCX library")) << r.output;
  EXPECT_TRUE(Has(r, "result: FAILED")) << r.output;

  const CliRun local = Doctor("--target 127.0.0.1:" + std::to_string(port) + " doctor --local");
  EXPECT_EQ(local.exit_code, 0) << local.output;
  EXPECT_FALSE(Has(local, "[daemon]")) << local.output;
}

}  // namespace
}  // namespace doctor_test
}  // namespace kvshade::integration

// Integration: what the real kvshade-server says and does at start-up: `--check-config`
// refuses an unusable spill path with a clear message and a non-zero exit; serving beyond
// loopback with neither TLS nor tenant tokens logs a warning that says what to set.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "harness.h"

extern char** environ;

namespace kvshade::integration {
namespace startup_test {
namespace {

using ServerRun = CommandRun;

// Runs kvshade-server with `args` to completion (for --check-config and --version).
ServerRun RunServer(const std::string& args) {
  return RunCommand("timeout 30 " + ServerBinary() + " " + args + " 2>&1");
}

bool Has(const ServerRun& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

TEST(CheckConfig, RefusesAnUnusableSpillPath) {
  TempDir dir;
  const std::string file = dir.path() + "/a-file";
  std::ofstream(file) << "not a database\n";

  // Usable: a directory that does not exist yet in a writable one.
  const ServerRun ok = RunServer("--check-config --spill-path " + dir.path() + "/spill");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(Has(ok, "configuration OK")) << ok.output;

  const ServerRun not_dir = RunServer("--check-config --spill-path " + file);
  EXPECT_EQ(not_dir.exit_code, 1) << not_dir.output;
  EXPECT_TRUE(Has(not_dir, "invalid configuration: spill_path '" + file +
                               "' exists and is not a directory"))
      << not_dir.output;
  EXPECT_FALSE(Has(not_dir, "configuration OK")) << not_dir.output;

  const ServerRun no_parent = RunServer("--check-config --spill-path " + dir.path() + "/no/spill");
  EXPECT_EQ(no_parent.exit_code, 1) << no_parent.output;
  EXPECT_TRUE(Has(no_parent, "its parent directory '" + dir.path() + "/no' does not exist"))
      << no_parent.output;

  // The same from a config file; /sys takes no new files, not even root's.
  const std::string yaml = dir.path() + "/kvshade.yaml";
  std::ofstream(yaml) << "spill_path: /sys\n";
  const ServerRun ro = RunServer("--check-config -c " + yaml);
  EXPECT_EQ(ro.exit_code, 1) << ro.output;
  EXPECT_TRUE(Has(ro, "spill_path '/sys' is not writable")) << ro.output;

  // And the server refuses to start with it, with the same message.
  const ServerRun start = RunServer("--listen 127.0.0.1:0 --spill-path " + file);
  EXPECT_EQ(start.exit_code, 1) << start.output;
  EXPECT_TRUE(Has(start, "exists and is not a directory")) << start.output;
}

// Several devices (docs/OPERATIONS.md "Devices"): --check-config takes the lists (cuda:all is
// counted only at start) and refuses bad ones naming the entry, and a KV-events endpoint that
// every device would bind.
TEST(CheckConfig, BackendListsOfDevices) {
  for (const char* ok : {"cpu:0,cpu:1", "cuda:0,cuda:1", "cuda:all"}) {
    const ServerRun r = RunServer(std::string("--check-config --backend ") + ok);
    EXPECT_EQ(r.exit_code, 0) << ok << ": " << r.output;
    EXPECT_TRUE(Has(r, "configuration OK")) << r.output;
  }
  const ServerRun twice = RunServer("--check-config --backend cpu:0,cpu:0");
  EXPECT_EQ(twice.exit_code, 1) << twice.output;
  EXPECT_TRUE(Has(twice, "'cpu:0' is listed twice")) << twice.output;
  const ServerRun mixed = RunServer("--check-config --backend cpu:0,cuda:1");
  EXPECT_EQ(mixed.exit_code, 1) << mixed.output;
  EXPECT_TRUE(Has(mixed, "mixes cpu and cuda devices")) << mixed.output;
  const ServerRun binds =
      RunServer("--check-config --backend cpu:0,cpu:1 --kv-events-endpoint 'tcp://*:5557'");
  EXPECT_EQ(binds.exit_code, 1) << binds.output;
  EXPECT_TRUE(Has(binds, "binds")) << binds.output;
}

// Starts kvshade-server with `args` (its own --listen among them), waits for its start-up
// line, stops it with SIGTERM and returns everything it logged.
std::string StartupLog(const std::vector<std::string>& args) {
  TempDir dir;
  const std::string log = dir.path() + "/server.log";
  std::vector<std::string> all = {ServerBinary(), "--backend", "cpu"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, all[0].c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return "cannot spawn the server";
  auto read = [&] {
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  const absl::Time end = absl::Now() + absl::Seconds(30);
  while (absl::Now() < end && read().find(" serving on ") == std::string::npos &&
         waitpid(pid, nullptr, WNOHANG) == 0) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGTERM);
  waitpid(pid, nullptr, 0);
  return read();
}

TEST(Startup, WarnsWhenServingBeyondLoopbackWithNeitherTlsNorTokens) {
  const std::string open = StartupLog({"--listen", "0.0.0.0:0"});
  EXPECT_NE(open.find(" serving on 0.0.0.0:0"), std::string::npos) << open;
  EXPECT_NE(open.find("warning kvshade-server: listen address 0.0.0.0:0 is not a loopback address and "
                      "the server has neither TLS nor tenant tokens"),
            std::string::npos)
      << open;
  EXPECT_NE(open.find("--tls-cert"), std::string::npos) << open;
  EXPECT_NE(open.find("--tenant-token"), std::string::npos) << open;

  // Tenant tokens, or loopback: no warning.
  const std::string tokens = StartupLog({"--listen", "0.0.0.0:0", "--tenant-token", "alice:alice-token-123456"});
  EXPECT_NE(tokens.find(" serving on 0.0.0.0:0"), std::string::npos) << tokens;
  EXPECT_EQ(tokens.find("not a loopback address"), std::string::npos) << tokens;
  const std::string local = StartupLog({"--listen", "127.0.0.1:0"});
  EXPECT_NE(local.find(" serving on 127.0.0.1:0"), std::string::npos) << local;
  EXPECT_EQ(local.find("not a loopback address"), std::string::npos) << local;
}

}  // namespace
}  // namespace startup_test
}  // namespace kvshade::integration

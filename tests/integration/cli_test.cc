// Integration: the `kvshade` CLI's `status` and `demo` against real kvshade-servers, as the
// README runs them: `status --wait` without a value waits (30 s) for SERVING; the demo
// uses UCX when the daemon offers it and reports what it used, fails (exit 4) on a
// fallback only when given --ucx, runs a second time against the same server (document
// cached), and leaves no session behind.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <future>
#include <regex>
#include <vector>

#include "gtest/gtest.h"
#include "harness.h"

extern char** environ;

namespace kvshade::integration {
namespace cli_test {
namespace {

using CliRun = CommandRun;

CliRun Cli(const std::string& args) {
  return RunCommand(std::string(KVSHADE_CLI_PATH) + " " + args + " 2>&1");
}

bool Has(const CliRun& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

void ExpectNoSessions(const ServerProcess& server) {
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  auto list = c->ListSessions();
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->sessions_size(), 0);
}

// kvshade-server on a port chosen by the test (the harness picks its own), CPU backend, log
// discarded; SIGTERM and reaped on destruction.
class ServerOnPort {
 public:
  explicit ServerOnPort(int port) {
    const std::string bin = ServerBinary();
    std::vector<std::string> args = {bin, "--listen", "127.0.0.1:" + std::to_string(port), "--backend", "cpu"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    if (posix_spawn(&pid_, bin.c_str(), &fa, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&fa);
  }
  ~ServerOnPort() {
    if (pid_ <= 0) return;
    kill(pid_, SIGTERM);
    waitpid(pid_, nullptr, 0);
  }
  bool started() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
};

// A demo small enough for 2 cores.
const char kSmallDemo[] = " demo --no-progress --doc-tokens 1024 --layers 2 --questions 2 --steps 2";

TEST(CliStatus, WaitWithoutAValueWaitsForAServerStartingLater) {
  const int port = FreePort();
  const std::string target = "127.0.0.1:" + std::to_string(port);
  // Nothing listens yet: plain `status` fails at once, `--wait 0.5` gives up with exit 3.
  const CliRun now = Cli("--target " + target + " status");
  EXPECT_EQ(now.exit_code, 1) << now.output;
  const CliRun short_wait = Cli("--target " + target + " status --wait 0.5");
  EXPECT_EQ(short_wait.exit_code, 3) << short_wait.output;
  EXPECT_TRUE(Has(short_wait, "not SERVING within")) << short_wait.output;

  // `status --wait`, as in the README, started before the server: it waits.
  auto waiting = std::async(std::launch::async, [&] { return Cli("--target " + target + " status --wait"); });
  ServerOnPort server(port);
  ASSERT_TRUE(server.started());
  const CliRun r = waiting.get();
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r, target + " SERVING (kvshade ")) << r.output;
  EXPECT_FALSE(Has(r, "required")) << r.output;

  // A value still works, in both spellings, and other flags may follow a bare --wait.
  for (const std::string args : {" status --wait 5", " status --wait=5", " status --wait --json"}) {
    const CliRun v = Cli("--target " + target + args);
    EXPECT_EQ(v.exit_code, 0) << args << ": " << v.output;
  }
  EXPECT_TRUE(Has(Cli("--target " + target + " status --wait --json"), "\"backend\": \"cpu\""));
  EXPECT_EQ(Cli("--target " + target + " status --wait -1").exit_code, 2);
}

TEST(CliDemo, DaemonWithoutUcxRunsOverGrpcAndFailsOnlyWhenUcxIsRequired) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));  // ucx.enable off, as deploy/kvshade.yaml
  const std::string base = "--target " + server.target() + kSmallDemo;

  const CliRun plain = Cli(base);
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
  EXPECT_TRUE(Has(plain, "data plane: UCX if the daemon offers it, else gRPC inline")) << plain.output;
  EXPECT_TRUE(Has(plain, "[transport] data calls over gRPC inline: the daemon offers no UCX data plane"))
      << plain.output;
  EXPECT_FALSE(Has(plain, "FAILED")) << plain.output;
  EXPECT_TRUE(Has(plain, "[document] session ")) << plain.output;
  EXPECT_TRUE(Has(plain, "ingested 1024 tokens")) << plain.output;
  // The figures say what they are.
  EXPECT_TRUE(Has(plain, "an approximation by design")) << plain.output;
  EXPECT_TRUE(Has(plain, "reference: question 0's queries on an exact-profile session")) << plain.output;
  EXPECT_TRUE(Has(plain, "a dense bf16 K+V cache of the same 1152 tokens")) << plain.output;
  EXPECT_FALSE(Has(plain, "unshared")) << plain.output;
  // 2 steps x 2 layers = 4 selects: too few for a p99, the max is shown.
  EXPECT_TRUE(std::regex_search(plain.output, std::regex(R"(Select \(b=2\) +[0-9.]+ +[0-9.]+ max +4\n)")))
      << plain.output;
  ExpectNoSessions(server);

  // --ucx asks for UCX: the fallback fails the run.
  const CliRun strict = Cli(base + " --ucx");
  EXPECT_EQ(strict.exit_code, 4) << strict.output;
  EXPECT_TRUE(Has(strict, "data plane: UCX, required by --ucx")) << strict.output;
  EXPECT_TRUE(Has(strict, "[transport] FAILED: --ucx asks for the UCX data plane")) << strict.output;
  // The document is cached by now: nothing to ingest, and not counted as this run's memory.
  EXPECT_TRUE(Has(strict, "all 1024 tokens already cached")) << strict.output;
  EXPECT_TRUE(Has(strict, "none of the document's (its 1024 tokens were cached before this run)")) << strict.output;
  ExpectNoSessions(server);

  // The last of --ucx / --no-ucx wins (scripts/demo.sh passes --ucx before the user's flags).
  const CliRun off = Cli(base + " --ucx --no-ucx");
  EXPECT_EQ(off.exit_code, 0) << off.output;
  EXPECT_TRUE(Has(off, "[transport] data calls over gRPC inline (--no-ucx)")) << off.output;
  EXPECT_FALSE(Has(off, "falling back")) << off.output;
  ExpectNoSessions(server);
}

TEST(CliDemo, DaemonWithUcxRunsOverUcxWithAndWithoutTheFlag) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "tcp,self")}));
  const std::string base = "--target " + server.target() + " --ucx-transports tcp,self" + kSmallDemo;
  for (const std::string flag : {"", " --ucx"}) {
    const CliRun r = Cli(base + flag);
    EXPECT_EQ(r.exit_code, 0) << flag << ": " << r.output;
    EXPECT_TRUE(Has(r, "[transport] data calls (ingest, append, select, attend) over UCX via ")) << r.output;
    EXPECT_TRUE(Has(r, "; 0 fallbacks to gRPC")) << r.output;
    EXPECT_FALSE(Has(r, "falling back")) << r.output;
  }
  ExpectNoSessions(server);
}

}  // namespace
}  // namespace cli_test
}  // namespace kvshade::integration

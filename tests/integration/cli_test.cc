// Integration: the `kvshade` CLI's `status` against a real kvshade-server, as the README
// runs it: `status --wait` without a value waits (30 s) for SERVING.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <future>
#include <vector>

#include "gtest/gtest.h"
#include "harness.h"

extern char** environ;

namespace kvshade::integration {
namespace {

struct CliRun {
  int exit_code = -1;
  std::string output;  // stdout + stderr
};

CliRun Cli(const std::string& args) {
  const std::string cmd = std::string(KVSHADE_CLI_PATH) + " " + args + " 2>&1";
  CliRun r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

bool Has(const CliRun& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

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

}  // namespace
}  // namespace kvshade::integration

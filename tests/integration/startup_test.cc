// Integration: what the real kvshade-server says and does at start-up: `--check-config`
// refuses an unusable spill path with a clear message and a non-zero exit.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace {

struct ServerRun {
  int exit_code = -1;
  std::string output;  // stdout + stderr
};

// Runs kvshade-server with `args` to completion (for --check-config and --version).
ServerRun RunServer(const std::string& args) {
  ServerRun r;
  // Bounded, so that a server that starts after all cannot hang the test.
  FILE* p = popen(("timeout 30 " + ServerBinary() + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
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

}  // namespace
}  // namespace kvshade::integration

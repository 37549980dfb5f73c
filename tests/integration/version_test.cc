// Integration: `--version` on every binary of the build (kvshade-server, the kvshade CLI,
// the benchmarks) prints "<binary> <version> (<commit>)" from the one definition in the
// top-level CMakeLists.txt (the commit only when git knew it at configure time) and exits
// 0; the daemon reports the same version in Stats.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace version_test {
namespace {

using VersionRun = CommandRun;

VersionRun RunVersion(const std::string& path) {
  return RunCommand(path + " --version 2>/dev/null");
}

TEST(Version, EveryBinaryPrintsItsNameTheVersionAndTheCommit) {
  namespace fs = std::filesystem;
  // The benchmarks are built beside service/ and client/ in the same build tree.
  const fs::path bench = fs::path(KVSHADE_SERVER_PATH).parent_path().parent_path() / "bench";
  std::vector<std::pair<std::string, std::string>> binaries = {
      {"kvshade-server", KVSHADE_SERVER_PATH}, {"kvshade", KVSHADE_CLI_PATH}};
  if (fs::exists(bench)) {  // absent with KVSHADE_BUILD_BENCH=OFF
    for (const char* name : {"kvshade_kernel_bench", "kvshade_service_bench", "kvshade_storage_bench",
                             "kvshade_ucx_bench", "kvshade_delivery_bench"}) {
      const fs::path p = bench / name;
      // The delivery benchmark is built only with the CUDA backend.
      if (std::string(name) == "kvshade_delivery_bench" && !fs::exists(p)) {
        std::printf("note: %s is not built here (no CUDA backend)\n", name);
        continue;
      }
      EXPECT_TRUE(fs::exists(p)) << p << " is not built";
      binaries.emplace_back(name, p.string());
    }
  } else {
    std::printf("note: the benchmarks are not built here (KVSHADE_BUILD_BENCH=OFF)\n");
  }

  std::string version, commit;
  for (const auto& [name, path] : binaries) {
    SCOPED_TRACE(name);
    const VersionRun r = RunVersion(path);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::smatch m;
    const std::regex line("^" + std::regex_replace(name, std::regex("[-_]"), "[$&]") +
                          R"( ([0-9]+\.[0-9]+\.[0-9]+)(?: \(([0-9a-f]{7,40})\))?\n$)");
    ASSERT_TRUE(std::regex_match(r.output, m, line)) << "got: '" << r.output << "'";
    if (version.empty()) {
      version = m[1];
      commit = m[2];
    }
    EXPECT_EQ(m[1], version) << "every binary has the same version";
    EXPECT_EQ(m[2], commit) << "and the same commit";
  }

  // The daemon reports the same version over the wire.
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  auto st = c->Stats();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->version(), version);
}

}  // namespace
}  // namespace version_test
}  // namespace kvshade::integration

// Integration: KVSHADE_* variables on the real binaries. kvshade-server reads every
// configuration key from the environment, between the YAML file and the flags (flags >
// environment > file > defaults); a typo under a section is refused; KVSHADE_CONFIG names
// the file; --list-env lists the variables. The CLI takes its server address from
// KVSHADE_TARGET.
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace environment_test {
namespace {


// Runs `command` through the shell with `env` (NAME=VALUE words) before it.
CommandRun RunWithEnv(const std::string& env, const std::string& command) {
  return RunCommand("env " + env + " timeout 30 " + command + " 2>&1");
}

bool Has(const CommandRun& r, const std::string& s) { return r.output.find(s) != std::string::npos; }

TEST(Environment, OverridesTheFileAndFlagsOverrideIt) {
  TempDir dir;
  const std::string yaml = dir.path() + "/kvshade.yaml";
  std::ofstream(yaml) << "limits:\n  session_idle_ttl_s: 30\nhost_budget: 1GiB\n";
  const std::string server = ServerBinary() + " --check-config";

  const CommandRun file = RunWithEnv("", server + " -c " + yaml);
  EXPECT_EQ(file.exit_code, 0) << file.output;
  EXPECT_TRUE(Has(file, "session_idle_ttl=30s")) << file.output;

  const CommandRun env = RunWithEnv("KVSHADE_LIMITS_SESSION_IDLE_TTL_S=600 KVSHADE_HOST_BUDGET=2GiB",
                             server + " -c " + yaml);
  EXPECT_EQ(env.exit_code, 0) << env.output;
  EXPECT_TRUE(Has(env, "session_idle_ttl=600s")) << env.output;
  EXPECT_TRUE(Has(env, "host_budget=2147483648")) << env.output;

  const CommandRun flag = RunWithEnv("KVSHADE_LIMITS_SESSION_IDLE_TTL_S=600",
                              server + " -c " + yaml + " --session-idle-ttl-s 5");
  EXPECT_EQ(flag.exit_code, 0) << flag.output;
  EXPECT_TRUE(Has(flag, "session_idle_ttl=5s")) << flag.output;

  // KVSHADE_CONFIG names the file when --config is not given.
  const CommandRun by_env = RunWithEnv("KVSHADE_CONFIG=" + yaml, server);
  EXPECT_EQ(by_env.exit_code, 0) << by_env.output;
  EXPECT_TRUE(Has(by_env, "session_idle_ttl=30s")) << by_env.output;
}

TEST(Environment, ATypoUnderASectionIsRefusedByName) {
  const CommandRun r = RunWithEnv("KVSHADE_LIMITS_SESSION_IDLE_TTL=5", ServerBinary() + " --check-config");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Has(r, "unknown variable KVSHADE_LIMITS_SESSION_IDLE_TTL")) << r.output;
  const CommandRun bad = RunWithEnv("KVSHADE_LIMITS_MAX_BATCH=many", ServerBinary() + " --check-config");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_TRUE(Has(bad, "KVSHADE_LIMITS_MAX_BATCH")) << bad.output;
}

TEST(Environment, ListEnvNamesEveryVariable) {
  const CommandRun r = RunWithEnv("", ServerBinary() + " --list-env");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r, "KVSHADE_LIMITS_SESSION_IDLE_TTL_S limits.session_idle_ttl_s\n")) << r.output;
  EXPECT_TRUE(Has(r, "KVSHADE_TLS_CERT_FILE tls.cert_file\n")) << r.output;
  EXPECT_TRUE(Has(r, "KVSHADE_HOST_BUDGET host_budget\n")) << r.output;
}

TEST(Environment, TheCliTakesTheServerAddressFromKvshadeTarget) {
  ServerProcess server;
  ASSERT_TRUE(server.Start({}).ok()) << server.log();
  const CommandRun ok = RunWithEnv("KVSHADE_TARGET=" + server.target(), std::string(KVSHADE_CLI_PATH) + " status --wait 10");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_TRUE(Has(ok, server.target())) << ok.output;
  // A flag wins over the variable: a dead address with --target fails.
  const CommandRun flag = RunWithEnv("KVSHADE_TARGET=" + server.target(),
                              std::string(KVSHADE_CLI_PATH) + " --target 127.0.0.1:1 --timeout 2 status");
  EXPECT_NE(flag.exit_code, 0) << flag.output;
  server.Stop();
}

}  // namespace
}  // namespace environment_test
}  // namespace kvshade::integration

// Unit tests of the KVSHADE_* environment overlay of the daemon's configuration
// (LoadConfig): the naming rule, precedence over the YAML file and the defaults, values read
// as the file's are, refusal of unknown names under a section, and documentation of every
// variable in deploy/README.md.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/service/config.h"

namespace kvshade::service {
namespace config_env_test {
namespace {

using Env = std::vector<std::pair<std::string, std::string>>;

class YamlFile {
 public:
  explicit YamlFile(const std::string& text) {
    char name[] = "/tmp/kvshade-config-env-XXXXXX";
    const int fd = mkstemp(name);
    path_ = name;
    (void)!write(fd, text.data(), text.size());
    close(fd);
  }
  ~YamlFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(ConfigEnv, NamesFollowTheKeyPath) {
  std::map<std::string, std::string> names;
  for (const auto& [key, name] : ConfigEnvironmentVariables()) names[key] = name;
  EXPECT_EQ(names["limits.session_idle_ttl_s"], "KVSHADE_LIMITS_SESSION_IDLE_TTL_S");
  EXPECT_EQ(names["listen"], "KVSHADE_LISTEN");
  EXPECT_EQ(names["tls.cert_file"], "KVSHADE_TLS_CERT_FILE");
  EXPECT_EQ(names["same_node.export"], "KVSHADE_SAME_NODE_EXPORT");
  EXPECT_EQ(names["profile.value_codec"], "KVSHADE_PROFILE_VALUE_CODEC");
  EXPECT_EQ(names["prefix_secret"], "KVSHADE_PREFIX_SECRET");
  EXPECT_EQ(names["ucx.transports"], "KVSHADE_UCX_TRANSPORTS");
  // Every key the example config documents has a variable (and none is named twice).
  std::set<std::string> seen;
  for (const auto& [key, name] : ConfigEnvironmentVariables()) {
    EXPECT_TRUE(seen.insert(name).second) << name;
  }
  EXPECT_GE(seen.size(), 40u);
}

TEST(ConfigEnv, EnvironmentOverridesTheFileWhichOverridesDefaults) {
  YamlFile yaml(
      "listen: 127.0.0.1:6000\n"
      "host_budget: 4GiB\n"
      "limits:\n  session_idle_ttl_s: 30\n  max_batch: 64\n"
      "profile:\n  rank: 96\n");
  const Env env = {{"KVSHADE_LIMITS_SESSION_IDLE_TTL_S", "600"},
                   {"KVSHADE_HOST_BUDGET", "2GiB"},
                   {"KVSHADE_DEVICE_BUDGET", "512MiB"},
                   {"KVSHADE_TLS_REQUIRE_CLIENT_CERT", "true"},
                   {"KVSHADE_SAME_NODE_EXPORT", "false"},
                   {"KVSHADE_PROFILE_REFACTOR_THRESHOLD", "0.25"},
                   {"KVSHADE_UCX_ENABLE", "true"},
                   {"KVSHADE_METRICS_PORT", "9464"}};
  auto c = LoadConfig(yaml.path(), env);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->limits.session_idle_ttl_s, 600u);        // env over file
  EXPECT_EQ(c->host_budget_bytes, 2ull << 30);          // env over file, a size
  EXPECT_EQ(c->device_budget_bytes, 512ull << 20);      // env over default
  EXPECT_EQ(c->limits.max_batch, 64u);                  // file over default
  EXPECT_EQ(c->listen, "127.0.0.1:6000");               // file, no variable
  EXPECT_EQ(c->profile.rank, 96u);
  EXPECT_TRUE(c->tls.require_client_cert);              // a boolean
  EXPECT_FALSE(c->same_node.export_state);
  EXPECT_FLOAT_EQ(c->profile.refactor_threshold, 0.25f);  // a float
  EXPECT_TRUE(c->ucx.enable);
  EXPECT_EQ(c->metrics_port, 9464);
  EXPECT_EQ(c->limits.max_lease_ms, LimitsConfig{}.max_lease_ms);  // default

  // No file: the environment over the defaults.
  auto d = LoadConfig("", {{"KVSHADE_BACKEND", "auto"}, {"KVSHADE_SPILL_BUDGET", "1G"}});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->backend, "auto");
  EXPECT_EQ(d->spill_budget_bytes, 1ull << 30);
  EXPECT_EQ(d->host_budget_bytes, ServerConfig{}.host_budget_bytes);
}

TEST(ConfigEnv, EmptyValuesAndForeignNamesAreIgnored) {
  YamlFile yaml("backend: auto\n");
  auto c = LoadConfig(yaml.path(), {{"KVSHADE_BACKEND", ""},
                                    {"KVSHADE_TARGET", "elsewhere:1"},  // the CLI's
                                    {"KVSHADE_TEST_SEED", "7"},
                                    {"PATH", "/bin"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->backend, "auto");
}

TEST(ConfigEnv, BadValuesAndUnknownSectionNamesAreRefusedByName) {
  auto bad_int = LoadConfig("", {{"KVSHADE_LIMITS_MAX_BATCH", "-3"}});
  ASSERT_FALSE(bad_int.ok());
  EXPECT_NE(bad_int.status().message().find("KVSHADE_LIMITS_MAX_BATCH"), std::string::npos)
      << bad_int.status();
  auto bad_size = LoadConfig("", {{"KVSHADE_HOST_BUDGET", "12 parsecs"}});
  ASSERT_FALSE(bad_size.ok());
  EXPECT_NE(bad_size.status().message().find("KVSHADE_HOST_BUDGET"), std::string::npos);
  auto bad_bool = LoadConfig("", {{"KVSHADE_UCX_ENABLE", "maybe"}});
  EXPECT_FALSE(bad_bool.ok());
  // A typo under a section is an error, as an unknown YAML key is.
  auto typo = LoadConfig("", {{"KVSHADE_LIMITS_SESSION_IDLE_TTL", "5"}});
  ASSERT_FALSE(typo.ok());
  EXPECT_NE(typo.status().message().find("unknown variable KVSHADE_LIMITS_SESSION_IDLE_TTL"),
            std::string::npos)
      << typo.status();
}

TEST(ConfigEnv, StringsAreTakenVerbatimAndTenantsAreAYamlList) {
  // A secret with YAML's special characters is not parsed as YAML.
  auto c = LoadConfig("", {{"KVSHADE_PREFIX_SECRET", "a: #b [c] {d} *e"},
                           {"KVSHADE_TENANTS", "[{name: search, token: search-token-123}]"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->prefix_secret, "a: #b [c] {d} *e");
  ASSERT_EQ(c->tenant_tokens.size(), 1u);
  EXPECT_EQ(c->tenant_tokens.at("search-token-123"), "search");
  // The file's tenants stay; the variable's are added.
  YamlFile yaml("tenants:\n  - name: chat\n    token: chat-token-456\n");
  auto d = LoadConfig(yaml.path(), {{"KVSHADE_TENANTS", "[{name: search, token: search-token-123}]"}});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->tenant_tokens.size(), 2u);
}

TEST(ConfigEnv, TheRuleAndThePrecedenceAreDocumentedInDeployReadme) {
  std::ifstream in(std::filesystem::path(KVSHADE_SOURCE_DIR) / "deploy/README.md");
  ASSERT_TRUE(in) << "deploy/README.md";
  std::stringstream text;
  text << in.rdbuf();
  for (const char* needle : {"`KVSHADE_LIMITS_SESSION_IDLE_TTL_S`", "flags > environment > YAML file > defaults",
                             "--list-env", "`KVSHADE_TENANTS`"}) {
    EXPECT_NE(text.str().find(needle), std::string::npos) << needle << " is not in deploy/README.md";
  }
}

}  // namespace
}  // namespace config_env_test
}  // namespace kvshade::service

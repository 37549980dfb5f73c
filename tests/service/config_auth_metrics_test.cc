// Unit tests of the daemon's shell: YAML config loading and validation, byte sizes,
// tenant tokens, bearer authentication and tenant salts, and the metrics registry and its
// /metrics endpoint.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/metrics.h"

namespace kvshade::service {
namespace config_auth_metrics_test {
namespace {

class TempFile {
 public:
  explicit TempFile(const std::string& text) {
    char name[] = "/tmp/kvshade-config-test-XXXXXX";
    const int fd = mkstemp(name);
    path_ = name;
    (void)!write(fd, text.data(), text.size());
    close(fd);
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A fresh directory, removed with its contents.
class TempDir {
 public:
  TempDir() {
    char name[] = "/tmp/kvshade-config-dir-XXXXXX";
    path_ = mkdtemp(name);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

TEST(Config, ByteSizes) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("8GiB"), 8ull << 30);
  EXPECT_EQ(*ParseByteSize("512 MiB"), 512ull << 20);
  EXPECT_EQ(*ParseByteSize("1.5k"), 1536u);
  EXPECT_EQ(*ParseByteSize("2T"), 2ull << 40);
  EXPECT_FALSE(ParseByteSize("").ok());
  EXPECT_FALSE(ParseByteSize("lots").ok());
  EXPECT_FALSE(ParseByteSize("8 parsecs").ok());
  EXPECT_FALSE(ParseByteSize("-1").ok());
  EXPECT_FALSE(ParseByteSize("99999999TiB").ok());
}

TEST(Config, LoadsEveryKeyAndKeepsDefaultsForTheRest) {
  TempFile tokens("# comment\nbob:bob-token-12345678\n\n");
  TempDir spill_parent;  // the spill path must be creatable for the config to be valid
  const std::string spill = spill_parent.path() + "/kvshade";
  TempFile f(R"(
listen: "0.0.0.0:6000"
backend: auto
device_budget: 2GiB
host_budget: 16GiB
spill_budget: 100GiB
spill_path: )" + spill + R"(
prefix_secret: s3cret
metrics_port: 9464
metrics_listen: 0.0.0.0
worker_threads: 16
tokens_file: )" + tokens.path() + R"(
tenants:
  - name: alice
    token: alice-token-123456
limits:
  max_tokens_per_session: 200000
  max_sessions_per_tenant: 10
  max_message_bytes: 64MiB
  max_batch: 32
  max_attachments_per_session: 4
  default_lease_ms: 1000
  max_lease_ms: 2000
  max_layers: 80
  max_head_dim: 128
  session_idle_ttl_s: 3600
  stream_min_bytes_per_s: 4KiB
  stream_progress_window_ms: 10000
profile:
  rank: 96
  chunk_size: 16
  sparse_budget: 128
  outliers: 12
  local_window: 64
  heavy_chunks: 2
  min_tokens: 4096
  kivi_group: 32
  keep_sink: false
  refactor_threshold: 0.1
  mini_recent_ratio: 0.2
  mini_heavy_ratio: 0.05
  value_codec: fp8
  factorize_host_min_tokens: 32768
)");
  auto c = LoadConfigFile(f.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->listen, "0.0.0.0:6000");
  EXPECT_EQ(c->backend, "auto");
  EXPECT_EQ(c->device_budget_bytes, 2ull << 30);
  EXPECT_EQ(c->host_budget_bytes, 16ull << 30);
  EXPECT_EQ(c->spill_budget_bytes, 100ull << 30);
  EXPECT_EQ(c->spill_path, spill);
  EXPECT_EQ(c->prefix_secret, "s3cret");
  EXPECT_EQ(c->metrics_port, 9464);
  EXPECT_EQ(c->metrics_listen, "0.0.0.0");
  EXPECT_EQ(c->worker_threads, 16u);
  ASSERT_EQ(c->tenant_tokens.size(), 2u);
  EXPECT_EQ(c->tenant_tokens.at("alice-token-123456"), "alice");
  EXPECT_EQ(c->tenant_tokens.at("bob-token-12345678"), "bob");
  EXPECT_EQ(c->limits.max_tokens_per_session, 200000u);
  EXPECT_EQ(c->limits.max_sessions_per_tenant, 10u);
  EXPECT_EQ(c->limits.max_message_bytes, 64ull << 20);
  EXPECT_EQ(c->limits.max_batch, 32u);
  EXPECT_EQ(c->limits.max_attachments_per_session, 4u);
  EXPECT_EQ(c->limits.default_lease_ms, 1000u);
  EXPECT_EQ(c->limits.max_lease_ms, 2000u);
  EXPECT_EQ(c->limits.max_layers, 80u);
  EXPECT_EQ(c->limits.max_head_dim, 128u);
  EXPECT_EQ(c->limits.session_idle_ttl_s, 3600u);
  EXPECT_EQ(c->limits.stream_min_bytes_per_s, 4096u);
  EXPECT_EQ(c->limits.stream_progress_window_ms, 10000u);
  EXPECT_EQ(c->profile.rank, 96u);
  EXPECT_EQ(c->profile.chunk_size, 16u);
  EXPECT_EQ(c->profile.sparse_budget, 128u);
  EXPECT_EQ(c->profile.outliers, 12u);
  EXPECT_EQ(c->profile.local_window, 64u);
  EXPECT_EQ(c->profile.heavy_chunks, 2u);
  EXPECT_EQ(c->profile.min_tokens, 4096u);
  EXPECT_EQ(c->profile.kivi_group, 32u);
  EXPECT_FALSE(c->profile.keep_sink);
  EXPECT_FLOAT_EQ(c->profile.refactor_threshold, 0.1f);
  EXPECT_FLOAT_EQ(c->profile.mini_recent_ratio, 0.2f);
  EXPECT_FLOAT_EQ(c->profile.mini_heavy_ratio, 0.05f);
  EXPECT_EQ(c->profile.value_codec, "fp8");
  EXPECT_EQ(c->profile.factorize_host_min_tokens, 32768u);
  EXPECT_TRUE(ValidateConfig(*c).ok()) << ValidateConfig(*c);

  // An empty file is every default, and the defaults are valid.
  TempFile empty("");
  auto d = LoadConfigFile(empty.path());
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->listen, ServerConfig().listen);
  EXPECT_EQ(d->limits.session_idle_ttl_s, 0u);  // never: nothing expires unless asked
  EXPECT_TRUE(ValidateConfig(*d).ok());
}

TEST(Config, RejectsTyposBadValuesAndBadFiles) {
  auto load = [](const std::string& text) {
    TempFile f(text);
    return LoadConfigFile(f.path()).status();
  };
  const absl::Status typo = load("listne: 1.2.3.4:5\n");
  EXPECT_EQ(typo.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(typo.message().find("listne"), std::string::npos) << typo;
  EXPECT_EQ(load("limits:\n  max_batchh: 3\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("limits: 5\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("metrics_port: 70000\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("worker_threads: -3\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("host_budget: plenty\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("listen: [unclosed\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("tenants:\n  - name: x\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("tenants:\n  - name: x\n    token: short\n").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(load("tenants:\n  - name: 'bad name'\n    token: long-enough-token\n").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadConfigFile("/nonexistent/kvshade.yaml").status().code(), absl::StatusCode::kNotFound);

  auto invalid = [](auto edit) {
    ServerConfig c;
    edit(c);
    return ValidateConfig(c).code();
  };
  using C = absl::StatusCode;
  EXPECT_EQ(invalid([](ServerConfig& c) { c.listen = "nohostport"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.listen = "h:99999"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.backend = "tpu"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.backend = "cuda:x"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.backend = "cuda:"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.backend = "cuda:-1"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.backend = "cuda:1"; }), C::kOk);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.host_budget_bytes = 0; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.spill_budget_bytes = 1; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.tls.cert_file = "/etc/hostname"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) {
              c.tls.cert_file = c.tls.key_file = "/nonexistent.pem";
            }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.tls.require_client_cert = true; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.limits.default_lease_ms = c.limits.max_lease_ms + 1; }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.limits.max_message_bytes = 1000; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.profile.rank = 100; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.same_node.host_memory = "hugepages"; }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.same_node.host_memory = "file"; }), C::kOk);
  for (const char* ok : {"auto", "off", "@kvshade-fd", "/run/kvshade/fd.sock"}) {
    EXPECT_EQ(invalid([&](ServerConfig& c) { c.same_node.descriptor_broker = ok; }), C::kOk) << ok;
  }
  for (const std::string bad : {std::string(), std::string("@"), std::string("fd.sock"),
                                "/" + std::string(120, 'x'), "@" + std::string(120, 'x')}) {
    EXPECT_EQ(invalid([&](ServerConfig& c) { c.same_node.descriptor_broker = bad; }),
              C::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(invalid([](ServerConfig& c) { c.ucx.receive_buffers = 0; }), C::kOk);  // no pool
  EXPECT_EQ(invalid([](ServerConfig& c) { c.ucx.receive_buffers = 1025; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.ucx.receive_buffer_bytes = 4096; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) {
              c.ucx.receive_buffers = 64;
              c.ucx.receive_buffer_bytes = uint64_t{1} << 30;  // 64 GiB resident
            }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.profile.value_codec = "int3"; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.profile.kivi_group = 12; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.profile.refactor_threshold = 0; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.profile.factorize_host_min_tokens = 1u << 31; }),
            C::kInvalidArgument);
  // A per-tenant call cap at or above the thread cap would let one tenant hold every thread.
  EXPECT_EQ(invalid([](ServerConfig& c) {
              c.worker_threads = 8;
              c.limits.max_calls_per_tenant = 8;
            }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& c) { c.limits.max_calls_per_tenant = 70000; }), C::kInvalidArgument);
}

TEST(Config, UcxReceivePoolKeysTakeCountsAndByteSizes) {
  TempFile f("ucx:\n  receive_buffers: 3\n  receive_buffer_bytes: 2MiB\n");
  auto c = LoadConfigFile(f.path());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->ucx.receive_buffers, 3u);
  EXPECT_EQ(c->ucx.receive_buffer_bytes, uint64_t{2} << 20);
  EXPECT_TRUE(ValidateConfig(*c).ok()) << ValidateConfig(*c);
  ServerConfig d;  // defaults: 8 x 16 MiB
  EXPECT_EQ(d.ucx.receive_buffers, 8u);
  EXPECT_EQ(d.ucx.receive_buffer_bytes, uint64_t{16} << 20);
}

// limits.max_calls_per_tenant: as given; automatic (0) = the thread cap minus one when the
// threads are capped and tenants are configured, else no cap.
TEST(Config, CallsPerTenantDefaultLeavesAThreadToOtherTenants) {
  ServerConfig c;
  EXPECT_EQ(EffectiveMaxCallsPerTenant(c), 0u);
  c.worker_threads = 8;
  EXPECT_EQ(EffectiveMaxCallsPerTenant(c), 0u);  // one tenant (default): nothing to share
  ASSERT_TRUE(AddTenantToken("alpha:alpha-token-1", &c).ok());
  EXPECT_EQ(EffectiveMaxCallsPerTenant(c), 7u);
  c.worker_threads = 2;  // the thread cap has a floor of 4
  EXPECT_EQ(EffectiveMaxCallsPerTenant(c), 3u);
  c.limits.max_calls_per_tenant = 2;
  EXPECT_EQ(EffectiveMaxCallsPerTenant(c), 2u);
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

// The limits on streams and calls (docs/OPERATIONS.md "Limits on streams and calls"): the
// call cap must stay below the call thread cap (the guarantee that one tenant leaves a
// thread to the others); open streams hold no thread while they wait, so the stream cap
// is not tied to the threads, and its automatic value never exceeds the call cap.
TEST(Config, StreamAndCallLimits) {
  ServerConfig c;
  EXPECT_EQ(c.limits.stream_min_bytes_per_s, 1024u);  // on by default
  EXPECT_EQ(c.limits.stream_progress_window_ms, 30000u);
  EXPECT_EQ(EffectiveMaxStreamsPerTenant(c), 64u);
  c.worker_threads = 8;
  ASSERT_TRUE(AddTenantToken("alpha:alpha-token-1", &c).ok());
  EXPECT_EQ(EffectiveMaxStreamsPerTenant(c), 4u);
  // The reported configuration: 7 streams with 8 threads (the call cap automatic: 7).
  c.limits.max_streams_per_tenant = 7;
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.limits.max_streams_per_tenant = 100;  // accepted; the call cap (7) is met first
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.limits.max_streams_per_tenant = 0;
  c.limits.max_calls_per_tenant = 1;
  EXPECT_EQ(EffectiveMaxStreamsPerTenant(c), 1u);  // automatic: within the call cap
  c.limits.max_calls_per_tenant = 8;
  const absl::Status st = ValidateConfig(c);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("limits.max_calls_per_tenant (8) must be below the call thread cap"),
            std::string::npos)
      << st;
  c.limits.max_calls_per_tenant = 0;
  EXPECT_EQ(CallThreadCap(c), 8u);
  c.worker_threads = 2;  // a floor of 4
  EXPECT_EQ(CallThreadCap(c), 4u);
  c.worker_threads = 0;
  EXPECT_EQ(CallThreadCap(c), 0u);

  auto invalid = [](auto change) {
    ServerConfig d;
    change(d);
    return ValidateConfig(d).code();
  };
  using C = absl::StatusCode;
  EXPECT_EQ(invalid([](ServerConfig& d) { d.limits.stream_min_bytes_per_s = 0; }), C::kOk);
  EXPECT_EQ(invalid([](ServerConfig& d) { d.limits.stream_min_bytes_per_s = (uint64_t{1} << 30) + 1; }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& d) { d.limits.stream_progress_window_ms = 99; }), C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& d) { d.limits.stream_progress_window_ms = 86400001; }),
            C::kInvalidArgument);
  EXPECT_EQ(invalid([](ServerConfig& d) { d.limits.stream_progress_window_ms = 100; }), C::kOk);
  EXPECT_NE(DescribeConfig(ServerConfig()).find("stream_min_progress=1024B/s over 30000ms"), std::string::npos)
      << DescribeConfig(ServerConfig());
}

TEST(Config, RejectsAnUnusableSpillPath) {
  auto check = [](const std::string& path) {
    ServerConfig c;
    c.spill_path = path;
    return ValidateConfig(c);
  };
  TempDir dir;
  // Usable: an existing writable directory, or a new one in an existing writable directory.
  EXPECT_TRUE(check(dir.path()).ok()) << check(dir.path());
  EXPECT_TRUE(check(dir.path() + "/spill").ok()) << check(dir.path() + "/spill");
  EXPECT_FALSE(std::filesystem::exists(dir.path() + "/spill"));  // checking creates nothing
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));

  // A path that exists and is not a directory.
  TempFile file("not a database");
  absl::Status st = check(file.path());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("spill_path '" + file.path() + "' exists and is not a directory"),
            std::string::npos)
      << st;

  // A path whose parent does not exist (RocksDB creates only the last component).
  st = check(dir.path() + "/missing/spill");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("its parent directory '" + dir.path() + "/missing' does not exist"),
            std::string::npos)
      << st;
  st = check(file.path() + "/spill");  // the parent is a file
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("is not a directory"), std::string::npos) << st;

  // A directory nothing can be created in: /sys refuses new files even to root; a mode
  // 0555 directory refuses them to anyone else.
  st = check("/sys");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("spill_path '/sys' is not writable"), std::string::npos) << st;
  st = check("/sys/kvshade-spill");  // would be created in a directory that refuses it
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("its parent directory '/sys' is not writable"), std::string::npos) << st;
  if (geteuid() != 0) {
    TempDir ro;
    ASSERT_EQ(chmod(ro.path().c_str(), 0555), 0);
    st = check(ro.path());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("is not writable"), std::string::npos) << st;
  }
  // No spill path: nothing to check.
  EXPECT_TRUE(check("").ok());
}

TEST(Config, WarnsAboutAnOpenListenerBeyondLoopback) {
  for (const char* local : {"127.0.0.1:50551", "127.1.2.3:0", "localhost:50551", "[::1]:50551",
                            "ipv4:127.0.0.1:50551", "unix:/run/kvshade.sock"}) {
    EXPECT_TRUE(IsLoopbackListen(local)) << local;
    ServerConfig c;
    c.listen = local;
    EXPECT_EQ(InsecureListenWarning(c), "") << local;
  }
  for (const char* remote : {"0.0.0.0:50551", "[::]:50551", "10.1.2.3:50551", "kv.internal:50551",
                             "[2001:db8::1]:50551", "128.0.0.1:1"}) {
    EXPECT_FALSE(IsLoopbackListen(remote)) << remote;
  }
  ServerConfig open;
  open.listen = "0.0.0.0:50551";
  const std::string w = InsecureListenWarning(open);
  // Says what is wrong and what to set.
  EXPECT_NE(w.find("0.0.0.0:50551 is not a loopback address"), std::string::npos) << w;
  EXPECT_NE(w.find("neither TLS nor tenant tokens"), std::string::npos) << w;
  EXPECT_NE(w.find("--tls-cert"), std::string::npos) << w;
  EXPECT_NE(w.find("--tenant-token"), std::string::npos) << w;
  EXPECT_NE(w.find("tokens_file"), std::string::npos) << w;
  // Either TLS or tenant tokens silences it.
  ServerConfig tokens = open;
  ASSERT_TRUE(AddTenantToken("alice:alice-token-123456", &tokens).ok());
  EXPECT_EQ(InsecureListenWarning(tokens), "");
  ServerConfig tls = open;
  tls.tls.cert_file = "server.pem";
  tls.tls.key_file = "server.key";
  EXPECT_EQ(InsecureListenWarning(tls), "");
}

TEST(Config, TenantTokensFromFlagsAndDescribeHidesSecrets) {
  ServerConfig c;
  EXPECT_TRUE(AddTenantToken("alice:alice-token-123456", &c).ok());
  EXPECT_TRUE(AddTenantToken("alice:alice-token-123456", &c).ok());  // same pair: fine
  EXPECT_FALSE(AddTenantToken("bob:alice-token-123456", &c).ok());  // token reused
  EXPECT_FALSE(AddTenantToken("no-colon", &c).ok());
  EXPECT_FALSE(AddTenantToken("carol:short", &c).ok());
  EXPECT_FALSE(AddTenantToken("carol:has space in it", &c).ok());
  c.prefix_secret = "do-not-print-me";
  const std::string d = DescribeConfig(c);
  EXPECT_NE(d.find("alice"), std::string::npos);
  EXPECT_EQ(d.find("alice-token"), std::string::npos) << d;
  EXPECT_EQ(d.find("do-not-print-me"), std::string::npos) << d;
}

TEST(Auth, BearerTokensNameTenantsAndSaltsAreDerived) {
  ServerConfig c;
  ASSERT_TRUE(AddTenantToken("alice:alice-token-123456", &c).ok());
  ASSERT_TRUE(AddTenantToken("bob:bob-token-12345678", &c).ok());
  c.prefix_secret = "k1";
  Authenticator auth(c);
  EXPECT_FALSE(auth.open());
  auto a = auth.AuthenticateHeader("Bearer alice-token-123456");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->name, "alice");
  auto b = auth.AuthenticateHeader("  bearer bob-token-12345678 ");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->name, "bob");
  EXPECT_NE(a->salt, b->salt);
  EXPECT_EQ(a->salt, TenantSalt("alice", "k1"));
  EXPECT_NE(a->salt, TenantSalt("alice", "k2"));  // the secret keys the salt
  EXPECT_EQ(a->salt.size(), 64u);                  // hex HMAC-SHA256
  using C = absl::StatusCode;
  EXPECT_EQ(auth.AuthenticateHeader("").status().code(), C::kUnauthenticated);
  EXPECT_EQ(auth.AuthenticateHeader("Bearer wrong-token-0000").status().code(), C::kUnauthenticated);
  EXPECT_EQ(auth.AuthenticateHeader("Basic YWxpY2U6").status().code(), C::kUnauthenticated);
  EXPECT_EQ(auth.AuthenticateHeader("Bearer alice-token-12345").status().code(), C::kUnauthenticated);
  EXPECT_EQ(auth.AuthenticateHeader("alice-token-123456").status().code(), C::kUnauthenticated);

  // No tenants configured: everyone is "default", whatever they send.
  Authenticator open(ServerConfig{});
  EXPECT_TRUE(open.open());
  auto d = open.AuthenticateHeader("");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->name, "default");
  EXPECT_EQ(open.AuthenticateHeader("Bearer anything")->salt, d->salt);
}

TEST(Metrics, FamiliesLabelsAndEndpoint) {
  Metrics m;
  m.ObserveRpc("SelectAndReconstruct", 0, 0.002);
  m.ObserveRpc("SelectAndReconstruct", 5, 0.001);
  m.ObserveStage("select", 0.001);
  m.ObserveStage("some-unlisted-stage", 0.001);  // folded into stage="other"
  m.SetTierBytes("device", "landmarks", 1024);
  m.SetTierBytes("nvme", "values", 1);  // unknown tier -> "other"
  m.SetSessions(3);
  m.PrefixLookup(PrefixStop::kAbsent, 300, 100, 1, 1);  // a partial hit
  m.PrefixLookup(PrefixStop::kEvicted, 50, 0, 0, 0);
  m.PrefixProbe(true);
  m.ChunkSelection(64, 48);
  m.ReconstructionEnergy(0.97);
  m.ProjectionResidual(0.01);
  m.Spill(4096);
  m.PageIn(2048);
  m.Eviction();
  m.IngestedTokens(512);
  for (const char* rpc : {"CreateSession", "Ingest", "ForkSession", "LookupPrefix", "AppendTokens",
                          "GetSession", "ListSessions", "CloseSession", "Attach", "Detach",
                          "GetStaticSet", "SlotTable", "CommitStaged", "Attend", "ExportSession", "Stats",
                          "ucx/SelectAndReconstruct", "ucx/Attend", "ucx/AppendTokens",
                          "ucx/Ingest", "ucx/Register", "ucx/Unregister"}) {
    m.ObserveRpc(rpc, 0, 0.0);
  }
  for (int i = 0; i < 200; ++i) m.ObserveRpc("junk-" + std::to_string(i), 0, 0.0);  // "other"

  auto endpoint = MetricsEndpoint::Start("127.0.0.1", 0, m.registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  ASSERT_GT(port, 0);
  auto get = [port](const std::string& path) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    std::string out;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
      (void)!send(fd, req.data(), req.size(), 0);
      char buf[4096];
      ssize_t r;
      while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(r));
    }
    close(fd);
    return out;
  };
  const std::string body = get("/metrics");
  ASSERT_EQ(body.rfind("HTTP/1.1 200 OK", 0), 0u) << body.substr(0, 200);
  for (const char* want : {
           "kvshade_rpc_duration_seconds_bucket{method=\"SelectAndReconstruct\"",
           "kvshade_rpc_total{code=\"OK\",method=\"SelectAndReconstruct\"} 1",
           "kvshade_rpc_total{code=\"NOT_FOUND\",method=\"SelectAndReconstruct\"} 1",
           "kvshade_errors_total{code=\"NOT_FOUND\"} 1",
           "kvshade_stage_duration_seconds_count{stage=\"select\"} 1",
           "kvshade_stage_duration_seconds_count{stage=\"other\"} 1",
           "kvshade_tier_bytes{kind=\"landmarks\",tier=\"device\"} 1024",
           "kvshade_tier_bytes{kind=\"values\",tier=\"other\"} 1",
           "kvshade_sessions 3",
           "kvshade_prefix_lookups_total{reason=\"absent\",result=\"hit\"} 1",
           "kvshade_prefix_lookups_total{reason=\"evicted\",result=\"miss\"} 1",
           "kvshade_prefix_lookups_total{reason=\"full\",result=\"hit\"} 0",
           "kvshade_prefix_tokens_total{kind=\"requested\"} 350",
           "kvshade_prefix_tokens_total{kind=\"reused\"} 100",
           "kvshade_prefix_reused_segments_total{source=\"resident\"} 1",
           "kvshade_prefix_reused_segments_total{source=\"spilled_and_paged_in\"} 1",
           "kvshade_prefix_probes_total{result=\"hit\"} 1",
           "kvshade_prefix_probes_total{result=\"miss\"} 0",
           "kvshade_chunks_selected_total 64",
           "kvshade_chunk_hits_total 48",
           "kvshade_captured_energy_ratio_count 1",
           "kvshade_projection_residual_ratio_count 1",
           "kvshade_spill_bytes_total 4096",
           "kvshade_spills_total 1",
           "kvshade_page_in_bytes_total 2048",
           "kvshade_page_ins_total 1",
           "kvshade_evictions_total 1",
           "kvshade_ingested_tokens_total 512",
           "method=\"other\"",
       }) {
    EXPECT_NE(body.find(want), std::string::npos) << "missing: " << want;
  }
  // Method label values are exactly the names docs/OPERATIONS.md lists ("Metrics": the 15
  // RPCs and the 6 UCX calls); the 200 junk names above all became "other".
  std::set<std::string> methods;
  for (size_t p = body.find("kvshade_rpc_total{"); p != std::string::npos; p = body.find("kvshade_rpc_total{", p + 1)) {
    const size_t s = body.find("method=\"", p) + 8;
    methods.insert(body.substr(s, body.find('"', s) - s));
  }
  const std::set<std::string> documented = {
      "CreateSession", "Ingest", "ForkSession", "LookupPrefix", "AppendTokens", "GetSession",
      "ListSessions", "CloseSession", "Attach", "Detach", "GetStaticSet", "SlotTable", "CommitStaged",
      "SelectAndReconstruct", "Attend", "ExportSession", "Stats", "ucx/SelectAndReconstruct", "ucx/Attend",
      "ucx/AppendTokens", "ucx/Ingest", "ucx/Register", "ucx/Unregister"};
  std::set<std::string> want = documented;
  want.insert("other");
  EXPECT_EQ(methods, want);
  EXPECT_EQ(get("/nope").rfind("HTTP/1.1 404", 0), 0u);
  // A second endpoint on the same port is refused (no SO_REUSEPORT: it would share the
  // port and take part of the scrapes).
  auto again = MetricsEndpoint::Start("127.0.0.1", static_cast<uint16_t>((*endpoint)->port()), m.registry());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  endpoint->reset();  // stops cleanly
}

// The value of the one sample line that starts with `series` + " " in a scrape, or -1.
double SampleValue(const std::string& body, const std::string& series) {
  const std::string key = "\n" + series + " ";
  const size_t p = body.find(key);
  if (p == std::string::npos) return -1;
  const size_t start = p + key.size();
  const std::string text = body.substr(start, body.find('\n', start) - start);
  if (text == "+Inf") return HUGE_VAL;
  return std::strtod(text.c_str(), nullptr);
}

TEST(Metrics, BuildInfoBudgetsTierTotalsAndProcessMetrics) {
  Metrics m;
  m.SetBuildInfo("1.2.3", "abcdef012345", "cpu");
  m.SetTierBudget("device", 8ull << 30);
  m.SetTierBudget("host", 32ull << 30);
  m.SetTierBudget("spill", HUGE_VAL);  // a spill tier without a budget
  m.SetTierBytes("device", "landmarks", 1024);
  m.SetTierBytes("device", "a", 100);
  m.SetTierBytes("device", "a", 200);  // a gauge: the total follows the latest value
  m.SetTierBytes("host", "values", 4096);
  m.SessionsExpired(2);
  auto endpoint = MetricsEndpoint::Start("127.0.0.1", 0, m.registry());
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  const int port = (*endpoint)->port();
  auto scrape = [port] {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    std::string out;
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
      const std::string req = "GET /metrics HTTP/1.0\r\n\r\n";
      (void)!send(fd, req.data(), req.size(), 0);
      char buf[4096];
      ssize_t r;
      while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, static_cast<size_t>(r));
    }
    close(fd);
    return out;
  };
  const std::string body = scrape();
  EXPECT_EQ(SampleValue(body, "kvshade_build_info{backend=\"cpu\",commit=\"abcdef012345\",version=\"1.2.3\"}"), 1)
      << body;
  EXPECT_EQ(SampleValue(body, "kvshade_tier_budget_bytes{tier=\"device\"}"), double(8ull << 30)) << body;
  EXPECT_EQ(SampleValue(body, "kvshade_tier_budget_bytes{tier=\"host\"}"), double(32ull << 30)) << body;
  EXPECT_EQ(SampleValue(body, "kvshade_tier_budget_bytes{tier=\"spill\"}"), HUGE_VAL) << body;
  // kind="total": the sum of the tier's kinds, on every tier (0 where nothing is held).
  EXPECT_EQ(SampleValue(body, "kvshade_tier_bytes{kind=\"total\",tier=\"device\"}"), 1224) << body;
  EXPECT_EQ(SampleValue(body, "kvshade_tier_bytes{kind=\"total\",tier=\"host\"}"), 4096) << body;
  EXPECT_EQ(SampleValue(body, "kvshade_tier_bytes{kind=\"total\",tier=\"spill\"}"), 0) << body;
  EXPECT_EQ(SampleValue(body, "kvshade_sessions_expired_total"), 2) << body;

  // Process metrics, from /proc/self at the scrape.
  for (const char* type : {"# TYPE process_resident_memory_bytes gauge", "# TYPE process_cpu_seconds_total counter",
                           "# TYPE process_open_fds gauge", "# TYPE process_max_fds gauge",
                           "# TYPE process_start_time_seconds gauge", "# TYPE process_virtual_memory_bytes gauge"}) {
    EXPECT_NE(body.find(type), std::string::npos) << "missing: " << type;
  }
  const double rss = SampleValue(body, "process_resident_memory_bytes");
  EXPECT_GT(rss, 1e6);
  EXPECT_LT(rss, 64e9);
  EXPECT_GE(SampleValue(body, "process_cpu_seconds_total"), 0);
  const double start = SampleValue(body, "process_start_time_seconds");
  const double now = static_cast<double>(time(nullptr));
  EXPECT_GT(start, now - 3600);
  EXPECT_LE(start, now + 2);
  // Open descriptors are counted at each scrape: ten more files open, ten more counted.
  const double fds = SampleValue(body, "process_open_fds");
  EXPECT_GT(fds, 3);
  EXPECT_LE(fds, SampleValue(body, "process_max_fds"));
  std::vector<int> extra;
  for (int i = 0; i < 10; ++i) extra.push_back(dup(0));
  EXPECT_EQ(SampleValue(scrape(), "process_open_fds"), fds + 10);
  for (int fd : extra) close(fd);
  // CPU time is read at each scrape too.
  const double cpu0 = SampleValue(body, "process_cpu_seconds_total");
  volatile double sink = 0;
  const std::clock_t busy_until = std::clock() + CLOCKS_PER_SEC / 20;  // 50 ms of CPU
  while (std::clock() < busy_until) sink = sink + 1.0;
  EXPECT_GT(SampleValue(scrape(), "process_cpu_seconds_total"), cpu0);
  endpoint->reset();
}

}  // namespace
}  // namespace config_auth_metrics_test
}  // namespace kvshade::service

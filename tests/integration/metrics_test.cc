// Integration: /metrics of the real kvshade-server follows the Prometheus conventions for
// what an operator reads first: kvshade_build_info{version,commit,backend} 1, each tier's
// budget (kvshade_tier_budget_bytes) beside its usage (kvshade_tier_bytes, whose
// kind="total" is the sum of the tier's kinds, for every tier), and the process metrics
// (resident memory, CPU seconds, open and maximum file descriptors, start time), read from
// /proc/self on each scrape; the spill tier's bytes are what it holds now (durable
// write-through, deletes, a restart's restored sessions).
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <regex>
#include <string>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace {

// Every sample line of a scrape: "name{labels}" (or "name") -> value.
std::map<std::string, double> Samples(const std::string& body) {
  std::map<std::string, double> out;
  static const std::regex line(R"(^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$)");
  size_t start = 0;
  while (start < body.size()) {
    size_t end = body.find('\n', start);
    if (end == std::string::npos) end = body.size();
    const std::string l = body.substr(start, end - start);
    start = end + 1;
    std::smatch m;
    if (l.empty() || l[0] == '#' || !std::regex_match(l, m, line)) continue;
    double v = 0;
    const std::string text = m[2];
    if (text == "+Inf") {
      v = HUGE_VAL;
    } else if (!absl::SimpleAtod(text, &v)) {
      continue;
    }
    out[m[1]] = v;
  }
  return out;
}

// The value of `series`, or NaN (and a failure) when the scrape lacks it.
double Value(const std::map<std::string, double>& samples, const std::string& series) {
  auto it = samples.find(series);
  if (it == samples.end()) {
    ADD_FAILURE() << "no series " << series;
    return std::nan("");
  }
  return it->second;
}

// "<version> (<commit>)" of kvshade-server --version, split.
std::pair<std::string, std::string> ServerVersion() {
  std::string out;
  FILE* p = popen((ServerBinary() + " --version").c_str(), "r");
  if (p == nullptr) return {};
  std::array<char, 512> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  pclose(p);
  std::smatch m;
  if (!std::regex_match(out, m, std::regex(R"(kvshade-server (\S+)(?: \((\S+)\))?\n)"))) return {};
  return {m[1], m[2]};
}

// The sum of kvshade_tier_bytes{kind=...,tier=`tier`} over the kinds other than total.
double SumOfKinds(const std::map<std::string, double>& s, const std::string& tier) {
  double sum = 0;
  const std::regex series("kvshade_tier_bytes\\{kind=\"([a-z]+)\",tier=\"" + tier + "\"\\}");
  for (const auto& [name, v] : s) {
    std::smatch m;
    if (std::regex_match(name, m, series) && m[1] != "total") sum += v;
  }
  return sum;
}

TEST(Metrics, BuildInfoTierBudgetsAndTotalsAndProcessMetrics) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--device-budget", "64MiB", "--host-budget", "128MiB", "--spill-path",
                             dir.path() + "/spill", "--spill-budget", "1GiB"}));
  auto scrape = [&] {
    auto body = HttpGet(server.metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return body.ok() ? *body : std::string();
  };
  const std::string first_body = scrape();
  const auto first = Samples(first_body);

  // Build info: one series, value 1, the version and commit --version prints.
  const auto [version, commit] = ServerVersion();
  ASSERT_FALSE(version.empty());
  const std::string info =
      "kvshade_build_info{backend=\"cpu\",commit=\"" + commit + "\",version=\"" + version + "\"}";
  ASSERT_TRUE(first.count(info)) << info << " missing from\n" << first_body;
  EXPECT_EQ(Value(first, info), 1);
  EXPECT_NE(first_body.find("# TYPE kvshade_build_info gauge"), std::string::npos);

  // Budgets per tier, as configured.
  EXPECT_EQ(Value(first, "kvshade_tier_budget_bytes{tier=\"device\"}"), 64.0 * (1 << 20));
  EXPECT_EQ(Value(first, "kvshade_tier_budget_bytes{tier=\"host\"}"), 128.0 * (1 << 20));
  EXPECT_EQ(Value(first, "kvshade_tier_budget_bytes{tier=\"spill\"}"), 1024.0 * (1 << 20));

  // Process metrics, plausible and read on each scrape.
  EXPECT_NE(first_body.find("# TYPE process_cpu_seconds_total counter"), std::string::npos);
  EXPECT_NE(first_body.find("# TYPE process_resident_memory_bytes gauge"), std::string::npos);
  EXPECT_GT(Value(first, "process_resident_memory_bytes"), 1e6);
  EXPECT_LT(Value(first, "process_resident_memory_bytes"), 64e9);
  EXPECT_GT(Value(first, "process_open_fds"), 3);
  EXPECT_LE(Value(first, "process_open_fds"), Value(first, "process_max_fds"));
  EXPECT_GT(Value(first, "process_virtual_memory_bytes"), Value(first, "process_resident_memory_bytes"));
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_GT(Value(first, "process_start_time_seconds"), now - 120);
  EXPECT_LE(Value(first, "process_start_time_seconds"), now + 2);

  // Work in between: a session on the device and host tiers, and CPU time.
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK(CreateAndIngest(*c, doc, ShadowProfile(), -1).status());
  const std::string second_body = scrape();
  const auto second = Samples(second_body);
  // CPU time counts in clock ticks (10 ms): the small ingest may not add one, but the
  // counter never goes back, and start-up alone took some.
  EXPECT_GT(Value(first, "process_cpu_seconds_total"), 0.0);
  EXPECT_GE(Value(second, "process_cpu_seconds_total"), Value(first, "process_cpu_seconds_total"));
  EXPECT_EQ(Value(second, "process_start_time_seconds"), Value(first, "process_start_time_seconds"));

  // kind="total" on every tier, the sum of the tier's kinds.
  for (const std::string tier : {"device", "host", "spill"}) {
    const std::string total = "kvshade_tier_bytes{kind=\"total\",tier=\"" + tier + "\"}";
    ASSERT_TRUE(second.count(total)) << total << " missing from\n" << second_body;
    EXPECT_EQ(Value(second, total), SumOfKinds(second, tier)) << tier;
  }
  EXPECT_GT(Value(second, "kvshade_tier_bytes{kind=\"total\",tier=\"device\"}"), 0);
  EXPECT_GT(Value(second, "kvshade_tier_bytes{kind=\"total\",tier=\"host\"}"), 0);
  EXPECT_EQ(server.Stop(), 0);
}

TEST(Metrics, SpillBudgetWithoutAndUnboundedSpillTier) {
  {
    ServerProcess none;  // no spill_path: a tier that holds nothing
    KV_ASSERT_OK(none.Start({}));
    auto body = HttpGet(none.metrics_port(), "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    const auto s = Samples(*body);
    EXPECT_EQ(Value(s, "kvshade_tier_budget_bytes{tier=\"spill\"}"), 0) << *body;
    EXPECT_EQ(Value(s, "kvshade_tier_bytes{kind=\"total\",tier=\"spill\"}"), 0) << *body;
    EXPECT_EQ(Value(s, "kvshade_tier_budget_bytes{tier=\"device\"}"), 8.0 * (1 << 30));  // defaults
    EXPECT_EQ(Value(s, "kvshade_tier_budget_bytes{tier=\"host\"}"), 32.0 * (1 << 30));
  }
  TempDir dir;
  ServerProcess unbounded;  // spill_path without spill_budget
  KV_ASSERT_OK(unbounded.Start({"--spill-path", dir.path() + "/spill"}));
  auto body = HttpGet(unbounded.metrics_port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_NE(body->find("\nkvshade_tier_budget_bytes{tier=\"spill\"} +Inf\n"), std::string::npos) << *body;
}

// kvshade_tier_bytes{tier="spill"} is what the spill tier holds now, not what was ever
// spilled: with no memory pressure (nothing spills) a durable session's write-through is
// counted; a segment leaving the tier takes its bytes off (a closed session's segment
// that is not a cached prefix goes at once, a cached one stays for reuse until evicted or
// until a restart drops it); after a restart the restored sessions' segments are counted.
TEST(Metrics, SpillTierBytesAreWhatTheTierHoldsNow) {
  TempDir dir;
  const std::vector<std::string> args = {"--host-budget", "64MiB", "--spill-path", dir.path() + "/spill"};
  const std::string spill = "kvshade_tier_bytes{kind=\"values\",tier=\"spill\"}";
  const std::string total = "kvshade_tier_bytes{kind=\"total\",tier=\"spill\"}";
  auto scrape = [](const ServerProcess& s) {
    auto body = HttpGet(s.metrics_port(), "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return Samples(body.ok() ? *body : std::string());
  };
  auto spilled_stat = [](client::Client& c) -> double {
    auto st = c.Stats();
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? double(st->spilled_bytes()) : -1;
  };
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  EXPECT_EQ(Value(scrape(server), spill), 0);

  // Two durable 1024-token documents (four 256-token prefix blocks each, so cached for
  // reuse) of the same geometry: the same value bytes each.
  const synthetic::Document kept_doc(SmallDoc(1024, 11)), cached_doc(SmallDoc(1024, 13));
  KV_ASSERT_OK_AND_ASSIGN(kept, CreateAndIngest(*c, kept_doc, ShadowProfile(), -1, /*durable=*/true));
  auto m = scrape(server);
  const double one = Value(m, spill);
  EXPECT_GT(one, 0);
  EXPECT_EQ(Value(m, total), one);
  EXPECT_EQ(Value(m, "kvshade_spills_total"), 0);  // written through, never spilled
  EXPECT_EQ(spilled_stat(*c), one);
  KV_ASSERT_OK_AND_ASSIGN(cached, CreateAndIngest(*c, cached_doc, ShadowProfile(), -1, /*durable=*/true));
  EXPECT_EQ(Value(scrape(server), spill), 2 * one);

  // 200 tokens: no whole prefix block, so never a cached prefix; closing the session
  // deletes its segment from the tier.
  const synthetic::Document brief_doc(SmallDoc(200, 12));
  KV_ASSERT_OK_AND_ASSIGN(brief, CreateAndIngest(*c, brief_doc, ShadowProfile(), -1, /*durable=*/true));
  const double three = Value(scrape(server), spill);
  EXPECT_GT(three, 2 * one);
  EXPECT_EQ(spilled_stat(*c), three);
  KV_ASSERT_OK(c->CloseSession(brief.session_id()));
  EXPECT_EQ(Value(scrape(server), spill), 2 * one);
  EXPECT_EQ(spilled_stat(*c), 2 * one);

  // A closed session's cached prefix stays on the tier (a later durable session reuses it)
  // but is nobody's in Stats.
  KV_ASSERT_OK(c->CloseSession(cached.session_id()));
  EXPECT_EQ(Value(scrape(server), spill), 2 * one);
  EXPECT_EQ(spilled_stat(*c), one);
  EXPECT_EQ(server.Stop(), 0) << server.log();

  // Restart: the open durable session is restored and counted; the closed one's cached
  // segment belonged to no session record and is dropped.
  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  auto c2 = again.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(kept.session_id()));
  EXPECT_EQ(info.state(), "ready");
  m = scrape(again);
  EXPECT_EQ(Value(m, spill), one);
  EXPECT_EQ(Value(m, total), one);
  EXPECT_EQ(Value(m, "kvshade_spills_total"), 0);
  EXPECT_EQ(spilled_stat(*c2), one);
  KV_ASSERT_OK(c2->CloseSession(kept.session_id()));
  EXPECT_EQ(again.Stop(), 0) << again.log();
}

}  // namespace
}  // namespace kvshade::integration

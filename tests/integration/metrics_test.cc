// Integration: /metrics of the real kvshade-server follows the Prometheus conventions for
// what an operator reads first: kvshade_build_info{version,commit,backend} 1, each tier's
// budget (kvshade_tier_budget_bytes) beside its usage (kvshade_tier_bytes, whose
// kind="total" is the sum of the tier's kinds, for every tier), and the process metrics
// (resident memory, CPU seconds, open and maximum file descriptors, start time), read from
// /proc/self on each scrape; the spill tier's bytes are what it holds now (durable
// write-through, deletes, a restart's restored sessions); CreateSession's prefix lookups
// are counted by result and by the reason the reuse stopped, with the prompt tokens
// requested and reused, and the reused segments paged in from the spill tier.
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>

#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace metrics_test {
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
  const std::string out = RunCommand(ServerBinary() + " --version").output;
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

// --- Prefix lookups ---------------------------------------------------------------------

// Every kvshade_prefix_* sample of a scrape.
std::map<std::string, double> PrefixSamples(const ServerProcess& server) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  std::map<std::string, double> out;
  for (const auto& [name, v] : Samples(body.ok() ? *body : std::string())) {
    if (name.rfind("kvshade_prefix_", 0) == 0) out[name] = v;
  }
  return out;
}

std::string Lookup(const std::string& result, const std::string& reason) {
  return "kvshade_prefix_lookups_total{reason=\"" + reason + "\",result=\"" + result + "\"}";
}
const std::string kRequested = "kvshade_prefix_tokens_total{kind=\"requested\"}";
const std::string kReused = "kvshade_prefix_tokens_total{kind=\"reused\"}";
const std::string kResident = "kvshade_prefix_reused_segments_total{source=\"resident\"}";
const std::string kPagedIn = "kvshade_prefix_reused_segments_total{source=\"spilled_and_paged_in\"}";

// Expects the kvshade_prefix_* series to have moved from `before` to `after` by exactly
// `deltas` (series not named there: unchanged); returns `after` for the next step.
std::map<std::string, double> ExpectDeltas(const std::map<std::string, double>& before,
                                           const std::map<std::string, double>& after,
                                           const std::map<std::string, double>& deltas,
                                           const std::string& step) {
  EXPECT_EQ(before.size(), after.size()) << step;
  for (const auto& [name, v] : after) {
    auto b = before.find(name);
    const double was = b == before.end() ? 0 : b->second;
    auto d = deltas.find(name);
    EXPECT_EQ(v - was, d == deltas.end() ? 0 : d->second) << step << ": " << name;
  }
  for (const auto& [name, d] : deltas) EXPECT_TRUE(after.count(name)) << step << ": no series " << name;
  return after;
}

v1::CreateSessionRequest CreateOver(const synthetic::Document& doc, std::vector<int32_t> tokens,
                                    bool durable = false) {
  v1::CreateSessionRequest r = synthetic::MakeCreate(doc, ShadowProfile(), -1, durable);
  r.mutable_token_ids()->Assign(tokens.begin(), tokens.end());
  return r;
}

std::vector<int32_t> Concat(const std::vector<int32_t>& a, size_t na, const std::vector<int32_t>& b,
                            size_t nb) {
  std::vector<int32_t> out(a.begin(), a.begin() + na);
  out.insert(out.end(), b.begin(), b.begin() + nb);
  return out;
}

// The series exist from the start, at 0: every (result, reason) a lookup can end in.
TEST(Metrics, PrefixLookupSeriesExistFromTheStart) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  const auto s = PrefixSamples(server);
  std::map<std::string, double> want;
  for (const char* r : {"full", "absent", "evicted", "partial_segment", "not_durable", "quota", "read_failure"}) {
    want[Lookup("hit", r)] = 0;
  }
  for (const char* r : {"absent", "evicted", "partial_segment", "not_durable", "read_failure"}) {
    want[Lookup("miss", r)] = 0;
  }
  for (const std::string& n : {kRequested, kReused, kResident, kPagedIn}) want[n] = 0;
  want["kvshade_prefix_probes_total{result=\"hit\"}"] = 0;
  want["kvshade_prefix_probes_total{result=\"miss\"}"] = 0;
  want["kvshade_prefix_splits_total{source=\"hint\"}"] = 0;
  want["kvshade_prefix_splits_total{source=\"automatic\"}"] = 0;
  EXPECT_EQ(s, want);
  EXPECT_EQ(server.Stop(), 0);
}

// Hits (whole prompt, or part of it and why the rest was not reused) and misses, by reason,
// with the tokens requested and reused, one CreateSession at a time; LookupPrefix is a
// probe, counted apart.
TEST(Metrics, PrefixLookupsByResultAndReason) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--spill-path", dir.path() + "/spill"}));
  auto c = server.Connect();
  const synthetic::Document a(SmallDoc(1024, 21)), other(SmallDoc(1024, 22));
  const std::vector<int32_t>& at = a.tokens();
  auto m = PrefixSamples(server);

  // Nothing cached: a miss, the rest (all of it) absent.
  KV_ASSERT_OK_AND_ASSIGN(first, CreateAndIngest(*c, a, ShadowProfile(), -1));
  EXPECT_EQ(first.reused_tokens(), 0u);
  m = ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "absent"), 1}, {kRequested, 1024}}, "first");

  // The same prompt: all of it reused, one resident segment.
  KV_ASSERT_OK_AND_ASSIGN(full, c->CreateSession(CreateOver(a, at)));
  EXPECT_EQ(full.reused_tokens(), 1024u);
  m = ExpectDeltas(m, PrefixSamples(server),
                   {{Lookup("hit", "full"), 1}, {kRequested, 1024}, {kReused, 1024}, {kResident, 1}}, "full");

  // The prompt and 512 tokens never seen: a hit, the rest absent.
  KV_ASSERT_OK_AND_ASSIGN(longer, c->CreateSession(CreateOver(a, Concat(at, 1024, other.tokens(), 512))));
  EXPECT_EQ(longer.reused_tokens(), 1024u);
  m = ExpectDeltas(m, PrefixSamples(server),
                   {{Lookup("hit", "absent"), 1}, {kRequested, 1536}, {kReused, 1024}, {kResident, 1}},
                   "longer");

  // Its first 512 tokens then others: two blocks match the cached segment, but segments are
  // reused whole and this one goes on differently; the matched blocks become an automatic
  // segment end of the new session.
  KV_ASSERT_OK_AND_ASSIGN(fork, c->CreateSession(CreateOver(a, Concat(at, 512, other.tokens(), 512))));
  EXPECT_EQ(fork.reused_tokens(), 0u);
  EXPECT_EQ(fork.automatic_segment_end(), 512u);
  m = ExpectDeltas(m, PrefixSamples(server),
                   {{Lookup("miss", "partial_segment"), 1},
                    {kRequested, 1024},
                    {"kvshade_prefix_splits_total{source=\"automatic\"}", 1}},
                   "diverging");

  // Its first 512 tokens alone: the cached segment runs past the prompt.
  KV_ASSERT_OK_AND_ASSIGN(shorter, c->CreateSession(CreateOver(a, Concat(at, 512, at, 0))));
  EXPECT_EQ(shorter.reused_tokens(), 0u);
  m = ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "partial_segment"), 1}, {kRequested, 512}},
                   "shorter");

  // A durable session does not reuse a segment that is not durable.
  KV_ASSERT_OK_AND_ASSIGN(durable, c->CreateSession(CreateOver(a, at, /*durable=*/true)));
  EXPECT_EQ(durable.reused_tokens(), 0u);
  m = ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "not_durable"), 1}, {kRequested, 1024}},
                   "durable");

  // LookupPrefix: a probe, not a lookup of a session.
  v1::LookupPrefixRequest probe;
  *probe.mutable_model() = a.Model();
  *probe.mutable_profile() = ShadowProfile();
  probe.mutable_token_ids()->Assign(at.begin(), at.end());
  KV_ASSERT_OK_AND_ASSIGN(probed, c->LookupPrefix(probe));
  EXPECT_EQ(probed.reusable_tokens(), 1024u);
  m = ExpectDeltas(m, PrefixSamples(server), {{"kvshade_prefix_probes_total{result=\"hit\"}", 1}}, "probe");

  // The cap on reused segments per session: a chain of 6 one-block segments (each session
  // reuses the ones before and ingests one more block), then a prompt over 8 blocks reuses
  // the first kMaxReusedSegments = 5 of them only.
  const synthetic::Document q(SmallDoc(2048, 23));
  for (int k = 1; k <= 6; ++k) {
    const size_t n = size_t(k) * 256;
    KV_ASSERT_OK_AND_ASSIGN(created, c->CreateSession(CreateOver(q, Concat(q.tokens(), n, q.tokens(), 0))));
    EXPECT_EQ(created.reused_tokens(), uint64_t(k - 1) * 256) << k;
    KV_ASSERT_OK(synthetic::IngestRange(*c, q, created.session_id(), -1, int64_t(created.reused_tokens()),
                                        int64_t(n)).status());
    m = ExpectDeltas(m, PrefixSamples(server),
                     {{Lookup(k == 1 ? "miss" : "hit", "absent"), 1},
                      {kRequested, double(n)},
                      {kReused, double(created.reused_tokens())},
                      {kResident, double(created.reused_tokens() / 256)}},
                     "chain " + std::to_string(k));
  }
  KV_ASSERT_OK_AND_ASSIGN(capped, c->CreateSession(CreateOver(q, q.tokens())));
  EXPECT_EQ(capped.reused_tokens(), 5u * 256);
  m = ExpectDeltas(m, PrefixSamples(server),
                   {{Lookup("hit", "quota"), 1}, {kRequested, 2048}, {kReused, 5 * 256}, {kResident, 5}},
                   "capped");
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// A cached prefix evicted under memory pressure (no spill tier: a closed session's cached
// segment goes when the host tier is full) is a miss with reason evicted, not absent.
TEST(Metrics, PrefixLookupOfAnEvictedPrefixIsAMissEvicted) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--host-budget", "2MiB"}));
  auto c = server.Connect();
  // 2048 tokens of SmallDoc: 512 KiB of values; four fill the budget.
  const synthetic::Document gone(SmallDoc(2048, 31));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, gone, ShadowProfile(), -1));
  KV_ASSERT_OK(c->CloseSession(s.session_id()));  // cached, nobody's
  auto m = PrefixSamples(server);
  int docs = 0;
  while (Value(Samples(*HttpGet(server.metrics_port(), "/metrics")), "kvshade_evictions_total") == 0 &&
         docs < 6) {
    KV_ASSERT_OK(CreateAndIngest(*c, synthetic::Document(SmallDoc(2048, 40 + docs)), ShadowProfile(), -1).status());
    ++docs;
  }
  ASSERT_EQ(Value(Samples(*HttpGet(server.metrics_port(), "/metrics")), "kvshade_evictions_total"), 1)
      << server.log();
  m = ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "absent"), docs}, {kRequested, 2048.0 * docs}},
                   "filling");
  KV_ASSERT_OK_AND_ASSIGN(again, c->CreateSession(synthetic::MakeCreate(gone, ShadowProfile(), -1)));
  EXPECT_EQ(again.reused_tokens(), 0u);
  ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "evicted"), 1}, {kRequested, 2048}}, "evicted");
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

// The values SST file of the spill tier (its largest: factors and records are small and
// compressed, values are not), to damage.
std::string LargestSst(const std::string& dir) {
  std::string best;
  uintmax_t size = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() == ".sst" && e.file_size() > size) {
      size = e.file_size();
      best = e.path();
    }
  }
  return best;
}

// After a restart a durable session's segment is on the spill tier only: a CreateSession
// that reuses it pages it in first (counted as spilled_and_paged_in); when its values can
// no longer be read back (the file damaged under the daemon), the lookup is a miss with
// reason read_failure and the session ingests those tokens itself.
TEST(Metrics, PrefixLookupPagesSpilledSegmentsInAndCountsReadFailures) {
  TempDir dir;
  const std::string spill = dir.path() + "/spill";
  const std::vector<std::string> args = {"--spill-path", spill};
  const synthetic::Document a(SmallDoc(1024, 51));
  {
    ServerProcess server;
    KV_ASSERT_OK(server.Start(args));
    auto c = server.Connect();
    KV_ASSERT_OK(CreateAndIngest(*c, a, ShadowProfile(), -1, /*durable=*/true).status());
    ASSERT_EQ(server.Stop(), 0) << server.log();
  }
  {
    ServerProcess server;
    KV_ASSERT_OK(server.Start(args));
    auto c = server.Connect();
    auto m = PrefixSamples(server);
    const double page_ins = Value(Samples(*HttpGet(server.metrics_port(), "/metrics")), "kvshade_page_ins_total");
    KV_ASSERT_OK_AND_ASSIGN(reused, c->CreateSession(synthetic::MakeCreate(a, ShadowProfile(), -1)));
    EXPECT_EQ(reused.reused_tokens(), 1024u);
    ExpectDeltas(m, PrefixSamples(server),
                 {{Lookup("hit", "full"), 1}, {kRequested, 1024}, {kReused, 1024}, {kPagedIn, 1}}, "paged in");
    EXPECT_EQ(Value(Samples(*HttpGet(server.metrics_port(), "/metrics")), "kvshade_page_ins_total"), page_ins + 1);
    ASSERT_EQ(server.Stop(), 0) << server.log();
  }
  // Damage the middle of the values' last data block (the layer read last), where only a
  // page-in reads: the start-up's scans read the first block of each segment.
  const std::string sst = LargestSst(spill);
  ASSERT_FALSE(sst.empty());
  {
    const uintmax_t size = std::filesystem::file_size(sst);
    std::fstream f(sst, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(size * 3 / 4));
    const std::string junk(64, '\x5a');
    f.write(junk.data(), std::streamsize(junk.size()));
    ASSERT_TRUE(f.good());
  }
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  auto m = PrefixSamples(server);
  KV_ASSERT_OK_AND_ASSIGN(unread, c->CreateSession(synthetic::MakeCreate(a, ShadowProfile(), -1)));
  EXPECT_EQ(unread.reused_tokens(), 0u);
  EXPECT_EQ(unread.tokens_to_ingest(), 1024u);
  ExpectDeltas(m, PrefixSamples(server), {{Lookup("miss", "read_failure"), 1}, {kRequested, 1024}},
               "read failure");
  EXPECT_NE(server.log().find("prefix_read_failure"), std::string::npos) << server.log();
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace metrics_test
}  // namespace kvshade::integration

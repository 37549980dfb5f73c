// Integration: the host tier's budget through the real daemon (docs/DESIGN.md "Memory").
// With a spill tier, the least recently used values spill when the budget is reached, and
// Attach pages the session's spilled values in before it returns (the first decode step
// finds them resident); the spill and page-in series of /metrics count it. Without one,
// closed sessions' cached segments are evicted to make room (kvshade_evictions_total), and
// with every session open a full tier refuses the ingest with RESOURCE_EXHAUSTED.
#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace memory_tiers_test {
namespace {

// The value of the /metrics sample line `series` (exact name and labels); -1 when absent.
double Metric(const ServerProcess& server, const std::string& series) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return -1;
  const std::string key = "\n" + series + " ";
  const size_t at = body->find(key);
  if (at == std::string::npos) return -1;
  return std::atof(body->c_str() + at + key.size());
}

// 2048 tokens of SmallDoc: 2048 x 2 layers x 2 heads x 32 x 2 bytes = 512 KiB of bf16
// values, so four of them fill the 2 MiB host budget.
constexpr int64_t kTokens = 2048;

TEST(MemoryTiers, SpillsPastTheHostBudgetAndAttachPagesIn) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--host-budget", "2MiB", "--spill-path", dir.path() + "/rocks"}));
  auto c = server.Connect();
  const synthetic::Document first(SmallDoc(kTokens, 1));
  KV_ASSERT_OK_AND_ASSIGN(a, CreateAndIngest(*c, first, ShadowProfile(), -1));
  EXPECT_EQ(Metric(server, "kvshade_spills_total"), 0);
  // More documents of the same size until the store has had to spill: `first`, the least
  // recently used, goes first.
  int docs = 1;
  while (Metric(server, "kvshade_spills_total") <= 0 && docs < 12) {
    const synthetic::Document other(SmallDoc(kTokens, 100 + docs));
    KV_ASSERT_OK(CreateAndIngest(*c, other, ShadowProfile(), -1).status());
    ++docs;
  }
  ASSERT_GE(Metric(server, "kvshade_spills_total"), 1) << server.log();
  EXPECT_GE(docs, 4);  // four fit in the budget
  EXPECT_LE(docs, 6);
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_GT(stats.spilled_bytes(), 0u);
  EXPECT_LE(stats.host_bytes_used(), stats.host_bytes_budget());
  EXPECT_GE(Metric(server, "kvshade_spill_bytes_total"), double(stats.spilled_bytes()));

  // Attach pages `first` back in before it returns: when the reply arrives the page-in is
  // counted, and the decode steps that follow page nothing in.
  const double ins = Metric(server, "kvshade_page_ins_total");
  const double in_bytes = Metric(server, "kvshade_page_in_bytes_total");
  EXPECT_EQ(ins, 0);
  v1::AttachRequest ar;
  ar.set_session_id(a.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  EXPECT_EQ(Metric(server, "kvshade_page_ins_total"), ins + 1);  // its one segment
  EXPECT_GT(Metric(server, "kvshade_page_in_bytes_total"), in_bytes);
  for (int l = 0; l < first.spec().layers; ++l) {
    KV_ASSERT_OK_AND_ASSIGN(sel, c->SelectAndReconstruct(MakeSelect(first, l, {att.attachment_id()}, 0, 0, kTokens)));
    ASSERT_EQ(sel.deltas_size(), 1);
    EXPECT_GT(sel.deltas(0).selected(), 0u);
  }
  EXPECT_EQ(Metric(server, "kvshade_page_ins_total"), ins + 1);
  KV_ASSERT_OK_AND_ASSIGN(after, c->Stats());
  EXPECT_LE(after.host_bytes_used(), after.host_bytes_budget());
  EXPECT_EQ(Metric(server, "kvshade_evictions_total"), 0);  // spilling made the room
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(MemoryTiers, WithoutASpillTierClosedSessionsAreEvictedAndAFullTierRefuses) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--host-budget", "2MiB"}));
  auto c = server.Connect();
  std::vector<std::string> open;
  absl::Status refused;
  for (int i = 0; i < 12 && refused.ok(); ++i) {
    const synthetic::Document doc(SmallDoc(kTokens, 200 + i));
    auto s = CreateAndIngest(*c, doc, ShadowProfile(), -1);
    if (s.ok()) {
      open.push_back(s->session_id());
    } else {
      refused = s.status();
    }
  }
  // Every session open, nothing spillable or evictable: the full tier refuses.
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_GE(open.size(), 3u);
  EXPECT_LE(open.size(), 4u);
  EXPECT_EQ(Metric(server, "kvshade_evictions_total"), 0);
  // Closing one keeps its segment cached (reusable) until the memory is needed; the next
  // document evicts it and fits.
  KV_ASSERT_OK(c->CloseSession(open.front()));
  const synthetic::Document next(SmallDoc(kTokens, 300));
  KV_ASSERT_OK(CreateAndIngest(*c, next, ShadowProfile(), -1).status());
  EXPECT_EQ(Metric(server, "kvshade_evictions_total"), 1);
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_EQ(stats.spilled_bytes(), 0u);
  EXPECT_LE(stats.host_bytes_used(), stats.host_bytes_budget());
  // Full again: refused again, nothing evicted from the open sessions.
  const synthetic::Document more(SmallDoc(kTokens, 301));
  EXPECT_EQ(CreateAndIngest(*c, more, ShadowProfile(), -1).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Metric(server, "kvshade_evictions_total"), 1);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace memory_tiers_test
}  // namespace kvshade::integration

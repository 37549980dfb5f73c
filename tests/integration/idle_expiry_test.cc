// Integration: --session-idle-ttl-s on the real kvshade-server: an untouched session is
// closed by the background maintenance once the TTL has passed, and counted on /metrics.
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace idle_expiry_test {
namespace {

TEST(IdleExpiry, AnUntouchedSessionIsClosedAfterTheTtlAndCounted) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--session-idle-ttl-s", "1"}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));

  // Maintenance runs about once a second: the session goes within a few seconds.
  const absl::Time end = absl::Now() + absl::Seconds(20);
  int sessions = -1;
  while (absl::Now() < end) {
    auto list = c->ListSessions();  // listing does not touch
    ASSERT_TRUE(list.ok()) << list.status();
    sessions = list->sessions_size();
    if (sessions == 0) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_EQ(sessions, 0) << server.log();
  EXPECT_EQ(c->GetSession(created.session_id()).status().code(), absl::StatusCode::kNotFound);
  auto metrics = HttpGet(server.metrics_port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_NE(metrics->find("\nkvshade_sessions_expired_total 1\n"), std::string::npos) << *metrics;
  EXPECT_EQ(server.Stop(), 0);
}

}  // namespace
}  // namespace idle_expiry_test
}  // namespace kvshade::integration

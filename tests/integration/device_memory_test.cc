// Device memory on demand (docs/OPERATIONS.md, `device_growth`): the daemon holds device
// memory in steps as sessions need it, reports what it holds, returns steps no data uses,
// and still refuses past its budget; `device_growth: 0` holds the whole budget from the
// start. CPU backend (its arena is the same class over host memory), a real server.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "harness.h"

namespace kvshade::integration {
namespace device_memory_test {
namespace {

v1::Profile MiniProfile() {
  v1::Profile p;
  p.set_kind(v1::PROFILE_KIND_MINI);
  p.set_chunk_size(8);
  p.set_local_window(32);
  return p;
}

uint64_t Held(client::Client& c) {
  auto st = c.Stats();
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() ? st->device_bytes_held() : 0;
}

TEST(DeviceMemory, HeldGrowsWithSessionsAndShrinksWhenTheyClose) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu", "--device-budget", "256MiB", "--device-growth", "1MiB"}));
  auto c = server.Connect();
  KV_ASSERT_OK_AND_ASSIGN(st0, c->Stats());
  EXPECT_EQ(st0.device_bytes_budget(), uint64_t(256) << 20);
  const uint64_t held0 = st0.device_bytes_held();
  EXPECT_LE(held0, uint64_t(2) << 20) << "nothing to hold yet";

  // Sessions whose segments are not cached for reuse (mini): closing them frees their memory.
  std::vector<std::string> sessions;
  for (int i = 0; i < 6; ++i) {
    const synthetic::Document doc(SmallDoc(4096, 40 + i));
    KV_ASSERT_OK_AND_ASSIGN(cs, CreateAndIngest(*c, doc, MiniProfile(), -1));
    sessions.push_back(cs.session_id());
  }
  KV_ASSERT_OK_AND_ASSIGN(st1, c->Stats());
  EXPECT_GT(st1.device_bytes_held(), held0);
  EXPECT_GE(st1.device_bytes_held(), st1.device_bytes_used());
  EXPECT_LT(st1.device_bytes_held(), st1.device_bytes_budget()) << "on demand: not the whole budget";
  KV_ASSERT_OK_AND_ASSIGN(metrics, HttpGet(server.metrics_port(), "/metrics"));
  const size_t at = metrics.find("\nkvshade_device_held_bytes ");
  ASSERT_NE(at, std::string::npos) << metrics.substr(0, 2000);
  // (The maintenance pass may have returned an emptied scratch step since: not equal.)
  const double gauge = std::strtod(metrics.c_str() + at + 27, nullptr);
  EXPECT_GE(gauge, double(st1.device_bytes_used()));
  EXPECT_LE(gauge, double(st1.device_bytes_held()));

  for (const std::string& s : sessions) KV_ASSERT_OK(c->CloseSession(s));
  // The maintenance pass (about once a second) returns the emptied steps, keeping one.
  uint64_t held2 = Held(*c);
  for (int i = 0; i < 50 && held2 > held0 + (uint64_t(1) << 20); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    held2 = Held(*c);
  }
  EXPECT_LT(held2, st1.device_bytes_held());
  EXPECT_LE(held2, held0 + (uint64_t(1) << 20));
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(DeviceMemory, BudgetStaysEnforcedAndGrowthZeroReservesIt) {
  {
    ServerProcess server;
    KV_ASSERT_OK(server.Start({"--backend", "cpu", "--device-budget", "64MiB", "--device-growth", "0"}));
    auto c = server.Connect();
    KV_ASSERT_OK_AND_ASSIGN(st, c->Stats());
    EXPECT_EQ(st.device_bytes_held(), uint64_t(64) << 20);
    EXPECT_EQ(server.Stop(), 0) << server.log();
  }
  // A budget too small for one session's device state: refused by name, nothing held past it.
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"--backend", "cpu", "--device-budget", "1MiB", "--device-growth", "256KiB"}));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(16384, 3));
  auto cs = CreateAndIngest(*c, doc, ShadowProfile(16, 8, 4), -1);
  ASSERT_FALSE(cs.ok());
  EXPECT_EQ(cs.status().code(), absl::StatusCode::kResourceExhausted) << cs.status();
  KV_ASSERT_OK_AND_ASSIGN(st, c->Stats());
  EXPECT_LE(st.device_bytes_held(), uint64_t(1) << 20);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace device_memory_test
}  // namespace kvshade::integration

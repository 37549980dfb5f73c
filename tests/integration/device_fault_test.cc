// Integration: a device fault stops the daemon cleanly. A CUDA sticky error leaves the
// device unusable for the process; the daemon then refuses every call with UNAVAILABLE
// naming the fault, drains (health NOT_SERVING) and exits with status 1 for its supervisor
// to start a new process, which restores the durable sessions. The fault is injected here
// through KVSHADE_FAILPOINT_DEVICE_FAULT (service/device_fault.h) on the CPU backend.
#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace device_fault_test {
namespace {

TEST(DeviceFault, RefusesCallsExitsWithAnErrorAndARestartRestoresDurableSessions) {
  TempDir dir;
  const std::string failpoint = dir.path() + "/device-fault";
  const std::vector<std::string> args = {"--spill-path", dir.path() + "/rocks", "--backend", "cpu"};
  ServerProcess server;
  setenv("KVSHADE_FAILPOINT_DEVICE_FAULT", failpoint.c_str(), 1);
  const absl::Status started = server.Start(args);
  unsetenv("KVSHADE_FAILPOINT_DEVICE_FAULT");
  KV_ASSERT_OK(started);
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, ShadowProfile(), -1, /*durable=*/true));
  KV_ASSERT_OK(c->GetSession(s.session_id()).status());

  std::ofstream(failpoint) << "fault\n";
  // Every call from now on is refused; the first one names the fault unless the server
  // has already stopped listening (then gRPC's own UNAVAILABLE).
  auto refused = c->GetSession(s.session_id());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  if (absl::StrContains(refused.status().message(), "device")) {
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "injected device fault"))
        << refused.status();
  }
  EXPECT_EQ(server.WaitExit(absl::Seconds(30)), 1) << server.log();
  EXPECT_TRUE(absl::StrContains(server.log(), "device fault, draining and exiting")) << server.log();

  // A new process (no fault) restores the durable session.
  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  auto c2 = again.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(s.session_id()));
  EXPECT_EQ(info.state(), "ready");
  EXPECT_EQ(info.tokens(), 512u);
  EXPECT_EQ(again.Stop(), 0) << again.log();
}

}  // namespace
}  // namespace device_fault_test
}  // namespace kvshade::integration

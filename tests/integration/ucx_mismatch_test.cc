// Integration: a UCX client whose transports differ from the daemon's (client shm,self
// against a daemon with UCX's choice, and the reverse) works over UCX without waiting out
// a timeout; and a UCX call that times out marks the data plane failed, so that the
// Client falls back to gRPC loudly (counted) instead of timing out call after call.
#include <fstream>

#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace ucx_mismatch_test {
namespace {

struct Pair {
  std::string daemon, client;
};

class UcxMismatchTest : public ::testing::TestWithParam<Pair> {};

TEST_P(UcxMismatchTest, SelectWorksOverUcx) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, GetParam().daemon)}));
  auto grpc_client = server.Connect();
  client::ClientOptions uo = UcxClientOptions(GetParam().client);
  uo.timeout = absl::Seconds(3);
  auto c = server.Connect(uo);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*grpc_client, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  ASSERT_TRUE(c->ucx_connected());
  for (int l = 0; l < doc.spec().layers; ++l) {
    KV_ASSERT_OK(c->SelectAndReconstruct(MakeSelect(doc, l, {att.attachment_id()}, 0, 0, 512)).status());
  }
  // Every call went over UCX: a call that timed out or failed over UCX would have marked the
  // data plane failed and been counted as a fallback to gRPC (no clock is read: a loaded
  // machine may be slow, and slowness alone is not a mismatch).
  EXPECT_EQ(c->ucx_fallbacks(), 0u);
  EXPECT_TRUE(c->ucx_connected());
}

TEST(UcxTimeoutTest, TimedOutCallMarksDataPlaneFailedAndClientFallsBackToGrpc) {
  TempDir dir;
  ServerProcess server;
  KV_ASSERT_OK(server.Start({"-c", UcxConfig(dir, "")}));
  client::ClientOptions uo = UcxClientOptions("shm,self");
  uo.timeout = absl::Seconds(2);  // also the UCX per-call timeout
  auto c = server.Connect(uo);
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  v1::AttachRequest ar;
  ar.set_session_id(created.session_id());
  ar.set_worker_id("w");
  KV_ASSERT_OK_AND_ASSIGN(att, c->Attach(ar));
  ASSERT_TRUE(c->ucx_connected());
  const auto sel = MakeSelect(doc, 0, {att.attachment_id()}, 0, 0, 512);
  KV_ASSERT_OK(c->SelectAndReconstruct(sel).status());
  // A message id the daemon has no handler for is dropped unanswered: the call times out.
  auto dp = c->ucx_data_plane();
  ASSERT_NE(dp, nullptr);
  auto lost = dp->RawAdmittedRequest(99, "");
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDeadlineExceeded) << lost.status();
  // From then on the data plane is failed: calls fail at once, not after another timeout.
  EXPECT_TRUE(dp->failed());
  // "At once" is read from the status, not a clock: a call that was sent and waited for
  // the timeout would end DEADLINE_EXCEEDED; one refused before sending ends UNAVAILABLE
  // with the earlier failure's reason.
  auto again = dp->SelectAndReconstruct(sel);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kUnavailable) << again.status();
  EXPECT_NE(again.status().message().find("no longer used"), std::string::npos) << again.status();
  dp.reset();
  // The Client drops it loudly and routes the call over gRPC.
  KV_ASSERT_OK(c->SelectAndReconstruct(sel).status());
  EXPECT_EQ(c->ucx_fallbacks(), 1u);
  EXPECT_FALSE(c->ucx_connected());
}

INSTANTIATE_TEST_SUITE_P(Pairs, UcxMismatchTest,
                         ::testing::Values(Pair{"", "shm,self"}, Pair{"", "tcp,self"},
                                           Pair{"shm,self", ""}, Pair{"", ""}),
                         [](const auto& info) {
                           auto name = [](std::string t) {
                             if (t.empty()) return std::string("auto");
                             for (char& ch : t) ch = ch == ',' ? '_' : ch;
                             return t;
                           };
                           return "daemon_" + name(info.param.daemon) + "_client_" +
                                  name(info.param.client);
                         });

}  // namespace
}  // namespace ucx_mismatch_test
}  // namespace kvshade::integration

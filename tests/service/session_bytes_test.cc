// GetSession reports the device and host bytes of a session's own segments: a freshly
// ingested session owns everything it ingested (its segments are registered as prefixes
// too, which once made it report 0); a session that reused the whole prompt owns none.
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace session_bytes_test {
namespace {

TEST(SessionBytes, AFreshlyIngestedSessionReportsItsBytes) {
  Harness hx;
  Stream s = MakeStream(512, hx.model, 91);
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(64);
  auto first = hx.Open(s, p);
  v1::GetSessionRequest gr;
  gr.set_session_id(first.session);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->reused_tokens(), 0u);
  EXPECT_GT(info->gpu_bytes(), 0u);
  EXPECT_GT(info->host_bytes(), 0u);
  // The same prompt again: everything reused, nothing of its own.
  auto second = hx.Open(s, p);
  gr.set_session_id(second.session);
  auto info2 = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info2.ok());
  EXPECT_EQ(info2->reused_tokens(), 512u);
  EXPECT_EQ(info2->gpu_bytes(), 0u);
  EXPECT_EQ(info2->host_bytes(), 0u);
}

}  // namespace
}  // namespace session_bytes_test
}  // namespace kvshade::service::testing

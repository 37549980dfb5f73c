// Checks shared by the ingest tests that reach into the engine (its staging pool).
#pragma once

#include <string>

#include "engine_internals.h"
#include "service_test_util.h"

namespace kvshade::service::testing {

// What a dropped Ingest stream leaves behind: nothing. Its session is still ingesting with
// no tokens, the device and host tiers hold what they held before it (device0, host0), and
// nothing of the engine's staging pool is leased. `where` names the case in failures.
inline void ExpectDroppedStreamLeftNothing(Harness& hx, const std::string& session_id, double device0,
                                           double host0, const std::string& where) {
  v1::GetSessionRequest gr;
  gr.set_session_id(session_id);
  auto info = hx.engine->GetSession(hx.tenant, gr);
  ASSERT_TRUE(info.ok()) << where << ": " << info.status();
  EXPECT_EQ(info->state(), "ingesting") << where;
  EXPECT_EQ(info->tokens(), 0u) << where;
  EXPECT_EQ(TierTotal(hx, "device"), device0) << where;
  EXPECT_EQ(TierTotal(hx, "host"), host0) << where;
  EXPECT_EQ(EngineInternals(*hx.engine).staging().leased_bytes(), 0u) << where;
}

}  // namespace kvshade::service::testing

// Integration: durability across process death. Durable sessions are written through to
// the spill tier at commit; after kill -9 (no drain, no flush) and a restart on the same
// spill path they come back with the same ids, tokens and answers, while non-durable
// sessions are gone. A graceful SIGTERM restart keeps appended tokens too.
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace {

struct Snapshot {
  std::vector<int32_t> chunks;
  std::string keys, values;
};

Snapshot FirstSelect(client::Client& c, const synthetic::Document& doc, const std::string& sid, int64_t pos) {
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("snapshot");
  auto a = c.Attach(ar);
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return {};
  auto r = c.SelectAndReconstruct(MakeSelect(doc, 1, {a->attachment_id()}, 0, 2, pos));
  EXPECT_TRUE(r.ok()) << r.status();
  c.Detach(a->attachment_id()).IgnoreError();
  if (!r.ok() || r->deltas_size() != 1) return {};
  const auto& d = r->deltas(0);
  return {std::vector<int32_t>(d.chunk().begin(), d.chunk().end()), d.keys().data(), d.values().data()};
}

TEST(Restart, KillNineKeepsDurableSessions) {
  TempDir spill;
  const std::vector<std::string> args = {"--spill-path", spill.path() + "/rocks"};
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(1024));
  KV_ASSERT_OK_AND_ASSIGN(durable, CreateAndIngest(*c, doc, ShadowProfile(), -1, /*durable=*/true));
  KV_ASSERT_OK_AND_ASSIGN(transient, CreateAndIngest(*c, doc, ShadowProfile(), 1, /*durable=*/false));
  KV_ASSERT_OK_AND_ASSIGN(info_before, c->GetSession(durable.session_id()));
  EXPECT_TRUE(info_before.durable());
  const Snapshot before = FirstSelect(*c, doc, durable.session_id(), 1024);
  ASSERT_FALSE(before.chunks.empty());

  server.Kill9();
  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  auto c2 = again.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(durable.session_id()));
  EXPECT_EQ(info.state(), "ready");
  EXPECT_EQ(info.tokens(), 1024u);
  EXPECT_TRUE(info.durable());
  EXPECT_EQ(info.label(), info_before.label());
  EXPECT_EQ(info.model_id(), info_before.model_id());
  EXPECT_EQ(c2->GetSession(transient.session_id()).status().code(), absl::StatusCode::kNotFound);
  const Snapshot after = FirstSelect(*c2, doc, durable.session_id(), 1024);
  EXPECT_EQ(after.chunks, before.chunks);
  EXPECT_EQ(after.keys, before.keys);
  EXPECT_EQ(after.values, before.values);
  // The restored session is fully usable: fork it and decode the child.
  KV_ASSERT_OK_AND_ASSIGN(child, c2->ForkSession(durable.session_id(), 1024));
  const Snapshot forked = FirstSelect(*c2, doc, child.session_id(), 1024);
  EXPECT_EQ(forked.chunks, before.chunks);
  EXPECT_EQ(again.Stop(), 0) << again.log();
}

TEST(Restart, GracefulRestartKeepsAppendedTokens) {
  TempDir spill;
  const std::vector<std::string> args = {"--spill-path", spill.path() + "/rocks"};
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  const synthetic::Document doc(SmallDoc(512));
  KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, doc, ShadowProfile(), -1, /*durable=*/true));
  KV_ASSERT_OK_AND_ASSIGN(appended, c->AppendTokens(synthetic::MakeAppend(doc, s.session_id(), 0, 512, 528)));
  EXPECT_EQ(appended.tokens(), 528u);
  const Snapshot before = FirstSelect(*c, doc, s.session_id(), 528);
  ASSERT_EQ(server.Stop(), 0) << server.log();  // SIGTERM: drain and flush

  ServerProcess again;
  KV_ASSERT_OK(again.Start(args));
  auto c2 = again.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(s.session_id()));
  EXPECT_EQ(info.tokens(), 528u);
  const Snapshot after = FirstSelect(*c2, doc, s.session_id(), 528);
  EXPECT_EQ(after.chunks, before.chunks);
  EXPECT_EQ(after.keys, before.keys);
  EXPECT_EQ(after.values, before.values);
  EXPECT_EQ(again.Stop(), 0) << again.log();
}

}  // namespace
}  // namespace kvshade::integration

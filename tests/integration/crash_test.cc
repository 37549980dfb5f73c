// Integration: a crash test in the style of RocksDB's db_crashtest, against the real daemon.
// Each iteration starts kvshade-server on one spill directory (append_fsync always), runs
// random traffic from a client thread (durable sessions created over two documents and
// three prompts, appends, closes), kills the daemon with SIGKILL at a random moment,
// restarts it on the same directory and checks every acknowledged write:
//   - a durable session whose commit was acknowledged is there and ready, with exactly its
//     acknowledged tokens, or one append more when an append was in flight at the kill;
//   - a session whose close was acknowledged is gone (NOT_FOUND);
//   - every surviving session answers a select (chunks, reconstructed keys and values)
//     bit for bit as it did right after its last acknowledged write, before the kill.
// Sessions carry over from one iteration to the next, so later kills land on restored
// state. KVSHADE_CRASH_ITERATIONS=N sets the iterations (default 3 here; the long run is
// scripts/crash-test.sh) and KVSHADE_CRASH_SEED the random stream (default fixed).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace {

constexpr int64_t kAppend = 8;  // tokens per append (one chunk)

struct Selected {
  std::vector<int32_t> chunks;
  std::string keys, values;
  bool ok = false;
  std::string error;
};

struct Tracked {
  Selected snap;        // the select answer right after the last acknowledged write
  int64_t snap_tokens = -1;
  int doc = 0;
  int question = -1;   // -1: the document alone
  int64_t base = 0;    // tokens at creation
  int64_t acked = 0;   // tokens acknowledged
  int64_t pending = 0; // tokens if the append in flight at the kill landed (0: none)
  bool close_pending = false;
  std::string history;  // what was acknowledged when, for a failure's message
};

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

// One select of layer 1 at the session's position through a fresh attachment.
Selected SelectNow(client::Client& c, const synthetic::Document& doc, const std::string& sid,
                   int question, int64_t pos) {
  Selected out;
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("crash-check");
  auto a = c.Attach(ar);
  if (!a.ok()) {
    out.error = a.status().ToString();
    return out;
  }
  auto r = c.SelectAndReconstruct(MakeSelect(doc, 1, {a->attachment_id()}, std::max(question, 0), 3, pos));
  c.Detach(a->attachment_id()).IgnoreError();
  if (!r.ok() || r->deltas_size() != 1) {
    out.error = r.ok() ? "not one delta" : r.status().ToString();
    return out;
  }
  const auto& d = r->deltas(0);
  out.chunks.assign(d.chunk().begin(), d.chunk().end());
  out.keys = d.keys().data();
  out.values = d.values().data();
  out.ok = true;
  return out;
}

TEST(CrashTest, RandomKillsLoseNoAcknowledgedWrite) {
  const int iterations = std::max(1, EnvInt("KVSHADE_CRASH_ITERATIONS", 3));
  std::mt19937_64 rng(static_cast<uint64_t>(EnvInt("KVSHADE_CRASH_SEED", 20261202)));
  TempDir spill;
  const std::vector<std::string> args = {"--spill-path", spill.path() + "/rocks", "--append-fsync",
                                         "always", "--backend", "cpu"};
  const std::vector<synthetic::Document> docs = {synthetic::Document(SmallDoc(512, 21)),
                                                 synthetic::Document(SmallDoc(512, 22))};
  const v1::Profile profile = ShadowProfile();
  std::map<std::string, Tracked> live;
  std::vector<std::string> closed;
  uint64_t creates = 0, appends = 0, closes = 0, verified_sessions = 0;
  int kills = 0;
  std::vector<double> restart_s;

  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  for (int it = 0; it < iterations; ++it) {
    // Traffic until the kill; one call in flight at a time, so at most one is unknown.
    std::atomic<bool> killed{false};
    std::string traffic_error;
    std::mt19937_64 trng(rng());
    std::thread traffic([&] {
      auto c = server.Connect();
      while (!killed.load()) {
        const double p = std::uniform_real_distribution<double>(0, 1)(trng);
        std::vector<std::string> ids;
        for (const auto& [id, t] : live) ids.push_back(id);
        // Creates, appends and closes, with between 3 and 40 live sessions (a long run must
        // stay under the tenant's session limit).
        enum class Op { kCreate, kAppend, kClose };
        Op op = p < 0.25 ? Op::kCreate : p < 0.85 ? Op::kAppend : Op::kClose;
        if (ids.size() < 3) op = Op::kCreate;
        if (ids.size() > 40 && op == Op::kCreate) op = Op::kClose;
        if (op == Op::kCreate) {
          const int d = static_cast<int>(trng() % docs.size());
          const int q = static_cast<int>(trng() % 3) - 1;
          auto r = CreateAndIngest(*c, docs[d], profile, q, /*durable=*/true);
          if (!r.ok()) {
            if (!killed.load()) traffic_error = "create: " + r.status().ToString();
            return;
          }
          const int64_t n = static_cast<int64_t>(q < 0 ? docs[d].tokens().size()
                                                       : docs[d].SessionTokens(q).size());
          Tracked& t = live[r->session_id()];
          t.doc = d;
          t.question = q;
          t.base = t.acked = n;
          t.history += absl::StrCat(" [kill ", it, "] created (", n, " tokens, ", r->reused_tokens(),
                                    " reused)");
          ++creates;
          t.snap = SelectNow(*c, docs[d], r->session_id(), q, n);  // fails only past the kill
          t.snap_tokens = t.snap.ok ? n : -1;
        } else if (op == Op::kAppend) {
          const std::string id = ids[trng() % ids.size()];
          Tracked& t = live[id];
          t.pending = t.acked + kAppend;
          auto r = c->AppendTokens(synthetic::MakeAppend(docs[t.doc], id, std::max(t.question, 0),
                                                         t.acked, t.pending));
          if (!r.ok()) {
            if (!killed.load()) traffic_error = "append: " + r.status().ToString();
            return;
          }
          t.history += absl::StrCat(" [kill ", it, "] append ", t.acked, "->", t.pending);
          t.acked = t.pending;
          t.pending = 0;
          ++appends;
          t.snap = SelectNow(*c, docs[t.doc], id, t.question, t.acked);
          t.snap_tokens = t.snap.ok ? t.acked : -1;
        } else {
          const std::string id = ids[trng() % ids.size()];
          live[id].close_pending = true;
          absl::Status st = c->CloseSession(id);
          if (!st.ok()) {
            if (!killed.load()) traffic_error = "close: " + st.ToString();
            return;
          }
          live.erase(id);
          closed.push_back(id);
          ++closes;
        }
      }
    });
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(400, 2500)(rng)));
    killed.store(true);
    server.Kill9();
    ++kills;
    traffic.join();
    ASSERT_TRUE(traffic_error.empty()) << "iteration " << it << ": " << traffic_error << "\n"
                                       << server.log();

    const auto t0 = std::chrono::steady_clock::now();
    KV_ASSERT_OK(server.Start(args));
    restart_s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    auto c = server.Connect();
    for (const std::string& id : closed) {
      EXPECT_EQ(c->GetSession(id).status().code(), absl::StatusCode::kNotFound)
          << "iteration " << it << ": session " << id << " was closed and acknowledged";
    }
    closed.clear();
    for (auto it_s = live.begin(); it_s != live.end();) {
      Tracked& t = it_s->second;
      auto info = c->GetSession(it_s->first);
      if (t.close_pending && info.status().code() == absl::StatusCode::kNotFound) {
        it_s = live.erase(it_s);  // the close in flight at the kill landed
        continue;
      }
      ASSERT_TRUE(info.ok()) << "iteration " << it << ": acknowledged session " << it_s->first
                             << " lost: " << info.status() << "\n" << server.log();
      EXPECT_EQ(info->state(), "ready");
      const int64_t tokens = static_cast<int64_t>(info->tokens());
      if (t.pending != 0 && tokens == t.pending) t.acked = tokens;
      EXPECT_EQ(tokens, t.acked) << "iteration " << it << ": session " << it_s->first << " (document "
                                 << t.doc << ", prompt " << t.question << "):" << t.history;
      t.acked = tokens;
      t.pending = 0;
      t.close_pending = false;
      ++it_s;
    }

    // Every surviving session answers as it did after its last acknowledged write.
    for (const auto& [id, t] : live) {
      if (t.snap_tokens != t.acked) continue;  // the kill came before its snapshot
      const Selected got = SelectNow(*c, docs[t.doc], id, t.question, t.acked);
      ASSERT_TRUE(got.ok) << "iteration " << it << ": session " << id << ": " << got.error;
      EXPECT_EQ(got.chunks, t.snap.chunks) << "iteration " << it << ": session " << id;
      EXPECT_TRUE(got.keys == t.snap.keys) << "iteration " << it << ": session " << id << " keys differ";
      EXPECT_TRUE(got.values == t.snap.values) << "iteration " << it << ": session " << id << " values differ";
      ++verified_sessions;
    }
    if (HasFailure()) break;
  }
  EXPECT_EQ(server.Stop(), 0) << server.log();

  std::sort(restart_s.begin(), restart_s.end());
  const double p50 = restart_s.empty() ? 0 : restart_s[restart_s.size() / 2];
  const double worst = restart_s.empty() ? 0 : restart_s.back();
  std::printf("crash test: %d kills; acknowledged %llu durable creates, %llu appends, %llu closes; "
              "%llu sessions answered as before the kill; restart until SERVING as the harness "
              "polls it: p50 %.2f s, max %.2f s\n",
              kills, (unsigned long long)creates, (unsigned long long)appends,
              (unsigned long long)closes, (unsigned long long)verified_sessions, p50, worst);
  RecordProperty("kills", kills);
  RecordProperty("acknowledged_writes", static_cast<int>(creates + appends + closes));
  EXPECT_GT(creates + appends, 0u);
}

}  // namespace
}  // namespace kvshade::integration

// Integration: concurrency against the real server. Eight workers attached to one session
// decode concurrently (each attachment keeps its own slot tables, so all eight must see
// the same, deterministic answers as a single worker), and 100 sessions are created,
// ingested, used and closed at once from several client threads.
#include <atomic>
#include <set>
#include <thread>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/tensor.h"

namespace kvshade::integration {
namespace {

struct StepRecord {
  std::vector<int32_t> chunks;
  std::string keys, values;
  uint32_t hits = 0, selected = 0;
  bool operator==(const StepRecord& o) const {
    return chunks == o.chunks && keys == o.keys && values == o.values && hits == o.hits && selected == o.selected;
  }
};

TEST(Concurrency, EightWorkersOnOneSessionSeeIdenticalDeterministicAnswers) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  auto c = server.Connect();
  ASSERT_NE(c, nullptr);
  const synthetic::Document doc(SmallDoc(2048));
  KV_ASSERT_OK_AND_ASSIGN(created, CreateAndIngest(*c, doc, ShadowProfile(), -1));
  const std::string sid = created.session_id();
  constexpr int kWorkers = 8, kSteps = 12;
  const int L = doc.spec().layers;

  // Reference: one worker alone.
  auto run_worker = [&](client::Client& cl, const std::string& worker,
                        std::vector<StepRecord>* out) -> absl::Status {
    v1::AttachRequest ar;
    ar.set_session_id(sid);
    ar.set_worker_id(worker);
    auto att = cl.Attach(ar);
    if (!att.ok()) return att.status();
    for (int step = 0; step < kSteps; ++step) {
      for (int l = 0; l < L; ++l) {
        auto r = cl.SelectAndReconstruct(MakeSelect(doc, l, {att->attachment_id()}, 0, step, 2048));
        if (!r.ok()) return r.status();
        if (r->deltas_size() != 1) return absl::InternalError("expected one delta");
        const auto& d = r->deltas(0);
        StepRecord rec;
        rec.chunks.assign(d.chunk().begin(), d.chunk().end());
        rec.keys = d.keys().data();
        rec.values = d.values().data();
        rec.hits = d.hits();
        rec.selected = d.selected();
        out->push_back(std::move(rec));
      }
    }
    return cl.Detach(att->attachment_id());
  };
  std::vector<StepRecord> reference;
  KV_ASSERT_OK(run_worker(*c, "solo", &reference));
  ASSERT_EQ(reference.size(), static_cast<size_t>(kSteps * L));

  // Eight at once, each with its own channel (as separate worker processes would have).
  std::vector<std::vector<StepRecord>> got(kWorkers);
  std::vector<absl::Status> status(kWorkers);
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      auto cl = server.Connect();
      status[w] = cl ? run_worker(*cl, "worker-" + std::to_string(w), &got[w]) : absl::InternalError("connect");
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < kWorkers; ++w) {
    ASSERT_TRUE(status[w].ok()) << "worker " << w << ": " << status[w];
    ASSERT_EQ(got[w].size(), reference.size());
    for (size_t i = 0; i < reference.size(); ++i) {
      ASSERT_TRUE(got[w][i] == reference[i]) << "worker " << w << " differs at call " << i;
    }
  }
  // The slot tables were private: the solo run's later steps hit (temporal locality).
  uint64_t hits = 0, selected = 0;
  for (size_t i = L; i < reference.size(); ++i) {
    hits += reference[i].hits;
    selected += reference[i].selected;
  }
  EXPECT_GT(hits, selected / 2) << "later steps should mostly hit the slot tables";
  KV_ASSERT_OK_AND_ASSIGN(info, c->GetSession(sid));
  EXPECT_EQ(info.attachments(), 0u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

TEST(Concurrency, HundredSessionsAtOnce) {
  ServerProcess server;
  KV_ASSERT_OK(server.Start({}));
  constexpr int kSessions = 100, kThreads = 8;
  // Each session a distinct small document (different seeds: no prefix sharing), exact
  // profile for cheap ingest, a few hundred tokens.
  std::vector<std::string> ids(kSessions);
  std::vector<absl::Status> status(kSessions);
  std::atomic<int> next{0};
  std::vector<std::thread> threads;
  v1::Profile exact;
  exact.set_kind(v1::PROFILE_KIND_EXACT);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto cl = server.Connect();
      for (int i = next++; i < kSessions; i = next++) {
        if (!cl) {
          status[i] = absl::InternalError("connect");
          continue;
        }
        const synthetic::Document doc(SmallDoc(96 + (i % 4) * 8, 1000 + i));
        auto created = CreateAndIngest(*cl, doc, exact, -1);
        if (!created.ok()) {
          status[i] = created.status();
          continue;
        }
        ids[i] = created->session_id();
        v1::AttachRequest ar;
        ar.set_session_id(ids[i]);
        auto att = cl->Attach(ar);
        if (!att.ok()) {
          status[i] = att.status();
          continue;
        }
        v1::AttendRequest r;
        auto* q = r.add_queries();
        q->set_attachment_id(att->attachment_id());
        const auto qv = doc.Query(0, 0, 0, doc.spec().doc_tokens);
        *q->mutable_q() = client::MakeBf16Tensor({doc.spec().q_heads, doc.spec().head_dim}, absl::MakeConstSpan(qv));
        auto out = cl->Attend(r);
        status[i] = out.ok() ? cl->Detach(att->attachment_id()) : out.status();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) ASSERT_TRUE(status[i].ok()) << "session " << i << ": " << status[i];
  auto c = server.Connect();
  KV_ASSERT_OK_AND_ASSIGN(list, c->ListSessions());
  std::set<std::string> listed;
  for (const auto& s : list.sessions()) listed.insert(s.session_id());
  for (const auto& id : ids) EXPECT_TRUE(listed.count(id)) << id;
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), static_cast<size_t>(kSessions));
  KV_ASSERT_OK_AND_ASSIGN(stats, c->Stats());
  EXPECT_EQ(stats.sessions(), static_cast<uint64_t>(kSessions));
  // Close them all concurrently too.
  next = 0;
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto cl = server.Connect();
      for (int i = next++; i < kSessions; i = next++) status[i] = cl->CloseSession(ids[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kSessions; ++i) EXPECT_TRUE(status[i].ok()) << status[i];
  KV_ASSERT_OK_AND_ASSIGN(after, c->Stats());
  EXPECT_EQ(after.sessions(), 0u);
  EXPECT_EQ(server.Stop(), 0) << server.log();
}

}  // namespace
}  // namespace kvshade::integration

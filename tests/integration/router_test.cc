// Integration: client-side routing over several daemons (kvshade/client/router.h).
// Placement is checked as arithmetic (the documented bytes, spread, stability, minimal
// movement) and against 3 real kvshade-servers: a document, its questions and its forks
// land on one endpoint (so the question reuses the cached prefix there), a router that
// has never seen an id finds it by asking, batches that span endpoints come back in order
// and equal to per-endpoint calls, removing an endpoint moves only its keys (the others
// keep their cache hits), and a down endpoint's new keys go to their next-ranked endpoint.
#include <xxhash.h>

#include <map>
#include <set>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/client/router.h"

namespace kvshade::integration {
namespace router_test {
namespace {

using client::Router;
using client::RouterEndpoint;
using client::RouterOptions;

const std::vector<std::string> kNames = {"kv-0", "kv-1", "kv-2"};

std::string Canonical(v1::SelectAndReconstructResponse r) {
  for (auto& d : *r.mutable_deltas()) d.clear_attachment_id();
  return r.SerializeAsString();
}

// 3 servers and a router over them named kv-0..kv-2 (names, not ports, decide placement,
// so the assignment of the test's documents is the same in every run).
class RouterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 3; ++i) {
      servers_.push_back(std::make_unique<ServerProcess>());
      KV_ASSERT_OK(servers_.back()->Start({}));
      direct_.push_back(servers_.back()->Connect());
      ASSERT_NE(direct_.back(), nullptr);
    }
  }

  std::unique_ptr<Router> MakeRouter(const std::vector<int>& which = {0, 1, 2}) {
    RouterOptions o;
    for (int i : which) {
      RouterEndpoint e;
      e.name = kNames[i];
      e.options.target = servers_[i]->target();
      e.options.timeout = absl::Seconds(30);
      o.endpoints.push_back(e);
    }
    auto r = Router::Connect(o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : nullptr;
  }

  // Which servers (by index) hold `session_id`, asked directly.
  std::vector<int> Holders(const std::string& session_id) {
    std::vector<int> out;
    for (int i = 0; i < 3; ++i) {
      if (!servers_[i]->running()) continue;
      auto r = direct_[i]->GetSession(session_id);
      if (r.ok()) {
        out.push_back(i);
      } else {
        EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
      }
    }
    return out;
  }

  static int IndexOf(const std::string& name) {
    return static_cast<int>(std::find(kNames.begin(), kNames.end(), name) - kNames.begin());
  }

  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::unique_ptr<client::Client>> direct_;
};

std::string AttachVia(Router& r, const std::string& sid, const std::string& worker) {
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id(worker);
  auto a = r.Attach(ar);
  EXPECT_TRUE(a.ok()) << a.status();
  return a.ok() ? a->attachment_id() : "";
}

TEST(RouterPlacement, KeyBytesAreTheDocumentedOnes) {
  const std::vector<int32_t> tokens = {1, 2, 300000, -5, 7};
  std::string bytes = "model/x";
  bytes.push_back('\0');
  for (size_t i = 0; i < 4; ++i) {  // route_prefix_tokens = 4: the 5th token is not part of it
    const uint32_t t = static_cast<uint32_t>(tokens[i]);
    for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<char>(t >> (8 * b)));
  }
  const uint64_t key = client::RoutePrefixKey("model/x", tokens, 4);
  EXPECT_EQ(key, XXH3_64bits_withSeed(bytes.data(), bytes.size(), client::kRouteSeed));
  const uint64_t seed = XXH3_64bits_withSeed("kv-1", 4, client::kRouteSeed);
  unsigned char k[8];
  for (int i = 0; i < 8; ++i) k[i] = static_cast<unsigned char>(key >> (8 * i));
  EXPECT_EQ(client::RendezvousWeight("kv-1", key), XXH3_64bits_withSeed(k, 8, seed));

  // Only the first route_prefix_tokens tokens and the model count.
  std::vector<int32_t> later = tokens;
  later[4] = 99;
  EXPECT_EQ(client::RoutePrefixKey("model/x", later, 4), key);
  std::vector<int32_t> earlier = tokens;
  earlier[3] = 99;
  EXPECT_NE(client::RoutePrefixKey("model/x", earlier, 4), key);
  EXPECT_NE(client::RoutePrefixKey("model/y", tokens, 4), key);
  // A prompt shorter than route_prefix_tokens is keyed by all of it.
  EXPECT_EQ(client::RoutePrefixKey("model/x", absl::MakeConstSpan(tokens).subspan(0, 4), 256), key);
}

TEST(RouterPlacement, SpreadIsEvenStableAndMovesOnlyWhatItMust) {
  const std::vector<std::string> three = kNames;
  const std::vector<std::string> reordered = {"kv-2", "kv-0", "kv-1"};
  const std::vector<std::string> without1 = {"kv-0", "kv-2"};
  const std::vector<std::string> four = {"kv-0", "kv-1", "kv-2", "kv-3"};
  std::map<std::string, int> count;
  int moved_on_add = 0;
  const int n = 3000;
  for (int i = 0; i < n; ++i) {
    const std::vector<int32_t> tokens = {i, i * 7 + 1, 42};
    const uint64_t key = client::RoutePrefixKey("m", tokens);
    const auto rank = client::RendezvousRank(three, key);
    ASSERT_EQ(rank.size(), 3u);
    const std::string& owner = three[rank[0]];
    ++count[owner];
    // The list's order does not matter, only the names.
    EXPECT_EQ(reordered[client::RendezvousRank(reordered, key)[0]], owner);
    // Removing kv-1 moves only kv-1's keys, each to its next-ranked endpoint.
    const std::string& owner2 = without1[client::RendezvousRank(without1, key)[0]];
    if (owner != "kv-1") {
      EXPECT_EQ(owner2, owner) << "key " << i;
    } else {
      EXPECT_EQ(owner2, three[rank[1]]) << "key " << i;
    }
    // Adding kv-3 takes keys only for itself.
    const std::string& owner4 = four[client::RendezvousRank(four, key)[0]];
    if (owner4 != owner) {
      EXPECT_EQ(owner4, "kv-3") << "key " << i;
      ++moved_on_add;
    }
  }
  // Expected n/3 each (sd ~26): a broken hash would be far outside these bounds.
  for (const auto& name : three) {
    EXPECT_GT(count[name], n * 3 / 10) << name;
    EXPECT_LT(count[name], n * 37 / 100) << name;
  }
  EXPECT_GT(moved_on_add, n * 2 / 10);  // ~n/4 move to the new endpoint
  EXPECT_LT(moved_on_add, n * 3 / 10);
}

TEST(RouterPlacement, RejectsBadOptions) {
  EXPECT_EQ(Router::Connect(RouterOptions{}).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions dup;
  dup.endpoints.resize(2);
  dup.endpoints[0].options.target = dup.endpoints[1].options.target = "127.0.0.1:1";
  EXPECT_EQ(Router::Connect(dup).status().code(), absl::StatusCode::kInvalidArgument);
  RouterOptions zero;
  zero.endpoints.resize(1);
  zero.route_prefix_tokens = 0;
  EXPECT_EQ(Router::Connect(zero).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(RouterTest, DocumentsQuestionsAndForksLandTogether) {
  auto router = MakeRouter();
  ASSERT_NE(router, nullptr);
  KV_ASSERT_OK(router->WaitForServing(absl::Seconds(20)));
  const v1::Profile profile = ShadowProfile();
  std::set<int> used;
  for (int d = 0; d < 9; ++d) {
    const synthetic::Document doc(SmallDoc(512, 100 + d));
    KV_ASSERT_OK_AND_ASSIGN(created, router->CreateSession(synthetic::MakeCreate(doc, profile, -1)));
    const std::string sid = created.session_id();
    KV_ASSERT_OK_AND_ASSIGN(owner, router->SessionEndpoint(sid));
    EXPECT_EQ(owner, router->Rank(router->PrefixKey(doc.spec().model_id, doc.tokens()))[0]);
    // Really there, and only there.
    EXPECT_EQ(Holders(sid), std::vector<int>{static_cast<int>(owner)}) << "document " << d;
    used.insert(static_cast<int>(owner));
    KV_ASSERT_OK_AND_ASSIGN(client, router->ClientForSession(sid));
    KV_ASSERT_OK(synthetic::IngestRange(*client, doc, sid, -1, 0, 512).status());

    // A fork goes to the parent's endpoint.
    KV_ASSERT_OK_AND_ASSIGN(fork, router->ForkSession(sid, 512));
    EXPECT_EQ(Holders(fork.session_id()), std::vector<int>{static_cast<int>(owner)});
    // A question (the document's tokens, then its own) lands with the document and
    // reuses its cached prefix there.
    KV_ASSERT_OK_AND_ASSIGN(question, router->CreateSession(synthetic::MakeCreate(doc, profile, 0)));
    EXPECT_EQ(Holders(question.session_id()), std::vector<int>{static_cast<int>(owner)});
    EXPECT_EQ(question.reused_tokens(), 512u) << "document " << d;
    KV_ASSERT_OK_AND_ASSIGN(lookup, router->LookupPrefix([&] {
      v1::LookupPrefixRequest lr;
      *lr.mutable_model() = doc.Model();
      *lr.mutable_profile() = profile;
      lr.mutable_token_ids()->Assign(doc.tokens().begin(), doc.tokens().end());
      return lr;
    }()));
    EXPECT_EQ(lookup.reusable_tokens(), 512u);
    // Calls by id reach the owner: attach, select, close.
    const std::string att = AttachVia(*router, fork.session_id(), "w");
    KV_ASSERT_OK(router->SelectAndReconstruct(MakeSelect(doc, 0, {att}, 0, 0, 512)).status());
    KV_ASSERT_OK(router->Detach(att));
    KV_ASSERT_OK(router->CloseSession(question.session_id()));
    EXPECT_TRUE(Holders(question.session_id()).empty());
  }
  // The 9 documents (fixed seeds and names: the same placement every run) use every endpoint.
  EXPECT_EQ(used.size(), 3u);
  KV_ASSERT_OK_AND_ASSIGN(all, router->ListSessions());
  EXPECT_EQ(all.sessions_size(), 18);  // 9 documents + 9 forks
  EXPECT_EQ(router->ucx_fallbacks(), 0u);
}

TEST_F(RouterTest, UnknownIdsAreFoundByAskingAndBatchesSpanEndpoints) {
  auto a = MakeRouter();
  ASSERT_NE(a, nullptr);
  const v1::Profile profile = ShadowProfile();
  // Two documents on two different endpoints (found by placement arithmetic).
  std::vector<std::unique_ptr<synthetic::Document>> docs;
  std::vector<std::string> sids;
  std::set<size_t> owners;
  for (uint64_t seed = 200; docs.size() < 2 && seed < 300; ++seed) {
    auto doc = std::make_unique<synthetic::Document>(SmallDoc(512, seed));
    const size_t owner = a->Rank(a->PrefixKey(doc->spec().model_id, doc->tokens()))[0];
    if (owners.count(owner)) continue;
    owners.insert(owner);
    KV_ASSERT_OK_AND_ASSIGN(created, a->CreateSession(synthetic::MakeCreate(*doc, profile, -1)));
    KV_ASSERT_OK_AND_ASSIGN(client, a->ClientForSession(created.session_id()));
    KV_ASSERT_OK(synthetic::IngestRange(*client, *doc, created.session_id(), -1, 0, 512).status());
    sids.push_back(created.session_id());
    docs.push_back(std::move(doc));
  }
  ASSERT_EQ(docs.size(), 2u);
  const std::string x1 = AttachVia(*a, sids[0], "x1"), y1 = AttachVia(*a, sids[1], "y1");

  // A router that has seen none of these ids finds the sessions and attachments.
  auto b = MakeRouter();
  ASSERT_NE(b, nullptr);
  KV_ASSERT_OK_AND_ASSIGN(info, b->GetSession(sids[1]));
  EXPECT_EQ(info.session_id(), sids[1]);
  KV_ASSERT_OK_AND_ASSIGN(where_b, b->SessionEndpoint(sids[1]));
  KV_ASSERT_OK_AND_ASSIGN(where_a, a->SessionEndpoint(sids[1]));
  EXPECT_EQ(where_b, where_a);
  KV_ASSERT_OK_AND_ASSIGN(att_b, b->AttachmentEndpoint(y1));
  EXPECT_EQ(att_b, where_a);
  EXPECT_EQ(b->GetSession("no-such-session").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(b->Detach("no-such-attachment").code(), absl::StatusCode::kNotFound);

  // One batch over both endpoints (y first): answers in the request's order, equal to the
  // same queries sent to each endpoint on its own (fresh attachments, same slot state).
  const std::string x2 = AttachVia(*a, sids[0], "x2"), y2 = AttachVia(*a, sids[1], "y2");
  for (int step = 0; step < 3; ++step) {
    for (uint32_t l = 0; l < 2; ++l) {
      v1::SelectAndReconstructRequest batch = MakeSelect(*docs[1], l, {y1}, 0, step, 512);
      *batch.add_queries() = MakeSelect(*docs[0], l, {x1}, 0, step, 512).queries(0);
      KV_ASSERT_OK_AND_ASSIGN(rb, b->SelectAndReconstruct(batch));
      ASSERT_EQ(rb.deltas_size(), 2);
      EXPECT_EQ(rb.deltas(0).attachment_id(), y1);
      EXPECT_EQ(rb.deltas(1).attachment_id(), x1);
      KV_ASSERT_OK_AND_ASSIGN(ry, a->SelectAndReconstruct(MakeSelect(*docs[1], l, {y2}, 0, step, 512)));
      KV_ASSERT_OK_AND_ASSIGN(rx, a->SelectAndReconstruct(MakeSelect(*docs[0], l, {x2}, 0, step, 512)));
      v1::SelectAndReconstructResponse want;
      *want.add_deltas() = ry.deltas(0);
      *want.add_deltas() = rx.deltas(0);
      EXPECT_EQ(Canonical(rb), Canonical(want)) << "layer " << l << " step " << step;

      v1::AttendRequest ab;
      ab.set_layer(l);
      for (const auto& q : batch.queries()) {
        auto* aq = ab.add_queries();
        aq->set_attachment_id(q.attachment_id());
        *aq->mutable_q() = q.q();
      }
      KV_ASSERT_OK_AND_ASSIGN(ob, b->Attend(ab));
      ASSERT_EQ(ob.outputs_size(), 2);
      v1::AttendRequest one = ab;
      one.mutable_queries()->DeleteSubrange(0, 1);  // x1 alone
      KV_ASSERT_OK_AND_ASSIGN(ox, a->Attend(one));
      EXPECT_EQ(ob.outputs(1).SerializeAsString(), ox.outputs(0).SerializeAsString());
      // Async: over both endpoints (a thread) and on one (the Client's async call).
      auto fb = b->AttendAsync(ab);
      auto fx = b->AttendAsync(one);
      KV_ASSERT_OK_AND_ASSIGN(ob2, fb.get());
      KV_ASSERT_OK_AND_ASSIGN(ox2, fx.get());
      EXPECT_EQ(ob2.SerializeAsString(), ob.SerializeAsString());
      EXPECT_EQ(ox2.SerializeAsString(), ox.SerializeAsString());
    }
  }
  // An unknown attachment inside a batch names its query.
  v1::SelectAndReconstructRequest bad = MakeSelect(*docs[0], 0, {x1, "no-such-attachment"}, 0, 0, 512);
  auto rbad = b->SelectAndReconstruct(bad);
  EXPECT_EQ(rbad.status().code(), absl::StatusCode::kNotFound) << rbad.status();
  EXPECT_NE(rbad.status().message().find("queries[1]"), absl::string_view::npos) << rbad.status();
  EXPECT_EQ(b->SelectAndReconstructAsync(bad).get().status().code(), absl::StatusCode::kNotFound);
}

TEST_F(RouterTest, RemovingAnEndpointMovesOnlyItsKeys) {
  auto three = MakeRouter();
  ASSERT_NE(three, nullptr);
  const v1::Profile profile = ShadowProfile();
  std::vector<std::unique_ptr<synthetic::Document>> docs;
  std::vector<size_t> owner3;
  for (int d = 0; d < 9; ++d) {
    docs.push_back(std::make_unique<synthetic::Document>(SmallDoc(512, 100 + d)));
    KV_ASSERT_OK_AND_ASSIGN(created, three->CreateSession(synthetic::MakeCreate(*docs.back(), profile, -1)));
    KV_ASSERT_OK_AND_ASSIGN(client, three->ClientForSession(created.session_id()));
    KV_ASSERT_OK(synthetic::IngestRange(*client, *docs.back(), created.session_id(), -1, 0, 512).status());
    owner3.push_back(three->Rank(three->PrefixKey(docs.back()->spec().model_id, docs.back()->tokens()))[0]);
  }
  // kv-1 leaves: its documents go to their second choice (a cache miss there); every
  // other document stays where its prefix is cached.
  auto two = MakeRouter({0, 2});
  ASSERT_NE(two, nullptr);
  int stayed = 0, moved = 0;
  for (size_t d = 0; d < docs.size(); ++d) {
    const auto& doc = *docs[d];
    const uint64_t key = three->PrefixKey(doc.spec().model_id, doc.tokens());
    KV_ASSERT_OK_AND_ASSIGN(q, two->CreateSession(synthetic::MakeCreate(doc, profile, 0)));
    KV_ASSERT_OK_AND_ASSIGN(where2, two->SessionEndpoint(q.session_id()));
    const int server = IndexOf(two->name(where2));
    EXPECT_EQ(Holders(q.session_id()), std::vector<int>{server});
    if (kNames[owner3[d]] != "kv-1") {
      EXPECT_EQ(server, static_cast<int>(owner3[d])) << "document " << d << " moved";
      EXPECT_EQ(q.reused_tokens(), 512u) << "document " << d;
      ++stayed;
    } else {
      EXPECT_EQ(server, static_cast<int>(three->Rank(key)[1])) << "document " << d;
      EXPECT_EQ(q.reused_tokens(), 0u) << "document " << d;
      ++moved;
    }
  }
  EXPECT_GT(stayed, 0);
  EXPECT_GT(moved, 0);
}

TEST_F(RouterTest, DownEndpointFailsOverToNextRanked) {
  auto router = MakeRouter();
  ASSERT_NE(router, nullptr);
  const v1::Profile profile = ShadowProfile();
  // A document owned by kv-0 and one owned by another endpoint.
  std::unique_ptr<synthetic::Document> on0, other;
  for (uint64_t seed = 300; (!on0 || !other) && seed < 400; ++seed) {
    auto doc = std::make_unique<synthetic::Document>(SmallDoc(512, seed));
    const size_t owner = router->Rank(router->PrefixKey(doc->spec().model_id, doc->tokens()))[0];
    if (owner == 0 && !on0) on0 = std::move(doc);
    else if (owner != 0 && !other) other = std::move(doc);
  }
  ASSERT_TRUE(on0 && other);
  KV_ASSERT_OK_AND_ASSIGN(lost, router->CreateSession(synthetic::MakeCreate(*on0, profile, -1)));
  KV_ASSERT_OK_AND_ASSIGN(lost_at, router->SessionEndpoint(lost.session_id()));
  EXPECT_EQ(lost_at, 0u);

  EXPECT_EQ(servers_[0]->Stop(), 0);
  // New keys owned by kv-0 go to their next-ranked endpoint.
  const size_t second = router->Rank(router->PrefixKey(on0->spec().model_id, on0->tokens()))[1];
  KV_ASSERT_OK_AND_ASSIGN(moved, router->CreateSession(synthetic::MakeCreate(*on0, profile, 0)));
  KV_ASSERT_OK_AND_ASSIGN(moved_at, router->SessionEndpoint(moved.session_id()));
  EXPECT_EQ(moved_at, second);
  EXPECT_EQ(Holders(moved.session_id()), std::vector<int>{static_cast<int>(second)});
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = on0->Model();
  *lr.mutable_profile() = profile;
  lr.mutable_token_ids()->Assign(on0->tokens().begin(), on0->tokens().end());
  KV_ASSERT_OK(router->LookupPrefix(lr).status());
  // Other keys are untouched.
  KV_ASSERT_OK_AND_ASSIGN(kept, router->CreateSession(synthetic::MakeCreate(*other, profile, -1)));
  KV_ASSERT_OK_AND_ASSIGN(kept_at, router->SessionEndpoint(kept.session_id()));
  EXPECT_EQ(kept_at, router->Rank(router->PrefixKey(other->spec().model_id, other->tokens()))[0]);
  // Sessions are not replicated: the one on kv-0 is unavailable, not "not found".
  auto gone = router->GetSession(lost.session_id());
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  // A fresh router asking for an id while an endpoint is down cannot say NOT_FOUND.
  auto fresh = MakeRouter();
  ASSERT_NE(fresh, nullptr);
  EXPECT_EQ(fresh->GetSession("no-such-session").status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace router_test
}  // namespace kvshade::integration

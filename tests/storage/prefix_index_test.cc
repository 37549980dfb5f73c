// Prefix keys and the prefix index: a golden vector (the README's scheme, so other
// processes and languages can check themselves) and the independent program behind it
// (prefix_key_reference.c), the same keys in two processes, salts
// and scope fields separating key spaces, longest-prefix lookup on shared and diverging
// streams, and refcounts / parents blocking LRU eviction.
#include "kvshade/storage/prefix_index.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "storage_test_util.h"

namespace kvshade::storage {
namespace prefix_index_test {
namespace {

PrefixScope Scope(std::string salt = "tenant-a") {
  return PrefixScope{"llama-3-8b", "shadow;rank=160;C=8;codec=int4;group=16", std::move(salt)};
}

std::vector<int32_t> Iota(int n, int32_t start = 0) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), start);
  return v;
}

std::vector<int32_t> RandomTokens(std::mt19937_64& rng, int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = int32_t(rng() % 128256);
  return v;
}

// The worked example of storage/README.md ("Prefix keys"). If this fails, the key scheme
// changed: every cached prefix of every deployment would stop matching.
TEST(PrefixHasher, GoldenVector) {
  auto h = PrefixHasher::Create(Scope(), 4);
  ASSERT_TRUE(h.ok());
  const auto chain = h->Chain(Iota(10));  // two whole blocks; the last 2 tokens are not keyed
  ASSERT_EQ(chain.size(), 2u);
  EXPECT_EQ(h->Root().ToHex(), "4814e32fc571f5a4ebaf85b94ef397a1");
  EXPECT_EQ(chain[0].ToHex(), "eb82f6444c94a58b9fb2fb33ee15df75");
  EXPECT_EQ(chain[1].ToHex(), "e386bc62c1ce8c8c4d0614179afdae17");
}

// Runs tests/storage/prefix_key_reference (the README's definition written again in C over
// libxxhash alone) and returns the keys it prints, one hex key per element.
std::vector<std::string> ReferenceKeys(uint32_t block, const PrefixScope& scope,
                                       const std::vector<int32_t>& tokens) {
  testing::TempDir dir;
  const std::string in = dir.Sub("tokens"), out = dir.Sub("keys");
  {
    FILE* f = std::fopen(in.c_str(), "w");
    EXPECT_NE(f, nullptr);
    if (f == nullptr) return {};
    for (int32_t t : tokens) std::fprintf(f, "%u\n", static_cast<uint32_t>(t));
    std::fclose(f);
  }
  auto quote = [](const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const std::string cmd = std::string(KVSHADE_PREFIX_KEY_REFERENCE) + " " + std::to_string(block) +
                          " " + quote(scope.model_id) + " " + quote(scope.profile) + " " +
                          quote(scope.tenant_salt) + " < " + in + " > " + out;
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::vector<std::string> keys;
  FILE* f = std::fopen(out.c_str(), "r");
  EXPECT_NE(f, nullptr);
  if (f == nullptr) return keys;
  char line[128];
  while (std::fgets(line, sizeof(line), f) != nullptr) keys.emplace_back(line, std::strcspn(line, "\n"));
  std::fclose(f);
  return keys;
}

// The golden keys above are the independent program's, and it agrees with PrefixHasher on
// random scopes (empty and non-ASCII fields, other block sizes) and random token ids.
TEST(PrefixHasher, MatchesTheIndependentProgram) {
  EXPECT_EQ(ReferenceKeys(4, Scope(), Iota(10)),
            (std::vector<std::string>{"4814e32fc571f5a4ebaf85b94ef397a1", "eb82f6444c94a58b9fb2fb33ee15df75",
                                      "e386bc62c1ce8c8c4d0614179afdae17"}));
  auto rng = testing::Rng(17);
  const std::vector<PrefixScope> scopes = {
      Scope(), Scope(""), PrefixScope{"", "", ""},
      PrefixScope{"Qwen/Qwen2-7B \xc3\xa9", "exact;C=16", "salt with spaces"}};
  int compared = 0;
  for (const PrefixScope& scope : scopes) {
    for (uint32_t block : {1u, 7u, 256u}) {
      std::vector<int32_t> tokens = RandomTokens(rng, int(block) * 3 + int(rng() % block));
      tokens[0] = 0x7fffffff;  // the largest token id
      auto h = PrefixHasher::Create(scope, block);
      ASSERT_TRUE(h.ok()) << h.status();
      std::vector<std::string> mine = {h->Root().ToHex()};
      for (const PrefixKey& k : h->Chain(tokens)) mine.push_back(k.ToHex());
      EXPECT_EQ(mine.size(), tokens.size() / block + 1);
      EXPECT_EQ(ReferenceKeys(block, scope, tokens), mine) << scope.model_id << " B=" << block;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 12);
}

TEST(PrefixHasher, SameKeysInTwoProcesses) {
  auto rng = testing::Rng(11);
  const std::vector<int32_t> tokens = RandomTokens(rng, 256 * 5 + 17);
  auto h = PrefixHasher::Create(Scope());
  ASSERT_TRUE(h.ok());
  std::string mine;
  for (const PrefixKey& k : h->Chain(tokens)) mine += k.ToHex();

  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: computes from scratch (its own hasher) and reports over the pipe.
    close(fds[0]);
    auto ch = PrefixHasher::Create(Scope());
    std::string out;
    if (ch.ok()) for (const PrefixKey& k : ch->Chain(tokens)) out += k.ToHex();
    size_t off = 0;
    while (off < out.size()) {
      const ssize_t w = write(fds[1], out.data() + off, out.size() - off);
      if (w <= 0) _exit(2);
      off += size_t(w);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string theirs;
  char buf[4096];
  ssize_t r;
  while ((r = read(fds[0], buf, sizeof(buf))) > 0) theirs.append(buf, size_t(r));
  close(fds[0]);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_EQ(mine.size(), 5u * 32);
  EXPECT_EQ(theirs, mine);
}

TEST(PrefixHasher, EveryScopeFieldSeparatesKeySpaces) {
  const auto tokens = Iota(512);
  auto base = PrefixHasher::Create(Scope());
  ASSERT_TRUE(base.ok());
  const PrefixKey k = base->Chain(tokens).back();
  auto other = [&](PrefixScope s, int block) { return PrefixHasher::Create(s, block)->Chain(tokens); };
  EXPECT_NE(other(Scope("tenant-b"), 256).back(), k);
  EXPECT_NE(other(Scope(""), 256).back(), k);
  PrefixScope m = Scope();
  m.model_id = "llama-3-70b";
  EXPECT_NE(other(m, 256).back(), k);
  PrefixScope p = Scope();
  p.profile = "shadow;rank=128;C=8;codec=int4;group=16";
  EXPECT_NE(other(p, 256).back(), k);
  // Length-prefixed fields: moving a byte between fields changes the key.
  PrefixScope a{"ab", "c", "salt"}, b{"a", "bc", "salt"};
  EXPECT_NE(PrefixHasher::Create(a)->Root(), PrefixHasher::Create(b)->Root());
  EXPECT_NE(other(Scope(), 128)[1], k);  // same 256 tokens, other block size
  EXPECT_EQ(other(Scope(), 256).back(), k);
  EXPECT_EQ(PrefixHasher::Create(Scope(), 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(PrefixIndex, DifferentSaltNeverHits) {
  const auto tokens = Iota(1024);
  PrefixIndex index;
  auto ha = PrefixHasher::Create(Scope("tenant-a"), 256);
  auto hb = PrefixHasher::Create(Scope("tenant-b"), 256);
  const auto ka = ha->Chain(tokens);
  auto ref = index.Insert(SegmentId{1, 1}, std::nullopt, 256, 0, ka, 100);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(index.Lookup(ka).tokens, 1024);
  PrefixMatch miss = index.Lookup(hb->Chain(tokens));
  EXPECT_EQ(miss.tokens, 0);
  EXPECT_TRUE(miss.chain.empty());
}

TEST(PrefixIndex, LongestPrefixOnSharedAndDivergingStreams) {
  const int B = 16;
  auto h = PrefixHasher::Create(Scope(), B);
  ASSERT_TRUE(h.ok());
  auto rng = testing::Rng(12);
  const std::vector<int32_t> doc = RandomTokens(rng, 10 * B);
  PrefixIndex index;
  // Segment A: the document's first 6 blocks; segment A2: blocks 6..9, child of A.
  const auto keys = h->Chain(doc);
  const SegmentId sa{1, 0}, sa2{2, 0};
  ASSERT_TRUE(index.Insert(sa, std::nullopt, B, 0, absl::MakeConstSpan(keys).subspan(0, 6), 600).ok());
  ASSERT_TRUE(index.Insert(sa2, sa, B, 6, absl::MakeConstSpan(keys).subspan(6, 4), 400).ok());

  auto lookup = [&](const std::vector<int32_t>& t) { return index.Lookup(h->Chain(t)); };
  {
    PrefixMatch m = lookup(doc);  // the whole document
    EXPECT_EQ(m.tokens, 10 * B);
    ASSERT_EQ(m.chain.size(), 2u);
    EXPECT_EQ(m.chain[0].segment(), sa);
    EXPECT_EQ(m.chain[1].segment(), sa2);
    EXPECT_EQ(m.chain[1].first_token(), 6 * B);
    EXPECT_EQ(m.chain[1].end_token(), 10 * B);
  }
  {
    // The document's first 8 blocks, a diverging tail and a partial block: 8 blocks reuse.
    std::vector<int32_t> t(doc.begin(), doc.begin() + 8 * B + 3);
    for (int i = 0; i < 3 * B; ++i) t.push_back(int32_t(999000 + i));
    PrefixMatch m = lookup(t);
    EXPECT_EQ(m.tokens, 8 * B);
    ASSERT_EQ(m.chain.size(), 2u);
    EXPECT_EQ(m.chain.back().segment(), sa2);
  }
  {
    // Shares 3 blocks and then diverges: only A, 3 blocks.
    std::vector<int32_t> t(doc.begin(), doc.begin() + 3 * B);
    t.push_back(-1);
    t.insert(t.end(), doc.begin() + 3 * B + 1, doc.end());
    PrefixMatch m = lookup(t);
    EXPECT_EQ(m.tokens, 3 * B);
    ASSERT_EQ(m.chain.size(), 1u);
    EXPECT_EQ(m.chain[0].segment(), sa);
  }
  {
    // Diverges in the first block; and a stream shorter than one block.
    std::vector<int32_t> t = doc;
    t[0] ^= 1;
    EXPECT_EQ(lookup(t).tokens, 0);
    EXPECT_EQ(lookup(std::vector<int32_t>(doc.begin(), doc.begin() + B - 1)).tokens, 0);
  }
  // A standalone segment for a second document that shares A's first 2 blocks: its own
  // deeper keys are registered, the shared ones keep mapping to A.
  std::vector<int32_t> doc2(doc.begin(), doc.begin() + 2 * B);
  for (int i = 0; i < 2 * B; ++i) doc2.push_back(int32_t(500000 + i));
  const auto k2 = h->Chain(doc2);
  ASSERT_TRUE(index.Insert(SegmentId{3, 0}, std::nullopt, B, 0, k2, 50).ok());
  EXPECT_EQ(lookup(doc2).chain.back().segment(), (SegmentId{3, 0}));
  EXPECT_EQ(lookup(std::vector<int32_t>(doc.begin(), doc.begin() + 2 * B)).chain.back().segment(), sa);
  // The same final key again is AlreadyExists (the prefix is cached: use it).
  EXPECT_EQ(index.Insert(SegmentId{4, 0}, std::nullopt, B, 0, k2, 50).status().code(),
            absl::StatusCode::kAlreadyExists);
  PrefixIndexStats st = index.Stats();
  EXPECT_EQ(st.segments, 3u);
  EXPECT_EQ(st.keys, 6u + 4u + 2u);  // doc2's first two keys stay A's
  EXPECT_GE(st.hits, 5u);
}

// take_over: a segment split off the front of a longer one takes the keys of their shared
// blocks from it (only from the segment named), the longer one keeps its later keys, and
// eviction of either still removes exactly the keys it holds.
TEST(PrefixIndex, ASegmentSplitOffTheFrontTakesOverTheSharedKeys) {
  const int B = 16;
  auto h = PrefixHasher::Create(Scope(), B);
  ASSERT_TRUE(h.ok());
  auto rng = testing::Rng(13);
  const std::vector<int32_t> doc = RandomTokens(rng, 5 * B);
  const auto keys = h->Chain(doc);
  PrefixIndex index;
  const SegmentId longer{1, 0}, front{2, 0}, other{3, 0};
  {
    auto ref = index.Insert(longer, std::nullopt, B, 0, keys, 500);
    ASSERT_TRUE(ref.ok());
  }
  const auto first3 = absl::MakeConstSpan(keys).subspan(0, 3);
  // Without take_over, or naming another segment: the prefix is cached already.
  EXPECT_EQ(index.Insert(front, std::nullopt, B, 0, first3, 300).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(index.Insert(front, std::nullopt, B, 0, first3, 300, other).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(index.Holder(keys[2]), longer);
  {
    auto ref = index.Insert(front, std::nullopt, B, 0, first3, 300, longer);
    ASSERT_TRUE(ref.ok()) << ref.status();
  }
  EXPECT_EQ(index.Holder(keys[0]), front);
  EXPECT_EQ(index.Holder(keys[2]), front);
  EXPECT_EQ(index.Holder(keys[3]), longer);
  EXPECT_FALSE(index.Holder(h->Chain(Iota(B, 7))[0]).has_value());
  // Three blocks of the document lead to the front; all five to the longer one.
  EXPECT_EQ(index.Lookup(h->Chain(std::vector<int32_t>(doc.begin(), doc.begin() + 3 * B))).chain.back().segment(),
            front);
  EXPECT_EQ(index.Lookup(keys).chain.back().segment(), longer);
  EXPECT_EQ(index.Stats().keys, 5u);
  // Removing the longer one leaves the front's keys.
  ASSERT_TRUE(index.Remove(longer).ok());
  EXPECT_EQ(index.Stats().keys, 3u);
  EXPECT_EQ(index.Holder(keys[2]), front);
  EXPECT_FALSE(index.Holder(keys[3]).has_value());
  EXPECT_TRUE(index.WasRemoved(keys[3]));
  EXPECT_FALSE(index.WasRemoved(keys[2]));
}

TEST(PrefixIndex, InsertValidatesParents) {
  PrefixIndex index;
  auto h = PrefixHasher::Create(Scope(), 4);
  const auto k = h->Chain(Iota(16));
  EXPECT_EQ(index.Insert(SegmentId{1, 0}, std::nullopt, 4, 0, {}, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(index.Insert(SegmentId{1, 0}, std::nullopt, 4, 1, absl::MakeConstSpan(k).subspan(1, 1), 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // starts after 0 without a parent
  EXPECT_EQ(index.Insert(SegmentId{1, 0}, SegmentId{9, 9}, 4, 1, absl::MakeConstSpan(k).subspan(1, 1), 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // unknown parent
  ASSERT_TRUE(index.Insert(SegmentId{1, 0}, std::nullopt, 4, 0, absl::MakeConstSpan(k).subspan(0, 2), 1).ok());
  EXPECT_EQ(index.Insert(SegmentId{2, 0}, SegmentId{1, 0}, 4, 3, absl::MakeConstSpan(k).subspan(3, 1), 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // gap: parent ends at block 2
  EXPECT_EQ(index.Insert(SegmentId{1, 0}, std::nullopt, 4, 0, absl::MakeConstSpan(k).subspan(0, 3), 1).status().code(),
            absl::StatusCode::kAlreadyExists);  // id registered
  EXPECT_TRUE(index.Insert(SegmentId{2, 0}, SegmentId{1, 0}, 4, 2, absl::MakeConstSpan(k).subspan(2, 2), 1).ok());
}

TEST(PrefixIndex, ReferencesAndChildrenBlockEvictionLruOtherwise) {
  auto h = PrefixHasher::Create(Scope(), 8);
  auto rng = testing::Rng(13);
  PrefixIndex index;
  std::vector<std::vector<PrefixKey>> chains;
  for (int i = 0; i < 4; ++i) chains.push_back(h->Chain(RandomTokens(rng, 32)));
  // x, y, z: independent, unreferenced once their insert refs drop. p <- c: parent/child.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(index.Insert(SegmentId{uint64_t(10 + i), 0}, std::nullopt, 8, 0, chains[i], 100).ok());
  }
  ASSERT_TRUE(index.Insert(SegmentId{20, 0}, std::nullopt, 8, 0, absl::MakeConstSpan(chains[3]).subspan(0, 2), 100).ok());
  auto child = index.Insert(SegmentId{21, 0}, SegmentId{20, 0}, 8, 2, absl::MakeConstSpan(chains[3]).subspan(2, 2), 100);
  ASSERT_TRUE(child.ok());
  EXPECT_EQ(index.Info(SegmentId{20, 0})->children, 1);
  EXPECT_EQ(index.Stats().bytes, 500u);

  // Held reference on z and on the child; touch x so that y is the least recently used.
  PrefixMatch held = index.Lookup(chains[2]);
  ASSERT_EQ(held.chain.size(), 1u);
  { PrefixMatch touch = index.Lookup(chains[0]); EXPECT_EQ(touch.tokens, 32); }
  EXPECT_EQ(index.Remove(SegmentId{12, 0}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(index.Remove(SegmentId{20, 0}).code(), absl::StatusCode::kFailedPrecondition);

  auto ev = index.Evict(400);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].segment, (SegmentId{11, 0}));  // y: LRU among the evictable
  ev = index.Evict(0);
  // x goes; z is referenced; the child is referenced, so its parent stays too.
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].segment, (SegmentId{10, 0}));
  EXPECT_EQ(index.Lookup(chains[0]).tokens, 0);
  EXPECT_EQ(index.Lookup(chains[2]).tokens, 32);  // still cached (and now referenced twice)

  // Dropping the child's reference makes it evictable, then its parent.
  child->Reset();
  ev = index.Evict(100);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].segment, (SegmentId{21, 0}));
  EXPECT_EQ(ev[1].segment, (SegmentId{20, 0}));
  held.chain.clear();
  EXPECT_EQ(index.Info(SegmentId{12, 0})->refs, 0);
  ev = index.Evict(0);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(index.Stats().segments, 0u);
  EXPECT_EQ(index.Stats().bytes, 0u);
  EXPECT_EQ(index.Stats().evictions, 5u);
}

TEST(PrefixIndex, RefsOutliveTheIndexObject) {
  SegmentRef ref;
  {
    PrefixIndex index;
    auto h = PrefixHasher::Create(Scope(), 4);
    auto r = index.Insert(SegmentId{1, 0}, std::nullopt, 4, 0, h->Chain(Iota(8)), 1);
    ASSERT_TRUE(r.ok());
    ref = std::move(r).value();
  }
  EXPECT_EQ(ref.end_token(), 8);
  ref.Reset();  // no use after free (ASan)
}

}  // namespace
}  // namespace prefix_index_test
}  // namespace kvshade::storage

// Prefix keys (XXH3-128 hash chain) and the refcounted, LRU-evicted segment index.
#include "kvshade/storage/prefix_index.h"

#include <algorithm>
#include <bit>
#include <deque>
#include <list>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"
#include "kvshade/base/sync.h"

namespace kvshade::storage {
namespace {

void PutLE32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(char((v >> (8 * i)) & 0xff));
}

// The 16 canonical bytes of a key: hi then lo, each big-endian (XXH128_canonical_t).
void Canonical(const PrefixKey& k, unsigned char out[16]) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<unsigned char>(k.hi >> (56 - 8 * i));
    out[8 + i] = static_cast<unsigned char>(k.lo >> (56 - 8 * i));
  }
}

}  // namespace

absl::StatusOr<PrefixHasher> PrefixHasher::Create(const PrefixScope& scope, int block_tokens) {
  if (block_tokens < 1 || block_tokens > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefixHasher: block_tokens must be in [1, 1048576], got ", block_tokens));
  }
  constexpr size_t kMax = 64 << 10;
  if (scope.model_id.size() > kMax || scope.profile.size() > kMax || scope.tenant_salt.size() > kMax) {
    return absl::InvalidArgumentError("PrefixHasher: model_id, profile and tenant_salt are limited to 64 KiB each");
  }
  std::string m(kPrefixDomain);
  PutLE32(&m, uint32_t(block_tokens));
  for (const std::string* s : {&scope.model_id, &scope.profile, &scope.tenant_salt}) {
    PutLE32(&m, uint32_t(s->size()));
    m.append(*s);
  }
  const XXH128_hash_t h = XXH3_128bits_withSeed(m.data(), m.size(), kPrefixHashSeed);
  return PrefixHasher(PrefixKey{h.high64, h.low64}, block_tokens);
}

PrefixKey PrefixHasher::Extend(const PrefixKey& prev, absl::Span<const int32_t> block) const {
  XXH3_state_t st;
  XXH3_128bits_reset_withSeed(&st, kPrefixHashSeed);
  unsigned char c[16];
  Canonical(prev, c);
  XXH3_128bits_update(&st, c, 16);
  if constexpr (std::endian::native == std::endian::little) {
    XXH3_128bits_update(&st, block.data(), block.size() * sizeof(int32_t));
  } else {
    for (int32_t t : block) {
      const uint32_t u = uint32_t(t);
      const unsigned char b[4] = {static_cast<unsigned char>(u), static_cast<unsigned char>(u >> 8),
                                  static_cast<unsigned char>(u >> 16), static_cast<unsigned char>(u >> 24)};
      XXH3_128bits_update(&st, b, 4);
    }
  }
  const XXH128_hash_t h = XXH3_128bits_digest(&st);
  return PrefixKey{h.high64, h.low64};
}

std::vector<PrefixKey> PrefixHasher::Chain(absl::Span<const int32_t> tokens) const {
  const size_t n = tokens.size() / size_t(block_tokens_);
  std::vector<PrefixKey> keys;
  keys.reserve(n);
  PrefixKey k = root_;
  for (size_t b = 0; b < n; ++b) {
    k = Extend(k, tokens.subspan(b * size_t(block_tokens_), size_t(block_tokens_)));
    keys.push_back(k);
  }
  return keys;
}

namespace internal {

struct PrefixNode {
  PrefixSegmentInfo info;
  std::vector<PrefixKey> keys;  // keys that map to this node
  std::list<PrefixNode*>::iterator lru_it;
};

struct PrefixIndexState {
  base::Mutex mu;
  absl::flat_hash_map<SegmentId, std::unique_ptr<PrefixNode>> nodes ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<PrefixKey, std::pair<PrefixNode*, int64_t>> keys ABSL_GUARDED_BY(mu);
  std::list<PrefixNode*> lru ABSL_GUARDED_BY(mu);  // most recent first
  size_t bytes ABSL_GUARDED_BY(mu) = 0;
  PrefixIndexStats stats ABSL_GUARDED_BY(mu);
  // Keys of removed segments (WasRemoved): key -> the removal's sequence number, and the
  // same pairs oldest first; a pair whose number no longer matches the map was re-mapped
  // or removed again later, and is skipped when it leaves the queue.
  absl::flat_hash_map<PrefixKey, uint64_t> removed ABSL_GUARDED_BY(mu);
  std::deque<std::pair<PrefixKey, uint64_t>> removed_order ABSL_GUARDED_BY(mu);
  uint64_t removed_seq ABSL_GUARDED_BY(mu) = 0;

  void Touch(PrefixNode* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    lru.splice(lru.begin(), lru, n->lru_it);
  }
  void Release(const SegmentId& id) {
    base::MutexLock lock(&mu);
    auto it = nodes.find(id);
    if (it != nodes.end() && it->second->info.refs > 0) --it->second->info.refs;
  }
  void RememberRemoved(const PrefixKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    removed[k] = ++removed_seq;
    removed_order.emplace_back(k, removed_seq);
    while (removed_order.size() > PrefixIndex::kRememberedRemovedKeys) {
      const auto& [old, seq] = removed_order.front();
      auto it = removed.find(old);
      if (it != removed.end() && it->second == seq) removed.erase(it);
      removed_order.pop_front();
    }
  }
  void RemoveLocked(PrefixNode* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const PrefixKey& k : n->keys) {
      keys.erase(k);
      RememberRemoved(k);
    }
    if (n->info.parent) {
      auto p = nodes.find(*n->info.parent);
      if (p != nodes.end()) --p->second->info.children;
    }
    bytes -= n->info.bytes;
    lru.erase(n->lru_it);
    nodes.erase(n->info.segment);  // destroys n
  }
};

}  // namespace internal

SegmentRef::SegmentRef(SegmentRef&& o) noexcept { *this = std::move(o); }
SegmentRef& SegmentRef::operator=(SegmentRef&& o) noexcept {
  if (this != &o) {
    Reset();
    state_ = std::move(o.state_);
    segment_ = o.segment_;
    first_token_ = o.first_token_;
    end_token_ = o.end_token_;
  }
  return *this;
}
SegmentRef::~SegmentRef() { Reset(); }
void SegmentRef::Reset() {
  if (state_) state_->Release(segment_);
  state_.reset();
}

PrefixIndex::PrefixIndex() : state_(std::make_shared<internal::PrefixIndexState>()) {}
PrefixIndex::~PrefixIndex() = default;

absl::StatusOr<SegmentRef> PrefixIndex::Insert(const SegmentId& segment,
                                               std::optional<SegmentId> parent, int block_tokens,
                                               int64_t first_block,
                                               absl::Span<const PrefixKey> block_keys, size_t bytes,
                                               std::optional<SegmentId> take_over) {
  if (block_tokens < 1 || block_tokens > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PrefixIndex::Insert: block_tokens must be in [1, 1048576], got ", block_tokens));
  }
  if (block_keys.empty()) return absl::InvalidArgumentError("PrefixIndex::Insert: no block keys");
  if (first_block < 0 || first_block > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat("PrefixIndex::Insert: bad first_block ", first_block));
  }
  if ((first_block > 0) != parent.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PrefixIndex::Insert: a segment starting at block ", first_block,
        first_block > 0 ? " needs a parent" : " cannot have a parent"));
  }
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  if (st.nodes.contains(segment)) {
    return absl::AlreadyExistsError(absl::StrCat("PrefixIndex: segment ", segment.ToHex(), " is registered"));
  }
  const int64_t first_token = first_block * block_tokens;
  internal::PrefixNode* parent_node = nullptr;
  if (parent) {
    auto p = st.nodes.find(*parent);
    if (p == st.nodes.end()) {
      return absl::InvalidArgumentError(absl::StrCat("PrefixIndex::Insert: parent ", parent->ToHex(),
                                                     " is not registered"));
    }
    parent_node = p->second.get();
    if (parent_node->info.end_token != first_token) {
      return absl::InvalidArgumentError(absl::StrCat(
          "PrefixIndex::Insert: parent ends at token ", parent_node->info.end_token,
          ", the segment starts at ", first_token));
    }
  }
  if (auto k = st.keys.find(block_keys.back());
      k != st.keys.end() && !(take_over && k->second.first->info.segment == *take_over)) {
    return absl::AlreadyExistsError(absl::StrCat("PrefixIndex: this prefix is cached as segment ",
                                                 k->second.first->info.segment.ToHex()));
  }
  auto node = std::make_unique<internal::PrefixNode>();
  internal::PrefixNode* n = node.get();
  n->info.segment = segment;
  n->info.parent = parent;
  n->info.first_token = first_token;
  n->info.end_token = first_token + int64_t(block_keys.size()) * block_tokens;
  n->info.bytes = bytes;
  n->info.refs = 1;
  for (size_t i = 0; i < block_keys.size(); ++i) {
    const int64_t tokens = first_token + int64_t(i + 1) * block_tokens;
    auto [k, added] = st.keys.emplace(block_keys[i], std::make_pair(n, tokens));
    if (!added && take_over && k->second.first->info.segment == *take_over) {
      std::vector<PrefixKey>& theirs = k->second.first->keys;
      theirs.erase(std::remove(theirs.begin(), theirs.end(), block_keys[i]), theirs.end());
      k->second = std::make_pair(n, tokens);
      added = true;
    }
    if (added) {
      n->keys.push_back(block_keys[i]);
      st.removed.erase(block_keys[i]);  // cached again
    }
  }
  if (parent_node) ++parent_node->info.children;
  st.lru.push_front(n);
  n->lru_it = st.lru.begin();
  st.bytes += bytes;
  st.nodes.emplace(segment, std::move(node));
  return SegmentRef(state_, segment, n->info.first_token, n->info.end_token);
}

PrefixMatch PrefixIndex::Lookup(absl::Span<const PrefixKey> chain) {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  ++st.stats.lookups;
  PrefixMatch m;
  for (size_t b = chain.size(); b-- > 0;) {
    auto k = st.keys.find(chain[b]);
    if (k == st.keys.end()) continue;
    m.tokens = k->second.second;
    std::vector<internal::PrefixNode*> path;
    for (internal::PrefixNode* n = k->second.first; n != nullptr;) {
      path.push_back(n);
      if (!n->info.parent) break;
      auto p = st.nodes.find(*n->info.parent);
      n = p == st.nodes.end() ? nullptr : p->second.get();  // parents outlive children
    }
    std::reverse(path.begin(), path.end());
    for (internal::PrefixNode* n : path) {
      ++n->info.refs;
      st.Touch(n);
      m.chain.push_back(SegmentRef(state_, n->info.segment, n->info.first_token, n->info.end_token));
    }
    ++st.stats.hits;
    st.stats.hit_tokens += uint64_t(m.tokens);
    break;
  }
  return m;
}

absl::StatusOr<SegmentRef> PrefixIndex::Acquire(const SegmentId& segment) {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  auto it = st.nodes.find(segment);
  if (it == st.nodes.end()) {
    return absl::NotFoundError(absl::StrCat("PrefixIndex: no segment ", segment.ToHex()));
  }
  internal::PrefixNode* n = it->second.get();
  ++n->info.refs;
  st.Touch(n);
  return SegmentRef(state_, segment, n->info.first_token, n->info.end_token);
}

std::vector<PrefixSegmentInfo> PrefixIndex::Evict(size_t max_bytes) {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  std::vector<PrefixSegmentInfo> out;
  while (st.bytes > max_bytes) {
    internal::PrefixNode* victim = nullptr;
    for (auto it = st.lru.rbegin(); it != st.lru.rend(); ++it) {
      if ((*it)->info.refs == 0 && (*it)->info.children == 0) {
        victim = *it;
        break;
      }
    }
    if (victim == nullptr) break;
    out.push_back(victim->info);
    st.RemoveLocked(victim);
    ++st.stats.evictions;
  }
  return out;
}

std::optional<PrefixSegmentInfo> PrefixIndex::EvictOne(
    const std::function<bool(const PrefixSegmentInfo&)>& eligible) {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  for (auto it = st.lru.rbegin(); it != st.lru.rend(); ++it) {
    internal::PrefixNode* n = *it;
    if (n->info.refs != 0 || n->info.children != 0) continue;
    if (eligible && !eligible(n->info)) continue;
    PrefixSegmentInfo info = n->info;
    st.RemoveLocked(n);
    ++st.stats.evictions;
    return info;
  }
  return std::nullopt;
}

absl::Status PrefixIndex::Remove(const SegmentId& segment) {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  auto it = st.nodes.find(segment);
  if (it == st.nodes.end()) return absl::NotFoundError(absl::StrCat("PrefixIndex: no segment ", segment.ToHex()));
  const PrefixSegmentInfo& info = it->second->info;
  if (info.refs > 0 || info.children > 0) {
    return absl::FailedPreconditionError(absl::StrCat("PrefixIndex: segment ", segment.ToHex(), " has ",
                                                      info.refs, " references and ", info.children,
                                                      " children"));
  }
  st.RemoveLocked(it->second.get());
  return absl::OkStatus();
}

std::optional<SegmentId> PrefixIndex::Holder(const PrefixKey& key) const {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  auto k = st.keys.find(key);
  if (k == st.keys.end()) return std::nullopt;
  return k->second.first->info.segment;
}

bool PrefixIndex::WasRemoved(const PrefixKey& key) const {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  return st.removed.contains(key);
}

std::optional<PrefixSegmentInfo> PrefixIndex::Info(const SegmentId& segment) const {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  auto it = st.nodes.find(segment);
  if (it == st.nodes.end()) return std::nullopt;
  return it->second->info;
}

PrefixIndexStats PrefixIndex::Stats() const {
  auto& st = *state_;
  base::MutexLock lock(&st.mu);
  PrefixIndexStats s = st.stats;
  s.segments = st.nodes.size();
  s.keys = st.keys.size();
  s.bytes = st.bytes;
  return s;
}

}  // namespace kvshade::storage

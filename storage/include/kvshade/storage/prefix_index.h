// The prefix index: content-addressed, immutable, refcounted segments, found by the
// longest cached prefix of a token stream.
//
// Keys (storage/README.md, "Prefix keys", gives the exact bytes so that any process or
// language recomputes them): token streams are cut into fixed blocks of `block_tokens`
// tokens; a root key is XXH3-128 of the scope (model id, canonical profile parameters,
// tenant salt, block size), and key i+1 = XXH3-128(key i ++ block i's tokens). Only whole
// blocks are keyed. Two processes with the same scope and tokens compute the same keys; a
// different salt (another tenant) shares nothing.
//
// Segments: a segment covers tokens [first_token, end_token) of one chain and is
// registered under the chain keys of the blocks it covers (key of block b = the key after
// b+1 blocks, usable prefix (b+1)*block_tokens). A segment that does not start at token 0
// names its parent (the segment covering the tokens before it); the index holds a
// reference on the parent while the child is registered, so a chain is never evicted from
// the middle. Lookup returns the deepest registered key's segment with its ancestors,
// referenced: referenced segments are never evicted. Unreferenced segments are evicted
// least recently used first (Evict, EvictOne), and the caller then frees their storage.
// The keys of removed segments are remembered (the last kRememberedRemovedKeys of them) so
// that a lookup that finds nothing can tell a prefix that was cached and evicted from one
// that never was (WasRemoved).
//
// Thread-safe. SegmentRefs must not outlive the index's last owner (they share its state,
// so destroying the PrefixIndex object first is safe).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/storage/types.h"

namespace kvshade::storage {

// Part of the key scheme: changing either changes every key.
inline constexpr uint64_t kPrefixHashSeed = 0x6B76736861646531ull;  // "kvshade1"
inline constexpr char kPrefixDomain[] = "kvshade.prefix.v1";
inline constexpr int kDefaultPrefixBlockTokens = 256;

// What a prefix is scoped to. `profile` is the canonical serialization of the profile
// parameters that change the stored state (the service writes it, e.g.
// "shadow;rank=160;C=8;codec=int4;group=16;outliers=48;sink=1;local=32"); `tenant_salt`
// comes from the authenticated tenant, never from the request.
struct PrefixScope {
  std::string model_id;
  std::string profile;
  std::string tenant_salt;
};

class PrefixHasher {
 public:
  // block_tokens in [1, 1<<20]; each of the three scope strings at most 64 KiB.
  static absl::StatusOr<PrefixHasher> Create(const PrefixScope& scope,
                                             int block_tokens = kDefaultPrefixBlockTokens);

  int block_tokens() const { return block_tokens_; }
  // The key of the empty prefix (depends on the scope only).
  PrefixKey Root() const { return root_; }
  // The key after one more block (block.size() must be block_tokens; unchecked).
  PrefixKey Extend(const PrefixKey& prev, absl::Span<const int32_t> block) const;
  // keys[b] = key after blocks 0..b, for every whole block of tokens (floor(n/B) keys).
  std::vector<PrefixKey> Chain(absl::Span<const int32_t> tokens) const;

 private:
  PrefixHasher(PrefixKey root, int block_tokens) : root_(root), block_tokens_(block_tokens) {}
  PrefixKey root_;
  int block_tokens_;
};

// A registered segment, as the index knows it.
struct PrefixSegmentInfo {
  SegmentId segment;
  std::optional<SegmentId> parent;
  int64_t first_token = 0;
  int64_t end_token = 0;
  size_t bytes = 0;   // the caller's size of the segment (capacity accounting)
  int refs = 0;       // live SegmentRefs
  int children = 0;   // registered segments naming it as parent
};

namespace internal {
struct PrefixIndexState;
}

// A reference on a registered segment: while it lives the segment is not evicted.
class SegmentRef {
 public:
  SegmentRef() = default;
  SegmentRef(SegmentRef&& o) noexcept;
  SegmentRef& operator=(SegmentRef&& o) noexcept;
  SegmentRef(const SegmentRef&) = delete;
  SegmentRef& operator=(const SegmentRef&) = delete;
  ~SegmentRef();

  const SegmentId& segment() const { return segment_; }
  int64_t first_token() const { return first_token_; }
  int64_t end_token() const { return end_token_; }
  explicit operator bool() const { return state_ != nullptr; }
  void Reset();

 private:
  friend class PrefixIndex;
  SegmentRef(std::shared_ptr<internal::PrefixIndexState> state, SegmentId id, int64_t first,
             int64_t end)
      : state_(std::move(state)), segment_(id), first_token_(first), end_token_(end) {}
  std::shared_ptr<internal::PrefixIndexState> state_;
  SegmentId segment_;
  int64_t first_token_ = 0;
  int64_t end_token_ = 0;
};

struct PrefixMatch {
  int64_t tokens = 0;               // length of the longest cached prefix (0 = miss)
  std::vector<SegmentRef> chain;    // root first; chain.back() contains the matched key
};

struct PrefixIndexStats {
  size_t segments = 0;
  size_t keys = 0;
  size_t bytes = 0;
  uint64_t lookups = 0;
  uint64_t hits = 0;
  uint64_t hit_tokens = 0;
  uint64_t evictions = 0;
};

class PrefixIndex {
 public:
  PrefixIndex();
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  // Registers an immutable segment covering blocks [first_block, first_block +
  // block_keys.size()) of a chain of block size `block_tokens`; block_keys[i] is the chain
  // key after block first_block + i. parent: the segment ending at first_block (required
  // iff first_block > 0). Returns a reference on the new segment.
  //   AlreadyExists: the segment id is registered, or its last key already maps to another
  //                  segment (the same prefix is cached: use that one);
  //   InvalidArgument: no keys, bad block numbers, parent missing or not ending where this
  //                  segment starts.
  // Intermediate keys already mapped to another segment keep their mapping.
  // take_over: the keys of block_keys that map to that segment map to this one instead (a
  // segment split off the front of a longer cached one: a prompt that shares only its
  // blocks is to reuse it); then the last key mapping to it is no AlreadyExists. The other
  // segment keeps its other keys.
  absl::StatusOr<SegmentRef> Insert(const SegmentId& segment, std::optional<SegmentId> parent,
                                    int block_tokens, int64_t first_block,
                                    absl::Span<const PrefixKey> block_keys, size_t bytes,
                                    std::optional<SegmentId> take_over = std::nullopt);
  // The segment a key maps to, if any.
  std::optional<SegmentId> Holder(const PrefixKey& key) const;
  // Longest cached prefix of a chain (keys from PrefixHasher::Chain): the deepest key that
  // maps to a segment. tokens = (b+1)*block_tokens for the matched key b. Marks the chain
  // most recently used.
  PrefixMatch Lookup(absl::Span<const PrefixKey> chain);
  // A reference on a registered segment; NotFound otherwise.
  absl::StatusOr<SegmentRef> Acquire(const SegmentId& segment);

  // Evicts unreferenced leaf segments (no refs, no children), least recently used first,
  // until the registered bytes are <= max_bytes or nothing more is evictable. Returns
  // what was evicted, in eviction order.
  std::vector<PrefixSegmentInfo> Evict(size_t max_bytes);
  // Evicts the least recently used unreferenced leaf segment for which `eligible` (called
  // under the index's lock: it must not call into the index) says yes; returns it, or
  // nothing when no segment qualifies.
  std::optional<PrefixSegmentInfo> EvictOne(
      const std::function<bool(const PrefixSegmentInfo&)>& eligible);
  // Removes one segment now; FailedPrecondition when referenced or a parent.
  absl::Status Remove(const SegmentId& segment);

  // Whether `key` mapped to a segment that has since been removed (Evict, EvictOne,
  // Remove) and no segment maps it again. Remembers the keys of the most recent removals,
  // kRememberedRemovedKeys keys at most (16 bytes and a counter each), oldest forgotten
  // first; a forgotten or never-mapped key answers false.
  bool WasRemoved(const PrefixKey& key) const;
  static constexpr size_t kRememberedRemovedKeys = size_t{1} << 16;

  std::optional<PrefixSegmentInfo> Info(const SegmentId& segment) const;
  PrefixIndexStats Stats() const;

 private:
  std::shared_ptr<internal::PrefixIndexState> state_;
};

}  // namespace kvshade::storage

// The prefix index (docs/DESIGN.md "Sessions"): registering committed segments under their
// token-chain keys, matching the longest reusable chain for a new prompt (paging in spilled
// values before reuse), and evicting cached prefixes when memory runs short.
#include "kvshade/service/engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <numeric>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "status_util.h"
#include "kvshade/service/log.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

// ---------------------------------------------------------------------------------------
// Prefix index

absl::StatusOr<storage::PrefixHasher> EngineImpl::Hasher(const Tenant& t, const ModelInfo& m,
                                                         const ProfileInfo& p) const {
  storage::PrefixScope scope;
  scope.model_id = m.Fingerprint();
  scope.profile = p.Fingerprint();
  scope.tenant_salt = t.salt;  // from the Authenticator, never from a request
  return storage::PrefixHasher::Create(scope, storage::kDefaultPrefixBlockTokens);
}

storage::SegmentRef EngineImpl::RegisterPrefix(const std::shared_ptr<const Segment>& seg,
                                               const std::vector<storage::PrefixKey>& keys,
                                               int block_tokens,
                                               std::optional<storage::SegmentId> parent) {
  const int64_t first = seg->first_position;
  const int64_t end = seg->first_position + seg->n_tokens;
  if (first % block_tokens != 0) return {};
  const int64_t first_block = first / block_tokens;
  const int64_t end_block = std::min<int64_t>(end / block_tokens, int64_t(keys.size()));
  if (end_block <= first_block) return {};
  if (first_block > 0) {
    if (!parent) return {};
    auto info = prefix_.Info(*parent);
    if (!info || info->end_token != first) return {};
  }
  std::vector<storage::PrefixKey> mine(keys.begin() + first_block, keys.begin() + end_block);
  // A segment that another cached one, starting where it starts, runs past (a segment end
  // cut a prompt inside what that one holds: docs/DESIGN.md "Segment ends") takes over
  // the keys of the blocks they share, so that a prompt sharing only those blocks reuses
  // it; the longer one keeps the keys of its later blocks.
  std::optional<storage::SegmentId> take_over;
  if (std::optional<storage::SegmentId> holder = prefix_.Holder(mine.back())) {
    std::shared_ptr<const Segment> other;
    {
      base::MutexLock lock(&seg_mu_);
      auto it = registered_.find(*holder);
      if (it != registered_.end()) other = it->second;
    }
    if (other && other->first_position == first && other->first_position + other->n_tokens > end) {
      take_over = *holder;
    }
  }
  auto ref = prefix_.Insert(seg->id, first_block > 0 ? parent : std::nullopt, block_tokens,
                            first_block, mine, seg->DeviceBytes() + seg->HostBytes(), take_over);
  if (!ref.ok()) return {};  // e.g. the same prefix was cached concurrently: keep ours private
  {
    base::MutexLock lock(&seg_mu_);
    registered_[seg->id] = seg;
  }
  if (kv_events_) {
    // The low 64 bits of each block's key (the last 8 bytes of its canonical form).
    std::vector<uint64_t> hashes;
    for (const storage::PrefixKey& k : mine) hashes.push_back(k.lo);
    if (take_over) kv_events_->HandedOver(take_over->ToHex(), hashes);
    std::optional<uint64_t> parent_hash;
    if (first_block > 0) parent_hash = keys[first_block - 1].lo;
    const size_t n = std::min(seg->tokens.size(), size_t(end_block - first_block) * block_tokens);
    kv_events_->Stored(seg->id.ToHex(), std::move(hashes), parent_hash,
                       std::vector<int32_t>(seg->tokens.begin(), seg->tokens.begin() + n),
                       static_cast<uint32_t>(block_tokens));
  }
  EvictPrefixes(config_->device_budget_bytes / 2);
  return std::move(ref).value();
}

// Forgets segments the prefix index evicted; they are freed (values included) when the
// last call using them lets go.
void EngineImpl::DropEvicted(const std::vector<storage::PrefixSegmentInfo>& gone) {
  if (gone.empty()) return;
  std::vector<std::shared_ptr<const Segment>> drop;  // destroyed outside the lock
  {
    base::MutexLock lock(&seg_mu_);
    for (const auto& info : gone) {
      auto it = registered_.find(info.segment);
      if (it != registered_.end()) {
        drop.push_back(std::move(it->second));
        registered_.erase(it);
      }
      if (kv_events_) kv_events_->Removed(info.segment.ToHex());
      metrics_->Eviction();
    }
  }
}

void EngineImpl::EvictPrefixes(size_t max_bytes) { DropEvicted(prefix_.Evict(max_bytes)); }

// The host value store is full and can spill nothing: evicts the least recently used
// cached segment that no session holds and whose values take host memory (resident and
// unpinned). Called by the store without its lock.
bool EngineImpl::EvictIdlePrefix() {
  std::optional<storage::PrefixSegmentInfo> gone =
      prefix_.EvictOne([this](const storage::PrefixSegmentInfo& info) {
        absl::StatusOr<storage::SegmentUsage> u = store_->Usage(info.segment);
        return u.ok() && u->resident_bytes > 0 && u->pins == 0;
      });
  if (!gone) return false;
  DropEvicted({*gone});
  return true;
}


// The values of a cached segment about to be reused, paged in when they are on the spill
// tier: true when that happened, the page-in's error when they cannot be read back.
static absl::StatusOr<bool> PageInForReuse(EngineImpl& e, const Segment& seg) {
  const Segment& owner = seg.values_owner();
  if (!owner.values_in_store) return false;
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentUsage u, e.store().Usage(owner.id));
  if (u.state == storage::SegmentState::kResident || u.state == storage::SegmentState::kBuilding) {
    return false;
  }
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, e.store().Pin(owner.id));
  return true;  // resident now, most recently used; the pin goes, Attach pins it again
}

// page_in (CreateSession): a matched segment whose values were spilled is paged in before
// it is reused, so that one that cannot be read back ends the reuse (the session ingests
// those tokens itself) instead of failing the session's decode steps later.
ReuseMatch EngineImpl::FindReusable(const storage::PrefixHasher& hasher,
                                     absl::Span<const int32_t> tokens, bool need_durable,
                                     bool page_in) {
  ReuseMatch out;
  std::vector<storage::PrefixKey> keys = hasher.Chain(tokens);
  if (keys.empty()) return out;  // shorter than a block: nothing of it is ever cached
  storage::PrefixMatch m = prefix_.Lookup(keys);
  int64_t pos = 0;
  std::optional<PrefixStop> stop;
  for (storage::SegmentRef& ref : m.chain) {
    std::shared_ptr<const Segment> seg;
    {
      base::MutexLock lock(&seg_mu_);
      auto it = registered_.find(ref.segment());
      if (it != registered_.end()) seg = it->second;
    }
    // Not registered yet (its registration is under way) or not where the chain goes.
    if (!seg || seg->first_position != pos) break;
    const int64_t end = pos + seg->n_tokens;
    // Segments are reused whole: one that runs past the prompt's end, or whose tokens
    // after its last matched block differ from the prompt's, is not.
    if (end > int64_t(tokens.size()) ||
        !std::equal(seg->tokens.begin(), seg->tokens.end(), tokens.begin() + pos)) {
      stop = PrefixStop::kPartialSegment;
      if (m.tokens > pos) out.partial_tokens = m.tokens;
      break;
    }
    if (need_durable && !seg->durable) {
      stop = PrefixStop::kNotDurable;
      break;
    }
    // Room for the session's own segment and its open segment in the kernels' view.
    if (int64_t(out.chain.size()) >= kMaxReusedSegments) {
      stop = PrefixStop::kQuota;
      break;
    }
    if (page_in) {
      absl::StatusOr<bool> paged = PageInForReuse(*this, *seg);
      if (!paged.ok()) {
        log::Event(spdlog::level::warn, "prefix_read_failure")
            .Str("segment", seg->id.ToHex())
            .Str("error", std::string(paged.status().message()));
        stop = PrefixStop::kReadFailure;
        break;
      }
      out.paged_in += *paged;
    }
    out.chain.push_back(seg);
    out.refs.push_back(std::move(ref));
    pos = end;
  }
  out.tokens = pos;
  if (stop) {
    out.stop = *stop;
  } else if (pos == int64_t(tokens.size())) {
    out.stop = PrefixStop::kFull;
  } else {
    // The chain ends before the prompt does: was the next block cached once?
    const int64_t b = hasher.block_tokens();
    const bool next_keyed = pos % b == 0 && pos / b < int64_t(keys.size());
    out.stop = next_keyed && prefix_.WasRemoved(keys[pos / b]) ? PrefixStop::kEvicted
                                                                  : PrefixStop::kAbsent;
  }
  return out;
}

}  // namespace kvshade::service

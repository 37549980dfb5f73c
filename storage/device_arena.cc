// DeviceArena: a backend pool sub-allocated by a RangeAllocator under one mutex.
#include "kvshade/storage/device_arena.h"

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "range_allocator.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/base/sync.h"

namespace kvshade::storage {

std::string_view ArenaKindName(ArenaKind k) {
  switch (k) {
    case ArenaKind::kA: return "a";
    case ArenaKind::kB: return "b";
    case ArenaKind::kLandmarks: return "landmarks";
    case ArenaKind::kStatic: return "static";
    case ArenaKind::kSlots: return "slots";
    case ArenaKind::kOther: return "other";
    case ArenaKind::kSignatures: return "signatures";
  }
  return "unknown";
}

namespace internal {

// Bytes in live blocks over every pool of an arena, and their peak (shared by the pools).
struct ArenaUsage {
  std::atomic<size_t> used{0};
  std::atomic<size_t> peak{0};
};

// The pool and its bookkeeping, shared by the arena and its live blocks.
class ArenaPool {
 public:
  // `buffer` holds capacity + alignment bytes so that the base can be aligned up.
  ArenaPool(kernels::Buffer buffer, size_t capacity, size_t alignment,
            std::shared_ptr<ArenaUsage> usage)
      : buffer_(std::move(buffer)), ranges_(capacity, alignment), usage_(std::move(usage)) {
    const auto p = reinterpret_cast<uintptr_t>(buffer_.data());
    base_ = static_cast<std::byte*>(buffer_.data()) + ((alignment - p % alignment) % alignment);
  }

  std::byte* base() const { return base_; }

  absl::StatusOr<std::pair<size_t, size_t>> Take(size_t bytes, ArenaKind kind) {
    base::MutexLock lock(&mu_);
    std::optional<size_t> offset = ranges_.Allocate(bytes);
    if (!offset) {
      ++stats_.failed_allocations;
      return absl::ResourceExhaustedError(absl::StrCat(
          "arena: no free range for ", bytes, " bytes of ", std::string(ArenaKindName(kind)), " (free ",
          ranges_.free_bytes(), " of ", ranges_.capacity(), " bytes, largest free range ",
          ranges_.largest_free(), ")"));
    }
    const size_t reserved = ranges_.Reserved(bytes);
    stats_.used += reserved;
    stats_.peak_used = std::max(stats_.peak_used, stats_.used);
    stats_.used_by_kind[int(kind)] += reserved;
    stats_.blocks_by_kind[int(kind)] += 1;
    const size_t total = usage_->used.fetch_add(reserved) + reserved;
    size_t peak = usage_->peak.load();
    while (total > peak && !usage_->peak.compare_exchange_weak(peak, total)) {
    }
    return std::make_pair(*offset, reserved);
  }

  void Give(size_t offset, size_t reserved, ArenaKind kind) {
    base::MutexLock lock(&mu_);
    ranges_.Free(offset, reserved);
    stats_.used -= reserved;
    stats_.used_by_kind[int(kind)] -= reserved;
    stats_.blocks_by_kind[int(kind)] -= 1;
    usage_->used.fetch_sub(reserved);
  }

  ArenaStats Stats() const {
    base::MutexLock lock(&mu_);
    ArenaStats s = stats_;
    s.capacity = ranges_.capacity();
    s.largest_free = ranges_.largest_free();
    s.free_ranges = ranges_.free_ranges();
    return s;
  }

  size_t capacity() const {
    base::MutexLock lock(&mu_);
    return ranges_.capacity();
  }

  size_t used() const {
    base::MutexLock lock(&mu_);
    return stats_.used;
  }

 private:
  kernels::Buffer buffer_;
  std::byte* base_ = nullptr;
  mutable base::Mutex mu_;
  RangeAllocator ranges_ ABSL_GUARDED_BY(mu_);
  ArenaStats stats_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<ArenaUsage> usage_;
};

}  // namespace internal

ArenaBlock::ArenaBlock(ArenaBlock&& o) noexcept { *this = std::move(o); }

ArenaBlock& ArenaBlock::operator=(ArenaBlock&& o) noexcept {
  if (this != &o) {
    Reset();
    pool_ = std::move(o.pool_);
    data_ = o.data_;
    offset_ = o.offset_;
    bytes_ = o.bytes_;
    reserved_ = o.reserved_;
    kind_ = o.kind_;
    o.data_ = nullptr;
    o.bytes_ = o.reserved_ = 0;
  }
  return *this;
}

ArenaBlock::~ArenaBlock() { Reset(); }

void ArenaBlock::Reset() {
  if (pool_ && data_ != nullptr) pool_->Give(offset_, reserved_, kind_);
  pool_.reset();
  data_ = nullptr;
  bytes_ = reserved_ = 0;
}

namespace {

absl::Status CheckAlignment(size_t alignment) {
  if (alignment < 16 || alignment > (size_t{1} << 20) || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceArena: alignment must be a power of two in [16, 1048576], got ", alignment));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<internal::ArenaPool>> DeviceArena::NewPool(size_t bytes) {
  // One extra alignment unit so that the first block is aligned whatever the backend's own
  // alignment is (the CPU backend gives 64 bytes).
  absl::StatusOr<kernels::Buffer> buffer = backend_->Allocate(bytes + alignment_);
  if (!buffer.ok()) {
    return absl::Status(buffer.status().code(),
                        absl::StrCat("DeviceArena: cannot allocate a ", bytes, "-byte pool on ",
                                     std::string(backend_->name()), ": ", buffer.status().message()));
  }
  return std::make_shared<internal::ArenaPool>(std::move(buffer).value(), bytes, alignment_, usage_);
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(kernels::DeviceRuntime& backend,
                                                                 size_t budget_bytes,
                                                                 size_t alignment) {
  if (budget_bytes == 0) {
    return absl::InvalidArgumentError("DeviceArena: budget_bytes must be > 0, got 0");
  }
  KVSHADE_RETURN_IF_ERROR(CheckAlignment(alignment));
  if (budget_bytes < alignment) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceArena: budget_bytes (", budget_bytes,
                                                   ") is below the alignment (", alignment,
                                                   ")"));
  }
  std::unique_ptr<DeviceArena> arena(new DeviceArena(&backend, budget_bytes, 0, backend.space(), alignment));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<internal::ArenaPool> pool, arena->NewPool(budget_bytes));
  arena->pools_.push_back(std::move(pool));
  return arena;
}

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::CreateOnDemand(kernels::DeviceRuntime& backend,
                                                                         size_t budget_bytes,
                                                                         size_t growth_bytes,
                                                                         size_t alignment) {
  if (budget_bytes == 0) {
    return absl::InvalidArgumentError("DeviceArena: budget_bytes must be > 0, got 0");
  }
  KVSHADE_RETURN_IF_ERROR(CheckAlignment(alignment));
  if (growth_bytes == 0 || growth_bytes % alignment != 0 || growth_bytes > budget_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceArena: growth_bytes must be a positive multiple of the alignment (", alignment,
        ") at most budget_bytes (", budget_bytes, "), got ", growth_bytes));
  }
  return std::unique_ptr<DeviceArena>(
      new DeviceArena(&backend, budget_bytes, growth_bytes, backend.space(), alignment));
}

DeviceArena::DeviceArena(kernels::DeviceRuntime* backend, size_t budget, size_t growth,
                         kernels::MemorySpace space, size_t alignment)
    : backend_(backend), budget_(budget), growth_(growth), space_(space), alignment_(alignment),
      usage_(std::make_shared<internal::ArenaUsage>()) {}

DeviceArena::~DeviceArena() = default;

absl::StatusOr<ArenaBlock> DeviceArena::Allocate(size_t bytes, ArenaKind kind) {
  if (bytes == 0) return absl::InvalidArgumentError("DeviceArena::Allocate: bytes must be > 0");
  if (int(kind) < 0 || int(kind) >= kArenaKinds) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceArena::Allocate: bad kind ", int(kind)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status last = absl::ResourceExhaustedError("arena: no pool");
  size_t held = 0;
  for (const auto& pool : pools_) {
    absl::StatusOr<std::pair<size_t, size_t>> taken = pool->Take(bytes, kind);
    if (taken.ok()) {
      auto [offset, reserved] = *taken;
      return ArenaBlock(pool, pool->base() + offset, offset, bytes, reserved, kind);
    }
    last = taken.status();
    held += pool->capacity();
  }
  if (growth_ == 0) {
    ++failed_;
    return last;
  }
  // A new pool: growth_bytes, or the request rounded up to the alignment when larger, and
  // what is left of the budget at most.
  const size_t need = (bytes + alignment_ - 1) / alignment_ * alignment_;
  const size_t left = budget_ - std::min(budget_, held);
  const size_t size = std::min(std::max(growth_, need), left / alignment_ * alignment_);
  if (size < need) {
    ++failed_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "arena: no room for ", bytes, " bytes of ", std::string(ArenaKindName(kind)), ": ", held,
        " of the budget's ", budget_, " bytes are held in ", pools_.size(),
        " pools and none has a free range that large"));
  }
  absl::StatusOr<std::shared_ptr<internal::ArenaPool>> pool = NewPool(size);
  if (!pool.ok()) {
    ++failed_;
    return pool.status();
  }
  pools_.push_back(*pool);
  absl::StatusOr<std::pair<size_t, size_t>> taken = (*pool)->Take(bytes, kind);
  if (!taken.ok()) return taken.status();  // cannot happen: the pool was sized for it
  auto [offset, reserved] = *taken;
  return ArenaBlock(*pool, (*pool)->base() + offset, offset, bytes, reserved, kind);
}

size_t DeviceArena::Trim(size_t keep_bytes) {
  if (growth_ == 0) return 0;
  std::vector<std::shared_ptr<internal::ArenaPool>> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Newest first: the empty pools kept as headroom are the most recently made.
    size_t kept = 0;
    for (size_t i = pools_.size(); i-- > 0;) {
      // No block can be taken from a pool while mu_ is held, and a pool no block uses has
      // no other owner than this list.
      if (pools_[i]->used() != 0) continue;
      if (kept + pools_[i]->capacity() <= keep_bytes) {
        kept += pools_[i]->capacity();
        continue;
      }
      released.push_back(std::move(pools_[i]));
      pools_.erase(pools_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  size_t bytes = 0;
  for (const auto& p : released) bytes += p->capacity();
  return bytes;  // the pools' memory goes back to the backend as `released` is destroyed
}

ArenaStats DeviceArena::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ArenaStats s;
  s.budget = budget_;
  s.pools = pools_.size();
  for (const auto& p : pools_) {
    const ArenaStats ps = p->Stats();
    s.capacity += ps.capacity;
    s.used += ps.used;
    s.largest_free = std::max(s.largest_free, ps.largest_free);
    s.free_ranges += ps.free_ranges;
    s.failed_allocations += ps.failed_allocations;
    for (int k = 0; k < kArenaKinds; ++k) {
      s.used_by_kind[k] += ps.used_by_kind[k];
      s.blocks_by_kind[k] += ps.blocks_by_kind[k];
    }
    if (growth_ == 0) s.peak_used = ps.peak_used;
  }
  if (growth_ > 0) {
    s.peak_used = std::max(usage_->peak.load(), s.used);
    // A block up to what is left of the budget fits in a new pool.
    const size_t left = budget_ - std::min(budget_, s.capacity);
    s.largest_free = std::max(s.largest_free, left / alignment_ * alignment_);
    // Failures of pools tried before a new one was made are not the arena's.
    s.failed_allocations = failed_;
  }
  return s;
}

size_t DeviceArena::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t c = 0;
  for (const auto& p : pools_) c += p->capacity();
  return c;
}

}  // namespace kvshade::storage

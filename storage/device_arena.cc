// DeviceArena: a backend pool sub-allocated by a RangeAllocator under one mutex.
#include "kvshade/storage/device_arena.h"

#include <algorithm>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "range_allocator.h"
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
  }
  return "unknown";
}

namespace internal {

// The pool and its bookkeeping, shared by the arena and its live blocks.
class ArenaPool {
 public:
  // `buffer` holds capacity + alignment bytes so that the base can be aligned up.
  ArenaPool(kernels::Buffer buffer, size_t capacity, size_t alignment)
      : buffer_(std::move(buffer)), ranges_(capacity, alignment) {
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
    return std::make_pair(*offset, reserved);
  }

  void Give(size_t offset, size_t reserved, ArenaKind kind) {
    base::MutexLock lock(&mu_);
    ranges_.Free(offset, reserved);
    stats_.used -= reserved;
    stats_.used_by_kind[int(kind)] -= reserved;
    stats_.blocks_by_kind[int(kind)] -= 1;
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

 private:
  kernels::Buffer buffer_;
  std::byte* base_ = nullptr;
  mutable base::Mutex mu_;
  RangeAllocator ranges_ ABSL_GUARDED_BY(mu_);
  ArenaStats stats_ ABSL_GUARDED_BY(mu_);
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

absl::StatusOr<std::unique_ptr<DeviceArena>> DeviceArena::Create(kernels::Backend& backend,
                                                                 size_t budget_bytes,
                                                                 size_t alignment) {
  if (budget_bytes == 0) {
    return absl::InvalidArgumentError("DeviceArena: budget_bytes must be > 0, got 0");
  }
  if (alignment < 16 || alignment > (size_t{1} << 20) || (alignment & (alignment - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "DeviceArena: alignment must be a power of two in [16, 1048576], got ", alignment));
  }
  if (budget_bytes < alignment) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceArena: budget_bytes (", budget_bytes,
                                                   ") is below the alignment (", alignment,
                                                   ")"));
  }
  // One extra alignment unit so that the first block is aligned whatever the backend's own
  // alignment is (the CPU backend gives 64 bytes).
  absl::StatusOr<kernels::Buffer> buffer = backend.Allocate(budget_bytes + alignment);
  if (!buffer.ok()) {
    return absl::Status(buffer.status().code(),
                        absl::StrCat("DeviceArena: cannot allocate the ", budget_bytes,
                                     "-byte pool on ", std::string(backend.name()), ": ",
                                     buffer.status().message()));
  }
  auto pool = std::make_shared<internal::ArenaPool>(std::move(buffer).value(),
                                                    budget_bytes, alignment);
  return std::unique_ptr<DeviceArena>(new DeviceArena(std::move(pool), backend.space(), alignment));
}

DeviceArena::~DeviceArena() = default;

absl::StatusOr<ArenaBlock> DeviceArena::Allocate(size_t bytes, ArenaKind kind) {
  if (bytes == 0) return absl::InvalidArgumentError("DeviceArena::Allocate: bytes must be > 0");
  if (int(kind) < 0 || int(kind) >= kArenaKinds) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceArena::Allocate: bad kind ", int(kind)));
  }
  absl::StatusOr<std::pair<size_t, size_t>> taken = pool_->Take(bytes, kind);
  if (!taken.ok()) return taken.status();
  auto [offset, reserved] = *taken;
  return ArenaBlock(pool_, pool_->base() + offset, offset, bytes, reserved, kind);
}

ArenaStats DeviceArena::Stats() const { return pool_->Stats(); }
size_t DeviceArena::capacity() const { return pool_->capacity(); }

}  // namespace kvshade::storage

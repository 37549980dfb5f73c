// DeviceArena: one memory pool per backend, made once at start-up from a byte budget with a
// single Backend::Allocate call, then sub-allocated (best fit over a free list, neighbours
// coalesced on free). Nothing on the request path calls the backend allocator.
//
// Over a CUDA backend the pool is device memory (factors, landmarks, static sets, slot
// buffers); over the CPU backend Backend::Allocate is host memory, so the same class is the
// host-memory arena of the CPU backend.
//
// Contract
// - Thread-safe. Allocate never blocks on I/O; a request that does not fit returns
//   ResourceExhausted (the caller decides what to spill) and counts as a failed allocation.
// - Every block is aligned to `alignment` bytes (default 256) and owned by an ArenaBlock,
//   which returns it on destruction. Blocks keep the pool alive: destroying the arena
//   while blocks are outstanding is safe (the memory is released with the last block).
// - Accounting is by kind (A, B, landmarks, static, slots, other), in bytes actually
//   reserved (request rounded up to the alignment), for metrics.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::storage {

enum class ArenaKind : int { kA = 0, kB, kLandmarks, kStatic, kSlots, kOther };
inline constexpr int kArenaKinds = 6;
std::string_view ArenaKindName(ArenaKind k);

struct ArenaStats {
  size_t capacity = 0;       // pool bytes
  size_t used = 0;           // bytes in live blocks (after alignment rounding)
  size_t peak_used = 0;
  size_t largest_free = 0;   // biggest single block that would fit now
  size_t free_ranges = 0;    // number of free ranges (fragmentation indicator)
  uint64_t failed_allocations = 0;
  std::array<size_t, kArenaKinds> used_by_kind{};
  std::array<size_t, kArenaKinds> blocks_by_kind{};
};

namespace internal {
class ArenaPool;
}

// A live block of an arena. Move-only; returns the block to its pool on destruction.
class ArenaBlock {
 public:
  ArenaBlock() = default;
  ArenaBlock(ArenaBlock&& o) noexcept;
  ArenaBlock& operator=(ArenaBlock&& o) noexcept;
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;
  ~ArenaBlock();

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }  // the size requested
  ArenaKind kind() const { return kind_; }
  kernels::Workspace workspace() const { return kernels::Workspace{data_, bytes_}; }
  explicit operator bool() const { return data_ != nullptr; }
  // Returns the block now (same as destroying it).
  void Reset();

 private:
  friend class DeviceArena;
  ArenaBlock(std::shared_ptr<internal::ArenaPool> pool, void* data, size_t offset,
             size_t bytes, size_t reserved, ArenaKind kind)
      : pool_(std::move(pool)), data_(data), offset_(offset), bytes_(bytes),
        reserved_(reserved), kind_(kind) {}

  std::shared_ptr<internal::ArenaPool> pool_;
  void* data_ = nullptr;
  size_t offset_ = 0;
  size_t bytes_ = 0;
  size_t reserved_ = 0;
  ArenaKind kind_ = ArenaKind::kOther;
};

class DeviceArena {
 public:
  // Allocates the pool (one Backend::Allocate of budget_bytes). alignment: a power of two
  // in [16, 1 MiB]. InvalidArgument for a zero budget or a bad alignment; the backend's
  // error (ResourceExhausted) when the pool cannot be made.
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Create(kernels::Backend& backend,
                                                             size_t budget_bytes,
                                                             size_t alignment = 256);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A block of `bytes` (> 0) in the backend's memory space; ResourceExhausted when no free
  // range is large enough (the message says the request, the free bytes and the largest
  // free range).
  absl::StatusOr<ArenaBlock> Allocate(size_t bytes, ArenaKind kind);

  ArenaStats Stats() const;
  kernels::MemorySpace space() const { return space_; }
  size_t alignment() const { return alignment_; }
  size_t capacity() const;

 private:
  DeviceArena(std::shared_ptr<internal::ArenaPool> pool, kernels::MemorySpace space,
              size_t alignment)
      : pool_(std::move(pool)), space_(space), alignment_(alignment) {}
  std::shared_ptr<internal::ArenaPool> pool_;
  kernels::MemorySpace space_;
  size_t alignment_;
};

}  // namespace kvshade::storage

// DeviceArena: the memory of a backend under one byte budget, sub-allocated (best fit over
// a free list per pool, neighbours coalesced on free). Two ways to hold it:
// - reserved (growth_bytes = 0): one pool of the whole budget, made at start-up with a
//   single Backend::Allocate call; nothing on the request path calls the backend allocator;
// - on demand (growth_bytes > 0): pools of growth_bytes (or the request, if larger) are
//   allocated when no pool has room, up to the budget, and Trim() returns pools no block
//   uses to the backend, so the arena holds about what its blocks need and a process
//   sharing the device gets the rest. Each pool is one backend allocation (one exported
//   region for same-node decode).
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
#include <mutex>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::storage {

// kSignatures: key signatures of chunked tokens (docs/ALGORITHM.md "Key signatures").
enum class ArenaKind : int { kA = 0, kB, kLandmarks, kStatic, kSlots, kOther, kSignatures };
inline constexpr int kArenaKinds = 7;
std::string_view ArenaKindName(ArenaKind k);

struct ArenaStats {
  size_t capacity = 0;       // pool bytes held now (the budget when reserved)
  size_t budget = 0;         // the most the arena may hold
  size_t pools = 0;          // backend allocations held
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
struct ArenaUsage;
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
  static absl::StatusOr<std::unique_ptr<DeviceArena>> Create(kernels::DeviceRuntime& backend,
                                                             size_t budget_bytes,
                                                             size_t alignment = 256);
  // On demand: no pool at first; pools of at least growth_bytes (a multiple of the
  // alignment, > 0) as blocks need them, up to budget_bytes. The backend must outlive the
  // arena and its blocks.
  static absl::StatusOr<std::unique_ptr<DeviceArena>> CreateOnDemand(kernels::DeviceRuntime& backend,
                                                                     size_t budget_bytes,
                                                                     size_t growth_bytes,
                                                                     size_t alignment = 256);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // A block of `bytes` (> 0) in the backend's memory space; ResourceExhausted when no free
  // range is large enough (the message says the request, the free bytes and the largest
  // free range).
  // On demand, a new pool is allocated when none has room (ResourceExhausted, as above,
  // when the budget does not allow one, or with the backend's message when the backend
  // has no memory left).
  absl::StatusOr<ArenaBlock> Allocate(size_t bytes, ArenaKind kind);

  // On demand: returns to the backend every pool no block uses, beyond `keep_bytes` of
  // such empty pools (the newest are kept: headroom against allocating again at once);
  // returns the bytes released. A no-op for a reserved arena.
  size_t Trim(size_t keep_bytes = 0);

  ArenaStats Stats() const;
  kernels::MemorySpace space() const { return space_; }
  size_t alignment() const { return alignment_; }
  size_t capacity() const;  // bytes held now
  size_t budget() const { return budget_; }
  bool on_demand() const { return growth_ > 0; }

 private:
  DeviceArena(kernels::DeviceRuntime* backend, size_t budget, size_t growth, kernels::MemorySpace space,
              size_t alignment);
  absl::StatusOr<std::shared_ptr<internal::ArenaPool>> NewPool(size_t bytes);

  kernels::DeviceRuntime* backend_;
  const size_t budget_;
  const size_t growth_;  // 0: reserved (one pool)
  kernels::MemorySpace space_;
  size_t alignment_;
  mutable std::mutex mu_;  // the pool list (pools have their own locks)
  std::vector<std::shared_ptr<internal::ArenaPool>> pools_;
  std::shared_ptr<internal::ArenaUsage> usage_;  // over every pool, made in the constructor
  uint64_t failed_ = 0;
};

}  // namespace kvshade::storage

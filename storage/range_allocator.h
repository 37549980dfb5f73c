// RangeAllocator: best-fit sub-allocation of an offset range [0, capacity), with free
// neighbours coalesced on release. Offsets only: the owner maps them onto memory (the
// device arena's pool, the host store's slabs). Not thread-safe; owners lock around it.
//
// Invariants: free ranges never touch (always coalesced); every range is a multiple of the
// granularity given at construction; free bytes + allocated bytes == capacity.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace kvshade::storage::internal {

class RangeAllocator {
 public:
  // capacity is rounded down to a multiple of granularity (a power of two).
  RangeAllocator(size_t capacity, size_t granularity);

  // Bytes a request of `bytes` actually takes (rounded up to the granularity).
  size_t Reserved(size_t bytes) const;
  // Offset of a new range of Reserved(bytes) bytes (smallest free range that fits, lowest
  // offset among equals), or nullopt when none fits. bytes == 0 takes one granule.
  std::optional<size_t> Allocate(size_t bytes);
  // Returns a range [offset, offset + reserved) previously allocated.
  void Free(size_t offset, size_t reserved);

  size_t capacity() const { return capacity_; }
  size_t free_bytes() const { return free_bytes_; }
  size_t largest_free() const;
  size_t free_ranges() const { return by_offset_.size(); }

 private:
  size_t capacity_;
  size_t granularity_;
  size_t free_bytes_ = 0;
  std::map<size_t, size_t> by_offset_;          // offset -> size
  std::set<std::pair<size_t, size_t>> by_size_; // (size, offset)
};

}  // namespace kvshade::storage::internal

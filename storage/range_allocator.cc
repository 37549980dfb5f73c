// Best-fit range allocator with coalescing (see range_allocator.h).
#include "range_allocator.h"

#include <iterator>

namespace kvshade::storage::internal {

RangeAllocator::RangeAllocator(size_t capacity, size_t granularity)
    : capacity_(capacity / granularity * granularity), granularity_(granularity) {
  if (capacity_ > 0) {
    by_offset_.emplace(0, capacity_);
    by_size_.emplace(capacity_, 0);
    free_bytes_ = capacity_;
  }
}

size_t RangeAllocator::Reserved(size_t bytes) const {
  if (bytes == 0) return granularity_;
  return (bytes + granularity_ - 1) / granularity_ * granularity_;
}

std::optional<size_t> RangeAllocator::Allocate(size_t bytes) {
  if (bytes > capacity_) return std::nullopt;  // also guards the rounding below
  const size_t need = Reserved(bytes);
  auto it = by_size_.lower_bound({need, 0});
  if (it == by_size_.end()) return std::nullopt;
  const auto [size, offset] = *it;
  by_size_.erase(it);
  by_offset_.erase(offset);
  if (size > need) {
    by_offset_.emplace(offset + need, size - need);
    by_size_.emplace(size - need, offset + need);
  }
  free_bytes_ -= need;
  return offset;
}

void RangeAllocator::Free(size_t offset, size_t reserved) {
  size_t start = offset, size = reserved;
  auto next = by_offset_.lower_bound(offset);
  if (next != by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      size += prev->second;
      by_size_.erase({prev->second, prev->first});
      by_offset_.erase(prev);
    }
  }
  if (next != by_offset_.end() && offset + reserved == next->first) {
    size += next->second;
    by_size_.erase({next->second, next->first});
    by_offset_.erase(next);
  }
  by_offset_.emplace(start, size);
  by_size_.emplace(size, start);
  free_bytes_ += reserved;
}

size_t RangeAllocator::largest_free() const {
  return by_size_.empty() ? 0 : by_size_.rbegin()->first;
}

}  // namespace kvshade::storage::internal

#include "kvshade/storage/staging_pool.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvshade::storage {

struct StagingPool::State {
  kernels::DeviceRuntime* backend = nullptr;
  size_t max_kept = 0;
  mutable std::mutex mu;
  std::multimap<size_t, kernels::Buffer> free;  // by size
  size_t kept = 0;                              // bytes in `free`
  size_t leased = 0;                            // bytes of outstanding leases

  // Takes the buffers out under the lock; the caller frees them outside it.
  std::vector<kernels::Buffer> TakeAll() {
    std::vector<kernels::Buffer> out;
    for (auto& [size, b] : free) out.push_back(std::move(b));
    free.clear();
    kept = 0;
    return out;
  }
};

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    state_ = std::move(o.state_);
    buffer_ = std::move(o.buffer_);
  }
  return *this;
}

void StagingPool::Lease::reset() {
  if (!buffer_.data()) {
    state_.reset();
    return;
  }
  kernels::Buffer drop;  // freed outside the lock
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    const size_t n = buffer_.bytes();
    state_->leased -= n;
    if (state_->kept + n <= state_->max_kept) {
      state_->free.emplace(n, std::move(buffer_));
      state_->kept += n;
    } else {
      drop = std::move(buffer_);
    }
  }
  buffer_ = kernels::Buffer();
  state_.reset();
}

StagingPool::StagingPool(kernels::DeviceRuntime& backend, size_t max_kept_bytes)
    : state_(std::make_shared<State>()) {
  state_->backend = &backend;
  state_->max_kept = max_kept_bytes;
}

StagingPool::~StagingPool() { Trim(); }

absl::StatusOr<StagingPool::Lease> StagingPool::Take(size_t bytes) {
  const size_t want = (std::max<size_t>(bytes, 1) + kSizeClass - 1) / kSizeClass * kSizeClass;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto it = state_->free.lower_bound(want);
    if (it != state_->free.end() && it->first <= 2 * want) {
      kernels::Buffer b = std::move(it->second);
      state_->free.erase(it);
      state_->kept -= b.bytes();
      state_->leased += b.bytes();
      return Lease(state_, std::move(b));
    }
  }
  absl::StatusOr<kernels::Buffer> b = state_->backend->AllocateStaging(want);
  if (!b.ok()) {
    Trim();  // the kept buffers of other sizes may be what stands in the way
    b = state_->backend->AllocateStaging(want);
  }
  if (!b.ok()) {
    return absl::Status(b.status().code(), absl::StrCat("staging memory of ", want, " bytes: ",
                                                        b.status().message()));
  }
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->leased += b->bytes();
  return Lease(state_, *std::move(b));
}

void StagingPool::Trim() {
  std::vector<kernels::Buffer> drop;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    drop = state_->TakeAll();
  }
}

size_t StagingPool::kept_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->kept;
}

size_t StagingPool::leased_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->leased;
}

}  // namespace kvshade::storage

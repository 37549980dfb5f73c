// StagingPool: host buffers to stage copies between host and backend memory, kept for
// reuse. Backend::AllocateStaging's memory (page-locked on CUDA, so copies to and from it
// are DMA at full PCIe rate and need no bounce through a driver buffer) is dear to make:
// pinning and faulting in tens of megabytes costs milliseconds. A caller that needs such
// memory for a while, again and again (an ingest stream's host copies of incomplete
// layers during a chunked prefill: service/ingest.cc "Overlap"), takes it here and gives
// it back, so that after the first use of each size no allocation is on its path.
//
// Contract
// - Thread-safe. Take(bytes) returns a lease of at least `bytes` (rounded up to 2 MiB):
//   a kept buffer of that size class if one is free, else a new one from the backend
//   (AllocateStaging's error, with the size, when it fails after letting every kept
//   buffer go). Never a buffer more than twice the rounded size.
// - A lease gives its buffer back when it is reset or destroyed; the pool keeps it while
//   the free buffers stay within `max_kept_bytes`, and frees it otherwise. Leases keep the
//   pool's state alive: destroying the pool while leases are outstanding is safe.
// - Free buffers are memory the process holds without use: Trim() frees them all, and
//   kept_bytes() / leased_bytes() say how much there is, for metrics.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::storage {

class StagingPool {
  struct State;

 public:
  static constexpr size_t kSizeClass = size_t(2) << 20;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&&) noexcept = default;
    Lease& operator=(Lease&& o) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() { reset(); }

    std::byte* get() const { return static_cast<std::byte*>(buffer_.data()); }
    size_t bytes() const { return buffer_.bytes(); }
    explicit operator bool() const { return buffer_.data() != nullptr; }
    // Gives the buffer back to the pool (nothing may still read or write it).
    void reset();

   private:
    friend class StagingPool;
    Lease(std::shared_ptr<State> state, kernels::Buffer buffer)
        : state_(std::move(state)), buffer_(std::move(buffer)) {}
    std::shared_ptr<State> state_;
    kernels::Buffer buffer_;
  };

  StagingPool(kernels::DeviceRuntime& backend, size_t max_kept_bytes);
  ~StagingPool();
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  absl::StatusOr<Lease> Take(size_t bytes);
  void Trim();
  size_t kept_bytes() const;
  size_t leased_bytes() const;

 private:
  std::shared_ptr<State> state_;
};

}  // namespace kvshade::storage

// Mutex, MutexLock and CondVar for the storage layer: the absl::Mutex vocabulary on top of
// the C++ standard library (pthreads). Why not absl::Mutex: Debian's prebuilt Abseil is not
// built for ThreadSanitizer, so the TSan build (KVSHADE_SANITIZE=thread) cannot see its
// synchronization and buries real races under false reports; TSan does understand
// pthreads. Clang thread-safety annotations are kept.
#pragma once

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace kvshade::storage::internal {

class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
};

class CondVar {
 public:
  // Atomically releases *mu (held by the caller), waits for a signal (or spuriously wakes),
  // and re-acquires it. Callers loop on their condition.
  void Wait(Mutex* mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held; the caller's MutexLock releases it
  }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace kvshade::storage::internal

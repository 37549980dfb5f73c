// Mutex, MutexLock, ReaderMutexLock and CondVar for every layer: the absl::Mutex vocabulary
// on top of the C++ standard library (pthreads). Why not absl::Mutex: Debian's prebuilt
// Abseil is not built for ThreadSanitizer, so the TSan build (KVSHADE_SANITIZE=thread)
// cannot see its synchronization and buries real races under false reports; TSan does
// understand pthreads. Clang thread-safety annotations are kept.
#pragma once

#include <condition_variable>
#include <shared_mutex>

#include "absl/base/thread_annotations.h"

namespace kvshade::base {

// A reader-writer mutex (pthread rwlock underneath): Lock/Unlock exclusive, ReaderLock/
// ReaderUnlock shared.
class ABSL_LOCKABLE Mutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  void ReaderLock() ABSL_SHARED_LOCK_FUNCTION() { mu_.lock_shared(); }
  void ReaderUnlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock_shared(); }

 private:
  friend class CondVar;
  std::shared_mutex mu_;
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

class ABSL_SCOPED_LOCKABLE ReaderMutexLock {
 public:
  explicit ReaderMutexLock(Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
  }
  ~ReaderMutexLock() ABSL_UNLOCK_FUNCTION() { mu_->ReaderUnlock(); }
  ReaderMutexLock(const ReaderMutexLock&) = delete;
  ReaderMutexLock& operator=(const ReaderMutexLock&) = delete;

 private:
  Mutex* mu_;
};

class CondVar {
 public:
  // Atomically releases *mu (held exclusively by the caller), waits for a signal (or
  // spuriously wakes), and re-acquires it. Callers loop on their condition.
  void Wait(Mutex* mu) {
    std::unique_lock<std::shared_mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();  // still held; the caller's MutexLock releases it
  }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable_any cv_;
};

}  // namespace kvshade::base

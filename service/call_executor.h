// CallExecutor: the daemon's threads for the work of gRPC calls (docs/OPERATIONS.md "Limits
// on streams and calls"). The gRPC service runs on gRPC's callback API, whose handlers run
// on gRPC's own threads and must never block: every call hands its work (the engine
// operation of a unary call, one message of an Ingest stream) to this executor, after it
// was admitted (admission.h). A call waiting for its client (an idle or slow Ingest
// stream) holds no thread here, nor in gRPC.
//
// At most `max_threads` run at once (worker_threads; 0: no cap, a thread is started
// whenever a job finds none idle). Jobs queue per tenant and the tenants with queued jobs
// take turns, so a tenant with many jobs queued delays another tenant's next job by at
// most one of its own. With limits.max_calls_per_tenant below the thread cap, one
// tenant's jobs never run on every thread at once (each call has at most one job queued
// or running), so the others always find a thread.
//
// Threads start on demand; one idle for `idle_exit` ends, down to `keep_threads`.
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"

namespace kvshade::service {

class CallExecutor {
 public:
  struct Options {
    uint32_t max_threads = 0;   // 0: no cap
    uint32_t keep_threads = 4;  // threads that never end for being idle
    std::chrono::milliseconds idle_exit{30000};
  };
  using Job = absl::AnyInvocable<void() &&>;

  explicit CallExecutor(Options options);
  // Runs every job still queued, then joins the threads.
  ~CallExecutor();
  CallExecutor(const CallExecutor&) = delete;
  CallExecutor& operator=(const CallExecutor&) = delete;

  // Queues `job` in `tenant`'s turn. Never blocks on other jobs.
  void Submit(std::string_view tenant, Job job);

  struct Counts {
    uint32_t threads = 0;  // started and not ended
    uint32_t busy = 0;     // running a job
    size_t queued = 0;     // waiting for a thread
  };
  Counts counts() const;

 private:
  void Loop();
  // Joins the threads that ended for being idle. Under mu_.
  void ReapLocked();

  const Options options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::deque<Job>, std::less<>> queues_;  // tenants with queued jobs
  std::deque<std::string> turns_;                               // their order of turns
  size_t queued_ = 0;
  uint32_t idle_ = 0;  // threads waiting for a job
  uint32_t busy_ = 0;
  bool stopping_ = false;
  std::list<std::thread> threads_;
  std::vector<std::thread::id> ended_;  // ended for being idle, not yet joined
};

}  // namespace kvshade::service

// CallExecutor (call_executor.h): fair turns between tenants over a capped, on-demand pool.
#include "call_executor.h"

#include <algorithm>
#include <utility>

namespace kvshade::service {

CallExecutor::CallExecutor(Options options) : options_(options) {}

CallExecutor::~CallExecutor() {
  std::list<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
    // Every queued job has a thread to run it (Submit saw to that); they finish the queue.
    threads.swap(threads_);
  }
  for (auto& t : threads) t.join();
}

void CallExecutor::Submit(std::string_view tenant, Job job) {
  std::lock_guard<std::mutex> lock(mu_);
  ReapLocked();
  auto it = queues_.find(tenant);
  if (it == queues_.end()) {
    it = queues_.emplace(std::string(tenant), std::deque<Job>()).first;
    turns_.push_back(it->first);
  }
  it->second.push_back(std::move(job));
  ++queued_;
  // Enough idle threads for every queued job: wake one. Otherwise start one, within the cap.
  const uint32_t running = static_cast<uint32_t>(threads_.size() - ended_.size());
  if (idle_ < queued_ && (options_.max_threads == 0 || running < options_.max_threads)) {
    threads_.emplace_back([this] { Loop(); });
  } else {
    cv_.notify_one();
  }
}

CallExecutor::Counts CallExecutor::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Counts{static_cast<uint32_t>(threads_.size() - ended_.size()), busy_, queued_};
}

void CallExecutor::ReapLocked() {
  if (ended_.empty()) return;
  for (auto it = threads_.begin(); it != threads_.end();) {
    if (std::find(ended_.begin(), ended_.end(), it->get_id()) != ended_.end()) {
      // It has left Loop (it marked itself ended as its last step under mu_): the join
      // waits at most for its return.
      it->join();
      it = threads_.erase(it);
    } else {
      ++it;
    }
  }
  ended_.clear();
}

void CallExecutor::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (queued_ > 0) {
      // The tenant whose turn it is gives its oldest job; it goes to the back of the turns
      // if it has more.
      std::string tenant = std::move(turns_.front());
      turns_.pop_front();
      auto q = queues_.find(tenant);
      Job job = std::move(q->second.front());
      q->second.pop_front();
      --queued_;
      if (q->second.empty()) {
        queues_.erase(q);
      } else {
        turns_.push_back(std::move(tenant));
      }
      ++busy_;
      lock.unlock();
      std::move(job)();
      job = nullptr;  // what the job holds is released outside the lock
      lock.lock();
      --busy_;
      continue;
    }
    if (stopping_) return;
    ++idle_;
    const bool woken =
        cv_.wait_for(lock, options_.idle_exit, [this] { return queued_ > 0 || stopping_; });
    --idle_;
    if (!woken && threads_.size() - ended_.size() > options_.keep_threads) {
      ended_.push_back(std::this_thread::get_id());
      return;
    }
  }
}

}  // namespace kvshade::service

// StreamPace (stream_pace.h): the idle timeout and the minimum-progress rule of an Ingest
// stream over waiting time.
#include "stream_pace.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvshade::service {

StreamPaceLimits PaceLimits(const LimitsConfig& limits) {
  StreamPaceLimits l;
  l.idle_ms = limits.stream_idle_timeout_ms;
  l.min_bytes_per_s = limits.stream_min_bytes_per_s;
  l.window_ms = limits.stream_progress_window_ms;
  return l;
}

void StreamPace::StartWait(Clock::time_point now) {
  waiting_ = true;
  wait_start_ = now;
  accounted_to_ = now;
}

StreamPace::Clock::time_point StreamPace::Deadline() const {
  auto deadline = Clock::time_point::max();
  if (!waiting_) return deadline;
  if (limits_.idle_ms != 0) deadline = wait_start_ + std::chrono::milliseconds(limits_.idle_ms);
  if (limits_.min_bytes_per_s != 0) {
    const auto window =
        std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(limits_.window_ms));
    const auto left = window > window_waited_ ? window - window_waited_ : Clock::duration::zero();
    deadline = std::min(deadline, accounted_to_ + left);
  }
  return deadline;
}

void StreamPace::Account(Clock::time_point now) {
  if (!waiting_ || now <= accounted_to_) return;
  window_waited_ += now - accounted_to_;
  accounted_to_ = now;
}

uint64_t StreamPace::WindowMinBytes() const {
  // min_bytes_per_s <= 1 GiB and window_ms <= 86400000 (ValidateConfig): no overflow.
  return (limits_.min_bytes_per_s * limits_.window_ms + 999) / 1000;
}

absl::Status StreamPace::CloseWindows() {
  if (limits_.min_bytes_per_s == 0) return absl::OkStatus();
  const auto window =
      std::chrono::duration_cast<Clock::duration>(std::chrono::milliseconds(limits_.window_ms));
  while (window_waited_ >= window) {
    if (window_bytes_ < WindowMinBytes()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "Ingest: ", window_bytes_, " bytes in ", limits_.window_ms,
          " ms spent waiting for the client, below the minimum of ", WindowMinBytes(), " (",
          limits_.min_bytes_per_s,
          " bytes/s, limits.stream_min_bytes_per_s, over "
          "limits.stream_progress_window_ms); the stream is ended and nothing was committed"));
    }
    window_waited_ -= window;
    window_bytes_ = 0;
  }
  return absl::OkStatus();
}

absl::Status StreamPace::Expire(Clock::time_point now) {
  if (!waiting_) return absl::OkStatus();
  if (limits_.idle_ms != 0 && now - wait_start_ >= std::chrono::milliseconds(limits_.idle_ms)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "Ingest: no message for ", limits_.idle_ms,
        " ms (limits.stream_idle_timeout_ms); the stream is ended and nothing was committed"));
  }
  Account(now);
  return CloseWindows();
}

absl::Status StreamPace::Received(Clock::time_point now, uint64_t bytes) {
  Account(now);
  waiting_ = false;
  window_bytes_ += bytes;
  return CloseWindows();
}

absl::Status PipelinedPace::Received(Clock::time_point now, uint64_t bytes) {
  ++in_hand_;
  // Ends the wait when there was one; a message that arrives while others are in hand
  // only adds its bytes to the current window.
  return pace_.Received(now, bytes);
}

void PipelinedPace::Processed(Clock::time_point now) {
  if (in_hand_ == 0) return;
  if (--in_hand_ == 0) pace_.StartWait(now);
}

}  // namespace kvshade::service

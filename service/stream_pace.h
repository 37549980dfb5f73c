// StreamPace: the limits on how an Ingest stream's client paces its messages
// (docs/OPERATIONS.md "Limits on streams and calls"), as pure logic over a clock the caller
// passes in, so that it is tested without a transport (tests/service/admission_test.cc):
//
//   - idle: a wait for the next message longer than limits.stream_idle_timeout_ms ends the
//     stream;
//   - minimum progress: every window of limits.stream_progress_window_ms spent waiting for
//     the client must bring at least limits.stream_min_bytes_per_s x window bytes, or the
//     stream ends. It cuts a stream that trickles (one small part now and then, never idle
//     for long), which the idle timeout alone never would.
//
// Both clocks run only while the server waits for the client, never while it processes a
// message (a busy server must not cut its clients). A stream that ends before its first
// window has passed is never judged by the minimum-progress rule.
//
// Not thread-safe: the stream's owner and the timer that expires it hand it over (the
// owner never touches it while a timer holds it; grpc_service.cc's StreamWatchdog), or one
// thread does both (ucx_server.cc: the progress thread).
#pragma once

#include <chrono>
#include <cstdint>

#include "absl/status/status.h"
#include "kvshade/service/config.h"

namespace kvshade::service {

struct StreamPaceLimits {
  uint32_t idle_ms = 0;          // 0: no idle timeout
  uint64_t min_bytes_per_s = 0;  // 0: no minimum progress
  uint32_t window_ms = 30000;    // > 0 when min_bytes_per_s is set
  bool any() const { return idle_ms != 0 || min_bytes_per_s != 0; }
};

// limits.stream_idle_timeout_ms, stream_min_bytes_per_s and stream_progress_window_ms.
StreamPaceLimits PaceLimits(const LimitsConfig& limits);

class StreamPace {
 public:
  using Clock = std::chrono::steady_clock;

  explicit StreamPace(StreamPaceLimits limits) : limits_(limits) {}

  // The server starts waiting for the next message at `now`.
  void StartWait(Clock::time_point now);

  // While waiting: when the wait must be looked at again (Expire), the earlier of the idle
  // deadline and the end of the current progress window; Clock::time_point::max() when
  // neither limit applies (or when not waiting).
  Clock::time_point Deadline() const;

  // While waiting, at or after Deadline(): DEADLINE_EXCEEDED naming the limit that ends the
  // stream (and that nothing was committed), or OK when the stream may go on waiting (a
  // progress window closed with enough bytes; Deadline() is then later).
  absl::Status Expire(Clock::time_point now);

  // A message of `bytes` arrived at `now`, which ends the wait. DEADLINE_EXCEEDED when a
  // progress window closed short (the message counted in it); OK otherwise. A message
  // that arrives is never refused by the idle timeout, whatever `now` is.
  absl::Status Received(Clock::time_point now, uint64_t bytes);

  bool waiting() const { return waiting_; }

 private:
  // Moves the waiting time up to `now` into the current window.
  void Account(Clock::time_point now);
  // Closes every window that has run its full length: the next one starts, or the error.
  absl::Status CloseWindows();
  uint64_t WindowMinBytes() const;

  StreamPaceLimits limits_;
  bool waiting_ = false;
  Clock::time_point wait_start_{};    // the current wait (idle timeout)
  Clock::time_point accounted_to_{};  // waiting time before this is in window_waited_
  Clock::duration window_waited_{0};  // time spent waiting in the current window
  uint64_t window_bytes_ = 0;         // bytes received in the current window
};

// StreamPace for a stream whose messages the server receives ahead of processing them
// (the UCX data plane: a client keeps several messages of a stream in flight, and they
// queue behind each other and behind the connection's other streams). The server waits
// for the client only while none of the stream's messages is in hand (received, not yet
// processed): a stream whose messages queue behind a busy server is never cut, and the
// wait starts when the last message in hand has been processed.
class PipelinedPace {
 public:
  using Clock = StreamPace::Clock;

  explicit PipelinedPace(StreamPaceLimits limits) : pace_(limits) {}

  // A message of `bytes` was received at `now`; it is in hand until Processed. As
  // StreamPace::Received: DEADLINE_EXCEEDED when a progress window closed short.
  absl::Status Received(Clock::time_point now, uint64_t bytes);
  // A message in hand was processed at `now`; when none is left, the wait starts.
  void Processed(Clock::time_point now);

  // As StreamPace: max() while a message is in hand (or before the first one was processed).
  Clock::time_point Deadline() const { return pace_.Deadline(); }
  absl::Status Expire(Clock::time_point now) { return pace_.Expire(now); }

  uint32_t in_hand() const { return in_hand_; }
  bool waiting() const { return pace_.waiting(); }

 private:
  StreamPace pace_;
  uint32_t in_hand_ = 0;
};

}  // namespace kvshade::service

// Admission per tenant and the pace of Ingest streams, the transport-free parts of
// docs/OPERATIONS.md "Limits on streams and calls": TenantAdmission (call and stream slots,
// refusals by name), StreamPace (idle timeout and minimum progress over waiting time only),
// PipelinedPace (the same for UCX streams, whose messages are received ahead) and
// CallExecutor (the call threads: the cap, turns between tenants, threads on demand).
// The same rules over the wire, both transports: tests/integration/admission_test.cc.
#include "admission.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "call_executor.h"
#include "gtest/gtest.h"
#include "stream_pace.h"

namespace kvshade::service {
namespace admission_test {
namespace {

using std::chrono::milliseconds;
using Clock = StreamPace::Clock;

// --- TenantAdmission ----------------------------------------------------------------------

TEST(TenantAdmission, CapsArePerTenantAndRefusalsNameTheLimit) {
  TenantAdmission a(/*max_calls=*/3, /*max_streams=*/2);
  std::vector<TenantAdmission::Ticket> held;
  for (int i = 0; i < 2; ++i) {
    auto t = a.Admit("Ingest", "alpha", /*stream=*/true);
    ASSERT_TRUE(t.ok()) << t.status();
    held.push_back(*std::move(t));
  }
  EXPECT_EQ(a.streams("alpha"), 2u);
  EXPECT_EQ(a.calls("alpha"), 2u);
  // A third stream: the stream cap, by name.
  auto stream = a.Admit("Ingest", "alpha", true);
  ASSERT_EQ(stream.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(stream.status().message(), "limits.max_streams_per_tenant"))
      << stream.status();
  EXPECT_TRUE(absl::StrContains(stream.status().message(), "tenant 'alpha'")) << stream.status();
  // A unary call still fits under the call cap; the next does not, and is refused by name
  // (the call cap is checked first, for streams too).
  auto call = a.Admit("GetSession", "alpha", false);
  ASSERT_TRUE(call.ok()) << call.status();
  held.push_back(*std::move(call));
  for (bool s : {false, true}) {
    auto over = a.Admit(s ? "Ingest" : "ListSessions", "alpha", s);
    ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StrContains(over.status().message(), "limits.max_calls_per_tenant"))
        << over.status();
    EXPECT_TRUE(absl::StartsWith(over.status().message(), s ? "Ingest: " : "ListSessions: "));
  }
  // Another tenant is not affected.
  auto beta = a.Admit("Ingest", "beta", true);
  ASSERT_TRUE(beta.ok()) << beta.status();
  EXPECT_EQ(a.calls("beta"), 1u);
  // Tickets give their slots back when destroyed or reset, once (a moved-from ticket holds
  // nothing).
  TenantAdmission::Ticket moved = std::move(held.front());
  EXPECT_FALSE(held.front().held());
  held.erase(held.begin());
  EXPECT_EQ(a.calls("alpha"), 3u);
  moved.Reset();
  moved.Reset();
  EXPECT_EQ(a.calls("alpha"), 2u);
  EXPECT_EQ(a.streams("alpha"), 1u);
  EXPECT_TRUE(a.Admit("Ingest", "alpha", true).ok());  // the temporary gives it back at once
  held.clear();
  EXPECT_EQ(a.calls("alpha"), 0u);
  EXPECT_EQ(a.streams("alpha"), 0u);
}

TEST(TenantAdmission, ZeroMeansNoCap) {
  TenantAdmission a(0, 0);
  std::vector<TenantAdmission::Ticket> held;
  for (int i = 0; i < 1000; ++i) {
    auto t = a.Admit("Ingest", "default", true);
    ASSERT_TRUE(t.ok()) << t.status();
    held.push_back(*std::move(t));
  }
  EXPECT_EQ(a.streams("default"), 1000u);
}

// The daemon has one TenantAdmission for both transports (Server::Start): a tenant's gRPC
// and UCX calls and streams fill one count, and a refusal starts with the name of the call
// that asked, over either.
TEST(TenantAdmission, OneCountWhicheverTransportAsks) {
  TenantAdmission a(/*max_calls=*/3, /*max_streams=*/2);
  auto grpc_stream = a.Admit("Ingest", "alpha", true);
  auto ucx_stream = a.Admit("ucx Ingest", "alpha", true);
  ASSERT_TRUE(grpc_stream.ok() && ucx_stream.ok());
  for (const char* method : {"Ingest", "ucx Ingest"}) {
    auto over = a.Admit(method, "alpha", true);
    ASSERT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_TRUE(absl::StartsWith(over.status().message(),
                                 std::string(method) + ": tenant 'alpha' already has 2 open"))
        << over.status();
  }
  auto call = a.Admit("ucx SelectAndReconstruct", "alpha", false);
  ASSERT_TRUE(call.ok());
  auto over = a.Admit("ListSessions", "alpha", false);
  EXPECT_TRUE(absl::StrContains(over.status().message(), "limits.max_calls_per_tenant"));
  ucx_stream->Reset();
  EXPECT_TRUE(a.Admit("Ingest", "alpha", true).ok());
}

// calls() is every tenant's calls in flight together (what a shutdown waits for); a refused
// call holds nothing.
TEST(TenantAdmission, CallsCountsEveryTenantsCallsInFlight) {
  TenantAdmission a(/*max_calls=*/2, /*max_streams=*/0);
  EXPECT_EQ(a.calls(), 0u);
  auto a1 = a.Admit("Ingest", "alpha", true);
  auto a2 = a.Admit("GetSession", "alpha", false);
  auto b1 = a.Admit("ucx SelectAndReconstruct", "beta", false);
  ASSERT_TRUE(a1.ok() && a2.ok() && b1.ok());
  EXPECT_FALSE(a.Admit("GetSession", "alpha", false).ok());
  EXPECT_EQ(a.calls(), 3u);
  a2->Reset();
  EXPECT_EQ(a.calls(), 2u);
  a1->Reset();
  b1->Reset();
  EXPECT_EQ(a.calls(), 0u);
}

// --- StreamPace -----------------------------------------------------------------------------

TEST(StreamPace, IdleTimeoutCountsOneWaitAndNamesTheLimit) {
  StreamPace p({/*idle_ms=*/1000, /*min_bytes_per_s=*/0, /*window_ms=*/30000});
  const Clock::time_point t0{};
  EXPECT_EQ(p.Deadline(), Clock::time_point::max());  // not waiting
  p.StartWait(t0);
  EXPECT_EQ(p.Deadline(), t0 + milliseconds(1000));
  EXPECT_TRUE(p.Expire(t0 + milliseconds(999)).ok());
  // A message resets it; processing time (here 5 s) is not waiting time.
  EXPECT_TRUE(p.Received(t0 + milliseconds(999), 10).ok());
  p.StartWait(t0 + milliseconds(6000));
  EXPECT_EQ(p.Deadline(), t0 + milliseconds(7000));
  const absl::Status st = p.Expire(t0 + milliseconds(7000));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_idle_timeout_ms")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nothing was committed")) << st;
  // Without limits there is no deadline at all.
  StreamPace none({0, 0, 30000});
  none.StartWait(t0);
  EXPECT_EQ(none.Deadline(), Clock::time_point::max());
}

// One 300-byte part every 900 ms against 1000 bytes/s over 2 s windows (2000 bytes each):
// never idle (1 s), cut when the first window closes.
TEST(StreamPace, ATrickleIsCutWhenAWindowClosesShort) {
  StreamPace p({/*idle_ms=*/1000, /*min_bytes_per_s=*/1000, /*window_ms=*/2000});
  Clock::time_point now{};
  absl::Status st;
  int parts = 0;
  for (; parts < 10; ++parts) {
    p.StartWait(now);
    ASSERT_LE(p.Deadline(), now + milliseconds(1000));
    now += milliseconds(900);
    st = p.Received(now, 300);
    if (!st.ok()) break;
    now += milliseconds(1);  // processing: not counted
  }
  // Waits of 900 ms: the window's 2000 ms of waiting close during the third wait.
  EXPECT_EQ(parts, 2);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_min_bytes_per_s")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_progress_window_ms")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "900 bytes")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nothing was committed")) << st;
}

TEST(StreamPace, TheWindowDeadlineCutsAWaitAndAFullWindowRollsOver) {
  StreamPace p({/*idle_ms=*/0, /*min_bytes_per_s=*/1000, /*window_ms=*/1000});
  Clock::time_point now{};
  // 1500 bytes in the first 400 ms of waiting, then a long wait: the window closes with
  // enough bytes and a new one starts at its end; the wait goes on.
  p.StartWait(now);
  EXPECT_EQ(p.Deadline(), now + milliseconds(1000));
  now += milliseconds(400);
  ASSERT_TRUE(p.Received(now, 1500).ok());
  now += milliseconds(5000);  // processing
  p.StartWait(now);
  EXPECT_EQ(p.Deadline(), now + milliseconds(600));  // what is left of the window
  now += milliseconds(600);
  ASSERT_TRUE(p.Expire(now).ok());
  EXPECT_EQ(p.Deadline(), now + milliseconds(1000));  // the next window
  // That one receives nothing: cut at its end, not before.
  EXPECT_TRUE(p.Expire(now + milliseconds(999)).ok());
  const absl::Status st = p.Expire(now + milliseconds(1000));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st.message(), "0 bytes in 1000 ms")) << st;
}

TEST(StreamPace, AStreamShorterThanAWindowIsNeverJudged) {
  StreamPace p({/*idle_ms=*/30000, /*min_bytes_per_s=*/1 << 20, /*window_ms=*/30000});
  Clock::time_point now{};
  for (int i = 0; i < 20; ++i) {  // 20 tiny messages, 1 s apart: 20 s of waiting
    p.StartWait(now);
    now += milliseconds(1000);
    ASSERT_TRUE(p.Received(now, 1).ok()) << i;
  }
}

// --- PipelinedPace (UCX ingest streams) -------------------------------------------------

// Messages received ahead of processing stop the clock: a server that takes 10 s over two
// queued messages never cuts their stream; the wait starts when the last one is processed.
TEST(PipelinedPace, MessagesInHandStopTheClock) {
  PipelinedPace p({/*idle_ms=*/1000, /*min_bytes_per_s=*/0, /*window_ms=*/30000});
  const Clock::time_point t0{};
  EXPECT_EQ(p.Deadline(), Clock::time_point::max());  // nothing processed yet
  ASSERT_TRUE(p.Received(t0, 100).ok());                // the header
  ASSERT_TRUE(p.Received(t0 + milliseconds(1), 100).ok());  // a part sent ahead
  EXPECT_EQ(p.in_hand(), 2u);
  p.Processed(t0 + milliseconds(5000));  // the header; the part is still in hand
  EXPECT_FALSE(p.waiting());
  EXPECT_EQ(p.Deadline(), Clock::time_point::max());
  EXPECT_TRUE(p.Expire(t0 + milliseconds(9000)).ok());
  p.Processed(t0 + milliseconds(10000));  // none left: the client is waited for
  EXPECT_TRUE(p.waiting());
  EXPECT_EQ(p.Deadline(), t0 + milliseconds(11000));
  ASSERT_TRUE(p.Received(t0 + milliseconds(10999), 100).ok());  // in time
  EXPECT_FALSE(p.waiting());
  p.Processed(t0 + milliseconds(12000));
  p.Processed(t0 + milliseconds(12500));  // none in hand: changes nothing
  EXPECT_EQ(p.in_hand(), 0u);
  EXPECT_EQ(p.Deadline(), t0 + milliseconds(13000));
  const absl::Status st = p.Expire(t0 + milliseconds(13000));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_idle_timeout_ms")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "nothing was committed")) << st;
}

// The gRPC trickle (StreamPace.ATrickleIsCutWhenAWindowClosesShort) sent one message at a
// time; pipelined, a client may send two at once each time: 2 x 300 bytes every 900 ms
// of waiting against 2000 bytes per 2 s window is still short, and cut by the same rule,
// however long the server takes over them.
TEST(PipelinedPace, APipelinedTrickleIsCutLikeAnyOther) {
  PipelinedPace p({/*idle_ms=*/1000, /*min_bytes_per_s=*/1000, /*window_ms=*/2000});
  Clock::time_point now{};
  ASSERT_TRUE(p.Received(now, 50).ok());  // the header
  now += milliseconds(3000);              // processing: not counted
  p.Processed(now);
  absl::Status st;
  int rounds = 0;
  for (; rounds < 10 && st.ok(); ++rounds) {
    ASSERT_TRUE(p.waiting());
    ASSERT_LE(p.Deadline(), now + milliseconds(1000));
    now += milliseconds(900);
    st = p.Received(now, 300);
    if (st.ok()) st = p.Received(now, 300);
    now += milliseconds(4000);  // both processed: not counted
    p.Processed(now);
    p.Processed(now);
  }
  // The header and 1200 bytes in the first two waits; the window's 2000 ms close during
  // the third, with the part that ends it counted in it.
  EXPECT_EQ(rounds, 3);
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(st.message(), "limits.stream_min_bytes_per_s")) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "1550 bytes in 2000 ms")) << st;
}

// --- CallExecutor ---------------------------------------------------------------------------

// A gate jobs wait at until it opens.
class Gate {
 public:
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

// Opens a gate when it goes out of scope: declared after the executor, it lets every job
// waiting at the gate finish before the executor is destroyed, whatever the test did.
struct OpenAtExit {
  Gate& gate;
  ~OpenAtExit() { gate.Open(); }
};

template <typename Pred>
bool WaitFor(Pred pred, milliseconds timeout = milliseconds(10000)) {
  const auto end = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(milliseconds(2));
  }
  return true;
}

TEST(CallExecutor, NeverRunsMoreThanItsCap) {
  Gate gate;
  std::atomic<int> running{0}, most{0}, done{0};
  CallExecutor ex({/*max_threads=*/3, /*keep_threads=*/3, milliseconds(30000)});
  OpenAtExit open{gate};
  for (int i = 0; i < 10; ++i) {
    ex.Submit(i % 2 ? "alpha" : "beta", [&] {
      const int now = ++running;
      int m = most.load();
      while (now > m && !most.compare_exchange_weak(m, now)) {
      }
      gate.Wait();
      --running;
      ++done;
    });
  }
  ASSERT_TRUE(WaitFor([&] { return running.load() == 3; }));
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_EQ(running.load(), 3);
  EXPECT_EQ(ex.counts().threads, 3u);
  EXPECT_EQ(ex.counts().queued, 7u);
  gate.Open();
  ASSERT_TRUE(WaitFor([&] { return done.load() == 10; }));
  EXPECT_EQ(most.load(), 3);
}

// One thread; alpha has five jobs queued behind its running one when beta's arrives:
// beta's runs after one more of alpha's, not after all of them.
TEST(CallExecutor, TenantsTakeTurns) {
  Gate gate;
  std::mutex mu;
  std::vector<std::string> order;
  CallExecutor ex({1, 1, milliseconds(30000)});
  OpenAtExit open{gate};
  auto job = [&](std::string name) {
    return [&, name] {
      if (name == "a1") gate.Wait();
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(name);
    };
  };
  ex.Submit("alpha", job("a1"));
  ASSERT_TRUE(WaitFor([&] { return ex.counts().busy == 1; }));
  for (int i = 2; i <= 5; ++i) ex.Submit("alpha", job("a" + std::to_string(i)));
  ex.Submit("beta", job("b1"));
  ex.Submit("beta", job("b2"));
  gate.Open();
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(mu);
    return order.size() == 7;
  }));
  EXPECT_EQ(order, (std::vector<std::string>{"a1", "a2", "b1", "a3", "b2", "a4", "a5"}));
}

// With a per-tenant call cap below the thread cap, the other tenants always find a thread:
// alpha's 3 stuck jobs (its cap) on 4 threads leave beta's jobs running.
TEST(CallExecutor, AStuckTenantLeavesAThreadToTheOthers) {
  TenantAdmission admission(/*max_calls=*/3, 0);
  Gate stuck;
  CallExecutor ex({4, 4, milliseconds(30000)});
  OpenAtExit open{stuck};
  int refused = 0;
  for (int i = 0; i < 5; ++i) {
    auto t = admission.Admit("Attend", "alpha", false);
    if (!t.ok()) {
      ++refused;
      continue;
    }
    ex.Submit("alpha", [&stuck, ticket = *std::move(t)]() mutable { stuck.Wait(); });
  }
  EXPECT_EQ(refused, 2);
  // beta's calls one after the other, as a client makes them: each is served.
  for (int i = 0; i < 20; ++i) {
    auto t = admission.Admit("GetSession", "beta", false);
    ASSERT_TRUE(t.ok()) << t.status();
    std::atomic<bool> done{false};
    ex.Submit("beta", [&done, ticket = *std::move(t)]() mutable {
      ticket.Reset();
      done = true;
    });
    ASSERT_TRUE(WaitFor([&] { return done.load(); }, milliseconds(5000))) << "beta's call " << i;
  }
  EXPECT_EQ(admission.calls("alpha"), 3u);
}

TEST(CallExecutor, WithoutACapThreadsStartOnDemandAndIdleOnesEnd) {
  Gate gate;
  std::atomic<int> running{0};
  CallExecutor ex({/*max_threads=*/0, /*keep_threads=*/1, milliseconds(50)});
  OpenAtExit open{gate};
  for (int i = 0; i < 12; ++i) {
    ex.Submit("default", [&] {
      ++running;
      gate.Wait();
    });
  }
  EXPECT_TRUE(WaitFor([&] { return running.load() == 12; }));  // all at once
  gate.Open();
  EXPECT_TRUE(WaitFor([&] { return ex.counts().threads == 1 && ex.counts().busy == 0; }));
  // The pool starts again after its threads ended.
  std::atomic<bool> ran{false};
  ex.Submit("default", [&] { ran = true; });
  EXPECT_TRUE(WaitFor([&] { return ran.load(); }));
}

TEST(CallExecutor, DestructionRunsWhatIsQueued) {
  std::atomic<int> done{0};
  {
    CallExecutor ex({1, 1, milliseconds(30000)});
    for (int i = 0; i < 5; ++i) {
      ex.Submit("t" + std::to_string(i % 2), [&] {
        std::this_thread::sleep_for(milliseconds(5));
        ++done;
      });
    }
  }
  EXPECT_EQ(done.load(), 5);
}

}  // namespace
}  // namespace admission_test
}  // namespace kvshade::service

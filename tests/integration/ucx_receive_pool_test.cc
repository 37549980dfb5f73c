// The UCX receive pool (transport/ucx_core.h ReceivePool): rendezvous payloads land in its
// pre-faulted buffers while one is free, byte for byte what was sent; a payload larger than
// a buffer, or one that finds every buffer held, gets an allocation of its own and counts
// a miss; eager (small) payloads never take a buffer; a buffer goes back to the pool when
// the message holding it is destroyed, also after the pool itself is gone.
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>

#include "gtest/gtest.h"
#include "harness.h"
#include "kvshade/transport/ucx_core.h"

namespace kvshade::integration {
namespace ucx_receive_pool_test {
namespace {

namespace ucx = transport::ucx;

TEST(ReceivePool, HandsOutEachBufferOnceAndTakesItBackWhenReleased) {
  KV_ASSERT_OK_AND_ASSIGN(pool, ucx::ReceivePool::Create(2, 100000));
  EXPECT_EQ(pool->buffers(), 2u);
  EXPECT_EQ(pool->buffer_bytes(), 100000u);
  std::shared_ptr<char> a = pool->Acquire(), b = pool->Acquire();
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_NE(a.get(), b.get());
  // Each buffer is writable over its whole size, and the two do not overlap.
  std::memset(a.get(), 0x11, 100000);
  std::memset(b.get(), 0x22, 100000);
  EXPECT_EQ(a.get()[99999], 0x11);
  EXPECT_EQ(pool->misses(), 0u);
  EXPECT_EQ(pool->Acquire(), nullptr);  // both held
  EXPECT_EQ(pool->misses(), 1u);
  a.reset();
  EXPECT_EQ(pool->free_buffers(), 1u);
  std::shared_ptr<char> c = pool->Acquire();
  ASSERT_NE(c, nullptr);
  // A buffer held past the pool stays valid and is unmapped only when it goes.
  pool.reset();
  std::memset(c.get(), 0x33, 100000);
  EXPECT_EQ(c.get()[0], 0x33);
  c.reset();
  b.reset();

  EXPECT_EQ(ucx::ReceivePool::Create(0, 4096).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ucx::ReceivePool::Create(4, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

// A (sender) and B (receiver with a pool of 2 x 1 MiB), two workers of this process; B's
// handler keeps every message until the test drops it.
class PooledReceive : public ::testing::TestWithParam<const char*> {
 protected:
  static constexpr size_t kBuffer = size_t{1} << 20;

  void SetUp() override {
    std::map<unsigned, ucx::UcxLoop::Handler> hb;
    hb[1] = [this](ucx::AmMessage&& m) {
      std::lock_guard<std::mutex> lock(mu_);
      got_.push_back(std::move(m));
      cv_.notify_all();
    };
    KV_ASSERT_OK_AND_ASSIGN(b, ucx::UcxLoop::Start(GetParam(), std::move(hb)));
    b_ = std::move(b);
    KV_ASSERT_OK_AND_ASSIGN(pool, ucx::ReceivePool::Create(2, kBuffer));
    pool_ = pool;
    KV_ASSERT_OK(b_->CallStatus([&] {
      b_->set_receive_pool(pool_);
      return absl::OkStatus();
    }));
    KV_ASSERT_OK_AND_ASSIGN(a, ucx::UcxLoop::Start(GetParam(), {}));
    a_ = std::move(a);
    const std::string addr = b_->address();
    KV_ASSERT_OK(a_->CallStatus([&]() -> absl::Status {
      auto ep = ucx::UcxEndpoint::Connect(a_->worker(), addr);
      if (!ep.ok()) return ep.status();
      ep_ = *std::move(ep);
      return absl::OkStatus();
    }));
  }
  void TearDown() override {
    if (a_) a_->Stop([this] { ep_.reset(); });
    if (b_) b_->Stop();
    got_.clear();
  }

  // Sends `bytes` as a payload gathered from the caller's buffer (rendezvous above 64 KiB,
  // as the client sends ingest parts) and returns the message B received.
  ucx::AmMessage SendAndReceive(const std::string& bytes) {
    std::unique_lock<std::mutex> lock(mu_);
    const size_t before = got_.size() + taken_;
    lock.unlock();
    EXPECT_TRUE(a_->CallStatus([&] {
                      return a_->SendIov(ep_->get(), 1, "h", {{bytes.data(), bytes.size()}});
                    }).ok());
    lock.lock();
    EXPECT_TRUE(cv_.wait_for(lock, std::chrono::seconds(60),
                             [&] { return got_.size() + taken_ > before; }));
    ucx::AmMessage m = std::move(got_.front());
    got_.pop_front();
    ++taken_;
    return m;
  }

  static std::string Pattern(size_t n, int seed) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
    return s;
  }

  std::unique_ptr<ucx::UcxLoop> a_, b_;
  std::unique_ptr<ucx::UcxEndpoint> ep_;  // A's thread only
  std::shared_ptr<ucx::ReceivePool> pool_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ucx::AmMessage> got_;
  size_t taken_ = 0;
};

TEST_P(PooledReceive, LargePayloadsLandInPoolBuffersUntilNoneIsFree) {
  // Two rendezvous payloads take the two buffers, bytes intact.
  const std::string p1 = Pattern(600000, 1), p2 = Pattern(kBuffer, 2);
  ucx::AmMessage m1 = SendAndReceive(p1);
  ucx::AmMessage m2 = SendAndReceive(p2);
  EXPECT_TRUE(m1.payload.pooled());
  EXPECT_TRUE(m2.payload.pooled());
  EXPECT_EQ(m1.payload.view(), p1);
  EXPECT_EQ(m2.payload.view(), p2);
  EXPECT_EQ(m1.header, "h");
  EXPECT_EQ(pool_->free_buffers(), 0u);
  EXPECT_EQ(pool_->misses(), 0u);

  // Both held: the next one gets its own allocation (a miss), bytes intact.
  const std::string p3 = Pattern(300000, 3);
  ucx::AmMessage m3 = SendAndReceive(p3);
  EXPECT_FALSE(m3.payload.pooled());
  EXPECT_EQ(m3.payload.view(), p3);
  EXPECT_EQ(pool_->misses(), 1u);

  // Larger than a buffer: its own allocation, a miss, even with buffers free.
  m1 = ucx::AmMessage();
  m2 = ucx::AmMessage();
  EXPECT_EQ(pool_->free_buffers(), 2u);
  const std::string p4 = Pattern(kBuffer + 1, 4);
  ucx::AmMessage m4 = SendAndReceive(p4);
  EXPECT_FALSE(m4.payload.pooled());
  EXPECT_EQ(m4.payload.view(), p4);
  EXPECT_EQ(pool_->misses(), 2u);

  // Eager (small) payloads never take a buffer and are no miss.
  const std::string p5 = Pattern(1000, 5);
  ucx::AmMessage m5 = SendAndReceive(p5);
  EXPECT_FALSE(m5.payload.pooled());
  EXPECT_EQ(m5.payload.view(), p5);
  EXPECT_EQ(pool_->misses(), 2u);

  // A released buffer is used again, and its new contents are the new message's.
  const std::string p6 = Pattern(700000, 6);
  ucx::AmMessage m6 = SendAndReceive(p6);
  EXPECT_TRUE(m6.payload.pooled());
  EXPECT_EQ(m6.payload.view(), p6);
  // TakeString copies a pooled payload out and gives the buffer back.
  EXPECT_EQ(std::move(m6.payload).TakeString(), p6);
  EXPECT_EQ(pool_->free_buffers(), 2u);
}

INSTANTIATE_TEST_SUITE_P(Transports, PooledReceive, ::testing::Values("tcp,self", "shm,self"),
                         [](const auto& info) {
                           return std::string(info.param).substr(0, 3);
                         });

}  // namespace
}  // namespace ucx_receive_pool_test
}  // namespace kvshade::integration

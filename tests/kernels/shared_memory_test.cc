// Shared host memory's descriptor broker (kernels/shared_memory.h): a worker takes a
// region's descriptor over the daemon's Unix socket (SCM_RIGHTS) and maps the same pages,
// needing neither /proc/<pid>/fd nor pidfd_getfd; bad requests and unknown regions get
// clear errors and leave the broker serving.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvshade/kernels/shared_memory.h"

namespace kvshade::kernels {
namespace shared_memory_test {
namespace {

constexpr int64_t kNoSuchProcess = 0x3fffffff;

std::string FreshAbstractName() {
  static std::atomic<int> n{0};
  return absl::StrCat("@kvshade-test-", getpid(), "-", n++);
}

struct Region {
  Buffer buf;
  ExportedMemory m;
};

Region MakeRegion(size_t bytes) {
  Region r;
  auto buf = AllocateSharedHost(bytes);
  EXPECT_TRUE(buf.ok()) << buf.status();
  r.buf = *std::move(buf);
  auto* p = static_cast<unsigned char*>(r.buf.data());
  for (size_t i = 0; i < bytes; ++i) p[i] = static_cast<unsigned char>(i * 7 + 1);
  auto m = ExportSharedHost(p);
  EXPECT_TRUE(m.has_value());
  r.m = *m;
  return r;
}

TEST(DescriptorBroker, AWorkerMapsTheSameBytesThroughItWithoutProc) {
  auto broker = DescriptorBroker::Start(FreshAbstractName());
  ASSERT_TRUE(broker.ok()) << broker.status();
  Region r = MakeRegion(1 << 20);
  EXPECT_EQ(r.m.broker, (*broker)->address());
  // No /proc path can work for this pid: only the broker can hand the descriptor over.
  r.m.pid = kNoSuchProcess;
  auto im = MapSharedHostRegion(r.m);
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_NE(im->base, r.buf.data());
  EXPECT_EQ(std::memcmp(im->base, r.buf.data(), 1 << 20), 0);
  static_cast<unsigned char*>(im->base)[12345] = 0xab;  // one memory, two mappings
  EXPECT_EQ(static_cast<unsigned char*>(r.buf.data())[12345], 0xab);
  UnmapSharedHostRegion(*im);
}

TEST(DescriptorBroker, AnUnknownRegionIsRefusedNamingBothWays) {
  auto broker = DescriptorBroker::Start(FreshAbstractName());
  ASSERT_TRUE(broker.ok()) << broker.status();
  Region r = MakeRegion(4096);
  r.m.region_id += 1000000;
  r.m.pid = kNoSuchProcess;
  auto fd = TakeSharedDescriptor(r.m);
  ASSERT_FALSE(fd.ok());
  const std::string msg(fd.status().message());
  EXPECT_NE(msg.find("shares no region"), std::string::npos) << msg;
  EXPECT_NE(msg.find("/proc/"), std::string::npos) << msg;
}

TEST(DescriptorBroker, AnUnreachableBrokerFallsBackToProc) {
  Region r = MakeRegion(4096);
  r.m.broker = FreshAbstractName();  // nobody listens there
  auto im = MapSharedHostRegion(r.m);
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(std::memcmp(im->base, r.buf.data(), 4096), 0);
  UnmapSharedHostRegion(*im);
}

TEST(DescriptorBroker, ExportsNameNoBrokerOnceItStops) {
  {
    auto broker = DescriptorBroker::Start(FreshAbstractName());
    ASSERT_TRUE(broker.ok()) << broker.status();
  }
  Region r = MakeRegion(4096);
  EXPECT_EQ(r.m.broker, "");
}

TEST(DescriptorBroker, ASocketPathIsPrivateAndRemovedAndAFileIsNotReplaced) {
  const std::string dir = ::testing::TempDir();
  const std::string path = absl::StrCat(dir, "kvshade-broker-", getpid(), ".sock");
  {
    auto broker = DescriptorBroker::Start(path);
    ASSERT_TRUE(broker.ok()) << broker.status();
    struct stat st;
    ASSERT_EQ(lstat(path.c_str(), &st), 0);
    EXPECT_TRUE(S_ISSOCK(st.st_mode));
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    Region r = MakeRegion(4096);
    r.m.pid = kNoSuchProcess;
    auto fd = TakeSharedDescriptor(r.m);
    ASSERT_TRUE(fd.ok()) << fd.status();
    close(*fd);
    // A second daemon on the same path does not take the socket of a live one.
    auto second = DescriptorBroker::Start(path);
    ASSERT_FALSE(second.ok());
    EXPECT_NE(second.status().message().find("another process serves"), std::string::npos)
        << second.status();
    EXPECT_EQ(lstat(path.c_str(), &st), 0);
  }
  struct stat st;
  EXPECT_NE(lstat(path.c_str(), &st), 0);  // removed
  {
    // A socket file nobody listens on (a daemon killed with -9) is replaced.
    const int stale = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
    ASSERT_EQ(bind(stale, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
    close(stale);
    ASSERT_EQ(lstat(path.c_str(), &st), 0);
    auto again = DescriptorBroker::Start(path);
    ASSERT_TRUE(again.ok()) << again.status();
  }
  const std::string file = absl::StrCat(dir, "kvshade-broker-", getpid(), ".txt");
  std::ofstream(file) << "not a socket";
  auto refused = DescriptorBroker::Start(file);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("not a socket"), std::string::npos);
  EXPECT_EQ(lstat(file.c_str(), &st), 0);  // left alone
  unlink(file.c_str());
  for (const std::string& bad : {std::string(), std::string("@"), "@" + std::string(200, 'x')}) {
    auto b = DescriptorBroker::Start(bad);
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(DescriptorBroker, GarbageGetsAnErrorAndTheBrokerKeepsServing) {
  auto broker = DescriptorBroker::Start(FreshAbstractName());
  ASSERT_TRUE(broker.ok()) << broker.status();
  const std::string name = (*broker)->address();
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path + 1, name.data() + 1, name.size() - 1);
  const socklen_t len = socklen_t(offsetof(sockaddr_un, sun_path) + name.size());
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&a), len), 0) << std::strerror(errno);
  const char junk[16] = "not a request!!";
  ASSERT_EQ(send(fd, junk, sizeof junk, MSG_NOSIGNAL), ssize_t(sizeof junk));
  uint32_t answer[2] = {0, 0};
  ASSERT_EQ(recv(fd, answer, sizeof answer, MSG_WAITALL), ssize_t(sizeof answer));
  EXPECT_EQ(answer[0], uint32_t(absl::StatusCode::kInvalidArgument));
  close(fd);
  // A client that connects and says nothing holds the broker for at most its timeout.
  const int idle = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(connect(idle, reinterpret_cast<const sockaddr*>(&a), len), 0);
  Region r = MakeRegion(4096);
  r.m.pid = kNoSuchProcess;
  auto got = TakeSharedDescriptor(r.m);
  ASSERT_TRUE(got.ok()) << got.status();
  close(*got);
  close(idle);
}

TEST(DescriptorBroker, AnotherUserIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a child as another user";
  auto broker = DescriptorBroker::Start(FreshAbstractName());
  ASSERT_TRUE(broker.ok()) << broker.status();
  Region r = MakeRegion(4096);
  r.m.pid = kNoSuchProcess;
  int pipefd[2];
  ASSERT_EQ(pipe(pipefd), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pipefd[0]);
    // The answer as text: "ok", or the error message (setuid failures included).
    std::string answer = "setuid to 65534 failed";
    if (setgid(65534) == 0 && setuid(65534) == 0) {
      auto fd = TakeSharedDescriptor(r.m);
      answer = fd.ok() ? "ok" : std::string(fd.status().message());
    }
    [[maybe_unused]] ssize_t w = write(pipefd[1], answer.data(), answer.size());
    _exit(0);
  }
  close(pipefd[1]);
  std::string answer;
  char buf[512];
  for (ssize_t got; (got = read(pipefd[0], buf, sizeof buf)) > 0;) answer.append(buf, size_t(got));
  close(pipefd[0]);
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_NE(answer.find("processes of uid 0; this one runs as uid 65534"), std::string::npos)
      << answer;
}

}  // namespace
}  // namespace shared_memory_test
}  // namespace kvshade::kernels

// Integration: storage faults under the real daemon (docs/OPERATIONS.md "Storage faults").
// A spill disk that fills up, or a spill file that may not grow (RLIMIT_FSIZE, EFBIG: an
// I/O error other than a full disk), must never take the daemon down: the affected
// durable commits fail with RESOURCE_EXHAUSTED / UNAVAILABLE, every other session keeps
// working, the fault is logged and counted in /metrics, and what was acknowledged comes
// back after a restart.
//
// The full disk is a real tmpfs, which needs the right to mount (root in the build
// container); elsewhere that test skips and the storage unit tests (SpillTierFaults, a
// simulated full disk under RocksDB's file system) cover the same paths.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace storage_fault_test {
namespace {

// The defect report's model: 2 layers, 4 query heads, 2 KV heads, head dim 64.
synthetic::DocSpec Doc64(int64_t tokens, uint64_t seed) {
  synthetic::DocSpec s = SmallDoc(tokens, seed);
  s.head_dim = 64;
  return s;
}

// Writes a file into `dir` until the file system says ENOSPC.
void FillDisk(const std::string& dir) {
  const int fd = open((dir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << strerror(errno);
  std::vector<char> block(64 << 10, 'x');
  ssize_t n = 0;
  while ((n = write(fd, block.data(), block.size())) > 0) {
  }
  const int err = errno;
  close(fd);
  ASSERT_EQ(err, ENOSPC) << strerror(err);
}

// The value of the first /metrics sample line starting with `prefix`; -1 when absent.
double Metric(const ServerProcess& server, const std::string& prefix) {
  auto body = HttpGet(server.metrics_port(), "/metrics");
  if (!body.ok()) return -1;
  for (size_t at = body->find(prefix); at != std::string::npos; at = body->find(prefix, at + 1)) {
    if (at != 0 && (*body)[at - 1] != '\n') continue;
    const size_t space = body->find(' ', at + prefix.size());
    if (space == std::string::npos) return -1;
    return std::atof(body->c_str() + space + 1);
  }
  return -1;
}

// One decode step of `sid`: the session is served.
absl::Status Decode(client::Client& c, const synthetic::Document& doc, const std::string& sid,
                    int64_t position) {
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("fault-test");
  auto a = c.Attach(ar);
  if (!a.ok()) return a.status();
  auto r = c.SelectAndReconstruct(MakeSelect(doc, 1, {a->attachment_id()}, 0, 1, position));
  c.Detach(a->attachment_id()).IgnoreError();
  if (!r.ok()) return r.status();
  if (r->deltas_size() != 1 || r->deltas(0).selected() == 0) {
    return absl::InternalError("no chunk selected");
  }
  return absl::OkStatus();
}

// Retries a durable create + ingest until it succeeds or 30 s pass.
absl::StatusOr<v1::CreateSessionResponse> RetryDurable(client::Client& c, const synthetic::Document& doc,
                                                       int question) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  absl::StatusOr<v1::CreateSessionResponse> r;
  do {
    r = CreateAndIngest(c, doc, ShadowProfile(), question, /*durable=*/true);
    if (r.ok()) return r;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  } while (std::chrono::steady_clock::now() < deadline);
  return r;
}

class Tmpfs {
 public:
  Tmpfs(const std::string& path, const std::string& size) : path_(path) {
    mkdir(path.c_str(), 0755);
    mounted_ = mount("tmpfs", path.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
    if (!mounted_) error_ = strerror(errno);
  }
  ~Tmpfs() {
    if (mounted_) umount2(path_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_;
  bool mounted_ = false;
  std::string error_;
};

TEST(StorageFaults, FullSpillDiskFailsDurableCommitsAndTheDaemonKeepsServing) {
  TempDir dir;
  const std::string fs = dir.path() + "/fs";
  Tmpfs tmpfs(fs, "16m");
  if (!tmpfs.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (" << tmpfs.error() << ")";
  const std::vector<std::string> args = {"--spill-path", fs + "/rocks"};
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  auto c = server.Connect();
  const synthetic::Document doc(Doc64(1024, 7)), other(Doc64(1024, 8));
  KV_ASSERT_OK_AND_ASSIGN(durable, CreateAndIngest(*c, doc, ShadowProfile(), -1, /*durable=*/true));
  KV_ASSERT_OK_AND_ASSIGN(transient, CreateAndIngest(*c, other, ShadowProfile(), -1, /*durable=*/false));

  FillDisk(fs);
  auto refused = CreateAndIngest(*c, doc, ShadowProfile(), 1, /*durable=*/true);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "No space left on device"))
      << refused.status();
  // A second one while writes are stopped: the same answer, and the daemon is still up.
  auto again = CreateAndIngest(*c, doc, ShadowProfile(), 2, /*durable=*/true);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kResourceExhausted) << again.status();
  ASSERT_TRUE(server.running());
  // Everything else is served: both sessions decode, new non-durable sessions work.
  KV_ASSERT_OK(Decode(*c, doc, durable.session_id(), 1024));
  KV_ASSERT_OK(Decode(*c, other, transient.session_id(), 1024));
  KV_ASSERT_OK_AND_ASSIGN(fresh, CreateAndIngest(*c, other, ShadowProfile(), 1, /*durable=*/false));
  KV_ASSERT_OK(Decode(*c, other, fresh.session_id(), 1024));
  KV_ASSERT_OK(c->Stats().status());
  // Reported: log and metrics.
  EXPECT_GE(Metric(server, "kvshade_spill_write_failures_total{reason=\"no_space\"}"), 1);
  EXPECT_EQ(Metric(server, "kvshade_spill_writes_stopped"), 1);
  EXPECT_TRUE(absl::StrContains(server.log(), "storage fault")) << server.log();

  // Space returns: durable commits succeed again.
  ASSERT_EQ(unlink((fs + "/filler").c_str()), 0);
  KV_ASSERT_OK_AND_ASSIGN(late, RetryDurable(*c, doc, 3));
  EXPECT_EQ(Metric(server, "kvshade_spill_writes_stopped"), 0);

  // What was acknowledged survives a kill -9; the non-durable sessions do not.
  server.Kill9();
  ServerProcess restarted;
  KV_ASSERT_OK(restarted.Start(args));
  auto c2 = restarted.Connect();
  for (const auto* s : {&durable, &late}) {
    KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(s->session_id()));
    EXPECT_EQ(info.state(), "ready");
  }
  KV_ASSERT_OK(Decode(*c2, doc, late.session_id(), 1024 + doc.spec().question_tokens));
  EXPECT_EQ(c2->GetSession(transient.session_id()).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(restarted.Stop(), 0) << restarted.log();
}

// The pid of the kvshade-server listening on `port` (its --listen argument).
pid_t ServerPid(int port) {
  const std::string want = "127.0.0.1:" + std::to_string(port);
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(std::string("--listen") + '\0' + want + '\0') != std::string::npos) {
      return static_cast<pid_t>(std::stol(name));
    }
  }
  return -1;
}

// RLIMIT_FSIZE set on the running daemon (prlimit, same user, no root): a WAL record over
// the limit fails with EFBIG, an I/O error other than a full disk. Small budgets keep the
// daemon's later memory files (host slabs) under the limit, and the device tier (a memory
// file on the cpu backend) is reserved at start (--device-growth 0), before the limit.
TEST(StorageFaults, SpillFileSizeLimitFailsDurableCommitsWithUnavailable) {
  TempDir dir;
  const std::vector<std::string> args = {"--spill-path", dir.path() + "/rocks", "--device-budget",
                                         "256MiB", "--device-growth", "0", "--host-budget", "8MiB"};
  ServerProcess server;
  KV_ASSERT_OK(server.Start(args));
  const pid_t pid = ServerPid(server.port());
  ASSERT_GT(pid, 0);
  struct rlimit limit;
  limit.rlim_cur = limit.rlim_max = 3 << 20;  // a 512-token session's WAL record fits, 8192 not
  ASSERT_EQ(prlimit(pid, RLIMIT_FSIZE, &limit, nullptr), 0) << strerror(errno);

  auto c = server.Connect();
  const synthetic::Document small(Doc64(512, 7)), big(Doc64(8192, 9)), other(Doc64(1024, 8));
  KV_ASSERT_OK_AND_ASSIGN(durable, CreateAndIngest(*c, small, ShadowProfile(), -1, /*durable=*/true));
  KV_ASSERT_OK_AND_ASSIGN(transient, CreateAndIngest(*c, other, ShadowProfile(), -1, /*durable=*/false));
  auto refused = CreateAndIngest(*c, big, ShadowProfile(), -1, /*durable=*/true);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "File too large")) << refused.status();
  ASSERT_TRUE(server.running()) << server.log();
  // After an I/O error RocksDB stays read-only: later durable commits are refused too,
  // while everything else is served.
  auto later = CreateAndIngest(*c, small, ShadowProfile(), 1, /*durable=*/true);
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable) << later.status();
  KV_ASSERT_OK(Decode(*c, small, durable.session_id(), 512));
  KV_ASSERT_OK(Decode(*c, other, transient.session_id(), 1024));
  EXPECT_GE(Metric(server, "kvshade_spill_write_failures_total{reason=\"io_error\"}"), 1);
  EXPECT_EQ(Metric(server, "kvshade_spill_writes_stopped"), 1);
  EXPECT_TRUE(absl::StrContains(server.log(), "storage fault")) << server.log();

  // A restart without the limit: the acknowledged session is back, and durable commits work.
  server.Kill9();
  ServerProcess restarted;
  KV_ASSERT_OK(restarted.Start(args));
  auto c2 = restarted.Connect();
  KV_ASSERT_OK_AND_ASSIGN(info, c2->GetSession(durable.session_id()));
  EXPECT_EQ(info.state(), "ready");
  KV_ASSERT_OK(Decode(*c2, small, durable.session_id(), 512));
  KV_ASSERT_OK(CreateAndIngest(*c2, small, ShadowProfile(), 1, /*durable=*/true).status());
  EXPECT_EQ(restarted.Stop(), 0) << restarted.log();
}

}  // namespace
}  // namespace storage_fault_test
}  // namespace kvshade::integration

// Shared host memory: memfd-backed allocations and the process-wide table that names them
// (shared_memory.h).
#include "kvshade/kernels/shared_memory.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, SharedHostRegion> by_base;  // keyed by base address
  std::atomic<uint64_t> next_id{1};
  std::string broker;  // the running DescriptorBroker's address, "" for none
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: buffers may outlive statics
  return *r;
}

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace

absl::StatusOr<Buffer> AllocateSharedHost(size_t bytes, std::function<void(void*)> on_release) {
  if (bytes == 0) return Buffer();
  const size_t mapped = PageRound(bytes);
  const int fd = memfd_create("kvshade", MFD_CLOEXEC);
  if (fd < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("memfd_create for ", bytes, " shared bytes: ", std::strerror(errno)));
  }
  if (ftruncate(fd, static_cast<off_t>(mapped)) != 0) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("ftruncate of a ", mapped, "-byte memory file: ", std::strerror(err)));
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of a ", mapped, "-byte memory file: ", std::strerror(err)));
  }
  RegisterSharedHost(ExportedMemory::Kind::kHostFile, fd, p, mapped);
  return Buffer(p, bytes, [mapped, fd, on_release = std::move(on_release)](void* q) {
    if (on_release) on_release(q);
    UnregisterSharedHost(q);
    munmap(q, mapped);
    close(fd);
  });
}

uint64_t RegisterSharedHost(ExportedMemory::Kind kind, int fd, void* base, size_t bytes) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const uint64_t id = r.next_id++;
  r.by_base[reinterpret_cast<uintptr_t>(base)] = SharedHostRegion{id, fd, base, bytes, kind};
  return id;
}

void UnregisterSharedHost(const void* base) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.by_base.erase(reinterpret_cast<uintptr_t>(base));
}

std::optional<SharedHostRegion> FindSharedHostRegion(const void* p) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = r.by_base.upper_bound(a);
  if (it == r.by_base.begin()) return std::nullopt;
  --it;
  const SharedHostRegion& reg = it->second;
  if (a >= it->first + reg.bytes) return std::nullopt;
  return reg;
}

std::optional<ExportedMemory> ExportSharedHost(const void* p) {
  std::optional<SharedHostRegion> r = FindSharedHostRegion(p);
  if (!r) return std::nullopt;
  ExportedMemory m;
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    m.broker = reg.broker;
  }
  m.kind = r->kind;
  m.region_id = r->id;
  m.pid = getpid();
  m.fd = r->fd;
  m.region_bytes = r->bytes;
  m.offset = static_cast<size_t>(static_cast<const char*>(p) - static_cast<const char*>(r->base));
  return m;
}

absl::StatusOr<ImportedMemory> MapSharedHostRegion(const ExportedMemory& m) {
  if (m.kind != ExportedMemory::Kind::kHostFile) {
    return absl::InvalidArgumentError("MapSharedHostRegion: not a host memory file");
  }
  KVSHADE_ASSIGN_OR_RETURN(const int fd, TakeSharedDescriptor(m));
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < m.region_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        "the daemon's shared memory region ", m.region_id, " is not the exported region (size ",
        st.st_size, ", expected ", m.region_bytes, "): the daemon may have restarted"));
  }
  void* p = mmap(nullptr, m.region_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of ", m.region_bytes, " shared bytes: ", std::strerror(err)));
  }
  return ImportedMemory{ExportedMemory::Kind::kHostFile, p, m.region_bytes};
}

void UnmapSharedHostRegion(const ImportedMemory& m) {
  if (m.base != nullptr) munmap(m.base, m.bytes);
}

// --- descriptors: the broker, and the ways a worker takes one ---

namespace {

constexpr uint32_t kBrokerMagic = 0x4b565344;  // "KVSD"
constexpr uint32_t kBrokerVersion = 1;
constexpr size_t kMaxBrokerMessage = 1024;

// A request: magic, version, region id (host order: both ends are on this node).
struct BrokerRequest {
  uint32_t magic;
  uint32_t version;
  uint64_t region_id;
};
// An answer: a status code and the length of the message that follows; on success the
// descriptor rides with these bytes (SCM_RIGHTS).
struct BrokerAnswer {
  uint32_t code;
  uint32_t message_bytes;
};

absl::StatusOr<sockaddr_un> BrokerAddress(const std::string& address, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  const bool abstract = !address.empty() && address[0] == '@';
  const size_t n = address.size();
  if (address.empty() || (abstract && n < 2) || n >= sizeof(a.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "descriptor broker address must be a socket path or @name of 1 to ",
        sizeof(a.sun_path) - 2, " characters, got '", address, "'"));
  }
  std::memcpy(a.sun_path, address.data(), n);
  if (abstract) a.sun_path[0] = '\0';  // abstract: no file, not NUL-terminated
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + n + (abstract ? 0 : 1));
  return a;
}

void SetTimeouts(int fd, int seconds) {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

bool SendAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= size_t(w);
  }
  return true;
}

bool RecvAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= size_t(r);
  }
  return true;
}

// The answer's fixed part, with `fd` attached when >= 0, then its message.
void SendAnswer(int conn, absl::StatusCode code, std::string_view message, int fd) {
  const BrokerAnswer a{static_cast<uint32_t>(code),
                       static_cast<uint32_t>(std::min(message.size(), kMaxBrokerMessage))};
  iovec iov{const_cast<BrokerAnswer*>(&a), sizeof a};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  ssize_t w;
  do {
    w = sendmsg(conn, &msg, MSG_NOSIGNAL);
  } while (w < 0 && errno == EINTR);
  if (w != static_cast<ssize_t>(sizeof a)) return;
  SendAll(conn, message.data(), a.message_bytes);
}

absl::StatusOr<int> TakeFromBroker(const ExportedMemory& m) {
  socklen_t len = 0;
  KVSHADE_ASSIGN_OR_RETURN(const sockaddr_un addr, BrokerAddress(m.broker, &len));
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  SetTimeouts(fd, 5);
  auto fail = [&](const std::string& what) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
  };
  if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0) return fail("connect");
  const BrokerRequest req{kBrokerMagic, kBrokerVersion, m.region_id};
  // A broker that refuses may close before all of it is read: its answer is read anyway.
  const bool sent = SendAll(fd, &req, sizeof req);
  const int send_errno = errno;
  BrokerAnswer a{};
  iovec iov{&a, sizeof a};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t r;
  do {
    r = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (r < 0 && errno == EINTR);
  if (r != static_cast<ssize_t>(sizeof a)) {
    if (!sent) {
      errno = send_errno;
      return fail("send");
    }
    if (r >= 0) errno = EPROTO;
    return fail("no answer");
  }
  int got = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len >= CMSG_LEN(sizeof(int))) {
      std::memcpy(&got, CMSG_DATA(c), sizeof got);
    }
  }
  std::string message(std::min<size_t>(a.message_bytes, kMaxBrokerMessage), '\0');
  const bool have_message = RecvAll(fd, message.data(), message.size());
  close(fd);
  if (a.code != 0 || got < 0) {
    if (got >= 0) close(got);
    if (a.code == 0) return absl::InternalError("the answer carried no descriptor");
    const auto code = a.code <= static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)
                          ? static_cast<absl::StatusCode>(a.code)
                          : absl::StatusCode::kUnknown;
    return absl::Status(code, have_message ? message : "(no message)");
  }
  return got;
}

absl::StatusOr<int> OpenViaProc(const ExportedMemory& m) {
  const std::string path = absl::StrCat("/proc/", m.pid, "/fd/", m.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot open the daemon's shared memory ", path, ": ", std::strerror(errno),
        " (same-node decode needs the worker on the daemon's node, under the daemon's user, "
        "in its PID namespace)"));
  }
  return fd;
}

absl::StatusOr<int> TakeViaPidfd(const ExportedMemory& m) {
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(m.pid), 0));
  if (pidfd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot reach the daemon process ", m.pid, ": pidfd_open: ", std::strerror(errno),
        " (same-node decode needs the worker on the daemon's node, in its PID namespace)"));
  }
  const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, m.fd, 0));
  const int err = errno;
  close(pidfd);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot take the daemon's host memory descriptor (pidfd_getfd of fd ", m.fd, " in pid ",
        m.pid, "): ", std::strerror(err),
        " (the worker needs ptrace access to the daemon: the same user with Yama "
        "ptrace_scope 0, or the daemon started by the worker, or CAP_SYS_PTRACE; otherwise "
        "run the daemon with same_node.host_memory: file)"));
  }
  return fd;
}

}  // namespace

absl::StatusOr<int> TakeSharedDescriptor(const ExportedMemory& m) {
  if (m.kind != ExportedMemory::Kind::kHostFile && m.kind != ExportedMemory::Kind::kHostVmm) {
    return absl::InvalidArgumentError("TakeSharedDescriptor: not host memory");
  }
  absl::Status broker = absl::OkStatus();
  if (!m.broker.empty()) {
    absl::StatusOr<int> fd = TakeFromBroker(m);
    if (fd.ok()) return fd;
    broker = fd.status();
  }
  absl::StatusOr<int> fd =
      m.kind == ExportedMemory::Kind::kHostVmm ? TakeViaPidfd(m) : OpenViaProc(m);
  if (fd.ok() || broker.ok()) return fd;
  return absl::Status(fd.status().code(),
                      absl::StrCat("the daemon's descriptor broker ", m.broker, " refused: ",
                                   broker.message(), "; and ", fd.status().message()));
}

absl::StatusOr<std::unique_ptr<DescriptorBroker>> DescriptorBroker::Start(
    const std::string& address) {
  socklen_t len = 0;
  KVSHADE_ASSIGN_OR_RETURN(const sockaddr_un addr, BrokerAddress(address, &len));
  const bool abstract = address[0] == '@';
  if (!abstract) {
    struct stat st;
    if (lstat(address.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode)) {
        return absl::FailedPreconditionError(absl::StrCat(
            "descriptor broker: ", address, " exists and is not a socket"));
      }
      // A socket left by an earlier run is replaced; one a live process answers on is not.
      const int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      const bool live =
          probe >= 0 && connect(probe, reinterpret_cast<const sockaddr*>(&addr), len) == 0;
      if (probe >= 0) close(probe);
      if (live) {
        return absl::FailedPreconditionError(absl::StrCat(
            "descriptor broker: another process serves ", address));
      }
      unlink(address.c_str());
    }
  }
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("socket: ", std::strerror(errno)));
  if (bind(fd, reinterpret_cast<const sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    const int err = errno;
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("descriptor broker: cannot listen on ", address, ": ", std::strerror(err)));
  }
  if (!abstract) chmod(address.c_str(), 0600);  // the daemon's user only (root aside)
  const int stop = eventfd(0, EFD_CLOEXEC);
  if (stop < 0) {
    const int err = errno;
    close(fd);
    if (!abstract) unlink(address.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("eventfd: ", std::strerror(err)));
  }
  std::unique_ptr<DescriptorBroker> b(new DescriptorBroker(address, fd, stop));
  try {
    b->thread_ = std::thread([p = b.get()] { p->Serve(); });
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(absl::StrCat("descriptor broker thread: ", e.what()));
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.broker = address;
  return b;
}

DescriptorBroker::DescriptorBroker(std::string address, int listen_fd, int stop_fd)
    : address_(std::move(address)), listen_fd_(listen_fd), stop_fd_(stop_fd) {}

DescriptorBroker::~DescriptorBroker() {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    if (r.broker == address_) r.broker.clear();
  }
  if (thread_.joinable()) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t w = write(stop_fd_, &one, sizeof one);
    thread_.join();
  }
  close(listen_fd_);
  close(stop_fd_);
  if (address_[0] != '@') unlink(address_.c_str());
}

void DescriptorBroker::Serve() {
  for (;;) {
    pollfd p[2] = {{listen_fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (p[1].revents != 0) return;
    if ((p[0].revents & POLLIN) == 0) continue;
    const int conn = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    SetTimeouts(conn, 1);
    Answer(conn);
    close(conn);
  }
}

void DescriptorBroker::Answer(int conn) {
  // The request is read first, whoever sent it, so that the sender's write completes and
  // it reads the answer instead of a broken pipe.
  BrokerRequest req{};
  if (!RecvAll(conn, &req, sizeof req) || req.magic != kBrokerMagic ||
      req.version != kBrokerVersion) {
    SendAnswer(conn, absl::StatusCode::kInvalidArgument,
               absl::StrCat("not a descriptor request of version ", kBrokerVersion), -1);
    return;
  }
  ucred peer{};
  socklen_t len = sizeof peer;
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &peer, &len) != 0) {
    SendAnswer(conn, absl::StatusCode::kInternal, "SO_PEERCRED failed", -1);
    return;
  }
  const uid_t self = geteuid();
  if (peer.uid != self && peer.uid != 0) {
    SendAnswer(conn, absl::StatusCode::kPermissionDenied,
               absl::StrCat("the daemon's shared memory is for processes of uid ", self,
                            "; this one runs as uid ", peer.uid),
               -1);
    return;
  }
  int fd = -1, err = 0;
  bool found = false;
  {
    // Duplicated under the table's lock: a region is unregistered before its descriptor
    // is closed, so a found descriptor still names the region.
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [base, reg] : r.by_base) {
      if (reg.id == req.region_id) {
        found = true;
        fd = fcntl(reg.fd, F_DUPFD_CLOEXEC, 0);
        err = errno;
        break;
      }
    }
  }
  if (found && fd < 0) {
    SendAnswer(conn, absl::StatusCode::kResourceExhausted,
               absl::StrCat("the daemon cannot duplicate a descriptor: ", std::strerror(err)), -1);
    return;
  }
  if (!found) {
    SendAnswer(conn, absl::StatusCode::kNotFound,
               absl::StrCat("process ", getpid(), " shares no region ", req.region_id,
                            " (freed, or the daemon restarted)"),
               -1);
    return;
  }
  SendAnswer(conn, absl::StatusCode::kOk, "", fd);
  close(fd);
}

}  // namespace kvshade::kernels

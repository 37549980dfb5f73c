// Shared host memory: memfd-backed allocations and the process-wide table that names them
// (shared_memory.h).
#include "kvshade/kernels/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace kvshade::kernels {
namespace {

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, SharedHostRegion> by_base;  // keyed by base address
  std::atomic<uint64_t> next_id{1};
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
  const std::string path = absl::StrCat("/proc/", m.pid, "/fd/", m.fd);
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cannot open the daemon's shared memory ", path, ": ", std::strerror(errno),
        " (same-node decode needs the worker on the daemon's node, under the daemon's user, "
        "in its PID namespace)"));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < m.region_bytes) {
    close(fd);
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not the exported region (size ", st.st_size, ", expected ", m.region_bytes,
        "): the daemon may have restarted"));
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

}  // namespace kvshade::kernels

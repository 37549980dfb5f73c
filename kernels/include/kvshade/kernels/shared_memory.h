// Memory shared between the daemon and worker processes on one node (same-node decode).
//
// The daemon owns a session's compressed state; a worker on the same node maps it and runs
// the decode kernels itself. Two kinds of memory cross the process boundary:
//   - host memory (the CPU backend's arena, every backend's host-visible value slabs):
//     allocated from an anonymous memory file (memfd) mapped MAP_SHARED; another process
//     of the same user opens it as /proc/<pid>/fd/<fd> and maps the same pages. A CUDA
//     worker then registers the mapping (cudaHostRegister) so its kernels read it over PCIe.
//     Registration pins every page again (0.1-0.25 s per GiB), so a CUDA daemon whose GPU
//     supports it allocates its host-visible memory from the CUDA driver instead (pinned
//     host memory exported as a descriptor, kHostVmm): a CUDA worker takes the descriptor
//     with pidfd_getfd and maps the already pinned pages (about 0.01 s per GiB).
//   - device memory (the CUDA arena): named by a CUDA IPC handle of its allocation.
// An ExportedMemory names one whole allocation ("region") plus an offset into it; regions
// carry an id unique within the exporting process, so an importer can map each region once
// and tell a new region from a recycled file descriptor number.
//
// How a worker gets the region's descriptor: from the daemon's descriptor broker when it
// runs one (DescriptorBroker: a Unix socket that passes the descriptor by SCM_RIGHTS to a
// process of the daemon's user, so neither ptrace access nor a shared PID namespace is
// needed), else by /proc/<pid>/fd/<fd> (memory files) or pidfd_getfd (CUDA driver memory),
// which need the daemon's PID namespace and, for pidfd_getfd, ptrace access.
//
// Trust: a process that can open /proc/<daemon pid>/fd/* can read the daemon's memory
// anyway (same user or CAP_SYS_PTRACE); CUDA IPC is node-local. Same-node export is for
// workers that the operator runs under the daemon's user, as ordinary shared memory is;
// the broker answers only peers of the daemon's user (or root), checked by SO_PEERCRED.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// One shared host region of this process.
struct SharedHostRegion {
  uint64_t id = 0;
  int fd = -1;
  void* base = nullptr;
  size_t bytes = 0;
  ExportedMemory::Kind kind = ExportedMemory::Kind::kHostFile;  // kHostFile or kHostVmm
};

// Allocates `bytes` (rounded up to pages) of zeroed host memory backed by a memory file and
// registers it process-wide, so FindSharedHostRegion can name it. `on_release` runs before
// the pages are unmapped (e.g. to unregister them from CUDA).
absl::StatusOr<Buffer> AllocateSharedHost(size_t bytes,
                                          std::function<void(void*)> on_release = {});
// Names host memory allocated elsewhere (a kHostVmm region of the CUDA backend) in the
// same table, under a fresh id; UnregisterSharedHost removes it before it is freed.
uint64_t RegisterSharedHost(ExportedMemory::Kind kind, int fd, void* base, size_t bytes);
void UnregisterSharedHost(const void* base);
// The shared host region containing p, if any.
std::optional<SharedHostRegion> FindSharedHostRegion(const void* p);
// p named for another process when it lies in a shared host region of this process.
std::optional<ExportedMemory> ExportSharedHost(const void* p);
// Maps another process's shared host region (kHostFile) read-write into this one.
absl::StatusOr<ImportedMemory> MapSharedHostRegion(const ExportedMemory& m);
void UnmapSharedHostRegion(const ImportedMemory& m);

// Hands the descriptors of this process's shared host regions to same-user processes
// over a Unix socket (SCM_RIGHTS). While one runs, ExportSharedHost names its address in
// ExportedMemory::broker. A request names a region id; the answer is the region's
// descriptor (a duplicate: the region may be freed meanwhile without the descriptor
// naming anything else), or an error. Requests are served one at a time, each bounded by
// a one-second socket timeout.
class DescriptorBroker {
 public:
  // address: "@name" for an abstract socket (no file; the network namespace's), else a
  // filesystem path (an existing socket file there is replaced; removed on destruction).
  static absl::StatusOr<std::unique_ptr<DescriptorBroker>> Start(const std::string& address);
  ~DescriptorBroker();
  DescriptorBroker(const DescriptorBroker&) = delete;
  DescriptorBroker& operator=(const DescriptorBroker&) = delete;
  const std::string& address() const { return address_; }

 private:
  DescriptorBroker(std::string address, int listen_fd, int stop_fd);
  void Serve();
  void Answer(int conn);

  std::string address_;
  int listen_fd_, stop_fd_;
  std::thread thread_;
};

// The descriptor of region m (kHostFile or kHostVmm) in this process, to be closed by the
// caller: from m.broker when set, else via /proc/<pid>/fd (kHostFile) or pidfd_getfd
// (kHostVmm). When the broker fails the other way is tried, and an error names both.
absl::StatusOr<int> TakeSharedDescriptor(const ExportedMemory& m);

}  // namespace kvshade::kernels

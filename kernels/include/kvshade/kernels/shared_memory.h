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
// Trust: a process that can open /proc/<daemon pid>/fd/* can read the daemon's memory
// anyway (same user or CAP_SYS_PTRACE); CUDA IPC is node-local. Same-node export is for
// workers that the operator runs under the daemon's user, as ordinary shared memory is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

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

}  // namespace kvshade::kernels

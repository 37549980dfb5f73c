// Pinned host memory from the CUDA driver, shared with worker processes on the node by a
// descriptor (kHostVmm, shared_memory.h): the daemon allocates it (cuMemCreate on the GPU's
// host NUMA node, mapped for the device and the CPU) and keeps its exported descriptor; a
// CUDA worker takes that descriptor from the daemon (its descriptor broker, else
// pidfd_getfd: TakeSharedDescriptor) and maps the same pinned
// pages into its own device address space. Unlike a memory file registered in the worker
// (cudaHostRegister pins every page again: 0.1-0.25 s per GiB), the import maps pages the
// driver already pinned (about 0.01 s per GiB on an H200).
//
// The driver API is reached through cuda_driver.h (the backend does not link libcuda).
#pragma once

#include <cstddef>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// Whether `device` can allocate host memory this way (driver entry points, host NUMA
// virtual memory management and POSIX descriptors); checked once per device.
bool HostVmmSupported(int device);

// `bytes` of pinned host memory readable and writable by the CPU and `device`, registered
// in the shared host table as kHostVmm. The caller checks HostVmmSupported first.
absl::StatusOr<Buffer> AllocateHostVmm(int device, size_t bytes);

// Maps another process's kHostVmm region for `device` (device access only: a worker reads
// it with kernels and copies). FailedPrecondition when the descriptor cannot be taken
// (the worker needs ptrace access to the daemon: same user and Yama ptrace_scope 0, or the
// daemon its child, or CAP_SYS_PTRACE; else run the daemon with same_node.host_memory: file).
absl::StatusOr<ImportedMemory> ImportHostVmm(int device, const ExportedMemory& m);
void ReleaseHostVmm(const ImportedMemory& m);

}  // namespace kvshade::kernels

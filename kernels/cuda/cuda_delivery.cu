// Delivery into a worker's slot buffers: CopyRows (a row scatter, one launch for all the
// misses of a call instead of one cudaMemcpy per 2 KiB row) and the CUDA IPC mapping of a
// worker's allocation into the daemon (OpenPeerBuffer / ClosePeerBuffer).
#include <cuda.h>  // CUdeviceptr / CUresult types only; the driver: cuda_driver.h

#include <cstring>
#include <optional>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cuda/cuda_backend_impl.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_driver.h"
#include "cuda/cuda_host_vmm.h"
#include "kvshade/kernels/shared_memory.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {
namespace {

using cuda::ToCudaStream;
using cuda::UseDevice;

// One block per row; 16-byte vector copies (row_bytes % 16 == 0 is validated).
__global__ void CopyRowsKernel(const int4* __restrict__ src, int4* __restrict__ dst,
                               size_t row_vecs, const int64_t* __restrict__ src_rows,
                               const int64_t* __restrict__ dst_rows) {
  const int64_t s = src_rows[blockIdx.x], d = dst_rows[blockIdx.x];
  const int4* from = src + s * row_vecs;
  int4* to = dst + d * row_vecs;
  for (size_t i = threadIdx.x; i < row_vecs; i += blockDim.x) to[i] = from[i];
}

}  // namespace

absl::Status CudaBackend::CopyRows(const void* src, void* dst, size_t row_bytes, int n,
                                   const int64_t* src_rows, const int64_t* dst_rows,
                                   Stream stream) {
  KVSHADE_RETURN_IF_ERROR(validate::CopyRows(src, dst, row_bytes, n, src_rows, dst_rows));
  if (n == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  const size_t row_vecs = row_bytes / sizeof(int4);
  const int threads = row_vecs >= 256 ? 256 : static_cast<int>((row_vecs + 31) / 32 * 32);
  CopyRowsKernel<<<n, threads, 0, ToCudaStream(stream)>>>(
      static_cast<const int4*>(src), static_cast<int4*>(dst), row_vecs, src_rows, dst_rows);
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return absl::OkStatus();
}

absl::StatusOr<PeerBuffer> CudaBackend::OpenPeerBuffer(std::string_view handle) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h)) {
    return absl::InvalidArgumentError(absl::StrCat("a CUDA IPC memory handle has ", sizeof(h),
                                                   " bytes, got ", handle.size()));
  }
  std::memcpy(&h, handle.data(), sizeof(h));
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  void* base = nullptr;
  const cudaError_t e = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave the context clean for the next call
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot open the CUDA IPC handle on device ", device_, ": ", cudaGetErrorString(e),
        " (the worker must be on this node and its buffer on a device this one can reach)"));
  }
  if (Driver().address_range == nullptr) {
    cudaIpcCloseMemHandle(base);
    return absl::InternalError("cuda: the driver has no cuMemGetAddressRange");
  }
  CUdeviceptr alloc_base = 0;
  size_t alloc_bytes = 0;
  if (Driver().address_range(&alloc_base, &alloc_bytes, reinterpret_cast<CUdeviceptr>(base)) !=
      CUDA_SUCCESS) {
    cudaIpcCloseMemHandle(base);
    return absl::InternalError("cuda: cuMemGetAddressRange failed on a mapped IPC buffer");
  }
  // The handle names an allocation; its mapping starts at the allocation's base.
  return PeerBuffer{base, alloc_bytes - (reinterpret_cast<CUdeviceptr>(base) - alloc_base)};
}

absl::Status CudaBackend::ClosePeerBuffer(const PeerBuffer& buffer) {
  if (buffer.base == nullptr) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  KVSHADE_CUDA_RETURN_IF_ERROR(cudaIpcCloseMemHandle(buffer.base));
  return absl::OkStatus();
}

absl::StatusOr<ExportedMemory> CudaBackend::ExportMemory(const void* p) {
  if (std::optional<ExportedMemory> m = ExportSharedHost(p)) return *m;
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  // The allocation of Allocate that holds p.
  uintptr_t base = 0;
  size_t bytes = 0;
  uint64_t id = 0;
  std::string handle;
  {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(allocs_->mu);
    auto it = allocs_->by_base.upper_bound(a);
    if (it != allocs_->by_base.begin()) {
      --it;
      if (a < it->first + it->second.bytes) {
        base = it->first;
        bytes = it->second.bytes;
        id = it->second.id;
        handle = it->second.ipc_handle;
      }
    }
  }
  if (base == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "cuda: memory at ", absl::Hex(reinterpret_cast<uintptr_t>(p)),
        " is neither an allocation of this backend nor shared host memory; it cannot be "
        "exported to another process"));
  }
  if (handle.empty()) {
    cudaIpcMemHandle_t h;
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
    handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    std::lock_guard<std::mutex> lock(allocs_->mu);
    auto it = allocs_->by_base.find(base);
    if (it != allocs_->by_base.end() && it->second.id == id) it->second.ipc_handle = handle;
  }
  ExportedMemory m;
  m.kind = ExportedMemory::Kind::kDeviceIpc;
  // Never reused within this process (a worker may keep the mapping while the region is
  // idle); the top bit keeps device ids apart from host region ids.
  m.region_id = id | (uint64_t{1} << 63);
  m.pid = getpid();
  m.ipc_handle = std::move(handle);
  m.region_bytes = bytes;
  m.offset = size_t(reinterpret_cast<uintptr_t>(p) - base);
  return m;
}

absl::StatusOr<ImportedMemory> CudaBackend::ImportMemory(const ExportedMemory& m) {
  if (m.kind == ExportedMemory::Kind::kDeviceIpc) {
    KVSHADE_ASSIGN_OR_RETURN(PeerBuffer b, OpenPeerBuffer(m.ipc_handle));
    if (b.bytes < m.region_bytes) {
      (void)ClosePeerBuffer(b);
      return absl::FailedPreconditionError(absl::StrCat(
          "cuda: the exported device region has ", b.bytes, " bytes, expected ", m.region_bytes));
    }
    return ImportedMemory{m.kind, b.base, m.region_bytes};
  }
  if (m.kind == ExportedMemory::Kind::kHostVmm) {
    KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
    return ImportHostVmm(device_, m);
  }
  KVSHADE_ASSIGN_OR_RETURN(ImportedMemory im, MapSharedHostRegion(m));
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  const cudaError_t e =
      cudaHostRegister(im.base, im.bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e != cudaSuccess) {
    cudaGetLastError();
    UnmapSharedHostRegion(im);
    return absl::ResourceExhaustedError(absl::StrCat(
        "cuda: cannot register ", im.bytes, " bytes of shared host memory: ",
        cudaGetErrorString(e), " (check the memlock limit: ulimit -l)"));
  }
  return im;
}

absl::Status CudaBackend::ReleaseImported(const ImportedMemory& m) {
  if (m.base == nullptr) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(UseDevice(device_));
  if (m.kind == ExportedMemory::Kind::kDeviceIpc) {
    KVSHADE_CUDA_RETURN_IF_ERROR(cudaIpcCloseMemHandle(m.base));
    return absl::OkStatus();
  }
  if (m.kind == ExportedMemory::Kind::kHostVmm) {
    ReleaseHostVmm(m);
    return absl::OkStatus();
  }
  cudaHostUnregister(m.base);
  cudaGetLastError();
  UnmapSharedHostRegion(m);
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

// Pinned host memory from the CUDA driver, shared by descriptor (cuda_host_vmm.h).
#include "cuda/cuda_host_vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include <map>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cuda/cuda_driver.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/shared_memory.h"

namespace kvshade::kernels {
namespace {

absl::Status Check(CUresult r, absl::string_view what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const absl::StatusCode code = r == CUDA_ERROR_OUT_OF_MEMORY ? absl::StatusCode::kResourceExhausted
                                                              : absl::StatusCode::kInternal;
  return absl::Status(code, absl::StrCat("cuda: ", what, ": ", DriverErrorString(r)));
}

int HostNumaNode(int device) {
  int numa = -1;
  if (cudaDeviceGetAttribute(&numa, cudaDevAttrHostNumaId, device) != cudaSuccess) {
    cudaGetLastError();
    numa = -1;
  }
  return numa < 0 ? 0 : numa;  // 0 where the system has no NUMA
}

CUmemAllocationProp HostProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = HostNumaNode(device);
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

CUmemAccessDesc Access(CUmemLocationType type, int id) {
  CUmemAccessDesc a{};
  a.location.type = type;
  a.location.id = id;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return a;
}

// Unmaps and frees a mapping made here; `handle` (0: none) and `fd` (-1: none) too.
void Teardown(CUdeviceptr va, size_t mapped, size_t reserved, CUmemGenericAllocationHandle handle,
              int fd) {
  const CudaDriver& d = Driver();
  if (mapped != 0) d.mem_unmap(va, mapped);
  if (reserved != 0) d.address_free(va, reserved);
  if (handle != 0) d.mem_release(handle);
  if (fd >= 0) close(fd);
}

size_t RoundUp(size_t n, size_t g) { return (n + g - 1) / g * g; }

// Reserves `size` bytes of address space, maps `handle` there and grants `access`; on
// failure undoes what it did. The handle stays the caller's either way.
absl::StatusOr<CUdeviceptr> MapWithAccess(CUmemGenericAllocationHandle handle, size_t size,
                                          size_t gran, const CUmemAccessDesc* access, int n_access,
                                          absl::string_view what) {
  const CudaDriver& d = Driver();
  CUdeviceptr va = 0;
  if (absl::Status st = Check(d.address_reserve(&va, size, gran, 0, 0), "reserve address range");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = Check(d.mem_map(va, size, 0, handle, 0), what); !st.ok()) {
    Teardown(va, 0, size, 0, -1);
    return st;
  }
  if (absl::Status st = Check(d.set_access(va, size, access, n_access), "grant access"); !st.ok()) {
    Teardown(va, size, size, 0, -1);
    return st;
  }
  return va;
}

}  // namespace

bool HostVmmSupported(int device) {
  static std::mutex mu;
  static std::map<int, bool> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  const CudaDriver& d = Driver();
  int vmm = 0, host_numa = 0, fd = 0;
  CUdevice dev = 0;
  const bool ok =
      d.vmm && d.device_get(&dev, device) == CUDA_SUCCESS &&
      d.device_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
          CUDA_SUCCESS &&
      d.device_attribute(&host_numa,
                         CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                         dev) == CUDA_SUCCESS &&
      d.device_attribute(&fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                         dev) == CUDA_SUCCESS &&
      vmm != 0 && host_numa != 0 && fd != 0;
  known[device] = ok;
  return ok;
}

absl::StatusOr<Buffer> AllocateHostVmm(int device, size_t bytes) {
  const CudaDriver& d = Driver();
  const CUmemAllocationProp prop = HostProp(device);
  size_t gran = 0;
  if (absl::Status st = Check(d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                              "host allocation granularity");
      !st.ok()) {
    return st;
  }
  const size_t size = RoundUp(bytes, gran);
  CUmemGenericAllocationHandle handle = 0;
  if (absl::Status st = Check(d.mem_create(&handle, size, &prop, 0),
                              absl::StrCat("allocate ", size, " bytes of pinned host memory"));
      !st.ok()) {
    return st;
  }
  const CUmemAccessDesc access[2] = {Access(CU_MEM_LOCATION_TYPE_DEVICE, device),
                                     Access(CU_MEM_LOCATION_TYPE_HOST_NUMA, prop.location.id)};
  absl::StatusOr<CUdeviceptr> mapped = MapWithAccess(handle, size, gran, access, 2, "map host memory");
  if (!mapped.ok()) {
    Teardown(0, 0, 0, handle, -1);
    return mapped.status();
  }
  const CUdeviceptr va = *mapped;
  int fd = -1;
  if (absl::Status st = Check(
          d.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), "export");
      !st.ok()) {
    Teardown(va, size, size, handle, -1);
    return st;
  }
  // The mapping keeps the physical memory alive; the handle is no longer needed.
  d.mem_release(handle);
  void* p = reinterpret_cast<void*>(va);
  RegisterSharedHost(ExportedMemory::Kind::kHostVmm, fd, p, size);
  return Buffer(p, bytes, [size, fd](void* q) {
    UnregisterSharedHost(q);
    Teardown(reinterpret_cast<CUdeviceptr>(q), size, size, 0, fd);
  });
}

absl::StatusOr<ImportedMemory> ImportHostVmm(int device, const ExportedMemory& m) {
  if (!HostVmmSupported(device)) {
    return absl::FailedPreconditionError(
        "cuda: the daemon shares host memory as CUDA driver allocations, which this GPU or "
        "driver cannot map (run the daemon with same_node.host_memory: file)");
  }
  const CudaDriver& d = Driver();
  KVSHADE_ASSIGN_OR_RETURN(const int fd, TakeSharedDescriptor(m));
  CUmemGenericAllocationHandle handle = 0;
  absl::Status st =
      Check(d.import_handle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
            "import the daemon's host memory");
  close(fd);
  if (!st.ok()) return st;
  const CUmemAllocationProp prop = HostProp(device);
  size_t gran = 0;
  if (st = Check(d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity");
      !st.ok()) {
    Teardown(0, 0, 0, handle, -1);
    return st;
  }
  const size_t size = RoundUp(m.region_bytes, gran);
  const CUmemAccessDesc access = Access(CU_MEM_LOCATION_TYPE_DEVICE, device);
  absl::StatusOr<CUdeviceptr> va =
      MapWithAccess(handle, size, gran, &access, 1, "map the daemon's host memory");
  // The mapping keeps the memory alive; the imported handle is no longer needed.
  d.mem_release(handle);
  if (!va.ok()) return va.status();
  return ImportedMemory{ExportedMemory::Kind::kHostVmm, reinterpret_cast<void*>(*va), size};
}

void ReleaseHostVmm(const ImportedMemory& m) {
  if (m.base == nullptr) return;
  Teardown(reinterpret_cast<CUdeviceptr>(m.base), m.bytes, m.bytes, 0, -1);
}

}  // namespace kvshade::kernels

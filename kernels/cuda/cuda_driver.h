// The CUDA driver API entry points the backend uses, resolved once through the runtime
// (cudaGetDriverEntryPointByVersion): the backend does not link libcuda, so its binaries
// still load on a machine without a GPU driver. An entry point the driver lacks is null.
#pragma once

#include <cuda.h>

#include <string>

namespace kvshade::kernels {

struct CudaDriver {
  // Virtual memory management with shareable handles (cuda_host_vmm.h): every entry point
  // from mem_create to device_attribute resolved.
  bool vmm = false;
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long) = nullptr;
  CUresult (*mem_release)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                              unsigned long long) = nullptr;
  CUresult (*address_free)(CUdeviceptr, size_t) = nullptr;
  CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long) = nullptr;
  CUresult (*mem_unmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*,
                          CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long) = nullptr;
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*,
                            CUmemAllocationHandleType) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*device_attribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  // The allocation that holds an address (same-node ingest: a worker's IPC buffer).
  CUresult (*address_range)(CUdeviceptr*, size_t*, CUdeviceptr) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
};

const CudaDriver& Driver();

// The driver's name for `r` (or its number).
std::string DriverErrorString(CUresult r);

}  // namespace kvshade::kernels

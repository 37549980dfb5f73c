// Driver API entry points through the runtime (cuda_driver.h).
#include "cuda/cuda_driver.h"

#include <cuda_runtime.h>

#include "absl/strings/str_cat.h"

namespace kvshade::kernels {
namespace {

template <typename F>
bool Resolve(const char* symbol, F* fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    *fn = nullptr;
    return false;
  }
  *fn = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

const CudaDriver& Driver() {
  static const CudaDriver* d = [] {
    auto* x = new CudaDriver();  // never destroyed: used until exit
    Resolve("cuGetErrorString", &x->error_string);
    Resolve("cuMemGetAddressRange", &x->address_range);
    x->vmm = Resolve("cuMemCreate", &x->mem_create) && Resolve("cuMemRelease", &x->mem_release) &&
             Resolve("cuMemAddressReserve", &x->address_reserve) &&
             Resolve("cuMemAddressFree", &x->address_free) && Resolve("cuMemMap", &x->mem_map) &&
             Resolve("cuMemUnmap", &x->mem_unmap) && Resolve("cuMemSetAccess", &x->set_access) &&
             Resolve("cuMemGetAllocationGranularity", &x->granularity) &&
             Resolve("cuMemExportToShareableHandle", &x->export_handle) &&
             Resolve("cuMemImportFromShareableHandle", &x->import_handle) &&
             Resolve("cuDeviceGet", &x->device_get) &&
             Resolve("cuDeviceGetAttribute", &x->device_attribute);
    return x;
  }();
  return *d;
}

std::string DriverErrorString(CUresult r) {
  const char* s = nullptr;
  if (Driver().error_string != nullptr) Driver().error_string(r, &s);
  return s != nullptr ? std::string(s) : absl::StrCat("CUresult ", static_cast<int>(r));
}

}  // namespace kvshade::kernels

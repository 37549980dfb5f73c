// libkvshade_cuda.so: the CUDA backend behind the C entry points of
// kernels/common/cuda_plugin_abi.h, for libkvshade.so (which loads it at the first use).
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "common/cuda_plugin_abi.h"
#include "cuda/cuda_backend.h"

namespace {

void CopyOut(const std::string& s, char* out, size_t cap) {
  if (out == nullptr || cap == 0) return;
  const size_t n = std::min(s.size(), cap - 1);
  std::memcpy(out, s.data(), n);
  out[n] = '\0';
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int kvshade_cuda_plugin_abi(void) { return KVSHADE_CUDA_PLUGIN_ABI; }

__attribute__((visibility("default"))) int kvshade_cuda_device_count(void) {
  return kvshade::kernels::CudaDeviceCount();
}

__attribute__((visibility("default"))) int kvshade_cuda_pci_bus_id(int device, char* out, size_t cap) {
  const std::string id = kvshade::kernels::CudaDevicePciBusId(device);
  if (id.empty()) return -1;
  CopyOut(id, out, cap);
  return static_cast<int>(id.size());
}

__attribute__((visibility("default"))) void* kvshade_cuda_create_backend(int device, int* code, char* msg,
                                                                        size_t cap) {
  absl::StatusOr<std::unique_ptr<kvshade::kernels::Backend>> b = kvshade::kernels::CreateCudaBackend(device);
  if (!b.ok()) {
    if (code != nullptr) *code = static_cast<int>(b.status().code());
    CopyOut(std::string(b.status().message()), msg, cap);
    return nullptr;
  }
  return b->release();
}

}  // extern "C"

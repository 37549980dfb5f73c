// The C entry points of the CUDA backend plugin, libkvshade_cuda.so (kernels/cuda/plugin).
// libkvshade.so reaches the CUDA backend only through them (dlopen at the first use), so
// that the client library itself needs no CUDA library: a worker that decodes remotely, or
// runs on a machine without CUDA, loads it as it is. The daemon and the tests link the
// backend directly. Plugin and library come from one build: the Backend object crosses the
// boundary as a C++ object.
#pragma once

#include <stddef.h>

#define KVSHADE_CUDA_PLUGIN_ABI 2  // 2: Backend is DeviceRuntime + KernelOps
#define KVSHADE_CUDA_PLUGIN_FILE "libkvshade_cuda.so"

extern "C" {
// KVSHADE_CUDA_PLUGIN_ABI of the plugin.
typedef int (*kvshade_cuda_plugin_abi_fn)(void);
// CudaDeviceCount().
typedef int (*kvshade_cuda_device_count_fn)(void);
// CudaDevicePciBusId(device) into out (cap bytes, NUL-terminated); its length, or -1.
typedef int (*kvshade_cuda_pci_bus_id_fn)(int device, char* out, size_t cap);
// CreateCudaBackend(device): a new kvshade::kernels::Backend (free it with delete), or null
// with *code (an absl::StatusCode) and the message in msg (cap bytes, NUL-terminated).
typedef void* (*kvshade_cuda_create_backend_fn)(int device, int* code, char* msg, size_t cap);
}

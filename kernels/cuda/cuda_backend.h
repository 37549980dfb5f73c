// Entry points of the CUDA backend (kernels/cuda). Only the registry includes this.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// Number of visible CUDA devices; 0 when there is no driver or device.
int CudaDeviceCount();
// The PCI bus id of CUDA device `device` ("0000:3b:00.0", lower case); empty when unknown.
std::string CudaDevicePciBusId(int device);

// A backend bound to `device`, owning its streams, cuBLAS and cuSOLVER handles.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device);

}  // namespace kvshade::kernels

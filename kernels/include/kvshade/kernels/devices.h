// The devices a daemon can serve (docs/OPERATIONS.md "Devices"): a backend list such as
// "cuda:0,cuda:1", "cuda:all" or "cpu:0,cpu:1" names one backend per device. Kept apart
// from backend.h so that the kernels need not know about lists.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::kernels {

// One device of a backend list: its name as the daemon reports it ("cpu", "cuda:1",
// "cpu:0", "auto") and the parsed kind and index.
struct DeviceName {
  std::string name;
  BackendName backend;  // kind "cpu", "cuda" or "auto"; device = the index
};

// Parses a backend value: one name (ParseBackendName, or "cpu:N": an independent CPU
// device), a comma-separated list of them of one kind with no repeats ("cuda:0,cuda:2",
// "cpu:0,cpu:1"), or "cuda:all" (every visible CUDA device, counted now: Unavailable when
// there is none). A list holds cuda:N or cpu:N entries only; "cpu", "cuda" and "auto" stand
// alone. At most 64 devices. InvalidArgument naming the bad entry otherwise. With
// `count_devices` false, "cuda:all" is checked for syntax only and yields no entries.
absl::StatusOr<std::vector<DeviceName>> ParseDeviceList(std::string_view value,
                                                        bool count_devices = true);
inline constexpr int kMaxDevices = 64;

// The PCI bus id ("0000:3b:00.0", lower case) of a CUDA device by its ordinal; empty when
// it cannot be read (no CUDA backend in this build, no such device).
std::string CudaPciBusId(int device);
// A PCI bus id in one form, to compare: lower case, a 4-digit domain ("00000000:3B:00.0"
// from nvidia-smi and "0000:3b:00.0" from CUDA name the same device).
std::string NormalizePciBusId(std::string_view id);
// This process's CUDA ordinal of the GPU with that PCI bus id (any form); -1 when it sees no
// such GPU (or has no CUDA backend).
int CudaOrdinalOfPciBusId(std::string_view id);

}  // namespace kvshade::kernels

// The backend registry: the one place that knows which backends this build contains.
// Service code asks here instead of testing build macros.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/devices.h"
#if KVSHADE_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace kvshade::kernels {

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> out = {"cpu"};
#if KVSHADE_HAVE_CUDA
  if (CudaDeviceCount() > 0) out.push_back("cuda");
#endif
  return out;
}

namespace {

// "cuda:N" or "cpu:N" (N a non-negative decimal below 2^31): the kind and N.
bool ParseIndexed(std::string_view name, std::string_view kind, int* device) {
  if (name.size() <= kind.size() + 1 || name.substr(0, kind.size()) != kind ||
      name[kind.size()] != ':') {
    return false;
  }
  const std::string n(name.substr(kind.size() + 1));
  return n.size() <= 9 &&
         std::all_of(n.begin(), n.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
         absl::SimpleAtoi(n, device);
}

}  // namespace

absl::StatusOr<BackendName> ParseBackendName(std::string_view name) {
  if (name == "cpu" || name == "auto" || name == "cuda") return BackendName{std::string(name), 0};
  int device = -1;
  if (ParseIndexed(name, "cuda", &device)) return BackendName{"cuda", device};
  // An independent CPU device of a daemon with several ("cpu:0,cpu:1"): a CPU backend.
  if (ParseIndexed(name, "cpu", &device)) return BackendName{"cpu", device};
  return absl::InvalidArgumentError(absl::StrCat("bad backend name '", std::string(name),
                                                 "' (expected cpu, cpu:N, cuda, cuda:N or auto)"));
}

absl::StatusOr<std::vector<DeviceName>> ParseDeviceList(std::string_view value, bool count_devices) {
  std::vector<DeviceName> out;
  if (value == "cuda:all") {
    if (!count_devices) return out;
#if KVSHADE_HAVE_CUDA
    const int n = CudaDeviceCount();
#else
    const int n = 0;
#endif
    if (n == 0) {
      return absl::UnavailableError(
          "backend 'cuda:all': no CUDA device is visible (or this build has no CUDA backend)");
    }
    for (int i = 0; i < std::min(n, kMaxDevices); ++i) {
      out.push_back(DeviceName{absl::StrCat("cuda:", i), BackendName{"cuda", i}});
    }
    return out;
  }
  const std::string text(value);
  const std::vector<std::string> parts = absl::StrSplit(text, ',');
  if (parts.size() > static_cast<size_t>(kMaxDevices)) {
    return absl::InvalidArgumentError(absl::StrCat("backend: ", parts.size(), " devices (at most ",
                                                   kMaxDevices, ")"));
  }
  for (const std::string& part : parts) {
    const std::string name(absl::StripAsciiWhitespace(part));
    absl::StatusOr<BackendName> b = ParseBackendName(name);
    if (!b.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad backend '", std::string(value), "': entry '", name,
          "' is not a device (expected cpu, cuda, auto, or a list of cuda:N or of cpu:N, or cuda:all)"));
    }
    const bool indexed = name.find(':') != std::string::npos;
    if (parts.size() > 1 && !indexed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad backend '", std::string(value), "': '", name,
          "' cannot be part of a list (list cuda:N or cpu:N entries)"));
    }
    for (const DeviceName& d : out) {
      if (d.backend.kind != b->kind) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bad backend '", std::string(value), "': mixes ", d.backend.kind, " and ", b->kind,
            " devices (one kind per daemon)"));
      }
      if (d.backend.device == b->device) {
        return absl::InvalidArgumentError(absl::StrCat("bad backend '", std::string(value),
                                                       "': '", name, "' is listed twice"));
      }
    }
    out.push_back(DeviceName{name, *b});
  }
  return out;
}

std::string NormalizePciBusId(std::string_view id) {
  std::string out(id);
  for (char& c : out) c = static_cast<char>(absl::ascii_tolower(static_cast<unsigned char>(c)));
  if (out.find(':') == 8 && out.compare(0, 4, "0000") == 0) out.erase(0, 4);
  return out;
}

int CudaOrdinalOfPciBusId(std::string_view id) {
#if KVSHADE_HAVE_CUDA
  const std::string want = NormalizePciBusId(id);
  for (int i = 0; i < CudaDeviceCount(); ++i) {
    const std::string have = CudaDevicePciBusId(i);
    if (!have.empty() && NormalizePciBusId(have) == want) return i;
  }
#else
  (void)id;
#endif
  return -1;
}

std::string CudaPciBusId(int device) {
#if KVSHADE_HAVE_CUDA
  return CudaDevicePciBusId(device);
#else
  (void)device;
  return {};
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name) {
  KVSHADE_ASSIGN_OR_RETURN(const BackendName b, ParseBackendName(name));
  if (b.kind == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  if (b.kind == "auto") {
#if KVSHADE_HAVE_CUDA
    if (CudaDeviceCount() > 0) return CreateCudaBackend(0);
#endif
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  }
#if KVSHADE_HAVE_CUDA
  if (CudaDeviceCount() <= b.device) {
    return absl::UnavailableError(absl::StrCat("backend '", std::string(name), "': CUDA device ",
                                               b.device, " not present (", CudaDeviceCount(),
                                               " visible)"));
  }
  return CreateCudaBackend(b.device);
#else
  return absl::UnavailableError("backend 'cuda': this build has no CUDA backend");
#endif
}

}  // namespace kvshade::kernels

// The backend registry: the one place that knows which backends this build contains.
// Service code asks here instead of testing build macros.
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/backend.h"
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

absl::StatusOr<BackendName> ParseBackendName(std::string_view name) {
  if (name == "cpu" || name == "auto" || name == "cuda") return BackendName{std::string(name), 0};
  int device = -1;
  if (name.substr(0, 5) == "cuda:") {
    const std::string n(name.substr(5));
    if (!n.empty() && std::all_of(n.begin(), n.end(), [](char ch) { return ch >= '0' && ch <= '9'; }) &&
        absl::SimpleAtoi(n, &device)) {
      return BackendName{"cuda", device};
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("bad backend name '", std::string(name),
                                                 "' (expected cpu, cuda, cuda:N or auto)"));
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

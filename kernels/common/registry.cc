// The backend registry: the one place that knows which backends this build contains.
// Service code asks here instead of testing build macros.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cpu/cpu_backend.h"
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

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name) {
  if (name == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  if (name == "auto") {
#if KVSHADE_HAVE_CUDA
    if (CudaDeviceCount() > 0) return CreateCudaBackend(0);
#endif
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  }
  if (name == "cuda" || name.substr(0, 5) == "cuda:") {
    int device = 0;
    if (name.size() > 5 && !absl::SimpleAtoi(std::string(name.substr(5)), &device)) {
      return absl::InvalidArgumentError(absl::StrCat("bad backend name '", std::string(name), "'"));
    }
#if KVSHADE_HAVE_CUDA
    if (CudaDeviceCount() <= device) {
      return absl::UnavailableError(absl::StrCat("backend '", std::string(name), "': CUDA device ", device,
                                                 " not present (", CudaDeviceCount(),
                                                 " visible)"));
    }
    return CreateCudaBackend(device);
#else
    return absl::UnavailableError("backend 'cuda': this build has no CUDA backend");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown backend '", std::string(name), "' (expected cpu, cuda, cuda:N or auto)"));
}

}  // namespace kvshade::kernels

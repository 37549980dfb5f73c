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
#elif KVSHADE_CUDA_PLUGIN
#include <dlfcn.h>

#include <cstdlib>

#include "common/cuda_plugin_abi.h"
#endif

namespace kvshade::kernels {

// The CUDA backend as this build reaches it: linked in (KVSHADE_HAVE_CUDA: the daemon, the
// tests), through the plugin libkvshade_cuda.so (KVSHADE_CUDA_PLUGIN: libkvshade.so), or
// not at all.
namespace {

#if KVSHADE_CUDA_PLUGIN
// The plugin, loaded once: from $KVSHADE_CUDA_PLUGIN when set, else beside the library this
// code is in, else by the loader's search path. Not found (no CUDA here, or a build
// without the backend): no CUDA device, and `why` says what was tried.
struct CudaPlugin {
  kvshade_cuda_device_count_fn count = nullptr;
  kvshade_cuda_pci_bus_id_fn bus_id = nullptr;
  kvshade_cuda_create_backend_fn create = nullptr;
  std::string why;  // why it is not loaded
};

const CudaPlugin& Plugin() {
  static const CudaPlugin* plugin = [] {
    auto* p = new CudaPlugin();
    std::vector<std::string> paths;
    if (const char* env = std::getenv("KVSHADE_CUDA_PLUGIN"); env != nullptr && *env != '\0') {
      paths.push_back(env);
    } else {
      Dl_info info;
      if (dladdr(reinterpret_cast<const void*>(&Plugin), &info) != 0 && info.dli_fname != nullptr) {
        std::string dir(info.dli_fname);
        const size_t slash = dir.rfind('/');
        if (slash != std::string::npos) paths.push_back(dir.substr(0, slash + 1) + KVSHADE_CUDA_PLUGIN_FILE);
      }
      paths.push_back(KVSHADE_CUDA_PLUGIN_FILE);
    }
    std::vector<std::string> tried;
    for (const std::string& path : paths) {
      void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (h == nullptr) {
        const char* e = dlerror();
        tried.push_back(e != nullptr ? std::string(e) : path);
        continue;
      }
      auto abi = reinterpret_cast<kvshade_cuda_plugin_abi_fn>(dlsym(h, "kvshade_cuda_plugin_abi"));
      if (abi == nullptr || abi() != KVSHADE_CUDA_PLUGIN_ABI) {
        tried.push_back(absl::StrCat(path, ": not a kvshade CUDA plugin of this build (ABI ",
                                     abi == nullptr ? -1 : abi(), ", want ", KVSHADE_CUDA_PLUGIN_ABI, ")"));
        dlclose(h);
        continue;
      }
      p->count = reinterpret_cast<kvshade_cuda_device_count_fn>(dlsym(h, "kvshade_cuda_device_count"));
      p->bus_id = reinterpret_cast<kvshade_cuda_pci_bus_id_fn>(dlsym(h, "kvshade_cuda_pci_bus_id"));
      p->create = reinterpret_cast<kvshade_cuda_create_backend_fn>(dlsym(h, "kvshade_cuda_create_backend"));
      if (p->count != nullptr && p->bus_id != nullptr && p->create != nullptr) return p;  // kept open
      tried.push_back(absl::StrCat(path, ": entry points missing"));
      p->count = nullptr;
      p->bus_id = nullptr;
      p->create = nullptr;
      dlclose(h);
    }
    p->why = absl::StrCat("the CUDA backend plugin " KVSHADE_CUDA_PLUGIN_FILE " could not be loaded (",
                          absl::StrJoin(tried, "; "), ")");
    return p;
  }();
  return *plugin;
}
#endif

bool BuildHasCuda() {
#if KVSHADE_HAVE_CUDA || KVSHADE_CUDA_PLUGIN
  return true;
#else
  return false;
#endif
}

int CudaCount() {
#if KVSHADE_HAVE_CUDA
  return CudaDeviceCount();
#elif KVSHADE_CUDA_PLUGIN
  return Plugin().count != nullptr ? Plugin().count() : 0;
#else
  return 0;
#endif
}

std::string CudaBusId(int device) {
#if KVSHADE_HAVE_CUDA
  return CudaDevicePciBusId(device);
#elif KVSHADE_CUDA_PLUGIN
  if (Plugin().bus_id == nullptr) return {};
  char buf[64];
  return Plugin().bus_id(device, buf, sizeof(buf)) > 0 ? std::string(buf) : std::string();
#else
  (void)device;
  return {};
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CudaCreate(int device) {
#if KVSHADE_HAVE_CUDA
  return CreateCudaBackend(device);
#elif KVSHADE_CUDA_PLUGIN
  const CudaPlugin& p = Plugin();
  if (p.create == nullptr) return absl::UnavailableError(absl::StrCat("backend 'cuda': ", p.why));
  int code = static_cast<int>(absl::StatusCode::kUnknown);
  char msg[1024] = {0};
  void* b = p.create(device, &code, msg, sizeof(msg));
  if (b == nullptr) return absl::Status(static_cast<absl::StatusCode>(code), msg);
  return std::unique_ptr<Backend>(static_cast<Backend*>(b));
#else
  (void)device;
  return absl::UnavailableError("backend 'cuda': this build has no CUDA backend");
#endif
}

}  // namespace

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> out = {"cpu"};
  if (CudaCount() > 0) out.push_back("cuda");
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
    const int n = CudaCount();
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
  const std::string want = NormalizePciBusId(id);
  for (int i = 0; i < CudaCount(); ++i) {
    const std::string have = CudaBusId(i);
    if (!have.empty() && NormalizePciBusId(have) == want) return i;
  }
  return -1;
}

std::string CudaPciBusId(int device) { return CudaBusId(device); }

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name) {
  KVSHADE_ASSIGN_OR_RETURN(const BackendName b, ParseBackendName(name));
  if (b.kind == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  if (b.kind == "auto") {
    if (CudaCount() > 0) return CudaCreate(0);
    return std::unique_ptr<Backend>(std::make_unique<CpuBackend>());
  }
  if (!BuildHasCuda()) return CudaCreate(b.device);  // this build has no CUDA backend
#if KVSHADE_CUDA_PLUGIN
  if (Plugin().create == nullptr) return CudaCreate(b.device);  // why the plugin is missing
#endif
  if (CudaCount() <= b.device) {
    return absl::UnavailableError(absl::StrCat("backend '", std::string(name), "': CUDA device ",
                                               b.device, " not present (", CudaCount(), " visible)"));
  }
  return CudaCreate(b.device);
}

}  // namespace kvshade::kernels

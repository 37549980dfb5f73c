// Fuzz target: the daemon's YAML config file (service/config.cc). Any input must load or be
// refused with a status (never an exception, crash or hang), and a config that loads must
// validate or be refused the same way; its description and the derived limits must be
// computable. File-system side effects stay out: the input is written to a private
// temporary file, and spill_path and the TLS files are cleared before validation (they name
// paths that validation would create or read).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

#include "kvshade/service/config.h"

namespace {

// Names that would make the loader read something other than a regular file (a tokens_file
// of /dev/stdin blocks forever): inputs naming them are skipped.
bool NamesSpecialFile(std::string_view s) {
  for (std::string_view bad : {"dev/", "proc/", "sys/", "/dev", "/proc", "/sys", "/fd"}) {
    if (s.find(bad) != std::string_view::npos) return true;
  }
  return false;
}

const std::string& TempPath() {
  static const std::string* path = [] {
    char tmpl[] = "/tmp/kvshade-config-fuzz-XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd < 0) std::abort();
    close(fd);
    return new std::string(tmpl);
  }();
  return *path;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // validation warns about open listeners
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (NamesSpecialFile(text)) return -1;  // not added to the corpus
  const std::string& path = TempPath();
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);

  auto config = kvshade::service::LoadConfigFile(path);
  if (!config.ok()) {
    if (config.status().message().empty()) std::abort();  // a refusal always says why
    return 0;
  }
  kvshade::service::ServerConfig c = *config;
  c.spill_path.clear();
  c.tls.cert_file.clear();
  c.tls.key_file.clear();
  c.tls.client_ca_file.clear();
  absl::Status st = kvshade::service::ValidateConfig(c);
  if (!st.ok() && st.message().empty()) std::abort();
  (void)kvshade::service::DescribeConfig(c);
  (void)kvshade::service::InsecureListenWarning(c);
  (void)kvshade::service::IsLoopbackListen(c.listen);
  (void)kvshade::service::CallThreadCap(c);
  (void)kvshade::service::EffectiveMaxStreamsPerTenant(c);
  return 0;
}

#include "device_fault.h"

#include <sys/stat.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvshade::service {

absl::Status DeviceFault(const kernels::DeviceRuntime& backend) {
  if (absl::Status st = backend.DeviceFault(); !st.ok()) return st;
  static const std::string failpoint = [] {
    const char* v = std::getenv("KVSHADE_FAILPOINT_DEVICE_FAULT");
    return std::string(v == nullptr ? "" : v);
  }();
  struct stat info;
  if (!failpoint.empty() && ::stat(failpoint.c_str(), &info) == 0) {
    return absl::InternalError(
        absl::StrCat("injected device fault (KVSHADE_FAILPOINT_DEVICE_FAULT: ", failpoint, " exists)"));
  }
  return absl::OkStatus();
}

}  // namespace kvshade::service

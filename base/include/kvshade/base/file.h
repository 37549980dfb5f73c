// Reading a whole file (certificates, keys, CA bundles) with an error that names it.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvshade::base {

// The bytes of `path`. NOT_FOUND "cannot read <what> '<path>'" when it cannot be opened,
// INTERNAL when reading it fails; `what` says what the file is for (e.g. "tls.cert_file").
absl::StatusOr<std::string> ReadFile(const std::string& path, std::string_view what);

}  // namespace kvshade::base

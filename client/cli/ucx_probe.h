// UcxLanesTo: which UCX transports a client on this host would use to reach a daemon's
// worker (`kvshade doctor`, `kvshade demo`). It creates an endpoint to the address on a
// throwaway worker, reads the lanes UCP picked (ucp_ep_print_info: "tcp/lo", "posix/memory",
// "rc_mlx5/mlx5_0:1", ...) and closes it. Nothing is sent that the daemon acts on (no HELLO),
// so it needs no admission token.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace kvshade::cli {

// `address`: AttachResponse.data_plane_address; `transports`: UCX_TLS ("" = UCX's choice).
// Returns the lanes' "tl/device" names, comma separated.
absl::StatusOr<std::string> UcxLanesTo(const std::string& address, const std::string& transports);

}  // namespace kvshade::cli

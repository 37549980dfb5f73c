// `kvshade doctor`: what this host offers the data plane, and whether a test transfer to
// the daemon works. Checks, in order:
//   ucx     the UCX library version, the transports its UCT components report
//           (tl/device, as `ucx_info -d` does) and whether a UCP context with the chosen
//           UCX_TLS opens;
//   cuda    CUDA driver visibility at run time (dlopen libcuda.so.1, cuInit,
//           cuDeviceGetCount: no link-time CUDA dependency; "no driver" is a clean answer);
//   memlock RLIMIT_MEMLOCK, which bounds pinned and UCX-registered host memory;
//   daemon  health, then a throwaway small session: ingest, two attachments, UCX connect
//           with the admission token, one select over UCX and the same over gRPC (results
//           must be identical), round-trip times of both, then cleanup.
// Exit code: 0 when every check passed (warnings allowed), 1 when the daemon check (or
// --require-ucx) failed, 3 when the daemon is not SERVING.
#pragma once

#include <string>

#include <CLI/CLI.hpp>

#include "kvshade/client/client.h"

namespace kvshade::cli {

struct DoctorOptions {
  bool local_only = false;   // skip the daemon check
  bool require_ucx = false;  // a daemon without a UCX data plane fails the check
  int repeats = 200;         // select round trips timed per transport
  double wait_s = 5;         // wait this long for SERVING
};

void AddDoctorOptions(CLI::App* app, DoctorOptions* options);

// `client_options` are the connection flags (target, token, TLS, ucx_transports).
int RunDoctor(const client::ClientOptions& client_options, const DoctorOptions& options);

}  // namespace kvshade::cli

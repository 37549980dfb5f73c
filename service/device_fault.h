// Whether this daemon's device still works (docs/OPERATIONS.md "Device faults").
//
// Backend::DeviceFault reports an error that left the device unusable for this process.
// Once it does, every call is refused with UNAVAILABLE and the server drains and exits
// with status 1, so that its supervisor (systemd, Kubernetes) starts a new process, which
// restores the durable sessions.
//
// Fault injection for tests: when KVSHADE_FAILPOINT_DEVICE_FAULT names a file, the daemon
// acts as if its device failed from the moment that file exists (any backend; the file is
// checked at each call and once a second). Unset in production.
#pragma once

#include "absl/status/status.h"
#include "kvshade/kernels/backend.h"

namespace kvshade::service {

absl::Status DeviceFault(const kernels::DeviceRuntime& backend);

}  // namespace kvshade::service

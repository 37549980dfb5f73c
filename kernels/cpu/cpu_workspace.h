// Workspace layout helpers of the CPU backend's ops that carve one caller-provided
// workspace into aligned arrays (cpu_lowrank.cc, cpu_observation.cc).
#pragma once

#include <cstddef>

namespace kvshade::kernels::cpu_internal {

// Alignment of every array carved from a workspace (and the slack for aligning its base).
inline constexpr size_t kWorkspaceAlign = 64;

inline constexpr size_t AlignUp(size_t x) {
  return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

}  // namespace kvshade::kernels::cpu_internal

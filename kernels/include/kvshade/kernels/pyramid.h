// MiniKV's pyramid layer budgets (docs/ALGORITHM.md): for m layers, mean budget x and depth
// delta, layer 0 gets 2x - x/delta, layer m-1 gets x/delta, linear in between, so lower
// layers keep more. Host-side scalar math shared by every backend.
#pragma once

#include <vector>

#include "absl/status/statusor.h"

namespace kvshade::kernels {

// Budget fraction per layer; InvalidArgument unless m >= 1, 0 < x <= 1, delta >= 1 and
// every layer's budget stays within [0, 1].
absl::StatusOr<std::vector<double>> PyramidBudgets(int m, double x, double delta = 7.0);

}  // namespace kvshade::kernels

// MiniKV's pyramid layer budgets (docs/ALGORITHM.md "Pyramid budget"): layer 0 gets
// 2x - x/delta, layer m-1 gets x/delta, linear in between, so the mean over layers is x.
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvshade/kernels/pyramid.h"

namespace kvshade::kernels {

absl::StatusOr<std::vector<double>> PyramidBudgets(int m, double x, double delta) {
  if (m < 1) return absl::InvalidArgumentError(absl::StrCat("PyramidBudgets: m must be >= 1, got ", m));
  if (!(x > 0.0 && x <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("PyramidBudgets: x must be in (0, 1], got ", x));
  }
  if (!(delta >= 1.0) || !std::isfinite(delta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("PyramidBudgets: delta must be finite and >= 1, got ", delta));
  }
  // One layer: first == last; it gets the mean budget.
  if (m == 1) return std::vector<double>{x};
  const double first = 2.0 * x - x / delta;
  const double last = x / delta;
  // The largest budget is layer 0's (first >= last since delta >= 1); the smallest is > 0.
  if (first > 1.0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PyramidBudgets: layer 0 budget 2x - x/delta = ", first, " exceeds 1 (x = ", x,
        ", delta = ", delta, "); lower x or delta"));
  }
  std::vector<double> out(m);
  for (int l = 0; l < m; ++l) out[l] = first + (last - first) * l / (m - 1);
  return out;
}

}  // namespace kvshade::kernels

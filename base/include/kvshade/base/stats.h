// Percentiles of measured samples (latencies, round trips) for the CLI's reports and the
// benchmarks: one definition, linear interpolation between the two nearest ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvshade::base {

// The p-quantile (p in [0, 1]) of `v`, interpolated between the two samples around rank
// p * (n - 1); 0 for no samples.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(idx), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

}  // namespace kvshade::base

// Reference computations in double precision, single-threaded: the yardstick of the
// accuracy tests (reference.h).
#include "kvshade/kernels/reference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvshade::kernels::reference {

void ExactAttention(const LayerShape& shape, const float* q, const float* k, const float* v,
                    int n, float scale, float* out) {
  const int h = shape.h, g = shape.g, d = shape.d;
  std::vector<double> logits(std::max(n, 0));
  std::vector<double> acc(d);
  for (int qh = 0; qh < h * g; ++qh) {
    const int hh = qh / g;
    const float* qv = q + size_t(qh) * d;
    double mx = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < n; ++t) {
      const float* kt = k + (size_t(t) * h + hh) * d;
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(qv[c]) * kt[c];
      logits[t] = dot * scale;
      mx = std::max(mx, logits[t]);
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    double sum = 0;
    for (int t = 0; t < n; ++t) {
      const double w = std::exp(logits[t] - mx);
      sum += w;
      const float* vt = v + (size_t(t) * h + hh) * d;
      for (int c = 0; c < d; ++c) acc[c] += w * vt[c];
    }
    for (int c = 0; c < d; ++c) out[size_t(qh) * d + c] = n > 0 ? float(acc[c] / sum) : 0.0f;
  }
}

}  // namespace kvshade::kernels::reference

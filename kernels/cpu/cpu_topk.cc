// CPU TopK: per row of scores [rows, cols] f32, the k best eligible columns, best first.
// Order (a strict total order, so the result is unique and deterministic):
//   - any number beats NaN (NaN scores are worse than every number, +-inf included);
//   - largest=true: larger score first; largest=false: smaller score first;
//   - equal scores (including +0 == -0, and NaN vs NaN): lower column first.
// Columns with mask[row, col] != 0 are never chosen. Every row's eligible count is checked
// before any output is written: InvalidArgument names the first row with fewer than k.
// Workspace: [rows, cols] int32 candidate lists (one per row); OpenMP over rows.
#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/validate.h"
#include "cpu/cpu_backend.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::kernels {

size_t CpuBackend::TopKWorkspaceBytes(int rows, int cols, int /*k*/) const {
  if (rows < 0 || cols < 0) return 0;
  return size_t(rows) * size_t(cols) * sizeof(int32_t);
}

absl::Status CpuBackend::TopK(absl::Span<const float> scores, absl::Span<const uint8_t> mask,
                              int rows, int cols, int k, bool largest, absl::Span<int32_t> out,
                              Workspace ws, Stream) {
  KVSHADE_RETURN_IF_ERROR(validate::TopK(scores.size(), mask.size(), rows, cols, k, out.size(),
                                         ws, TopKWorkspaceBytes(rows, cols, k)));
  const bool has_mask = !mask.empty();
  if (has_mask) {
    for (int row = 0; row < rows; ++row) {
      const uint8_t* m = mask.data() + int64_t{row} * cols;
      int eligible = 0;
      for (int c = 0; c < cols; ++c) eligible += m[c] == 0;
      if (eligible < k) {
        return absl::InvalidArgumentError(absl::StrCat("TopK: row ", row, " has ", eligible,
                                                       " eligible (unmasked) columns, need k = ",
                                                       k));
      }
    }
  }
  int32_t* cand_all = static_cast<int32_t*>(ws.data);

#pragma omp parallel for schedule(dynamic, 1)
  for (int row = 0; row < rows; ++row) {
    const float* s = scores.data() + int64_t{row} * cols;
    const uint8_t* m = has_mask ? mask.data() + int64_t{row} * cols : nullptr;
    int32_t* cand = cand_all + int64_t{row} * cols;
    int count = 0;
    for (int c = 0; c < cols; ++c) {
      if (m == nullptr || m[c] == 0) cand[count++] = c;
    }
    auto better = [s, largest](int32_t x, int32_t y) {
      const float a = s[x], b = s[y];
      const bool na = std::isnan(a), nb = std::isnan(b);
      if (na != nb) return nb;  // a number beats NaN
      if (!na && a != b) return largest ? a > b : a < b;
      return x < y;
    };
    std::partial_sort(cand, cand + k, cand + count, better);
    std::copy(cand, cand + k, out.data() + int64_t{row} * k);
  }
  return absl::OkStatus();
}

}  // namespace kvshade::kernels

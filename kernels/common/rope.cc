// RoPE frequency tables (MakeRopeTable) and the reference rotation (ApplyRopeReference).
// Every backend applies the table built here; the scaling formulas reproduce Hugging Face
// transformers' `modeling_rope_utils` (default, linear, llama3, yarn), evaluated in double
// precision and rounded once to float per frequency.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/rope_math.h"
#include "kvshade/kernels/rope.h"

namespace kvshade::kernels {
namespace {

absl::Status Bad(const std::string& field, const std::string& expected, double actual) {
  return absl::InvalidArgumentError(
      absl::StrCat("RopeSpec.", field, ": expected ", expected, ", got ", actual));
}

// Llama-3.1 band-wise scaling (transformers `_compute_llama3_parameters`). With
// wavelen = 2*pi/inv_freq, low_wavelen = original_max_position/low_freq_factor and
// high_wavelen = original_max_position/high_freq_factor:
//   wavelen < high_wavelen : unchanged (high frequencies)
//   wavelen > low_wavelen  : inv_freq / factor (low frequencies)
//   otherwise              : (1 - s) * inv_freq/factor + s * inv_freq with
//                            s = (original_max_position/wavelen - low_freq_factor) /
//                                (high_freq_factor - low_freq_factor)
double Llama3InvFreq(double inv_freq, const RopeSpec& spec) {
  const double factor = spec.factor;
  const double low = spec.low_freq_factor, high = spec.high_freq_factor;
  const double old_context = spec.original_max_position;
  const double low_wavelen = old_context / low;
  const double high_wavelen = old_context / high;
  const double wavelen = 2.0 * std::numbers::pi / inv_freq;
  if (wavelen < high_wavelen) return inv_freq;
  if (wavelen > low_wavelen) return inv_freq / factor;
  const double smooth = (old_context / wavelen - low) / (high - low);
  return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq;
}

// YaRN "NTK-by-parts" (transformers `_compute_yarn_parameters`, truncate = true, no
// explicit attention_factor / mscale overrides). For rotary dim `dim` and base theta, the
// pair index that completes `rot` rotations over the original context is
//   corr(rot) = dim * ln(original_max_position / (rot * 2*pi)) / (2 * ln(theta));
// low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), dim - 1)
// (high += 0.001 when equal). Pair i gets ramp_i = clamp((i - low) / (high - low), 0, 1),
// mask_i = 1 - ramp_i, and
//   inv_freq_i = inv_freq_i/factor * (1 - mask_i) + inv_freq_i * mask_i,
// i.e. high-frequency pairs (i < low) keep their frequency (extrapolation) and
// low-frequency pairs (i > high) are interpolated by `factor`.
double YarnInvFreq(double inv_freq, int i, int dim, const RopeSpec& spec) {
  const double base = spec.theta;
  const double orig = spec.original_max_position;
  auto corr = [&](double rot) {
    return dim * std::log(orig / (rot * 2.0 * std::numbers::pi)) / (2.0 * std::log(base));
  };
  double low = std::max(std::floor(corr(spec.beta_fast)), 0.0);
  double high = std::min(std::ceil(corr(spec.beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
  const double mask = 1.0 - ramp;
  const double interp = inv_freq / spec.factor;
  return interp * (1.0 - mask) + inv_freq * mask;
}

// YaRN attention factor: 0.1 * ln(factor) + 1 (1 when factor <= 1), multiplied into cos
// and sin.
double YarnMscale(double factor) { return factor <= 1.0 ? 1.0 : 0.1 * std::log(factor) + 1.0; }

absl::Status ValidateSpec(const RopeSpec& spec, int d) {
  if (d < 1) return Bad("d (head dim)", ">= 1", d);
  if (!(spec.theta > 0) || !std::isfinite(spec.theta)) return Bad("theta", "finite > 0", spec.theta);
  const int rd = spec.rotary_dim == 0 ? d : spec.rotary_dim;
  if (rd < 0 || rd > d) {
    return Bad("rotary_dim", absl::StrCat("in [0, d=", d, "] (0 = d)"), spec.rotary_dim);
  }
  if (rd % 2 != 0) return Bad("rotary_dim", "even (resolved against d)", rd);
  if (spec.pairing != RopePairing::kHalfSplit && spec.pairing != RopePairing::kInterleaved) {
    return Bad("pairing", "kHalfSplit or kInterleaved", static_cast<int>(spec.pairing));
  }
  switch (spec.scaling) {
    case RopeScaling::kNone:
      return absl::OkStatus();
    case RopeScaling::kLinear:
      if (!(spec.factor >= 1) || !std::isfinite(spec.factor)) {
        return Bad("factor", "finite >= 1 for linear scaling", spec.factor);
      }
      return absl::OkStatus();
    case RopeScaling::kLlama3:
      if (!(spec.factor >= 1) || !std::isfinite(spec.factor)) {
        return Bad("factor", "finite >= 1 for llama3 scaling", spec.factor);
      }
      if (!(spec.low_freq_factor > 0) || !std::isfinite(spec.low_freq_factor)) {
        return Bad("low_freq_factor", "finite > 0", spec.low_freq_factor);
      }
      if (!(spec.high_freq_factor > spec.low_freq_factor) ||
          !std::isfinite(spec.high_freq_factor)) {
        return Bad("high_freq_factor",
                   absl::StrCat("finite > low_freq_factor (", spec.low_freq_factor, ")"),
                   spec.high_freq_factor);
      }
      if (spec.original_max_position <= 0) {
        return Bad("original_max_position", "> 0", spec.original_max_position);
      }
      return absl::OkStatus();
    case RopeScaling::kYarn:
      if (!(spec.factor >= 1) || !std::isfinite(spec.factor)) {
        return Bad("factor", "finite >= 1 for yarn scaling", spec.factor);
      }
      if (spec.original_max_position <= 0) {
        return Bad("original_max_position", "> 0", spec.original_max_position);
      }
      // ln(theta) is a denominator of the correction-dim formula.
      if (!(spec.theta > 1)) return Bad("theta", "> 1 for yarn scaling", spec.theta);
      if (!(spec.beta_slow > 0) || !std::isfinite(spec.beta_slow)) {
        return Bad("beta_slow", "finite > 0", spec.beta_slow);
      }
      if (!(spec.beta_fast > spec.beta_slow) || !std::isfinite(spec.beta_fast)) {
        return Bad("beta_fast", absl::StrCat("finite > beta_slow (", spec.beta_slow, ")"),
                   spec.beta_fast);
      }
      return absl::OkStatus();
  }
  return Bad("scaling", "kNone, kLinear, kLlama3 or kYarn", static_cast<int>(spec.scaling));
}

}  // namespace

absl::StatusOr<RopeTable> MakeRopeTable(const RopeSpec& spec, int d) {
  if (absl::Status st = ValidateSpec(spec, d); !st.ok()) return st;
  RopeTable table;
  table.rotary_dim = spec.rotary_dim == 0 ? d : spec.rotary_dim;
  const int rd = table.rotary_dim;
  table.inv_freq.resize(rd / 2);
  for (int i = 0; i < rd / 2; ++i) {
    // Default RoPE: inv_freq_i = theta^(-2i / rotary_dim).
    double f = 1.0 / std::pow(static_cast<double>(spec.theta), (2.0 * i) / rd);
    switch (spec.scaling) {
      case RopeScaling::kNone:
      case RopeScaling::kLinear:  // linear scales positions instead (position_scale)
        break;
      case RopeScaling::kLlama3:
        f = Llama3InvFreq(f, spec);
        break;
      case RopeScaling::kYarn:
        f = YarnInvFreq(f, i, rd, spec);
        break;
    }
    table.inv_freq[i] = static_cast<float>(f);
  }
  if (spec.scaling == RopeScaling::kLinear) {
    table.position_scale = static_cast<float>(1.0 / spec.factor);  // positions / factor
  }
  if (spec.scaling == RopeScaling::kYarn) {
    table.magnitude = static_cast<float>(YarnMscale(spec.factor));
  }
  return table;
}

void ApplyRopeReference(const RopeTable& table, RopePairing pairing, long long pos, float* x,
                        int d) {
  const int half = table.rotary_dim / 2;
  if (table.rotary_dim > d) return;  // not a table for this head dim; leave x untouched
  for (int i = 0; i < half; ++i) {
    float c, s;
    rope_math::CosSin(table, pos, i, &c, &s);
    int i0, i1;
    rope_math::PairIndex(pairing, table.rotary_dim, i, &i0, &i1);
    rope_math::Rotate(c, s, &x[i0], &x[i1]);
  }
}

}  // namespace kvshade::kernels

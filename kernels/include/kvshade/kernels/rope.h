// Rotary position embedding (RoPE) specification and the host-side frequency table that
// every backend applies. Scaling schemes follow the model families that use them:
//   none    : inv_freq_i = theta^(-2i/rotary_dim)
//   linear  : positions divided by `factor`
//   llama3  : Llama-3.1 band-wise frequency scaling (factor, low/high_freq_factor,
//             original_max_position)
//   yarn    : YaRN NTK-by-parts interpolation (factor, beta_fast, beta_slow,
//             original_max_position) with attention scaling mscale = 0.1*ln(factor)+1
//             applied to cos and sin (as Hugging Face transformers does)
// Pairing: kHalfSplit ("neox", Llama/HF): dimension i pairs with i + rotary_dim/2;
//          kInterleaved (GPT-J): dimension 2i pairs with 2i+1.
// Dimensions >= rotary_dim pass through unchanged.
#pragma once

#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvshade::kernels {

enum class RopeScaling { kNone, kLinear, kLlama3, kYarn };
enum class RopePairing { kHalfSplit, kInterleaved };

struct RopeSpec {
  float theta = 10000.0f;
  int rotary_dim = 0;  // 0 means the full head dim
  RopeScaling scaling = RopeScaling::kNone;
  RopePairing pairing = RopePairing::kHalfSplit;
  float factor = 1.0f;              // linear, llama3, yarn
  float low_freq_factor = 1.0f;     // llama3
  float high_freq_factor = 4.0f;    // llama3
  int original_max_position = 8192; // llama3, yarn
  float beta_fast = 32.0f;          // yarn
  float beta_slow = 1.0f;           // yarn
};

// The per-pair frequency table of a spec for head dim `d`.
struct RopeTable {
  int rotary_dim = 0;                // even, <= d
  std::vector<float> inv_freq;       // [rotary_dim/2], radians per position
  float position_scale = 1.0f;       // positions are multiplied by this (linear scaling)
  float magnitude = 1.0f;            // cos/sin multiplied by this (yarn mscale)
};

// Validates `spec` for head dim `d` (InvalidArgument naming the bad field) and builds its
// table.
absl::StatusOr<RopeTable> MakeRopeTable(const RopeSpec& spec, int d);

// Reference RoPE of one head vector x [d] fp32 at absolute position `pos`, in place.
// Angles are computed in double precision then rounded to float; backends match this to
// fp32 tolerance.
void ApplyRopeReference(const RopeTable& table, RopePairing pairing, long long pos, float* x,
                        int d);

}  // namespace kvshade::kernels

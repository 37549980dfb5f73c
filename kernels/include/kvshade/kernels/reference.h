// Plain, obviously-correct reference computations (double accumulation, no blocking, no
// threads) that tests and benchmarks compare backends against. Host memory, fp32 in/out.
#pragma once

#include "kvshade/kernels/backend.h"

namespace kvshade::kernels::reference {

// Exact decode attention of one token over n cached tokens.
//   q   : [h*g, d] f32      k, v : [n, h, d] f32 (post-RoPE keys)
//   out : [h*g, d] f32 = softmax(q k^T * scale) v per query head (KV head = qh / g)
void ExactAttention(const LayerShape& shape, const float* q, const float* k, const float* v,
                    int n, float scale, float* out);

}  // namespace kvshade::kernels::reference

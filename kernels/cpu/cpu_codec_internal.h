// Single-chunk value codec routines of the CPU backend, shared by cpu_codec.cc
// (EncodeValueChunks / DecodeValueChunks) and cpu_reconstruct.cc (fused gather + decode).
// Layouts are those of codec.h; callers have validated spec, C and d.
#pragma once

#include <cstddef>

#include "kvshade/kernels/codec.h"

namespace kvshade::kernels::cpu_internal {

// Encodes one chunk. `v` points at token 0, channel 0 of the chunk; token t channel c is
// at v[t*token_stride + c] (elements). `out` receives ValueChunkBytes(spec, C, d) bytes.
void EncodeValueChunk(const bf16* v, int64_t token_stride, int C, int d,
                      const ValueCodecSpec& spec, std::byte* out);

// Decodes one chunk of ValueChunkBytes(spec, C, d) bytes into out [C, d] bf16.
void DecodeValueChunk(const std::byte* encoded, int C, int d, const ValueCodecSpec& spec,
                      bf16* out);

}  // namespace kvshade::kernels::cpu_internal

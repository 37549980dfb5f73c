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

// Decodes tokens [t0, t0 + n) of one encoded chunk of C tokens into out [n, d] bf16: the
// same values as rows t0.. of DecodeValueChunk (every codec is token-separable: fp8 shares
// the chunk's one scale, KIVI groups lie within a token). 0 <= t0, t0 + n <= C.
void DecodeValueRows(const std::byte* encoded, int C, int d, const ValueCodecSpec& spec, int t0,
                     int n, bf16* out);

}  // namespace kvshade::kernels::cpu_internal

// The layout of a worker's K and V slot buffers: the one definition that Attach reports
// (slot_buffer_bytes, slots_per_head), that CUDA IPC delivery copies rows by and that UCX
// RMA delivery puts rows by. Each of K and V is [layers, heads, slots_per_head, slot_tokens,
// head_dim] bf16, row-major; a "row" is one slot's [slot_tokens, head_dim] block (the layout
// v1.CudaIpcSlotBuffers documents for workers). A slot holds a chunk (slot_tokens = C), or
// a selection unit (slot_tokens = u, slots_per_head = sparse_budget * C/u: the same bytes).
#pragma once

#include <cstdint>

#include "kvshade/service/model.h"

namespace kvshade::service {

struct SlotLayout {
  uint32_t layers = 0;
  uint32_t heads = 0;           // KV heads
  uint32_t slots_per_head = 0;  // 0: the session's profile selects nothing
  uint32_t slot_tokens = 0;  // tokens per slot: C, or the selection unit
  uint32_t head_dim = 0;

  // The slot buffers of a session of this model and profile: a shadow profile has
  // sparse_budget slots per head (sparse_budget * C/u with selection units of u tokens),
  // every other profile none.
  // (service/slot_table.cc: the profile's strategy says how many slots it selects.)
  static SlotLayout Of(const ModelInfo& model, const ProfileInfo& profile);

  // Bytes of one row (one slot: slot_tokens x head_dim bf16).
  uint64_t RowBytes() const { return uint64_t{slot_tokens} * head_dim * 2; }
  // The row index of (layer, head, slot) in each buffer.
  uint64_t Row(uint32_t layer, uint32_t head, uint32_t slot) const {
    return (uint64_t{layer} * heads + head) * slots_per_head + slot;
  }
  // Bytes of each of the K and V buffers.
  uint64_t BufferBytes() const { return uint64_t{layers} * heads * slots_per_head * RowBytes(); }
};

}  // namespace kvshade::service

// The data path's domain types: what Engine::Select and Engine::Attend take and fill, and
// the layer parts an ingest stream takes.
// Requests are views over caller-owned bytes (a wire frame, a proto's strings, a test's
// vectors) that must stay valid for the call; nothing is copied before it is validated and
// converted once into the backend's input. Results are plain structs the caller may keep
// and pass again: their vectors are cleared, not freed, so a data plane that reuses one
// result per connection allocates nothing per call in steady state.
//
// The wire adapters (gRPC: wire.cc over v1 messages; UCX: transport/frame.h binary frames)
// translate at the edge into these types; the engine never sees a wire message on this
// path.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"
#include "kvshade/kernels/types.h"
#include "kvshade/v1/kvshade.pb.h"  // the DType and SelectPurpose enums only

namespace kvshade::service {

// A tensor the caller owns: dtype, shape and raw little-endian bytes. Empty (rank 0 and no
// bytes) means "not given".
struct TensorView {
  static constexpr int kMaxRank = 4;
  v1::DType dtype = v1::DTYPE_UNSPECIFIED;
  int rank = 0;
  int64_t shape[kMaxRank] = {0, 0, 0, 0};
  std::string_view data;

  bool empty() const { return rank == 0 && data.empty(); }
  absl::Span<const int64_t> dims() const { return {shape, static_cast<size_t>(rank)}; }
};

// --- Ingest ------------------------------------------------------------------------------

// One layer part of an Ingest stream (v1.IngestLayer's fields), its tensors as views:
// what a data plane that received the bytes into buffers of its own hands the engine
// (Engine::IngestStream::AddLayer), so the part is copied once, into its layer.
struct IngestLayerView {
  uint32_t layer = 0;
  uint64_t token_offset = 0;
  bool last_part = false;
  TensorView k, v;                 // [n_part, h, d] pre-RoPE, the model's dtype
  TensorView observation_queries;  // [w, hq, d] with the layer's final part, or empty
};

// --- SelectAndReconstruct ---------------------------------------------------------------

struct SelectQueryView {
  std::string_view attachment_id;
  TensorView q;       // [hq, d] post-RoPE, the model's dtype
  TensorView chunks;  // model-native selection: INT32 [h, m], m <= slots per head; else empty
  // Stage the step's new token (k_new pre-RoPE [h, d], v_new [h, d]) as token
  // `stage_token_id` (v1.SelectQuery.stage_token_id); not attended here.
  TensorView k_new, v_new;
  bool stage = false;
  int32_t stage_token_id = 0;
  v1::SelectPurpose purpose = v1::SELECT_PURPOSE_UNSPECIFIED;  // counted, nothing else
  bool hold = false;  // stage_hold: wait for CommitStaged after the last layer
};

struct SelectRequestView {
  uint32_t layer = 0;
  absl::Span<const SelectQueryView> queries;
};

// One query's slot-table change (v1.SlotDelta has the meaning of every field).
struct SlotDeltaResult {
  std::vector<uint32_t> head, slot;
  std::vector<int32_t> chunk;
  std::vector<int64_t> position;  // of the first of each miss's chunk_size tokens
  // The misses' rows [misses, chunk_size, d] bf16, in delta order, when they travel in the
  // reply (inline delivery, and UCX RMA, whose adapter puts them); empty when `delivered`.
  std::vector<kernels::bf16> keys, values;
  // Rows (tokens) per miss: the chunk size C, or the selection unit u with selection
  // units (v1.SlotDelta.slot_tokens).
  uint32_t chunk_size = 0, head_dim = 0;
  uint32_t selected = 0, hits = 0;
  bool delivered = false;  // written into the worker's slot buffers (CUDA IPC)
  bool fallback = false;    // the recall guard widened or opened this layer
  uint64_t tokens = 0;      // the session's length after the call

  uint32_t misses() const { return static_cast<uint32_t>(head.size()); }
  void Clear();
};

struct SelectResult {
  std::vector<SlotDeltaResult> deltas;  // one per query, in request order
  // Sizes `deltas` to n, clearing each (capacity kept).
  void Reset(size_t n);
};

// --- Attend ------------------------------------------------------------------------------

struct AttendQueryView {
  std::string_view attachment_id;
  TensorView q;      // [hq, d] post-RoPE
  TensorView k_new;  // optional: this step's token, pre-RoPE [h, d]
  TensorView v_new;  // optional: [h, d]
  // Stage the new token as token `stage_token_id` (v1.AttendQuery.stage_token_id).
  bool stage = false;
  int32_t stage_token_id = 0;
  bool hold = false;  // stage_hold
};

struct AttendRequestView {
  uint32_t layer = 0;
  absl::Span<const AttendQueryView> queries;
};

struct AttendResult {
  // Per query (of its session's shape): output [hq, d] fp32 and log-sum-exp [hq] fp32
  // (natural log; -inf for none).
  std::vector<std::vector<float>> outputs, lse;
  // Per query: the session's length after the call (a staged token's commit included).
  std::vector<uint64_t> tokens;
  void Reset(size_t n);
};

}  // namespace kvshade::service

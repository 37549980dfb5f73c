// Delivery of reconstructed misses: the one place that knows where a selected chunk's K
// and V rows go once the decode kernels have rebuilt them.
//
// Three sinks, one per v1.DeliveryMode:
// - INLINE: the rows travel in the reply (SlotDeltaResult keys/values).
// - CUDA_IPC: the rows are scattered on the device straight into the worker's slot buffers
//   (PeerSlots), rows placed by SlotLayout::Row; the delta says `delivered`.
// - UCX_RMA: the rows come to the host like INLINE; the UCX adapter then puts them into
//   the worker's registered buffers, one put per run of consecutive rows (ForEachRowRun),
//   and sets `delivered`.
// A Delivery batches the device work of one decode sub-batch: one index upload, two
// row-copy launches per destination, one synchronize, whatever mix of sinks it carries.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/service/decode.h"
#include "kvshade/service/slot_layout.h"

namespace kvshade::service {

class EngineImpl;
struct PeerSlots;

class Delivery {
 public:
  Delivery(EngineImpl& engine, kernels::Stream stream) : e_(engine), stream_(stream) {}

  // The item's misses, rows `src_rows` of the reconstruct output, go into `delta` (keys
  // and values, in that order). `delta` must stay valid until Run returns.
  void ToReply(const std::vector<int64_t>& src_rows, SlotDeltaResult* delta);
  // The item's misses go into the worker's slot buffers at `dst_rows` (SlotLayout::Row);
  // `delta->delivered` is set once Run has succeeded.
  void ToPeer(const PeerSlots& peer, const std::vector<int64_t>& src_rows,
              const std::vector<int64_t>& dst_rows, SlotDeltaResult* delta);

  // Copies every planned row out of `keys` / `values` (the reconstruct output, rows of
  // `row_bytes`; null when nothing missed) and waits for the copies, then marks the peer
  // deltas delivered. The caller's stream must have the reconstruct queued before.
  absl::Status Run(const kernels::bf16* keys, const kernels::bf16* values, size_t row_bytes);

 private:
  struct PeerJob {
    const PeerSlots* peer;
    size_t first, n;  // into the index arrays
    SlotDeltaResult* delta;
  };
  struct ReplyJob {
    size_t first, n;  // into the gathered rows
    SlotDeltaResult* delta;
  };
  EngineImpl& e_;
  kernels::Stream stream_;
  std::vector<int64_t> peer_src_, peer_dst_, reply_src_;
  std::vector<PeerJob> peer_jobs_;
  std::vector<ReplyJob> reply_jobs_;
};

// Walks a delta's misses (head[i], slot[i]) in order as runs of consecutive slot-buffer
// rows: fn(first miss, run length, first row). Returns false (stopping) when a miss's
// head or slot lies outside `layout` or `layer` is not one of its layers.
bool ForEachRowRun(const SlotLayout& layout, uint32_t layer, const SlotDeltaResult& delta,
                   const std::function<bool(uint32_t first, uint32_t n, uint64_t row)>& fn);

}  // namespace kvshade::service

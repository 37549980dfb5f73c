// Delivery (delivery.h): reply rows gathered on the device and brought to the host in one
// copy per tensor; peer rows scattered into CUDA IPC slot buffers; RMA row runs.
#include "delivery.h"

#include <cstring>

#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

using kernels::bf16;
using storage::ArenaKind;

void Delivery::ToReply(const std::vector<int64_t>& src_rows, SlotDeltaResult* delta) {
  if (src_rows.empty()) return;
  reply_jobs_.push_back({reply_src_.size(), src_rows.size(), delta});
  reply_src_.insert(reply_src_.end(), src_rows.begin(), src_rows.end());
}

void Delivery::ToPeer(const PeerSlots& peer, const std::vector<int64_t>& src_rows,
                      const std::vector<int64_t>& dst_rows, SlotDeltaResult* delta) {
  peer_jobs_.push_back({&peer, peer_src_.size(), src_rows.size(), delta});
  peer_src_.insert(peer_src_.end(), src_rows.begin(), src_rows.end());
  peer_dst_.insert(peer_dst_.end(), dst_rows.begin(), dst_rows.end());
}

absl::Status Delivery::Run(const bf16* keys, const bf16* values, size_t row_bytes) {
  const size_t np = peer_src_.size(), nr = reply_src_.size();
  StageTimer timer(e_.metrics(), "deliver");
  if (np + nr > 0) {
    kernels::Backend& b = e_.backend();
    const size_t row_elems = row_bytes / sizeof(bf16);
    if (row_bytes % 16 != 0) {
      // Rows CopyRows cannot move (C*d*2 not a multiple of 16: only the CPU backend takes
      // such small head dims, and it has no peer buffers); replies copy row by row.
      if (np > 0) return absl::InternalError("peer delivery of rows not a multiple of 16 bytes");
      for (const ReplyJob& j : reply_jobs_) {
        j.delta->keys.resize(j.n * row_elems);
        j.delta->values.resize(j.n * row_elems);
        for (size_t x = 0; x < j.n; ++x) {
          const size_t src = static_cast<size_t>(reply_src_[j.first + x]) * row_elems;
          KVSHADE_RETURN_IF_ERROR(b.CopyToHost(j.delta->keys.data() + x * row_elems, keys + src, row_bytes, stream_));
          KVSHADE_RETURN_IF_ERROR(b.CopyToHost(j.delta->values.data() + x * row_elems, values + src, row_bytes, stream_));
        }
      }
      return b.Synchronize(stream_);
    }
    // One index upload: [peer src | peer dst | reply src | reply dst (0..nr-1)].
    std::vector<int64_t> idx;
    idx.reserve(2 * (np + nr));
    idx.insert(idx.end(), peer_src_.begin(), peer_src_.end());
    idx.insert(idx.end(), peer_dst_.begin(), peer_dst_.end());
    idx.insert(idx.end(), reply_src_.begin(), reply_src_.end());
    for (size_t i = 0; i < nr; ++i) idx.push_back(static_cast<int64_t>(i));
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock id, e_.UploadOn(stream_, idx.data(), idx.size() * 8, ArenaKind::kOther));
    const int64_t* d = static_cast<const int64_t*>(id.data());
    for (const PeerJob& j : peer_jobs_) {
      if (j.n == 0) continue;
      const int n = static_cast<int>(j.n);
      KVSHADE_RETURN_IF_ERROR(b.CopyRows(keys, j.peer->k, row_bytes, n, d + j.first, d + np + j.first, stream_));
      KVSHADE_RETURN_IF_ERROR(b.CopyRows(values, j.peer->v, row_bytes, n, d + j.first, d + np + j.first, stream_));
    }
    DeviceBlock gathered;
    if (nr > 0) {
      // The reply rows, gathered into one [2, nr] block of rows, come over in one copy.
      KVSHADE_ASSIGN_OR_RETURN(gathered, e_.Alloc(2 * nr * row_bytes, ArenaKind::kOther));
      bf16* gk = static_cast<bf16*>(gathered.data());
      bf16* gv = gk + nr * row_elems;
      const int64_t* rs = d + 2 * np;
      const int64_t* rd = rs + nr;
      KVSHADE_RETURN_IF_ERROR(b.CopyRows(keys, gk, row_bytes, static_cast<int>(nr), rs, rd, stream_));
      KVSHADE_RETURN_IF_ERROR(b.CopyRows(values, gv, row_bytes, static_cast<int>(nr), rs, rd, stream_));
      // Each reply's rows are contiguous in the gathered block: copied straight into it.
      for (const ReplyJob& j : reply_jobs_) {
        j.delta->keys.resize(j.n * row_elems);
        j.delta->values.resize(j.n * row_elems);
        KVSHADE_RETURN_IF_ERROR(b.CopyToHost(j.delta->keys.data(), gk + j.first * row_elems, j.n * row_bytes, stream_));
        KVSHADE_RETURN_IF_ERROR(b.CopyToHost(j.delta->values.data(), gv + j.first * row_elems, j.n * row_bytes, stream_));
      }
      KVSHADE_RETURN_IF_ERROR(b.Synchronize(stream_));
    } else {
      KVSHADE_RETURN_IF_ERROR(b.Synchronize(stream_));
    }
  }
  for (const PeerJob& j : peer_jobs_) j.delta->delivered = true;
  return absl::OkStatus();
}

bool ForEachRowRun(const SlotLayout& layout, uint32_t layer, const SlotDeltaResult& delta,
                   const std::function<bool(uint32_t first, uint32_t n, uint64_t row)>& fn) {
  const uint32_t m = delta.misses();
  if (layer >= layout.layers || delta.slot.size() != m) return false;
  auto row_of = [&](uint32_t i, uint64_t* row) {
    if (delta.head[i] >= layout.heads || delta.slot[i] >= layout.slots_per_head) return false;
    *row = layout.Row(layer, delta.head[i], delta.slot[i]);
    return true;
  };
  for (uint32_t i0 = 0; i0 < m;) {
    uint64_t row0 = 0, next = 0;
    if (!row_of(i0, &row0)) return false;
    // Misses in consecutive slots of one head are consecutive rows.
    uint32_t run = 1;
    while (i0 + run < m && row_of(i0 + run, &next) && next == row0 + run) ++run;
    if (!fn(i0, run, row0)) return false;
    i0 += run;
  }
  return true;
}

}  // namespace kvshade::service

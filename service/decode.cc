// The decode path's result types (decode.h): cleared in place, capacity kept.
#include "kvshade/service/decode.h"

namespace kvshade::service {

void SlotDeltaResult::Clear() {
  head.clear();
  slot.clear();
  chunk.clear();
  position.clear();
  keys.clear();
  values.clear();
  chunk_size = head_dim = selected = hits = 0;
  delivered = false;
  fallback = false;
  tokens = 0;
}

void SelectResult::Reset(size_t n) {
  deltas.resize(n);
  for (SlotDeltaResult& d : deltas) d.Clear();
}

void AttendResult::Reset(size_t n) {
  outputs.resize(n);
  lse.resize(n);
  tokens.assign(n, 0);
  for (auto& o : outputs) o.clear();
  for (auto& l : lse) l.clear();
}

}  // namespace kvshade::service

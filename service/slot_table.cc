// EngineImpl::SlotTable: an attachment's slot tables read back, and optionally reset, so that
// a worker that lost a SelectAndReconstruct response can resynchronise (docs/API.md
// "Slot tables").
#include <mutex>
#include <vector>

#include "engine_impl.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/service/slot_layout.h"
#include "profile.h"
#include "status_util.h"

namespace kvshade::service {

SlotLayout SlotLayout::Of(const ModelInfo& model, const ProfileInfo& profile) {
  SlotLayout l;
  l.layers = static_cast<uint32_t>(model.layers);
  l.heads = static_cast<uint32_t>(model.shape.h);
  l.slots_per_head = static_cast<uint32_t>(ProfileOf(profile.kind).SlotsPerHead(profile));
  l.slot_tokens = static_cast<uint32_t>(profile.slot_tokens());
  l.head_dim = static_cast<uint32_t>(model.shape.d);
  return l;
}

absl::StatusOr<v1::SlotTableResponse> EngineImpl::SlotTable(const Tenant& t,
                                                            const v1::SlotTableRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckIdLength(r.attachment_id(), "attachment id"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, sessions_.Use(t.name, r.attachment_id()));
  const size_t h = static_cast<size_t>(a->session->model.shape.h);
  v1::SlotTableResponse resp;
  // The attachment's lock serialises this with its selects: a select either ran before
  // (and is in the table) or runs after (and, after a reset, finds every slot empty).
  std::lock_guard<std::mutex> lock(a->mu);
  for (size_t layer = 0; layer < a->slots.size(); ++layer) {
    service::SlotTable& table = a->slots[layer];
    if (!table.slots) continue;  // never selected on
    v1::LayerSlotTable* out = resp.add_layers();
    out->set_layer(static_cast<uint32_t>(layer));
    out->set_slots_per_head(static_cast<uint32_t>(table.k));
    std::vector<int32_t> chunks(h * static_cast<size_t>(table.k));
    if (!chunks.empty()) {
      KVSHADE_RETURN_IF_ERROR(
          Download(chunks.data(), table.slots.data(), chunks.size() * sizeof(int32_t)));
    }
    out->mutable_chunk()->Add(chunks.begin(), chunks.end());
  }
  // Dropped tables come back empty (every slot -1) on the layer's next select.
  if (r.reset()) {
    for (service::SlotTable& table : a->slots) table = service::SlotTable{};
  }
  return resp;
}

}  // namespace kvshade::service

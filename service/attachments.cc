// Attachments: Attach (values paged in, slot tables, the data-plane admission token),
// Detach, the slot buffers a peer registers for delivery, and an attachment's slot
// geometry for the data planes.
#include "kvshade/service/engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <numeric>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "status_util.h"
#include "kvshade/service/log.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

// ---------------------------------------------------------------------------------------
// Attachments

absl::StatusOr<std::shared_ptr<PeerSlots>> PeerSlots::Open(kernels::DeviceRuntime& backend,
                                                           const v1::CudaIpcSlotBuffers& b,
                                                           uint64_t need_bytes) {
  if (b.bytes() < need_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.bytes must be >= ", need_bytes,
        " (L * h * slots_per_head * C * d bf16 per buffer), got ", b.bytes()));
  }
  if (b.k_offset() % 16 != 0 || b.v_offset() % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc offsets must be multiples of 16, got k_offset ", b.k_offset(), ", v_offset ",
        b.v_offset()));
  }
  const bool shared = b.k_handle() == b.v_handle();
  if (shared && b.k_offset() < b.v_offset() + need_bytes && b.v_offset() < b.k_offset() + need_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc: the K and V buffers overlap in one allocation (k_offset ", b.k_offset(),
        ", v_offset ", b.v_offset(), ", ", need_bytes, " bytes each)"));
  }
  auto p = std::make_shared<PeerSlots>();
  p->backend = &backend;
  KVSHADE_ASSIGN_OR_RETURN(kernels::PeerBuffer km, backend.OpenPeerBuffer(b.k_handle()));
  p->maps.push_back(km);
  kernels::PeerBuffer vm = km;
  if (!shared) {
    KVSHADE_ASSIGN_OR_RETURN(vm, backend.OpenPeerBuffer(b.v_handle()));
    p->maps.push_back(vm);
  }
  for (const auto& [name, map, offset] :
       {std::tuple{"k", km, b.k_offset()}, std::tuple{"v", vm, b.v_offset()}}) {
    if (offset + need_bytes > map.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc: the ", name, " allocation has ", map.bytes, " bytes; offset ", offset,
          " + ", need_bytes, " bytes of slots do not fit"));
    }
  }
  p->k = reinterpret_cast<kernels::bf16*>(static_cast<std::byte*>(km.base) + b.k_offset());
  p->v = reinterpret_cast<kernels::bf16*>(static_cast<std::byte*>(vm.base) + b.v_offset());
  return p;
}

PeerSlots::~PeerSlots() {
  for (const kernels::PeerBuffer& m : maps) {
    absl::Status st = backend->ClosePeerBuffer(m);
    if (!st.ok()) spdlog::warn("closing a CUDA IPC slot buffer: {}", std::string(st.message()));
  }
}

absl::StatusOr<v1::AttachResponse> EngineImpl::Attach(const Tenant& t, const v1::AttachRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("Attach"));
  if (r.worker_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id must be <= 128 bytes, got ", r.worker_id().size()));
  }
  if (!v1::DeliveryMode_IsValid(r.delivery())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "delivery must be DELIVERY_MODE_INLINE, _UCX_RMA or _CUDA_IPC, got ", r.delivery()));
  }
  const bool ipc = r.delivery() == v1::DELIVERY_MODE_CUDA_IPC;
  if (r.has_cuda_ipc() != ipc) {
    return absl::InvalidArgumentError(
        ipc ? "delivery DELIVERY_MODE_CUDA_IPC needs cuda_ipc (the worker's slot buffers)"
            : "cuda_ipc is only for delivery DELIVERY_MODE_CUDA_IPC");
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_.FindSession(t.name, r.session_id()));
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(*s, "Attach"));
  const SlotLayout layout = SlotLayout::Of(s->model, s->profile);
  const uint32_t slots = layout.slots_per_head;
  const uint64_t slot_bytes = layout.BufferBytes();
  std::shared_ptr<PeerSlots> peer;
  if (ipc) {
    if (slots == 0) {
      return absl::InvalidArgumentError(
          "delivery DELIVERY_MODE_CUDA_IPC needs a session that selects chunks (a shadow "
          "profile); this one has no slots to deliver");
    }
    // Mapped before the attachment exists, so a bad handle leaves nothing behind.
    KVSHADE_ASSIGN_OR_RETURN(peer, PeerSlots::Open(*backend_, r.cuda_ipc(), slot_bytes));
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a,
                           sessions_.Attach(t.name, s, r.worker_id(), r.lease_ms(), r.writer()));
  v1::AttachResponse resp;
  resp.set_attachment_id(a->id);
  resp.set_lease_expires_unix_ms(sessions_.LeaseExpiry(*a));
  resp.set_chunk_size(s->profile.chunk_size);
  resp.set_slots_per_head(slots);
  resp.set_local_window(s->profile.local_window);
  resp.set_writer(a->writer);
  a->delivery = r.delivery();
  a->peer_slots = std::move(peer);
  resp.set_delivery(r.delivery());
  resp.set_slot_buffer_bytes(slot_bytes);
  resp.set_slot_tokens(layout.slot_tokens);
  // Page the session's spilled values in ahead of its first decode step. Synchronous: the
  // store has no prefetch thread (Init), so Prefetch runs inline and Attach answers once
  // they are resident. A read that fails fails the Attach with its error (UNAVAILABLE for
  // an I/O error, DATA_LOSS for bytes that fail their checksum), and the attachment is
  // undone: a worker is never attached to a session whose values cannot be read.
  std::vector<storage::SegmentId> ids;
  {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    for (const auto& seg : s->chain) {
      const Segment& owner = seg->values_owner();
      if (owner.values_in_store) ids.push_back(owner.id);
    }
  }
  if (!ids.empty()) {
    auto paged = std::make_shared<absl::Status>();
    store_->Prefetch(std::move(ids), [paged](absl::Status st) { *paged = std::move(st); });
    if (!paged->ok()) {
      (void)sessions_.Detach(t.name, a->id);
      NoteReadFailure(*s, *paged).IgnoreError();
      log::Event(spdlog::level::warn, "attach_page_in_failed")
          .Str("session", s->id)
          .Str("tenant", t.name)
          .Status(*paged);
      return absl::Status(paged->code(), absl::StrCat("attach: paging in the values of session '", s->id,
                                                      "' failed: ", paged->message()));
    }
  }
  UpdateGauges();
  log::Event(spdlog::level::info, "attached")
      .Str("attachment", a->id)
      .Str("session", s->id)
      .Str("tenant", t.name)
      .Str("worker", r.worker_id())
      .Bool("writer", a->writer)
      .Str("delivery", v1::DeliveryMode_Name(r.delivery()));
  return resp;
}

absl::StatusOr<v1::DetachResponse> EngineImpl::Detach(const Tenant& t, const v1::DetachRequest& r) {
  KVSHADE_RETURN_IF_ERROR(sessions_.Detach(t.name, r.attachment_id()));
  DropExports(r.attachment_id());
  UpdateGauges();
  log::Event(spdlog::level::info, "detached").Str("attachment", r.attachment_id()).Str("tenant", t.name);
  return v1::DetachResponse();
}

absl::StatusOr<Engine::SlotGeometry> EngineImpl::AttachmentSlots(const Tenant& t,
                                                                 const std::string& attachment_id) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, sessions_.Use(t.name, attachment_id));
  const Session& s = *a->session;
  Engine::SlotGeometry g;
  static_cast<SlotLayout&>(g) = SlotLayout::Of(s.model, s.profile);
  g.delivery = a->delivery;
  return g;
}

}  // namespace kvshade::service

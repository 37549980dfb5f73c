// Same-node export (docs/DESIGN.md "Same-node decode"): ExportSession hands a worker on
// this node a generation of its attachment's session state, named by shared regions
// (kernels/shared_memory.h), which the worker maps to run select, reconstruct and attend
// itself.
//
// What a generation holds in place, until the worker releases it, detaches, or its lease
// ends (RunMaintenance drops the generations of attachments that are gone):
//   - the sealed segments of the chain (shared_ptr: factors, landmarks and masks are
//     immutable once sealed; a refactorization swaps in new segments and leaves these),
//   - a SegmentPin on each segment's values (pinned segments are never spilled or moved),
//   - its own copies, in the arena, of what can still change in place: the open segment's
//     chunks (its blocks grow and are reallocated as tokens are appended),
//   - the static set and the exact tail: GetCache's blocks themselves (shared_ptr: a
//     rebuild allocates new ones and never writes these in place).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "profile.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::ArenaKind;

constexpr size_t kMaxGenerationsPerAttachment = 4;

}  // namespace

namespace {

// Regions of one response, deduplicated by id.
class RegionTable {
 public:
  RegionTable(kernels::DeviceRuntime& backend, v1::SessionExport* out, bool transient_device)
      : backend_(backend), out_(out), transient_device_(transient_device) {}

  absl::Status Ref(const void* p, v1::RegionRef* ref) {
    KVSHADE_ASSIGN_OR_RETURN(kernels::ExportedMemory m, backend_.ExportMemory(p));
    if (std::find(ids_.begin(), ids_.end(), m.region_id) == ids_.end()) {
      ids_.push_back(m.region_id);
      v1::SharedRegion* r = out_->add_regions();
      r->set_id(m.region_id);
      r->set_device(m.kind == kernels::ExportedMemory::Kind::kDeviceIpc);
      r->set_host_vmm(m.kind == kernels::ExportedMemory::Kind::kHostVmm);
      r->set_pid(m.pid);
      r->set_fd(m.fd);
      r->set_descriptor_broker(m.broker);
      r->set_cuda_ipc_handle(m.ipc_handle);
      r->set_bytes(m.region_bytes);
      r->set_transient(transient_device_ && r->device());
    }
    ref->set_region(m.region_id);
    ref->set_offset(m.offset);
    return absl::OkStatus();
  }

 private:
  kernels::DeviceRuntime& backend_;
  v1::SessionExport* out_;
  bool transient_device_;
  std::vector<uint64_t> ids_;
};

void WireRope(const kernels::RopeSpec& k, v1::RopeSpec* r) {
  r->set_theta(k.theta);
  r->set_rotary_dim(static_cast<uint32_t>(k.rotary_dim));
  r->set_scaling(static_cast<v1::RopeScaling>(static_cast<int>(k.scaling)));
  r->set_pairing(static_cast<v1::RopePairing>(static_cast<int>(k.pairing)));
  r->set_factor(k.factor);
  r->set_low_freq_factor(k.low_freq_factor);
  r->set_high_freq_factor(k.high_freq_factor);
  r->set_original_max_position(static_cast<uint32_t>(k.original_max_position));
  r->set_beta_fast(k.beta_fast);
  r->set_beta_slow(k.beta_slow);
}

}  // namespace

// A copy of `bytes` of backend memory into a new arena block held by the generation.
static absl::StatusOr<const void*> CopyInto(EngineImpl& e, ExportGeneration& g, const void* src,
                                            size_t bytes) {
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock b, e.Alloc(std::max<size_t>(bytes, 16), ArenaKind::kStatic));
  if (bytes > 0) KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(b.data(), src, bytes));
  const void* p = b.data();
  g.copies.push_back(std::move(b));
  return p;
}

absl::StatusOr<v1::SessionExport> EngineImpl::ExportSession(const Tenant& t,
                                                            const v1::ExportSessionRequest& r) {
  if (!config_->same_node.export_state) {
    return absl::FailedPreconditionError(
        "same-node export is off on this daemon (same_node.export: false); decode over the "
        "RPC path (SelectAndReconstruct or Attend)");
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a, sessions_.Use(t.name, r.attachment_id()));
  Session& s = *a->session;
  if (ProfileOf(s.profile.kind).all_exact()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id, "' uses the exact profile: it has no compressed state to export; "
        "decode it with Attend, or keep it in the worker's own cache"));
  }
  // Releases first: they may free what the new generation does not need.
  {
    std::lock_guard<std::mutex> lock(exports_mu_);
    auto it = exports_.find(a->id);
    if (it != exports_.end()) {
      auto& live = it->second->live;
      for (uint64_t gen : r.release_generations()) {
        live.erase(std::remove_if(live.begin(), live.end(),
                                  [gen](const auto& g) { return g->generation == gen; }),
                   live.end());
      }
      if (r.release_generations_size() > 0) {
        metrics_->SetExportGenerations(double(CountExportGenerationsLocked()), options_.metrics_gpu);
      }
      if (live.size() >= kMaxGenerationsPerAttachment) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "attachment '", a->id, "' holds ", live.size(),
            " export generations; release the ones it no longer reads (release_generations)"));
      }
    }
  }

  if (r.renew_only()) {
    v1::SessionExport renewed;
    renewed.set_daemon_instance(instance_id_);
    renewed.set_lease_ms(a->lease_ms);
    renewed.set_lease_expires_unix_ms(
        static_cast<uint64_t>(options_.clock ? options_.clock() : SystemNowMs()) + a->lease_ms);
    return renewed;
  }
  StageTimer timer(metrics_, "export");
  auto gen = std::make_unique<ExportGeneration>();
  v1::SessionExport out;
  RegionTable regions(*backend_, &out, arena_->on_demand());
  const ModelInfo& m = s.model;
  const int h = m.shape.h, d = m.shape.d, C = s.profile.chunk_size;
  {
    std::shared_lock lock(s.mu);
    KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(s, "ExportSession"));
    if (s.state != SessionState::kReady) {
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", s.id, "' is ", SessionStateName(s.state), "; commit its ingest first"));
    }
    out.set_tokens(s.tokens);
    for (const auto& seg : s.chain) gen->segments.push_back(seg);
    for (int layer = 0; layer < m.layers; ++layer) {
      v1::ExportedLayer* L = out.add_layers();
      std::vector<uint32_t> selectable(h, 0);
      int total = 0;
      auto add_segment = [&](const Segment& seg, bool open) -> absl::Status {
        const LayerData& ld = seg.data(layer);
        const LayerData& own = seg.layers[layer];
        if (ld.n_chunks == 0) return absl::OkStatus();
        if (L->segments_size() == kernels::kMaxSegments) return TooManySegmentsError(s.id);
        if (!own.basis || !own.a) {
          return absl::InternalError(absl::StrCat("segment of session '", s.id, "' has no factors"));
        }
        if (L->rank() == 0) {
          L->set_rank(static_cast<uint32_t>(own.basis->r));
          KVSHADE_RETURN_IF_ERROR(regions.Ref(own.basis->b.data(), L->mutable_b()));
        }
        v1::ExportedSegment* es = L->add_segments();
        es->set_n_chunks(static_cast<uint32_t>(ld.n_chunks));
        es->set_first_position(seg.first_position);
        const size_t a_bytes = Bf16Bytes(size_t(ld.n_chunks) * C * own.basis->r);
        const size_t lm_bytes = Bf16Bytes(size_t(ld.n_chunks) * h * d);
        const void* a_ptr = own.a->data();
        const void* lm_ptr = ld.landmarks.data();
        if (open) {
          KVSHADE_ASSIGN_OR_RETURN(a_ptr, CopyInto(*this, *gen, a_ptr, a_bytes));
          KVSHADE_ASSIGN_OR_RETURN(lm_ptr, CopyInto(*this, *gen, lm_ptr, lm_bytes));
        }
        KVSHADE_RETURN_IF_ERROR(regions.Ref(a_ptr, es->mutable_a()));
        KVSHADE_RETURN_IF_ERROR(regions.Ref(lm_ptr, es->mutable_landmarks()));
        // Key signatures at the profile's width (a segment restored without them has none:
        // the worker's selection then reconstructs keys, as the daemon's does).
        if (ld.sig && ld.sig_bits == s.profile.key_signature_bits) {
          const size_t sig_bytes =
              size_t(ld.n_chunks) * C * h * kernels::SignatureRecordBytes(ld.sig_bits, d);
          const void* sig_ptr = ld.sig.data();
          if (open) {
            KVSHADE_ASSIGN_OR_RETURN(sig_ptr, CopyInto(*this, *gen, sig_ptr, sig_bytes));
          }
          KVSHADE_RETURN_IF_ERROR(regions.Ref(sig_ptr, es->mutable_sig()));
        }
        std::vector<uint8_t> excl;
        if (ld.excluded) {
          excl.resize(size_t(h) * ld.n_chunks);
          KVSHADE_RETURN_IF_ERROR(Download(excl.data(), ld.excluded.data(), excl.size()));
          const void* ex_ptr = ld.excluded.data();
          if (open) {
            KVSHADE_ASSIGN_OR_RETURN(ex_ptr, CopyInto(*this, *gen, ex_ptr, excl.size()));
          }
          KVSHADE_RETURN_IF_ERROR(regions.Ref(ex_ptr, es->mutable_excluded()));
        }
        for (int hh = 0; hh < h; ++hh) {
          uint32_t n = 0;
          for (int j = 0; j < ld.n_chunks; ++j) n += excl.empty() || excl[size_t(hh) * ld.n_chunks + j] == 0;
          selectable[hh] += n;
        }
        const Segment& vo = seg.values_owner();
        if (vo.values_in_store) {
          KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, PinValues(s, vo));
          const storage::LayerValues lv = pin.layer(layer);
          KVSHADE_RETURN_IF_ERROR(regions.Ref(lv.base, es->mutable_values()));
          es->set_value_head_stride(lv.head_stride);
          es->set_value_chunk_stride(lv.chunk_stride);
          gen->pins.push_back(std::move(pin));
        } else {
          // The open segment's growable buffer: copy its n_chunks chunks of every head,
          // packed [h, n_chunks, chunk_stride].
          const OpenValues& ov = ld.open_values;
          const size_t per_head = size_t(ld.n_chunks) * ov.chunk_stride;
          KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vb, Alloc(std::max<size_t>(per_head * h, 16), ArenaKind::kStatic));
          for (int hh = 0; hh < h; ++hh) {
            KVSHADE_RETURN_IF_ERROR(backend_->CopyFromHost(
                static_cast<std::byte*>(vb.data()) + hh * per_head,
                static_cast<const std::byte*>(ov.buffer.data()) + hh * ov.head_stride(), per_head));
          }
          KVSHADE_RETURN_IF_ERROR(regions.Ref(vb.data(), es->mutable_values()));
          es->set_value_head_stride(static_cast<int64_t>(per_head));
          es->set_value_chunk_stride(ov.chunk_stride);
          gen->copies.push_back(std::move(vb));
        }
        total += ld.n_chunks;
        return absl::OkStatus();
      };
      for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add_segment(*seg, false));
      if (s.open) {
        KVSHADE_RETURN_IF_ERROR(add_segment(*s.open, true));
      }
      const int k = ProfileOf(s.profile.kind).selects() ? std::min(s.profile.sparse_budget, total) : 0;
      // Slots: k chunks, or their k*C/u units with selection units.
      L->set_slots_per_head(static_cast<uint32_t>(s.profile.slots(k)));
      if (k > 0) {
        const int budget = s.selection.Budget(layer, k, total);
        if (budget > k) {
          L->set_guard_budget(static_cast<uint32_t>(budget));
          L->set_guard_fallback(s.profile.recall_action);
        }
      }
      for (uint32_t n : selectable) L->add_selectable_per_head(n);
      if (k == 0) L->clear_segments();
      // The static set and the exact tail: the cache's blocks, held by the generation.
      KVSHADE_ASSIGN_OR_RETURN(const StaticCache* c, GetCache(s, layer));
      L->set_static_rows(static_cast<uint32_t>(c->s));
      for (int32_t len : c->host_lengths) L->add_static_lengths_host(static_cast<uint32_t>(len));
      if (c->s > 0) {
        for (const auto& b : {c->k, c->v, c->lengths}) gen->shared.push_back(b);
        KVSHADE_RETURN_IF_ERROR(regions.Ref(c->k->data(), L->mutable_static_k()));
        KVSHADE_RETURN_IF_ERROR(regions.Ref(c->v->data(), L->mutable_static_v()));
        KVSHADE_RETURN_IF_ERROR(regions.Ref(c->lengths->data(), L->mutable_static_lengths()));
      }
      L->set_tail_tokens(static_cast<uint32_t>(c->t));
      if (c->t > 0) {
        gen->shared.push_back(c->tk);
        gen->shared.push_back(c->tv);
        KVSHADE_RETURN_IF_ERROR(regions.Ref(c->tk->data(), L->mutable_tail_k()));
        KVSHADE_RETURN_IF_ERROR(regions.Ref(c->tv->data(), L->mutable_tail_v()));
      }
    }
    if (s.open) gen->segments.push_back(s.open);
  }
  KVSHADE_RETURN_IF_ERROR(backend_->Synchronize());

  out.set_daemon_instance(instance_id_);
  out.set_lease_ms(a->lease_ms);
  out.set_lease_expires_unix_ms(static_cast<uint64_t>(options_.clock ? options_.clock() : SystemNowMs()) + a->lease_ms);
  out.set_backend(std::string(backend_->name()));
  out.set_device(device_name());
  out.set_device_pci_bus_id(options_.device_pci_bus_id);
  out.set_profile_kind(s.profile.kind);
  out.set_num_layers(static_cast<uint32_t>(m.layers));
  out.set_num_kv_heads(static_cast<uint32_t>(h));
  out.set_num_query_heads(static_cast<uint32_t>(m.shape.query_heads()));
  out.set_head_dim(static_cast<uint32_t>(d));
  out.set_chunk_size(static_cast<uint32_t>(C));
  WireRope(m.rope, out.mutable_rope());
  out.set_value_codec(CodecToProto(s.profile.codec.codec));
  out.set_value_group(static_cast<uint32_t>(s.profile.codec.group));
  *out.mutable_profile() = s.profile.ToProto();

  std::lock_guard<std::mutex> lock(exports_mu_);
  auto& slot = exports_[a->id];
  if (!slot) {
    slot = std::make_unique<AttachmentExports>();
    slot->attachment = a;
  }
  gen->generation = slot->next_generation++;
  out.set_generation(gen->generation);
  slot->live.push_back(std::move(gen));
  metrics_->SetExportGenerations(double(CountExportGenerationsLocked()), options_.metrics_gpu);
  return out;
}

size_t EngineImpl::CountExportGenerationsLocked() const {
  size_t n = 0;
  for (const auto& [id, e] : exports_) n += e->live.size();
  return n;
}

void EngineImpl::DropExports(const std::string& attachment_id) {
  std::unique_ptr<AttachmentExports> gone;
  std::lock_guard<std::mutex> lock(exports_mu_);
  auto it = exports_.find(attachment_id);
  if (it == exports_.end()) return;
  gone = std::move(it->second);
  exports_.erase(it);
  metrics_->SetExportGenerations(double(CountExportGenerationsLocked()), options_.metrics_gpu);
}

void EngineImpl::PruneExports() {
  std::vector<std::unique_ptr<AttachmentExports>> gone;
  std::lock_guard<std::mutex> lock(exports_mu_);
  for (auto it = exports_.begin(); it != exports_.end();) {
    if (it->second->attachment.expired()) {
      gone.push_back(std::move(it->second));
      exports_.erase(it++);
    } else {
      ++it;
    }
  }
  metrics_->SetExportGenerations(double(CountExportGenerationsLocked()), options_.metrics_gpu);
}

}  // namespace kvshade::service

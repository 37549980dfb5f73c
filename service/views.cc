// The working set of a decode call: pinned values, per-layer views of a session's
// segments, and the static caches (static set + exact tail) selects read.
#include "kvshade/service/engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <numeric>
#include <optional>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "profile.h"
#include "status_util.h"
#include "kvshade/service/log.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

using storage::ArenaKind;

// ---------------------------------------------------------------------------------------
// Views and caches

absl::StatusOr<storage::SegmentPin> EngineImpl::PinValues(const Session& s, const Segment& owner) {
  absl::StatusOr<storage::SegmentPin> pin = store_->Pin(owner.id);
  if (!pin.ok()) {
    NoteReadFailure(s, pin.status()).IgnoreError();
    return absl::Status(pin.status().code(),
                        absl::StrCat("values of a segment of session '", s.id,
                                     "' are unavailable: ", pin.status().message()));
  }
  return pin;
}

absl::StatusOr<LayerViewHold> EngineImpl::BuildView(const Session& s, int layer) {
  LayerViewHold hold;
  kernels::SessionLayerView& v = hold.view;
  auto add = [&](const Segment& seg) -> absl::Status {
    const LayerData& d = seg.data(layer);
    const LayerData& own = seg.layers[layer];
    if (d.n_chunks == 0) return absl::OkStatus();
    if (v.n_segments == kernels::kMaxSegments) return TooManySegmentsError(s.id);
    if (!own.basis || !own.a) {
      return absl::InternalError(absl::StrCat("segment of session '", s.id, "' has no factors"));
    }
    if (v.b == nullptr) {
      v.b = static_cast<const kernels::bf16*>(own.basis->b.data());
      v.r = own.basis->r;
    } else if (own.basis->r != v.r) {
      return absl::InternalError("segments of one session disagree on the rank");
    }
    kernels::SegmentView& sv = v.segments[v.n_segments++];
    sv.n_chunks = d.n_chunks;
    sv.first_position = seg.first_position;
    sv.landmarks = static_cast<const kernels::bf16*>(d.landmarks.data());
    // Key signatures of the profile's width; a segment without them (written before they
    // existed) leaves sig null, and selection then reconstructs keys (decode::HasSignatures).
    sv.sig = d.sig && d.sig_bits == s.profile.key_signature_bits
                 ? static_cast<const std::byte*>(d.sig.data())
                 : nullptr;
    sv.excluded = d.excluded ? static_cast<const uint8_t*>(d.excluded.data()) : nullptr;
    sv.a = static_cast<const kernels::bf16*>(own.a->data());
    const Segment& vo = seg.values_owner();
    if (vo.values_in_store) {
      KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, PinValues(s, vo));
      pin.layer(layer).FillView(&sv);
      hold.pins.push_back(std::move(pin));
    } else {
      sv.values = static_cast<const std::byte*>(d.open_values.buffer.data());
      sv.value_head_stride = d.open_values.head_stride();
      sv.value_chunk_stride = d.open_values.chunk_stride;
    }
    hold.total_chunks += d.n_chunks;
    return absl::OkStatus();
  };
  v.sig_bits = s.profile.key_signature_bits;
  for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add(*seg));
  if (s.open) KVSHADE_RETURN_IF_ERROR(add(*s.open));
  return hold;
}

absl::StatusOr<const StaticCache*> EngineImpl::GetCache(Session& s, int layer, bool host_rows) {
  std::lock_guard<std::mutex> lock(s.cache_mu);
  StaticCache& c = s.cache[layer];
  const int h = s.model.shape.h, d = s.model.shape.d;
  const size_t row = size_t(d);
  const size_t tok = size_t(h) * d;
  // A rebuild (a session's first export or static-set read of the layer, or the first
  // after an append) counts as the static_set stage. The rows move between backend buffers
  // only; the host copies GetStaticSet sends are made when it asks (host_rows).
  std::optional<StageTimer> timer;
  if (c.static_version != s.static_version || c.tail_version != s.tail_version) {
    timer.emplace(metrics_, "static_set");
  }
  bool rebuilt = false;
  if (c.static_version != s.static_version) {
    // Per head: every segment's static rows (exact, or dequantized INT2), in chain order.
    std::vector<const Segment*> segs;
    for (const auto& seg : s.chain) segs.push_back(seg.get());
    if (s.open) segs.push_back(s.open.get());
    c.host_lengths.assign(h, 0);
    for (const Segment* seg : segs) {
      const LayerData& ld = seg->data(layer);
      if (ld.s_cap == 0) continue;
      for (int hh = 0; hh < h; ++hh) c.host_lengths[hh] += ld.s_len[hh];
    }
    const int sn = h > 0 ? *std::max_element(c.host_lengths.begin(), c.host_lengths.end()) : 0;
    c.s = sn;
    c.host_pos.assign(size_t(h) * sn, -1);
    c.k.reset();
    c.v.reset();
    c.lengths.reset();
    if (sn > 0) {
      const size_t bytes = Bf16Bytes(size_t(h) * sn * row);
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kb, Alloc(bytes, ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vb, Alloc(bytes, ArenaKind::kStatic));
      // Rows past a head's length are zeros, as the host copies show them.
      KVSHADE_RETURN_IF_ERROR(backend_->Fill(kb.data(), 0, bytes));
      KVSHADE_RETURN_IF_ERROR(backend_->Fill(vb.data(), 0, bytes));
      std::vector<int> at(h, 0);
      for (const Segment* seg : segs) {
        const LayerData& ld = seg->data(layer);
        if (ld.s_cap == 0) continue;
        for (int hh = 0; hh < h; ++hh) {
          const int n = ld.s_len[hh];
          if (n == 0) continue;
          const size_t src = size_t(hh) * ld.s_cap * row, dst = (size_t(hh) * sn + at[hh]) * row;
          KVSHADE_RETURN_IF_ERROR(backend_->Copy(static_cast<kernels::bf16*>(kb.data()) + dst,
                                                 static_cast<const kernels::bf16*>(ld.sk.data()) + src,
                                                 Bf16Bytes(size_t(n) * row)));
          KVSHADE_RETURN_IF_ERROR(backend_->Copy(static_cast<kernels::bf16*>(vb.data()) + dst,
                                                 static_cast<const kernels::bf16*>(ld.sv.data()) + src,
                                                 Bf16Bytes(size_t(n) * row)));
          const size_t prow = size_t(hh) * ld.s_cap;
          for (int i = 0; i < n; ++i) {
            c.host_pos[size_t(hh) * sn + at[hh] + i] = prow + i < ld.s_pos.size() ? ld.s_pos[prow + i] : -1;
          }
          at[hh] += n;
        }
      }
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock lb, Upload(c.host_lengths.data(), h * 4, ArenaKind::kStatic));
      c.k = std::make_shared<const DeviceBlock>(std::move(kb));
      c.v = std::make_shared<const DeviceBlock>(std::move(vb));
      c.lengths = std::make_shared<const DeviceBlock>(std::move(lb));
    }
    c.static_version = s.static_version;
    c.host_static_rows = false;
    rebuilt = true;
    c.tail_version = ~0ull;  // segment remainders live in the tail part: rebuild it too
  }
  if (c.tail_version != s.tail_version) {
    c.host_tail_pos.clear();
    // A remainder's rows that chunks of a later (open) segment cover left the tail; the
    // remainder is the segment's tokens after its chunks.
    struct Part {
      const kernels::bf16* k;
      const kernels::bf16* v;
      size_t rows;
    };
    std::vector<Part> parts;
    auto add_tail = [&](const Segment& seg) {
      const LayerData& ld = seg.data(layer);
      const int skip = CoveredRemainderRows(s, seg, layer);
      if (ld.n_tail - skip <= 0) return;
      const int64_t first = seg.first_position + int64_t(ld.n_chunks) * seg.chunk_size;
      for (int i = skip; i < ld.n_tail; ++i) c.host_tail_pos.push_back(first + i);
      parts.push_back({static_cast<const kernels::bf16*>(ld.tk.data()) + size_t(skip) * tok,
                       static_cast<const kernels::bf16*>(ld.tv.data()) + size_t(skip) * tok,
                       size_t(ld.n_tail - skip)});
    };
    if (!ProfileOf(s.profile.kind).all_exact()) {
      for (const auto& seg : s.chain) add_tail(*seg);
      if (s.open) add_tail(*s.open);
    }
    const TailLayer& tl = s.tail[layer];
    // The appended tail is the session's newest tokens.
    const int64_t appended = static_cast<int64_t>(tl.k.size() / tok);
    for (int64_t i = 0; i < appended; ++i) {
      c.host_tail_pos.push_back(static_cast<int64_t>(s.tokens) - appended + i);
    }
    c.t = static_cast<int>(c.host_tail_pos.size());
    c.tk.reset();
    c.tv.reset();
    if (c.t > 0) {
      const size_t bytes = Bf16Bytes(size_t(c.t) * tok);
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock tkb, Alloc(bytes, ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock tvb, Alloc(bytes, ArenaKind::kStatic));
      auto* tk = static_cast<kernels::bf16*>(tkb.data());
      auto* tv = static_cast<kernels::bf16*>(tvb.data());
      size_t at = 0;
      for (const Part& part : parts) {
        KVSHADE_RETURN_IF_ERROR(backend_->Copy(tk + at * tok, part.k, Bf16Bytes(part.rows * tok)));
        KVSHADE_RETURN_IF_ERROR(backend_->Copy(tv + at * tok, part.v, Bf16Bytes(part.rows * tok)));
        at += part.rows;
      }
      if (appended > 0) {
        KVSHADE_RETURN_IF_ERROR(backend_->CopyFromHost(tk + at * tok, tl.k.data(), Bf16Bytes(tl.k.size())));
        KVSHADE_RETURN_IF_ERROR(backend_->CopyFromHost(tv + at * tok, tl.v.data(), Bf16Bytes(tl.v.size())));
      }
      c.tk = std::make_shared<const DeviceBlock>(std::move(tkb));
      c.tv = std::make_shared<const DeviceBlock>(std::move(tvb));
    }
    c.tail_version = s.tail_version;
    c.host_tail_rows = false;
    rebuilt = true;
  }
  // The copies ran on the default stream; decode requests read the cache on their own.
  if (rebuilt) KVSHADE_RETURN_IF_ERROR(backend_->Synchronize());
  if (host_rows && !c.host_static_rows) {
    c.host_k.assign(size_t(h) * c.s * row, kernels::bf16{});
    c.host_v.assign(c.host_k.size(), kernels::bf16{});
    if (c.s > 0) {
      KVSHADE_RETURN_IF_ERROR(Download(c.host_k.data(), c.k->data(), Bf16Bytes(c.host_k.size())));
      KVSHADE_RETURN_IF_ERROR(Download(c.host_v.data(), c.v->data(), Bf16Bytes(c.host_v.size())));
    }
    c.host_static_rows = true;
  }
  if (host_rows && !c.host_tail_rows) {
    c.host_tk.assign(size_t(c.t) * tok, kernels::bf16{});
    c.host_tv.assign(c.host_tk.size(), kernels::bf16{});
    if (c.t > 0) {
      KVSHADE_RETURN_IF_ERROR(Download(c.host_tk.data(), c.tk->data(), Bf16Bytes(c.host_tk.size())));
      KVSHADE_RETURN_IF_ERROR(Download(c.host_tv.data(), c.tv->data(), Bf16Bytes(c.host_tv.size())));
    }
    c.host_tail_rows = true;
  }
  // Host copies of an earlier version are stale: their memory goes.
  if (!c.host_static_rows) {
    std::vector<kernels::bf16>().swap(c.host_k);
    std::vector<kernels::bf16>().swap(c.host_v);
  }
  if (!c.host_tail_rows) {
    std::vector<kernels::bf16>().swap(c.host_tk);
    std::vector<kernels::bf16>().swap(c.host_tv);
  }
  return &c;
}

}  // namespace kvshade::service

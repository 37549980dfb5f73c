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

absl::StatusOr<const StaticCache*> EngineImpl::GetCache(Session& s, int layer) {
  std::lock_guard<std::mutex> lock(s.cache_mu);
  StaticCache& c = s.cache[layer];
  const int h = s.model.shape.h, d = s.model.shape.d;
  const size_t row = size_t(d);
  bool rebuilt = false;
  // The rebuild below (a session's first export or static-set read of the layer, or the
  // first after an append) counts as the static_set stage.
  std::optional<StageTimer> timer;
  if (c.static_version != s.static_version || c.tail_version != s.tail_version) timer.emplace(metrics_, "static_set");
  if (c.static_version != s.static_version) {
    // Per head: every segment's static rows (exact, or dequantized INT2), in chain order.
    std::vector<std::vector<kernels::bf16>> hk(h), hv(h);
    std::vector<std::vector<int64_t>> hp(h);
    auto add_segment = [&](const Segment& seg) -> absl::Status {
      const LayerData& ld = seg.data(layer);
      if (ld.s_cap == 0) return absl::OkStatus();
      std::vector<kernels::bf16> k(size_t(h) * ld.s_cap * d), v(k.size());
      KVSHADE_RETURN_IF_ERROR(Download(k.data(), ld.sk.data(), Bf16Bytes(k.size())));
      KVSHADE_RETURN_IF_ERROR(Download(v.data(), ld.sv.data(), Bf16Bytes(v.size())));
      for (int hh = 0; hh < h; ++hh) {
        const size_t off = size_t(hh) * ld.s_cap * row;
        const size_t len = size_t(ld.s_len[hh]) * row;
        hk[hh].insert(hk[hh].end(), k.begin() + off, k.begin() + off + len);
        hv[hh].insert(hv[hh].end(), v.begin() + off, v.begin() + off + len);
        const size_t prow = size_t(hh) * ld.s_cap;
        for (int i = 0; i < ld.s_len[hh]; ++i) {
          hp[hh].push_back(prow + i < ld.s_pos.size() ? ld.s_pos[prow + i] : -1);
        }
      }
      return absl::OkStatus();
    };
    for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add_segment(*seg));
    if (s.open) KVSHADE_RETURN_IF_ERROR(add_segment(*s.open));
    int sn = 0;
    c.host_lengths.assign(h, 0);
    for (int hh = 0; hh < h; ++hh) {
      c.host_lengths[hh] = static_cast<int32_t>(hk[hh].size() / row);
      sn = std::max(sn, c.host_lengths[hh]);
    }
    c.s = sn;
    c.host_k.assign(size_t(h) * sn * row, kernels::bf16{});
    c.host_v.assign(c.host_k.size(), kernels::bf16{});
    c.host_pos.assign(size_t(h) * sn, -1);
    for (int hh = 0; hh < h; ++hh) {
      std::copy(hk[hh].begin(), hk[hh].end(), c.host_k.begin() + size_t(hh) * sn * row);
      std::copy(hv[hh].begin(), hv[hh].end(), c.host_v.begin() + size_t(hh) * sn * row);
      std::copy(hp[hh].begin(), hp[hh].end(), c.host_pos.begin() + size_t(hh) * sn);
    }
    c.k = DeviceBlock();
    c.v = DeviceBlock();
    c.lengths = DeviceBlock();
    if (sn > 0) {
      KVSHADE_ASSIGN_OR_RETURN(c.k, Upload(c.host_k.data(), Bf16Bytes(c.host_k.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.v, Upload(c.host_v.data(), Bf16Bytes(c.host_v.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.lengths, Upload(c.host_lengths.data(), h * 4, ArenaKind::kStatic));
    }
    c.static_version = s.static_version;
    rebuilt = true;
    c.tail_version = ~0ull;  // segment remainders live in the tail part: rebuild it too
  }
  if (c.tail_version != s.tail_version) {
    c.host_tk.clear();
    c.host_tv.clear();
    c.host_tail_pos.clear();
    const size_t tok = size_t(h) * d;
    // A remainder's rows that chunks of a later (open) segment cover left the tail.
    auto add_tail = [&](const Segment& seg) -> absl::Status {
      const LayerData& ld = seg.data(layer);
      const int skip = CoveredRemainderRows(s, seg, layer);
      if (ld.n_tail - skip <= 0) return absl::OkStatus();
      const size_t n = size_t(ld.n_tail - skip) * tok, off = size_t(skip) * tok;
      // The remainder is the segment's tokens after its chunks.
      const int64_t first = seg.first_position + int64_t(ld.n_chunks) * seg.chunk_size;
      for (int i = skip; i < ld.n_tail; ++i) c.host_tail_pos.push_back(first + i);
      const size_t at = c.host_tk.size();
      c.host_tk.resize(at + n);
      c.host_tv.resize(at + n);
      KVSHADE_RETURN_IF_ERROR(Download(c.host_tk.data() + at,
                                       static_cast<const kernels::bf16*>(ld.tk.data()) + off, Bf16Bytes(n)));
      return Download(c.host_tv.data() + at, static_cast<const kernels::bf16*>(ld.tv.data()) + off,
                      Bf16Bytes(n));
    };
    if (!ProfileOf(s.profile.kind).all_exact()) {
      for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add_tail(*seg));
      if (s.open) KVSHADE_RETURN_IF_ERROR(add_tail(*s.open));
    }
    const TailLayer& tl = s.tail[layer];
    c.host_tk.insert(c.host_tk.end(), tl.k.begin(), tl.k.end());
    c.host_tv.insert(c.host_tv.end(), tl.v.begin(), tl.v.end());
    c.t = static_cast<int>(c.host_tk.size() / tok);
    // The appended tail is the session's newest tokens.
    const int64_t appended = static_cast<int64_t>(tl.k.size() / tok);
    for (int64_t i = 0; i < appended; ++i) {
      c.host_tail_pos.push_back(static_cast<int64_t>(s.tokens) - appended + i);
    }
    c.tk = DeviceBlock();
    c.tv = DeviceBlock();
    if (c.t > 0) {
      KVSHADE_ASSIGN_OR_RETURN(c.tk, Upload(c.host_tk.data(), Bf16Bytes(c.host_tk.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.tv, Upload(c.host_tv.data(), Bf16Bytes(c.host_tv.size()), ArenaKind::kStatic));
    }
    c.tail_version = s.tail_version;
    rebuilt = true;
  }
  // The uploads ran on the default stream; decode requests read the cache on their own.
  if (rebuilt) KVSHADE_RETURN_IF_ERROR(backend_->Synchronize());
  return &c;
}

}  // namespace kvshade::service

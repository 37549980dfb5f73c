// AppendTokens (generated or new-turn tokens, all layers at once) and the open segment.
// Where the new tokens go is the profile's (ProfileStrategy::AppendLayer, FinishAppend in
// profile_*.cc):
// shadow : new tokens join the exact tail (pre-RoPE K kept for projection, post-RoPE K, V),
//          which also holds the prompt's remainder: one tail in token order. When it
//          exceeds local_window + C, its oldest whole chunks leave it (TrimShadowTail,
//          profile_shadow.cc): coordinates appended to the open segment's A (a remainder token's kept
//          from the ingest, an appended token's projected onto the layer's basis), values
//          encoded into the open segment's value buffer, a landmark appended; the chunks
//          become selectable, with ids in token order.
// mini   : new tokens join a bf16 residual; every R = 128 tokens (rounded down to whole
//          KIVI groups) the oldest are quantized INT2 and move to the open segment.
// exact  : new tokens are appended to the open segment as they are.
// The open segment is sealed (made immutable, values moved into the HostValueStore) when
// the session is forked at its end or drained; it then joins the chain.
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

}  // namespace

// A new device block of `new_bytes` holding the first `used` bytes of `blk`.
absl::StatusOr<DeviceBlock> Grown(EngineImpl& e, const DeviceBlock& blk, size_t used,
                                  size_t new_bytes, ArenaKind kind) {
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock nb, e.Alloc(new_bytes, kind));
  if (used > 0) {
    std::vector<std::byte> tmp(used);
    KVSHADE_RETURN_IF_ERROR(e.Download(tmp.data(), blk.data(), used));
    KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(nb.data(), tmp.data(), used));
  }
  return nb;
}

// Grows a device block to `new_bytes`, keeping its first `used` bytes.
absl::Status GrowDevice(EngineImpl& e, DeviceBlock& blk, size_t used, size_t new_bytes,
                        ArenaKind kind) {
  KVSHADE_ASSIGN_OR_RETURN(blk, Grown(e, blk, used, new_bytes, kind));
  return absl::OkStatus();
}

// Appends `n` post-RoPE/value tokens [n, h, d] to a layer's exact token buffer.
absl::Status AppendExactTokens(EngineImpl& e, LayerData& ld, const bf16* k, const bf16* v, int n,
                               size_t tok) {
  if (ld.n_tail + n > ld.cap_tail) {
    const int cap = std::max({ld.cap_tail * 2, ld.n_tail + n, 64});
    KVSHADE_RETURN_IF_ERROR(GrowDevice(e, ld.tk, Bf16Bytes(size_t(ld.n_tail) * tok),
                                       Bf16Bytes(size_t(cap) * tok), ArenaKind::kStatic));
    KVSHADE_RETURN_IF_ERROR(GrowDevice(e, ld.tv, Bf16Bytes(size_t(ld.n_tail) * tok),
                                       Bf16Bytes(size_t(cap) * tok), ArenaKind::kStatic));
    ld.cap_tail = cap;
  }
  KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(Ptr<bf16>(ld.tk) + size_t(ld.n_tail) * tok, k,
                                                   Bf16Bytes(size_t(n) * tok)));
  KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(Ptr<bf16>(ld.tv) + size_t(ld.n_tail) * tok, v,
                                                   Bf16Bytes(size_t(n) * tok)));
  ld.n_tail += n;
  return absl::OkStatus();
}

std::shared_ptr<Segment> NewOpen(EngineImpl& e, const Session& s, int64_t first_position) {
  auto seg = std::make_shared<Segment>();
  seg->id = *storage::Id128::FromHex(SessionManager::NewId());
  seg->kind = s.profile.kind;
  seg->first_position = first_position;
  seg->chunk_size = s.profile.chunk_size;
  seg->layers.resize(s.model.layers);
  seg->store = e.store_link();
  return seg;
}


// The append itself (s.mu held exclusively; inputs validated): the new tokens' K/V join the
// session as the file comment says. Replayed logged appends (append_log.cc) take the same
// path, so that a restored session holds exactly what the acknowledged appends built.
absl::Status EngineImpl::ApplyAppend(Session& s, absl::Span<const int32_t> ids,
                                     const std::vector<std::vector<bf16>>& ks,
                                     const std::vector<std::vector<bf16>>& vs) {
  const ModelInfo& m = s.model;
  const int h = m.shape.h, d = m.shape.d, L = m.layers;
  const int n = static_cast<int>(ids.size());
  StageTimer timer(metrics_, "append");
  const int64_t first = static_cast<int64_t>(s.tokens);
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock posd, DevicePositions(first, n));
  const absl::Span<const int64_t> pos(Ptr<const int64_t>(posd), size_t(n));
  const ProfileInfo& p = s.profile;
  // Post-RoPE keys of the new tokens, every layer before any state changes.
  std::vector<std::vector<bf16>> kr(L);
  for (int l = 0; l < L; ++l) {
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, Upload(ks[l].data(), Bf16Bytes(ks[l].size()), ArenaKind::kOther));
    KVSHADE_RETURN_IF_ERROR(backend_->ApplyRope(m.rope, pos, h, d,
                                                absl::Span<bf16>(Ptr<bf16>(kd), ks[l].size())));
    kr[l].resize(ks[l].size());
    KVSHADE_RETURN_IF_ERROR(Download(kr[l].data(), kd.data(), Bf16Bytes(kr[l].size())));
  }
  const ProfileStrategy& profile = ProfileOf(p.kind);
  for (int l = 0; l < L; ++l) {
    KVSHADE_RETURN_IF_ERROR(profile.AppendLayer(*this, s, l, first, n, ks[l], kr[l], vs[l]));
  }
  s.tokens += n;
  if (absl::Status st = profile.FinishAppend(*this, s, n); !st.ok()) {
    s.tokens -= n;  // the append does not happen
    return st;
  }
  s.appended_tokens.insert(s.appended_tokens.end(), ids.begin(), ids.end());
  ++s.tail_version;
  bool drifted = false;
  for (double x : s.drift) drifted = drifted || x > p.refactor_threshold;
  if (drifted) metrics_->ProjectionResidual(*std::max_element(s.drift.begin(), s.drift.end()));
  return absl::OkStatus();
}

absl::StatusOr<v1::AppendTokensResponse> EngineImpl::AppendTokens(const Tenant& t,
                                                                  const v1::AppendTokensRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("AppendTokens"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> sp, sessions_.FindSession(t.name, r.session_id()));
  Session& s = *sp;
  const ModelInfo& m = s.model;
  const int h = m.shape.h, d = m.shape.d, L = m.layers;
  const int n = r.token_ids_size();
  if (n < 1) return absl::InvalidArgumentError("token_ids must hold at least one token");
  for (int i = 0; i < n; ++i) {
    if (r.token_ids(i) < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token_ids[", i, "] must be >= 0, got ", r.token_ids(i)));
    }
  }
  if (r.layers_size() != L) {
    return absl::InvalidArgumentError(absl::StrCat("layers must have exactly num_layers = ", L,
                                                   " entries, got ", r.layers_size()));
  }
  // Decode and validate everything before taking the session's lock.
  std::vector<std::vector<bf16>> ks(L), vs(L);
  std::vector<bool> seen(L, false);
  for (int i = 0; i < L; ++i) {
    const v1::LayerKV& lk = r.layers(i);
    if (lk.layer() >= static_cast<uint32_t>(L) || seen[lk.layer()]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layers[", i, "].layer must be a distinct layer in [0, ", L, "), got ", lk.layer()));
    }
    seen[lk.layer()] = true;
    const std::vector<int64_t> shape = {n, h, d};
    KVSHADE_ASSIGN_OR_RETURN(ks[lk.layer()], DecodeTensor(lk.k(), shape, m.dtype, absl::StrCat("layers[", i, "].k")));
    KVSHADE_ASSIGN_OR_RETURN(vs[lk.layer()], DecodeTensor(lk.v(), shape, m.dtype, absl::StrCat("layers[", i, "].v")));
  }
  const absl::Span<const int32_t> ids(r.token_ids().data(), n);
  KVSHADE_ASSIGN_OR_RETURN(uint64_t tokens, CommitAppend(t, s, r.attachment_id(), ids, ks, vs));
  v1::AppendTokensResponse resp;
  resp.set_tokens(tokens);
  return resp;
}

absl::StatusOr<uint64_t> EngineImpl::CommitAppend(const Tenant& t, Session& s,
                                                  const std::string& attachment_id,
                                                  absl::Span<const int32_t> ids,
                                                  const std::vector<std::vector<bf16>>& ks,
                                                  const std::vector<std::vector<bf16>>& vs,
                                                  std::optional<uint64_t> at_tokens) {
  KVSHADE_RETURN_IF_ERROR(sessions_.CheckWriter(t.name, s, attachment_id));

  std::unique_lock lock(s.mu);
  if (s.state == SessionState::kClosed) {
    return absl::NotFoundError(absl::StrCat("session '", s.id, "' not found (closed)"));
  }
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(s, "AppendTokens"));
  if (s.state != SessionState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id, "' is ", SessionStateName(s.state), "; commit its ingest first"));
  }
  if (at_tokens && *at_tokens != s.tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id, "' has ", s.tokens, " tokens, not the ", *at_tokens,
        " it had when the token's staging began (an append came in between); stage it again"));
  }
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(ids, s.tokens, config_->limits, "token_ids"));
  // Logged appends: on disk before they happen (and so before the acknowledgement).
  const bool logged = s.durable && spill_ && s.append_fsync != v1::APPEND_FSYNC_NO;
  if (logged) KVSHADE_RETURN_IF_ERROR(LogAppend(s, ids, ks, vs));
  if (absl::Status st = ApplyAppend(s, ids, ks, vs); !st.ok()) {
    if (logged) DropLastAppendRecord(s);
    return st;
  }
  return s.tokens;
}

// --- Compaction ------------------------------------------------------------------------
//
// Every seal adds a segment to the chain (a fork at the end, a durable session's drain or
// write-through), and a select searches at most kernels::kMaxSegments segments with
// selectable chunks. So the seal merges the open segment with the chain's trailing
// *appended* segments (sealed open segments, or earlier merges of them): whole chunks of
// the session's tail on its one basis, no static rows, no exact remainder, no exclusions,
// no prefix key, each starting where the chunks before it end. Merging them is a
// concatenation of their chunk arrays (A rows, landmarks, value chunks per head): chunk ids
// and positions do not change, so selection, attention and slot tables are as before. The
// merged segment is a new sealed segment (the old ones stay alive while a fork, an export
// generation or, for a durable session until its next record, `Session::retired` holds
// them).
//
// Which ones merge (PlanCompaction): binary-counter tiering (the segment before the merged
// one joins it while it holds no more chunks than the merged one), so that a chunk is
// copied O(log n) times and the appended segments stay few; and whatever more it takes to
// leave room under the cap for the session's next open segment. The segments that cannot
// merge (cached prefixes and the session's own ingested segment: at most
// kMaxReusedSegments + 1) always leave that room.

namespace {

// Whether a sealed segment of a chain holds only appended chunks (see above; only a
// profile that selects has chunks).
bool Appended(const Segment& seg, int layers) {
  const ProfileStrategy* profile = FindProfile(seg.kind);
  if (!profile || !profile->selects() || seg.prefix_key || !seg.tokens.empty()) return false;
  if (!seg.values_owner().values_in_store) return false;
  const int n0 = seg.data(0).n_chunks;
  if (n0 == 0) return false;
  for (int l = 0; l < layers; ++l) {
    const LayerData& d = seg.data(l);
    const LayerData& own = seg.layers[l];
    if (d.n_chunks != n0 || d.n_tail != 0 || d.s_cap != 0 || d.excluded || !d.int2.empty() ||
        !own.a || !own.basis) {
      return false;
    }
  }
  return true;
}

int64_t ChunksEnd(const Segment& seg) {
  return seg.first_position + int64_t(seg.data(0).n_chunks) * seg.chunk_size;
}

}  // namespace

CompactionPlan PlanCompaction(const Session& s) {
  CompactionPlan plan;
  const int L = s.model.layers;
  const int open_chunks = s.open ? s.open->layers[0].n_chunks : 0;
  plan.first = s.chain.size();
  if (ProfileOf(s.profile.kind).selects() && open_chunks > 0) {
    int64_t next = s.open->first_position;
    while (plan.first > 0) {
      const Segment& seg = *s.chain[plan.first - 1];
      if (!Appended(seg, L) || ChunksEnd(seg) != next) break;
      next = seg.first_position;
      --plan.first;
    }
  }
  for (size_t i = 0; i < plan.first; ++i) plan.fixed += s.chain[i]->data(0).n_chunks > 0;
  if (open_chunks == 0) {
    plan.fits = plan.fixed + int(s.chain.size() - plan.first) + 1 <= kernels::kMaxSegments;
    plan.first = s.chain.size();
    return plan;
  }
  const size_t run = s.chain.size() - plan.first;
  int merged = open_chunks;  // the open segment and the run's segments folded into it
  size_t folded = 0;
  while (folded < run) {
    const int before = s.chain[s.chain.size() - 1 - folded]->data(0).n_chunks;
    // Sealed after this step: fixed, the unfolded run, the merged one; then a next open.
    const bool over = plan.fixed + int(run - folded) + 1 + 1 > kernels::kMaxSegments;
    if (!over && before > merged) break;
    merged += before;
    ++folded;
  }
  plan.first = s.chain.size() - folded;
  plan.fits = plan.fixed + int(run - folded) + 1 + 1 <= kernels::kMaxSegments;
  return plan;
}

namespace {

// One new sealed segment holding the chunks of chain[from..] and then the open segment's,
// in order (values in the store, written through when the session is durable). Changes
// nothing of the session.
absl::StatusOr<std::shared_ptr<Segment>> MergeSegments(EngineImpl& e, Session& s, size_t from) {
  const ModelInfo& m = s.model;
  const ProfileInfo& p = s.profile;
  const int L = m.layers, h = m.shape.h, d = m.shape.d, D = m.shape.D(), C = p.chunk_size;
  std::vector<const Segment*> src;
  for (size_t i = from; i < s.chain.size(); ++i) src.push_back(s.chain[i].get());
  src.push_back(s.open.get());
  int n_chunks = 0;
  auto seg = std::make_shared<Segment>();
  seg->id = *storage::Id128::FromHex(SessionManager::NewId());
  seg->kind = p.kind;
  seg->first_position = src[0]->first_position;
  seg->chunk_size = C;
  seg->layers.resize(L);
  seg->store = e.store_link();
  for (const Segment* x : src) {
    n_chunks += x->data(0).n_chunks;
    seg->n_tokens += x->n_tokens;
  }
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentValueLayout layout,
                           storage::SegmentValueLayout::Make(L, h, n_chunks, C, d, p.codec));
  // Pins of the sealed sources' values (paged in when spilled), every layer.
  std::vector<std::optional<storage::SegmentPin>> pins(src.size());
  for (size_t i = 0; i + 1 < src.size(); ++i) {
    KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, e.PinValues(s, src[i]->values_owner()));
    pins[i] = std::move(pin);
  }
  KVSHADE_RETURN_IF_ERROR(e.store().Create(seg->id, layout));
  auto fill = [&]() -> absl::Status {
    for (int l = 0; l < L; ++l) {
      const std::shared_ptr<const Basis>& basis = src[0]->layers[l].basis;
      const int r = basis->r;
      std::vector<bf16> a(size_t(n_chunks) * C * r), lm(size_t(n_chunks) * D);
      std::vector<std::byte> values(layout.dense_layer_bytes());
      // Key signatures: concatenated rows when every source keeps them at the profile's
      // width (a source restored from a record without them leaves the merge without).
      const int bits = p.key_signature_bits;
      bool with_sig = bits > 0;
      for (const Segment* x : src) with_sig = with_sig && x->data(l).sig && x->data(l).sig_bits == bits;
      const size_t sig_row = with_sig ? size_t(h) * kernels::SignatureRecordBytes(bits, d) : 0;
      std::vector<std::byte> sig(size_t(n_chunks) * C * sig_row);
      int at = 0;
      for (size_t i = 0; i < src.size(); ++i) {
        const Segment& x = *src[i];
        const LayerData& ld = x.data(l);
        const LayerData& own = x.layers[l];
        const int n = ld.n_chunks;
        if (n != x.data(0).n_chunks) {
          return absl::InternalError(absl::StrCat(
              "session '", s.id, "': an appended segment has ", n, " chunks at layer ", l,
              " and ", x.data(0).n_chunks, " at layer 0"));
        }
        if (!own.basis || own.basis->r != r) {
          return absl::InternalError(absl::StrCat(
              "session '", s.id, "': appended segments disagree on the rank at layer ", l));
        }
        KVSHADE_RETURN_IF_ERROR(e.Download(a.data() + size_t(at) * C * r, own.a->data(),
                                           Bf16Bytes(size_t(n) * C * r)));
        KVSHADE_RETURN_IF_ERROR(e.Download(lm.data() + size_t(at) * D, ld.landmarks.data(),
                                           Bf16Bytes(size_t(n) * D)));
        if (with_sig) {
          KVSHADE_RETURN_IF_ERROR(e.Download(sig.data() + size_t(at) * C * sig_row, ld.sig.data(),
                                             size_t(n) * C * sig_row));
        }
        const std::byte* base;
        int64_t head_stride, chunk_stride;
        if (pins[i]) {
          const storage::LayerValues lv = pins[i]->layer(l);
          base = lv.base;
          head_stride = lv.head_stride;
          chunk_stride = lv.chunk_stride;
        } else {
          base = static_cast<const std::byte*>(ld.open_values.buffer.data());
          head_stride = ld.open_values.head_stride();
          chunk_stride = ld.open_values.chunk_stride;
        }
        for (int hh = 0; hh < h; ++hh) {
          for (int j = 0; j < n; ++j) {
            std::memcpy(values.data() + (size_t(hh) * n_chunks + at + j) * layout.chunk_bytes,
                        base + hh * head_stride + j * chunk_stride, layout.chunk_bytes);
          }
        }
        at += n;
      }
      LayerData& out = seg->layers[l];
      out.basis = basis;
      out.n_chunks = out.cap_chunks = n_chunks;
      out.a = std::make_shared<DeviceBlock>();
      KVSHADE_ASSIGN_OR_RETURN(*out.a, e.Upload(a.data(), Bf16Bytes(a.size()), ArenaKind::kA));
      KVSHADE_ASSIGN_OR_RETURN(out.landmarks,
                               e.Upload(lm.data(), Bf16Bytes(lm.size()), ArenaKind::kLandmarks));
      if (with_sig) {
        KVSHADE_ASSIGN_OR_RETURN(out.sig, e.Upload(sig.data(), sig.size(), ArenaKind::kSignatures));
        out.sig_bits = bits;
      }
      KVSHADE_RETURN_IF_ERROR(e.store().WriteLayer(seg->id, l, values));
    }
    seg->values_in_store = true;
    seg->value_layout = layout;
    return e.SealSegmentValues(*seg, s.durable, m);
  };
  if (absl::Status st = fill(); !st.ok()) {
    seg->values_in_store = false;
    e.store().Erase(seg->id).IgnoreError();
    return st;
  }
  return seg;
}

}  // namespace

absl::Status EngineImpl::SealOpen(Session& s) {
  if (!s.open) return absl::OkStatus();
  bool empty = true;
  for (const LayerData& ld : s.open->layers) empty = empty && ld.n_chunks == 0 && ld.n_tail == 0;
  if (empty) {
    s.open.reset();
    return absl::OkStatus();
  }
  const CompactionPlan plan = PlanCompaction(s);
  if (plan.first < s.chain.size()) {
    // The open segment and chain[plan.first..] become one sealed segment.
    StageTimer timer(metrics_, "compact");
    KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Segment> merged, MergeSegments(*this, s, plan.first));
    if (s.durable && spill_) {
      s.retired.insert(s.retired.end(), s.chain.begin() + plan.first, s.chain.end());
    }
    s.chain.erase(s.chain.begin() + plan.first, s.chain.end());
    s.chain.push_back(std::move(merged));
    s.open.reset();
    ++s.static_version;
    return absl::OkStatus();
  }
  std::shared_ptr<Segment> seg = std::move(s.open);
  s.open.reset();
  const ModelInfo& m = s.model;
  const ProfileInfo& p = s.profile;
  const int L = m.layers, h = m.shape.h;
  const int n_chunks = seg->layers[0].n_chunks;
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentValueLayout layout,
                           storage::SegmentValueLayout::Make(L, h, n_chunks, p.chunk_size, m.shape.d, p.codec));
  KVSHADE_RETURN_IF_ERROR(store_->Create(seg->id, layout));
  for (int l = 0; l < L && n_chunks > 0; ++l) {
    LayerData& ld = seg->layers[l];
    std::vector<std::byte> packed(layout.dense_layer_bytes());
    for (int hh = 0; hh < h; ++hh) {
      for (int j = 0; j < n_chunks; ++j) {
        std::memcpy(packed.data() + (size_t(hh) * n_chunks + j) * layout.chunk_bytes,
                    static_cast<const std::byte*>(ld.open_values.buffer.data()) +
                        size_t(hh) * ld.open_values.head_stride() + size_t(j) * ld.open_values.chunk_stride,
                    layout.chunk_bytes);
      }
    }
    absl::Status st = store_->WriteLayer(seg->id, l, packed);
    if (!st.ok()) {
      store_->Erase(seg->id).IgnoreError();
      s.open = seg;
      return st;
    }
  }
  seg->values_in_store = true;
  seg->value_layout = layout;
  seg->durable = s.durable;
  if (absl::Status st = SealSegmentValues(*seg, s.durable, m); !st.ok()) {
    store_->Erase(seg->id).IgnoreError();
    seg->values_in_store = false;
    s.open = seg;
    return st;
  }
  for (LayerData& ld : seg->layers) {
    ld.open_values = OpenValues();
    ld.cap_chunks = ld.n_chunks;
  }
  s.chain.push_back(std::move(seg));
  ++s.static_version;
  return absl::OkStatus();
}

}  // namespace kvshade::service

// AppendTokens (generated or new-turn tokens, all layers at once) and the open segment.
//
// shadow : new tokens join the exact tail (pre-RoPE K kept for projection, post-RoPE K, V).
//          When the tail exceeds local_window + C, whole chunks leave it: keys projected
//          onto the layer's basis (rows appended to A), values encoded into the open
//          segment's value buffer, a landmark appended; the chunks become selectable.
// mini   : new tokens join a bf16 residual; every R = 128 tokens (rounded down to whole
//          KIVI groups) the oldest are quantized INT2 and move to the open segment.
// exact  : new tokens are appended to the open segment as they are.
// The open segment is sealed (made immutable, values moved into the HostValueStore) when
// the session is forked at its end or drained; it then joins the chain.
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/kernels/status_macros.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::ArenaKind;

constexpr int kMiniResidual = 128;  // MiniKV's R

template <typename T>
T* Ptr(const DeviceBlock& b) {
  return static_cast<T*>(b.data());
}

// Grows a device block to `new_bytes`, keeping its first `used` bytes.
absl::Status GrowDevice(EngineImpl& e, DeviceBlock& blk, size_t used, size_t new_bytes,
                        ArenaKind kind) {
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock nb, e.Alloc(new_bytes, kind));
  if (used > 0) {
    std::vector<std::byte> tmp(used);
    KVSHADE_RETURN_IF_ERROR(e.Download(tmp.data(), blk.data(), used));
    KVSHADE_RETURN_IF_ERROR(e.backend_->CopyFromHost(nb.data(), tmp.data(), used));
  }
  blk = std::move(nb);
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
  KVSHADE_RETURN_IF_ERROR(e.backend_->CopyFromHost(Ptr<bf16>(ld.tk) + size_t(ld.n_tail) * tok, k,
                                                   Bf16Bytes(size_t(n) * tok)));
  KVSHADE_RETURN_IF_ERROR(e.backend_->CopyFromHost(Ptr<bf16>(ld.tv) + size_t(ld.n_tail) * tok, v,
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

}  // namespace

// Moves `m` whole chunks from the front of a shadow tail into the open segment.
static absl::Status MigrateChunks(EngineImpl& e, Session& s, int layer, int m) {
  const kernels::LayerShape& shape = s.model.shape;
  const int h = shape.h, d = shape.d, C = s.profile.chunk_size, D = shape.D();
  const int rows = m * C;
  TailLayer& tl = s.tail[layer];
  LayerData& ld = s.open->layers[layer];
  if (!ld.basis) {
    for (const auto& seg : s.chain) {
      if (seg->layers[layer].basis) ld.basis = seg->layers[layer].basis;
    }
    if (!ld.basis) return absl::FailedPreconditionError("shadow session without a basis");
  }
  const Basis& basis = *ld.basis;
  const int r = basis.r;
  StageTimer timer(e.metrics_, "append");
  // Keys: a = k_pre W (ProjectKeys), residual tracked as drift.
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, e.Upload(tl.k_pre.data(), Bf16Bytes(size_t(rows) * D), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ad, e.Alloc(Bf16Bytes(size_t(rows) * r), ArenaKind::kOther));
  const size_t wsb = e.backend_->ProjectWorkspaceBytes(rows, shape, r);
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(
      kernels::ProjectionResult pr,
      e.backend_->ProjectKeys(absl::Span<const bf16>(Ptr<const bf16>(kd), size_t(rows) * D), rows, shape,
                              absl::Span<const bf16>(Ptr<const bf16>(basis.b), size_t(h) * r * d), r,
                              absl::Span<bf16>(Ptr<bf16>(ad), size_t(rows) * r),
                              kernels::Workspace{ws.data(), wsb}));
  e.metrics_->ProjectionResidual(pr.residual_energy);
  s.drift[layer] = std::max(s.drift[layer], pr.residual_energy);
  // Landmarks from the post-RoPE keys.
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock krd, e.Upload(tl.k.data(), Bf16Bytes(size_t(rows) * D), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock lmd, e.Alloc(Bf16Bytes(size_t(m) * D), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock mcd, e.Alloc(size_t(h) * m * 4, ArenaKind::kOther));
  KVSHADE_RETURN_IF_ERROR(e.backend_->BuildLandmarks(
      absl::Span<const bf16>(Ptr<const bf16>(krd), size_t(rows) * D), rows, h, d, C, m,
      absl::Span<bf16>(Ptr<bf16>(lmd), size_t(m) * D), absl::Span<float>(Ptr<float>(mcd), size_t(h) * m)));
  // Values: [h, m, chunk_bytes].
  KVSHADE_ASSIGN_OR_RETURN(const size_t cb, kernels::ValueChunkBytes(s.profile.codec, C, d));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vd, e.Upload(tl.v.data(), Bf16Bytes(size_t(rows) * D), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ed, e.Alloc(size_t(h) * m * cb, ArenaKind::kOther));
  KVSHADE_RETURN_IF_ERROR(e.backend_->EncodeValueChunks(
      absl::Span<const bf16>(Ptr<const bf16>(vd), size_t(rows) * D), rows, h, d, C, m, s.profile.codec,
      absl::Span<std::byte>(Ptr<std::byte>(ed), size_t(h) * m * cb)));
  std::vector<bf16> a_host(size_t(rows) * r), lm_host(size_t(m) * D);
  std::vector<std::byte> enc(size_t(h) * m * cb);
  KVSHADE_RETURN_IF_ERROR(e.Download(a_host.data(), ad.data(), Bf16Bytes(a_host.size())));
  KVSHADE_RETURN_IF_ERROR(e.Download(lm_host.data(), lmd.data(), Bf16Bytes(lm_host.size())));
  KVSHADE_RETURN_IF_ERROR(e.Download(enc.data(), ed.data(), enc.size()));

  // Capacity.
  const int n0 = ld.n_chunks;
  const int64_t stride = int64_t((cb + storage::kValueChunkAlign - 1) / storage::kValueChunkAlign *
                                 storage::kValueChunkAlign);
  if (n0 + m > ld.cap_chunks) {
    const int cap = std::max({ld.cap_chunks * 2, n0 + m, 16});
    auto a = std::make_shared<DeviceBlock>();
    if (ld.a) *a = std::move(*ld.a);
    KVSHADE_RETURN_IF_ERROR(GrowDevice(e, *a, Bf16Bytes(size_t(n0) * C * r),
                                       Bf16Bytes(size_t(cap) * C * r), ArenaKind::kA));
    ld.a = std::move(a);
    KVSHADE_RETURN_IF_ERROR(GrowDevice(e, ld.landmarks, Bf16Bytes(size_t(n0) * D),
                                       Bf16Bytes(size_t(cap) * D), ArenaKind::kLandmarks));
    KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer vb, e.backend_->AllocateHostVisible(size_t(h) * cap * stride));
    std::memset(vb.data(), 0, vb.bytes());
    for (int hh = 0; hh < h && n0 > 0; ++hh) {
      std::memcpy(static_cast<std::byte*>(vb.data()) + size_t(hh) * cap * stride,
                  static_cast<const std::byte*>(ld.open_values.buffer.data()) +
                      size_t(hh) * ld.open_values.head_stride(),
                  size_t(n0) * stride);
    }
    ld.open_values.buffer = std::move(vb);
    ld.open_values.cap_chunks = cap;
    ld.open_values.chunk_stride = stride;
    ld.cap_chunks = cap;
  }
  KVSHADE_RETURN_IF_ERROR(e.backend_->CopyFromHost(Ptr<bf16>(*ld.a) + size_t(n0) * C * r,
                                                   a_host.data(), Bf16Bytes(a_host.size())));
  KVSHADE_RETURN_IF_ERROR(e.backend_->CopyFromHost(Ptr<bf16>(ld.landmarks) + size_t(n0) * D,
                                                   lm_host.data(), Bf16Bytes(lm_host.size())));
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < m; ++j) {
      std::memcpy(static_cast<std::byte*>(ld.open_values.buffer.data()) +
                      size_t(hh) * ld.open_values.head_stride() + size_t(n0 + j) * stride,
                  enc.data() + (size_t(hh) * m + j) * cb, cb);
    }
  }
  ld.n_chunks = n0 + m;
  const size_t gone = size_t(rows) * D;
  tl.k_pre.erase(tl.k_pre.begin(), tl.k_pre.begin() + gone);
  tl.k.erase(tl.k.begin(), tl.k.begin() + gone);
  tl.v.erase(tl.v.begin(), tl.v.begin() + gone);
  return absl::OkStatus();
}

// Quantizes the oldest `rows` residual tokens of a mini tail into the open segment.
static absl::Status QuantizeResidual(EngineImpl& e, Session& s, int layer, int rows) {
  const int h = s.model.shape.h, d = s.model.shape.d;
  const size_t tok = size_t(h) * d;
  TailLayer& tl = s.tail[layer];
  std::vector<bf16> k(size_t(rows) * tok), v(k.size());
  for (int hh = 0; hh < h; ++hh) {  // [rows, h, d] -> [h, rows, d]
    for (int t = 0; t < rows; ++t) {
      std::copy_n(tl.k.begin() + t * tok + hh * d, d, k.begin() + (size_t(hh) * rows + t) * d);
      std::copy_n(tl.v.begin() + t * tok + hh * d, d, v.begin() + (size_t(hh) * rows + t) * d);
    }
  }
  KiviBlock kb;
  std::vector<bf16> dk, dv;
  KVSHADE_RETURN_IF_ERROR(QuantizeKivi(e, d, s.profile.kivi_group, k, v, h * rows, &kb, &dk, &dv));
  kb.rows = kb.valid = rows;
  // Dequantized rows back to token-major: every head holds the same tokens.
  std::vector<bf16> tk(k.size()), tv(k.size());
  for (int hh = 0; hh < h; ++hh) {
    for (int t = 0; t < rows; ++t) {
      std::copy_n(dk.begin() + (size_t(hh) * rows + t) * d, d, tk.begin() + t * tok + hh * d);
      std::copy_n(dv.begin() + (size_t(hh) * rows + t) * d, d, tv.begin() + t * tok + hh * d);
    }
  }
  LayerData& ld = s.open->layers[layer];
  KVSHADE_RETURN_IF_ERROR(AppendExactTokens(e, ld, tk.data(), tv.data(), rows, tok));
  ld.int2.push_back(std::move(kb));
  tl.k.erase(tl.k.begin(), tl.k.begin() + size_t(rows) * tok);
  tl.v.erase(tl.v.begin(), tl.v.begin() + size_t(rows) * tok);
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
  KVSHADE_RETURN_IF_ERROR(sessions_.CheckWriter(t.name, s, r.attachment_id()));

  std::unique_lock lock(s.mu);
  if (s.state == SessionState::kClosed) {
    return absl::NotFoundError(absl::StrCat("session '", s.id, "' not found (closed)"));
  }
  if (s.state != SessionState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", s.id, "' is ", SessionStateName(s.state), "; commit its ingest first"));
  }
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(absl::MakeConstSpan(r.token_ids().data(), n), s.tokens,
                                         config_->limits, "token_ids"));
  StageTimer timer(metrics_, "append");
  const size_t tok = size_t(h) * d;
  const int64_t first = static_cast<int64_t>(s.tokens);
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock posd, DevicePositions(first, n));
  const absl::Span<const int64_t> pos(Ptr<const int64_t>(posd), size_t(n));
  const ProfileInfo& p = s.profile;
  for (int l = 0; l < L; ++l) {
    // Post-RoPE keys of the new tokens.
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, Upload(ks[l].data(), Bf16Bytes(ks[l].size()), ArenaKind::kOther));
    KVSHADE_RETURN_IF_ERROR(backend_->ApplyRope(m.rope, pos, h, d,
                                                absl::Span<bf16>(Ptr<bf16>(kd), ks[l].size())));
    std::vector<bf16> kr(ks[l].size());
    KVSHADE_RETURN_IF_ERROR(Download(kr.data(), kd.data(), Bf16Bytes(kr.size())));
    if (p.kind == v1::PROFILE_KIND_EXACT) {
      if (!s.open) s.open = NewOpen(*this, s, first);
      KVSHADE_RETURN_IF_ERROR(AppendExactTokens(*this, s.open->layers[l], kr.data(), vs[l].data(), n, tok));
      continue;
    }
    TailLayer& tl = s.tail[l];
    if (p.kind == v1::PROFILE_KIND_SHADOW) {
      tl.k_pre.insert(tl.k_pre.end(), ks[l].begin(), ks[l].end());
    }
    tl.k.insert(tl.k.end(), kr.begin(), kr.end());
    tl.v.insert(tl.v.end(), vs[l].begin(), vs[l].end());
    const int t_len = static_cast<int>(tl.k.size() / tok);
    if (p.kind == v1::PROFILE_KIND_SHADOW) {
      if (t_len > p.local_window + p.chunk_size) {
        const int chunks = (t_len - p.local_window) / p.chunk_size;
        if (!s.open) s.open = NewOpen(*this, s, first + n - t_len);
        KVSHADE_RETURN_IF_ERROR(MigrateChunks(*this, s, l, chunks));
      }
    } else {  // mini
      const int G = p.kivi_group;
      const int R = std::max(G, kMiniResidual / G * G);
      if (t_len >= R) {
        if (!s.open) s.open = NewOpen(*this, s, first + n - t_len);
        KVSHADE_RETURN_IF_ERROR(QuantizeResidual(*this, s, l, t_len / R * R));
      }
    }
  }
  if (s.open) {
    const LayerData& l0 = s.open->layers[0];
    s.open->n_tokens = p.kind == v1::PROFILE_KIND_SHADOW ? int64_t(l0.n_chunks) * p.chunk_size : l0.n_tail;
  }
  s.tokens += n;
  s.appended_tokens.insert(s.appended_tokens.end(), r.token_ids().begin(), r.token_ids().end());
  ++s.tail_version;
  bool drifted = false;
  for (double x : s.drift) drifted = drifted || x > p.refactor_threshold;
  if (drifted) metrics_->ProjectionResidual(*std::max_element(s.drift.begin(), s.drift.end()));
  v1::AppendTokensResponse resp;
  resp.set_tokens(s.tokens);
  return resp;
}

absl::Status EngineImpl::SealOpen(Session& s) {
  if (!s.open) return absl::OkStatus();
  std::shared_ptr<Segment> seg = std::move(s.open);
  s.open.reset();
  const ModelInfo& m = s.model;
  const ProfileInfo& p = s.profile;
  const int L = m.layers, h = m.shape.h;
  bool empty = true;
  for (const LayerData& ld : seg->layers) empty = empty && ld.n_chunks == 0 && ld.n_tail == 0;
  if (empty) return absl::OkStatus();
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

// The shadow profile (docs/ALGORITHM.md "Shadow"): low-rank keys (a shared basis per layer
// and coordinates per token), landmarks and optional key signatures per chunk for
// selection, values in the host value store, an always-attended static set (sink,
// outliers, heavy chunks) and an exact tail of at most local_window + C tokens.
//
// Ingest: kernels::CompressShadowLayer (factorize, RoPE, landmarks, outliers, heavy
// chunks, values, static set, tail). A suffix after a reused prefix is then projected onto
// the prefix's basis (ProjectKeys) and its residual energy reported; past
// refactor_threshold a background refactorization is scheduled. Segments shorter than
// local_window + C are all exact tail. Every token keeps its coordinates A (the exact
// remainder's too): at the commit, and at later appends, the session's one exact tail
// gives its oldest whole chunks to the open segment while it holds more than
// local_window + C tokens (TrimShadowTail, append.cc).
// Append: new tokens join the exact tail (pre-RoPE K kept for projection, post-RoPE K, V).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <shared_mutex>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/kernels/shadow_layer.h"
#include "kvshade/service/metrics.h"
#include "profile.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::ArenaKind;

// Where kernel composites (CompressShadowLayer) take their buffers: the engine's device
// arena, with its evict-and-retry, so that a layer's factors, landmarks, static set and
// scratch count against device_budget_bytes and no request calls the device allocator.
// It also records the most bytes the composite held at once (peak_bytes()).
class ArenaAllocator final : public kernels::Allocator {
 public:
  explicit ArenaAllocator(EngineImpl& engine) : engine_(engine) {}
  absl::StatusOr<kernels::Buffer> Allocate(size_t bytes, kernels::BufferKind kind) override {
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock block, engine_.Alloc(bytes, ToArenaKind(kind)));
    auto holder = std::make_shared<DeviceBlock>(std::move(block));
    void* data = holder->data();
    const size_t now = live_->fetch_add(bytes) + bytes;
    peak_ = std::max(peak_, now);
    // The Buffer keeps the arena block alive; releasing it returns the block to the pool.
    return kernels::Buffer(data, bytes, [holder, live = live_, bytes](void*) { *live -= bytes; });
  }
  size_t peak_bytes() const { return peak_; }

 private:
  static ArenaKind ToArenaKind(kernels::BufferKind kind) {
    switch (kind) {
      case kernels::BufferKind::kFactorA: return ArenaKind::kA;
      case kernels::BufferKind::kFactorB: return ArenaKind::kB;
      case kernels::BufferKind::kLandmarks: return ArenaKind::kLandmarks;
      case kernels::BufferKind::kSignatures: return ArenaKind::kSignatures;
      case kernels::BufferKind::kStatic: return ArenaKind::kStatic;
      case kernels::BufferKind::kScratch: return ArenaKind::kOther;
    }
    return ArenaKind::kOther;
  }
  EngineImpl& engine_;
  std::shared_ptr<std::atomic<size_t>> live_ = std::make_shared<std::atomic<size_t>>(0);
  size_t peak_ = 0;  // Allocate runs on one thread (the composite's)
};

// Heavy-chunk counts per layer: the pyramid (docs/ALGORITHM.md) scaled to a mean of `mean`.
std::vector<int> HeavyPerLayer(int layers, int mean) {
  std::vector<int> out(layers, 0);
  if (mean <= 0) return out;
  constexpr double kX = 0.25;  // any x keeping every layer's fraction in [0, 1]
  auto b = kernels::PyramidBudgets(layers, kX);
  for (int l = 0; l < layers; ++l) {
    out[l] = b.ok() ? static_cast<int>(std::lround(mean * (*b)[l] / kX)) : mean;
  }
  return out;
}

class ShadowIngest final : public ProfileIngest {
 public:
  explicit ShadowIngest(IngestContext& context) : cx(context), e(context.engine()) {
    const Session& s = cx.session();
    const int L = s.model.layers;
    heavy_ = HeavyPerLayer(L, s.profile.heavy_chunks);
    std::shared_lock lock(s.mu);
    if (!s.chain.empty()) {
      prefix_basis_.resize(L);
      for (int l = 0; l < L; ++l) prefix_basis_[l] = s.chain.back()->layers[l].basis;
    }
  }

  absl::Status CompressLayer(int l) override {
    for (size_t r = 0; r < cx.range_count(); ++r) KVSHADE_RETURN_IF_ERROR(ProcessShadowRange(l, r));
    return absl::OkStatus();
  }

  // One range of a shadow layer: its own basis when nothing comes before it in the
  // session, else projected onto the basis of the segment before it (a reused prefix's or
  // the range before it).
  absl::Status ProcessShadowRange(int l, size_t r) {
    IngestLayer& b = cx.layer(l);
    IngestRange& rg = cx.range(r);
    const ModelInfo& m = cx.session().model;
    const ProfileInfo& p = cx.session().profile;
    const int C = p.chunk_size;
    const int n = rg.n;
    const int64_t first = rg.first;
    const bool last = r + 1 == cx.range_count();
    LayerData& out = rg.out[l];
    const std::shared_ptr<const Basis> pb =
        r > 0 ? cx.range(r - 1).out[l].basis : prefix_basis_.empty() ? nullptr : prefix_basis_[l];
    const absl::Span<const bf16> keys = cx.Rows(b.kd, rg);

    if (n < p.local_window + C) {
      // Too short to chunk: every token is exact tail (CreateSession guarantees a basis
      // from the prefix or an earlier range in this case).
      KVSHADE_RETURN_IF_ERROR(cx.EnsureStoreSegment(rg, 0));
      if (!pb) {
        return absl::FailedPreconditionError(
            "shadow segment without a basis: the prompt is shorter than local_window + "
            "chunk_size");
      }
      out.basis = pb;
      auto a = std::make_shared<DeviceBlock>();  // for when these tokens leave the tail
      KVSHADE_ASSIGN_OR_RETURN(const double residual, cx.Project(keys, *pb, a.get()));
      cx.NoteResidual(l, residual);
      out.a = std::move(a);
      if (last && cx.residual(l) > p.refactor_threshold) KVSHADE_RETURN_IF_ERROR(cx.KeepForRefactor(l, keys));
      KVSHADE_RETURN_IF_ERROR(cx.TakeRows(b, rg, &out.tk, &out.tv));
      KVSHADE_RETURN_IF_ERROR(cx.RopeInPlace(out.tk, first, n));
      out.n_tail = out.cap_tail = n;
      return absl::OkStatus();
    }

    DeviceBlock qd;
    std::vector<int64_t> qpos;
    kernels::ShadowObservation obs;
    // The observation queries are the prompt's last ones: they serve the last range.
    const int w = last ? std::min(b.w, n) : 0;
    const bool use_obs = w > 0 && heavy_[l] > 0;
    if (use_obs) {
      const size_t q_row = size_t(m.shape.query_heads()) * m.shape.d;
      const bf16* q_first = b.qobs.data() + size_t(b.w - w) * q_row;
      KVSHADE_ASSIGN_OR_RETURN(qd, e.Upload(q_first, Bf16Bytes(size_t(w) * q_row), ArenaKind::kOther));
      qpos = Positions(first + n - w, w);
      obs.qobs = absl::Span<const bf16>(static_cast<const bf16*>(qd.data()), size_t(w) * q_row);
      obs.q_positions = qpos;
      obs.w = w;
    }
    kernels::ShadowParams sp;
    sp.C = C;
    sp.rank = std::min({p.rank, m.shape.D(), n / 8 * 8});
    sp.energy_target = pb ? 0.0 : p.energy_target;
    sp.subspace_iterations = static_cast<int>(e.config().profile.factorize_iterations);
    sp.outliers = p.outliers;
    sp.keep_sink = p.keep_sink && first == 0;  // the sink is the session's first chunk
    sp.local_min = p.local_window;
    sp.heavy_chunks = use_obs ? heavy_[l] : 0;
    sp.heavy_group = p.kivi_group;
    sp.codec = p.codec;
    sp.signature_bits = p.key_signature_bits;
    // The values are encoded straight into the segment's block in the host value store
    // when its layout is packed (chunk_stride == chunk_bytes), else copied in afterwards.
    KVSHADE_RETURN_IF_ERROR(cx.EnsureStoreSegment(rg, (n - sp.local_min) / C));
    absl::Span<std::byte> values_out;
    if (rg.layout.chunk_stride == rg.layout.chunk_bytes) {
      KVSHADE_ASSIGN_OR_RETURN(values_out, e.store().MutableLayer(rg.id, l));
    }
    kernels::ShadowLayer sl;
    ArenaAllocator allocator(e);
    {
      StageTimer timer(e.metrics(), "ingest_factorize");
      absl::StatusOr<kernels::ShadowLayer> r = kernels::CompressShadowLayer(
          e.backend(), m.shape, m.rope, sp, keys, cx.Rows(b.vd, rg), n, first,
          use_obs ? &obs : nullptr, kernels::Stream{}, &allocator, values_out);
      cx.NoteCompressionPeak(allocator.peak_bytes());
      if (!r.ok()) return r.status();
      sl = *std::move(r);
      if (sl.factorize.subspace_fallback) e.metrics()->FactorizeFallback();
    }
    if (values_out.data() == nullptr) {
      StageTimer timer(e.metrics(), "ingest_values");
      const size_t bytes = size_t(m.shape.h) * sl.n_chunks * sl.value_chunk_bytes;
      KVSHADE_RETURN_IF_ERROR(e.store().WriteLayer(
          rg.id, l, absl::Span<const std::byte>(static_cast<const std::byte*>(sl.values.data()), bytes)));
    }
    out.n_chunks = out.cap_chunks = sl.n_chunks;
    if (pb) {
      auto a = std::make_shared<DeviceBlock>();
      KVSHADE_ASSIGN_OR_RETURN(const double residual, cx.Project(keys, *pb, a.get()));
      cx.NoteResidual(l, residual);
      out.a = std::move(a);
      out.basis = pb;
      if (last && cx.residual(l) > p.refactor_threshold) KVSHADE_RETURN_IF_ERROR(cx.KeepForRefactor(l, keys));
    } else {
      auto basis = std::make_shared<Basis>();
      basis->r = sl.r;
      basis->b = DeviceBlock(std::move(sl.b));
      out.basis = std::move(basis);
      out.a = std::make_shared<DeviceBlock>(std::move(sl.a));
      cx.set_captured(l, sl.factorize.captured_energy);
    }
    out.landmarks = DeviceBlock(std::move(sl.landmarks));
    if (sl.signature_bits > 0) {
      out.sig_bits = sl.signature_bits;
      out.sig = DeviceBlock(std::move(sl.sig));
    }
    out.excluded = DeviceBlock(std::move(sl.excluded));
    out.s_cap = sl.static_capacity * C;
    out.s_len.resize(m.shape.h);
    for (int hh = 0; hh < m.shape.h; ++hh) out.s_len[hh] = sl.static_count[hh] * C;
    out.sk = DeviceBlock(std::move(sl.static_k));
    out.sv = DeviceBlock(std::move(sl.static_v));
    out.static_chunks_per_head = sl.static_capacity;
    out.s_pos.assign(size_t(m.shape.h) * out.s_cap, -1);
    for (int hh = 0; hh < m.shape.h; ++hh) {
      for (int i = 0; i < sl.static_capacity; ++i) {
        const int32_t chunk = sl.static_chunks[size_t(hh) * sl.static_capacity + i];
        if (chunk < 0) continue;
        for (int j = 0; j < C; ++j) {
          out.s_pos[(size_t(hh) * sl.static_capacity + i) * C + j] = first + int64_t(chunk) * C + j;
        }
      }
    }
    if (sl.n_heavy > 0) {
      KiviBlock kb;
      kb.rows = sl.heavy_rows_per_head;
      kb.valid = sl.n_heavy * C;
      kb.k_codes = DeviceBlock(std::move(sl.heavy_k_codes));
      kb.k_scale = DeviceBlock(std::move(sl.heavy_k_scale));
      kb.k_min = DeviceBlock(std::move(sl.heavy_k_min));
      kb.v_codes = DeviceBlock(std::move(sl.heavy_v_codes));
      kb.v_scale = DeviceBlock(std::move(sl.heavy_v_scale));
      kb.v_min = DeviceBlock(std::move(sl.heavy_v_min));
      out.int2.push_back(std::move(kb));
    }
    out.n_tail = out.cap_tail = sl.n_tail;
    out.tk = DeviceBlock(std::move(sl.tail_k));
    out.tv = DeviceBlock(std::move(sl.tail_v));
    return absl::OkStatus();
  }

  void Report(Metrics* metrics, v1::IngestResponse* resp, absl::Span<const double> captured,
              absl::Span<const double> residual, bool projected) const override {
    const size_t L = captured.size();
    for (size_t l = 0; l < L; ++l) {
      if (prefix_basis_.empty()) metrics->ReconstructionEnergy(captured[l]);
      if (projected) metrics->ProjectionResidual(residual[l]);
    }
    for (size_t l = 0; l < L; ++l) {
      resp->add_captured_energy(static_cast<float>(captured[l]));
      if (projected) resp->add_residual_energy(static_cast<float>(residual[l]));
    }
  }

 private:
  IngestContext& cx;
  EngineImpl& e;
  std::vector<std::shared_ptr<const Basis>> prefix_basis_;
  std::vector<int> heavy_;
};

class Shadow final : public ProfileStrategy {
 public:
  v1::ProfileKind kind() const override { return v1::PROFILE_KIND_SHADOW; }

  absl::Status Resolve(const ProfileRequest& r, ProfileInfo& o) const override {
    const ProfileDefaults& def = r.defaults;
    // Long contexts keep int4 values in host RAM (a quarter of bf16, within half a point
    // of bf16 accuracy: bench/RESULTS.md); shorter ones bf16.
    KVSHADE_RETURN_IF_ERROR(ResolveValueCodec(
        r, r.n_tokens >= def.int4_from_tokens ? kernels::ValueCodec::kINT4 : kernels::ValueCodec::kBF16,
        o));
    KVSHADE_RETURN_IF_ERROR(ResolveKeySignatureBits(r, /*takes=*/true, o));
    const int D = r.model.shape.D();
    const int d = r.model.shape.d;
    KVSHADE_RETURN_IF_ERROR(CheckWindowRanges(o));
    if (o.rank < 8 || o.rank % 8 != 0 || o.rank > D) {
      return BadProfileField("profile.rank", absl::StrCat("must be a multiple of 8 in [8, h*d = ", D,
                                                          "], got ", o.rank));
    }
    if (o.codec.codec == kernels::ValueCodec::kINT2 || o.codec.codec == kernels::ValueCodec::kINT4 ||
        o.heavy_chunks > 0) {
      // KIVI groups run along the head dim for values. Heavy chunks are INT2 whatever the
      // value codec: 2-bit groups then, even with int4 values.
      const bool int2_groups = o.codec.codec == kernels::ValueCodec::kINT2 || o.heavy_chunks > 0;
      if (o.kivi_group < 1 || d % o.kivi_group != 0 || o.kivi_group % (int2_groups ? 16 : 8) != 0) {
        return BadProfileField("profile.kivi_group",
                               absl::StrCat("must divide head_dim = ", d, " and be a multiple of 16 (8 for "
                                            "int4 values without heavy chunks), got ", o.kivi_group));
      }
    }
    if (o.key_signature_bits > 0 && (int64_t{d} * o.key_signature_bits) % 32 != 0) {
      return BadProfileField("profile.key_signature_bits",
                             absl::StrCat("needs head_dim * bits to be a multiple of 32, got head_dim = ", d,
                                          " and ", o.key_signature_bits, " bits"));
    }
    if (auto b = kernels::ValueChunkBytes(o.codec, o.chunk_size, d); !b.ok()) {
      return BadProfileField("profile.value_codec", std::string(b.status().message()));
    }
    // Selection units: a divisor of chunk_size below it, with two-stage selection.
    bool asked = false;
    const uint32_t u = RequestedSelectionUnit(r, &asked);
    if (u != 0 && u != static_cast<uint32_t>(o.chunk_size)) {
      if (u > static_cast<uint32_t>(o.chunk_size) || o.chunk_size % u != 0) {
        return BadProfileField("profile.selection_unit",
                               absl::StrCat("must divide chunk_size = ", o.chunk_size,
                                            " (0 or chunk_size: whole chunks), got ", u));
      }
      if (o.rerank_factor < 2) {
        return BadProfileField(
            "profile.selection_unit",
            absl::StrCat("needs two-stage selection (rerank_factor > 1), got selection_unit = ",
                         u, " with rerank_factor = ", o.rerank_factor));
      }
      o.selection_unit = static_cast<int>(u);
    }
    return absl::OkStatus();
  }

  bool selects() const override { return true; }
  int SlotsPerHead(const ProfileInfo& p) const override { return p.slots(p.sparse_budget); }
  // A shadow segment before another one has chunks of its own (its remainder stays exact
  // between the two).
  int64_t MinClosedSegment(const ProfileInfo& p) const override {
    return int64_t(p.local_window) + p.chunk_size;
  }

  absl::Status CheckSession(const ModelInfo&, const ProfileInfo& profile, uint64_t reused,
                            size_t prompt_tokens) const override {
    if (reused == 0 && prompt_tokens < size_t(profile.local_window + profile.chunk_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token_ids: a shadow session needs at least local_window + chunk_size = ",
          profile.local_window + profile.chunk_size, " prompt tokens, got ", prompt_tokens,
          " (use the auto, mini or exact profile for short prompts)"));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<ProfileIngest> StartIngest(IngestContext& cx) const override {
    return std::make_unique<ShadowIngest>(cx);
  }

  // The prompt's remainder may join an earlier segment's (a short suffix), and a restored
  // record holds the prompt's whole remainder: whole chunks leave the tail.
  absl::Status SettleTail(EngineImpl& e, Session& s) const override { return TrimShadowTail(e, s); }

  absl::Status AppendLayer(EngineImpl&, Session& s, int l, int64_t, int,
                           const std::vector<bf16>& k, const std::vector<bf16>& kr,
                           const std::vector<bf16>& v) const override {
    TailLayer& tl = s.tail[l];
    tl.k_pre.insert(tl.k_pre.end(), k.begin(), k.end());
    tl.k.insert(tl.k.end(), kr.begin(), kr.end());
    tl.v.insert(tl.v.end(), v.begin(), v.end());
    return absl::OkStatus();
  }

  absl::Status FinishAppend(EngineImpl& e, Session& s, int n) const override {
    // One exact tail of at most local_window + C tokens, the prompt's remainder included.
    if (absl::Status st = TrimShadowTail(e, s); !st.ok()) {
      const size_t added = size_t(n) * s.model.shape.h * s.model.shape.d;  // the append does not happen
      for (TailLayer& tl : s.tail) {
        tl.k_pre.resize(tl.k_pre.size() - added);
        tl.k.resize(tl.k.size() - added);
        tl.v.resize(tl.v.size() - added);
      }
      return st;
    }
    return absl::OkStatus();
  }
};

}  // namespace

const ProfileStrategy& ShadowProfile() {
  static const Shadow profile;
  return profile;
}

}  // namespace kvshade::service

// The shadow profile (docs/ALGORITHM.md "Shadow"): low-rank keys (a shared basis per layer
// and coordinates per token), landmarks and optional key signatures per chunk for
// selection, values in the host value store, an always-attended static set (sink,
// outliers, heavy chunks) and an exact tail of at most local_window + C tokens.
//
// Ingest: kernels::CompressShadowLayer (factorize, RoPE, landmarks, outliers, heavy
// chunks, values, static set, tail). A suffix after a reused prefix is then projected onto
// the prefix's basis (ProjectKeys) and its residual energy reported; when that residual,
// weighted by the suffix's share of the session's tokens, passes refactor_threshold, a
// background refactorization is scheduled. Segments shorter than
// local_window + C are all exact tail. Every token keeps its coordinates A (the exact
// remainder's too): at the commit, and at later appends, the session's one exact tail
// gives its oldest whole chunks to the open segment while it holds more than
// local_window + C tokens (TrimShadowTail, below).
// Append: new tokens join the exact tail (pre-RoPE K kept for projection, post-RoPE K, V).
#include <algorithm>
#include <cstring>
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

  absl::Status CompressLayer(int l, size_t first_range) override {
    for (size_t r = first_range; r < cx.range_count(); ++r) {
      KVSHADE_RETURN_IF_ERROR(ProcessShadowRange(cx.layer(l), l, r));
    }
    return absl::OkStatus();
  }

  // A range needs only its own rows and the basis of the range before it.
  bool compresses_ranges_early() const override { return true; }
  absl::Status CompressRange(IngestLayer& rows, int l, size_t r) override {
    return ProcessShadowRange(rows, l, r);
  }

  // One range of a shadow layer: its own basis when nothing comes before it in the
  // session, else projected onto the basis of the segment before it (a reused prefix's or
  // the range before it).
  absl::Status ProcessShadowRange(IngestLayer& b, int l, size_t r) {
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
    const absl::Span<const bf16> keys = cx.Rows(b, b.kd, rg);

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
      cx.NoteResidual(l, residual, n);
      out.a = std::move(a);
      if (last && cx.session_residual(l) > p.refactor_threshold) KVSHADE_RETURN_IF_ERROR(cx.KeepForRefactor(l, keys));
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
    sp.host_subspace_min_tokens = static_cast<int>(e.config().profile.factorize_host_min_tokens);
    sp.outliers = p.outliers;
    sp.keep_sink = p.keep_sink && first == 0;  // the sink is the session's first chunk
    sp.local_min = p.local_window;
    sp.heavy_chunks = use_obs ? heavy_[l] : 0;
    sp.heavy_group = p.kivi_group;
    sp.codec = p.codec;
    sp.signature_bits = p.key_signature_bits;
    sp.factorize = !pb;  // with a basis, the keys are projected onto it below
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
      // A range projected onto a basis it was given compresses without factorizing.
      StageTimer timer(e.metrics(), pb ? "ingest_compress" : "ingest_factorize");
      absl::StatusOr<kernels::ShadowLayer> r = kernels::CompressShadowLayer(
          e.backend(), m.shape, m.rope, sp, keys, cx.Rows(b, b.vd, rg), n, first,
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
      cx.NoteResidual(l, residual, n);
      out.a = std::move(a);
      out.basis = pb;
      if (last && cx.session_residual(l) > p.refactor_threshold) KVSHADE_RETURN_IF_ERROR(cx.KeepForRefactor(l, keys));
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


// --- The shadow tail -------------------------------------------------------------------
//
// The exact tail is the run of tokens at the end of the session that no chunk covers: first
// the remainder rows (LayerData::n_tail, post-RoPE K and V) of the chain's last segments,
// then the appended tokens in Session::tail. Whole chunks leave it from its front into the
// open segment, whose chunks therefore start inside a remainder (first_position = the
// first tail token) and follow the chain's chunks in token order. A remainder token leaves
// with its coordinates A (K W of its pre-RoPE key, kept by the ingest for every token of a
// segment, on the segment's basis, which is the session's); an appended token's pre-RoPE
// key is projected onto the basis then. Sealed segments never change: which remainder
// rows left is implied by the open (or a sealed open) segment's chunk range
// (CoveredRemainderRows).

namespace {

// Remainder rows [from, from + rows) of one segment of the chain.
struct TailPiece {
  const Segment* seg = nullptr;
  int from = 0;
  int rows = 0;
};

struct TailPlan {
  int64_t first = 0;              // absolute position of the tail's first token
  std::vector<TailPiece> pieces;  // the chain's part of the tail, in token order
  int chain_rows = 0;
  int appended_rows = 0;          // Session::tail rows, after the chain's
};

// The basis chunks moved now are projected onto (the open segment's, else the newest of
// the chain's).
std::shared_ptr<const Basis> TailBasis(const Session& s, int layer) {
  if (s.open && s.open->layers[layer].basis) return s.open->layers[layer].basis;
  std::shared_ptr<const Basis> b;
  for (const auto& seg : s.chain) {
    if (seg->layers[layer].basis) b = seg->layers[layer].basis;
  }
  return b;
}

// Whether a segment's remainder can leave the tail as chunks: it has the coordinates of
// its remainder rows in every layer. A segment restored from a record written before
// short segments kept them has none: its remainder stays exact. (A session has one basis
// per layer, which every segment's A rows use: BuildView reads them all with one B. A
// restored session's segments hold equal copies of it.)
bool RemainderMovable(const Session& s, const Segment& seg) {
  const int C = seg.chunk_size;
  const LayerData& d0 = seg.data(0);
  for (int l = 0; l < s.model.layers; ++l) {
    const LayerData& d = seg.data(l);
    const LayerData& own = seg.layers[l];
    if (d.n_chunks != d0.n_chunks || d.n_tail != d0.n_tail || !d.tk || !d.tv) return false;
    const std::shared_ptr<const Basis> basis = TailBasis(s, l);
    if (!own.a || !own.basis || !basis || own.basis->r != basis->r) return false;
    const size_t need = Bf16Bytes((size_t(d.n_chunks) * C + d.n_tail) * own.basis->r);
    if (own.a->bytes() < need) return false;
  }
  return true;
}

absl::StatusOr<TailPlan> PlanTail(const Session& s) {
  const int C = s.profile.chunk_size;
  const size_t tok = size_t(s.model.shape.h) * s.model.shape.d;
  // Where the session's chunks end: chunks never cover a token after a tail token.
  int64_t frontier = 0;
  auto chunk_end = [&](const Segment& seg) {
    const int n_chunks = seg.data(0).n_chunks;
    if (n_chunks > 0) frontier = std::max(frontier, seg.first_position + int64_t(n_chunks) * C);
  };
  for (const auto& seg : s.chain) chunk_end(*seg);
  if (s.open) chunk_end(*s.open);
  TailPlan plan;
  plan.first = frontier;
  for (const auto& seg : s.chain) {
    const LayerData& d = seg->data(0);
    const int64_t start = seg->first_position + int64_t(d.n_chunks) * C;
    const int64_t end = start + d.n_tail;
    // A remainder before the frontier is covered, or (a cached prefix's, followed by the
    // chunks of a suffix) exact for good.
    if (d.n_tail == 0 || end <= frontier) continue;
    const int from = static_cast<int>(std::max<int64_t>(0, frontier - start));
    if (!RemainderMovable(s, *seg)) {  // the tail starts after it
      plan.pieces.clear();
      plan.chain_rows = 0;
      plan.first = end;
      continue;
    }
    if (start + from != plan.first + plan.chain_rows) {
      return absl::InternalError(absl::StrCat(
          "session '", s.id, "': the exact tail is not contiguous (a remainder at ",
          start + from, ", expected ", plan.first + plan.chain_rows, ")"));
    }
    plan.pieces.push_back({seg.get(), from, static_cast<int>(d.n_tail - from)});
    plan.chain_rows += static_cast<int>(d.n_tail - from);
  }
  plan.appended_rows = s.tail.empty() ? 0 : static_cast<int>(s.tail[0].k.size() / tok);
  if (plan.first + plan.chain_rows + plan.appended_rows != static_cast<int64_t>(s.tokens)) {
    return absl::InternalError(absl::StrCat(
        "session '", s.id, "': the exact tail (", plan.chain_rows, " remainder and ",
        plan.appended_rows, " appended tokens from position ", plan.first,
        ") does not end at the session's ", s.tokens, " tokens"));
  }
  return plan;
}

// The tokens an open segment adds at the end of the chain (its chunks may start inside
// the chain's last remainder).
int64_t OpenTokens(const Session& s) {
  int64_t chain_end = 0;
  for (const auto& seg : s.chain) chain_end += seg->n_tokens;
  const int64_t end = s.open->first_position +
                      int64_t(s.open->layers[0].n_chunks) * s.profile.chunk_size;
  return std::max<int64_t>(0, end - chain_end);
}

// The host form of `m` chunks leaving one layer's tail.
struct MovedChunks {
  std::vector<bf16> a;             // [m*C, r] coordinates
  std::vector<bf16> landmarks;     // [m, h, d]
  std::vector<std::byte> sig;      // [m*C, h, SignatureRecordBytes(bits, d)] (bits > 0)
  std::vector<std::byte> values;   // [h, m, chunk_bytes]
  size_t chunk_bytes = 0;
  double residual = -1;            // projection residual of the appended rows (-1: none)
};

// Computes the first `m` chunks of `plan` for one layer; changes nothing.
absl::StatusOr<MovedChunks> PrepareChunks(EngineImpl& e, const Session& s, int layer,
                                          const TailPlan& plan, int m) {
  const kernels::LayerShape& shape = s.model.shape;
  const int h = shape.h, d = shape.d, C = s.profile.chunk_size, D = shape.D();
  const int rows = m * C;
  const std::shared_ptr<const Basis> basis = TailBasis(s, layer);
  if (!basis) return absl::FailedPreconditionError("shadow session without a basis");
  const int r = basis->r;
  MovedChunks out;
  out.a.resize(size_t(rows) * r);
  std::vector<bf16> k(size_t(rows) * D), v(size_t(rows) * D);
  // The chain's remainder rows: post-RoPE K, V and the coordinates kept at ingest.
  int at = 0;
  for (const TailPiece& piece : plan.pieces) {
    if (at == rows) break;
    const int take = std::min(piece.rows, rows - at);
    const LayerData& ld = piece.seg->data(layer);
    const LayerData& own = piece.seg->layers[layer];
    const size_t row0 = size_t(ld.n_chunks) * C + piece.from;
    const size_t src = size_t(piece.from) * D, dst = size_t(at) * D, n = size_t(take) * D;
    KVSHADE_RETURN_IF_ERROR(e.Download(k.data() + dst, Ptr<const bf16>(ld.tk) + src, Bf16Bytes(n)));
    KVSHADE_RETURN_IF_ERROR(e.Download(v.data() + dst, Ptr<const bf16>(ld.tv) + src, Bf16Bytes(n)));
    KVSHADE_RETURN_IF_ERROR(e.Download(out.a.data() + size_t(at) * r, Ptr<const bf16>(*own.a) + row0 * r,
                                       Bf16Bytes(size_t(take) * r)));
    at += take;
  }
  // Appended rows: a = k_pre W (ProjectKeys), the residual tracked as drift.
  const int appended = rows - at;
  if (appended > 0) {
    const TailLayer& tl = s.tail[layer];
    const size_t n = size_t(appended) * D;
    std::copy_n(tl.k.begin(), n, k.begin() + size_t(at) * D);
    std::copy_n(tl.v.begin(), n, v.begin() + size_t(at) * D);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kd, e.Upload(tl.k_pre.data(), Bf16Bytes(n), ArenaKind::kOther));
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ad, e.Alloc(Bf16Bytes(size_t(appended) * r), ArenaKind::kOther));
    const size_t wsb = e.backend().ProjectWorkspaceBytes(appended, shape, r);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
    KVSHADE_ASSIGN_OR_RETURN(
        kernels::ProjectionResult pr,
        e.backend().ProjectKeys(absl::Span<const bf16>(Ptr<const bf16>(kd), n), appended, shape,
                                absl::Span<const bf16>(Ptr<const bf16>(basis->b), size_t(h) * r * d), r,
                                absl::Span<bf16>(Ptr<bf16>(ad), size_t(appended) * r),
                                kernels::Workspace{ws.data(), wsb}));
    KVSHADE_RETURN_IF_ERROR(
        e.Download(out.a.data() + size_t(at) * r, ad.data(), Bf16Bytes(size_t(appended) * r)));
    out.residual = pr.residual_energy;
  }
  // Landmarks from the post-RoPE keys.
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock krd, e.Upload(k.data(), Bf16Bytes(k.size()), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock lmd, e.Alloc(Bf16Bytes(size_t(m) * D), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock mcd, e.Alloc(size_t(h) * m * 4, ArenaKind::kOther));
  KVSHADE_RETURN_IF_ERROR(e.backend().BuildLandmarks(
      absl::Span<const bf16>(Ptr<const bf16>(krd), k.size()), rows, h, d, C, m,
      absl::Span<bf16>(Ptr<bf16>(lmd), size_t(m) * D), absl::Span<float>(Ptr<float>(mcd), size_t(h) * m)));
  // Values: [h, m, chunk_bytes].
  KVSHADE_ASSIGN_OR_RETURN(out.chunk_bytes, kernels::ValueChunkBytes(s.profile.codec, C, d));
  const size_t cb = out.chunk_bytes;
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock vd, e.Upload(v.data(), Bf16Bytes(v.size()), ArenaKind::kOther));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ed, e.Alloc(size_t(h) * m * cb, ArenaKind::kOther));
  KVSHADE_RETURN_IF_ERROR(e.backend().EncodeValueChunks(
      absl::Span<const bf16>(Ptr<const bf16>(vd), v.size()), rows, h, d, C, m, s.profile.codec,
      absl::Span<std::byte>(Ptr<std::byte>(ed), size_t(h) * m * cb)));
  // Key signatures from the exact post-RoPE keys and the new landmarks.
  if (s.profile.key_signature_bits > 0) {
    const int bits = s.profile.key_signature_bits;
    const size_t sig_bytes = size_t(rows) * h * kernels::SignatureRecordBytes(bits, d);
    KVSHADE_ASSIGN_OR_RETURN(DeviceBlock sgd, e.Alloc(sig_bytes, ArenaKind::kOther));
    KVSHADE_RETURN_IF_ERROR(e.backend().EncodeSignatures(
        absl::Span<const bf16>(Ptr<const bf16>(krd), k.size()),
        absl::Span<const bf16>(Ptr<const bf16>(lmd), size_t(m) * D), h, d, C, m, bits,
        absl::Span<std::byte>(Ptr<std::byte>(sgd), sig_bytes)));
    out.sig.resize(sig_bytes);
    KVSHADE_RETURN_IF_ERROR(e.Download(out.sig.data(), sgd.data(), sig_bytes));
  }
  out.landmarks.resize(size_t(m) * D);
  out.values.resize(size_t(h) * m * cb);
  KVSHADE_RETURN_IF_ERROR(e.Download(out.landmarks.data(), lmd.data(), Bf16Bytes(out.landmarks.size())));
  KVSHADE_RETURN_IF_ERROR(e.Download(out.values.data(), ed.data(), out.values.size()));
  return out;
}

// Room for `m` more chunks in one layer of the open segment (capacity only: the layer's
// visible state does not change).
absl::Status ReserveChunks(EngineImpl& e, const Session& s, LayerData& ld, size_t chunk_bytes,
                           int m) {
  const int h = s.model.shape.h, C = s.profile.chunk_size, D = s.model.shape.D();
  const int n0 = ld.n_chunks;
  if (n0 + m <= ld.cap_chunks) return absl::OkStatus();
  const int r = ld.basis->r;
  const int64_t stride = int64_t((chunk_bytes + storage::kValueChunkAlign - 1) /
                                 storage::kValueChunkAlign * storage::kValueChunkAlign);
  const int cap = std::max({ld.cap_chunks * 2, n0 + m, 16});
  const DeviceBlock none;
  auto a = std::make_shared<DeviceBlock>();
  KVSHADE_ASSIGN_OR_RETURN(*a, Grown(e, ld.a ? *ld.a : none, Bf16Bytes(size_t(n0) * C * r),
                                     Bf16Bytes(size_t(cap) * C * r), ArenaKind::kA));
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock landmarks,
                           Grown(e, ld.landmarks, Bf16Bytes(size_t(n0) * D),
                                 Bf16Bytes(size_t(cap) * D), ArenaKind::kLandmarks));
  // Signatures grow with the landmarks (rows of C tokens per chunk); a layer keeps them
  // only from its first chunk on (an open segment is created empty).
  const int bits = s.profile.key_signature_bits;
  DeviceBlock sig;
  if (bits > 0 && (n0 == 0 || ld.sig_bits == bits)) {
    const size_t rec = size_t(h) * kernels::SignatureRecordBytes(bits, s.model.shape.d) * C;
    KVSHADE_ASSIGN_OR_RETURN(sig, Grown(e, ld.sig, size_t(n0) * rec, size_t(cap) * rec,
                                        ArenaKind::kSignatures));
  }
  KVSHADE_ASSIGN_OR_RETURN(kernels::Buffer vb, e.backend().AllocateHostVisible(size_t(h) * cap * stride));
  std::memset(vb.data(), 0, vb.bytes());
  for (int hh = 0; hh < h && n0 > 0; ++hh) {
    std::memcpy(static_cast<std::byte*>(vb.data()) + size_t(hh) * cap * stride,
                static_cast<const std::byte*>(ld.open_values.buffer.data()) +
                    size_t(hh) * ld.open_values.head_stride(),
                size_t(n0) * stride);
  }
  ld.a = std::move(a);
  ld.landmarks = std::move(landmarks);
  ld.sig_bits = sig ? bits : 0;
  ld.sig = std::move(sig);
  ld.open_values.buffer = std::move(vb);
  ld.open_values.cap_chunks = cap;
  ld.open_values.chunk_stride = stride;
  ld.cap_chunks = cap;
  return absl::OkStatus();
}

// Writes prepared chunks after a layer's last chunk (not yet counted in n_chunks).
absl::Status WriteChunks(EngineImpl& e, const Session& s, LayerData& ld, const MovedChunks& mc,
                         int m) {
  const int h = s.model.shape.h, C = s.profile.chunk_size, D = s.model.shape.D();
  const int n0 = ld.n_chunks, r = ld.basis->r;
  KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(Ptr<bf16>(*ld.a) + size_t(n0) * C * r,
                                                   mc.a.data(), Bf16Bytes(mc.a.size())));
  KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(Ptr<bf16>(ld.landmarks) + size_t(n0) * D,
                                                   mc.landmarks.data(), Bf16Bytes(mc.landmarks.size())));
  if (ld.sig && !mc.sig.empty()) {
    const size_t row = size_t(h) * kernels::SignatureRecordBytes(ld.sig_bits, s.model.shape.d);
    KVSHADE_RETURN_IF_ERROR(e.backend().CopyFromHost(Ptr<std::byte>(ld.sig) + size_t(n0) * C * row,
                                                     mc.sig.data(), mc.sig.size()));
  }
  const int64_t stride = ld.open_values.chunk_stride;
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < m; ++j) {
      std::memcpy(static_cast<std::byte*>(ld.open_values.buffer.data()) +
                      size_t(hh) * ld.open_values.head_stride() + size_t(n0 + j) * stride,
                  mc.values.data() + (size_t(hh) * m + j) * mc.chunk_bytes, mc.chunk_bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace

// Moves the oldest whole chunks out of a shadow session's exact tail while it holds more
// than local_window + C tokens (docs/ALGORITHM.md: it never holds more). All layers or none:
// on an error the session is as it was (an open segment may have been created, empty).
// The caller holds s.mu exclusively; Session::tokens counts the tail's tokens.
absl::Status TrimShadowTail(EngineImpl& e, Session& s) {
  const ProfileInfo& p = s.profile;
  const int C = p.chunk_size, L = s.model.layers;
  KVSHADE_ASSIGN_OR_RETURN(const TailPlan plan, PlanTail(s));
  const int held = plan.chain_rows + plan.appended_rows;
  if (held <= p.local_window + C) return absl::OkStatus();
  const int m = (held - p.local_window) / C;
  StageTimer timer(e.metrics(), "append");
  if (!s.open) {
    s.open = NewOpen(e, s, plan.first);
  } else if (s.open->first_position + int64_t(s.open->layers[0].n_chunks) * C != plan.first) {
    return absl::InternalError(absl::StrCat(
        "session '", s.id, "': the open segment does not end where the exact tail starts"));
  }
  std::vector<MovedChunks> moved(L);
  for (int l = 0; l < L; ++l) {
    KVSHADE_ASSIGN_OR_RETURN(moved[l], PrepareChunks(e, s, l, plan, m));
  }
  for (int l = 0; l < L; ++l) {
    LayerData& ld = s.open->layers[l];
    if (!ld.basis) ld.basis = TailBasis(s, l);
    KVSHADE_RETURN_IF_ERROR(ReserveChunks(e, s, ld, moved[l].chunk_bytes, m));
  }
  for (int l = 0; l < L; ++l) {
    KVSHADE_RETURN_IF_ERROR(WriteChunks(e, s, s.open->layers[l], moved[l], m));
  }
  // The chunks become selectable and their tokens leave the tail (a remainder's by being
  // covered, an appended token's by leaving Session::tail).
  const size_t gone = size_t(m * C - std::min(m * C, plan.chain_rows)) * s.model.shape.D();
  for (int l = 0; l < L; ++l) {
    s.open->layers[l].n_chunks += m;
    TailLayer& tl = s.tail[l];
    tl.k_pre.erase(tl.k_pre.begin(), tl.k_pre.begin() + gone);
    tl.k.erase(tl.k.begin(), tl.k.begin() + gone);
    tl.v.erase(tl.v.begin(), tl.v.begin() + gone);
    if (moved[l].residual >= 0) {
      e.metrics()->ProjectionResidual(moved[l].residual);
      s.drift[l] = std::max(s.drift[l], moved[l].residual);
    }
  }
  s.open->n_tokens = OpenTokens(s);
  return absl::OkStatus();
}

}  // namespace kvshade::service

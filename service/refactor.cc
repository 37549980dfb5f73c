// Refactorization (docs/ALGORITHM.md "Later tokens and turns"): when a suffix's projection residual
// exceeds refactor_threshold, a background job refits the layer's basis on the whole
// session's keys (the prefix's A B reconstruction and the suffix's exact keys), recomputes
// A for every segment, and swaps new segment objects (sharing everything but A and B with
// the old ones) into the session. Chunk ids do not change, so slot tables stay valid.
#include <algorithm>
#include <cstring>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

using kernels::bf16;
using storage::ArenaKind;

bool EngineImpl::Refactor(const std::shared_ptr<Session>& sp) {
  Session& s = *sp;
  std::vector<std::vector<bf16>> keys;
  std::vector<std::shared_ptr<const Segment>> chain;
  int64_t suffix_first = 0;
  {
    std::shared_lock lock(s.mu);
    if (s.state != SessionState::kReady || !s.refactor_pending) return false;
    keys = s.refactor_keys;
    chain = s.chain;
    suffix_first = s.refactor_first_position;
  }
  const ModelInfo& m = s.model;
  const int h = m.shape.h, d = m.shape.d, D = m.shape.D(), L = m.layers;
  std::vector<std::shared_ptr<const Basis>> new_basis(L);
  std::vector<std::vector<std::shared_ptr<DeviceBlock>>> new_a(L);  // [layer][segment]
  for (int l = 0; l < L; ++l) {
    if (keys[l].empty()) continue;
    StageTimer timer(metrics_, "ingest_factorize");
    // K_all: every segment's rows that have coordinates (A B, pre-RoPE) and the suffix's
    // exact keys, in chain order.
    std::vector<bf16> k_all;
    std::vector<int64_t> rows_of(chain.size(), 0);
    bool ok = true, suffix_seen = false;
    for (size_t i = 0; i < chain.size() && ok; ++i) {
      const Segment& seg = *chain[i];
      const LayerData& own = seg.layers[l];
      // The ingested suffix (an open segment sealed after it may start at its position).
      if (seg.first_position == suffix_first && !seg.tokens.empty() && !suffix_seen) {
        suffix_seen = true;
        k_all.insert(k_all.end(), keys[l].begin(), keys[l].end());
        rows_of[i] = int64_t(keys[l].size() / D);
        continue;
      }
      if (!own.a || !own.basis) continue;
      const int r = own.basis->r;
      // a may have spare capacity rows (a sealed open segment): only the segment's tokens,
      // i.e. its chunks' (a sealed open segment may add fewer tokens to the chain's end
      // than its chunks hold: its first chunks can be the remainder before it).
      const int64_t held =
          std::max<int64_t>(seg.n_tokens, int64_t(seg.data(l).n_chunks) * seg.chunk_size);
      const int64_t rows = std::min<int64_t>(int64_t(own.a->bytes() / Bf16Bytes(r)), held);
      std::vector<bf16> a(size_t(rows) * r), b(size_t(h) * r * d);
      ok = Download(a.data(), own.a->data(), Bf16Bytes(a.size())).ok() &&
           Download(b.data(), own.basis->b.data(), Bf16Bytes(b.size())).ok();
      std::vector<float> bf(b.size());
      for (size_t x = 0; x < b.size(); ++x) bf[x] = kernels::Bf16ToFloat(b[x]);
      const size_t at = k_all.size();
      k_all.resize(at + size_t(rows) * D);
      std::vector<float> acc(d);
      for (int64_t t = 0; t < rows; ++t) {
        for (int hh = 0; hh < h; ++hh) {
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int rr = 0; rr < r; ++rr) {
            const float av = kernels::Bf16ToFloat(a[size_t(t) * r + rr]);
            const float* brow = bf.data() + (size_t(hh) * r + rr) * d;
            for (int c = 0; c < d; ++c) acc[c] += av * brow[c];
          }
          for (int c = 0; c < d; ++c) k_all[at + (size_t(t) * h + hh) * d + c] = kernels::FloatToBf16(acc[c]);
        }
      }
      rows_of[i] = rows;
    }
    const int n = static_cast<int>(k_all.size() / D);
    if (!ok || n < 8) continue;
    kernels::FactorizeOptions fo;
    fo.rank = std::min({s.profile.rank, D, n / 8 * 8});
    fo.subspace_iterations = static_cast<int>(config_->profile.factorize_iterations);
    fo.host_subspace_min_tokens = static_cast<int>(config_->profile.factorize_host_min_tokens);
    auto kd = Upload(k_all.data(), Bf16Bytes(k_all.size()), ArenaKind::kOther);
    auto ad = Alloc(Bf16Bytes(size_t(n) * fo.rank), ArenaKind::kOther);
    auto bd = Alloc(Bf16Bytes(size_t(h) * fo.rank * d), ArenaKind::kB);
    const size_t wsb = backend_->FactorizeWorkspaceBytes(n, m.shape, fo);
    auto ws = Alloc(wsb, ArenaKind::kOther);
    if (!kd.ok() || !ad.ok() || !bd.ok() || !ws.ok()) continue;
    std::vector<float> eig(D);
    auto fr = backend_->Factorize(
        absl::Span<const bf16>(Ptr<const bf16>(*kd), k_all.size()), n, m.shape, fo,
        absl::Span<bf16>(Ptr<bf16>(*ad), size_t(n) * fo.rank),
        absl::Span<bf16>(Ptr<bf16>(*bd), size_t(h) * fo.rank * d), absl::MakeSpan(eig),
        kernels::Workspace{ws->data(), wsb});
    if (!fr.ok() || !backend_->Synchronize().ok()) continue;
    const int r = fr->rank;
    metrics_->ReconstructionEnergy(fr->captured_energy);
    if (fr->subspace_fallback) metrics_->FactorizeFallback();
    std::vector<bf16> a_all(size_t(n) * r);
    if (!Download(a_all.data(), ad->data(), Bf16Bytes(a_all.size())).ok()) continue;
    auto basis = std::make_shared<Basis>();
    basis->r = r;
    basis->b = std::move(bd).value();
    new_basis[l] = basis;
    new_a[l].resize(chain.size());
    int64_t row = 0;
    for (size_t i = 0; i < chain.size() && ok; ++i) {
      const LayerData& own = chain[i]->layers[l];
      const int64_t rows = rows_of[i];
      if (own.a && rows > 0) {
        auto blk = Upload(a_all.data() + size_t(row) * r, Bf16Bytes(size_t(rows) * r), ArenaKind::kA);
        if (!blk.ok()) {
          ok = false;
          break;
        }
        new_a[l][i] = std::make_shared<DeviceBlock>(std::move(blk).value());
      }
      row += rows;
    }
    if (!ok) {
      new_basis[l].reset();
      new_a[l].clear();
    }
  }
  // Swap in new segment objects; the open segment's rows are re-projected.
  std::unique_lock lock(s.mu);
  if (s.state != SessionState::kReady || s.chain != chain) return false;  // changed meanwhile
  bool any = false;
  std::vector<std::shared_ptr<const Segment>> next;
  for (size_t i = 0; i < chain.size(); ++i) {
    auto seg = std::make_shared<Segment>();
    const Segment& old = *chain[i];
    seg->id = *storage::Id128::FromHex(SessionManager::NewId());
    seg->kind = old.kind;
    seg->first_position = old.first_position;
    seg->n_tokens = old.n_tokens;
    seg->chunk_size = old.chunk_size;
    seg->tokens = old.tokens;
    seg->base = chain[i];
    seg->store = store_link_;
    seg->layers.resize(L);
    for (int l = 0; l < L; ++l) {
      seg->layers[l].a = old.layers[l].a;
      seg->layers[l].basis = old.layers[l].basis;
      if (new_basis[l]) {
        any = true;
        seg->layers[l].basis = new_basis[l];
        if (!new_a[l].empty() && new_a[l][i]) seg->layers[l].a = new_a[l][i];
      }
    }
    next.push_back(std::move(seg));
  }
  if (!any) {
    s.refactor_pending = false;
    s.refactor_keys.clear();
    return false;
  }
  // The open segment's rows move to the new bases too; any failure leaves everything as
  // it was (a basis shared by part of a layer's chain would be wrong).
  std::vector<std::shared_ptr<DeviceBlock>> open_a(L);
  if (s.open) {
    for (int l = 0; l < L; ++l) {
      LayerData& ld = s.open->layers[l];
      if (!new_basis[l] || !ld.basis || ld.n_chunks == 0) continue;
      const int ro = ld.basis->r, rn = new_basis[l]->r;
      const int rows = ld.n_chunks * s.profile.chunk_size;
      std::vector<bf16> a(size_t(rows) * ro), b(size_t(h) * ro * d), k(size_t(rows) * D);
      if (!Download(a.data(), ld.a->data(), Bf16Bytes(a.size())).ok() ||
          !Download(b.data(), ld.basis->b.data(), Bf16Bytes(b.size())).ok()) {
        return false;
      }
      for (int t = 0; t < rows; ++t) {
        for (int hh = 0; hh < h; ++hh) {
          for (int c = 0; c < d; ++c) {
            float acc = 0;
            for (int rr = 0; rr < ro; ++rr) {
              acc += kernels::Bf16ToFloat(a[size_t(t) * ro + rr]) *
                     kernels::Bf16ToFloat(b[(size_t(hh) * ro + rr) * d + c]);
            }
            k[(size_t(t) * h + hh) * d + c] = kernels::FloatToBf16(acc);
          }
        }
      }
      auto kd = Upload(k.data(), Bf16Bytes(k.size()), ArenaKind::kOther);
      auto na = Alloc(Bf16Bytes(size_t(ld.cap_chunks) * s.profile.chunk_size * rn), ArenaKind::kA);
      const size_t wsb = backend_->ProjectWorkspaceBytes(rows, m.shape, rn);
      auto ws = Alloc(wsb, ArenaKind::kOther);
      if (!kd.ok() || !na.ok() || !ws.ok()) return false;
      auto pr = backend_->ProjectKeys(
          absl::Span<const bf16>(Ptr<const bf16>(*kd), k.size()), rows, m.shape,
          absl::Span<const bf16>(Ptr<const bf16>(new_basis[l]->b), size_t(h) * rn * d), rn,
          absl::Span<bf16>(Ptr<bf16>(*na), size_t(rows) * rn), kernels::Workspace{ws->data(), wsb});
      if (!pr.ok() || !backend_->Synchronize().ok()) return false;
      open_a[l] = std::make_shared<DeviceBlock>(std::move(na).value());
    }
    for (int l = 0; l < L; ++l) {
      if (!new_basis[l]) continue;
      if (open_a[l]) s.open->layers[l].a = open_a[l];
      s.open->layers[l].basis = new_basis[l];
    }
  }
  s.chain = std::move(next);
  s.refactor_pending = false;
  s.refactor_keys.clear();
  std::fill(s.drift.begin(), s.drift.end(), 0.0);
  ++s.static_version;
  if (s.durable) PersistSession(s).IgnoreError();
  return true;
}

}  // namespace kvshade::service

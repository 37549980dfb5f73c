// The mini profile (docs/ALGORITHM.md "Mini"): a recent window and heavy hitters by
// observation mass (token-granular, per head, pyramid budgets over layers), stored INT2
// (KIVI) in whole groups of G tokens; the newest retained tokens that do not fill a group
// stay exact. Without observation queries the heavy budget goes to the recent window.
// Its budgets are fractions of the prompt length, so its segments are not reusable by
// other sessions (no prefix lookup, no registration, no segment ends).
// Append: new tokens join a bf16 residual; every R = 128 tokens (rounded down to whole
// KIVI groups) the oldest are quantized INT2 and move to the open segment.
#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/pyramid.h"
#include "profile.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::ArenaKind;

constexpr int kMiniResidual = 128;  // MiniKV's R
constexpr int kMiniDefaultGroup = 16;  // the KIVI group a mini request gets when it names none

class MiniIngest final : public ProfileIngest {
 public:
  explicit MiniIngest(IngestContext& context) : cx(context), e(context.engine()) {
    const Session& s = cx.session();
    const int L = s.model.layers;
    auto b = kernels::PyramidBudgets(L, s.profile.mini_heavy_ratio);
    mini_heavy_ = b.ok() ? *b : std::vector<double>(L, s.profile.mini_heavy_ratio);
  }

  absl::Status CompressLayer(int l, size_t /*first_range: 0, one range*/) override {
    IngestLayer& b = cx.layer(l);
    const ModelInfo& m = cx.session().model;
    const ProfileInfo& p = cx.session().profile;
    const int h = m.shape.h, d = m.shape.d, G = p.kivi_group, n = cx.n();
    IngestRange& rg = cx.range(0);  // CreateSession sets no segment ends for mini
    KVSHADE_RETURN_IF_ERROR(cx.EnsureStoreSegment(rg, 0));
    KVSHADE_RETURN_IF_ERROR(cx.RopeInPlace(b.kd, cx.first(), cx.n()));
    const absl::Span<const bf16> kr = cx.Keys(b);
    // Token selection and the gathers run on the host here (one download of K and V).
    std::vector<bf16> krh(kr.size()), vh(kr.size());
    KVSHADE_RETURN_IF_ERROR(e.Download(krh.data(), b.kd.data(), b.kd.bytes()));
    KVSHADE_RETURN_IF_ERROR(e.Download(vh.data(), b.vd.data(), b.vd.bytes()));

    int window = std::clamp(static_cast<int>(std::ceil(p.mini_recent_ratio * n)), 1, n);
    int heavy = std::min(static_cast<int>(std::floor(mini_heavy_[l] * n)), n - window);
    std::vector<float> mass;
    if (b.w > 0 && heavy > 0) {
      DeviceBlock qd;
      KVSHADE_ASSIGN_OR_RETURN(qd, e.Upload(b.qobs.data(), Bf16Bytes(b.qobs.size()), ArenaKind::kOther));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock qposd, e.DevicePositions(cx.first() + n - b.w, b.w));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock kposd, e.DevicePositions(cx.first(), n));
      const absl::Span<const int64_t> qpos(static_cast<const int64_t*>(qposd.data()), size_t(b.w));
      const absl::Span<const int64_t> kpos(static_cast<const int64_t*>(kposd.data()), size_t(n));
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock md, e.Alloc(size_t(h) * n * 4, ArenaKind::kOther));
      const size_t wsb = e.backend().ObservationWorkspaceBytes(b.w, n, m.shape);
      KVSHADE_ASSIGN_OR_RETURN(DeviceBlock ws, e.Alloc(wsb, ArenaKind::kOther));
      KVSHADE_RETURN_IF_ERROR(e.backend().ObservationMass(
          absl::Span<const bf16>(static_cast<const bf16*>(qd.data()), b.qobs.size()), qpos, b.w,
          kr, kpos, n, m.shape,
          absl::Span<float>(static_cast<float*>(md.data()), size_t(h) * n),
          kernels::Workspace{ws.data(), wsb}));
      mass.resize(size_t(h) * n);
      KVSHADE_RETURN_IF_ERROR(e.Download(mass.data(), md.data(), mass.size() * 4));
    } else {
      window = std::min(n, window + heavy);  // no observation: the budget goes to recency
      heavy = 0;
    }
    const int keep = window + heavy;
    const int mq = keep / G * G;  // whole KIVI groups; the newest leftovers stay exact
    std::vector<bf16> rk(size_t(h) * keep * d), rv(rk.size());
    std::vector<int64_t> pos(size_t(h) * keep);
    std::vector<int32_t> idx(n);
    for (int hh = 0; hh < h; ++hh) {
      std::vector<int32_t> kept;
      if (heavy > 0) {
        std::vector<int32_t> cand(n - window);
        std::iota(cand.begin(), cand.end(), 0);
        const float* mh = mass.data() + size_t(hh) * n;
        std::partial_sort(cand.begin(), cand.begin() + heavy, cand.end(), [&](int32_t a, int32_t c) {
          return mh[a] > mh[c] || (mh[a] == mh[c] && a < c);
        });
        kept.assign(cand.begin(), cand.begin() + heavy);
        std::sort(kept.begin(), kept.end());
      }
      for (int t = n - window; t < n; ++t) kept.push_back(t);
      for (int i = 0; i < keep; ++i) {
        pos[size_t(hh) * keep + i] = cx.first() + kept[i];
        const size_t src = (size_t(kept[i]) * h + hh) * d;
        const size_t dst = (size_t(hh) * keep + i) * d;
        std::copy_n(krh.begin() + src, d, rk.begin() + dst);
        std::copy_n(vh.begin() + src, d, rv.begin() + dst);
      }
    }
    LayerData& out = rg.out[l];
    if (mq > 0) {
      // [h, mq, d] per head contiguous == [h*mq, d]: per-channel key groups of G rows never
      // cross heads because mq % G == 0.
      std::vector<bf16> qk(size_t(h) * mq * d), qv(qk.size());
      for (int hh = 0; hh < h; ++hh) {
        std::copy_n(rk.begin() + size_t(hh) * keep * d, size_t(mq) * d, qk.begin() + size_t(hh) * mq * d);
        std::copy_n(rv.begin() + size_t(hh) * keep * d, size_t(mq) * d, qv.begin() + size_t(hh) * mq * d);
      }
      KiviBlock kb;
      std::vector<bf16> dk, dv;
      KVSHADE_RETURN_IF_ERROR(QuantizeKivi(e, d, G, qk, qv, h * mq, &kb, &dk, &dv));
      kb.rows = kb.valid = mq;
      for (int hh = 0; hh < h; ++hh) {
        std::copy_n(dk.begin() + size_t(hh) * mq * d, size_t(mq) * d, rk.begin() + size_t(hh) * keep * d);
        std::copy_n(dv.begin() + size_t(hh) * mq * d, size_t(mq) * d, rv.begin() + size_t(hh) * keep * d);
      }
      out.int2.push_back(std::move(kb));
    }
    out.s_cap = keep;
    out.s_len.assign(h, keep);
    out.s_pos = std::move(pos);
    KVSHADE_ASSIGN_OR_RETURN(out.sk, e.Upload(rk.data(), Bf16Bytes(rk.size()), ArenaKind::kStatic));
    KVSHADE_ASSIGN_OR_RETURN(out.sv, e.Upload(rv.data(), Bf16Bytes(rv.size()), ArenaKind::kStatic));
    return absl::OkStatus();
  }

 private:
  IngestContext& cx;
  EngineImpl& e;
  std::vector<double> mini_heavy_;
};

// Quantizes the oldest `rows` residual tokens of a mini tail into the open segment.
absl::Status QuantizeResidual(EngineImpl& e, Session& s, int layer, int rows) {
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

class Mini final : public ProfileStrategy {
 public:
  v1::ProfileKind kind() const override { return v1::PROFILE_KIND_MINI; }

  absl::Status Resolve(const ProfileRequest& r, ProfileInfo& o) const override {
    KVSHADE_RETURN_IF_ERROR(ResolveValueCodec(r, kernels::ValueCodec::kBF16, o));
    KVSHADE_RETURN_IF_ERROR(ResolveKeySignatureBits(r, /*takes=*/false, o));
    const int d = r.model.shape.d;
    // Left unset, the group is at most 16: MiniKV's keys and values are all INT2, whose
    // error grows with the group, and the server's default of 32 was measured for int4
    // values only (bench/RESULTS.md "Selection fidelity").
    if (r.proto.kivi_group() == 0) o.kivi_group = std::min(o.kivi_group, kMiniDefaultGroup);
    KVSHADE_RETURN_IF_ERROR(CheckWindowRanges(o));
    KVSHADE_RETURN_IF_ERROR(RefuseSelectionUnit(r));
    if (o.kivi_group < 16 || o.kivi_group % 16 != 0 || d % o.kivi_group != 0) {
      return BadProfileField("profile.kivi_group",
                             absl::StrCat("must be a multiple of 16 dividing head_dim = ", d,
                                          ", got ", o.kivi_group));
    }
    return absl::OkStatus();
  }

  bool reusable() const override { return false; }

  absl::Status CheckSession(const ModelInfo& model, const ProfileInfo& profile, uint64_t,
                            size_t) const override {
    if (auto b = kernels::PyramidBudgets(model.layers, profile.mini_heavy_ratio); !b.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "profile.mini_heavy_ratio = ", profile.mini_heavy_ratio,
          " gives an invalid pyramid over ", model.layers, " layers: ", b.status().message()));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<ProfileIngest> StartIngest(IngestContext& cx) const override {
    return std::make_unique<MiniIngest>(cx);
  }

  absl::Status AppendLayer(EngineImpl& e, Session& s, int l, int64_t first, int n,
                           const std::vector<bf16>&, const std::vector<bf16>& kr,
                           const std::vector<bf16>& v) const override {
    const size_t tok = size_t(s.model.shape.h) * s.model.shape.d;
    const ProfileInfo& p = s.profile;
    TailLayer& tl = s.tail[l];
    tl.k.insert(tl.k.end(), kr.begin(), kr.end());
    tl.v.insert(tl.v.end(), v.begin(), v.end());
    const int t_len = static_cast<int>(tl.k.size() / tok);
    const int G = p.kivi_group;
    const int R = std::max(G, kMiniResidual / G * G);
    if (t_len >= R) {
      if (!s.open) s.open = NewOpen(e, s, first + n - t_len);
      KVSHADE_RETURN_IF_ERROR(QuantizeResidual(e, s, l, t_len / R * R));
    }
    return absl::OkStatus();
  }
};

}  // namespace

const ProfileStrategy& MiniProfile() {
  static const Mini profile;
  return profile;
}

}  // namespace kvshade::service

// The exact profile: post-RoPE K and V as given, every token attended (no selection, no
// static set). Each segment holds its tokens in its exact rows (LayerData::tk/tv); appended
// tokens go to the open segment as they are.
#include <memory>

#include "engine_impl.h"
#include "kvshade/base/status_macros.h"
#include "profile.h"

namespace kvshade::service {
namespace {

using kernels::bf16;

class ExactIngest final : public ProfileIngest {
 public:
  explicit ExactIngest(IngestContext& context) : cx(context) {}

  absl::Status CompressLayer(int l, size_t first_range) override {
    IngestLayer& b = cx.layer(l);
    if (!cx.direct()) KVSHADE_RETURN_IF_ERROR(cx.RopeInPlace(b.kd, cx.first(), cx.n()));  // direct: rotated part by part
    cx.NoteCompressionPeak(size_t(cx.n()) * sizeof(int64_t));   // the positions
    for (size_t r = first_range; r < cx.range_count(); ++r) {
      IngestRange& rg = cx.range(r);
      KVSHADE_RETURN_IF_ERROR(cx.EnsureStoreSegment(rg, 0));
      LayerData& out = rg.out[l];
      KVSHADE_RETURN_IF_ERROR(cx.TakeRows(b, rg, &out.tk, &out.tv));
      out.n_tail = out.cap_tail = rg.n;
    }
    return absl::OkStatus();
  }

 private:
  IngestContext& cx;
};

class Exact final : public ProfileStrategy {
 public:
  v1::ProfileKind kind() const override { return v1::PROFILE_KIND_EXACT; }

  absl::Status Resolve(const ProfileRequest& r, ProfileInfo& o) const override {
    KVSHADE_RETURN_IF_ERROR(ResolveValueCodec(r, kernels::ValueCodec::kBF16, o));
    KVSHADE_RETURN_IF_ERROR(ResolveKeySignatureBits(r, /*takes=*/false, o));
    KVSHADE_RETURN_IF_ERROR(CheckWindowRanges(o));
    return RefuseSelectionUnit(r);
  }

  bool all_exact() const override { return true; }
  bool rotates_parts() const override { return true; }

  std::unique_ptr<ProfileIngest> StartIngest(IngestContext& cx) const override {
    return std::make_unique<ExactIngest>(cx);
  }

  absl::Status AppendLayer(EngineImpl& e, Session& s, int l, int64_t first, int n,
                           const std::vector<bf16>&, const std::vector<bf16>& kr,
                           const std::vector<bf16>& v) const override {
    if (!s.open) s.open = NewOpen(e, s, first);
    return AppendExactTokens(e, s.open->layers[l], kr.data(), v.data(), n,
                             size_t(s.model.shape.h) * s.model.shape.d);
  }
};

}  // namespace

const ProfileStrategy& ExactProfile() {
  static const Exact profile;
  return profile;
}

}  // namespace kvshade::service

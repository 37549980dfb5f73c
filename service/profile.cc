// The profile registry and what the profiles' resolution shares (profile.h).
#include "profile.h"

#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

absl::Status ProfileStrategy::FinishAppend(EngineImpl&, Session& s, int) const {
  if (s.open) s.open->n_tokens = s.open->layers[0].n_tail;
  return absl::OkStatus();
}

// The registry: one line per profile.
const ProfileStrategy* FindProfile(v1::ProfileKind kind) {
  switch (kind) {
    case v1::PROFILE_KIND_SHADOW: return &ShadowProfile();
    case v1::PROFILE_KIND_MINI: return &MiniProfile();
    case v1::PROFILE_KIND_EXACT: return &ExactProfile();
    default: return nullptr;
  }
}

const ProfileStrategy& ProfileOf(v1::ProfileKind kind) {
  const ProfileStrategy* p = FindProfile(kind);
  if (p == nullptr) std::abort();  // a resolved profile is never AUTO or UNSPECIFIED
  return *p;
}

v1::ProfileKind AutoProfileKind(uint64_t n_tokens, const ProfileInfo& o) {
  return n_tokens < static_cast<uint64_t>(o.min_tokens) ? v1::PROFILE_KIND_MINI
                                                         : v1::PROFILE_KIND_SHADOW;
}

absl::Status BadProfileField(std::string_view field, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(std::string(field), " ", std::string(what)));
}

absl::Status ResolveValueCodec(const ProfileRequest& r, kernels::ValueCodec automatic,
                               ProfileInfo& o) {
  if (r.proto.value_codec() == v1::VALUE_CODEC_UNSPECIFIED && r.defaults.value_codec == "auto") {
    o.codec.codec = automatic;
  } else {
    KVSHADE_ASSIGN_OR_RETURN(o.codec.codec,
                             CodecFromProto(r.proto.value_codec(), r.defaults.value_codec));
  }
  o.codec.group = o.kivi_group;
  return absl::OkStatus();
}

// Key signatures: shadow only. A request naming another kind (mini, exact) may not ask for
// them; one left to AUTO gets them only when it resolves to shadow. The server's default
// applies to shadow sessions only.
absl::Status ResolveKeySignatureBits(const ProfileRequest& r, bool takes, ProfileInfo& o) {
  if (r.proto.has_key_signature_bits()) {
    const uint32_t bits = r.proto.key_signature_bits();
    if (bits != 0 && !kernels::ValidSignatureBits(static_cast<int>(bits))) {
      return BadProfileField("profile.key_signature_bits",
                             absl::StrCat("must be 0 (none), ", kernels::kSignatureBitsText, ", got ", bits));
    }
    if (bits != 0 && !r.auto_kind && !takes) {
      return BadProfileField("profile.key_signature_bits",
                             absl::StrCat("applies to the shadow profile only, got ", bits,
                                          " with profile ", v1::ProfileKind_Name(o.requested)));
    }
    o.key_signature_bits = takes ? static_cast<int>(bits) : 0;
  } else {
    o.key_signature_bits = takes ? static_cast<int>(r.defaults.key_signature_bits) : 0;
  }
  return absl::OkStatus();
}

absl::Status CheckWindowRanges(const ProfileInfo& o) {
  if (o.chunk_size < 1 || o.chunk_size > 256) {
    return BadProfileField("profile.chunk_size",
                           absl::StrCat("must be in [1, 256], got ", o.chunk_size));
  }
  if (o.sparse_budget < 1 || o.sparse_budget > 65536) {
    return BadProfileField("profile.sparse_budget",
                           absl::StrCat("must be in [1, 65536], got ", o.sparse_budget));
  }
  if (o.local_window < 1 || o.local_window > 65536) {
    return BadProfileField("profile.local_window",
                           absl::StrCat("must be in [1, 65536], got ", o.local_window));
  }
  return absl::OkStatus();
}

uint32_t RequestedSelectionUnit(const ProfileRequest& r, bool* asked) {
  *asked = r.proto.has_selection_unit();
  return *asked ? r.proto.selection_unit() : r.defaults.selection_unit;
}

// Selection units: shadow only (a request naming mini or exact may not ask for them; one
// left to AUTO gets them only when it resolves to shadow, as does the server's default).
absl::Status RefuseSelectionUnit(const ProfileRequest& r) {
  bool asked = false;
  const uint32_t u = RequestedSelectionUnit(r, &asked);
  if (asked && u != 0 && !r.auto_kind) {
    return BadProfileField("profile.selection_unit",
                           absl::StrCat("applies to the shadow profile only, got ", u,
                                        " with profile ",
                                        v1::ProfileKind_Name(r.proto.kind())));
  }
  return absl::OkStatus();
}

}  // namespace kvshade::service

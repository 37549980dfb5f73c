// Id128 text form, SegmentValueLayout validation, factor kind names.
#include "kvshade/storage/types.h"

#include "absl/strings/str_cat.h"

namespace kvshade::storage {

std::string Id128::ToHex() const {
  static const char* kHex = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[15 - i] = kHex[(hi >> (4 * i)) & 15];
    s[31 - i] = kHex[(lo >> (4 * i)) & 15];
  }
  return s;
}

absl::StatusOr<Id128> Id128::FromHex(std::string_view hex) {
  if (hex.size() != 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("Id128: expected 32 hex digits, got ", hex.size(), " characters"));
  }
  Id128 id;
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    uint64_t v;
    if (c >= '0' && c <= '9') v = c - '0';
    else if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') v = c - 'A' + 10;
    else return absl::InvalidArgumentError(absl::StrCat("Id128: bad hex digit at ", i));
    uint64_t& word = i < 16 ? id.hi : id.lo;
    word = (word << 4) | v;
  }
  return id;
}

absl::StatusOr<SegmentValueLayout> SegmentValueLayout::Make(int n_layers, int h, int n_chunks,
                                                            int C, int d,
                                                            const kernels::ValueCodecSpec& codec) {
  auto range = [](std::string_view name, int v, int lo, int hi) -> absl::Status {
    if (v < lo || v > hi) {
      return absl::InvalidArgumentError(absl::StrCat("value layout: ", std::string(name),
                                                     " must be in [", lo, ", ", hi, "], got ", v));
    }
    return absl::OkStatus();
  };
  if (auto s = range("n_layers", n_layers, 1, 4096); !s.ok()) return s;
  if (auto s = range("h", h, 1, 1024); !s.ok()) return s;
  if (auto s = range("n_chunks", n_chunks, 0, 1 << 24); !s.ok()) return s;
  if (auto s = range("C", C, 1, 4096); !s.ok()) return s;
  if (auto s = range("d", d, 1, 4096); !s.ok()) return s;
  absl::StatusOr<size_t> chunk = kernels::ValueChunkBytes(codec, C, d);
  if (!chunk.ok()) return chunk.status();
  SegmentValueLayout l;
  l.n_layers = n_layers;
  l.h = h;
  l.n_chunks = n_chunks;
  l.C = C;
  l.d = d;
  l.codec = codec;
  l.chunk_bytes = *chunk;
  l.chunk_stride = (*chunk + kValueChunkAlign - 1) / kValueChunkAlign * kValueChunkAlign;
  if (l.layer_bytes() >= (size_t{1} << 40)) {
    return absl::InvalidArgumentError(
        absl::StrCat("value layout: one layer would take ", l.layer_bytes(), " bytes (limit 1 TiB)"));
  }
  return l;
}

std::string_view FactorKindName(FactorKind k) {
  switch (k) {
    case FactorKind::kA: return "a";
    case FactorKind::kB: return "b";
    case FactorKind::kLandmarks: return "landmarks";
    case FactorKind::kStatic: return "static";
    case FactorKind::kExcluded: return "excluded";
    case FactorKind::kSignatures: return "signatures";
    case FactorKind::kOther: return "other";
  }
  return "unknown";
}

bool IsValidFactorKind(uint8_t k) { return (k >= 1 && k <= 6) || k == 15; }

}  // namespace kvshade::storage

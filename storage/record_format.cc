// Encoding and strict decoding of the spill tier's records (see record_format.h).
#include "record_format.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "xxhash.h"

namespace kvshade::storage::internal {
namespace {

void PutBE32(std::string* s, uint32_t v) {
  for (int i = 3; i >= 0; --i) s->push_back(char((v >> (8 * i)) & 0xff));
}
void PutBE64(std::string* s, uint64_t v) {
  for (int i = 7; i >= 0; --i) s->push_back(char((v >> (8 * i)) & 0xff));
}
uint64_t GetBE64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | uint8_t(p[i]);
  return v;
}
uint32_t GetBE32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | uint8_t(p[i]);
  return v;
}

template <typename T>
void PutLE(std::string* s, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) s->push_back(char((uint64_t(v) >> (8 * i)) & 0xff));
}
template <typename T>
T GetLE(const char* p) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) v |= uint64_t(uint8_t(p[i])) << (8 * i);
  return T(v);
}

// Sequential little-endian reader over untrusted bytes.
class Reader {
 public:
  explicit Reader(std::string_view s) : s_(s) {}
  template <typename T>
  bool Get(T* v) {
    if (s_.size() - pos_ < sizeof(T)) return false;
    *v = GetLE<T>(s_.data() + pos_);
    pos_ += sizeof(T);
    return true;
  }
  bool GetBytes(size_t n, std::string* out) {
    if (s_.size() - pos_ < n) return false;
    out->assign(s_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == s_.size(); }

 private:
  std::string_view s_;
  size_t pos_ = 0;
};

uint64_t RecordChecksum(std::string_view key, const char* header24, const void* payload,
                        size_t payload_bytes) {
  XXH3_state_t state;
  XXH3_64bits_reset_withSeed(&state, XXH3_64bits(key.data(), key.size()));
  XXH3_64bits_update(&state, header24, 24);
  if (payload_bytes > 0) XXH3_64bits_update(&state, payload, payload_bytes);
  return XXH3_64bits_digest(&state);
}

std::string KeyHex(std::string_view key) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (char c : key) {
    out.push_back(kHex[uint8_t(c) >> 4]);
    out.push_back(kHex[uint8_t(c) & 15]);
  }
  return out;
}

}  // namespace

std::string SegmentPrefix(const SegmentId& id) {
  std::string k;
  k.reserve(16);
  PutBE64(&k, id.hi);
  PutBE64(&k, id.lo);
  return k;
}

std::string MetaKey(const SegmentId& id) { return SegmentPrefix(id); }

std::string ValuePieceKey(const SegmentId& id, uint32_t layer, uint32_t piece) {
  std::string k = SegmentPrefix(id);
  PutBE32(&k, layer);
  PutBE32(&k, piece);
  return k;
}

std::string FactorPieceKey(const SegmentId& id, uint32_t layer, FactorKind kind,
                           uint32_t piece) {
  std::string k = SegmentPrefix(id);
  PutBE32(&k, layer);
  k.push_back(char(kind));
  PutBE32(&k, piece);
  return k;
}

std::string SegmentUpperBound(const SegmentId& id) {
  // Longer than any key of the segment and all 0xff after the prefix.
  return SegmentPrefix(id) + std::string(16, '\xff');
}

bool SegmentIdOfKey(std::string_view key, SegmentId* id) {
  if (key.size() < 16) return false;
  id->hi = GetBE64(key.data());
  id->lo = GetBE64(key.data() + 8);
  return true;
}

bool ParseValuePieceKey(std::string_view key, PieceKeyParts* out) {
  if (key.size() != 24 || !SegmentIdOfKey(key, &out->id)) return false;
  out->layer = GetBE32(key.data() + 16);
  out->piece = GetBE32(key.data() + 20);
  return true;
}

bool ParseFactorPieceKey(std::string_view key, PieceKeyParts* out) {
  if (key.size() != 25 || !SegmentIdOfKey(key, &out->id)) return false;
  out->layer = GetBE32(key.data() + 16);
  if (!IsValidFactorKind(uint8_t(key[20]))) return false;
  out->kind = FactorKind(uint8_t(key[20]));
  out->piece = GetBE32(key.data() + 21);
  return true;
}

std::string EncodeRecordHeader(RecordType type, std::string_view key,
                               absl::Span<const std::byte> payload) {
  std::string h;
  h.reserve(kRecordHeaderBytes);
  PutLE<uint32_t>(&h, kRecordMagic);
  PutLE<uint16_t>(&h, kFormatVersion);
  PutLE<uint8_t>(&h, uint8_t(type));
  PutLE<uint8_t>(&h, 0);
  PutLE<uint64_t>(&h, payload.size());
  PutLE<uint64_t>(&h, 0);
  PutLE<uint64_t>(&h, RecordChecksum(key, h.data(), payload.data(), payload.size()));
  return h;
}

absl::StatusOr<std::string_view> DecodeRecord(RecordType type, std::string_view key,
                                              std::string_view record) {
  auto bad = [&](std::string_view why) {
    return absl::DataLossError(absl::StrCat("spill tier: record ", KeyHex(key), ": ",
                                            std::string(why)));
  };
  if (record.size() < kRecordHeaderBytes) return bad("shorter than its header");
  const char* p = record.data();
  if (GetLE<uint32_t>(p) != kRecordMagic) return bad("bad magic");
  if (GetLE<uint16_t>(p + 4) != kFormatVersion) {
    return bad(absl::StrCat("format version ", GetLE<uint16_t>(p + 4), ", expected ",
                            kFormatVersion));
  }
  if (uint8_t(p[6]) != uint8_t(type)) {
    return bad(absl::StrCat("record type ", int(uint8_t(p[6])), ", expected ", int(type)));
  }
  const uint64_t n = GetLE<uint64_t>(p + 8);
  if (n != record.size() - kRecordHeaderBytes) {
    return bad(absl::StrCat("payload size ", n, " but ", record.size() - kRecordHeaderBytes,
                            " bytes stored"));
  }
  const uint64_t want = GetLE<uint64_t>(p + 24);
  if (RecordChecksum(key, p, p + kRecordHeaderBytes, n) != want) return bad("checksum mismatch");
  return record.substr(kRecordHeaderBytes);
}

std::string EncodeMetaPayload(const SegmentMeta& m) {
  std::string s;
  PutLE<uint32_t>(&s, kMetaPayloadVersion);
  PutLE<uint64_t>(&s, m.id.hi);
  PutLE<uint64_t>(&s, m.id.lo);
  PutLE<uint8_t>(&s, uint8_t(m.durability));
  PutLE<uint8_t>(&s, 0);
  PutLE<uint8_t>(&s, 0);
  PutLE<uint8_t>(&s, 0);
  const SegmentValueLayout& l = m.layout;
  PutLE<uint32_t>(&s, l.n_layers);
  PutLE<uint32_t>(&s, l.h);
  PutLE<uint32_t>(&s, l.n_chunks);
  PutLE<uint32_t>(&s, l.C);
  PutLE<uint32_t>(&s, l.d);
  PutLE<uint32_t>(&s, uint32_t(l.codec.codec));
  PutLE<uint32_t>(&s, l.codec.group);
  PutLE<uint64_t>(&s, l.chunk_bytes);
  PutLE<uint64_t>(&s, l.chunk_stride);
  PutLE<uint64_t>(&s, m.piece_bytes);
  PutLE<uint64_t>(&s, m.commit_unix_micros);
  PutLE<uint32_t>(&s, uint32_t(m.factors.size()));
  for (const SegmentMeta::Factor& f : m.factors) {
    PutLE<uint32_t>(&s, f.layer);
    PutLE<uint32_t>(&s, uint32_t(f.kind));
    PutLE<uint64_t>(&s, f.bytes);
  }
  PutLE<uint32_t>(&s, uint32_t(m.user_metadata.size()));
  s.append(m.user_metadata);
  return s;
}

absl::StatusOr<SegmentMeta> DecodeMetaPayload(std::string_view payload) {
  auto bad = [](std::string_view why) {
    return absl::DataLossError(absl::StrCat("spill tier: bad segment metadata: ", std::string(why)));
  };
  Reader r(payload);
  SegmentMeta m;
  uint32_t version = 0;
  if (!r.Get(&version)) return bad("truncated");
  if (version != kMetaPayloadVersion) return bad(absl::StrCat("payload version ", version));
  uint8_t durability = 0, pad = 0;
  uint32_t n_layers, h, n_chunks, C, d, codec, group, n_factors, user_len;
  uint64_t chunk_bytes, chunk_stride;
  if (!r.Get(&m.id.hi) || !r.Get(&m.id.lo) || !r.Get(&durability) || !r.Get(&pad) ||
      !r.Get(&pad) || !r.Get(&pad) || !r.Get(&n_layers) || !r.Get(&h) || !r.Get(&n_chunks) ||
      !r.Get(&C) || !r.Get(&d) || !r.Get(&codec) || !r.Get(&group) || !r.Get(&chunk_bytes) ||
      !r.Get(&chunk_stride) || !r.Get(&m.piece_bytes) || !r.Get(&m.commit_unix_micros) ||
      !r.Get(&n_factors)) {
    return bad("truncated");
  }
  if (durability > 1) return bad(absl::StrCat("durability ", int(durability)));
  m.durability = Durability(durability);
  if (codec > 3) return bad(absl::StrCat("codec ", codec));
  if (n_layers > (1u << 20) || h > (1u << 20) || n_chunks > (1u << 30) || C > (1u << 20) ||
      d > (1u << 20) || group > (1u << 20)) {
    return bad("dimension out of range");
  }
  absl::StatusOr<SegmentValueLayout> layout = SegmentValueLayout::Make(
      int(n_layers), int(h), int(n_chunks), int(C), int(d),
      kernels::ValueCodecSpec{kernels::ValueCodec(codec), int(group)});
  if (!layout.ok()) return bad(std::string(layout.status().message()));
  if (layout->chunk_bytes != chunk_bytes || layout->chunk_stride != chunk_stride) {
    return bad(absl::StrCat("chunk sizes ", chunk_bytes, "/", chunk_stride, " disagree with the codec (",
                            layout->chunk_bytes, "/", layout->chunk_stride, ")"));
  }
  m.layout = *layout;
  if (m.piece_bytes == 0) return bad("piece_bytes is 0");
  if (n_factors > payload.size() / 16) return bad("factor count exceeds the record");
  m.factors.resize(n_factors);
  for (SegmentMeta::Factor& f : m.factors) {
    uint32_t layer = 0, kind = 0;
    if (!r.Get(&layer) || !r.Get(&kind) || !r.Get(&f.bytes)) return bad("truncated factor list");
    if (layer >= n_layers) return bad(absl::StrCat("factor layer ", layer, " >= ", n_layers));
    if (kind > 255 || !IsValidFactorKind(uint8_t(kind))) return bad(absl::StrCat("factor kind ", kind));
    f.layer = int(layer);
    f.kind = FactorKind(kind);
  }
  if (!r.Get(&user_len) || !r.GetBytes(user_len, &m.user_metadata)) return bad("truncated user metadata");
  if (!r.done()) return bad("trailing bytes");
  return m;
}

}  // namespace kvshade::storage::internal

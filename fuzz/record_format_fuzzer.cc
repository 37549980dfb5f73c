// Fuzz target: the spill tier's on-disk records (storage/record_format.cc), which are read
// back from disk and so untrusted. Every decoder must accept or refuse with a status, never
// crash; what it accepts must re-encode to exactly the bytes it read (records, keys), and a
// decoded metadata payload must survive an encode/decode round trip unchanged.
//
// Input: byte 0 picks the record type and a key length (low 6 bits, capped by the input);
// then the key; the rest is the record. Every decoder sees the same bytes.
//
// KVSHADE_FUZZ_WRITE_SEED=<dir>: writes valid records (a metadata record, a value piece and
// a factor piece with their keys) into <dir> and exits (fuzz/corpus/record_format_fuzzer/).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "record_format.h"

using namespace kvshade::storage;
using namespace kvshade::storage::internal;

namespace {

void WriteFile(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) std::abort();
  std::fclose(f);
}

// byte 0 | key | record, as LLVMFuzzerTestOneInput reads it.
std::string Seed(RecordType type, const std::string& key, const std::string& payload) {
  std::string out(1, char(((uint8_t(type) - 1) << 6) | key.size()));
  out += key;
  out += EncodeRecordHeader(type, key, AsBytes(payload));
  out += payload;
  return out;
}

void WriteSeeds(const std::string& dir) {
  SegmentId id{0x0123456789abcdefull, 0xfedcba9876543210ull};
  SegmentMeta meta;
  meta.id = id;
  meta.durability = Durability::kDurable;
  meta.piece_bytes = 4096;
  meta.commit_unix_micros = 1700000000000000ull;
  meta.factors.push_back({0, FactorKind::kA, 512});
  meta.factors.push_back({1, FactorKind::kStatic, 96});
  meta.user_metadata = "KVSHSEG1 opaque";
  WriteFile(dir + "/meta", Seed(RecordType::kSegmentMeta, MetaKey(id), EncodeMetaPayload(meta)));
  WriteFile(dir + "/value_piece",
            Seed(RecordType::kValuePiece, ValuePieceKey(id, 1, 2), std::string(64, '\x5a')));
  WriteFile(dir + "/factor_piece", Seed(RecordType::kFactorPiece,
                                        FactorPieceKey(id, 0, FactorKind::kB, 0),
                                        std::string(32, '\x11')));
  WriteFile(dir + "/format", Seed(RecordType::kFormat, kFormatKey, "1"));
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("KVSHADE_FUZZ_WRITE_SEED")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto type = static_cast<RecordType>(1 + (data[0] >> 6));
  const size_t key_len = std::min<size_t>(data[0] & 0x3f, size - 1);
  const std::string_view key(reinterpret_cast<const char*>(data) + 1, key_len);
  const std::string_view record(reinterpret_cast<const char*>(data) + 1 + key_len,
                                size - 1 - key_len);

  // Records: header + checksum against the key.
  auto payload = DecodeRecord(type, key, record);
  if (payload.ok()) {
    if (payload->data() < record.data() ||
        payload->data() + payload->size() > record.data() + record.size()) {
      std::abort();  // the payload must be a view into the record
    }
    std::string again = EncodeRecordHeader(type, key, AsBytes(*payload));
    again.append(payload->data(), payload->size());
    if (again != record) std::abort();
  } else if (payload.status().code() != absl::StatusCode::kDataLoss) {
    std::abort();  // documented: any violation is DataLoss
  }

  // Metadata payloads: the same bytes as a payload.
  for (std::string_view p : {record, std::string_view(reinterpret_cast<const char*>(data), size)}) {
    auto meta = DecodeMetaPayload(p);
    if (!meta.ok()) continue;
    const std::string encoded = EncodeMetaPayload(*meta);
    auto meta2 = DecodeMetaPayload(encoded);
    if (!meta2.ok() || EncodeMetaPayload(*meta2) != encoded) std::abort();
  }

  // Keys.
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  SegmentId id;
  if (SegmentIdOfKey(all, &id)) {
    if (MetaKey(id) != all.substr(0, 16)) std::abort();
    if (SegmentPrefix(id) != all.substr(0, SegmentPrefix(id).size())) std::abort();
    if (!(SegmentUpperBound(id) > all.substr(0, 16))) std::abort();
  }
  PieceKeyParts parts;
  if (ParseValuePieceKey(all, &parts)) {
    if (ValuePieceKey(parts.id, parts.layer, parts.piece) != all) std::abort();
  }
  if (ParseFactorPieceKey(all, &parts)) {
    if (FactorPieceKey(parts.id, parts.layer, parts.kind, parts.piece) != all) std::abort();
  }
  return 0;
}

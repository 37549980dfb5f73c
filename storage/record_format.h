// The spill tier's on-disk record format (storage/README.md, "Spill tier on-disk format (version 1)"): keys of
// the column families, the 32-byte record header with its key-bound xxh3 checksum, and the
// binary metadata payload. Parsers treat their input as untrusted: every length is checked
// and a violation is DataLoss, never a crash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/storage/spill_tier.h"

namespace kvshade::storage::internal {

inline constexpr uint32_t kRecordMagic = 0x3153564Bu;  // bytes "KVS1"
inline constexpr size_t kRecordHeaderBytes = 32;
inline constexpr uint32_t kMetaPayloadVersion = 1;
inline constexpr char kFormatKey[] = "kvshade.format";

enum class RecordType : uint8_t { kFormat = 1, kSegmentMeta = 2, kFactorPiece = 3, kValuePiece = 4 };

// Keys (big-endian integers so that RocksDB's bytewise order is numeric order).
std::string MetaKey(const SegmentId& id);                                    // 16 bytes
std::string ValuePieceKey(const SegmentId& id, uint32_t layer, uint32_t piece);  // 24 bytes
std::string FactorPieceKey(const SegmentId& id, uint32_t layer, FactorKind kind,
                           uint32_t piece);                                  // 25 bytes
// Upper bound (exclusive) of every key starting with the segment's 16 id bytes.
std::string SegmentUpperBound(const SegmentId& id);
std::string SegmentPrefix(const SegmentId& id);
// Reads the 16-byte id at the start of a key; false when the key is shorter.
bool SegmentIdOfKey(std::string_view key, SegmentId* id);
struct PieceKeyParts {
  SegmentId id;
  uint32_t layer = 0;
  uint32_t piece = 0;
  FactorKind kind = FactorKind::kOther;
};
bool ParseValuePieceKey(std::string_view key, PieceKeyParts* out);
bool ParseFactorPieceKey(std::string_view key, PieceKeyParts* out);

// The 32-byte header of a record of `payload_bytes` bytes, with its checksum.
//   0 u32 magic | 4 u16 format version | 6 u8 type | 7 u8 flags (0) |
//   8 u64 payload bytes | 16 u64 reserved (0) | 24 u64 checksum
// checksum = XXH3_64bits_withSeed(header[0, 24) ++ payload, seed = XXH3_64bits(key)).
std::string EncodeRecordHeader(RecordType type, std::string_view key,
                               absl::Span<const std::byte> payload);
// Checks a stored record against its key and expected type; returns the payload (a view
// into `record`). DataLoss naming the key on any mismatch.
absl::StatusOr<std::string_view> DecodeRecord(RecordType type, std::string_view key,
                                              std::string_view record);

std::string EncodeMetaPayload(const SegmentMeta& meta);
absl::StatusOr<SegmentMeta> DecodeMetaPayload(std::string_view payload);

inline absl::Span<const std::byte> AsBytes(std::string_view s) {
  return absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(s.data()), s.size());
}

}  // namespace kvshade::storage::internal

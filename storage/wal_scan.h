// A read-only scan of the spill tier's write-ahead log files, run before RocksDB opens
// them (storage/README.md "WAL recovery"). RocksDB's point-in-time recovery replays a WAL
// up to its first damaged record and drops every record after it; the open then deletes
// the old WAL files, so what was dropped can only be known by reading them first. The
// scan parses RocksDB's log format (32 KiB blocks of CRC32C-checked physical records that
// join into WriteBatches) itself and keeps, for every file, where its first damaged
// record is and the metadata records (checksummed kvshade records, record_format.h) of
// every batch from there on: the writes the recovery drops, with the segment and (in the
// service's user metadata) the session each belonged to.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvshade/storage/spill_tier.h"

namespace kvshade::storage::internal {

struct WalFileScan {
  std::string path;
  uint64_t number = 0;  // from the file name (000012.log -> 12)
  uint64_t bytes = 0;
  // The first damaged physical record (checksum mismatch, bad length or type): its offset,
  // and why. A record cut short by the end of the file (a write torn by a crash) is not
  // damage: it was never acknowledged, and RocksDB drops it silently too.
  bool damaged = false;
  uint64_t damage_offset = 0;
  std::string damage_reason;
  // Metadata records of the batches from the damage on (the damaged batch's where its own
  // record checksums pass), and how many of those batches could not be read far enough to
  // say what they held (a damaged batch whose metadata record or framing is damaged).
  std::vector<SegmentMeta> after_damage;
  uint64_t unidentified_batches = 0;
  // Every batch's metadata records (all of the file), for files after a damaged one.
  std::vector<SegmentMeta> all;
  uint64_t unreadable_batches = 0;  // batches in `all` that could not be parsed
};

// Scans every *.log file of `dir` in file-number order. I/O errors are returned (the
// caller decides); damage is described, never an error.
absl::StatusOr<std::vector<WalFileScan>> ScanWalFiles(const std::string& dir);

// CRC32C (Castagnoli), as RocksDB's log records use it; exposed for tests.
uint32_t Crc32c(uint32_t init, const char* data, size_t n);

}  // namespace kvshade::storage::internal

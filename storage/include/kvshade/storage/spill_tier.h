// The spill tier: where segments go when they leave host memory, and where durable
// segments live across restarts. SpillTier is the interface (so a fault-injection wrapper
// can stand in front of it); RocksSpillTier is the RocksDB implementation. The on-disk
// format is documented in storage/README.md and versioned (kFormatVersion).
//
// Contract
// - A segment is written once, whole: metadata, per-layer factor blobs and per-layer value
//   blocks go in one atomic batch, so a reader (or a process restarted after a crash) sees
//   all of a segment or nothing of it.
// - Durability is a property of the segment, fixed when it is first written:
//   kDurable segments are written through the write-ahead log and fsynced before
//   WriteSegment returns, and are listed again after a restart; kCache segments (LRU spill
//   of a live process) skip the log and are deleted when the tier is next opened.
// - Every record carries its own xxh3 checksum bound to its key; a mismatch is DataLoss.
// - All methods are thread-safe. Errors are absl::Status (RocksDB's own are converted in
//   the lowest wrapper): NotFound for an unknown segment, DataLoss for a checksum or
//   format violation, ResourceExhausted for a full disk, Unavailable for any other I/O
//   error, FailedPrecondition for a format version this build does not read.
// - Storage faults never abort the process and are never silent: a write that fails
//   leaves nothing of itself, answers ResourceExhausted (full disk) or Unavailable (I/O
//   error), is counted in SpillStats and reported as a SpillEvent; reads keep working
//   while writes are refused (README.md "Storage faults").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvshade/storage/types.h"

namespace kvshade::storage {

inline constexpr uint16_t kFormatVersion = 1;

enum class Durability : uint8_t { kCache = 0, kDurable = 1 };

// How far a kDurable write has gone when WriteSegment returns (kCache writes skip the log
// whatever this says). kFlushed (the default): synced to the WAL and flushed into table
// files, so a damaged WAL cannot lose it (README.md "WAL recovery"). kSynced: synced to
// the WAL only (survives kill -9 and power loss; a damaged WAL before it loses it).
// kLogged: written to the WAL file but not synced: it survives the process (kill -9: the
// bytes are in the kernel), not the machine, until the next SyncWal() or synced write.
enum class WriteSync : uint8_t { kFlushed = 0, kSynced = 1, kLogged = 2 };

// One factor blob to write: host bytes of (layer, kind).
struct FactorBlob {
  int layer = 0;
  FactorKind kind = FactorKind::kOther;
  absl::Span<const std::byte> bytes;
};

// A whole segment to write. values[l] is layer l's block, layout.layer_bytes() bytes
// ([h, n_chunks, chunk_stride], host memory); values may be empty only when the layout
// holds no value bytes.
struct SegmentWrite {
  SegmentId id;
  SegmentValueLayout layout;
  Durability durability = Durability::kCache;
  WriteSync sync = WriteSync::kFlushed;  // kDurable only
  std::vector<absl::Span<const std::byte>> values;
  std::vector<FactorBlob> factors;
  std::string_view user_metadata;  // opaque to storage (the service's segment description)
};

// What a segment's metadata record says.
struct SegmentMeta {
  struct Factor {
    int layer = 0;
    FactorKind kind = FactorKind::kOther;
    uint64_t bytes = 0;
  };
  SegmentId id;
  SegmentValueLayout layout;
  Durability durability = Durability::kCache;
  uint64_t piece_bytes = 0;        // value/factor blobs are stored in pieces of this size
  uint64_t commit_unix_micros = 0;
  std::vector<Factor> factors;
  std::string user_metadata;

  const Factor* FindFactor(int layer, FactorKind kind) const;
};

struct SpillStats {
  uint64_t segments_written = 0;
  uint64_t bytes_written = 0;  // payload bytes (values + factors + metadata)
  uint64_t bytes_read = 0;     // payload bytes of value and factor reads
  uint64_t segments_deleted = 0;
  uint64_t checksum_failures = 0;
  // Storage faults (README.md "Storage faults").
  uint64_t write_failures = 0;     // writes (segments, factors, deletes) refused by an I/O error
  uint64_t no_space_failures = 0;  // of those, refused because the disk is full
  uint64_t background_errors = 0;  // errors RocksDB reported (WAL, flush, compaction, MANIFEST)
  uint64_t resumes = 0;            // times writes were accepted again after such an error
  bool writes_stopped = false;     // RocksDB refuses writes now (reads are still served)
  // Durable writes acknowledged while their records were in the synced WAL only (their
  // flush into table files was skipped during a fault, or failed).
  uint64_t unflushed_durable_writes = 0;
  // What the last open found: damaged WAL regions (point-in-time recovery kept every
  // record before the first one and dropped everything after it) and the bytes the WAL
  // reader reported dropped.
  uint64_t wal_damage_at_open = 0;
  uint64_t wal_bytes_dropped_at_open = 0;
};

// A storage fault or a recovery loss, reported as it happens (README.md "Storage faults").
struct SpillEvent {
  enum class Kind : uint8_t {
    kWriteFailed,      // a write was refused; nothing of it is stored
    kWritesStopped,    // RocksDB stopped accepting writes after an error (reads continue)
    kWritesResumed,    // writes are accepted again
    kBackgroundError,  // an error inside RocksDB (WAL, flush, compaction, MANIFEST)
    kWalDamaged,       // at open: a damaged WAL; the records from the damage on were dropped
    kCorruptRecord,    // a record failed its checksum; it is never served
    kRocksLog,         // a RocksDB warning or error line (its own log goes here, not to disk)
  };
  Kind kind = Kind::kRocksLog;
  absl::StatusCode code = absl::StatusCode::kOk;  // of the failure, where there is one
  bool error = false;  // error level (else warning)
  // False for a repeat of the same kind within 10 s: count it, do not log it (the next
  // logged event of the kind says how many were not).
  bool log = true;
  std::string message;  // names the tier's path
};
using SpillEventSink = std::function<void(const SpillEvent&)>;
std::string_view SpillEventKindName(SpillEvent::Kind kind);  // "write_failed", ...

// The receiver of the events of every tier opened without RocksSpillOptions::event_sink
// (the daemon sets it to its log and metrics before it opens the tier). Null (the start
// state) prints them to stderr. Process-wide; thread-safe.
void SetDefaultSpillEventSink(SpillEventSink sink);

// What the open of a spill tier found damaged (README.md "Damage at open"), for the service to
// name the sessions that lost data. Empty when nothing was.
struct SpillDamage {
  // A key range of one column family that could not be read (a table block that fails its
  // checksum, a table file that cannot be opened): every key k with after < k < until
  // ("" = no bound) is unknown. A block holds many keys, so a damaged block takes every
  // segment whose records lay in it.
  struct Range {
    std::string column_family;
    std::string after, until;
    // [after, until] with both ends included instead (a whole table file's key range).
    bool inclusive = false;
  };
  // The write-ahead log: RocksDB's point-in-time recovery dropped every write from the
  // first damaged record on. `wal_dropped` are the metadata records of the dropped writes
  // that could still be read (the scan before the open, wal_scan.h); `wal_unidentified`
  // counts dropped writes whose records could not be read (what they named is unknown).
  bool wal_damaged = false;
  std::string wal_report;
  std::vector<SegmentMeta> wal_dropped;
  uint64_t wal_unidentified = 0;
  // Copies of the damaged WAL files, kept for inspection (under <path>/quarantine/).
  std::vector<std::string> kept_files;
  // Table files.
  std::vector<Range> unreadable;
  // Metadata records that were read but fail their own checksum (never listed).
  std::vector<SegmentId> damaged_meta;
  // Set when a table file could not be opened at all and the tier opened without
  // RocksDB's paranoid checks (README.md "Damage at open"): what happened, naming the file.
  std::string table_report;

  bool any() const {
    return wal_damaged || !unreadable.empty() || !damaged_meta.empty() || !table_report.empty();
  }
  // True when a metadata record of `id` may lie in an unreadable range (it may exist and
  // not be listed).
  bool MetaUnreadable(const SegmentId& id) const;
  // True when some value or factor piece of `id` may lie in an unreadable range.
  bool PiecesUnreadable(const SegmentId& id) const;
  // True when any metadata key range is unreadable (records there cannot be named).
  bool AnyMetaUnreadable() const;
};

// How the open treats damage (README.md "Damage at open"): kServeRest opens with what can be read
// and reports the rest (SpillDamage); kRefuse fails the open (DataLoss) before anything
// is changed on disk when the WAL is damaged, and when a table range cannot be read.
enum class DamagePolicy : uint8_t { kServeRest = 0, kRefuse = 1 };

class SpillTier {
 public:
  virtual ~SpillTier() = default;

  // Atomically writes a whole segment; AlreadyExists when the id is already stored
  // (segments are immutable). InvalidArgument when values/factors disagree with the layout.
  virtual absl::Status WriteSegment(const SegmentWrite& segment) = 0;
  // Adds factor blobs to a stored segment (e.g. when the device budget pushes a cold
  // segment's factors out), atomically with the updated metadata. Uses the segment's own
  // durability. AlreadyExists when one of (layer, kind) is already stored.
  virtual absl::Status AddFactors(const SegmentId& id, absl::Span<const FactorBlob> factors) = 0;
  virtual absl::StatusOr<SegmentMeta> ReadMeta(const SegmentId& id) = 0;
  // Reads layer `layer`'s value block into dst (exactly layout.layer_bytes() bytes).
  virtual absl::Status ReadValues(const SegmentId& id, int layer, absl::Span<std::byte> dst) = 0;
  // Reads one factor blob into dst (exactly its stored size).
  virtual absl::Status ReadFactor(const SegmentId& id, int layer, FactorKind kind,
                                  absl::Span<std::byte> dst) = 0;
  // Deletes a segment (all records, atomically); OK when it is absent.
  virtual absl::Status DeleteSegment(const SegmentId& id) = 0;
  // Deletes several segments; durable ones cost one sync (and flush) for all of them.
  // Stops at the first error (the segments before it are deleted).
  virtual absl::Status DeleteSegments(absl::Span<const SegmentId> ids) {
    for (const SegmentId& id : ids) {
      if (absl::Status st = DeleteSegment(id); !st.ok()) return st;
    }
    return absl::OkStatus();
  }
  // Syncs every WriteSync::kLogged write made so far to stable storage.
  virtual absl::Status SyncWal() { return absl::OkStatus(); }
  // Metadata of every stored segment, ordered by id.
  virtual absl::StatusOr<std::vector<SegmentMeta>> ListSegments() = 0;
  virtual SpillStats Stats() const = 0;
  // What the open found damaged (and what listing found since); empty when nothing.
  virtual SpillDamage Damage() const { return SpillDamage(); }
};

// Reads back every value block and factor blob of a stored segment, verifying every
// checksum and size. OK, or the first error (DataLoss on corruption).
absl::Status VerifySegment(SpillTier& tier, const SegmentId& id);

class DiskFaults;  // fault_injection.h

// Compression of one column family. kAuto picks the default documented in README.md.
enum class SpillCompression { kAuto, kNone, kLz4, kZstd };

struct RocksSpillOptions {
  std::string path;                  // database directory (created if missing)
  size_t piece_bytes = 256 << 10;    // value and factor blobs are split into pieces this big
  // A segment up to this size is written as one WriteBatch; a larger one is staged (pieces
  // first, then the metadata record commits it) so that memory stays bounded.
  size_t max_batch_bytes = 64 << 20;
  // Per column family; kAuto = the defaults below, chosen from measured ratios
  // (README.md): bf16 factors gain 1.29x with ZSTD and nothing with LZ4; int4/int2 value
  // codes gain <= 1.09x, so values stay uncompressed (set kZstd for bf16/fp8 sessions on a
  // slow disk: 1.29x / 1.21x).
  SpillCompression metadata_compression = SpillCompression::kAuto;  // default ZSTD
  SpillCompression factors_compression = SpillCompression::kAuto;   // default ZSTD
  SpillCompression values_compression = SpillCompression::kAuto;    // default none
  size_t block_cache_bytes = 32 << 20;
  size_t write_buffer_bytes = 64 << 20;  // memtable size of the values column family
  // Value pieces in RocksDB blob files (less compaction rewriting) instead of inline in
  // SST files. Off by default: on the reference VM blob reads ran at ~300 MB/s against
  // ~1 GB/s inline (storage/README.md).
  bool values_in_blob_files = false;
  // Delete kCache segments (and any record without metadata) at open: they belonged to
  // the previous process's memory and nothing refers to them any more.
  bool drop_cache_segments_on_open = true;
  // Test sync point (RocksDB's SyncPoint idea): called from WriteSegment with "stage" after
  // each staged batch and "commit" just before the batch holding the metadata is written.
  // Crash tests use it to place a kill inside a write. Null in production.
  std::function<void(std::string_view point)> sync_point;
  // After a durable write or delete is synced to the WAL, flush the memtables into table
  // files before returning, so that an acknowledged durable record never lives in the WAL
  // alone: a damaged WAL (its tail, or a flipped byte) then loses only writes that were in
  // flight (README.md "WAL recovery"). Costs one small flush per durable write.
  bool flush_durable_writes = true;
  // Free space kept for RocksDB's own flushes and compactions: a write is refused
  // (ResourceExhausted) unless its file system has its bytes (twice for a durable write:
  // WAL and table file), the memtables' and this much free, so that a filling disk stops
  // writes before RocksDB meets it (README.md "Storage faults"). 0 = automatic: 5% of the
  // file system, at least 1 MiB, at most 256 MiB.
  uint64_t min_free_bytes = 0;
  // After an error stopped RocksDB's writes, the next write tries DB::Resume() first, at
  // most once per this interval (RocksDB's own background retry is off; see README.md).
  uint32_t resume_interval_ms = 1000;
  // Where this tier's SpillEvents go; null: the process default (SetDefaultSpillEventSink).
  SpillEventSink event_sink;
  // Tests: simulated disk faults (full disk, EIO) under RocksDB's own file I/O
  // (fault_injection.h). Null in production.
  std::shared_ptr<DiskFaults> disk_faults;
  // Damage found at open: served around and reported, or the open refused (DamagePolicy).
  DamagePolicy on_damage = DamagePolicy::kServeRest;
  // Runs RocksDB's RepairDB before the open (an explicit operator request, for a MANIFEST
  // or CURRENT file that RocksDB cannot open): it rebuilds the MANIFEST from the table
  // files it can read and drops what it cannot. Reported as an error-level event.
  bool repair = false;
};

// Result of a full scan of the database (an fsck).
struct ConsistencyReport {
  uint64_t segments = 0;
  uint64_t durable_segments = 0;
  uint64_t value_pieces = 0;
  uint64_t factor_pieces = 0;
  uint64_t orphan_pieces = 0;     // pieces whose segment has no metadata record
  uint64_t bad_records = 0;       // records that fail their checksum or header checks
  uint64_t incomplete_segments = 0;  // metadata whose pieces are missing or mis-sized
};

class RocksSpillTier final : public SpillTier {
 public:
  // Opens (creating if needed) the database at options.path. FailedPrecondition when it
  // holds another format version; Unavailable on I/O errors.
  static absl::StatusOr<std::unique_ptr<RocksSpillTier>> Open(const RocksSpillOptions& options);
  ~RocksSpillTier() override;

  absl::Status WriteSegment(const SegmentWrite& segment) override;
  absl::Status AddFactors(const SegmentId& id, absl::Span<const FactorBlob> factors) override;
  absl::StatusOr<SegmentMeta> ReadMeta(const SegmentId& id) override;
  absl::Status ReadValues(const SegmentId& id, int layer, absl::Span<std::byte> dst) override;
  absl::Status ReadFactor(const SegmentId& id, int layer, FactorKind kind,
                          absl::Span<std::byte> dst) override;
  absl::Status DeleteSegment(const SegmentId& id) override;
  absl::Status DeleteSegments(absl::Span<const SegmentId> ids) override;
  absl::Status SyncWal() override;
  absl::StatusOr<std::vector<SegmentMeta>> ListSegments() override;
  SpillStats Stats() const override;
  SpillDamage Damage() const override;

  // Flushes every column family's memtable to table/blob files (cache segments are only in
  // memory until a flush; e.g. before measuring or at an orderly shutdown). Refused
  // (the stopping error) while RocksDB refuses writes.
  absl::Status Flush();
  // Waits until RocksDB runs no flush or compaction and has none pending, or `timeout_ms`
  // passed; true when idle. A quiescent point: before copying the directory, or in a test
  // that injects a fault and must not also fail a compaction still running.
  bool WaitForBackgroundWork(uint32_t timeout_ms);
  // Scans every record of every column family (checksums included).
  absl::StatusOr<ConsistencyReport> CheckConsistency();
  // Number of segments dropped at open (kCache leftovers of the previous process).
  uint64_t dropped_on_open() const;

  struct Impl;

 private:
  explicit RocksSpillTier(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvshade::storage

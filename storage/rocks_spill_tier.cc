// RocksSpillTier: the spill tier on RocksDB. Column families: "metadata" (one record per
// segment: the commit record), "factors" and "values" (blobs split into pieces), and
// "default" (the format record). Layout and checksums: record_format.h, README.md.
//
// Commit protocol. A segment of at most max_batch_bytes goes in one WriteBatch (pieces +
// metadata), atomic by construction. A larger one is staged: its pieces are written first
// in several batches, then the metadata record alone commits it; readers only ever reach
// pieces through a metadata record, and pieces without one are deleted at the next open.
// Either way no partial segment is ever visible.
//
// Storage faults (README.md "Storage faults"). RocksDB's own log goes to the event sink,
// never to a file on the spill disk: its file logger re-used its writer after a failed
// write on a full disk and aborted the process (RocksDB 7.8 asserts
// `sync_without_flush_called_` in WritableFileWriter). A failed write stops RocksDB's
// writes (paranoid_checks, a background error); RocksDB's own retry is off and the next
// write calls DB::Resume() instead, at most once per resume_interval_ms. RocksDB 7.8's
// resume re-uses the WAL writer of a failed write when every memtable is empty (fixed
// upstream in 2024, rocksdb PR 12873), and that writer aborts on its next append: each
// logged write is preceded by a tombstone in the memtable (no WAL), so that the resume
// switches to a new WAL (WriteLogged). Manual flushes are never issued while an error is
// active, so no path re-uses a writer that has failed.
//
// WAL recovery (README.md "WAL recovery"): point in time. Durable writes are flushed into
// table files before they return (flush_durable_writes), so a damaged WAL drops only
// writes in flight; a damage found at open is reported.
#include <sys/statvfs.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/storage/fault_injection.h"
#include "kvshade/storage/spill_tier.h"
#include "record_format.h"
#include "wal_scan.h"
#include "kvshade/base/sync.h"
#include "rocksdb/cache.h"
#include "rocksdb/convenience.h"
#include "rocksdb/db.h"
#include "rocksdb/env.h"
#include "rocksdb/file_system.h"
#include "rocksdb/listener.h"
#include "rocksdb/options.h"
#include "rocksdb/slice.h"
#include "rocksdb/sst_file_reader.h"
#include "rocksdb/table.h"
#include "rocksdb/write_batch.h"

namespace kvshade::storage {
namespace {

using internal::RecordType;

// Converts a RocksDB status into an absl::Status naming the operation and the call site.
absl::Status FromRocks(const rocksdb::Status& s, std::string_view what, const char* file,
                       int line) {
  if (s.ok()) return absl::OkStatus();
  std::string msg =
      absl::StrCat("rocksdb ", std::string(what), ": ", s.ToString(), " (", file, ":", line, ")");
  switch (s.code()) {
    case rocksdb::Status::kNotFound: return absl::NotFoundError(msg);
    case rocksdb::Status::kCorruption: return absl::DataLossError(msg);
    case rocksdb::Status::kInvalidArgument: return absl::InvalidArgumentError(msg);
    case rocksdb::Status::kNotSupported: return absl::UnimplementedError(msg);
    case rocksdb::Status::kIOError:
      if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
      return absl::UnavailableError(msg);
    case rocksdb::Status::kBusy:
    case rocksdb::Status::kTimedOut:
    case rocksdb::Status::kTryAgain:
    case rocksdb::Status::kIncomplete: return absl::UnavailableError(msg);
    case rocksdb::Status::kAborted: return absl::AbortedError(msg);
    default: return absl::InternalError(msg);
  }
}
#define KVSHADE_ROCKS(expr, what) FromRocks((expr), (what), __FILE__, __LINE__)

// A key of the default column family that is only ever deleted (Impl::WriteLogged).
constexpr char kWalGuardKey[] = "kvshade.wal-guard";

rocksdb::CompressionType PickCompression(SpillCompression c, rocksdb::CompressionType dflt) {
  rocksdb::CompressionType want = dflt;
  switch (c) {
    case SpillCompression::kAuto: break;
    case SpillCompression::kNone: want = rocksdb::kNoCompression; break;
    case SpillCompression::kLz4: want = rocksdb::kLZ4Compression; break;
    case SpillCompression::kZstd: want = rocksdb::kZSTD; break;
  }
  for (rocksdb::CompressionType t : rocksdb::GetSupportedCompressions()) {
    if (t == want) return want;
  }
  return rocksdb::kNoCompression;  // this librocksdb was built without it
}

uint64_t PieceCount(uint64_t bytes, uint64_t piece_bytes) {
  return (bytes + piece_bytes - 1) / piece_bytes;
}

rocksdb::Slice ToSlice(absl::Span<const std::byte> b) {
  return rocksdb::Slice(reinterpret_cast<const char*>(b.data()), b.size());
}

// Puts header + payload as one record without copying the payload first.
rocksdb::Status PutRecord(rocksdb::WriteBatch* batch, rocksdb::ColumnFamilyHandle* cf,
                          RecordType type, const std::string& key,
                          absl::Span<const std::byte> payload) {
  const std::string header = internal::EncodeRecordHeader(type, key, payload);
  rocksdb::Slice key_slice(key);
  rocksdb::Slice parts[2] = {rocksdb::Slice(header), ToSlice(payload)};
  return batch->Put(cf, rocksdb::SliceParts(&key_slice, 1), rocksdb::SliceParts(parts, 2));
}

// Owner of a column family handle; destroyed through its DB before the DB closes.
struct CfDeleter {
  rocksdb::DB* db = nullptr;
  void operator()(rocksdb::ColumnFamilyHandle* h) const {
    if (db != nullptr && h != nullptr) db->DestroyColumnFamilyHandle(h).PermitUncheckedError();
  }
};
using CfHandle = std::unique_ptr<rocksdb::ColumnFamilyHandle, CfDeleter>;

// RocksSpillOptions::disk_faults: RocksDB's writes go through DiskFaults, which fails them
// like a full disk (ENOSPC) or a failing one (EIO).
rocksdb::IOStatus FaultStatus(DiskFaults::Result r, const char* op) {
  switch (r) {
    case DiskFaults::Result::kOk: return rocksdb::IOStatus::OK();
    case DiskFaults::Result::kNoSpace:
      return rocksdb::IOStatus::NoSpace(op, "No space left on device (simulated)");
    case DiskFaults::Result::kIoError: break;
  }
  return rocksdb::IOStatus::IOError(op, "Input/output error (simulated)");
}

class FaultyWritableFile final : public rocksdb::FSWritableFileOwnerWrapper {
  static constexpr DiskFaults::Result kOk = DiskFaults::Result::kOk;

 public:
  FaultyWritableFile(std::unique_ptr<rocksdb::FSWritableFile> f, std::shared_ptr<DiskFaults> faults)
      : FSWritableFileOwnerWrapper(std::move(f)), faults_(std::move(faults)) {}

  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Write(data.size()); r != kOk) return FaultStatus(r, "append");
    return FSWritableFileOwnerWrapper::Append(data, o, dbg);
  }
  rocksdb::IOStatus Append(const rocksdb::Slice& data, const rocksdb::IOOptions& o,
                           const rocksdb::DataVerificationInfo& v,
                           rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Write(data.size()); r != kOk) return FaultStatus(r, "append");
    return FSWritableFileOwnerWrapper::Append(data, o, v, dbg);
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Write(data.size()); r != kOk) return FaultStatus(r, "append");
    return FSWritableFileOwnerWrapper::PositionedAppend(data, offset, o, dbg);
  }
  rocksdb::IOStatus PositionedAppend(const rocksdb::Slice& data, uint64_t offset,
                                     const rocksdb::IOOptions& o,
                                     const rocksdb::DataVerificationInfo& v,
                                     rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Write(data.size()); r != kOk) return FaultStatus(r, "append");
    return FSWritableFileOwnerWrapper::PositionedAppend(data, offset, o, v, dbg);
  }
  rocksdb::IOStatus Flush(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Sync(); r != kOk) return FaultStatus(r, "flush");
    return FSWritableFileOwnerWrapper::Flush(o, dbg);
  }
  rocksdb::IOStatus Sync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Sync(); r != kOk) return FaultStatus(r, "sync");
    return FSWritableFileOwnerWrapper::Sync(o, dbg);
  }
  rocksdb::IOStatus Fsync(const rocksdb::IOOptions& o, rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Sync(); r != kOk) return FaultStatus(r, "fsync");
    return FSWritableFileOwnerWrapper::Fsync(o, dbg);
  }
  rocksdb::IOStatus RangeSync(uint64_t offset, uint64_t n, const rocksdb::IOOptions& o,
                              rocksdb::IODebugContext* dbg) override {
    if (auto r = faults_->Sync(); r != kOk) return FaultStatus(r, "range sync");
    return FSWritableFileOwnerWrapper::RangeSync(offset, n, o, dbg);
  }

 private:
  std::shared_ptr<DiskFaults> faults_;
};

class FaultyFileSystem final : public rocksdb::FileSystemWrapper {
 public:
  FaultyFileSystem(const std::shared_ptr<rocksdb::FileSystem>& base, std::shared_ptr<DiskFaults> faults)
      : FileSystemWrapper(base), faults_(std::move(faults)) {}
  const char* Name() const override { return "KvshadeDiskFaults"; }

  rocksdb::IOStatus NewWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                    std::unique_ptr<rocksdb::FSWritableFile>* r,
                                    rocksdb::IODebugContext* dbg) override {
    return Wrap(target()->NewWritableFile(f, o, r, dbg), r);
  }
  rocksdb::IOStatus ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o,
                                       std::unique_ptr<rocksdb::FSWritableFile>* r,
                                       rocksdb::IODebugContext* dbg) override {
    return Wrap(target()->ReopenWritableFile(f, o, r, dbg), r);
  }
  rocksdb::IOStatus ReuseWritableFile(const std::string& f, const std::string& old,
                                      const rocksdb::FileOptions& o,
                                      std::unique_ptr<rocksdb::FSWritableFile>* r,
                                      rocksdb::IODebugContext* dbg) override {
    return Wrap(target()->ReuseWritableFile(f, old, o, r, dbg), r);
  }
  rocksdb::IOStatus GetFreeSpace(const std::string& path, const rocksdb::IOOptions& o,
                                 uint64_t* free, rocksdb::IODebugContext* dbg) override {
    rocksdb::IOStatus s = target()->GetFreeSpace(path, o, free, dbg);
    if (s.ok()) *free = faults_->ReportedFree(*free);
    return s;
  }

 private:
  rocksdb::IOStatus Wrap(rocksdb::IOStatus s, std::unique_ptr<rocksdb::FSWritableFile>* r) {
    if (s.ok()) *r = std::make_unique<FaultyWritableFile>(std::move(*r), faults_);
    return s;
  }
  std::shared_ptr<DiskFaults> faults_;
};


// Default event sink (SetDefaultSpillEventSink); null prints to stderr.
std::mutex& DefaultSinkMu() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
SpillEventSink& DefaultSink() {
  static SpillEventSink* sink = new SpillEventSink;
  return *sink;
}

void PrintToStderr(const SpillEvent& e) {
  if (!e.log) return;
  std::fprintf(stderr, "kvshade spill tier [%s] %s: %s\n", e.error ? "error" : "warning",
               std::string(SpillEventKindName(e.kind)).c_str(), e.message.c_str());
}

// Counts storage faults and reports them (SpillEvent) to the tier's sink. Shared with the
// RocksDB logger and listener, which may outlive the tier's Impl by a little.
class Reporter {
 public:
  Reporter(std::string path, SpillEventSink sink) : path_(std::move(path)), sink_(std::move(sink)) {}

  const std::string& path() const { return path_; }

  void Emit(SpillEvent::Kind kind, bool error, absl::StatusCode code, std::string message) {
    SpillEvent e;
    e.kind = kind;
    e.error = error;
    e.code = code;
    e.message = std::move(message);
    // Repeats of the noisy kinds are logged at most once per 10 s, with a count.
    if (kind == SpillEvent::Kind::kWriteFailed || kind == SpillEvent::Kind::kBackgroundError ||
        kind == SpillEvent::Kind::kRocksLog || kind == SpillEvent::Kind::kCorruptRecord) {
      std::lock_guard<std::mutex> lock(mu_);
      Limit& l = limits_[static_cast<int>(kind)];
      const auto now = std::chrono::steady_clock::now();
      if (l.logged && now - l.last < std::chrono::seconds(10)) {
        e.log = false;
        ++l.suppressed;
      } else {
        if (l.suppressed > 0) {
          absl::StrAppend(&e.message, " (", l.suppressed, " more like it in the last ",
                          std::chrono::duration_cast<std::chrono::seconds>(now - l.last).count(),
                          " s)");
        }
        l.logged = true;
        l.last = now;
        l.suppressed = 0;
      }
    }
    if (sink_) {
      sink_(e);
      return;
    }
    SpillEventSink sink;
    {
      std::lock_guard<std::mutex> lock(DefaultSinkMu());
      sink = DefaultSink();
    }
    if (sink) {
      sink(e);
    } else {
      PrintToStderr(e);
    }
  }

  // A write refused by `s` (already converted): counts it and reports it.
  void WriteFailed(const absl::Status& s) {
    write_failures.fetch_add(1);
    if (absl::IsResourceExhausted(s)) no_space_failures.fetch_add(1);
    Emit(SpillEvent::Kind::kWriteFailed, true, s.code(), std::string(s.message()));
  }

  // RocksDB reported a background error (listener). Severity >= hard stops writes.
  void BackgroundError(std::string_view reason, const rocksdb::Status& s) {
    background_errors.fetch_add(1);
    bg_error_active.store(true);
    if (reason == "flush") flush_failed.store(true);
    const bool stops = s.severity() >= rocksdb::Status::Severity::kHardError;
    const absl::StatusCode code = FromRocks(s, reason, __FILE__, __LINE__).code();
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_bg_error_ = s;
    }
    Emit(SpillEvent::Kind::kBackgroundError, true, code,
         absl::StrCat("spill tier at ", path_, ": RocksDB ", std::string(reason), " error (",
                      stops ? "writes stop" : "writes continue", "): ", s.ToString()));
    if (stops) {
      Transition(&rocks_stopped_, true, code,
                 absl::StrCat("spill tier at ", path_, ": writes are refused after a ",
                              std::string(reason), " error (", s.ToString(),
                              "); reads are still served; the next write retries once the fault "
                              "is cleared (a full disk: once space is freed; other errors: after "
                              "a restart)"));
    }
  }

  // The background error is cleared (listener, or our own DB::Resume()).
  void Cleared() {
    bg_error_active.store(false);
    flush_failed.store(false);
    Transition(&rocks_stopped_, false, absl::StatusCode::kOk,
               absl::StrCat("spill tier at ", path_, ": writes are accepted again (after: ",
                            LastBackgroundError().ToString(), ")"));
  }

  // The free-space check (Impl::CheckSpace) refuses writes, or accepts them again.
  void LowSpace(bool on, std::string why) {
    Transition(&low_space_, on, on ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kOk,
               std::move(why));
  }

  // RocksDB's writes cannot be resumed in this process (Impl::MaybeResume); reported once.
  void NeedsRestart(std::string why) {
    if (resume_unsafe.exchange(true)) return;
    Emit(SpillEvent::Kind::kBackgroundError, true, absl::StatusCode::kUnavailable,
         absl::StrCat("spill tier at ", path_, ": writes stay refused until the daemon restarts: ",
                      why));
  }

  rocksdb::Status LastBackgroundError() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_bg_error_;
  }

  // RocksDB's log lines (SinkLogger). While opening, the WAL reader's reports of dropped
  // bytes are collected for the open report.
  void RocksLog(rocksdb::InfoLogLevel level, std::string line) {
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
    if (opening.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      if (const size_t at = line.find(": dropping "); at != std::string::npos) {
        ++open_wal_damage_;
        uint64_t bytes = 0;
        for (size_t i = at + 11; i < line.size() && line[i] >= '0' && line[i] <= '9'; ++i) {
          bytes = bytes * 10 + uint64_t(line[i] - '0');
        }
        open_wal_bytes_dropped_ += bytes;
        open_reports_.push_back(line);
        // "<dir>/000012.log: dropping ...": the file the recovery stopped in.
        if (at >= 4 && line.compare(at - 4, 4, ".log") == 0) {
          size_t b = at - 4;
          while (b > 0 && line[b - 1] >= '0' && line[b - 1] <= '9') --b;
          if (b < at - 4) open_damaged_wals_.push_back(std::stoull(line.substr(b, at - 4 - b)));
        }
        return;
      }
      if (line.find("Point in time recovered to") != std::string::npos) {
        open_reports_.push_back(line);
        return;
      }
    }
    // A flush job that failed, or found writes stopped and gave up (its flush request stays
    // queued without a job): see Impl::MaybeResume.
    if (line.find("Waiting after background flush error") != std::string::npos) {
      flush_failed.store(true);
    }
    if (level < rocksdb::InfoLogLevel::WARN_LEVEL) return;
    Emit(SpillEvent::Kind::kRocksLog, level >= rocksdb::InfoLogLevel::ERROR_LEVEL,
         absl::StatusCode::kOk, absl::StrCat("spill tier at ", path_, ": rocksdb: ", line));
  }

  // Ends the open: reports a damaged WAL, if any.
  void OpenDone() {
    opening.store(false);
    uint64_t damage = 0, bytes = 0;
    std::vector<std::string> reports;
    {
      std::lock_guard<std::mutex> lock(mu_);
      damage = open_wal_damage_;
      bytes = open_wal_bytes_dropped_;
      reports.swap(open_reports_);
    }
    wal_damage_at_open.store(damage);
    wal_bytes_dropped_at_open.store(bytes);
    if (damage == 0) return;
    Emit(SpillEvent::Kind::kWalDamaged, true, absl::StatusCode::kDataLoss,
         absl::StrCat("spill tier at ", path_, ": the write-ahead log is damaged (", damage,
                      " region(s), ", bytes,
                      " bytes reported dropped); point-in-time recovery kept every record "
                      "before the damage and dropped every record after it: ",
                      absl::StrJoin(reports, "; "),
                      ". Durable writes acknowledged after their flush are in table files and "
                      "unaffected; writes in flight at the crash (and acknowledged ones counted "
                      "as unflushed_durable_writes) are lost"));
  }

  // WAL files (numbers) the open's recovery reported damaged, in report order.
  std::vector<uint64_t> DamagedWals() {
    std::lock_guard<std::mutex> lock(mu_);
    return open_damaged_wals_;
  }

  std::atomic<bool> opening{true};
  std::atomic<bool> bg_error_active{false};
  std::atomic<bool> resume_unsafe{false};  // never DB::Resume() (Impl::MaybeResume)
  std::atomic<bool> flush_failed{false};   // a flush job failed since the last resume
  std::atomic<bool> writes_stopped{false};  // rocks_stopped_ || low_space_
  std::atomic<uint64_t> write_failures{0}, no_space_failures{0}, background_errors{0},
      resumes{0}, unflushed_durable_writes{0}, wal_damage_at_open{0}, wal_bytes_dropped_at_open{0};

 private:
  struct Limit {
    bool logged = false;
    std::chrono::steady_clock::time_point last;
    uint64_t suppressed = 0;
  };
  // Writes are refused while RocksDB is stopped by an error or the disk is short of space;
  // the changes of their union are the writes_stopped / writes_resumed events.
  void Transition(bool* flag, bool on, absl::StatusCode code, std::string why) {
    bool before = false, after = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      before = rocks_stopped_ || low_space_;
      *flag = on;
      after = rocks_stopped_ || low_space_;
      writes_stopped.store(after);
    }
    if (!before && after) Emit(SpillEvent::Kind::kWritesStopped, true, code, std::move(why));
    if (before && !after) {
      resumes.fetch_add(1);
      Emit(SpillEvent::Kind::kWritesResumed, false, absl::StatusCode::kOk, std::move(why));
    }
  }

  const std::string path_;
  const SpillEventSink sink_;
  std::mutex mu_;
  Limit limits_[8];
  rocksdb::Status last_bg_error_;
  bool rocks_stopped_ = false, low_space_ = false;
  uint64_t open_wal_damage_ = 0, open_wal_bytes_dropped_ = 0;
  std::vector<std::string> open_reports_;
  std::vector<uint64_t> open_damaged_wals_;
};

// RocksDB's info log, into the Reporter (never a file on the spill disk).
// RocksDB's Logger keeps its level in a plain member that its background threads read, so
// the level is never changed after the open (that was a data race under ThreadSanitizer):
// RocksDB's own filter stays at INFO and this logger filters by its own atomic threshold,
// INFO while opening and WARN afterwards (SetThreshold).
class SinkLogger final : public rocksdb::Logger {
 public:
  explicit SinkLogger(std::shared_ptr<Reporter> r)
      : Logger(rocksdb::InfoLogLevel::INFO_LEVEL), r_(std::move(r)) {}
  void SetThreshold(rocksdb::InfoLogLevel level) { threshold_.store(level); }
  using Logger::Logv;
  void Logv(const char* format, va_list ap) override {
    Logv(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    if (level < threshold_.load() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
    char buf[1024];
    va_list copy;
    va_copy(copy, ap);
    std::vsnprintf(buf, sizeof(buf), format, copy);
    va_end(copy);
    r_->RocksLog(level, buf);
  }

 private:
  std::shared_ptr<Reporter> r_;
  std::atomic<rocksdb::InfoLogLevel> threshold_{rocksdb::InfoLogLevel::INFO_LEVEL};
};

std::string_view ReasonName(rocksdb::BackgroundErrorReason r) {
  switch (r) {
    case rocksdb::BackgroundErrorReason::kFlush: return "flush";
    case rocksdb::BackgroundErrorReason::kCompaction: return "compaction";
    case rocksdb::BackgroundErrorReason::kWriteCallback: return "write";
    case rocksdb::BackgroundErrorReason::kMemTable: return "memtable";
    case rocksdb::BackgroundErrorReason::kManifestWrite: return "MANIFEST write";
    case rocksdb::BackgroundErrorReason::kFlushNoWAL: return "flush";
    case rocksdb::BackgroundErrorReason::kManifestWriteNoWAL: return "MANIFEST write";
  }
  return "background";
}

// RocksDB's background errors, into the Reporter. Automatic recovery is declined: the
// tier resumes on its next write (Impl::MaybeResume), so that nothing retries (and logs)
// in the background while a disk stays full.
class ErrorListener final : public rocksdb::EventListener {
 public:
  explicit ErrorListener(std::shared_ptr<Reporter> r) : r_(std::move(r)) {}
  void OnBackgroundError(rocksdb::BackgroundErrorReason reason, rocksdb::Status* error) override {
    if (error != nullptr && !error->ok()) r_->BackgroundError(ReasonName(reason), *error);
  }
  void OnErrorRecoveryBegin(rocksdb::BackgroundErrorReason, rocksdb::Status,
                            bool* auto_recovery) override {
    if (auto_recovery != nullptr) *auto_recovery = false;
  }
  void OnErrorRecoveryEnd(const rocksdb::BackgroundErrorRecoveryInfo& info) override {
    if (info.new_bg_error.ok()) r_->Cleared();
  }

 private:
  std::shared_ptr<Reporter> r_;
};

}  // namespace

std::string_view SpillEventKindName(SpillEvent::Kind kind) {
  switch (kind) {
    case SpillEvent::Kind::kWriteFailed: return "write_failed";
    case SpillEvent::Kind::kWritesStopped: return "writes_stopped";
    case SpillEvent::Kind::kWritesResumed: return "writes_resumed";
    case SpillEvent::Kind::kBackgroundError: return "background_error";
    case SpillEvent::Kind::kWalDamaged: return "wal_damaged";
    case SpillEvent::Kind::kCorruptRecord: return "corrupt_record";
    case SpillEvent::Kind::kRocksLog: return "rocksdb_log";
  }
  return "unknown";
}

void SetDefaultSpillEventSink(SpillEventSink sink) {
  std::lock_guard<std::mutex> lock(DefaultSinkMu());
  DefaultSink() = std::move(sink);
}

const SegmentMeta::Factor* SegmentMeta::FindFactor(int layer, FactorKind kind) const {
  for (const Factor& f : factors) {
    if (f.layer == layer && f.kind == kind) return &f;
  }
  return nullptr;
}

namespace {

// Whether some key with `prefix` (all its continuations included when `longer`) lies in
// the open interval (r.after, r.until).
bool InRange(const SpillDamage::Range& r, const std::string& key, const std::string& upper) {
  if (r.inclusive) return upper > r.after && key <= r.until;
  return (r.after.empty() || upper > r.after) && (r.until.empty() || key < r.until);
}

}  // namespace

bool SpillDamage::MetaUnreadable(const SegmentId& id) const {
  if (std::find(damaged_meta.begin(), damaged_meta.end(), id) != damaged_meta.end()) return true;
  const std::string key = internal::MetaKey(id);
  for (const Range& r : unreadable) {
    if (r.column_family != "metadata") continue;
    if (r.inclusive ? key >= r.after && key <= r.until
                    : (r.after.empty() || key > r.after) && (r.until.empty() || key < r.until)) {
      return true;
    }
  }
  return false;
}

bool SpillDamage::PiecesUnreadable(const SegmentId& id) const {
  const std::string prefix = internal::SegmentPrefix(id), upper = internal::SegmentUpperBound(id);
  for (const Range& r : unreadable) {
    if (r.column_family == "metadata" || r.column_family == "default") continue;
    if (InRange(r, prefix, upper)) return true;
  }
  return false;
}

bool SpillDamage::AnyMetaUnreadable() const {
  if (!damaged_meta.empty()) return true;
  for (const Range& r : unreadable) {
    if (r.column_family == "metadata") return true;
  }
  return false;
}

struct RocksSpillTier::Impl {
  RocksSpillOptions options;
  std::shared_ptr<Reporter> reporter;
  std::unique_ptr<rocksdb::Env> fault_env;  // options.disk_faults only; outlives the DB
  std::shared_ptr<rocksdb::Cache> block_cache;
  // Declaration order matters: handles are destroyed before the DB.
  std::unique_ptr<rocksdb::DB> db;
  CfHandle default_cf, meta_cf, factors_cf, values_cf;
  // Serializes the metadata read-modify-write of WriteSegment / AddFactors / DeleteSegment,
  // and with it every write, resume and flush the tier issues.
  base::Mutex write_mu;
  std::chrono::steady_clock::time_point last_resume;  // guarded by write_mu
  rocksdb::Env* env = nullptr;                        // the DB's (DiskFaults' when set)
  uint64_t min_free = 0;                              // options.min_free_bytes, resolved
  std::atomic<uint64_t> segments_written{0}, bytes_written{0}, bytes_read{0},
      segments_deleted{0}, checksum_failures{0};
  uint64_t dropped_on_open = 0;
  // What the open found damaged, and unreadable ranges met by later listings.
  mutable std::mutex damage_mu;
  SpillDamage damage;

  ~Impl() {
    default_cf.reset();
    meta_cf.reset();
    factors_cf.reset();
    values_cf.reset();
    if (db) db->Close().PermitUncheckedError();
  }

  absl::Status CheckFormat();
  absl::Status DropCacheSegments();
  // Iterates `cf` from its first key: `step` handles the iterator's current entry and
  // moves it (Next or Seek). A range that cannot be read (a damaged table block: RocksDB's
  // Corruption) does not end the scan: it is found by seeking (the first 16-byte key from
  // which a seek reads again, by bisection), recorded once in `damage` and reported, and
  // the scan resumes after it. Other read errors (I/O) are returned.
  absl::Status ScanTolerant(rocksdb::ColumnFamilyHandle* cf, std::string_view cf_name,
                            const std::function<absl::Status(rocksdb::Iterator*)>& step);
  void AddUnreadable(SpillDamage::Range r, const rocksdb::Status& why);
  // DamagePolicy::kRefuse: DataLoss describing the damage found so far, OK when none.
  absl::Status RefuseIfDamaged() const;
  absl::StatusOr<SegmentMeta> ReadMetaLocked(const SegmentId& id);
  absl::Status AddBlobPieces(rocksdb::WriteBatch* batch, rocksdb::ColumnFamilyHandle* cf,
                             RecordType type, absl::Span<const std::byte> blob,
                             const std::function<std::string(uint32_t)>& key_of);
  absl::Status ReadBlob(rocksdb::ColumnFamilyHandle* cf, RecordType type, uint64_t bytes,
                        uint64_t piece_bytes, const std::function<std::string(uint32_t)>& key_of,
                        absl::Span<std::byte> dst);
  absl::Status Commit(rocksdb::WriteBatch* batch, Durability durability, std::string_view what,
                      WriteSync sync = WriteSync::kFlushed);
  // Under write_mu: adds the deletion of every record of `id` to `batch`; the segment's
  // durability (kDurable when its metadata is damaged), NotFound when it is absent.
  absl::StatusOr<Durability> AddDelete(const SegmentId& id, rocksdb::WriteBatch* batch);
  // Under write_mu: the write path around DB::Write. WriteLogged is every write through
  // the WAL (see the top of this file).
  rocksdb::Status WriteLogged(const rocksdb::WriteOptions& wo, rocksdb::WriteBatch* batch);
  // OK when the file system has room for a write of `bytes` (see min_free_bytes); else
  // counts, reports and returns the refusal (ResourceExhausted).
  absl::Status CheckSpace(uint64_t bytes, bool durable, bool is_delete, std::string_view what);
  void MaybeResume();
  absl::Status WriteFailed(const rocksdb::Status& s, std::string_view what);
  void FlushDurable(std::string_view what);
  std::vector<rocksdb::ColumnFamilyHandle*> AllCfs() const {
    return {default_cf.get(), meta_cf.get(), factors_cf.get(), values_cf.get()};
  }
};

absl::Status RocksSpillTier::Impl::CheckFormat() {
  std::string stored;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), default_cf.get(), internal::kFormatKey, &stored);
  if (s.IsNotFound()) {
    // A new database: nothing but the format record may be written before this check.
    std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), meta_cf.get()));
    it->SeekToFirst();
    if (it->Valid()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spill tier at ", options.path, ": segments present but no format record; not a kvshade "
          "database of a known version"));
    }
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(it->status(), "scan metadata"));
    std::string payload;
    for (int i = 0; i < 4; ++i) payload.push_back(char((uint32_t(kFormatVersion) >> (8 * i)) & 0xff));
    rocksdb::WriteBatch batch;
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
        PutRecord(&batch, default_cf.get(), RecordType::kFormat, internal::kFormatKey,
                  internal::AsBytes(payload)),
        "put format"));
    rocksdb::WriteOptions wo;
    wo.sync = true;
    return KVSHADE_ROCKS(WriteLogged(wo, &batch), "write format record");
  }
  KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(s, "read format record"));
  // Report another version as such before checking the rest of the header.
  if (stored.size() >= 6) {
    uint16_t version = uint16_t(uint8_t(stored[4])) | uint16_t(uint8_t(stored[5])) << 8;
    uint32_t magic = 0;
    std::memcpy(&magic, stored.data(), 4);
    if (magic == internal::kRecordMagic && version != kFormatVersion) {
      return absl::FailedPreconditionError(absl::StrCat("spill tier at ", options.path,
                                                        ": on-disk format version ", version,
                                                        "; this build reads version ",
                                                        kFormatVersion));
    }
  }
  absl::StatusOr<std::string_view> payload =
      internal::DecodeRecord(RecordType::kFormat, internal::kFormatKey, stored);
  if (!payload.ok()) return payload.status();
  return absl::OkStatus();
}

void RocksSpillTier::Impl::AddUnreadable(SpillDamage::Range r, const rocksdb::Status& why) {
  {
    std::lock_guard<std::mutex> lock(damage_mu);
    for (const SpillDamage::Range& o : damage.unreadable) {
      if (o.column_family == r.column_family && o.after == r.after && o.until == r.until &&
          o.inclusive == r.inclusive) {
        return;
      }
    }
    damage.unreadable.push_back(r);
  }
  checksum_failures.fetch_add(1);
  auto hex = [](const std::string& k) {
    SegmentId id;
    return k.empty() ? std::string("(none)") : internal::SegmentIdOfKey(k, &id) ? id.ToHex() : k;
  };
  reporter->Emit(SpillEvent::Kind::kCorruptRecord, true, absl::StatusCode::kDataLoss,
                 absl::StrCat("spill tier at ", options.path, ": a damaged table range of column "
                              "family '", r.column_family, "' cannot be read (keys ",
                              r.inclusive ? "from " : "after ", hex(r.after),
                              r.inclusive ? " to " : " and before ", hex(r.until), ": ", why.ToString(),
                              "); the segments with records there are not served, everything "
                              "else is"));
}

absl::Status RocksSpillTier::Impl::RefuseIfDamaged() const {
  std::lock_guard<std::mutex> lock(damage_mu);
  if (damage.unreadable.empty() && damage.damaged_meta.empty()) return absl::OkStatus();
  std::vector<std::string> what;
  for (const SpillDamage::Range& r : damage.unreadable) {
    SegmentId a, b;
    what.push_back(absl::StrCat(
        r.column_family, " keys after ",
        r.after.empty() ? std::string("the start")
                        : internal::SegmentIdOfKey(r.after, &a) ? a.ToHex() : std::string("?"),
        " and before ",
        r.until.empty() ? std::string("the end")
                        : internal::SegmentIdOfKey(r.until, &b) ? b.ToHex() : std::string("?")));
  }
  for (const SegmentId& id : damage.damaged_meta) {
    what.push_back(absl::StrCat("the metadata record of segment ", id.ToHex()));
  }
  return absl::DataLossError(absl::StrCat(
      "spill tier at ", options.path, ": damaged table data cannot be read (", absl::StrJoin(what, "; "),
      "); the start is refused (on_damage: refuse). Either restore the spill directory from a "
      "backup, or start with on_damage serve_rest: the sessions with records there are then "
      "reported damaged and every other session is served"));
}

absl::Status RocksSpillTier::Impl::ScanTolerant(
    rocksdb::ColumnFamilyHandle* cf, std::string_view cf_name,
    const std::function<absl::Status(rocksdb::Iterator*)>& step) {
  using u128 = unsigned __int128;
  auto key16 = [](u128 v) {
    std::string k(16, '\0');
    for (int i = 15; i >= 0; --i) {
      k[size_t(i)] = char(uint8_t(v & 0xff));
      v >>= 8;
    }
    return k;
  };
  auto value16 = [](std::string_view k) {
    u128 v = 0;
    for (size_t i = 0; i < 16; ++i) v = (v << 8) | (i < k.size() ? uint8_t(k[i]) : 0);
    return v;
  };
  auto readable = [&](const std::string& target) {
    std::unique_ptr<rocksdb::Iterator> probe(db->NewIterator(rocksdb::ReadOptions(), cf));
    probe->Seek(target);
    return probe->status();
  };
  std::unique_ptr<rocksdb::Iterator> it(db->NewIterator(rocksdb::ReadOptions(), cf));
  std::string last;  // the last key handled; "" before the first
  it->SeekToFirst();
  for (;;) {
    while (it->Valid()) {
      last.assign(it->key().data(), it->key().size());
      KVSHADE_RETURN_IF_ERROR(step(it.get()));
    }
    const rocksdb::Status s = it->status();
    if (s.ok()) return absl::OkStatus();
    if (!s.IsCorruption()) return KVSHADE_ROCKS(s, absl::StrCat("scan ", std::string(cf_name)));
    // Unreadable from just after `last`: find the first 16-byte key a seek reads from.
    const u128 max = ~u128(0);
    u128 bad = last.empty() ? 0 : value16(last);
    rocksdb::Status at_max = readable(key16(max));
    if (!at_max.ok()) {
      if (!at_max.IsCorruption()) return KVSHADE_ROCKS(at_max, absl::StrCat("scan ", std::string(cf_name)));
      AddUnreadable({std::string(cf_name), last, ""}, s);
      return absl::OkStatus();
    }
    u128 good = max;
    while (good - bad > 1) {
      const u128 mid = bad + (good - bad) / 2;
      rocksdb::Status m = readable(key16(mid));
      if (!m.ok() && !m.IsCorruption()) return KVSHADE_ROCKS(m, absl::StrCat("scan ", std::string(cf_name)));
      (m.ok() ? good : bad) = mid;
    }
    const std::string until = key16(good);
    AddUnreadable({std::string(cf_name), last, until}, s);
    it.reset(db->NewIterator(rocksdb::ReadOptions(), cf));
    it->Seek(until);
  }
}

absl::Status RocksSpillTier::Impl::DropCacheSegments() {
  // Durable segments survive; everything else (cache segments, pieces of a staged write
  // that never committed) goes. A range that cannot be read is skipped (ScanTolerant) and
  // nothing in it or named by it is deleted: a segment whose metadata may lie in an
  // unreadable range keeps its pieces, for inspection.
  absl::flat_hash_set<SegmentId> keep;
  rocksdb::WriteBatch batch;
  KVSHADE_RETURN_IF_ERROR(ScanTolerant(meta_cf.get(), "metadata", [&](rocksdb::Iterator* it) {
    const std::string_view key(it->key().data(), it->key().size());
    absl::StatusOr<std::string_view> payload = internal::DecodeRecord(
        RecordType::kSegmentMeta, key, std::string_view(it->value().data(), it->value().size()));
    absl::StatusOr<SegmentMeta> meta =
        payload.ok() ? internal::DecodeMetaPayload(*payload) : payload.status();
    SegmentId id;
    const bool named = internal::SegmentIdOfKey(key, &id);
    if (!named) {
      it->Next();
      return absl::OkStatus();
    }
    if (!meta.ok()) {
      // Keep a damaged record (and its pieces) for inspection; it is never listed.
      checksum_failures.fetch_add(1);
      keep.insert(id);
    } else if (meta->durability == Durability::kDurable) {
      keep.insert(id);
    } else {
      KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(batch.Delete(meta_cf.get(), it->key()), "delete"));
      ++dropped_on_open;
    }
    it->Next();
    return absl::OkStatus();
  }));
  SpillDamage seen;
  {
    std::lock_guard<std::mutex> lock(damage_mu);
    seen = damage;
  }
  for (const auto& family : {std::pair{factors_cf.get(), "factors"}, std::pair{values_cf.get(), "values"}}) {
    // A plain variable, not a structured binding: lambdas may not capture those (C++17).
    rocksdb::ColumnFamilyHandle* const cf = family.first;
    KVSHADE_RETURN_IF_ERROR(ScanTolerant(cf, family.second, [&](rocksdb::Iterator* it) {
      SegmentId id;
      const std::string_view key(it->key().data(), it->key().size());
      if (!internal::SegmentIdOfKey(key, &id)) {
        KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(batch.Delete(cf, it->key()), "delete"));
        it->Next();
        return absl::OkStatus();
      }
      const std::string upper = internal::SegmentUpperBound(id);
      if (!keep.contains(id) && !seen.MetaUnreadable(id)) {
        KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
            batch.DeleteRange(cf, internal::SegmentPrefix(id), upper), "delete range"));
      }
      it->Seek(upper);  // jump to the next segment
      return absl::OkStatus();
    }));
  }
  if (batch.Count() == 0) return absl::OkStatus();
  rocksdb::WriteOptions wo;
  wo.sync = true;
  return KVSHADE_ROCKS(WriteLogged(wo, &batch), "drop cache segments");
}

absl::StatusOr<SegmentMeta> RocksSpillTier::Impl::ReadMetaLocked(const SegmentId& id) {
  const std::string key = internal::MetaKey(id);
  rocksdb::PinnableSlice stored;
  rocksdb::Status s = db->Get(rocksdb::ReadOptions(), meta_cf.get(), key, &stored);
  if (s.IsNotFound()) {
    return absl::NotFoundError(absl::StrCat("spill tier: no segment ", id.ToHex()));
  }
  KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(s, "read metadata"));
  absl::StatusOr<std::string_view> payload = internal::DecodeRecord(
      RecordType::kSegmentMeta, key, std::string_view(stored.data(), stored.size()));
  if (!payload.ok()) {
    checksum_failures.fetch_add(1);
    return payload.status();
  }
  absl::StatusOr<SegmentMeta> meta = internal::DecodeMetaPayload(*payload);
  if (meta.ok() && meta->id != id) {
    return absl::DataLossError(absl::StrCat("spill tier: metadata under ", id.ToHex(),
                                            " names segment ", meta->id.ToHex()));
  }
  return meta;
}

absl::Status RocksSpillTier::Impl::AddBlobPieces(
    rocksdb::WriteBatch* batch, rocksdb::ColumnFamilyHandle* cf, RecordType type,
    absl::Span<const std::byte> blob, const std::function<std::string(uint32_t)>& key_of) {
  const uint64_t piece = options.piece_bytes;
  const uint64_t n = PieceCount(blob.size(), piece);
  for (uint64_t p = 0; p < n; ++p) {
    const size_t off = size_t(p * piece);
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
        PutRecord(batch, cf, type, key_of(uint32_t(p)),
                  blob.subspan(off, std::min<size_t>(piece, blob.size() - off))),
        "put piece"));
  }
  return absl::OkStatus();
}

absl::Status RocksSpillTier::Impl::ReadBlob(rocksdb::ColumnFamilyHandle* cf, RecordType type,
                                            uint64_t bytes, uint64_t piece_bytes,
                                            const std::function<std::string(uint32_t)>& key_of,
                                            absl::Span<std::byte> dst) {
  rocksdb::ReadOptions ro;
  ro.verify_checksums = true;
  ro.fill_cache = false;  // big, read once per page-in
  const uint64_t n = PieceCount(bytes, piece_bytes);
  for (uint64_t p = 0; p < n; ++p) {
    const std::string key = key_of(uint32_t(p));
    rocksdb::PinnableSlice stored;
    rocksdb::Status s = db->Get(ro, cf, key, &stored);
    if (s.IsNotFound()) {
      return absl::DataLossError(absl::StrCat("spill tier: piece ", p, " of ", n, " missing"));
    }
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(s, "read piece"));
    absl::StatusOr<std::string_view> payload =
        internal::DecodeRecord(type, key, std::string_view(stored.data(), stored.size()));
    if (!payload.ok()) {
      checksum_failures.fetch_add(1);
      return payload.status();
    }
    const size_t off = size_t(p * piece_bytes);
    const size_t want = size_t(std::min<uint64_t>(piece_bytes, bytes - off));
    if (payload->size() != want) {
      return absl::DataLossError(absl::StrCat("spill tier: piece ", p, " holds ", payload->size(),
                                              " bytes, expected ", want));
    }
    std::memcpy(dst.data() + off, payload->data(), want);
  }
  bytes_read.fetch_add(bytes);
  return absl::OkStatus();
}

absl::Status RocksSpillTier::Impl::Commit(rocksdb::WriteBatch* batch, Durability durability,
                                          std::string_view what, WriteSync sync) {
  rocksdb::WriteOptions wo;
  if (durability == Durability::kDurable) {
    wo.sync = sync != WriteSync::kLogged;
  } else {
    wo.disableWAL = true;  // dropped at the next open anyway; halves the bytes written
  }
  KVSHADE_RETURN_IF_ERROR(
      CheckSpace(batch->GetDataSize(), durability == Durability::kDurable, false, what));
  MaybeResume();
  rocksdb::Status s = wo.disableWAL ? db->Write(wo, batch) : WriteLogged(wo, batch);
  if (!s.ok()) return WriteFailed(s, what);
  return absl::OkStatus();
}

absl::Status RocksSpillTier::Impl::CheckSpace(uint64_t bytes, bool durable, bool is_delete,
                                              std::string_view what) {
  uint64_t free = 0;
  if (!env->GetFreeSpace(options.path, &free).ok()) return absl::OkStatus();  // RocksDB decides
  uint64_t memtables = 0;
  db->GetAggregatedIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables, &memtables);
  // A delete frees space (after compaction): it only needs room for itself.
  const uint64_t reserve = is_delete ? std::min<uint64_t>(min_free, 1 << 20) : min_free;
  const uint64_t need = (durable ? 2 * bytes : bytes) + (is_delete ? 0 : memtables) + reserve;
  if (free >= need) {
    if (reporter->writes_stopped.load()) {
      reporter->LowSpace(false, absl::StrCat("spill tier at ", options.path, ": ", free,
                                             " bytes free again; writes are accepted"));
    }
    return absl::OkStatus();
  }
  reporter->LowSpace(true, absl::StrCat("spill tier at ", options.path,
                                        ": writes are refused while its file system is short of "
                                        "space (", free, " bytes free, ", reserve,
                                        " kept for RocksDB); reads are still served; writes are "
                                        "accepted again once space is freed"));
  absl::Status st = absl::ResourceExhaustedError(absl::StrCat(
      "spill tier at ", options.path, ": ", std::string(what),
      " refused, nothing of it is stored: No space left on device (", free,
      " bytes free on its file system, ", need, " needed: this write, the memtables and ",
      reserve, " kept free for RocksDB's flushes and compactions)"));
  reporter->WriteFailed(st);
  return st;
}

rocksdb::Status RocksSpillTier::Impl::WriteLogged(const rocksdb::WriteOptions& wo,
                                                  rocksdb::WriteBatch* batch) {
  // The guard: an entry in the default column family's memtable that never reaches the
  // WAL (a tombstone of a key that is never written), so that a resume after a failed
  // write below flushes a memtable and with it switches to a new WAL.
  rocksdb::WriteOptions memtable_only;
  memtable_only.disableWAL = true;
  // Fails, like the write below, when writes are stopped already (nothing reaches the WAL).
  const bool stopped = !db->Delete(memtable_only, default_cf.get(), kWalGuardKey).ok();
  rocksdb::Status s = db->Write(wo, batch);
  if (!s.ok() && !stopped) {
    uint64_t entries = 0;
    for (rocksdb::ColumnFamilyHandle* cf : AllCfs()) {
      uint64_t n = 0;
      if (db->GetIntProperty(cf, rocksdb::DB::Properties::kNumEntriesActiveMemTable, &n)) entries += n;
    }
    if (entries == 0) {
      // A background flush emptied the memtables in between: a resume would re-use the
      // failed WAL writer.
      reporter->NeedsRestart(absl::StrCat("a WAL write failed with empty memtables (",
                                          s.ToString(), ")"));
    }
  }
  return s;
}

void RocksSpillTier::Impl::MaybeResume() {
  if (!reporter->bg_error_active.load() || reporter->resume_unsafe.load()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_resume < std::chrono::milliseconds(options.resume_interval_ms)) return;
  last_resume = now;
  // DB::Resume() flushes every memtable and waits for those flushes. In RocksDB 7.8 it
  // waits forever when a flush job that failed (or gave up, finding writes stopped) left
  // memtables queued: their flush requests then outnumber the flush jobs it schedules. A
  // failed flush job also sleeps a second holding the flush slot. So: only with space back
  // and no flush running, and not past memtables a failed flush left queued (they never
  // flush while writes are stopped: then only a restart helps).
  uint64_t free = 0;
  if (env->GetFreeSpace(options.path, &free).ok() && free < min_free) return;
  uint64_t running = 0;
  if (!db->GetIntProperty(rocksdb::DB::Properties::kNumRunningFlushes, &running) || running > 0) {
    return;
  }
  uint64_t queued = 0;
  db->GetAggregatedIntProperty(rocksdb::DB::Properties::kNumImmutableMemTable, &queued);
  if (queued > 0 && reporter->flush_failed.load()) {
    reporter->NeedsRestart(absl::StrCat(
        queued, " memtable(s) whose flush failed are queued, and RocksDB 7.8 cannot resume past "
                "them; a restart recovers everything acknowledged from the WAL"));
    return;
  }
  // Flushes the memtables to new files and clears the error; fails while the fault lasts,
  // and always for errors above "hard" (EIO: restart the daemon).
  if (db->Resume().ok()) reporter->Cleared();
}

absl::Status RocksSpillTier::Impl::WriteFailed(const rocksdb::Status& s, std::string_view what) {
  absl::Status st = FromRocks(s, what, __FILE__, __LINE__);
  std::string msg = absl::StrCat("spill tier at ", options.path, ": ", std::string(what),
                                 " refused, nothing of it is stored: ", s.ToString());
  if (reporter->resume_unsafe.load()) {
    absl::StrAppend(&msg, " (writes are stopped since an earlier I/O error, until a restart)");
  } else if (reporter->writes_stopped.load()) {
    absl::StrAppend(&msg, " (writes are stopped since an earlier I/O error; each write retries ",
                    "at most every ", options.resume_interval_ms, " ms)");
  }
  st = absl::Status(st.code(), msg);
  reporter->WriteFailed(st);
  return st;
}

void RocksSpillTier::Impl::FlushDurable(std::string_view what) {
  if (!options.flush_durable_writes) return;
  if (reporter->bg_error_active.load()) {
    // A flush now could meet a WAL writer that has failed; the write is in the synced WAL.
    reporter->unflushed_durable_writes.fetch_add(1);
    return;
  }
  rocksdb::FlushOptions fo;
  fo.wait = true;
  fo.allow_write_stall = true;
  rocksdb::Status s = db->Flush(fo, AllCfs());
  if (!s.ok()) {
    reporter->unflushed_durable_writes.fetch_add(1);
    reporter->Emit(SpillEvent::Kind::kBackgroundError, false, absl::StatusCode::kOk,
                   absl::StrCat("spill tier at ", options.path, ": ", std::string(what),
                                " is durable in the synced WAL, but its flush into table files "
                                "failed: ", s.ToString()));
  }
}

RocksSpillTier::RocksSpillTier(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RocksSpillTier::~RocksSpillTier() = default;

absl::StatusOr<std::unique_ptr<RocksSpillTier>> RocksSpillTier::Open(
    const RocksSpillOptions& options) {
  if (options.path.empty()) return absl::InvalidArgumentError("spill tier: path is empty");
  if (options.piece_bytes < 4096 || options.piece_bytes > (size_t{256} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spill tier: piece_bytes must be in [4096, 268435456], got ", options.piece_bytes));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->reporter = std::make_shared<Reporter>(options.path, options.event_sink);
  impl->block_cache = rocksdb::NewLRUCache(std::max<size_t>(options.block_cache_bytes, 1 << 20));

  {
    // Created here rather than by RocksDB, which logs a missing directory as an error.
    std::error_code ec;
    std::filesystem::create_directories(options.path, ec);
  }
  // The WAL, read before RocksDB's recovery replays it up to a damage and deletes it
  // (wal_scan.h): what a damage drops can only be known now.
  std::vector<internal::WalFileScan> wal_scan;
  {
    absl::StatusOr<std::vector<internal::WalFileScan>> scanned = internal::ScanWalFiles(options.path);
    if (!scanned.ok()) {
      return absl::Status(scanned.status().code(),
                          absl::StrCat("spill tier at ", options.path, ": ", scanned.status().message()));
    }
    wal_scan = *std::move(scanned);
  }
  for (const internal::WalFileScan& f : wal_scan) {
    if (!f.damaged) continue;
    if (options.on_damage == DamagePolicy::kRefuse) {
      return absl::DataLossError(absl::StrCat(
          "spill tier at ", options.path, ": the write-ahead log ", f.path, " is damaged at byte ",
          f.damage_offset, " of ", f.bytes, " (", f.damage_reason,
          "); the start is refused (on_damage: refuse) and nothing was changed. Either restore "
          "the spill directory from a backup, or start with on_damage serve_rest: the log is "
          "then replayed up to the damage, every write after it is dropped, and the sessions "
          "that lose acknowledged data are reported damaged (GetSession)"));
    }
    // Kept for inspection: RocksDB deletes the WAL once it has recovered from it.
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(options.path) / "quarantine";
    std::filesystem::create_directories(dir, ec);
    const std::filesystem::path copy =
        dir / absl::StrCat(std::filesystem::path(f.path).filename().string(), ".damaged-",
                           std::chrono::duration_cast<std::chrono::seconds>(
                               std::chrono::system_clock::now().time_since_epoch()).count());
    if (!ec) std::filesystem::copy_file(f.path, copy, ec);
    if (!ec) impl->damage.kept_files.push_back(copy.string());
  }
  rocksdb::DBOptions dbo;
  dbo.create_if_missing = true;
  dbo.create_missing_column_families = true;
  // A failed write stops RocksDB's writes (a background error) instead of letting the
  // next one re-use the WAL writer that failed; RocksDB's checks on open stay on too.
  dbo.paranoid_checks = true;
  dbo.max_background_jobs = 2;
  dbo.max_total_wal_size = uint64_t{256} << 20;
  dbo.bytes_per_sync = 1 << 20;
  // RocksDB's log goes to the event sink: a log file on the spill disk aborted the
  // process when the disk filled (see the top of this file). INFO while opening (the
  // point-in-time recovery report), WARN afterwards.
  auto logger = std::make_shared<SinkLogger>(impl->reporter);
  dbo.info_log = logger;
  dbo.info_log_level = rocksdb::InfoLogLevel::INFO_LEVEL;
  dbo.listeners.push_back(std::make_shared<ErrorListener>(impl->reporter));
  dbo.max_bgerror_resume_count = 0;  // the next write resumes instead (MaybeResume)
  // WAL recovery (README.md "WAL recovery"): replay up to the first damaged record and
  // stop there, the database as of that point in time; what was dropped is reported.
  dbo.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
  // atomic_flush stays off: in RocksDB 7.8 a failed atomic flush is not rolled back and the
  // next DB::Resume() waits for it forever (fixed upstream in rocksdb PR 11872).
  if (options.disk_faults) {
    impl->fault_env = rocksdb::NewCompositeEnv(
        std::make_shared<FaultyFileSystem>(rocksdb::FileSystem::Default(), options.disk_faults));
    dbo.env = impl->fault_env.get();
  }
  impl->env = dbo.env;
  impl->min_free = options.min_free_bytes;
  if (impl->min_free == 0) {
    struct statvfs fs;
    const uint64_t size =
        statvfs(options.path.c_str(), &fs) == 0 ? uint64_t(fs.f_blocks) * fs.f_frsize : 0;
    impl->min_free = std::clamp<uint64_t>(size / 20, 1 << 20, 256 << 20);
  }

  auto table_options = [&](bool cache_data) {
    rocksdb::BlockBasedTableOptions t;
    t.checksum = rocksdb::kXXH3;
    t.block_cache = impl->block_cache;
    t.no_block_cache = !cache_data;
    return std::shared_ptr<rocksdb::TableFactory>(rocksdb::NewBlockBasedTableFactory(t));
  };
  rocksdb::ColumnFamilyOptions default_opts;
  default_opts.table_factory = table_options(true);
  rocksdb::ColumnFamilyOptions meta_opts;
  meta_opts.table_factory = table_options(true);
  meta_opts.compression = PickCompression(options.metadata_compression, rocksdb::kZSTD);
  meta_opts.write_buffer_size = 8 << 20;
  rocksdb::ColumnFamilyOptions factor_opts;
  factor_opts.table_factory = table_options(false);
  factor_opts.compression = PickCompression(options.factors_compression, rocksdb::kZSTD);
  factor_opts.write_buffer_size = options.write_buffer_bytes;
  rocksdb::ColumnFamilyOptions value_opts;
  value_opts.table_factory = table_options(false);
  value_opts.compression = PickCompression(options.values_compression, rocksdb::kNoCompression);
  value_opts.write_buffer_size = options.write_buffer_bytes;
  if (options.values_in_blob_files) {
    value_opts.enable_blob_files = true;
    value_opts.min_blob_size = 4096;
    value_opts.blob_compression_type = value_opts.compression;
    value_opts.enable_blob_garbage_collection = true;
  }
  // No compaction until the open's scans are done: one that meets a damaged block first
  // stops RocksDB's writes and races the scans that find and record the damage.
  for (rocksdb::ColumnFamilyOptions* c : {&default_opts, &meta_opts, &factor_opts, &value_opts}) {
    c->disable_auto_compactions = true;
  }
  std::vector<rocksdb::ColumnFamilyDescriptor> cfs = {
      {rocksdb::kDefaultColumnFamilyName, default_opts},
      {"metadata", meta_opts},
      {"factors", factor_opts},
      {"values", value_opts},
  };
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  if (options.repair) {
    // RocksDB's RepairDB (an explicit request): rebuilds the MANIFEST from the table files
    // it can read, drops what it cannot. Reported; the open below then reads the result.
    impl->reporter->Emit(SpillEvent::Kind::kCorruptRecord, true, absl::StatusCode::kDataLoss,
                         absl::StrCat("spill tier at ", options.path, ": repairing the database "
                                      "(RocksDB RepairDB, asked for by the repair option); what "
                                      "cannot be read is dropped"));
    rocksdb::Status rs = rocksdb::RepairDB(options.path, dbo, cfs);
    if (!rs.ok()) {
      impl->reporter->OpenDone();
      return absl::DataLossError(absl::StrCat("spill tier at ", options.path,
                                              ": RocksDB's repair failed: ", rs.ToString()));
    }
  }
  rocksdb::Status s = rocksdb::DB::Open(dbo, options.path, cfs, &handles, &raw);
  if (s.IsCorruption() && options.on_damage == DamagePolicy::kServeRest &&
      s.ToString().find("MANIFEST") == std::string::npos &&
      s.ToString().find("CURRENT") == std::string::npos) {
    // A table file RocksDB cannot open (its footer, index or properties block damaged):
    // with paranoid checks the whole open fails. Opened without them, the file's keys fail
    // where they are read, and the scans below take only the segments there.
    impl->damage.table_report = absl::StrCat(
        "a table file could not be opened (", s.ToString(), "); the tier runs without RocksDB's "
        "paranoid checks until the next start, and the segments with records in that file are "
        "not served");
    impl->reporter->Emit(SpillEvent::Kind::kCorruptRecord, true, absl::StatusCode::kDataLoss,
                         absl::StrCat("spill tier at ", options.path, ": ", impl->damage.table_report));
    dbo.paranoid_checks = false;
    handles.clear();
    s = rocksdb::DB::Open(dbo, options.path, cfs, &handles, &raw);
  }
  if (!s.ok()) {
    impl->reporter->OpenDone();  // reports a damaged WAL that failed the open too
    std::string what = "its files";
    const std::string msg = s.ToString();
    for (const char* name : {"MANIFEST", "CURRENT", "OPTIONS", ".sst", ".log"}) {
      if (msg.find(name) != std::string::npos) {
        what = absl::StrCat("a file named in the error (", name, ")");
        break;
      }
    }
    if (s.IsCorruption()) {
      return absl::DataLossError(absl::StrCat(
          "spill tier at ", options.path, ": RocksDB cannot open the database: ", msg, ". ",
          what, " is damaged. Recovery: restore the spill directory from a backup; or start once "
          "with the repair option (--spill-repair), which runs RocksDB's RepairDB: it rebuilds the "
          "MANIFEST from the table files it can read and drops what it cannot (sessions whose "
          "records are dropped are gone, the others are served)"));
    }
    return KVSHADE_ROCKS(s, absl::StrCat("open ", options.path));
  }
  impl->db.reset(raw);
  CfDeleter del{raw};
  impl->default_cf = CfHandle(handles[0], del);
  impl->meta_cf = CfHandle(handles[1], del);
  impl->factors_cf = CfHandle(handles[2], del);
  impl->values_cf = CfHandle(handles[3], del);

  impl->reporter->OpenDone();
  logger->SetThreshold(rocksdb::InfoLogLevel::WARN_LEVEL);

  // What the recovery dropped: RocksDB names the WAL file it stopped in; the scan knows
  // what that file held after its damage, and what every later file held (point-in-time
  // recovery replays none of it). A file RocksDB stopped in that the scan found intact
  // ended in a torn write (a crash), which was never acknowledged.
  if (impl->reporter->wal_damage_at_open.load() > 0) {
    const std::vector<uint64_t> named = impl->reporter->DamagedWals();
    uint64_t from = named.empty() ? 0 : named.front();
    if (named.empty()) {
      for (const internal::WalFileScan& f : wal_scan) {
        if (f.damaged) {
          from = f.number;
          break;
        }
      }
    }
    SpillDamage& d = impl->damage;
    std::vector<std::string> parts;
    for (const internal::WalFileScan& f : wal_scan) {
      if (f.number < from) continue;
      if (f.number == from) {
        if (!f.damaged) continue;
        d.wal_damaged = true;
        d.wal_dropped.insert(d.wal_dropped.end(), f.after_damage.begin(), f.after_damage.end());
        d.wal_unidentified += f.unidentified_batches;
        parts.push_back(absl::StrCat(f.path, " damaged at byte ", f.damage_offset, " of ", f.bytes,
                                     " (", f.damage_reason, ")"));
      } else if (!f.all.empty() || f.unreadable_batches > 0) {
        d.wal_damaged = true;
        d.wal_dropped.insert(d.wal_dropped.end(), f.all.begin(), f.all.end());
        d.wal_unidentified += f.unreadable_batches;
        parts.push_back(absl::StrCat(f.path, " (after the damage) dropped whole"));
      }
    }
    if (d.wal_damaged) {
      d.wal_report = absl::StrCat(absl::StrJoin(parts, "; "), ": ", d.wal_dropped.size(),
                                  " readable record(s) and ", d.wal_unidentified,
                                  " unreadable write(s) dropped");
      if (!d.kept_files.empty()) {
        absl::StrAppend(&d.wal_report, "; copies kept: ", absl::StrJoin(d.kept_files, ", "));
      }
    }
  }

  KVSHADE_RETURN_IF_ERROR(impl->CheckFormat());
  // The metadata column family's table files are small and hold what names every segment
  // and session: each is verified whole (block checksums). A merged iterator does not
  // always read a damaged block of a small level-0 file, and a record lost there unseen
  // would be a session missing without a report. A damaged file's whole key range is
  // unreadable.
  {
    std::vector<rocksdb::LiveFileMetaData> files;
    impl->db->GetLiveFilesMetaData(&files);
    for (const rocksdb::LiveFileMetaData& f : files) {
      if (f.column_family_name != "metadata") continue;
      rocksdb::Options so;
      so.env = dbo.env;
      rocksdb::SstFileReader reader(so);
      const std::string file = f.db_path + f.name;
      rocksdb::Status vs = reader.Open(file);
      if (vs.ok()) vs = reader.VerifyChecksum();
      if (vs.ok()) continue;
      if (!vs.IsCorruption()) return KVSHADE_ROCKS(vs, absl::StrCat("verify ", file));
      impl->AddUnreadable({"metadata", f.smallestkey, f.largestkey, /*inclusive=*/true}, vs);
    }
  }
  if (options.drop_cache_segments_on_open) {
    if (absl::Status st = impl->DropCacheSegments(); !st.ok()) {
      // I/O (e.g. a full disk): the leftovers are never listed as durable and go at a later
      // open; the tier itself is usable.
      if (!absl::IsUnavailable(st) && !absl::IsResourceExhausted(st)) return st;
      impl->reporter->Emit(SpillEvent::Kind::kBackgroundError, false, st.code(),
                           absl::StrCat("spill tier at ", options.path,
                                        ": could not drop the previous process's cache segments "
                                        "(they go at a later open): ", st.message()));
    }
  }
  if (options.on_damage == DamagePolicy::kRefuse) {
    // Table damage is found by reading (the scans above, ListSegments): refused as well.
    KVSHADE_RETURN_IF_ERROR(impl->RefuseIfDamaged());
  }
  for (rocksdb::ColumnFamilyHandle* cf : impl->AllCfs()) {
    impl->db->SetOptions(cf, {{"disable_auto_compactions", "false"}}).PermitUncheckedError();
  }
  return std::unique_ptr<RocksSpillTier>(new RocksSpillTier(std::move(impl)));
}

absl::Status RocksSpillTier::WriteSegment(const SegmentWrite& seg) {
  const SegmentValueLayout& l = seg.layout;
  // Validate against a freshly derived layout, so that chunk sizes cannot be forged.
  KVSHADE_ASSIGN_OR_RETURN(SegmentValueLayout check,
                           SegmentValueLayout::Make(l.n_layers, l.h, l.n_chunks, l.C, l.d, l.codec));
  if (!(check == l)) return absl::InvalidArgumentError("WriteSegment: inconsistent layout sizes");
  if (seg.values.size() != size_t(l.n_layers) && !(seg.values.empty() && l.layer_bytes() == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("WriteSegment: values has ", seg.values.size(),
                                                   " layers, layout has ", l.n_layers));
  }
  for (size_t i = 0; i < seg.values.size(); ++i) {
    if (seg.values[i].size() != l.layer_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSegment: values[", i, "] has ",
                                                     seg.values[i].size(), " bytes, expected ",
                                                     l.layer_bytes()));
    }
  }
  SegmentMeta meta;
  meta.id = seg.id;
  meta.layout = l;
  meta.durability = seg.durability;
  meta.piece_bytes = impl_->options.piece_bytes;
  meta.commit_unix_micros = uint64_t(std::chrono::duration_cast<std::chrono::microseconds>(
                                         std::chrono::system_clock::now().time_since_epoch())
                                         .count());
  meta.user_metadata = std::string(seg.user_metadata);
  for (const FactorBlob& f : seg.factors) {
    if (f.layer < 0 || f.layer >= l.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSegment: factor layer ", f.layer,
                                                     " outside [0, ", l.n_layers, ")"));
    }
    if (!IsValidFactorKind(uint8_t(f.kind))) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSegment: bad factor kind ", int(f.kind)));
    }
    if (meta.FindFactor(f.layer, f.kind) != nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("WriteSegment: factor (", f.layer, ", ",
                                                     std::string(FactorKindName(f.kind)),
                                                     ") given twice"));
    }
    meta.factors.push_back({f.layer, f.kind, f.bytes.size()});
  }
  const std::string meta_payload = internal::EncodeMetaPayload(meta);

  Impl& im = *impl_;
  base::MutexLock lock(&im.write_mu);
  {
    rocksdb::PinnableSlice existing;
    rocksdb::Status s =
        im.db->Get(rocksdb::ReadOptions(), im.meta_cf.get(), internal::MetaKey(seg.id), &existing);
    if (s.ok()) {
      return absl::AlreadyExistsError(absl::StrCat("spill tier: segment ", seg.id.ToHex(),
                                                   " is already stored"));
    }
    if (!s.IsNotFound()) return KVSHADE_ROCKS(s, "read metadata");
  }
  // Pieces go in batches of about max_batch_bytes; when everything fits in one, the
  // metadata joins it (one atomic batch), otherwise it commits alone after the pieces.
  const uint64_t total = l.total_bytes() + [&] {
    uint64_t t = 0;
    for (const FactorBlob& f : seg.factors) t += f.bytes.size();
    return t;
  }();
  const uint64_t max_batch = std::max<uint64_t>(im.options.max_batch_bytes, im.options.piece_bytes);
  rocksdb::WriteBatch batch;
  uint64_t batch_bytes = 0;
  auto maybe_flush = [&](uint64_t added) -> absl::Status {
    batch_bytes += added;
    if (total <= max_batch || batch_bytes < max_batch) return absl::OkStatus();
    KVSHADE_RETURN_IF_ERROR(im.Commit(&batch, seg.durability, "stage pieces", seg.sync));
    if (im.options.sync_point) im.options.sync_point("stage");
    batch.Clear();
    batch_bytes = 0;
    return absl::OkStatus();
  };
  for (size_t layer = 0; layer < seg.values.size(); ++layer) {
    const uint64_t n = PieceCount(seg.values[layer].size(), im.options.piece_bytes);
    for (uint64_t p = 0; p < n; ++p) {
      const size_t off = size_t(p * im.options.piece_bytes);
      auto piece = seg.values[layer].subspan(
          off, std::min<size_t>(im.options.piece_bytes, seg.values[layer].size() - off));
      KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
          PutRecord(&batch, im.values_cf.get(), RecordType::kValuePiece,
                    internal::ValuePieceKey(seg.id, uint32_t(layer), uint32_t(p)), piece),
          "put value piece"));
      KVSHADE_RETURN_IF_ERROR(maybe_flush(piece.size()));
    }
  }
  for (const FactorBlob& f : seg.factors) {
    const uint64_t n = PieceCount(f.bytes.size(), im.options.piece_bytes);
    for (uint64_t p = 0; p < n; ++p) {
      const size_t off = size_t(p * im.options.piece_bytes);
      auto piece = f.bytes.subspan(off, std::min<size_t>(im.options.piece_bytes, f.bytes.size() - off));
      KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
          PutRecord(&batch, im.factors_cf.get(), RecordType::kFactorPiece,
                    internal::FactorPieceKey(seg.id, uint32_t(f.layer), f.kind, uint32_t(p)), piece),
          "put factor piece"));
      KVSHADE_RETURN_IF_ERROR(maybe_flush(piece.size()));
    }
  }
  const std::string meta_key = internal::MetaKey(seg.id);
  KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(PutRecord(&batch, im.meta_cf.get(), RecordType::kSegmentMeta,
                                                  meta_key, internal::AsBytes(meta_payload)),
                                        "put metadata"));
  if (im.options.sync_point) im.options.sync_point("commit");
  KVSHADE_RETURN_IF_ERROR(im.Commit(&batch, seg.durability, "commit segment", seg.sync));
  if (seg.durability == Durability::kDurable && seg.sync == WriteSync::kFlushed) {
    im.FlushDurable("a durable segment");
  }
  im.segments_written.fetch_add(1);
  im.bytes_written.fetch_add(total + meta_payload.size());
  return absl::OkStatus();
}

absl::Status RocksSpillTier::AddFactors(const SegmentId& id, absl::Span<const FactorBlob> factors) {
  Impl& im = *impl_;
  base::MutexLock lock(&im.write_mu);
  KVSHADE_ASSIGN_OR_RETURN(SegmentMeta meta, im.ReadMetaLocked(id));
  uint64_t total = 0;
  for (const FactorBlob& f : factors) {
    if (f.layer < 0 || f.layer >= meta.layout.n_layers) {
      return absl::InvalidArgumentError(absl::StrCat("AddFactors: factor layer ", f.layer,
                                                     " outside [0, ", meta.layout.n_layers, ")"));
    }
    if (!IsValidFactorKind(uint8_t(f.kind))) {
      return absl::InvalidArgumentError(absl::StrCat("AddFactors: bad factor kind ", int(f.kind)));
    }
    if (meta.FindFactor(f.layer, f.kind) != nullptr) {
      return absl::AlreadyExistsError(absl::StrCat("AddFactors: factor (", f.layer, ", ",
                                                   std::string(FactorKindName(f.kind)),
                                                   ") of segment ", id.ToHex(), " is already stored"));
    }
    meta.factors.push_back({f.layer, f.kind, f.bytes.size()});
    total += f.bytes.size();
  }
  rocksdb::WriteBatch batch;
  for (const FactorBlob& f : factors) {
    const uint64_t n = PieceCount(f.bytes.size(), meta.piece_bytes);
    for (uint64_t p = 0; p < n; ++p) {
      const size_t off = size_t(p * meta.piece_bytes);
      auto piece = f.bytes.subspan(off, std::min<size_t>(meta.piece_bytes, f.bytes.size() - off));
      KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
          PutRecord(&batch, im.factors_cf.get(), RecordType::kFactorPiece,
                    internal::FactorPieceKey(id, uint32_t(f.layer), f.kind, uint32_t(p)), piece),
          "put factor piece"));
    }
  }
  const std::string payload = internal::EncodeMetaPayload(meta);
  KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(PutRecord(&batch, im.meta_cf.get(), RecordType::kSegmentMeta,
                                                  internal::MetaKey(id), internal::AsBytes(payload)),
                                        "put metadata"));
  KVSHADE_RETURN_IF_ERROR(im.Commit(&batch, meta.durability, "add factors"));
  if (meta.durability == Durability::kDurable) im.FlushDurable("durable factors");
  im.bytes_written.fetch_add(total + payload.size());
  return absl::OkStatus();
}

absl::StatusOr<SegmentMeta> RocksSpillTier::ReadMeta(const SegmentId& id) {
  return impl_->ReadMetaLocked(id);
}

absl::Status RocksSpillTier::ReadValues(const SegmentId& id, int layer, absl::Span<std::byte> dst) {
  KVSHADE_ASSIGN_OR_RETURN(SegmentMeta meta, impl_->ReadMetaLocked(id));
  if (layer < 0 || layer >= meta.layout.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("ReadValues: layer ", layer, " outside [0, ",
                                                   meta.layout.n_layers, ")"));
  }
  if (dst.size() != meta.layout.layer_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("ReadValues: dst has ", dst.size(),
                                                   " bytes, the layer has ",
                                                   meta.layout.layer_bytes()));
  }
  return impl_->ReadBlob(
      impl_->values_cf.get(), RecordType::kValuePiece, dst.size(), meta.piece_bytes,
      [&](uint32_t p) { return internal::ValuePieceKey(id, uint32_t(layer), p); }, dst);
}

absl::Status RocksSpillTier::ReadFactor(const SegmentId& id, int layer, FactorKind kind,
                                        absl::Span<std::byte> dst) {
  KVSHADE_ASSIGN_OR_RETURN(SegmentMeta meta, impl_->ReadMetaLocked(id));
  const SegmentMeta::Factor* f = meta.FindFactor(layer, kind);
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat("spill tier: segment ", id.ToHex(), " has no factor (",
                                            layer, ", ", std::string(FactorKindName(kind)), ")"));
  }
  if (dst.size() != f->bytes) {
    return absl::InvalidArgumentError(absl::StrCat("ReadFactor: dst has ", dst.size(),
                                                   " bytes, the factor has ", f->bytes));
  }
  return impl_->ReadBlob(
      impl_->factors_cf.get(), RecordType::kFactorPiece, f->bytes, meta.piece_bytes,
      [&](uint32_t p) { return internal::FactorPieceKey(id, uint32_t(layer), kind, p); }, dst);
}

absl::StatusOr<Durability> RocksSpillTier::Impl::AddDelete(const SegmentId& id,
                                                          rocksdb::WriteBatch* batch) {
  absl::StatusOr<SegmentMeta> meta = ReadMetaLocked(id);
  if (absl::IsNotFound(meta.status())) return meta.status();
  Durability durability = Durability::kDurable;
  if (meta.ok()) {
    durability = meta->durability;
    const uint64_t n = PieceCount(meta->layout.layer_bytes(), meta->piece_bytes);
    for (int layer = 0; layer < meta->layout.n_layers; ++layer) {
      for (uint64_t p = 0; p < n; ++p) {
        KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
            batch->Delete(values_cf.get(), internal::ValuePieceKey(id, layer, uint32_t(p))),
            "delete"));
      }
    }
    for (const SegmentMeta::Factor& f : meta->factors) {
      for (uint64_t p = 0; p < PieceCount(f.bytes, meta->piece_bytes); ++p) {
        KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
            batch->Delete(factors_cf.get(),
                          internal::FactorPieceKey(id, uint32_t(f.layer), f.kind, uint32_t(p))),
            "delete"));
      }
    }
  } else {
    // Damaged metadata: remove every record of the segment.
    for (rocksdb::ColumnFamilyHandle* cf : {values_cf.get(), factors_cf.get()}) {
      KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(
          batch->DeleteRange(cf, internal::SegmentPrefix(id), internal::SegmentUpperBound(id)),
          "delete range"));
    }
  }
  KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(batch->Delete(meta_cf.get(), internal::MetaKey(id)), "delete"));
  return durability;
}

absl::Status RocksSpillTier::DeleteSegment(const SegmentId& id) {
  return DeleteSegments(absl::MakeConstSpan(&id, 1));
}

absl::Status RocksSpillTier::DeleteSegments(absl::Span<const SegmentId> ids) {
  Impl& im = *impl_;
  base::MutexLock lock(&im.write_mu);
  rocksdb::WriteBatch batch;
  bool durable = false;
  uint64_t deleted = 0;
  for (const SegmentId& id : ids) {
    absl::StatusOr<Durability> d = im.AddDelete(id, &batch);
    if (absl::IsNotFound(d.status())) continue;
    if (!d.ok()) return d.status();
    durable = durable || *d == Durability::kDurable;
    ++deleted;
  }
  if (deleted == 0) return absl::OkStatus();
  // Deletes always go through the log (a cache segment's pieces may already be in SST files).
  rocksdb::WriteOptions wo;
  wo.sync = durable;
  KVSHADE_RETURN_IF_ERROR(im.CheckSpace(batch.GetDataSize(), false, true, "delete segment"));
  im.MaybeResume();
  if (rocksdb::Status s = im.WriteLogged(wo, &batch); !s.ok()) {
    return im.WriteFailed(s, "delete segment");
  }
  if (durable) im.FlushDurable("a durable delete");
  im.segments_deleted.fetch_add(deleted);
  return absl::OkStatus();
}

absl::Status RocksSpillTier::SyncWal() {
  Impl& im = *impl_;
  rocksdb::Status s = im.db->SyncWAL();
  if (!s.ok()) return im.WriteFailed(s, "sync WAL");
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SegmentMeta>> RocksSpillTier::ListSegments() {
  Impl& im = *impl_;
  std::vector<SegmentMeta> out;
  // A range that cannot be read is skipped and recorded (Damage()), not an error.
  KVSHADE_RETURN_IF_ERROR(im.ScanTolerant(im.meta_cf.get(), "metadata", [&](rocksdb::Iterator* it) {
    const std::string_view key(it->key().data(), it->key().size());
    absl::StatusOr<std::string_view> payload = internal::DecodeRecord(
        RecordType::kSegmentMeta, key, std::string_view(it->value().data(), it->value().size()));
    absl::StatusOr<SegmentMeta> meta =
        payload.ok() ? internal::DecodeMetaPayload(*payload) : payload.status();
    if (!meta.ok()) {
      im.checksum_failures.fetch_add(1);  // never listed; CheckConsistency reports it
      SegmentId id;
      const bool named = internal::SegmentIdOfKey(key, &id);
      im.reporter->Emit(SpillEvent::Kind::kCorruptRecord, true, meta.status().code(),
                        absl::StrCat("spill tier at ", im.options.path, ": the metadata of segment ",
                                     named ? id.ToHex() : std::string("(unreadable key)"),
                                     " is damaged; the segment is not listed (and so not "
                                     "restored): ", meta.status().message()));
      if (named) {
        std::lock_guard<std::mutex> lock(im.damage_mu);
        auto& d = im.damage.damaged_meta;
        if (std::find(d.begin(), d.end(), id) == d.end()) d.push_back(id);
      }
      it->Next();
      return absl::OkStatus();
    }
    out.push_back(std::move(meta).value());
    it->Next();
    return absl::OkStatus();
  }));
  return out;
}

SpillDamage RocksSpillTier::Damage() const {
  std::lock_guard<std::mutex> lock(impl_->damage_mu);
  return impl_->damage;
}

SpillStats RocksSpillTier::Stats() const {
  SpillStats s;
  s.segments_written = impl_->segments_written.load();
  s.bytes_written = impl_->bytes_written.load();
  s.bytes_read = impl_->bytes_read.load();
  s.segments_deleted = impl_->segments_deleted.load();
  s.checksum_failures = impl_->checksum_failures.load();
  const Reporter& r = *impl_->reporter;
  s.write_failures = r.write_failures.load();
  s.no_space_failures = r.no_space_failures.load();
  s.background_errors = r.background_errors.load();
  s.resumes = r.resumes.load();
  s.writes_stopped = r.writes_stopped.load();
  s.unflushed_durable_writes = r.unflushed_durable_writes.load();
  s.wal_damage_at_open = r.wal_damage_at_open.load();
  s.wal_bytes_dropped_at_open = r.wal_bytes_dropped_at_open.load();
  return s;
}

absl::Status RocksSpillTier::Flush() {
  Impl& im = *impl_;
  base::MutexLock lock(&im.write_mu);
  KVSHADE_RETURN_IF_ERROR(im.CheckSpace(0, false, false, "flush"));
  im.MaybeResume();
  if (im.reporter->bg_error_active.load()) {
    // Never flush past an active error (see the top of this file): report it instead.
    return im.WriteFailed(im.reporter->LastBackgroundError(), "flush");
  }
  rocksdb::FlushOptions fo;
  fo.wait = true;
  rocksdb::Status s = im.db->Flush(fo, im.AllCfs());
  if (!s.ok()) return im.WriteFailed(s, "flush");
  return absl::OkStatus();
}

bool RocksSpillTier::WaitForBackgroundWork(uint32_t timeout_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    uint64_t busy = 0;
    for (const rocksdb::Slice property :
         {rocksdb::DB::Properties::kNumRunningFlushes, rocksdb::DB::Properties::kNumRunningCompactions,
          rocksdb::DB::Properties::kMemTableFlushPending, rocksdb::DB::Properties::kCompactionPending}) {
      uint64_t n = 0;
      if (impl_->db->GetAggregatedIntProperty(property, &n)) busy += n;
    }
    if (busy == 0) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

uint64_t RocksSpillTier::dropped_on_open() const { return impl_->dropped_on_open; }

absl::StatusOr<ConsistencyReport> RocksSpillTier::CheckConsistency() {
  Impl& im = *impl_;
  ConsistencyReport r;
  absl::flat_hash_map<SegmentId, SegmentMeta> metas;
  absl::flat_hash_map<SegmentId, uint64_t> pieces_seen;
  {
    std::unique_ptr<rocksdb::Iterator> it(im.db->NewIterator(rocksdb::ReadOptions(), im.meta_cf.get()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::string_view key(it->key().data(), it->key().size());
      absl::StatusOr<std::string_view> payload = internal::DecodeRecord(
          RecordType::kSegmentMeta, key, std::string_view(it->value().data(), it->value().size()));
      absl::StatusOr<SegmentMeta> meta =
          payload.ok() ? internal::DecodeMetaPayload(*payload) : payload.status();
      if (!meta.ok()) {
        ++r.bad_records;
        continue;
      }
      ++r.segments;
      if (meta->durability == Durability::kDurable) ++r.durable_segments;
      metas.emplace(meta->id, std::move(meta).value());
    }
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(it->status(), "scan metadata"));
  }
  absl::flat_hash_set<SegmentId> damaged;
  for (int pass = 0; pass < 2; ++pass) {
    const bool values = pass == 0;
    std::unique_ptr<rocksdb::Iterator> it(im.db->NewIterator(
        rocksdb::ReadOptions(), values ? im.values_cf.get() : im.factors_cf.get()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const std::string_view key(it->key().data(), it->key().size());
      internal::PieceKeyParts parts;
      const bool parsed = values ? internal::ParseValuePieceKey(key, &parts)
                                 : internal::ParseFactorPieceKey(key, &parts);
      if (!parsed) {
        ++r.bad_records;
        continue;
      }
      (values ? r.value_pieces : r.factor_pieces) += 1;
      auto m = metas.find(parts.id);
      if (m == metas.end()) {
        ++r.orphan_pieces;
        continue;
      }
      absl::StatusOr<std::string_view> payload = internal::DecodeRecord(
          values ? RecordType::kValuePiece : RecordType::kFactorPiece, key,
          std::string_view(it->value().data(), it->value().size()));
      const SegmentMeta& meta = m->second;
      uint64_t blob_bytes = 0;
      bool known = parts.layer < uint32_t(meta.layout.n_layers);
      if (known && values) {
        blob_bytes = meta.layout.layer_bytes();
      } else if (known) {
        const SegmentMeta::Factor* f = meta.FindFactor(int(parts.layer), parts.kind);
        known = f != nullptr;
        if (f) blob_bytes = f->bytes;
      }
      const uint64_t n = PieceCount(blob_bytes, meta.piece_bytes);
      if (!payload.ok() || !known || parts.piece >= n ||
          payload->size() != std::min<uint64_t>(meta.piece_bytes,
                                                blob_bytes - uint64_t(parts.piece) * meta.piece_bytes)) {
        ++r.bad_records;
        damaged.insert(parts.id);
        continue;
      }
      pieces_seen[parts.id] += 1;
    }
    KVSHADE_RETURN_IF_ERROR(KVSHADE_ROCKS(it->status(), "scan pieces"));
  }
  for (const auto& [id, meta] : metas) {
    uint64_t want = uint64_t(meta.layout.n_layers) * PieceCount(meta.layout.layer_bytes(), meta.piece_bytes);
    for (const SegmentMeta::Factor& f : meta.factors) want += PieceCount(f.bytes, meta.piece_bytes);
    auto seen = pieces_seen.find(id);
    const uint64_t got = seen == pieces_seen.end() ? 0 : seen->second;
    if (got != want || damaged.contains(id)) ++r.incomplete_segments;
  }
  return r;
}

absl::Status VerifySegment(SpillTier& tier, const SegmentId& id) {
  KVSHADE_ASSIGN_OR_RETURN(SegmentMeta meta, tier.ReadMeta(id));
  std::vector<std::byte> buf(meta.layout.layer_bytes());
  for (int layer = 0; layer < meta.layout.n_layers; ++layer) {
    KVSHADE_RETURN_IF_ERROR(tier.ReadValues(id, layer, absl::MakeSpan(buf)));
  }
  for (const SegmentMeta::Factor& f : meta.factors) {
    std::vector<std::byte> fb(f.bytes);
    KVSHADE_RETURN_IF_ERROR(tier.ReadFactor(id, f.layer, f.kind, absl::MakeSpan(fb)));
  }
  return absl::OkStatus();
}

}  // namespace kvshade::storage

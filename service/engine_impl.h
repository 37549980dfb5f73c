// EngineImpl: the state and work behind Engine (engine.h), one file per job:
//   engine.cc       set-up, device memory, the Engine shell
//   sessions.cc     create, fork, lookup, get, list, close
//   prefixes.cc     the prefix index: registration, reuse matching, eviction
//   attachments.cc  attach, detach, slot geometry; slot_table.cc: slot tables read back
//   views.cc        a select's working set: pinned values, layer views, static caches
//   ingest.cc       the ingest streams; append.cc, append_log.cc: appended tokens
//   select.cc       select-and-reconstruct, attend, static sets; delivery.cc: where the
//                   reconstructed rows go
//   export.cc       same-node export; peer_memory.cc: workers' CUDA IPC memory
//   durable.cc      durable records and their restore; damage.cc: damaged sessions
//   refactor.cc     background refactorization
//   upkeep.cc       stats, gauges, drain, idle expiry, the background loop
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/base/sync.h"
#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/shared_memory.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/kv_events.h"
#include "kvshade/service/session.h"
#include "kvshade/service/session_manager.h"
#include "kvshade/storage/device_arena.h"
#include "kvshade/storage/host_value_store.h"
#include "kvshade/storage/prefix_index.h"
#include "kvshade/storage/spill_tier.h"
#include "kvshade/storage/staging_pool.h"

namespace kvshade::service {

struct StoreLink {
  storage::HostValueStore* store = nullptr;
  std::atomic<bool> keep{false};  // engine shutting down: leave values where they are
};

// Times a stage into Metrics::ObserveStage on destruction.
class StageTimer {
 public:
  StageTimer(Metrics* m, std::string_view stage);
  ~StageTimer();

 private:
  Metrics* m_;
  std::string_view stage_;
  int64_t start_ns_;
};

// DELIVERY_MODE_CUDA_IPC: a worker's K and V slot buffers (v1.CudaIpcSlotBuffers) mapped
// into this process for as long as its attachment lives.
struct PeerSlots {
  static absl::StatusOr<std::shared_ptr<PeerSlots>> Open(kernels::DeviceRuntime& backend,
                                                         const v1::CudaIpcSlotBuffers& b,
                                                         uint64_t need_bytes);
  ~PeerSlots();
  kernels::DeviceRuntime* backend = nullptr;
  std::vector<kernels::PeerBuffer> maps;  // one per distinct handle
  kernels::bf16* k = nullptr;             // [L, h, slots_per_head, C, d]
  kernels::bf16* v = nullptr;
};

// A session's layer as the decode kernels read it, with the value pins that keep it valid.
struct LayerViewHold {
  kernels::SessionLayerView view;
  std::vector<storage::SegmentPin> pins;
  int total_chunks = 0;
};

// Same-node export (export.cc): the memory one generation keeps alive.
struct ExportGeneration {
  uint64_t generation = 0;
  std::vector<std::shared_ptr<const Segment>> segments;
  std::vector<storage::SegmentPin> pins;
  std::vector<DeviceBlock> copies;
  std::vector<std::shared_ptr<const DeviceBlock>> shared;  // the static-set and tail caches
};

struct AttachmentExports {
  std::weak_ptr<Attachment> attachment;
  uint64_t next_generation = 1;
  std::vector<std::unique_ptr<ExportGeneration>> live;
};

// RestoreRecords' parsed records and rebuilt segments (durable.cc).
struct ParsedRecords;
struct RebuiltSegments;

// A reusable chain of registered segments for a prompt (EngineImpl::FindReusable).
struct ReuseMatch {
  std::vector<std::shared_ptr<const Segment>> chain;
  std::vector<storage::SegmentRef> refs;
  int64_t tokens = 0;
  PrefixStop stop = PrefixStop::kAbsent;  // why the chain ends where it does
  int64_t paged_in = 0;                   // segments of `chain` paged in by page_in
  // stop == kPartialSegment: where the prompt's block keys stop matching (a multiple of
  // the block size, past `tokens`, inside the segment that was not reused); else 0.
  int64_t partial_tokens = 0;
};

// The engine's state and work. Its state is private, and so is what only the engine's own
// methods call. Public: the operations Engine forwards, and what the engine's parts that
// are not its methods use (the ingest streams, Delivery, and the helpers in append.cc,
// select.cc, durable.cc and export.cc): the backend, metrics, config and host value store,
// the device memory helpers, and the data paths' shared steps. EngineInternals
// (engine_internals.h) gives the engine's tests and the durable-record fuzzer what they
// read.
class EngineImpl {
 public:
  EngineImpl(kernels::Backend* backend, const ServerConfig* config, Metrics* metrics,
             EngineOptions options);
  ~EngineImpl();

  absl::Status Init();

  // -------------------------------------------------------------------------------------
  // The operations (Engine forwards them)

  // --- sessions.cc ---
  absl::StatusOr<v1::CreateSessionResponse> CreateSession(const Tenant& t,
                                                          const v1::CreateSessionRequest& r);
  // logical_id: fork a tensor-parallel shard into a shard of that logical session (null:
  // a shard parent is refused).
  absl::StatusOr<v1::ForkSessionResponse> ForkSession(const Tenant& t,
                                                      const v1::ForkSessionRequest& r,
                                                      const std::string* logical_id = nullptr);
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const Tenant& t,
                                                        const v1::LookupPrefixRequest& r);
  absl::StatusOr<v1::SessionInfo> GetSession(const Tenant& t, const v1::GetSessionRequest& r);
  absl::StatusOr<v1::ListSessionsResponse> ListSessions(const Tenant& t);
  // shard_ok: close a tensor-parallel shard too (else refused: its logical session is
  // closed as a whole).
  absl::StatusOr<v1::CloseSessionResponse> CloseSession(const Tenant& t,
                                                        const v1::CloseSessionRequest& r,
                                                        bool shard_ok = false);
  std::vector<Engine::ShardRecord> TensorParallelShards();
  absl::Status MarkShardDamaged(const Tenant& t, const std::string& session_id,
                                const std::string& what);
  // --- attachments.cc ---
  absl::StatusOr<v1::AttachResponse> Attach(const Tenant& t, const v1::AttachRequest& r);
  absl::StatusOr<v1::DetachResponse> Detach(const Tenant& t, const v1::DetachRequest& r);
  absl::StatusOr<Engine::SlotGeometry> AttachmentSlots(const Tenant& t,
                                                       const std::string& attachment_id);
  // --- slot_table.cc ---
  absl::StatusOr<v1::SlotTableResponse> SlotTable(const Tenant& t, const v1::SlotTableRequest& r);
  // --- ingest.cc ---
  absl::StatusOr<std::unique_ptr<Engine::IngestStream>> BeginIngest(
      const Tenant& t, const v1::IngestRequest& header);
  // --- append.cc ---
  absl::StatusOr<v1::AppendTokensResponse> AppendTokens(const Tenant& t,
                                                        const v1::AppendTokensRequest& r);
  // --- select.cc ---
  // Appends (or with `discard` drops) an attachment's held staged token; returns the
  // session's length.
  absl::StatusOr<uint64_t> CommitStaged(const Tenant& t, std::string_view attachment_id, int32_t token_id,
                                        bool discard);
  absl::StatusOr<v1::GetStaticSetResponse> GetStaticSet(const Tenant& t,
                                                        const v1::GetStaticSetRequest& r);
  absl::Status Select(const Tenant& t, const SelectRequestView& r, SelectResult* out);
  absl::Status Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out);
  // --- export.cc ---
  absl::StatusOr<v1::SessionExport> ExportSession(const Tenant& t,
                                                  const v1::ExportSessionRequest& r);
  // --- upkeep.cc ---
  // Server-wide (Engine::LiveAttachments) and the Stats of one tenant.
  absl::StatusOr<v1::StatsResponse> Stats();
  absl::StatusOr<v1::StatsResponse> Stats(const Tenant& t);
  absl::Status Drain();
  bool draining() const { return draining_.load(); }
  int RunMaintenance();

  // -------------------------------------------------------------------------------------
  // For the engine's parts

  kernels::Backend& backend() const { return *backend_; }
  Metrics* metrics() const { return metrics_; }
  const ServerConfig& config() const { return *config_; }
  // This engine's device (EngineOptions::device_name, else the backend's name).
  std::string device_name() const {
    return options_.device_name.empty() ? std::string(backend_->name()) : options_.device_name;
  }
  // Sealed segments' values (host memory, spilled to the spill tier).
  storage::HostValueStore& store() const { return *store_; }
  // What a new segment object binds to, so that its values leave the store with it.
  std::shared_ptr<StoreLink> store_link() const { return store_link_; }
  // Page-locked host buffers kept for reuse: an ingest's host copies of incomplete layers.
  storage::StagingPool& staging() const { return *staging_; }

  // --- engine.cc: device memory ---
  // Backend memory from the arena; on exhaustion, unreferenced cached prefixes are
  // evicted and the allocation retried once.
  absl::StatusOr<DeviceBlock> Alloc(size_t bytes, storage::ArenaKind kind);
  // Backend memory from the arena, without that retry (an attachment's slot tables).
  absl::StatusOr<DeviceBlock> AllocNoEvict(size_t bytes, storage::ArenaKind kind);
  // Arena bytes not in live blocks (cached prefixes that could be evicted count as used).
  size_t DeviceFreeBytes() const;
  absl::StatusOr<DeviceBlock> Upload(const void* host, size_t bytes, storage::ArenaKind kind);
  absl::Status Download(void* host, const void* src, size_t bytes);
  // The same in the order of `stream` (the decode path's per-request streams); DownloadOn
  // returns once the bytes are on the host.
  absl::StatusOr<DeviceBlock> UploadOn(kernels::Stream stream, const void* host, size_t bytes,
                                       storage::ArenaKind kind);
  absl::Status DownloadOn(kernels::Stream stream, void* host, const void* src, size_t bytes);
  // Absolute positions first .. first+n-1 as int64 in backend memory (RoPE and
  // observation kernels read positions from the backend's memory space).
  absl::StatusOr<DeviceBlock> DevicePositions(int64_t first, int64_t n);
  // A stream of the decode pool for one request (created on first need, returned by the
  // lease's destructor), so that concurrent decode requests overlap on the device instead
  // of serialising on device-wide synchronizes. The CPU backend's default stream when the
  // backend makes none.
  class StreamLease {
   public:
    explicit StreamLease(EngineImpl& e);
    ~StreamLease();
    StreamLease(const StreamLease&) = delete;
    StreamLease& operator=(const StreamLease&) = delete;
    kernels::Stream get() const { return s_; }

   private:
    EngineImpl& e_;
    kernels::Stream s_;
  };

  // --- views.cc ---
  // Pins the values of `owner` (a segment whose values are in the store), paging them in
  // when spilled; the error names the session.
  absl::StatusOr<storage::SegmentPin> PinValues(const Session& s, const Segment& owner);

  // --- append.cc ---
  // Checks the writer rule, takes s.mu exclusively, validates `ids` against the session,
  // logs (durable sessions) and applies the append (k pre-RoPE [n, h, d] per layer,
  // decoded); returns the session's new length. AppendTokens and staged tokens; a staged
  // token passes the session's length when its staging began (`at_tokens`), and an append
  // that came in between refuses it (FAILED_PRECONDITION: it was staged for a position the
  // session has moved past).
  absl::StatusOr<uint64_t> CommitAppend(const Tenant& t, Session& s, const std::string& attachment_id,
                                        absl::Span<const int32_t> ids,
                                        const std::vector<std::vector<kernels::bf16>>& ks,
                                        const std::vector<std::vector<kernels::bf16>>& vs,
                                        std::optional<uint64_t> at_tokens = std::nullopt);

  // --- durable.cc ---
  // Reads the bytes of one factor blob of a stored segment into dst (dst.size() is the
  // blob's size in the segment's metadata record).
  using FactorReader = std::function<absl::Status(const storage::SegmentId& id, int layer,
                                                  storage::FactorKind kind,
                                                  absl::Span<std::byte> dst)>;
  // Writes a sealed segment's values (already in the store) and factors through as
  // durable; sets seg.durable.
  absl::Status SealSegmentValues(Segment& seg, bool durable, const ModelInfo& m);
  // Writes a durable session's record (and any unwritten own segments) through.
  absl::Status PersistSession(Session& s);

  // --- prefixes.cc ---
  absl::StatusOr<storage::PrefixHasher> Hasher(const Tenant& t, const ModelInfo& m,
                                               const ProfileInfo& p) const;
  // Registers a sealed segment in the prefix index (and the engine's cache of registered
  // segments); returns the index reference, or an empty one when it cannot be registered.
  storage::SegmentRef RegisterPrefix(const std::shared_ptr<const Segment>& seg,
                                     const std::vector<storage::PrefixKey>& keys,
                                     int block_tokens, std::optional<storage::SegmentId> parent);

  // --- peer_memory.cc: worker GPU memory named by CUDA IPC handles (same-node ingest) ---
  void ReleasePeer(const std::string& handle);
  // A cuda_ipc tensor of `shape` (bf16), checked against its handle's allocation, as this
  // process's view of the worker's GPU memory (device memory: kernels and copies read it);
  // the handle's mapping is acquired once per caller and listed in *held (release each
  // with ReleasePeer).
  absl::StatusOr<absl::Span<const kernels::bf16>> PeerTensor(const v1::Tensor& t,
                                                            absl::Span<const int64_t> shape,
                                                            const std::string& what,
                                                            std::vector<std::string>* held);
  // Copies such a tensor into `dst` (host or device memory of the shape's size).
  absl::Status CopyFromPeerTensor(const v1::Tensor& t, absl::Span<const int64_t> shape,
                                  const std::string& what, absl::Span<kernels::bf16> dst,
                                  std::vector<std::string>* held);

  // --- upkeep.cc ---
  void ScheduleRefactor(const std::shared_ptr<Session>& s);
  void UpdateGauges();

  // --- damage.cc: damaged sessions (docs/OPERATIONS.md "Damage") ---
  // DATA_LOSS for `call` on a damaged session, naming it and what it lost; OK otherwise.
  static absl::Status CheckNotDamaged(const Session& s, std::string_view call);

 private:
  // EngineInternals reads the engine's sessions and store for its tests and drives
  // RestoreRecords for the durable-record fuzzer (engine_internals.h).
  friend class EngineInternals;

  absl::Status CheckNotDraining(std::string_view what) const;

  // --- sessions.cc, prefixes.cc ---
  // The longest reusable chain of registered segments for `tokens` (CreateSession,
  // LookupPrefix). With page_in, a matched segment whose values were spilled is paged in
  // before it is reused, so that one that cannot be read back ends the reuse.
  ReuseMatch FindReusable(const storage::PrefixHasher& hasher, absl::Span<const int32_t> tokens,
                          bool need_durable, bool page_in);
  // Evicts cached prefixes (LRU, unreferenced) down to `max_bytes` of the index.
  void EvictPrefixes(size_t max_bytes);
  // The host value store's reclaim hook: evicts the least recently used idle cached
  // prefix; false when there is none.
  bool EvictIdlePrefix();
  // Forgets segments the prefix index evicted.
  void DropEvicted(const std::vector<storage::PrefixSegmentInfo>& gone);

  // --- views.cc ---
  // Builds the decode view of `layer` (caller holds the session lock, shared at least).
  absl::StatusOr<LayerViewHold> BuildView(const Session& s, int layer);
  // The attention working set of `layer`, rebuilt when stale (caller holds s.mu shared).
  // The layer's static-set and exact-tail cache, rebuilt if the session changed since; with
  // host_rows also its rows on the host (GetStaticSet).
  absl::StatusOr<const StaticCache*> GetCache(Session& s, int layer, bool host_rows = false);

  // --- append.cc ---
  // The append itself (s.mu held exclusively; tokens validated, k pre-RoPE [n, h, d]).
  absl::Status ApplyAppend(Session& s, absl::Span<const int32_t> ids,
                           const std::vector<std::vector<kernels::bf16>>& ks,
                           const std::vector<std::vector<kernels::bf16>>& vs);
  // Makes an open segment's state immutable and appends it to the chain (exclusive lock).
  absl::Status SealOpen(Session& s);

  // --- append_log.cc: logged appends (append_fsync everysec / always) ---
  v1::AppendFsync ResolveAppendFsync(bool durable, v1::AppendFsync asked) const;
  // Writes one append's record (s.mu held exclusively), before ApplyAppend.
  absl::Status LogAppend(Session& s, absl::Span<const int32_t> ids,
                         const std::vector<std::vector<kernels::bf16>>& ks,
                         const std::vector<std::vector<kernels::bf16>>& vs);
  // Deletes the last record LogAppend wrote (its append failed).
  void DropLastAppendRecord(Session& s);
  // Deletes append records (folded into a new session record, or of a closed session).
  void DropAppendRecords(const Session& s, std::vector<storage::Id128>* records);
  // At start, after RestoreDurable: applies each restored session's logged appends.
  absl::Status ReplayAppendLog();
  void WalSyncLoop();
  void StopWalSync();

  // --- damage.cc ---
  // A read of a segment of `s` failed: DATA_LOSS (bytes that fail their checksum) marks
  // the session damaged. Returns `st` unchanged.
  absl::Status NoteReadFailure(const Session& s, const absl::Status& st);
  // Marks `s` damaged (a later call adds to the description and the tokens): counted in
  // kvshade_sessions_damaged_total{cause} (unless cause is empty: a damage reported by an
  // earlier start), logged at error level with its id, and, with `persist`, written as a
  // durable damage marker for a durable session so that every later start reports it too.
  void MarkDamaged(const Session& s, std::string_view cause, const std::string& what,
                   uint64_t tokens_lost, bool persist);
  // At start, after ReplayAppendLog: the markers of earlier starts, and what the spill
  // tier's open found (a damaged WAL: the sessions whose appends it dropped). Under
  // spill_on_damage refuse, fails the start when any session was found damaged.
  absl::Status ApplyStartDamage();

  // --- durable.cc ---
  std::string SegmentMetadata(const Segment& seg, const ModelInfo& m) const;
  absl::Status DeleteDurableRecord(const Session& s);
  void DeleteSegmentRecord(const storage::Id128& id);
  // At start: the durable records of the spill tier, through RestoreRecords.
  absl::Status RestoreDurable();
  // What RestoreDurable does with the durable records it found: rebuilds the sessions of
  // `metas` (session and segment records) whose records are whole and consistent, skipping
  // (and deleting) the others. The records are untrusted bytes (fuzz/durable_fuzzer.cc):
  // a damaged one is skipped, never a crash.
  absl::Status RestoreRecords(const std::vector<storage::SegmentMeta>& metas,
                              const FactorReader& read_factor);
  // Its steps: parse the records (stale session records listed for deletion); rebuild the
  // segments the sessions' chains use (orphans deleted); rebuild the sessions over them
  // (their tails read, their prefixes registered), restoring one whose records are not
  // whole as damaged. read_error is the first I/O error of read_factor: it refuses the
  // restore.
  ParsedRecords ParseRecords(const std::vector<storage::SegmentMeta>& metas) const;
  RebuiltSegments RebuildSegments(const ParsedRecords& records, const storage::SpillDamage& damage,
                                  const FactorReader& read_factor);
  absl::Status RebuildSessions(ParsedRecords& records, const RebuiltSegments& segments,
                               const storage::SpillDamage& damage, const FactorReader& read_factor,
                               const absl::Status& read_error);
  // Registers a restored session's chain in the prefix index, parents first.
  void RegisterRestoredPrefixes(Session& s);

  // --- peer_memory.cc ---
  absl::StatusOr<kernels::PeerBuffer> AcquirePeer(const std::string& handle);

  // --- export.cc ---
  // Drops an attachment's export generations (detach), or those of every attachment that
  // is gone (lease expiry, session closed).
  void DropExports(const std::string& attachment_id);
  void PruneExports();
  size_t CountExportGenerationsLocked() const;

  // --- upkeep.cc, refactor.cc: maintenance ---
  // Idle expiry (limits.session_idle_ttl_s).
  void ExpireIdleSessions();
  void BackgroundLoop();
  // Runs one session's refactorization; true when it swapped in a new basis.
  bool Refactor(const std::shared_ptr<Session>& s);

  // -------------------------------------------------------------------------------------
  // State

  kernels::Backend* backend_;
  const ServerConfig* config_;
  Metrics* metrics_;
  EngineOptions options_;
  std::unique_ptr<storage::DeviceArena> arena_;
  storage::SpillTier* spill_ = nullptr;  // options_.spill_tier (not owned); null: none
  std::unique_ptr<storage::HostValueStore> store_;
  std::shared_ptr<StoreLink> store_link_;
  // At most host_budget / 8 kept for reuse (docs/DESIGN.md "Ingest").
  std::unique_ptr<storage::StagingPool> staging_;
  // KV-events of the prefix index (kv_events.endpoint); null when off. Declared before the
  // index so that it outlives every eviction.
  std::unique_ptr<KvEventPublisher> kv_events_;
  storage::PrefixIndex prefix_;
  SessionManager sessions_;

  // Decode streams not leased right now (StreamLease); destroyed with the engine.
  std::mutex streams_mu_;
  std::vector<kernels::Stream> idle_streams_;

  base::Mutex seg_mu_;
  absl::flat_hash_map<storage::SegmentId, std::shared_ptr<const Segment>> registered_
      ABSL_GUARDED_BY(seg_mu_);

  std::atomic<bool> draining_{false};
  uint64_t damaged_at_start_ = 0;  // sessions marked damaged by this start's restore
  // append_fsync everysec: a write left unsynced since the last sync; the thread that
  // syncs the spill tier's log once a second.
  std::atomic<bool> wal_dirty_{false};
  std::mutex wal_mu_;
  std::condition_variable wal_cv_;
  bool wal_stop_ = false;
  std::thread wal_sync_thread_;
  // Same-node export generations per attachment id (export.cc).
  std::mutex exports_mu_;
  std::map<std::string, std::unique_ptr<AttachmentExports>> exports_;
  std::string instance_id_;  // random per engine: scopes exported region ids
  std::unique_ptr<kernels::DescriptorBroker> broker_;  // same_node.descriptor_broker
  struct MappedPeer {
    kernels::PeerBuffer buffer;
    int refs = 0;
  };
  std::mutex peers_mu_;
  std::map<std::string, MappedPeer> peers_;  // by CUDA IPC handle bytes
  // Per-tenant counts are the session manager's; these are the server's (Stats()).
  std::atomic<uint64_t> prefix_lookups_{0}, prefix_hits_{0};
  std::atomic<uint64_t> chunks_selected_{0}, chunk_hits_{0};
  // Store counters already reported to Metrics (spills and page-ins happen inside it).
  std::mutex reported_mu_;
  storage::HostStoreStats reported_;

  // Background maintenance.
  std::mutex bg_mu_;
  std::condition_variable bg_cv_;
  std::deque<std::weak_ptr<Session>> refactor_queue_;
  bool stop_ = false;
  int bg_running_ = 0;
  std::thread bg_thread_;
};

// INT2 KIVI of k, v [rows, d] bf16 host (keys per-channel, values per-token groups of G):
// the codes into *kb (device), the dequantized rows into *dk, *dv (host).
absl::Status QuantizeKivi(EngineImpl& e, int d, int G, const std::vector<kernels::bf16>& k,
                          const std::vector<kernels::bf16>& v, int rows, KiviBlock* kb,
                          std::vector<kernels::bf16>* dk, std::vector<kernels::bf16>* dv);

// Segment caps (docs/DESIGN.md "Sessions", "Segment caps"). A select searches at most
// kernels::kMaxSegments segments with selectable chunks per session; CreateSession reuses
// at most kMaxReusedSegments cached segments, leaving room for the session's own segment,
// one segment of its sealed appended chunks (forks at the end and durable write-throughs
// seal them; a seal merges them into one: append.cc "Compaction") and its open one.
inline constexpr int kMaxReusedSegments = kernels::kMaxSegments - 3;
// Segment ends (docs/DESIGN.md "Segment ends"): an ingest may be cut into several
// segments, which take the place of the one ingested segment above, so that the reused
// ones and the ingested ones together are at most kMaxReusedSegments + 1.
inline constexpr int kMaxSegmentEnds = kMaxReusedSegments;
// What a seal of `s`'s open segment merges (append.cc "Compaction"): chain[first..] and
// the open segment become one segment (first == chain.size(): nothing merges, the open
// segment is sealed as it is).
struct CompactionPlan {
  size_t first = 0;
  int fixed = 0;      // segments with selectable chunks that cannot merge (before the run)
  bool fits = true;   // after the seal, a next open segment stays under the cap
};
CompactionPlan PlanCompaction(const Session& s);
// The refusal of a select (or an export) over a session with more segments than that.
absl::Status TooManySegmentsError(const std::string& session_id);

// sessions.cc: marks a session removed from the session manager closed and lets go of what it
// holds (segments, prefix references, quarantined segments, tail, caches), freed outside its
// lock. CloseSession and idle expiry.
void ReleaseClosedSession(Session& s);

// Helpers shared by the .cc files.
size_t Bf16Bytes(size_t elements);
// A block's memory as T (device memory on a device backend: pass it to kernels, not to host code).
template <typename T>
T* Ptr(const DeviceBlock& b) {
  return static_cast<T*>(b.data());
}
template <typename T>
T* Ptr(const std::shared_ptr<const DeviceBlock>& b) {
  return b ? static_cast<T*>(b->data()) : nullptr;
}
std::vector<int64_t> Positions(int64_t first, int64_t n);

}  // namespace kvshade::service

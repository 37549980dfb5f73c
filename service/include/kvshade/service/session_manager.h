// SessionManager: the registry of sessions and attachments, per tenant, with leases.
//
// Rules (docs/DESIGN.md "Sessions", docs/API.md "Workers"):
// - Sessions and attachments are scoped by tenant: an id of another tenant's session or
//   attachment is NOT_FOUND, exactly like an unknown id (existence is not revealed).
// - A tenant holds at most limits.max_sessions_per_tenant sessions (RESOURCE_EXHAUSTED).
// - Attach gives a lease of lease_ms (0 = default_lease_ms; at most max_lease_ms); every
//   use of the attachment (select, attend, static set, append) renews it. An expired
//   attachment is removed; using its id gets FAILED_PRECONDITION ("lease expired",
//   re-attach) while its tombstone is remembered (the most recent kMaxTombstones), then
//   NOT_FOUND.
// - At most one live writer attachment per session (FAILED_PRECONDITION for a second one);
//   its lease expiring or a Detach frees the role.
// - A session holds at most limits.max_attachments_per_session live attachments.
//
// - Ids longer than kMaxIdBytes (status_util.h) are INVALID_ARGUMENT; errors echo at most
//   a bounded piece of an id (BoundedId).
// - Per tenant, what Stats reports (Usage): open sessions, live attachments, and counters
//   (prefix lookups, chunks selected) that outlive the sessions and attachments.
// - Idle tracking (limits.session_idle_ttl_s): a session is touched when it is added and by
//   every lookup of it (FindSession: ingest, append, attach, fork, GetSession) or of one of
//   its attachments (Use: every decode call); RemoveIdle takes out the sessions untouched
//   for the TTL that have no live attachment and no open ingest stream.
//
// Concurrency: one short registry lock (base::Mutex of kvshade/base/sync.h, which
// ThreadSanitizer sees, unlike Debian's absl::Mutex) for the maps; nothing slow runs under
// it. Per-attachment work (slot tables) is serialized by Attachment::mu.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvshade/base/sync.h"
#include "kvshade/service/config.h"
#include "kvshade/service/session.h"

namespace kvshade::service {

// Milliseconds since the Unix epoch; injectable so that lease tests need no sleeps.
using Clock = std::function<int64_t()>;
int64_t SystemNowMs();

// A slot table of one layer: [h, k] int32 chunk ids (-1 = empty), backend memory.
struct SlotTable {
  int k = 0;
  DeviceBlock slots;
};

struct PeerSlots;  // engine_impl.h

// A tenant's cumulative counters (Stats).
struct TenantCounters {
  std::atomic<uint64_t> prefix_lookups{0}, prefix_hits{0};
  // Of attachments that are gone (live ones are counted from the attachments).
  std::atomic<uint64_t> chunks_selected{0}, chunk_hits{0};
};

struct Attachment {
  // Adds this attachment's selection counts to its tenant's counters.
  ~Attachment();

  std::string id;
  std::string tenant;
  std::string worker_id;
  bool writer = false;
  uint32_t lease_ms = 0;
  v1::DeliveryMode delivery = v1::DELIVERY_MODE_INLINE;
  std::shared_ptr<PeerSlots> peer_slots;  // DELIVERY_MODE_CUDA_IPC; set before Attach answers
  std::shared_ptr<Session> session;
  // Guarded by the manager's registry lock.
  int64_t expires_ms = 0;

  // Serializes selects of this attachment (its slot tables).
  std::mutex mu;
  std::vector<SlotTable> slots;  // [L], allocated on first use of a layer
  // The staged new token (stage_token_id): each layer's K [h, d] pre-RoPE and V as the
  // calls come; appended once every layer is there, or (hold) kept complete until
  // CommitStaged. Guarded by `mu`.
  struct StagedToken {
    int32_t token_id = -1;
    uint64_t at_tokens = 0;  // the session's length when staging began
    std::vector<std::vector<kernels::bf16>> k, v;  // [L][h*d]; empty: layer not staged
    int layers = 0;
    bool hold = false;  // some staging call asked to wait for CommitStaged
  } staged;
  // Chunks selected and slot-table hits, over the attachment's life (atomic: Stats reads
  // them while selects add).
  std::atomic<uint64_t> selected{0}, hits{0};
  std::shared_ptr<TenantCounters> counters;  // the tenant's; set by SessionManager::Attach
};

struct SessionCounts {
  size_t sessions = 0;
  size_t attachments = 0;
};

// One tenant's figures for Stats.
struct TenantUsage {
  size_t sessions = 0;
  size_t attachments = 0;
  uint64_t prefix_lookups = 0, prefix_hits = 0;
  uint64_t chunks_selected = 0, chunk_hits = 0;  // live and gone attachments
};

class SessionManager {
 public:
  static constexpr size_t kMaxTombstones = 65536;

  SessionManager(const LimitsConfig& limits, Clock clock);

  // Random 128-bit ids, 32 hex digits.
  static std::string NewId();
  // A session or attachment id of device `device` of a daemon with several (0..255): 32 hex
  // digits whose first two are the device's index and the other 30 random (120 bits), so
  // that a call finds the session's device from its id alone (DeviceOfId). device < 0: an
  // untagged NewId() (a daemon with one device).
  static std::string NewId(int device);
  // The device index a tagged id carries: its first two hex digits; -1 when the id is not
  // 32 lower-case hex digits. (Meaningful only for ids of a daemon with several devices.)
  static int DeviceOfId(std::string_view id);
  // The device index that the attachment ids this manager creates carry (NewId(device));
  // -1 (the default): untagged. Set once, before any attachment exists.
  void set_id_device(int device) { id_device_ = device; }

  // Registers a session (its id and tenant set). RESOURCE_EXHAUSTED over the tenant's
  // session limit.
  absl::Status AddSession(std::shared_ptr<Session> session);
  // NOT_FOUND for an unknown id or another tenant's session.
  absl::StatusOr<std::shared_ptr<Session>> FindSession(const std::string& tenant,
                                                       const std::string& id) const;
  // Unregisters a session and its attachments (their ids become tombstones).
  absl::StatusOr<std::shared_ptr<Session>> RemoveSession(const std::string& tenant,
                                                         const std::string& id);
  std::vector<std::shared_ptr<Session>> ListSessions(const std::string& tenant) const;
  std::vector<std::shared_ptr<Session>> AllSessions() const;

  // A new attachment to a registered session. lease_ms 0 = default; over max_lease_ms is
  // INVALID_ARGUMENT.
  absl::StatusOr<std::shared_ptr<Attachment>> Attach(const std::string& tenant,
                                                     std::shared_ptr<Session> session,
                                                     const std::string& worker_id,
                                                     uint32_t lease_ms, bool writer);
  absl::Status Detach(const std::string& tenant, const std::string& attachment_id);
  // Looks an attachment up for use and renews its lease. NOT_FOUND (unknown, other
  // tenant), FAILED_PRECONDITION (lease expired).
  absl::StatusOr<std::shared_ptr<Attachment>> Use(const std::string& tenant,
                                                  const std::string& attachment_id);
  // Whether `attachment_id` (may be empty) may append to `session`: with a live writer
  // attachment only that attachment may (PERMISSION_DENIED otherwise); without one the
  // owner tenant may append with no attachment or with any of its live attachments.
  absl::Status CheckWriter(const std::string& tenant, const Session& session,
                           const std::string& attachment_id);

  // Removes expired attachments; returns how many.
  int ReapExpired();
  int64_t LeaseExpiry(const Attachment& a) const;
  int AttachmentCount(const Session& s) const;
  SessionCounts Counts() const;  // server-wide
  // A prefix lookup of `tenant` (CreateSession, LookupPrefix) and whether it reused tokens.
  void CountPrefixLookup(const std::string& tenant, bool hit);
  TenantUsage Usage(const std::string& tenant) const;
  int64_t Now() const { return clock_(); }

  // Unregisters and returns the sessions no call has touched for `idle_ms` that have no live
  // attachment (expired leases are reaped first) and no open ingest stream, and that no
  // call holds right now; the caller frees them. A session with an open ingest stream
  // counts as touched now.
  std::vector<std::shared_ptr<Session>> RemoveIdle(int64_t idle_ms);

  // While one exists, lookups on this thread do not touch (a listing reads every session of
  // a tenant without keeping them alive).
  class UntouchedScope {
   public:
    UntouchedScope();
    ~UntouchedScope();
    UntouchedScope(const UntouchedScope&) = delete;
    UntouchedScope& operator=(const UntouchedScope&) = delete;
  };

 private:
  absl::Status ExpiredOrMissing(const std::string& attachment_id) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::shared_ptr<TenantCounters> CountersLocked(const std::string& tenant)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveAttachmentLocked(const std::shared_ptr<Attachment>& a, bool expired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReapLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a call on session `id` now (unless an UntouchedScope is active).
  void TouchLocked(const std::string& id) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  LimitsConfig limits_;
  Clock clock_;
  int id_device_ = -1;
  mutable base::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, size_t> per_tenant_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<Attachment>> attachments_
      ABSL_GUARDED_BY(mu_);
  // Expired attachment id -> (tenant, expiry), bounded FIFO.
  absl::flat_hash_map<std::string, std::pair<std::string, int64_t>> tombstones_
      ABSL_GUARDED_BY(mu_);
  std::deque<std::string> tombstone_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<TenantCounters>> counters_
      ABSL_GUARDED_BY(mu_);
  // Session id -> when a call last touched it (ms). The map changes under the exclusive
  // lock; the times are atomics so that lookups under the shared lock can set them.
  absl::flat_hash_map<std::string, std::unique_ptr<std::atomic<int64_t>>> touched_ms_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace kvshade::service

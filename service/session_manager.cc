// SessionManager: tenant-scoped registry of sessions and attachments with leases (see
// session_manager.h for the rules).
#include "kvshade/service/session_manager.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <shared_mutex>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "kvshade/service/log.h"
#include "status_util.h"

namespace kvshade::service {
namespace {

// Active SessionManager::UntouchedScope objects on this thread.
thread_local int untouched_scopes = 0;

}  // namespace

int64_t SystemNowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* SessionStateName(SessionState s) {
  switch (s) {
    case SessionState::kIngesting: return "ingesting";
    case SessionState::kReady: return "ready";
    case SessionState::kClosed: return "closed";
  }
  return "unknown";
}

Attachment::~Attachment() {
  if (counters == nullptr) return;
  counters->chunks_selected += selected.load();
  counters->chunk_hits += hits.load();
}

SessionManager::SessionManager(const LimitsConfig& limits, Clock clock)
    : limits_(limits), clock_(clock ? std::move(clock) : Clock(SystemNowMs)) {}

std::string SessionManager::NewId() {
  // Ids are capabilities within a tenant: unguessable, from the OS entropy source.
  thread_local std::random_device rd;
  uint64_t w[2];
  for (auto& x : w) x = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(w), sizeof(w)));
}

std::string SessionManager::NewId(int device) {
  std::string id = NewId();
  if (device < 0) return id;
  static constexpr char kHex[] = "0123456789abcdef";
  id[0] = kHex[(device >> 4) & 0xf];
  id[1] = kHex[device & 0xf];
  return id;
}

int SessionManager::DeviceOfId(std::string_view id) {
  if (id.size() != 32) return -1;
  int device = 0;
  for (size_t i = 0; i < id.size(); ++i) {
    const char c = id[i];
    int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (v < 0) return -1;
    if (i < 2) device = device * 16 + v;
  }
  return device;
}

absl::Status SessionManager::AddSession(std::shared_ptr<Session> session) {
  base::MutexLock lock(&mu_);
  size_t& n = per_tenant_[session->tenant];
  if (n >= limits_.max_sessions_per_tenant) {
    return absl::ResourceExhaustedError(
        absl::StrCat("tenant '", session->tenant, "' already holds ", n,
                     " sessions (limit max_sessions_per_tenant = ",
                     limits_.max_sessions_per_tenant, "); close some first"));
  }
  if (!sessions_.emplace(session->id, session).second) {
    return absl::AlreadyExistsError(absl::StrCat("session id ", session->id, " exists"));
  }
  ++n;
  touched_ms_[session->id] = std::make_unique<std::atomic<int64_t>>(clock_());
  return absl::OkStatus();
}

SessionManager::UntouchedScope::UntouchedScope() { ++untouched_scopes; }
SessionManager::UntouchedScope::~UntouchedScope() { --untouched_scopes; }

void SessionManager::TouchLocked(const std::string& id) const {
  if (untouched_scopes > 0) return;
  auto it = touched_ms_.find(id);
  if (it != touched_ms_.end()) it->second->store(clock_());
}

std::vector<std::shared_ptr<Session>> SessionManager::RemoveIdle(int64_t idle_ms) {
  std::vector<std::shared_ptr<Session>> idle;
  base::MutexLock lock(&mu_);
  ReapLocked();
  const int64_t now = clock_();
  for (const auto& [id, s] : sessions_) {
    auto t = touched_ms_.find(id);
    if (t == touched_ms_.end()) continue;
    if (s->ingest_active.load()) {  // a stream is open: in use, however slow the client
      t->second->store(now);
      continue;
    }
    if (s->attachments > 0 || now - t->second->load() < idle_ms) continue;
    // A call that holds the session's lock is using it. try_lock never waits, so the
    // order against the registry lock does not matter.
    std::unique_lock<std::shared_mutex> busy(s->mu, std::try_to_lock);
    if (!busy.owns_lock()) continue;
    idle.push_back(s);
  }
  for (const auto& s : idle) {
    sessions_.erase(s->id);
    touched_ms_.erase(s->id);
    if (--per_tenant_[s->tenant] == 0) per_tenant_.erase(s->tenant);
  }
  return idle;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::FindSession(
    const std::string& tenant, const std::string& id) const {
  if (absl::Status st = CheckIdLength(id, "session id"); !st.ok()) return st;
  base::ReaderMutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session '", BoundedId(id), "' not found"));
  }
  TouchLocked(id);
  return it->second;
}

absl::StatusOr<std::shared_ptr<Session>> SessionManager::RemoveSession(const std::string& tenant,
                                                                       const std::string& id) {
  if (absl::Status st = CheckIdLength(id, "session id"); !st.ok()) return st;
  base::MutexLock lock(&mu_);
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session '", BoundedId(id), "' not found"));
  }
  std::shared_ptr<Session> s = it->second;
  sessions_.erase(it);
  touched_ms_.erase(id);
  if (--per_tenant_[tenant] == 0) per_tenant_.erase(tenant);
  std::vector<std::shared_ptr<Attachment>> gone;
  for (const auto& [aid, a] : attachments_) {
    if (a->session == s) gone.push_back(a);
  }
  for (const auto& a : gone) RemoveAttachmentLocked(a, /*expired=*/false);
  return s;
}

std::vector<std::shared_ptr<Session>> SessionManager::ListSessions(const std::string& tenant) const {
  base::ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, s] : sessions_) {
    if (s->tenant == tenant) out.push_back(s);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a->created_unix_ms != b->created_unix_ms ? a->created_unix_ms < b->created_unix_ms
                                                    : a->id < b->id;
  });
  return out;
}

std::vector<std::shared_ptr<Session>> SessionManager::AllSessions() const {
  base::ReaderMutexLock lock(&mu_);
  std::vector<std::shared_ptr<Session>> out;
  for (const auto& [id, s] : sessions_) out.push_back(s);
  return out;
}

absl::StatusOr<std::shared_ptr<Attachment>> SessionManager::Attach(
    const std::string& tenant, std::shared_ptr<Session> session, const std::string& worker_id,
    uint32_t lease_ms, bool writer) {
  if (lease_ms > limits_.max_lease_ms) {
    return absl::InvalidArgumentError(absl::StrCat("lease_ms must be <= max_lease_ms = ",
                                                   limits_.max_lease_ms, ", got ", lease_ms));
  }
  if (lease_ms == 0) lease_ms = limits_.default_lease_ms;
  base::MutexLock lock(&mu_);
  ReapLocked();
  auto it = sessions_.find(session->id);
  if (it == sessions_.end() || it->second != session || session->tenant != tenant) {
    return absl::NotFoundError(absl::StrCat("session '", session->id, "' not found"));
  }
  if (session->attachments >= static_cast<int>(limits_.max_attachments_per_session)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("session '", session->id, "' already has ", session->attachments,
                     " attachments (limit max_attachments_per_session = ",
                     limits_.max_attachments_per_session, ")"));
  }
  if (writer && !session->writer_attachment.empty()) {
    const auto w = attachments_.find(session->writer_attachment);
    return absl::FailedPreconditionError(absl::StrCat(
        "session '", session->id, "' already has a writer attachment",
        w != attachments_.end() ? absl::StrCat(" (worker '", BoundedId(w->second->worker_id), "')")
                                : "",
        "; detach it or let its lease expire, or attach as a reader"));
  }
  auto a = std::make_shared<Attachment>();
  a->id = NewId(id_device_);
  a->tenant = tenant;
  a->worker_id = worker_id;
  a->writer = writer;
  a->lease_ms = lease_ms;
  a->session = session;
  a->expires_ms = clock_() + lease_ms;
  a->slots.resize(session->model.layers);
  a->counters = CountersLocked(tenant);
  attachments_[a->id] = a;
  ++session->attachments;
  TouchLocked(session->id);
  if (writer) session->writer_attachment = a->id;
  return a;
}

void SessionManager::RemoveAttachmentLocked(const std::shared_ptr<Attachment>& a, bool expired) {
  attachments_.erase(a->id);
  --a->session->attachments;
  if (a->session->writer_attachment == a->id) a->session->writer_attachment.clear();
  if (expired) {
    log::Event(spdlog::level::info, "lease_expired")
        .Str("attachment", a->id)
        .Str("session", a->session->id)
        .Str("tenant", a->tenant)
        .Bool("writer", a->writer);
    tombstones_[a->id] = {a->tenant, a->expires_ms};
    tombstone_order_.push_back(a->id);
    while (tombstone_order_.size() > kMaxTombstones) {
      tombstones_.erase(tombstone_order_.front());
      tombstone_order_.pop_front();
    }
  }
}

void SessionManager::ReapLocked() {
  const int64_t now = clock_();
  std::vector<std::shared_ptr<Attachment>> expired;
  for (const auto& [id, a] : attachments_) {
    if (a->expires_ms <= now) expired.push_back(a);
  }
  for (const auto& a : expired) RemoveAttachmentLocked(a, /*expired=*/true);
}

int SessionManager::ReapExpired() {
  base::MutexLock lock(&mu_);
  const size_t before = attachments_.size();
  ReapLocked();
  return static_cast<int>(before - attachments_.size());
}

absl::Status SessionManager::ExpiredOrMissing(const std::string& attachment_id) const {
  return absl::NotFoundError(absl::StrCat("attachment '", BoundedId(attachment_id), "' not found"));
}

absl::Status SessionManager::Detach(const std::string& tenant, const std::string& attachment_id) {
  if (absl::Status st = CheckIdLength(attachment_id, "attachment id"); !st.ok()) return st;
  base::MutexLock lock(&mu_);
  auto it = attachments_.find(attachment_id);
  if (it == attachments_.end() || it->second->tenant != tenant) {
    auto t = tombstones_.find(attachment_id);
    if (t != tombstones_.end() && t->second.first == tenant) return absl::OkStatus();  // gone
    return ExpiredOrMissing(attachment_id);
  }
  std::shared_ptr<Attachment> a = it->second;
  // Detaching an attachment whose lease has just run out is not an error: it is gone
  // either way.
  RemoveAttachmentLocked(a, /*expired=*/false);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<Attachment>> SessionManager::Use(const std::string& tenant,
                                                                const std::string& attachment_id) {
  if (absl::Status st = CheckIdLength(attachment_id, "attachment id"); !st.ok()) return st;
  base::MutexLock lock(&mu_);
  const int64_t now = clock_();
  auto it = attachments_.find(attachment_id);
  if (it != attachments_.end() && it->second->tenant == tenant) {
    std::shared_ptr<Attachment> a = it->second;
    if (a->expires_ms > now) {
      a->expires_ms = now + a->lease_ms;
      TouchLocked(a->session->id);  // every decode call goes through here
      return a;
    }
    RemoveAttachmentLocked(a, /*expired=*/true);
  }
  auto t = tombstones_.find(attachment_id);
  if (t != tombstones_.end() && t->second.first == tenant) {
    return absl::FailedPreconditionError(
        absl::StrCat("attachment '", BoundedId(attachment_id), "': lease expired ",
                     now - t->second.second,
                     " ms ago; attach again"));
  }
  return ExpiredOrMissing(attachment_id);
}

absl::Status SessionManager::CheckWriter(const std::string& tenant, const Session& session,
                                         const std::string& attachment_id) {
  if (absl::Status st = CheckIdLength(attachment_id, "attachment id"); !st.ok()) return st;
  base::MutexLock lock(&mu_);
  ReapLocked();
  std::shared_ptr<Attachment> a;
  if (!attachment_id.empty()) {
    auto it = attachments_.find(attachment_id);
    if (it == attachments_.end() || it->second->tenant != tenant) {
      auto t = tombstones_.find(attachment_id);
      if (t != tombstones_.end() && t->second.first == tenant) {
        return absl::FailedPreconditionError(
            absl::StrCat("attachment '", BoundedId(attachment_id),
                         "': lease expired; attach again"));
      }
      return ExpiredOrMissing(attachment_id);
    }
    a = it->second;
    if (a->session.get() != &session) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attachment '", BoundedId(attachment_id), "' belongs to another session than '",
          session.id, "'"));
    }
    a->expires_ms = clock_() + a->lease_ms;
  }
  if (!session.writer_attachment.empty() && session.writer_attachment != attachment_id) {
    return absl::PermissionDeniedError(absl::StrCat(
        "session '", session.id, "' has a writer attachment; only it may append (pass its id "
        "as attachment_id)"));
  }
  return absl::OkStatus();
}

int64_t SessionManager::LeaseExpiry(const Attachment& a) const {
  base::ReaderMutexLock lock(&mu_);
  return a.expires_ms;
}

int SessionManager::AttachmentCount(const Session& s) const {
  base::ReaderMutexLock lock(&mu_);
  return s.attachments;
}

SessionCounts SessionManager::Counts() const {
  base::ReaderMutexLock lock(&mu_);
  return SessionCounts{sessions_.size(), attachments_.size()};
}

std::shared_ptr<TenantCounters> SessionManager::CountersLocked(const std::string& tenant) {
  std::shared_ptr<TenantCounters>& c = counters_[tenant];
  if (c == nullptr) c = std::make_shared<TenantCounters>();
  return c;
}

void SessionManager::CountPrefixLookup(const std::string& tenant, bool hit) {
  std::shared_ptr<TenantCounters> c;
  {
    base::MutexLock lock(&mu_);
    c = CountersLocked(tenant);
  }
  ++c->prefix_lookups;
  if (hit) ++c->prefix_hits;
}

TenantUsage SessionManager::Usage(const std::string& tenant) const {
  base::ReaderMutexLock lock(&mu_);
  TenantUsage u;
  if (auto it = per_tenant_.find(tenant); it != per_tenant_.end()) u.sessions = it->second;
  for (const auto& [id, a] : attachments_) {
    if (a->tenant != tenant) continue;
    ++u.attachments;
    u.chunks_selected += a->selected.load();
    u.chunk_hits += a->hits.load();
  }
  if (auto it = counters_.find(tenant); it != counters_.end()) {
    const TenantCounters& c = *it->second;
    u.prefix_lookups = c.prefix_lookups.load();
    u.prefix_hits = c.prefix_hits.load();
    u.chunks_selected += c.chunks_selected.load();
    u.chunk_hits += c.chunk_hits.load();
  }
  return u;
}

}  // namespace kvshade::service

// The engine's upkeep: gauges, Stats (server-wide and per tenant), Drain, idle expiry,
// maintenance and the background loop.
#include "kvshade/service/engine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <numeric>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine_impl.h"
#include "status_util.h"
#include "kvshade/service/log.h"
#include "kvshade/kernels/pyramid.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {

using storage::ArenaKind;

// ---------------------------------------------------------------------------------------
// Stats, gauges, drain, maintenance

void EngineImpl::UpdateGauges() {
  const SessionCounts c = sessions_.Counts();
  metrics_->SetSessions(double(c.sessions), options_.metrics_gpu);
  metrics_->SetAttachments(double(c.attachments), options_.metrics_gpu);
  size_t segs = 0;
  {
    base::MutexLock lock(&seg_mu_);
    segs = registered_.size();
  }
  const storage::HostStoreStats hs = store_->Stats();
  metrics_->SetSegments(double(std::max(segs, hs.segments)), options_.metrics_gpu);
  {
    std::lock_guard<std::mutex> lock(reported_mu_);
    const uint64_t spills = hs.spills - std::min(hs.spills, reported_.spills);
    const uint64_t spill_bytes = hs.spill_bytes_written - std::min(hs.spill_bytes_written, reported_.spill_bytes_written);
    for (uint64_t i = 0; i < spills; ++i) metrics_->Spill(spill_bytes / spills);
    if (spills > 0) {
      log::Event(spdlog::level::info, "spilled")
          .Uint("segments", spills)
          .Uint("bytes", spill_bytes)
          .Uint("host_resident_bytes", hs.resident_bytes)
          .Uint("host_budget_bytes", config_->host_budget_bytes);
    }
    const uint64_t ins = hs.page_ins - std::min(hs.page_ins, reported_.page_ins);
    const uint64_t in_bytes = hs.page_in_bytes - std::min(hs.page_in_bytes, reported_.page_in_bytes);
    for (uint64_t i = 0; i < ins; ++i) metrics_->PageIn(in_bytes / ins);
    if (ins > 0) {
      log::Event(spdlog::level::info, "paged_in")
          .Uint("segments", ins)
          .Uint("bytes", in_bytes)
          .Uint("host_resident_bytes", hs.resident_bytes);
    }
    reported_ = hs;
  }
  const storage::ArenaStats as = arena_->Stats();
  metrics_->SetDeviceHeld(double(as.capacity), double(as.pools), options_.metrics_gpu);
  for (int k = 0; k < storage::kArenaKinds; ++k) {
    metrics_->SetTierBytes("device", storage::ArenaKindName(ArenaKind(k)),
                           double(as.used_by_kind[k]), options_.metrics_gpu);
  }
  metrics_->SetTierBytes("host", "values", double(hs.resident_bytes), options_.metrics_gpu);
  // What the spill tier holds now (durable write-through, restored and spilled segments'
  // values), not the running total of spill writes.
  if (spill_) {
    metrics_->SetTierBytes("spill", "values", double(hs.spill_tier_bytes), options_.metrics_gpu);
  }
}

// Server-wide figures (every tenant's): for the operator, like /metrics. The Stats RPC
// answers per tenant (Stats(t)).
absl::StatusOr<v1::StatsResponse> EngineImpl::Stats() {
  UpdateGauges();
  v1::StatsResponse r;
  const SessionCounts c = sessions_.Counts();
  const storage::ArenaStats as = arena_->Stats();
  const storage::HostStoreStats hs = store_->Stats();
  r.set_backend(std::string(backend_->name()));
  r.set_sessions(c.sessions);
  r.set_attachments(c.attachments);
  {
    base::MutexLock lock(&seg_mu_);
    r.set_segments(std::max(registered_.size(), hs.segments));
  }
  r.set_device_bytes_used(as.used);
  r.set_device_bytes_budget(as.budget);
  r.set_device_bytes_held(as.capacity);
  r.set_host_bytes_used(hs.resident_bytes);
  r.set_host_bytes_budget(hs.budget_bytes);
  r.set_spilled_bytes(hs.spill_tier_bytes);
  r.set_prefix_lookups(prefix_lookups_.load());
  r.set_prefix_hits(prefix_hits_.load());
  r.set_chunks_selected(chunks_selected_.load());
  r.set_chunk_hits(chunk_hits_.load());
#ifdef KVSHADE_VERSION
  r.set_version(KVSHADE_VERSION);
#endif
  return r;
}

// Stats of one tenant: its sessions and attachments, the segments its sessions hold (one
// shared by several counts once) and what they take on each tier, its prefix lookups and
// chunk selections; plus the server's backend, budgets and version. Nothing of another
// tenant (docs/API.md "Stats").
absl::StatusOr<v1::StatsResponse> EngineImpl::Stats(const Tenant& t) {
  UpdateGauges();
  const TenantUsage u = sessions_.Usage(t.name);
  uint64_t segments = 0, device = 0, host = 0, spilled = 0;
  absl::flat_hash_set<const Segment*> seen;
  absl::flat_hash_set<storage::SegmentId> values_seen;
  auto add = [&](const Segment& seg) {
    if (!seen.insert(&seg).second) return;
    ++segments;
    device += seg.DeviceBytes();
    if (seg.base == nullptr) {
      for (const LayerData& l : seg.layers) host += l.open_values.buffer.bytes();
    }
    const Segment& owner = seg.values_owner();
    if (!owner.values_in_store || !values_seen.insert(owner.id).second) return;
    absl::StatusOr<storage::SegmentUsage> su = store_->Usage(owner.id);
    if (!su.ok()) return;
    host += su->resident_bytes;
    if (su->on_spill_tier) spilled += su->value_bytes;
  };
  for (const auto& s : sessions_.ListSessions(t.name)) {
    std::shared_lock lock(s->mu);
    for (const auto& seg : s->chain) add(*seg);
    if (s->open) add(*s->open);
  }
  v1::StatsResponse r;
  r.set_backend(std::string(backend_->name()));
  r.set_sessions(u.sessions);
  r.set_attachments(u.attachments);
  r.set_segments(segments);
  r.set_device_bytes_used(device);
  r.set_device_bytes_budget(arena_->budget());
  r.set_device_bytes_held(arena_->capacity());  // server-wide, as the budget
  r.set_host_bytes_used(host);
  r.set_host_bytes_budget(store_->Stats().budget_bytes);
  r.set_spilled_bytes(spilled);
  r.set_prefix_lookups(u.prefix_lookups);
  r.set_prefix_hits(u.prefix_hits);
  r.set_chunks_selected(u.chunks_selected);
  r.set_chunk_hits(u.chunk_hits);
#ifdef KVSHADE_VERSION
  r.set_version(KVSHADE_VERSION);
#endif
  // This engine's device: the same figures (a router over several devices sums them).
  v1::DeviceStats* d = r.add_devices();
  d->set_device(device_name());
  d->set_pci_bus_id(options_.device_pci_bus_id);
  d->set_sessions(r.sessions());
  d->set_attachments(r.attachments());
  d->set_segments(r.segments());
  d->set_device_bytes_used(r.device_bytes_used());
  d->set_device_bytes_budget(r.device_bytes_budget());
  d->set_device_bytes_held(r.device_bytes_held());
  d->set_host_bytes_used(r.host_bytes_used());
  d->set_host_bytes_budget(r.host_bytes_budget());
  d->set_spilled_bytes(r.spilled_bytes());
  d->set_prefix_lookups(r.prefix_lookups());
  d->set_prefix_hits(r.prefix_hits());
  d->set_chunks_selected(r.chunks_selected());
  d->set_chunk_hits(r.chunk_hits());
  return r;
}

absl::Status EngineImpl::Drain() {
  draining_ = true;
  {
    std::unique_lock<std::mutex> lock(bg_mu_);
    stop_ = true;
    refactor_queue_.clear();
    bg_cv_.notify_all();
    bg_cv_.wait(lock, [&] { return bg_running_ == 0; });
  }
  if (bg_thread_.joinable()) bg_thread_.join();
  absl::Status first = absl::OkStatus();
  for (const auto& s : sessions_.AllSessions()) {
    if (!s->durable) continue;
    std::unique_lock lock(s->mu);
    // A damaged session's record stays as it was (its damage marker says what it lost).
    if (s->state != SessionState::kReady || s->damaged.load()) continue;
    absl::Status st = SealOpen(*s);
    if (st.ok()) st = PersistSession(*s);
    if (!st.ok() && first.ok()) first = st;
  }
  return first;
}

// Idle expiry (limits.session_idle_ttl_s): closes the sessions the session manager finds
// idle as CloseSession does (a durable one loses its record), and counts them. Not while
// draining: Drain writes durable sessions through.
void EngineImpl::ExpireIdleSessions() {
  const uint32_t ttl_s = config_->limits.session_idle_ttl_s;
  if (ttl_s == 0 || draining_.load()) return;
  const std::vector<std::shared_ptr<Session>> idle = sessions_.RemoveIdle(int64_t{ttl_s} * 1000);
  for (const std::shared_ptr<Session>& s : idle) {
    ReleaseClosedSession(*s);
    if (s->durable && spill_) {
      if (absl::Status st = DeleteDurableRecord(*s); !st.ok()) {
        spdlog::error("idle session {} expired, but its durable record could not be deleted "
                      "({}): it comes back at the next restart",
                      s->id, std::string(st.message()));
      }
    }
    log::Event(spdlog::level::info, "session_expired")
        .Str("session", s->id)
        .Str("tenant", s->tenant)
        .Uint("idle_ttl_s", ttl_s)
        .Msg("closed: no call for session_idle_ttl_s");
  }
  if (!idle.empty()) metrics_->SessionsExpired(idle.size());
}

int EngineImpl::RunMaintenance() {
  sessions_.ReapExpired();
  ExpireIdleSessions();
  PruneExports();
  // Device memory on demand: steps no data uses go back to the device (one step is kept
  // as headroom, so that a burst does not allocate again at once).
  const size_t trimmed = arena_->Trim(static_cast<size_t>(config_->device_growth_bytes));
  if (trimmed > 0) {
    log::Event(spdlog::level::debug, "device_memory_released").Uint("bytes", trimmed);
  }
  UpdateGauges();
  int done = 0;
  for (;;) {
    std::shared_ptr<Session> s;
    {
      std::lock_guard<std::mutex> lock(bg_mu_);
      if (refactor_queue_.empty()) break;
      s = refactor_queue_.front().lock();
      refactor_queue_.pop_front();
    }
    if (s && Refactor(s)) ++done;
  }
  return done;
}

void EngineImpl::ScheduleRefactor(const std::shared_ptr<Session>& s) {
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    if (stop_) return;
    refactor_queue_.push_back(s);
  }
  bg_cv_.notify_all();
}

void EngineImpl::BackgroundLoop() {
  std::unique_lock<std::mutex> lock(bg_mu_);
  while (!stop_) {
    bg_cv_.wait_for(lock, std::chrono::seconds(1),
                    [&] { return stop_ || !refactor_queue_.empty(); });
    if (stop_) break;
    ++bg_running_;
    lock.unlock();
    RunMaintenance();
    lock.lock();
    --bg_running_;
    bg_cv_.notify_all();
  }
}

}  // namespace kvshade::service

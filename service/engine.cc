// Engine: sessions, fork, prefix lookup, attachments, stats, drain and the shared helpers
// (memory, views, gauges). The data paths are in ingest.cc, append.cc and select.cc;
// durability in durable.cc.
#include <sys/resource.h>
#include <unistd.h>

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
// Small shared helpers

size_t Bf16Bytes(size_t elements) { return elements * sizeof(kernels::bf16); }

absl::Status TooManySegmentsError(const std::string& session_id) {
  // Seals merge appended segments (append.cc "Compaction"), so only a durable session
  // restored from records of a version that did not merge them can get here, until its
  // next seal; a new session over the same tokens reuses the cached prefix (at most
  // kMaxReusedSegments segments) and holds what it ingests as one segment.
  return absl::FailedPreconditionError(absl::StrCat(
      "session '", session_id, "' has more than ", kernels::kMaxSegments,
      " segments with selectable chunks, more than a select searches; create a new session "
      "over its whole token list (prompt and appended tokens) and ingest what is not reused: "
      "it reuses at most ", kMaxReusedSegments,
      " cached segments and holds the rest as one segment"));
}

std::vector<int64_t> Positions(int64_t first, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), first);
  return p;
}

StageTimer::StageTimer(Metrics* m, std::string_view stage)
    : m_(m), stage_(stage),
      start_ns_(std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now().time_since_epoch())
                    .count()) {}

StageTimer::~StageTimer() {
  if (m_ == nullptr) return;
  const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
  m_->ObserveStage(stage_, double(now - start_ns_) * 1e-9);
}

Segment::~Segment() {
  if (values_in_store && store && store->store != nullptr && !store->keep.load()) {
    // Values go with the segment (a durable one leaves the spill tier too). Nothing pins
    // a dying segment: pins are held only by calls that also hold the segment.
    store->store->Erase(id).IgnoreError();
  }
}

size_t Segment::DeviceBytes() const {
  size_t b = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerData& own = layers[l];
    if (own.a) b += own.a->bytes();
    if (base) continue;  // the rest belongs to the base segment
    b += own.landmarks.bytes() + own.sig.bytes() + own.excluded.bytes() + own.sk.bytes() + own.sv.bytes() +
         own.tk.bytes() + own.tv.bytes();
    for (const KiviBlock& k : own.int2) {
      b += k.k_codes.bytes() + k.k_scale.bytes() + k.k_min.bytes() + k.v_codes.bytes() +
           k.v_scale.bytes() + k.v_min.bytes();
    }
  }
  return b;
}

size_t Segment::HostBytes() const {
  if (base) return 0;
  size_t b = values_in_store ? value_layout.total_bytes() : 0;
  for (const LayerData& l : layers) b += l.open_values.buffer.bytes();
  return b;
}

static bool EvictIdlePrefix(EngineImpl& e);                                  // below
static absl::StatusOr<v1::StatsResponse> TenantStats(EngineImpl& e, const Tenant& t);  // below

// ---------------------------------------------------------------------------------------
// Engine (public shell)

Engine::Engine(std::unique_ptr<EngineImpl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(kernels::Backend* backend,
                                                       const ServerConfig* config,
                                                       Metrics* metrics, EngineOptions options) {
  if (backend == nullptr || config == nullptr || metrics == nullptr) {
    return absl::InvalidArgumentError("Engine::Create: backend, config and metrics must be set");
  }
  auto impl = std::make_unique<EngineImpl>(backend, config, metrics, std::move(options));
  KVSHADE_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

absl::StatusOr<v1::CreateSessionResponse> Engine::CreateSession(
    const Tenant& t, const v1::CreateSessionRequest& r) {
  return impl_->CreateSession(t, r);
}
absl::StatusOr<v1::ForkSessionResponse> Engine::ForkSession(const Tenant& t,
                                                            const v1::ForkSessionRequest& r) {
  return impl_->ForkSession(t, r);
}
absl::StatusOr<v1::LookupPrefixResponse> Engine::LookupPrefix(const Tenant& t,
                                                              const v1::LookupPrefixRequest& r) {
  return impl_->LookupPrefix(t, r);
}
absl::StatusOr<v1::SessionInfo> Engine::GetSession(const Tenant& t,
                                                   const v1::GetSessionRequest& r) {
  return impl_->GetSession(t, r);
}
absl::StatusOr<v1::ListSessionsResponse> Engine::ListSessions(const Tenant& t,
                                                              const v1::ListSessionsRequest&) {
  return impl_->ListSessions(t);
}
absl::StatusOr<v1::CloseSessionResponse> Engine::CloseSession(const Tenant& t,
                                                              const v1::CloseSessionRequest& r) {
  return impl_->CloseSession(t, r);
}
absl::StatusOr<std::unique_ptr<Engine::IngestStream>> Engine::BeginIngest(
    const Tenant& t, const v1::IngestRequest& header) {
  return impl_->BeginIngest(t, header);
}
absl::StatusOr<v1::IngestResponse> Engine::Ingest(const Tenant& t,
                                                  absl::Span<const v1::IngestRequest> stream) {
  if (stream.empty()) {
    return absl::InvalidArgumentError(
        "Ingest: the stream is empty; the first message must be the header");
  }
  KVSHADE_ASSIGN_OR_RETURN(auto s, impl_->BeginIngest(t, stream[0]));
  for (size_t i = 1; i < stream.size(); ++i) KVSHADE_RETURN_IF_ERROR(s->Add(stream[i]));
  return s->Finish();
}
absl::StatusOr<v1::AppendTokensResponse> Engine::AppendTokens(const Tenant& t,
                                                              const v1::AppendTokensRequest& r) {
  return impl_->AppendTokens(t, r);
}
absl::StatusOr<v1::AttachResponse> Engine::Attach(const Tenant& t, const v1::AttachRequest& r) {
  return impl_->Attach(t, r);
}
absl::StatusOr<v1::DetachResponse> Engine::Detach(const Tenant& t, const v1::DetachRequest& r) {
  return impl_->Detach(t, r);
}
absl::StatusOr<v1::CommitStagedResponse> Engine::CommitStaged(const Tenant& t,
                                                              const v1::CommitStagedRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckIdLength(r.attachment_id(), "attachment id"));
  KVSHADE_ASSIGN_OR_RETURN(uint64_t tokens,
                           impl_->CommitStaged(t, r.attachment_id(), r.stage_token_id(), r.discard()));
  v1::CommitStagedResponse resp;
  resp.set_tokens(tokens);
  return resp;
}

absl::StatusOr<v1::GetStaticSetResponse> Engine::GetStaticSet(const Tenant& t,
                                                              const v1::GetStaticSetRequest& r) {
  return impl_->GetStaticSet(t, r);
}
absl::Status Engine::Select(const Tenant& t, const SelectRequestView& r, SelectResult* out) {
  return impl_->Select(t, r, out);
}
absl::Status Engine::Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out) {
  return impl_->Attend(t, r, out);
}
absl::StatusOr<v1::SessionExport> Engine::ExportSession(const Tenant& t,
                                                        const v1::ExportSessionRequest& r) {
  return impl_->ExportSession(t, r);
}
absl::StatusOr<Engine::SlotGeometry> Engine::AttachmentSlots(const Tenant& t,
                                                             const std::string& attachment_id) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a,
                           impl_->sessions_.Use(t.name, attachment_id));
  const Session& s = *a->session;
  SlotGeometry g;
  static_cast<SlotLayout&>(g) = SlotLayout::Of(s.model, s.profile);
  g.delivery = a->delivery;
  return g;
}
absl::StatusOr<v1::StatsResponse> Engine::Stats(const Tenant& t, const v1::StatsRequest&) {
  return TenantStats(*impl_, t);
}
absl::Status Engine::Drain() { return impl_->Drain(); }
bool Engine::draining() const { return impl_->draining_.load(); }
uint64_t Engine::LiveAttachments() {
  auto stats = impl_->Stats();
  return stats.ok() ? stats->attachments() : 0;
}
int Engine::RunMaintenance() { return impl_->RunMaintenance(); }

// ---------------------------------------------------------------------------------------
// EngineImpl: set-up

EngineImpl::EngineImpl(kernels::Backend* backend, const ServerConfig* config, Metrics* metrics,
                       EngineOptions options)
    : backend_(backend), config_(config), metrics_(metrics), options_(std::move(options)),
      spill_(options_.spill_tier), sessions_(config->limits, options_.clock) {}

EngineImpl::~EngineImpl() {
  {
    std::lock_guard<std::mutex> lock(bg_mu_);
    stop_ = true;
  }
  bg_cv_.notify_all();
  if (bg_thread_.joinable()) bg_thread_.join();
  StopWalSync();
  for (kernels::Stream st : idle_streams_) (void)backend_->DestroyStream(st);
  // Durable segments stay in the spill tier when the process ends; cached ones are
  // dropped by the spill tier at its next open.
  if (store_link_) store_link_->keep = true;
}

// Every shared allocation (export.cc) holds a descriptor of its memory file: lift the soft
// limit on open files to the hard one.
static void RaiseOpenFileLimit() {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

absl::Status EngineImpl::Init() {
  // Same-node export: the arena and the value store come from memory a worker on this node
  // can map (export.cc). Each shared allocation holds a file descriptor: allow many.
  if (config_->same_node.export_state) {
    backend_->EnableSharedMemory(config_->same_node.host_memory == "file"
                                     ? kernels::SharedHostMemory::kFile
                                     : kernels::SharedHostMemory::kAuto);
    RaiseOpenFileLimit();
  }
  instance_id_ = SessionManager::NewId();
  if (config_->same_node.export_state && config_->same_node.descriptor_broker != "off") {
    // Workers take the shared regions' descriptors here (SCM_RIGHTS), needing neither
    // ptrace access nor the daemon's PID namespace; without it they use /proc or pidfd.
    const std::string& want = config_->same_node.descriptor_broker;
    const std::string address =
        want == "auto" ? absl::StrCat("@kvshade-", getpid(), "-", instance_id_.substr(0, 8)) : want;
    absl::StatusOr<std::unique_ptr<kernels::DescriptorBroker>> b =
        kernels::DescriptorBroker::Start(address);
    if (b.ok()) {
      broker_ = *std::move(b);
    } else if (want == "auto") {
      // Only a convenience: workers still reach the memory through /proc or pidfd_getfd.
      log::Event(spdlog::level::warn, "descriptor_broker_unavailable").Status(b.status());
    } else {
      return absl::Status(b.status().code(),
                          absl::StrCat("same_node.descriptor_broker: ", b.status().message()));
    }
  }
  if (config_->device_growth_bytes == 0) {
    KVSHADE_ASSIGN_OR_RETURN(arena_, storage::DeviceArena::Create(*backend_, config_->device_budget_bytes));
  } else {
    // Steps of device_growth (a multiple of the arena's alignment), at most the budget.
    constexpr size_t kAlign = 256;
    const size_t budget = config_->device_budget_bytes / kAlign * kAlign;
    const size_t growth = std::max<size_t>(
        kAlign, std::min<size_t>(config_->device_growth_bytes, budget) / kAlign * kAlign);
    KVSHADE_ASSIGN_OR_RETURN(arena_, storage::DeviceArena::CreateOnDemand(*backend_, budget, growth, kAlign));
  }
  storage::HostValueStoreOptions ho;
  ho.budget_bytes = config_->host_budget_bytes;
  ho.slab_bytes = std::min<size_t>(ho.slab_bytes, std::max<size_t>(config_->host_budget_bytes / 4, 1 << 20));
  ho.prefetch_thread = false;  // Attach's page-in runs inline (before it answers)
  // Host memory short and nothing spillable: cached segments no session holds go, least
  // recently used first (closed sessions' segments stay cached for reuse until then).
  ho.reclaim = [this](size_t) { return EvictIdlePrefix(*this); };
  KVSHADE_ASSIGN_OR_RETURN(store_, storage::HostValueStore::Create(*backend_, ho, spill_));
  store_link_ = std::make_shared<StoreLink>();
  store_link_->store = store_.get();
  if (!config_->kv_events.endpoint.empty()) {
    KvEventsOptions ko;
    ko.endpoint = config_->kv_events.endpoint;
    ko.topic = config_->kv_events.topic;
    ko.medium = backend_->name() == "cpu" ? "CPU" : "GPU";
    KVSHADE_ASSIGN_OR_RETURN(kv_events_, KvEventPublisher::Start(ko));
  }
  if (spill_) {
    const auto restore_start = std::chrono::steady_clock::now();
    KVSHADE_RETURN_IF_ERROR(RestoreDurable());
    KVSHADE_RETURN_IF_ERROR(ReplayAppendLog());
    KVSHADE_RETURN_IF_ERROR(ApplyStartDamage());
    size_t restored_segments = 0;
    {
      base::MutexLock lock(&seg_mu_);
      restored_segments = registered_.size();
    }
    log::Event(spdlog::level::info, "restore_summary")
        .Uint("sessions", sessions_.Counts().sessions)
        .Uint("prefix_segments", restored_segments)
        .Num("ms", std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - restore_start).count())
        .Str("spill_path", config_->spill_path);
    wal_sync_thread_ = std::thread([this] { WalSyncLoop(); });
  }
  if (options_.background_thread) bg_thread_ = std::thread([this] { BackgroundLoop(); });
  UpdateGauges();
  return absl::OkStatus();
}

absl::Status EngineImpl::CheckNotDraining(std::string_view what) const {
  if (draining_.load()) {
    return absl::UnavailableError(
        absl::StrCat(std::string(what), ": the server is draining (shutting down); retry on "
                                        "another replica"));
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Memory helpers

absl::StatusOr<DeviceBlock> EngineImpl::Alloc(size_t bytes, ArenaKind kind) {
  bytes = std::max<size_t>(bytes, 1);
  auto b = arena_->Allocate(bytes, kind);
  if (b.ok() || !absl::IsResourceExhausted(b.status())) return b;
  // Make room from cached prefixes nobody uses, then try once more.
  EvictPrefixes(0);
  b = arena_->Allocate(bytes, kind);
  if (!b.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "device memory budget exhausted (device_budget_bytes = ", config_->device_budget_bytes,
        "): ", b.status().message()));
  }
  return b;
}

size_t EngineImpl::DeviceFreeBytes() const {
  const storage::ArenaStats st = arena_->Stats();
  return st.budget - std::min(st.budget, st.used);
}

absl::StatusOr<DeviceBlock> EngineImpl::Upload(const void* host, size_t bytes, ArenaKind kind) {
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock b, Alloc(bytes, kind));
  if (bytes > 0) KVSHADE_RETURN_IF_ERROR(backend_->CopyFromHost(b.data(), host, bytes));
  return b;
}

absl::StatusOr<DeviceBlock> EngineImpl::DevicePositions(int64_t first, int64_t n) {
  const std::vector<int64_t> p = Positions(first, n);
  return Upload(p.data(), p.size() * sizeof(int64_t), ArenaKind::kOther);
}

absl::Status EngineImpl::Download(void* host, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(backend_->Synchronize());
  KVSHADE_RETURN_IF_ERROR(backend_->CopyToHost(host, src, bytes));
  return backend_->Synchronize();
}

absl::StatusOr<DeviceBlock> EngineImpl::UploadOn(kernels::Stream stream, const void* host,
                                                 size_t bytes, ArenaKind kind) {
  KVSHADE_ASSIGN_OR_RETURN(DeviceBlock b, Alloc(bytes, kind));
  if (bytes > 0) KVSHADE_RETURN_IF_ERROR(backend_->CopyFromHost(b.data(), host, bytes, stream));
  return b;
}

absl::Status EngineImpl::DownloadOn(kernels::Stream stream, void* host, const void* src,
                                    size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  KVSHADE_RETURN_IF_ERROR(backend_->CopyToHost(host, src, bytes, stream));
  return backend_->Synchronize(stream);
}

EngineImpl::StreamLease::StreamLease(EngineImpl& e) : e_(e) {
  {
    std::lock_guard<std::mutex> lock(e.streams_mu_);
    if (!e.idle_streams_.empty()) {
      s_ = e.idle_streams_.back();
      e.idle_streams_.pop_back();
      return;
    }
  }
  if (e.backend_->space() == kernels::MemorySpace::kHost) return;  // runs to completion anyway
  // A stream that cannot be made leaves the request on the default stream (correct,
  // only without overlap).
  if (auto st = e.backend_->CreateStream(); st.ok()) s_ = *st;
}

EngineImpl::StreamLease::~StreamLease() {
  if (s_.handle == nullptr) return;
  // A request that failed half-way may have left work queued: the next one starts clean.
  (void)e_.backend_->Synchronize(s_);
  std::lock_guard<std::mutex> lock(e_.streams_mu_);
  e_.idle_streams_.push_back(s_);
}

// ---------------------------------------------------------------------------------------
// Prefix index

absl::StatusOr<storage::PrefixHasher> EngineImpl::Hasher(const Tenant& t, const ModelInfo& m,
                                                         const ProfileInfo& p) const {
  storage::PrefixScope scope;
  scope.model_id = m.Fingerprint();
  scope.profile = p.Fingerprint();
  scope.tenant_salt = t.salt;  // from the Authenticator, never from a request
  return storage::PrefixHasher::Create(scope, storage::kDefaultPrefixBlockTokens);
}

storage::SegmentRef EngineImpl::RegisterPrefix(const std::shared_ptr<const Segment>& seg,
                                               const std::vector<storage::PrefixKey>& keys,
                                               int block_tokens,
                                               std::optional<storage::SegmentId> parent) {
  const int64_t first = seg->first_position;
  const int64_t end = seg->first_position + seg->n_tokens;
  if (first % block_tokens != 0) return {};
  const int64_t first_block = first / block_tokens;
  const int64_t end_block = std::min<int64_t>(end / block_tokens, int64_t(keys.size()));
  if (end_block <= first_block) return {};
  if (first_block > 0) {
    if (!parent) return {};
    auto info = prefix_.Info(*parent);
    if (!info || info->end_token != first) return {};
  }
  std::vector<storage::PrefixKey> mine(keys.begin() + first_block, keys.begin() + end_block);
  auto ref = prefix_.Insert(seg->id, first_block > 0 ? parent : std::nullopt, block_tokens,
                            first_block, mine, seg->DeviceBytes() + seg->HostBytes());
  if (!ref.ok()) return {};  // e.g. the same prefix was cached concurrently: keep ours private
  {
    base::MutexLock lock(&seg_mu_);
    registered_[seg->id] = seg;
  }
  if (kv_events_) {
    // The low 64 bits of each block's key (the last 8 bytes of its canonical form).
    std::vector<uint64_t> hashes;
    for (const storage::PrefixKey& k : mine) hashes.push_back(k.lo);
    std::optional<uint64_t> parent_hash;
    if (first_block > 0) parent_hash = keys[first_block - 1].lo;
    const size_t n = std::min(seg->tokens.size(), size_t(end_block - first_block) * block_tokens);
    kv_events_->Stored(seg->id.ToHex(), std::move(hashes), parent_hash,
                       std::vector<int32_t>(seg->tokens.begin(), seg->tokens.begin() + n),
                       static_cast<uint32_t>(block_tokens));
  }
  EvictPrefixes(config_->device_budget_bytes / 2);
  return std::move(ref).value();
}

// Forgets segments the prefix index evicted; they are freed (values included) when the
// last call using them lets go.
static void DropEvicted(EngineImpl& e, const std::vector<storage::PrefixSegmentInfo>& gone) {
  if (gone.empty()) return;
  std::vector<std::shared_ptr<const Segment>> drop;  // destroyed outside the lock
  {
    base::MutexLock lock(&e.seg_mu_);
    for (const auto& info : gone) {
      auto it = e.registered_.find(info.segment);
      if (it != e.registered_.end()) {
        drop.push_back(std::move(it->second));
        e.registered_.erase(it);
      }
      if (e.kv_events_) e.kv_events_->Removed(info.segment.ToHex());
      e.metrics_->Eviction();
    }
  }
}

void EngineImpl::EvictPrefixes(size_t max_bytes) { DropEvicted(*this, prefix_.Evict(max_bytes)); }

// The host value store is full and can spill nothing: evicts the least recently used
// cached segment that no session holds and whose values take host memory (resident and
// unpinned). Called by the store without its lock.
static bool EvictIdlePrefix(EngineImpl& e) {
  std::optional<storage::PrefixSegmentInfo> gone =
      e.prefix_.EvictOne([&e](const storage::PrefixSegmentInfo& info) {
        absl::StatusOr<storage::SegmentUsage> u = e.store_->Usage(info.segment);
        return u.ok() && u->resident_bytes > 0 && u->pins == 0;
      });
  if (!gone) return false;
  DropEvicted(e, {*gone});
  return true;
}

// Matches the longest reusable chain of registered segments for `tokens`.
namespace {

struct ReuseMatch {
  std::vector<std::shared_ptr<const Segment>> chain;
  std::vector<storage::SegmentRef> refs;
  int64_t tokens = 0;
  PrefixStop stop = PrefixStop::kAbsent;  // why the chain ends where it does
  int64_t paged_in = 0;                   // segments of `chain` paged in by page_in
};

}  // namespace

// The values of a cached segment about to be reused, paged in when they are on the spill
// tier: true when that happened, the page-in's error when they cannot be read back.
static absl::StatusOr<bool> PageInForReuse(EngineImpl& e, const Segment& seg) {
  const Segment& owner = seg.values_owner();
  if (!owner.values_in_store) return false;
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentUsage u, e.store_->Usage(owner.id));
  if (u.state == storage::SegmentState::kResident || u.state == storage::SegmentState::kBuilding) {
    return false;
  }
  KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, e.store_->Pin(owner.id));
  return true;  // resident now, most recently used; the pin goes, Attach pins it again
}

// page_in (CreateSession): a matched segment whose values were spilled is paged in before
// it is reused, so that one that cannot be read back ends the reuse (the session ingests
// those tokens itself) instead of failing the session's decode steps later.
static ReuseMatch FindReusable(EngineImpl& e, const storage::PrefixHasher& hasher,
                               absl::Span<const int32_t> tokens, bool need_durable, bool page_in) {
  ReuseMatch out;
  std::vector<storage::PrefixKey> keys = hasher.Chain(tokens);
  if (keys.empty()) return out;  // shorter than a block: nothing of it is ever cached
  storage::PrefixMatch m = e.prefix_.Lookup(keys);
  int64_t pos = 0;
  std::optional<PrefixStop> stop;
  for (storage::SegmentRef& ref : m.chain) {
    std::shared_ptr<const Segment> seg;
    {
      base::MutexLock lock(&e.seg_mu_);
      auto it = e.registered_.find(ref.segment());
      if (it != e.registered_.end()) seg = it->second;
    }
    // Not registered yet (its registration is under way) or not where the chain goes.
    if (!seg || seg->first_position != pos) break;
    const int64_t end = pos + seg->n_tokens;
    // Segments are reused whole: one that runs past the prompt's end, or whose tokens
    // after its last matched block differ from the prompt's, is not.
    if (end > int64_t(tokens.size()) ||
        !std::equal(seg->tokens.begin(), seg->tokens.end(), tokens.begin() + pos)) {
      stop = PrefixStop::kPartialSegment;
      break;
    }
    if (need_durable && !seg->durable) {
      stop = PrefixStop::kNotDurable;
      break;
    }
    // Room for the session's own segment and its open segment in the kernels' view.
    if (int64_t(out.chain.size()) >= kMaxReusedSegments) {
      stop = PrefixStop::kQuota;
      break;
    }
    if (page_in) {
      absl::StatusOr<bool> paged = PageInForReuse(e, *seg);
      if (!paged.ok()) {
        log::Event(spdlog::level::warn, "prefix_read_failure")
            .Str("segment", seg->id.ToHex())
            .Str("error", std::string(paged.status().message()));
        stop = PrefixStop::kReadFailure;
        break;
      }
      out.paged_in += *paged;
    }
    out.chain.push_back(seg);
    out.refs.push_back(std::move(ref));
    pos = end;
  }
  out.tokens = pos;
  if (stop) {
    out.stop = *stop;
  } else if (pos == int64_t(tokens.size())) {
    out.stop = PrefixStop::kFull;
  } else {
    // The chain ends before the prompt does: was the next block cached once?
    const int64_t b = hasher.block_tokens();
    const bool next_keyed = pos % b == 0 && pos / b < int64_t(keys.size());
    out.stop = next_keyed && e.prefix_.WasRemoved(keys[pos / b]) ? PrefixStop::kEvicted
                                                                  : PrefixStop::kAbsent;
  }
  return out;
}

// ---------------------------------------------------------------------------------------
// Sessions

absl::StatusOr<v1::CreateSessionResponse> EngineImpl::CreateSession(
    const Tenant& t, const v1::CreateSessionRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("CreateSession"));
  if (!r.has_model()) return absl::InvalidArgumentError("model is required");
  KVSHADE_ASSIGN_OR_RETURN(ModelInfo model, ResolveModel(r.model(), config_->limits));
  if (r.token_ids().empty()) {
    return absl::InvalidArgumentError("token_ids must not be empty (the prompt to cache)");
  }
  const absl::Span<const int32_t> tokens(r.token_ids().data(), r.token_ids().size());
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(tokens, 0, config_->limits, "token_ids"));
  if (r.label().size() > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("label must be <= 256 bytes, got ", r.label().size()));
  }
  KVSHADE_ASSIGN_OR_RETURN(ProfileInfo profile,
                           ResolveProfile(r.profile(), config_->profile, model, tokens.size()));
  if (!v1::AppendFsync_IsValid(r.append_fsync())) {
    return absl::InvalidArgumentError(
        absl::StrCat("append_fsync must be one of UNSPECIFIED, NO, EVERYSEC, ALWAYS, got ",
                     static_cast<int>(r.append_fsync())));
  }
  if (r.durable() && !spill_) {
    return absl::FailedPreconditionError(
        "durable sessions need a spill tier, and this server has none (spill_path is empty)");
  }

  auto s = std::make_shared<Session>();
  s->id = SessionManager::NewId();
  s->tenant = t.name;
  s->model = model;
  s->profile = profile;
  s->durable = r.durable();
  s->append_fsync = ResolveAppendFsync(s->durable, r.append_fsync());
  s->label = r.label();
  s->prompt.assign(tokens.begin(), tokens.end());
  s->created_unix_ms = sessions_.Now();
  s->tail.resize(model.layers);
  s->cache.resize(model.layers);
  s->captured_energy.assign(model.layers, 0.0);
  s->residual_energy.assign(model.layers, 0.0);
  s->drift.assign(model.layers, 0.0);

  // Prefix reuse: shadow and exact segments are content-addressed; mini keeps per-prompt
  // budgets (fractions of the prompt length), so its segments are not reusable by others.
  std::optional<PrefixStop> reuse_stop;  // no lookup for mini
  if (profile.kind != v1::PROFILE_KIND_MINI) {
    KVSHADE_ASSIGN_OR_RETURN(storage::PrefixHasher hasher, Hasher(t, model, profile));
    ReuseMatch m = FindReusable(*this, hasher, tokens, s->durable, /*page_in=*/true);
    ++prefix_lookups_;
    if (m.tokens > 0) ++prefix_hits_;
    sessions_.CountPrefixLookup(t.name, m.tokens > 0);
    metrics_->PrefixLookup(m.stop, tokens.size(), m.tokens, m.chain.size() - m.paged_in,
                           m.paged_in);
    reuse_stop = m.stop;
    s->chain = std::move(m.chain);
    s->prefix_refs = std::move(m.refs);
    s->reused_tokens = m.tokens;
  }
  if (profile.kind == v1::PROFILE_KIND_SHADOW && s->reused_tokens == 0 &&
      tokens.size() < size_t(profile.local_window + profile.chunk_size)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "token_ids: a shadow session needs at least local_window + chunk_size = ",
        profile.local_window + profile.chunk_size, " prompt tokens, got ", tokens.size(),
        " (use the auto, mini or exact profile for short prompts)"));
  }
  if (profile.kind == v1::PROFILE_KIND_MINI) {
    if (auto b = kernels::PyramidBudgets(model.layers, profile.mini_heavy_ratio); !b.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "profile.mini_heavy_ratio = ", profile.mini_heavy_ratio,
          " gives an invalid pyramid over ", model.layers, " layers: ", b.status().message()));
    }
  }
  s->tokens = s->reused_tokens;
  if (s->reused_tokens == tokens.size()) s->state = SessionState::kReady;
  KVSHADE_RETURN_IF_ERROR(sessions_.AddSession(s));
  if (s->state == SessionState::kReady && s->durable) {
    std::unique_lock lock(s->mu);
    if (absl::Status st = PersistSession(*s); !st.ok()) {
      lock.unlock();
      sessions_.RemoveSession(t.name, s->id).IgnoreError();
      return st;
    }
  }
  UpdateGauges();

  v1::CreateSessionResponse resp;
  resp.set_session_id(s->id);
  resp.set_reused_tokens(s->reused_tokens);
  resp.set_effective_profile(profile.kind);
  resp.set_tokens_to_ingest(tokens.size() - s->reused_tokens);
  log::Event(spdlog::level::info, "session_created")
      .Str("session", s->id)
      .Str("tenant", t.name)
      .Str("model", model.model_id)
      .Str("profile", v1::ProfileKind_Name(profile.kind))
      .Uint("tokens", tokens.size())
      .Uint("reused_tokens", s->reused_tokens)
      .Str("reuse_stop", reuse_stop ? PrefixStopName(*reuse_stop) : "none")
      .Bool("durable", s->durable);
  return resp;
}

absl::StatusOr<v1::LookupPrefixResponse> EngineImpl::LookupPrefix(
    const Tenant& t, const v1::LookupPrefixRequest& r) {
  if (!r.has_model()) return absl::InvalidArgumentError("model is required");
  KVSHADE_ASSIGN_OR_RETURN(ModelInfo model, ResolveModel(r.model(), config_->limits));
  const absl::Span<const int32_t> tokens(r.token_ids().data(), r.token_ids().size());
  KVSHADE_RETURN_IF_ERROR(ValidateTokens(tokens, 0, config_->limits, "token_ids"));
  KVSHADE_ASSIGN_OR_RETURN(ProfileInfo profile,
                           ResolveProfile(r.profile(), config_->profile, model, tokens.size()));
  v1::LookupPrefixResponse resp;
  if (profile.kind == v1::PROFILE_KIND_MINI || tokens.empty()) return resp;
  KVSHADE_ASSIGN_OR_RETURN(storage::PrefixHasher hasher, Hasher(t, model, profile));
  ReuseMatch m = FindReusable(*this, hasher, tokens, /*need_durable=*/false, /*page_in=*/false);
  ++prefix_lookups_;
  if (m.tokens > 0) ++prefix_hits_;
  sessions_.CountPrefixLookup(t.name, m.tokens > 0);
  metrics_->PrefixProbe(m.tokens > 0);
  resp.set_reusable_tokens(m.tokens);
  resp.set_cached_segments(m.chain.size());
  return resp;
}

absl::StatusOr<v1::ForkSessionResponse> EngineImpl::ForkSession(const Tenant& t,
                                                                const v1::ForkSessionRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("ForkSession"));
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> parent,
                           sessions_.FindSession(t.name, r.parent_session_id()));
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(*parent, "ForkSession"));
  auto child = std::make_shared<Session>();
  {
    std::unique_lock lock(parent->mu);
    if (parent->state != SessionState::kReady) {
      return absl::FailedPreconditionError(
          absl::StrCat("session '", parent->id, "' is ", SessionStateName(parent->state),
                       "; only a ready session can be forked"));
    }
    const uint64_t at = r.at_token();
    std::vector<uint64_t> bounds;
    uint64_t pos = 0;
    for (const auto& seg : parent->chain) {
      pos += seg->n_tokens;
      bounds.push_back(pos);
    }
    size_t keep = parent->chain.size();
    const bool at_end = at == parent->tokens;
    if (!at_end) {
      auto it = std::find(bounds.begin(), bounds.end(), at);
      if (at == 0 || it == bounds.end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "at_token must be a committed segment boundary (one of [", absl::StrJoin(bounds, ", "),
            "]) or the end of the committed tokens (", parent->tokens, "), got ", at));
      }
      keep = size_t(it - bounds.begin()) + 1;
    } else {
      // Everything the parent has: its open segment is sealed so that both share it, merged
      // with the parent's sealed appended segments as far as it takes to leave room for a
      // later open segment in the kernels' view (append.cc "Compaction"). Only a chain of
      // more segments that cannot merge than a session gets today (a durable session of a
      // version that reused 6 cached segments) has no such room.
      if (parent->open && parent->open->layers[0].n_chunks > 0 && !PlanCompaction(*parent).fits) {
        return absl::FailedPreconditionError(absl::StrCat(
            "forking session '", parent->id, "' at its end would give it more than ",
            kernels::kMaxSegments, " segments: it holds ", PlanCompaction(*parent).fixed,
            " segments that cannot merge (cached prefixes and its own ingested segment); fork "
            "at a segment boundary or create a new session over the whole token list (its "
            "cached prefix is reused)"));
      }
      KVSHADE_RETURN_IF_ERROR(SealOpen(*parent));
      // A durable parent whose seal merged segments names them in its record: the record is
      // written again (naming the merged one) before they may go.
      if (!parent->retired.empty()) KVSHADE_RETURN_IF_ERROR(PersistSession(*parent));
      keep = parent->chain.size();
      child->tail = parent->tail;
      child->appended_tokens = parent->appended_tokens;
    }
    child->id = SessionManager::NewId();
    child->tenant = t.name;
    child->model = parent->model;
    child->profile = parent->profile;
    child->durable = parent->durable;
    child->append_fsync = parent->append_fsync;
    child->label = parent->label;
    child->prompt.assign(parent->prompt.begin(),
                         parent->prompt.begin() + std::min<size_t>(at, parent->prompt.size()));
    child->created_unix_ms = sessions_.Now();
    child->chain.assign(parent->chain.begin(), parent->chain.begin() + keep);
    child->tokens = at;
    child->reused_tokens = at;
    child->state = SessionState::kReady;
    if (child->tail.empty()) child->tail.resize(child->model.layers);
    child->cache.resize(child->model.layers);
    child->captured_energy = parent->captured_energy;
    child->residual_energy = parent->residual_energy;
    child->drift.assign(child->model.layers, 0.0);
  }
  for (const auto& seg : child->chain) {
    if (!seg->prefix_key) continue;
    auto ref = prefix_.Acquire(seg->id);
    if (ref.ok()) child->prefix_refs.push_back(std::move(ref).value());
  }
  KVSHADE_RETURN_IF_ERROR(sessions_.AddSession(child));
  if (child->durable) {
    std::unique_lock lock(child->mu);
    if (absl::Status st = PersistSession(*child); !st.ok()) {
      lock.unlock();
      sessions_.RemoveSession(t.name, child->id).IgnoreError();
      return st;
    }
  }
  UpdateGauges();
  v1::ForkSessionResponse resp;
  resp.set_session_id(child->id);
  resp.set_shared_tokens(child->tokens);
  log::Event(spdlog::level::info, "session_forked")
      .Str("session", child->id)
      .Str("parent", r.parent_session_id())
      .Str("tenant", t.name)
      .Uint("shared_tokens", child->tokens);
  return resp;
}

absl::StatusOr<v1::SessionInfo> EngineImpl::GetSession(const Tenant& t,
                                                       const v1::GetSessionRequest& r) {
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_.FindSession(t.name, r.session_id()));
  v1::SessionInfo info;
  const int attachments = sessions_.AttachmentCount(*s);
  std::shared_lock lock(s->mu);
  info.set_session_id(s->id);
  info.set_model_id(s->model.model_id);
  info.set_profile(s->profile.kind);
  info.set_tokens(s->tokens);
  info.set_reused_tokens(s->reused_tokens);
  info.set_attachments(static_cast<uint32_t>(attachments));
  info.set_durable(s->durable);
  info.set_append_fsync(s->append_fsync);
  info.set_state(std::string(SessionStateName(s->state)));
  if (s->damaged.load()) {
    std::lock_guard<std::mutex> damage_lock(s->damage_mu);
    info.set_state("damaged");
    info.set_damaged(true);
    info.set_damage(s->damage);
    info.set_tokens_lost(s->tokens_lost);
  }
  // Its own segments: those past the prefix it reused from the cache (its own ingest's are
  // registered as prefixes too, and still its own).
  uint64_t gpu = 0, host = 0, pos = 0;
  for (const auto& seg : s->chain) {
    pos += seg->n_tokens;
    if (seg->prefix_key && pos <= s->reused_tokens) continue;  // reused: another's
    gpu += seg->DeviceBytes();
    host += seg->HostBytes();
  }
  if (s->open) {
    gpu += s->open->DeviceBytes();
    host += s->open->HostBytes();
  }
  info.set_gpu_bytes(gpu);
  info.set_host_bytes(host);
  info.set_label(s->label);
  info.set_layers_ingested(s->state == SessionState::kReady ? s->model.layers
                                                            : s->layers_ingested.load());
  info.set_value_codec(CodecToProto(s->profile.codec.codec));
  if (r.include_selection()) FillSelectionHealth(s->selection, info.mutable_selection());
  return info;
}

absl::StatusOr<v1::ListSessionsResponse> EngineImpl::ListSessions(const Tenant& t) {
  SessionManager::UntouchedScope listing;  // listing keeps no session from idle expiry
  v1::ListSessionsResponse resp;
  for (const auto& s : sessions_.ListSessions(t.name)) {
    v1::GetSessionRequest req;
    req.set_session_id(s->id);
    auto info = GetSession(t, req);
    if (info.ok()) *resp.add_sessions() = std::move(info).value();
  }
  return resp;
}

absl::StatusOr<v1::CloseSessionResponse> EngineImpl::CloseSession(
    const Tenant& t, const v1::CloseSessionRequest& r) {
  // A durable session's record goes first, while the session is still registered: when the
  // delete fails (a storage fault), the close answers its error and the session stays as
  // it was, so that a restart never brings back a session whose close was acknowledged.
  if (spill_) {
    auto found = sessions_.FindSession(t.name, r.session_id());
    if (found.ok() && (*found)->durable) {
      Session& d = **found;
      std::unique_lock lock(d.mu);
      if (d.state != SessionState::kClosed) {
        if (absl::Status st = DeleteDurableRecord(d); !st.ok()) {
          return absl::Status(st.code(), absl::StrCat("CloseSession: session '", d.id,
                                                      "' is durable and its record could not be "
                                                      "deleted; it stays open (retry the close): ",
                                                      st.message()));
        }
        // Nothing writes its record again (appends, commits and refactorizations check it).
        d.state = SessionState::kClosed;
      }
    }
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s,
                           sessions_.RemoveSession(t.name, r.session_id()));
  std::vector<std::shared_ptr<const Segment>> chain;
  std::shared_ptr<Segment> open;
  std::vector<storage::SegmentRef> refs;
  std::vector<std::shared_ptr<const Segment>> quarantined;
  {
    std::unique_lock lock(s->mu);
    s->state = SessionState::kClosed;
    quarantined.swap(s->quarantined);
    chain.swap(s->chain);
    open.swap(s->open);
    refs.swap(s->prefix_refs);
    s->tail.clear();
    s->cache.clear();
    s->refactor_keys.clear();
  }
  refs.clear();
  chain.clear();
  quarantined.clear();
  open.reset();
  UpdateGauges();
  log::Event(spdlog::level::info, "session_closed").Str("session", s->id).Str("tenant", t.name);
  return v1::CloseSessionResponse();
}

// ---------------------------------------------------------------------------------------
// Attachments

absl::StatusOr<std::shared_ptr<PeerSlots>> PeerSlots::Open(kernels::Backend& backend,
                                                           const v1::CudaIpcSlotBuffers& b,
                                                           uint64_t need_bytes) {
  if (b.bytes() < need_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc.bytes must be >= ", need_bytes,
        " (L * h * slots_per_head * C * d bf16 per buffer), got ", b.bytes()));
  }
  if (b.k_offset() % 16 != 0 || b.v_offset() % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc offsets must be multiples of 16, got k_offset ", b.k_offset(), ", v_offset ",
        b.v_offset()));
  }
  const bool shared = b.k_handle() == b.v_handle();
  if (shared && b.k_offset() < b.v_offset() + need_bytes && b.v_offset() < b.k_offset() + need_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda_ipc: the K and V buffers overlap in one allocation (k_offset ", b.k_offset(),
        ", v_offset ", b.v_offset(), ", ", need_bytes, " bytes each)"));
  }
  auto p = std::make_shared<PeerSlots>();
  p->backend = &backend;
  KVSHADE_ASSIGN_OR_RETURN(kernels::PeerBuffer km, backend.OpenPeerBuffer(b.k_handle()));
  p->maps.push_back(km);
  kernels::PeerBuffer vm = km;
  if (!shared) {
    KVSHADE_ASSIGN_OR_RETURN(vm, backend.OpenPeerBuffer(b.v_handle()));
    p->maps.push_back(vm);
  }
  for (const auto& [name, map, offset] :
       {std::tuple{"k", km, b.k_offset()}, std::tuple{"v", vm, b.v_offset()}}) {
    if (offset + need_bytes > map.bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_ipc: the ", name, " allocation has ", map.bytes, " bytes; offset ", offset,
          " + ", need_bytes, " bytes of slots do not fit"));
    }
  }
  p->k = reinterpret_cast<kernels::bf16*>(static_cast<std::byte*>(km.base) + b.k_offset());
  p->v = reinterpret_cast<kernels::bf16*>(static_cast<std::byte*>(vm.base) + b.v_offset());
  return p;
}

PeerSlots::~PeerSlots() {
  for (const kernels::PeerBuffer& m : maps) {
    absl::Status st = backend->ClosePeerBuffer(m);
    if (!st.ok()) spdlog::warn("closing a CUDA IPC slot buffer: {}", std::string(st.message()));
  }
}

absl::StatusOr<v1::AttachResponse> EngineImpl::Attach(const Tenant& t, const v1::AttachRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotDraining("Attach"));
  if (r.worker_id().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_id must be <= 128 bytes, got ", r.worker_id().size()));
  }
  if (!v1::DeliveryMode_IsValid(r.delivery())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "delivery must be DELIVERY_MODE_INLINE, _UCX_RMA or _CUDA_IPC, got ", r.delivery()));
  }
  const bool ipc = r.delivery() == v1::DELIVERY_MODE_CUDA_IPC;
  if (r.has_cuda_ipc() != ipc) {
    return absl::InvalidArgumentError(
        ipc ? "delivery DELIVERY_MODE_CUDA_IPC needs cuda_ipc (the worker's slot buffers)"
            : "cuda_ipc is only for delivery DELIVERY_MODE_CUDA_IPC");
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Session> s, sessions_.FindSession(t.name, r.session_id()));
  KVSHADE_RETURN_IF_ERROR(CheckNotDamaged(*s, "Attach"));
  const SlotLayout layout = SlotLayout::Of(s->model, s->profile);
  const uint32_t slots = layout.slots_per_head;
  const uint64_t slot_bytes = layout.BufferBytes();
  std::shared_ptr<PeerSlots> peer;
  if (ipc) {
    if (slots == 0) {
      return absl::InvalidArgumentError(
          "delivery DELIVERY_MODE_CUDA_IPC needs a session that selects chunks (a shadow "
          "profile); this one has no slots to deliver");
    }
    // Mapped before the attachment exists, so a bad handle leaves nothing behind.
    KVSHADE_ASSIGN_OR_RETURN(peer, PeerSlots::Open(*backend_, r.cuda_ipc(), slot_bytes));
  }
  KVSHADE_ASSIGN_OR_RETURN(std::shared_ptr<Attachment> a,
                           sessions_.Attach(t.name, s, r.worker_id(), r.lease_ms(), r.writer()));
  v1::AttachResponse resp;
  resp.set_attachment_id(a->id);
  resp.set_lease_expires_unix_ms(sessions_.LeaseExpiry(*a));
  resp.set_chunk_size(s->profile.chunk_size);
  resp.set_slots_per_head(slots);
  resp.set_local_window(s->profile.local_window);
  resp.set_writer(a->writer);
  a->delivery = r.delivery();
  a->peer_slots = std::move(peer);
  resp.set_delivery(r.delivery());
  resp.set_slot_buffer_bytes(slot_bytes);
  // Page the session's spilled values in ahead of its first decode step. Synchronous: the
  // store has no prefetch thread (Init), so Prefetch runs inline and Attach answers once
  // they are resident. A read that fails fails the Attach with its error (UNAVAILABLE for
  // an I/O error, DATA_LOSS for bytes that fail their checksum), and the attachment is
  // undone: a worker is never attached to a session whose values cannot be read.
  std::vector<storage::SegmentId> ids;
  {
    std::shared_lock<std::shared_mutex> lock(s->mu);
    for (const auto& seg : s->chain) {
      const Segment& owner = seg->values_owner();
      if (owner.values_in_store) ids.push_back(owner.id);
    }
  }
  if (!ids.empty()) {
    auto paged = std::make_shared<absl::Status>();
    store_->Prefetch(std::move(ids), [paged](absl::Status st) { *paged = std::move(st); });
    if (!paged->ok()) {
      (void)sessions_.Detach(t.name, a->id);
      NoteReadFailure(*s, *paged).IgnoreError();
      log::Event(spdlog::level::warn, "attach_page_in_failed")
          .Str("session", s->id)
          .Str("tenant", t.name)
          .Status(*paged);
      return absl::Status(paged->code(), absl::StrCat("attach: paging in the values of session '", s->id,
                                                      "' failed: ", paged->message()));
    }
  }
  UpdateGauges();
  log::Event(spdlog::level::info, "attached")
      .Str("attachment", a->id)
      .Str("session", s->id)
      .Str("tenant", t.name)
      .Str("worker", r.worker_id())
      .Bool("writer", a->writer)
      .Str("delivery", v1::DeliveryMode_Name(r.delivery()));
  return resp;
}

absl::StatusOr<v1::DetachResponse> EngineImpl::Detach(const Tenant& t, const v1::DetachRequest& r) {
  KVSHADE_RETURN_IF_ERROR(sessions_.Detach(t.name, r.attachment_id()));
  DropExports(r.attachment_id());
  UpdateGauges();
  log::Event(spdlog::level::info, "detached").Str("attachment", r.attachment_id()).Str("tenant", t.name);
  return v1::DetachResponse();
}

// ---------------------------------------------------------------------------------------
// Views and caches

absl::StatusOr<storage::SegmentPin> EngineImpl::PinValues(const Session& s, const Segment& owner) {
  absl::StatusOr<storage::SegmentPin> pin = store_->Pin(owner.id);
  if (!pin.ok()) {
    NoteReadFailure(s, pin.status()).IgnoreError();
    return absl::Status(pin.status().code(),
                        absl::StrCat("values of a segment of session '", s.id,
                                     "' are unavailable: ", pin.status().message()));
  }
  return pin;
}

absl::StatusOr<LayerViewHold> EngineImpl::BuildView(const Session& s, int layer) {
  LayerViewHold hold;
  kernels::SessionLayerView& v = hold.view;
  auto add = [&](const Segment& seg) -> absl::Status {
    const LayerData& d = seg.data(layer);
    const LayerData& own = seg.layers[layer];
    if (d.n_chunks == 0) return absl::OkStatus();
    if (v.n_segments == kernels::kMaxSegments) return TooManySegmentsError(s.id);
    if (!own.basis || !own.a) {
      return absl::InternalError(absl::StrCat("segment of session '", s.id, "' has no factors"));
    }
    if (v.b == nullptr) {
      v.b = static_cast<const kernels::bf16*>(own.basis->b.data());
      v.r = own.basis->r;
    } else if (own.basis->r != v.r) {
      return absl::InternalError("segments of one session disagree on the rank");
    }
    kernels::SegmentView& sv = v.segments[v.n_segments++];
    sv.n_chunks = d.n_chunks;
    sv.first_position = seg.first_position;
    sv.landmarks = static_cast<const kernels::bf16*>(d.landmarks.data());
    // Key signatures of the profile's width; a segment without them (written before they
    // existed) leaves sig null, and selection then reconstructs keys (decode::HasSignatures).
    sv.sig = d.sig && d.sig_bits == s.profile.key_signature_bits
                 ? static_cast<const std::byte*>(d.sig.data())
                 : nullptr;
    sv.excluded = d.excluded ? static_cast<const uint8_t*>(d.excluded.data()) : nullptr;
    sv.a = static_cast<const kernels::bf16*>(own.a->data());
    const Segment& vo = seg.values_owner();
    if (vo.values_in_store) {
      KVSHADE_ASSIGN_OR_RETURN(storage::SegmentPin pin, PinValues(s, vo));
      pin.layer(layer).FillView(&sv);
      hold.pins.push_back(std::move(pin));
    } else {
      sv.values = static_cast<const std::byte*>(d.open_values.buffer.data());
      sv.value_head_stride = d.open_values.head_stride();
      sv.value_chunk_stride = d.open_values.chunk_stride;
    }
    hold.total_chunks += d.n_chunks;
    return absl::OkStatus();
  };
  v.sig_bits = s.profile.key_signature_bits;
  for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add(*seg));
  if (s.open) KVSHADE_RETURN_IF_ERROR(add(*s.open));
  return hold;
}

absl::StatusOr<const StaticCache*> EngineImpl::GetCache(Session& s, int layer) {
  std::lock_guard<std::mutex> lock(s.cache_mu);
  StaticCache& c = s.cache[layer];
  const int h = s.model.shape.h, d = s.model.shape.d;
  const size_t row = size_t(d);
  bool rebuilt = false;
  if (c.static_version != s.static_version) {
    // Per head: every segment's static rows (exact, or dequantized INT2), in chain order.
    std::vector<std::vector<kernels::bf16>> hk(h), hv(h);
    std::vector<std::vector<int64_t>> hp(h);
    auto add_segment = [&](const Segment& seg) -> absl::Status {
      const LayerData& ld = seg.data(layer);
      if (ld.s_cap == 0) return absl::OkStatus();
      std::vector<kernels::bf16> k(size_t(h) * ld.s_cap * d), v(k.size());
      KVSHADE_RETURN_IF_ERROR(Download(k.data(), ld.sk.data(), Bf16Bytes(k.size())));
      KVSHADE_RETURN_IF_ERROR(Download(v.data(), ld.sv.data(), Bf16Bytes(v.size())));
      for (int hh = 0; hh < h; ++hh) {
        const size_t off = size_t(hh) * ld.s_cap * row;
        const size_t len = size_t(ld.s_len[hh]) * row;
        hk[hh].insert(hk[hh].end(), k.begin() + off, k.begin() + off + len);
        hv[hh].insert(hv[hh].end(), v.begin() + off, v.begin() + off + len);
        const size_t prow = size_t(hh) * ld.s_cap;
        for (int i = 0; i < ld.s_len[hh]; ++i) {
          hp[hh].push_back(prow + i < ld.s_pos.size() ? ld.s_pos[prow + i] : -1);
        }
      }
      return absl::OkStatus();
    };
    for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add_segment(*seg));
    if (s.open) KVSHADE_RETURN_IF_ERROR(add_segment(*s.open));
    int sn = 0;
    c.host_lengths.assign(h, 0);
    for (int hh = 0; hh < h; ++hh) {
      c.host_lengths[hh] = static_cast<int32_t>(hk[hh].size() / row);
      sn = std::max(sn, c.host_lengths[hh]);
    }
    c.s = sn;
    c.host_k.assign(size_t(h) * sn * row, kernels::bf16{});
    c.host_v.assign(c.host_k.size(), kernels::bf16{});
    c.host_pos.assign(size_t(h) * sn, -1);
    for (int hh = 0; hh < h; ++hh) {
      std::copy(hk[hh].begin(), hk[hh].end(), c.host_k.begin() + size_t(hh) * sn * row);
      std::copy(hv[hh].begin(), hv[hh].end(), c.host_v.begin() + size_t(hh) * sn * row);
      std::copy(hp[hh].begin(), hp[hh].end(), c.host_pos.begin() + size_t(hh) * sn);
    }
    c.k = DeviceBlock();
    c.v = DeviceBlock();
    c.lengths = DeviceBlock();
    if (sn > 0) {
      KVSHADE_ASSIGN_OR_RETURN(c.k, Upload(c.host_k.data(), Bf16Bytes(c.host_k.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.v, Upload(c.host_v.data(), Bf16Bytes(c.host_v.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.lengths, Upload(c.host_lengths.data(), h * 4, ArenaKind::kStatic));
    }
    c.static_version = s.static_version;
    rebuilt = true;
    c.tail_version = ~0ull;  // segment remainders live in the tail part: rebuild it too
  }
  if (c.tail_version != s.tail_version) {
    c.host_tk.clear();
    c.host_tv.clear();
    c.host_tail_pos.clear();
    const size_t tok = size_t(h) * d;
    // A remainder's rows that chunks of a later (open) segment cover left the tail.
    auto add_tail = [&](const Segment& seg) -> absl::Status {
      const LayerData& ld = seg.data(layer);
      const int skip = CoveredRemainderRows(s, seg, layer);
      if (ld.n_tail - skip <= 0) return absl::OkStatus();
      const size_t n = size_t(ld.n_tail - skip) * tok, off = size_t(skip) * tok;
      // The remainder is the segment's tokens after its chunks.
      const int64_t first = seg.first_position + int64_t(ld.n_chunks) * seg.chunk_size;
      for (int i = skip; i < ld.n_tail; ++i) c.host_tail_pos.push_back(first + i);
      const size_t at = c.host_tk.size();
      c.host_tk.resize(at + n);
      c.host_tv.resize(at + n);
      KVSHADE_RETURN_IF_ERROR(Download(c.host_tk.data() + at,
                                       static_cast<const kernels::bf16*>(ld.tk.data()) + off, Bf16Bytes(n)));
      return Download(c.host_tv.data() + at, static_cast<const kernels::bf16*>(ld.tv.data()) + off,
                      Bf16Bytes(n));
    };
    if (s.profile.kind != v1::PROFILE_KIND_EXACT) {
      for (const auto& seg : s.chain) KVSHADE_RETURN_IF_ERROR(add_tail(*seg));
      if (s.open) KVSHADE_RETURN_IF_ERROR(add_tail(*s.open));
    }
    const TailLayer& tl = s.tail[layer];
    c.host_tk.insert(c.host_tk.end(), tl.k.begin(), tl.k.end());
    c.host_tv.insert(c.host_tv.end(), tl.v.begin(), tl.v.end());
    c.t = static_cast<int>(c.host_tk.size() / tok);
    // The appended tail is the session's newest tokens.
    const int64_t appended = static_cast<int64_t>(tl.k.size() / tok);
    for (int64_t i = 0; i < appended; ++i) {
      c.host_tail_pos.push_back(static_cast<int64_t>(s.tokens) - appended + i);
    }
    c.tk = DeviceBlock();
    c.tv = DeviceBlock();
    if (c.t > 0) {
      KVSHADE_ASSIGN_OR_RETURN(c.tk, Upload(c.host_tk.data(), Bf16Bytes(c.host_tk.size()), ArenaKind::kStatic));
      KVSHADE_ASSIGN_OR_RETURN(c.tv, Upload(c.host_tv.data(), Bf16Bytes(c.host_tv.size()), ArenaKind::kStatic));
    }
    c.tail_version = s.tail_version;
    rebuilt = true;
  }
  // The uploads ran on the default stream; decode requests read the cache on their own.
  if (rebuilt) KVSHADE_RETURN_IF_ERROR(backend_->Synchronize());
  return &c;
}

// ---------------------------------------------------------------------------------------
// Stats, gauges, drain, maintenance

void EngineImpl::UpdateGauges() {
  const SessionCounts c = sessions_.Counts();
  metrics_->SetSessions(double(c.sessions));
  metrics_->SetAttachments(double(c.attachments));
  size_t segs = 0;
  {
    base::MutexLock lock(&seg_mu_);
    segs = registered_.size();
  }
  const storage::HostStoreStats hs = store_->Stats();
  metrics_->SetSegments(double(std::max(segs, hs.segments)));
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
  metrics_->SetDeviceHeld(double(as.capacity), double(as.pools));
  for (int k = 0; k < storage::kArenaKinds; ++k) {
    metrics_->SetTierBytes("device", storage::ArenaKindName(ArenaKind(k)),
                           double(as.used_by_kind[k]));
  }
  metrics_->SetTierBytes("host", "values", double(hs.resident_bytes));
  // What the spill tier holds now (durable write-through, restored and spilled segments'
  // values), not the running total of spill writes.
  if (spill_) metrics_->SetTierBytes("spill", "values", double(hs.spill_tier_bytes));
}

// Server-wide figures (every tenant's): for the operator, like /metrics. The Stats RPC
// answers per tenant (TenantStats).
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
// tenant (service/README.md "Stats").
static absl::StatusOr<v1::StatsResponse> TenantStats(EngineImpl& e, const Tenant& t) {
  e.UpdateGauges();
  const TenantUsage u = e.sessions_.Usage(t.name);
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
    absl::StatusOr<storage::SegmentUsage> su = e.store_->Usage(owner.id);
    if (!su.ok()) return;
    host += su->resident_bytes;
    if (su->on_spill_tier) spilled += su->value_bytes;
  };
  for (const auto& s : e.sessions_.ListSessions(t.name)) {
    std::shared_lock lock(s->mu);
    for (const auto& seg : s->chain) add(*seg);
    if (s->open) add(*s->open);
  }
  v1::StatsResponse r;
  r.set_backend(std::string(e.backend_->name()));
  r.set_sessions(u.sessions);
  r.set_attachments(u.attachments);
  r.set_segments(segments);
  r.set_device_bytes_used(device);
  r.set_device_bytes_budget(e.arena_->budget());
  r.set_device_bytes_held(e.arena_->capacity());  // server-wide, as the budget
  r.set_host_bytes_used(host);
  r.set_host_bytes_budget(e.store_->Stats().budget_bytes);
  r.set_spilled_bytes(spilled);
  r.set_prefix_lookups(u.prefix_lookups);
  r.set_prefix_hits(u.prefix_hits);
  r.set_chunks_selected(u.chunks_selected);
  r.set_chunk_hits(u.chunk_hits);
#ifdef KVSHADE_VERSION
  r.set_version(KVSHADE_VERSION);
#endif
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
static void ExpireIdleSessions(EngineImpl& e) {
  const uint32_t ttl_s = e.config_->limits.session_idle_ttl_s;
  if (ttl_s == 0 || e.draining_.load()) return;
  const std::vector<std::shared_ptr<Session>> idle = e.sessions_.RemoveIdle(int64_t{ttl_s} * 1000);
  for (const std::shared_ptr<Session>& s : idle) {
    std::vector<std::shared_ptr<const Segment>> chain;
    std::shared_ptr<Segment> open;
    std::vector<storage::SegmentRef> refs;
    {
      std::unique_lock lock(s->mu);
      s->state = SessionState::kClosed;
      chain.swap(s->chain);
      open.swap(s->open);
      refs.swap(s->prefix_refs);
      s->tail.clear();
      s->cache.clear();
      s->refactor_keys.clear();
    }
    if (s->durable && e.spill_) {
      if (absl::Status st = e.DeleteDurableRecord(*s); !st.ok()) {
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
  if (!idle.empty()) e.metrics_->SessionsExpired(idle.size());
}

int EngineImpl::RunMaintenance() {
  sessions_.ReapExpired();
  ExpireIdleSessions(*this);
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

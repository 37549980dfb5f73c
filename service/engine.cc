// Engine: the public shell over EngineImpl, the engine's set-up, its device memory and the
// helpers the engine's files share. The engine's other jobs live one per file
// (engine_impl.h lists them).
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
absl::StatusOr<v1::ForkSessionResponse> Engine::ForkShard(const Tenant& t,
                                                          const v1::ForkSessionRequest& r,
                                                          const std::string& logical_id) {
  return impl_->ForkSession(t, r, &logical_id);
}
absl::StatusOr<v1::CloseSessionResponse> Engine::CloseShard(const Tenant& t,
                                                            const v1::CloseSessionRequest& r) {
  return impl_->CloseSession(t, r, /*shard_ok=*/true);
}
std::vector<Engine::ShardRecord> Engine::TensorParallelShards() {
  return impl_->TensorParallelShards();
}
absl::Status Engine::MarkShardDamaged(const Tenant& t, const std::string& session_id,
                                      const std::string& what) {
  return impl_->MarkShardDamaged(t, session_id, what);
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
absl::StatusOr<v1::SlotTableResponse> Engine::SlotTable(const Tenant& t,
                                                        const v1::SlotTableRequest& r) {
  return impl_->SlotTable(t, r);
}
absl::StatusOr<Engine::SlotGeometry> Engine::AttachmentSlots(const Tenant& t,
                                                             const std::string& attachment_id) {
  return impl_->AttachmentSlots(t, attachment_id);
}
absl::StatusOr<v1::StatsResponse> Engine::Stats(const Tenant& t, const v1::StatsRequest&) {
  return impl_->Stats(t);
}
absl::Status Engine::Drain() { return impl_->Drain(); }
bool Engine::draining() const { return impl_->draining(); }
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
      spill_(options_.spill_tier), sessions_(config->limits, options_.clock) {
  sessions_.set_id_device(options_.device_index);
}

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
  ho.reclaim = [this](size_t) { return EvictIdlePrefix(); };
  KVSHADE_ASSIGN_OR_RETURN(store_, storage::HostValueStore::Create(*backend_, ho, spill_));
  store_link_ = std::make_shared<StoreLink>();
  store_link_->store = store_.get();
  staging_ = std::make_unique<storage::StagingPool>(*backend_, config_->host_budget_bytes / 8);
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

absl::StatusOr<DeviceBlock> EngineImpl::AllocNoEvict(size_t bytes, ArenaKind kind) {
  return arena_->Allocate(bytes, kind);
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

}  // namespace kvshade::service

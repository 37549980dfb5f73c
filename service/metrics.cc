// Prometheus metrics of the daemon. Names, types and labels are documented in
// docs/OPERATIONS.md ("Metrics"); keep the two in step. Label values come from small fixed
// sets (stage, tier, kind, code, result, reason, source); method names are capped so that a
// caller passing unexpected strings cannot blow up the series count.
#include "kvshade/service/metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <grpcpp/support/status.h>
#include <httplib.h>
#include <prometheus/text_serializer.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvshade::service {
namespace {

const std::set<std::string, std::less<>>& KnownTiers() {
  static const auto* s = new std::set<std::string, std::less<>>{"device", "host", "spill"};
  return *s;
}

// 25 us .. ~13 s, x2 per bucket: covers a cached select (tens of us) to a long ingest.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 25e-6; v < 15.0; v *= 2) b.push_back(v);
  return b;
}

prometheus::Histogram::BucketBoundaries FractionBuckets() {
  return {0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0};
}

const std::set<std::string, std::less<>>& KnownStages() {
  static const auto* s = new std::set<std::string, std::less<>>{
      "ingest_rope", "ingest_factorize", "ingest_compress", "ingest_project", "ingest_landmarks", "ingest_values",
      "ingest_heavy", "ingest_commit", "ingest_parts", "ingest_wait", "select", "reconstruct", "attend", "append", "compact", "spill",
      "page_in", "refactorize", "static_set", "decode_prepare", "deliver", "export"};
  return *s;
}

std::string Bounded(std::string_view v, const std::set<std::string, std::less<>>& known) {
  return known.count(v) ? std::string(v) : std::string("other");
}

// The `method` label: the KvShade service's RPC names and the UCX data plane's calls
// (docs/OPERATIONS.md "Metrics"); anything else is "other".
const std::set<std::string, std::less<>>& KnownMethods() {
  static const auto* s = new std::set<std::string, std::less<>>{
      "CreateSession", "Ingest", "ForkSession", "LookupPrefix", "AppendTokens", "GetSession",
      "ListSessions", "CloseSession", "Attach", "Detach", "GetStaticSet", "SlotTable", "CommitStaged",
      "SelectAndReconstruct", "Attend", "ExportSession", "Stats", "ucx/SelectAndReconstruct", "ucx/Attend",
      "ucx/AppendTokens", "ucx/Ingest", "ucx/Register", "ucx/Unregister"};
  return *s;
}

std::string MethodLabel(std::string_view method) { return Bounded(method, KnownMethods()); }

}  // namespace

std::string_view PrefixStopName(PrefixStop stop) {
  switch (stop) {
    case PrefixStop::kFull: return "full";
    case PrefixStop::kAbsent: return "absent";
    case PrefixStop::kEvicted: return "evicted";
    case PrefixStop::kPartialSegment: return "partial_segment";
    case PrefixStop::kNotDurable: return "not_durable";
    case PrefixStop::kQuota: return "quota";
    case PrefixStop::kReadFailure: return "read_failure";
  }
  return "absent";
}

std::string_view GrpcCodeName(int code) {
  static constexpr std::string_view kNames[] = {
      "OK",        "CANCELLED",           "UNKNOWN",        "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",      "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",    "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS",         "UNAUTHENTICATED"};
  if (code < 0 || code >= static_cast<int>(std::size(kNames))) return "UNKNOWN";
  return kNames[code];
}

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  using prometheus::BuildCounter;
  using prometheus::BuildGauge;
  using prometheus::BuildHistogram;
  auto& r = *registry_;
  rpc_seconds_ = &BuildHistogram()
                      .Name("kvshade_rpc_duration_seconds")
                      .Help("Server-side latency of each gRPC call, by method")
                      .Register(r);
  rpc_total_ = &BuildCounter()
                    .Name("kvshade_rpc_total")
                    .Help("gRPC calls finished, by method and status code")
                    .Register(r);
  stage_seconds_ = &BuildHistogram()
                        .Name("kvshade_stage_duration_seconds")
                        .Help("Latency of one pipeline stage (ingest steps, select, reconstruct, ...)")
                        .Register(r);
  tier_bytes_ = &BuildGauge()
                     .Name("kvshade_tier_bytes")
                     .Help("Bytes held per storage tier (device|host|spill) and kind of data")
                     .Register(r);
  tier_budget_ = &BuildGauge()
                      .Name("kvshade_tier_budget_bytes")
                      .Help("Configured budget per storage tier (device|host|spill); +Inf: unbounded, "
                            "0: no such tier")
                      .Register(r);
  auto device_gauge = [&r](const char* name, const char* help) {
    DeviceGauge g;
    g.family = &BuildGauge().Name(name).Help(help).Register(r);
    g.unlabelled = &g.family->Add({});
    return g;
  };
  device_held_ = device_gauge("kvshade_device_held_bytes",
                              "Device memory the daemon holds now: with device_growth, the steps its "
                              "data needs plus one of headroom; else the whole device_budget");
  device_pools_ = device_gauge("kvshade_device_allocations",
                               "Device allocations the daemon holds (steps of device_growth, or 1)");
  build_info_ = &BuildGauge()
                     .Name("kvshade_build_info")
                     .Help("Always 1; the labels say which build is running and on which backend")
                     .Register(r);
  for (const std::string& tier : KnownTiers()) {
    tier_bytes_->Add({{"tier", tier}, {"kind", "total"}}).Set(0);
  }
  sessions_ = device_gauge("kvshade_sessions", "Open sessions");
  attachments_ = device_gauge("kvshade_attachments", "Live worker attachments (leases not expired)");
  export_generations_ = device_gauge("kvshade_export_generations",
                                     "Same-node export generations that workers hold mapped");
  segments_ = device_gauge("kvshade_segments",
                           "Immutable compressed segments held (shared prefixes counted once)");
  // Every (result, reason) a lookup can end in exists from the start (0), so that rates
  // and ratios have their series before the first lookup. A miss never stops at the cap
  // on reused segments (it reused none), and a hit is the only way to reuse everything.
  auto& lookups = BuildCounter()
                      .Name("kvshade_prefix_lookups_total")
                      .Help("CreateSession prefix lookups, by result (hit: at least one token reused) "
                            "and the reason the reuse stopped where it did")
                      .Register(r);
  for (int stop = 0; stop < kPrefixStops; ++stop) {
    const std::string reason(PrefixStopName(PrefixStop(stop)));
    if (PrefixStop(stop) != PrefixStop::kFull && PrefixStop(stop) != PrefixStop::kQuota) {
      prefix_lookups_[0][stop] = &lookups.Add({{"result", "miss"}, {"reason", reason}});
    }
    prefix_lookups_[1][stop] = &lookups.Add({{"result", "hit"}, {"reason", reason}});
  }
  auto& prefix_tokens = BuildCounter()
                            .Name("kvshade_prefix_tokens_total")
                            .Help("Prompt tokens of CreateSession prefix lookups: requested (the "
                                  "token-level hit ratio's denominator) and reused from the cache")
                            .Register(r);
  prefix_requested_tokens_ = &prefix_tokens.Add({{"kind", "requested"}});
  prefix_reused_tokens_ = &prefix_tokens.Add({{"kind", "reused"}});
  auto& reused_segments = BuildCounter()
                              .Name("kvshade_prefix_reused_segments_total")
                              .Help("Cached segments reused by CreateSession, by where their values "
                                    "were: resident in host memory, or spilled and paged in by the lookup")
                              .Register(r);
  prefix_resident_segments_ = &reused_segments.Add({{"source", "resident"}});
  prefix_paged_in_segments_ = &reused_segments.Add({{"source", "spilled_and_paged_in"}});
  auto& probes = BuildCounter()
                     .Name("kvshade_prefix_probes_total")
                     .Help("LookupPrefix calls (a probe that reuses nothing), by result")
                     .Register(r);
  prefix_probes_[0] = &probes.Add({{"result", "miss"}});
  prefix_probes_[1] = &probes.Add({{"result", "hit"}});
  auto& splits = BuildCounter()
                     .Name("kvshade_prefix_splits_total")
                     .Help("Segment ends CreateSession cut an ingest at, by source: a client's "
                           "segment_ends hint, or an automatic end where a prompt's prefix "
                           "match ended inside a cached segment")
                     .Register(r);
  prefix_splits_[0] = &splits.Add({{"source", "hint"}});
  prefix_splits_[1] = &splits.Add({{"source", "automatic"}});
  chunks_selected_ = &BuildCounter()
                          .Name("kvshade_chunks_selected_total")
                          .Help("Chunks selected by select-and-reconstruct (hit-ratio denominator)")
                          .Register(r)
                          .Add({});
  chunk_hits_ = &BuildCounter()
                     .Name("kvshade_chunk_hits_total")
                     .Help("Selected chunks already in the attachment's slot table (no bytes moved)")
                     .Register(r)
                     .Add({});
  auto& selects = BuildCounter()
                      .Name("kvshade_decode_selects_total")
                      .Help("Select queries served, by the worker's purpose: synchronous, speculative "
                            "(for the next step) or correction (the query drifted from the speculated one)")
                      .Register(r);
  decode_selects_[0] = &selects.Add({{"purpose", "synchronous"}});
  decode_selects_[1] = &selects.Add({{"purpose", "speculative"}});
  decode_selects_[2] = &selects.Add({{"purpose", "correction"}});
  reconstruction_energy_ = &BuildHistogram()
                                .Name("kvshade_captured_energy_ratio")
                                .Help("Key energy captured by the rank-r basis, per layer factorized")
                                .Register(r)
                                .Add({}, FractionBuckets());
  projection_residual_ = &BuildHistogram()
                              .Name("kvshade_projection_residual_ratio")
                              .Help("Residual energy of suffix keys projected onto a cached basis, per layer")
                              .Register(r)
                              .Add({}, FractionBuckets());
  spill_bytes_ = &BuildCounter()
                      .Name("kvshade_spill_bytes_total")
                      .Help("Bytes written to the spill tier (RocksDB)")
                      .Register(r)
                      .Add({});
  spills_ = &BuildCounter().Name("kvshade_spills_total").Help("Spill operations").Register(r).Add({});
  page_in_bytes_ = &BuildCounter()
                        .Name("kvshade_page_in_bytes_total")
                        .Help("Bytes read back from the spill tier")
                        .Register(r)
                        .Add({});
  page_ins_ = &BuildCounter().Name("kvshade_page_ins_total").Help("Page-in operations").Register(r).Add({});
  evictions_ = &BuildCounter()
                    .Name("kvshade_evictions_total")
                    .Help("Segments evicted from a tier to make room")
                    .Register(r)
                    .Add({});
  ingested_tokens_ = &BuildCounter()
                          .Name("kvshade_ingested_tokens_total")
                          .Help("Tokens compressed by Ingest and AppendTokens (reused tokens excluded)")
                          .Register(r)
                          .Add({});
  sessions_expired_ = &BuildCounter()
                           .Name("kvshade_sessions_expired_total")
                           .Help("Sessions closed because no call touched them for "
                                 "limits.session_idle_ttl_s (durable ones included)")
                           .Register(r)
                           .Add({});
  sessions_damaged_ = &BuildCounter()
                          .Name("kvshade_sessions_damaged_total")
                          .Help("Sessions marked damaged (docs/OPERATIONS.md \"Damage\"), by cause: "
                                "wal (acknowledged appends dropped with a damaged write-ahead "
                                "log), record (a record failed its checksum or could not be read "
                                "at start), read (values failed their checksum where they were "
                                "read), tensor_parallel (a shard whose tensor-parallel session "
                                "lost another rank's shard)")
                          .Register(r);
  factorize_fallbacks_ = &BuildCounter()
                             .Name("kvshade_factorize_fallbacks_total")
                             .Help("Shadow layers whose factorization fell back from subspace "
                                   "iteration to the full eigensolver (a rank-deficient key "
                                   "block)")
                             .Register(r)
                             .Add({});
  ucx_pool_misses_ = &BuildCounter()
                          .Name("kvshade_ucx_receive_pool_misses_total")
                          .Help("UCX ingest parts and large appends received into an allocation "
                                "of their own: no buffer of the receive pool was free, or the "
                                "payload was larger than one (ucx.receive_buffers, "
                                "ucx.receive_buffer_bytes)")
                          .Register(r)
                          .Add({});
  errors_ = &BuildCounter()
                 .Name("kvshade_errors_total")
                 .Help("Failed gRPC calls, by status code")
                 .Register(r);
}

void Metrics::ObserveRpc(std::string_view method, int grpc_code, double seconds) {
  const std::string m = MethodLabel(method);
  rpc_seconds_->Add({{"method", m}}, LatencyBuckets()).Observe(seconds);
  rpc_total_->Add({{"method", m}, {"code", std::string(GrpcCodeName(grpc_code))}}).Increment();
  if (grpc_code != 0) Error(grpc_code);
}

void Metrics::ObserveStage(std::string_view stage, double seconds) {
  stage_seconds_->Add({{"stage", Bounded(stage, KnownStages())}}, LatencyBuckets()).Observe(seconds);
}

void Metrics::DeviceGauge::Set(std::string_view gpu, double v) {
  if (gpu.empty()) {
    if (unlabelled != nullptr) unlabelled->Set(v);
    return;
  }
  family->Add({{"gpu", std::string(gpu)}}).Set(v);
}

void Metrics::UseDeviceLabels(const std::vector<std::string>& gpus) {
  std::lock_guard<std::mutex> lock(tier_mu_);
  gpus_ = gpus;
  for (DeviceGauge* g : {&device_held_, &device_pools_, &sessions_, &attachments_,
                         &export_generations_, &segments_}) {
    if (g->unlabelled != nullptr) g->family->Remove(g->unlabelled);
    g->unlabelled = nullptr;
    for (const std::string& gpu : gpus) g->Set(gpu, 0);
  }
  for (const std::string& tier : KnownTiers()) {
    tier_bytes_->Remove(&tier_bytes_->Add({{"tier", tier}, {"kind", "total"}}));
    for (const std::string& gpu : gpus) {
      tier_bytes_->Add({{"tier", tier}, {"kind", "total"}, {"gpu", gpu}}).Set(0);
    }
  }
  for (auto it = tier_kinds_.begin(); it != tier_kinds_.end();) {
    it = std::get<0>(it->first).empty() ? tier_kinds_.erase(it) : std::next(it);
  }
}

void Metrics::SetTierBytes(std::string_view tier, std::string_view kind, double bytes,
                           std::string_view gpu) {
  // a = token coordinates A, b = per-head basis B (docs/ALGORITHM.md), as storage names them.
  static const std::set<std::string, std::less<>> kKinds = {
      "a", "b", "landmarks", "signatures", "static", "heavy", "tail", "slots", "values", "other"};
  if (kind == "total") return;  // kept below
  const std::string t = Bounded(tier, KnownTiers());
  const std::string k = Bounded(kind, kKinds);
  const std::string g(gpu);
  std::lock_guard<std::mutex> lock(tier_mu_);
  tier_kinds_[{g, t, k}] = bytes;
  double total = 0;
  for (auto it = tier_kinds_.lower_bound({g, t, ""});
       it != tier_kinds_.end() && std::get<0>(it->first) == g && std::get<1>(it->first) == t; ++it) {
    total += it->second;
  }
  prometheus::Labels labels = {{"tier", t}, {"kind", k}};
  if (!g.empty()) labels["gpu"] = g;
  tier_bytes_->Add(labels).Set(bytes);
  labels["kind"] = "total";
  tier_bytes_->Add(labels).Set(total);
}

void Metrics::SetDeviceHeld(double bytes, double pools, std::string_view gpu) {
  device_held_.Set(gpu, bytes);
  device_pools_.Set(gpu, pools);
}

void Metrics::SetTierBudget(std::string_view tier, double bytes, std::string_view gpu) {
  prometheus::Labels labels = {{"tier", Bounded(tier, KnownTiers())}};
  if (!gpu.empty()) labels["gpu"] = std::string(gpu);
  tier_budget_->Add(labels).Set(bytes);
}

void Metrics::SetBuildInfo(std::string_view version, std::string_view commit,
                           std::string_view backend) {
  std::lock_guard<std::mutex> lock(build_info_mu_);
  if (build_info_series_ != nullptr) build_info_->Remove(build_info_series_);
  build_info_series_ = &build_info_->Add({{"version", std::string(version)},
                                          {"commit", std::string(commit)},
                                          {"backend", std::string(backend)}});
  build_info_series_->Set(1);
}

void Metrics::SetSessions(double n, std::string_view gpu) { sessions_.Set(gpu, n); }
void Metrics::SetAttachments(double n, std::string_view gpu) { attachments_.Set(gpu, n); }
void Metrics::SetExportGenerations(double n, std::string_view gpu) {
  export_generations_.Set(gpu, n);
}
void Metrics::SetSegments(double n, std::string_view gpu) { segments_.Set(gpu, n); }

void Metrics::PrefixLookup(PrefixStop stop, uint64_t requested_tokens, uint64_t reused_tokens,
                           uint64_t resident_segments, uint64_t paged_in_segments) {
  const int i = static_cast<int>(stop);
  if (i >= 0 && i < kPrefixStops) {
    if (prometheus::Counter* c = prefix_lookups_[reused_tokens > 0 ? 1 : 0][i]) c->Increment();
  }
  prefix_requested_tokens_->Increment(static_cast<double>(requested_tokens));
  prefix_reused_tokens_->Increment(static_cast<double>(reused_tokens));
  prefix_resident_segments_->Increment(static_cast<double>(resident_segments));
  prefix_paged_in_segments_->Increment(static_cast<double>(paged_in_segments));
}

void Metrics::PrefixProbe(bool hit) { prefix_probes_[hit ? 1 : 0]->Increment(); }

void Metrics::PrefixSplits(uint64_t hinted, bool automatic) {
  if (hinted > 0) prefix_splits_[0]->Increment(double(hinted));
  if (automatic) prefix_splits_[1]->Increment();
}

void Metrics::ChunkSelection(uint64_t selected, uint64_t hits) {
  chunks_selected_->Increment(static_cast<double>(selected));
  chunk_hits_->Increment(static_cast<double>(hits));
}

void Metrics::DecodeSelect(int purpose) {
  const int i = purpose;
  if (i >= 0 && i < 3) decode_selects_[i]->Increment();
}

void Metrics::ReconstructionEnergy(double captured_energy) {
  reconstruction_energy_->Observe(captured_energy);
}
void Metrics::ProjectionResidual(double residual_energy) {
  projection_residual_->Observe(residual_energy);
}

void Metrics::Spill(uint64_t bytes) {
  spills_->Increment();
  spill_bytes_->Increment(static_cast<double>(bytes));
}
void Metrics::PageIn(uint64_t bytes) {
  page_ins_->Increment();
  page_in_bytes_->Increment(static_cast<double>(bytes));
}
void Metrics::Eviction() { evictions_->Increment(); }
void Metrics::IngestedTokens(uint64_t n) { ingested_tokens_->Increment(static_cast<double>(n)); }
void Metrics::SessionsExpired(uint64_t n) { sessions_expired_->Increment(static_cast<double>(n)); }
void Metrics::SessionDamaged(std::string_view cause) {
  sessions_damaged_->Add({{"cause", std::string(cause)}}).Increment();
}
void Metrics::FactorizeFallback() { factorize_fallbacks_->Increment(); }
void Metrics::UcxReceivePoolMisses(uint64_t n) { ucx_pool_misses_->Increment(static_cast<double>(n)); }
void Metrics::Error(int grpc_code) {
  errors_->Add({{"code", std::string(GrpcCodeName(grpc_code))}}).Increment();
}

// --- Process metrics ------------------------------------------------------------------------

namespace {

prometheus::MetricFamily OneValue(const char* name, const char* help, prometheus::MetricType type,
                                  double value) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
  return f;
}

std::string ReadProcFile(const char* path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  using prometheus::MetricType;
  std::vector<prometheus::MetricFamily> out;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  // /proc/self/stat: "pid (comm) state ..."; comm may hold spaces and parentheses, so the
  // fields are counted from the last ')'. After it: [0] = field 3 (state), [11] utime,
  // [12] stime, [19] starttime (ticks since boot), [20] vsize (bytes), [21] rss (pages).
  const std::string stat = ReadProcFile("/proc/self/stat");
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos && ticks > 0) {
    const std::vector<absl::string_view> f =
        absl::StrSplit(absl::string_view(stat).substr(paren + 1), ' ', absl::SkipEmpty());
    uint64_t utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (f.size() > 21 && absl::SimpleAtoi(f[11], &utime) && absl::SimpleAtoi(f[12], &stime) &&
        absl::SimpleAtoi(f[19], &start) && absl::SimpleAtoi(f[20], &vsize) &&
        absl::SimpleAtoi(f[21], &rss)) {
      out.push_back(OneValue("process_cpu_seconds_total", "Total user and system CPU time spent in seconds",
                             MetricType::Counter, static_cast<double>(utime + stime) / ticks));
      out.push_back(OneValue("process_resident_memory_bytes", "Resident memory size in bytes",
                             MetricType::Gauge, static_cast<double>(rss) * page));
      out.push_back(OneValue("process_virtual_memory_bytes", "Virtual memory size in bytes",
                             MetricType::Gauge, static_cast<double>(vsize)));
      // The boot time (btime in /proc/stat, seconds since the epoch) plus the start tick.
      for (absl::string_view line : absl::StrSplit(ReadProcFile("/proc/stat"), '\n')) {
        uint64_t btime = 0;
        if (absl::ConsumePrefix(&line, "btime ") && absl::SimpleAtoi(line, &btime)) {
          out.push_back(OneValue("process_start_time_seconds",
                                 "Start time of the process since unix epoch in seconds", MetricType::Gauge,
                                 static_cast<double>(btime) + static_cast<double>(start) / ticks));
          break;
        }
      }
    }
  }
  if (DIR* d = opendir("/proc/self/fd"); d != nullptr) {
    double n = 0;
    const int own = dirfd(d);
    while (const dirent* e = readdir(d)) {
      int fd = -1;
      if (absl::SimpleAtoi(e->d_name, &fd) && fd != own) ++n;  // not ".", "..", nor our own
    }
    closedir(d);
    out.push_back(OneValue("process_open_fds", "Number of open file descriptors", MetricType::Gauge, n));
  }
  rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    out.push_back(OneValue("process_max_fds", "Maximum number of open file descriptors", MetricType::Gauge,
                           rl.rlim_cur == RLIM_INFINITY ? HUGE_VAL : static_cast<double>(rl.rlim_cur)));
  }
  return out;
}

// --- /metrics over HTTP -------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& host, uint16_t port, std::shared_ptr<prometheus::Registry> registry) {
  std::unique_ptr<MetricsEndpoint> e(new MetricsEndpoint());
  e->registry_ = std::move(registry);
  e->server_ = std::make_unique<httplib::Server>();
  httplib::Server& srv = *e->server_;
  // One serving thread; a scraper that stalls cannot hold it for more than 2 s, and every
  // connection serves one request.
  srv.new_task_queue = [] { return new httplib::ThreadPool(1); };
  srv.set_read_timeout(2, 0);
  srv.set_write_timeout(2, 0);
  srv.set_keep_alive_max_count(1);
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, with which a second daemon
  // given the same port would bind it too and take half of the scrapes.
  srv.set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  MetricsEndpoint* self = e.get();
  srv.Get("/metrics", [self](const httplib::Request&, httplib::Response& res) {
    res.set_content(self->Scrape(), "text/plain; version=0.0.4; charset=utf-8");
  });
  srv.Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("kvshade-server: metrics at /metrics\n", "text/plain; charset=utf-8");
  });
  srv.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 404) res.set_content("not found; metrics are at /metrics\n", "text/plain; charset=utf-8");
  });
  // Binding first, so that a port in use or a bad address is an error here, not in the
  // serving thread.
  const int bound = port == 0 ? srv.bind_to_any_port(host) : (srv.bind_to_port(host, port) ? port : -1);
  if (bound < 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", host, ":", port,
                                               " (address unknown, or the port is in use)"));
  }
  e->port_ = bound;
  e->thread_ = std::thread([self] { self->server_->listen_after_bind(); });
  return e;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

std::string MetricsEndpoint::Scrape() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  for (auto& f : process_.Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace kvshade::service

// DeviceRouter (device_router.h): a daemon's devices, an engine each, and the routing of
// every call to the engine of the session or attachment it names.
#include "kvshade/service/device_router.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvshade/base/status_macros.h"
#include "kvshade/kernels/devices.h"
#include "kvshade/service/session_manager.h"
#include "device_fault.h"
#include "spill_storage.h"
#include "status_util.h"

namespace kvshade::service {
namespace {

bool LooksLikePciBusId(std::string_view id) {
  return std::count(id.begin(), id.end(), ':') == 2 && id.find('.') != std::string_view::npos;
}

// The spill directory of device i of n, and whether a directory holds a spill tier of its
// own (RocksDB's CURRENT file).
std::string DeviceSpillPath(const std::string& spill_path, size_t i) {
  return (std::filesystem::path(spill_path) / absl::StrCat("device-", i)).string();
}
bool HoldsSpillTier(const std::string& dir) {
  std::error_code ec;
  return std::filesystem::exists(std::filesystem::path(dir) / "CURRENT", ec);
}

// Checks that spill_path is laid out for `n` devices: one device keeps its tier in
// spill_path itself, several in spill_path/device-<i>. A layout of another daemon shape
// (durable sessions of devices this daemon does not have) fails the start rather than
// leave them unserved or restore them onto the wrong device.
absl::Status CheckSpillLayout(const std::string& spill_path, size_t n) {
  if (spill_path.empty()) return absl::OkStatus();
  std::error_code ec;
  std::vector<std::string> device_dirs;
  for (const auto& e : std::filesystem::directory_iterator(spill_path, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, "device-") && HoldsSpillTier(e.path().string())) {
      device_dirs.push_back(name);
    }
  }
  std::sort(device_dirs.begin(), device_dirs.end());
  if (n == 1) {
    if (!device_dirs.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spill_path '", spill_path, "' holds the spill tiers of a daemon with several devices (",
          absl::StrJoin(device_dirs, ", "), "), and this daemon has one device: start it with "
          "those devices (backend), or move the directories away"));
    }
    return absl::OkStatus();
  }
  if (HoldsSpillTier(spill_path)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spill_path '", spill_path, "' holds the spill tier of a daemon with one device, and "
        "this daemon has ", n, ": start it with one device, or give it another spill_path"));
  }
  for (const std::string& d : device_dirs) {
    size_t i = 0;
    if (!absl::SimpleAtoi(d.substr(7), &i) || i >= n) {
      return absl::FailedPreconditionError(absl::StrCat(
          "spill_path '", spill_path, "' holds the spill tier (and any durable sessions) of device ",
          d.substr(7), " (", d, "), and this daemon has ", n, " devices: start it with more "
          "devices (backend), or move that directory away"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

DeviceRouter::~DeviceRouter() {
  // Each engine before the spill tier it runs on.
  for (Device& d : devices_) {
    d.engine.reset();
    d.spill.reset();
  }
}

absl::StatusOr<std::unique_ptr<DeviceRouter>> DeviceRouter::Open(const ServerConfig& config,
                                                                  Metrics* metrics,
                                                                  DeviceRouterOptions options) {
  KVSHADE_ASSIGN_OR_RETURN(std::vector<kernels::DeviceName> names,
                           kernels::ParseDeviceList(config.backend));
  const size_t n = names.size();
  KVSHADE_RETURN_IF_ERROR(CheckSpillLayout(config.spill_path, n));
  std::unique_ptr<DeviceRouter> r(new DeviceRouter());
  r->devices_.resize(n);
  std::vector<std::string> gpus;
  for (size_t i = 0; i < n; ++i) {
    Device& d = r->devices_[i];
    d.name = names[i].name;
    d.ordinal = names[i].backend.device;
    if (n > 1) d.gpu = absl::StrCat(d.ordinal);
    auto backend = kernels::CreateBackend(d.name);
    if (!backend.ok()) {
      return absl::Status(backend.status().code(),
                          absl::StrCat("backend '", d.name, "': ", backend.status().message()));
    }
    d.backend = *std::move(backend);
    d.kind = std::string(d.backend->name());
    if (d.kind == "cuda") d.pci_bus_id = kernels::CudaPciBusId(d.ordinal);
    d.config = std::make_unique<ServerConfig>(config);
    d.config->backend = d.name;
    // An even share of the host budget, in whole 4 KiB pages (the value store's slabs are
    // a quarter of it, in 256-byte blocks).
    d.config->host_budget_bytes =
        n == 1 ? config.host_budget_bytes
               : std::max<uint64_t>(config.host_budget_bytes / n / 4096 * 4096, 4096);
    d.config->spill_budget_bytes = config.spill_budget_bytes / n;
    if (config.spill_budget_bytes != 0 && d.config->spill_budget_bytes == 0) {
      d.config->spill_budget_bytes = 1;
    }
    if (n > 1 && !config.spill_path.empty()) {
      d.config->spill_path = DeviceSpillPath(config.spill_path, i);
      std::error_code ec;
      std::filesystem::create_directories(d.config->spill_path, ec);
      if (ec) {
        return absl::UnavailableError(absl::StrCat("cannot create '", d.config->spill_path,
                                                   "' (device ", d.name, "): ", ec.message()));
      }
    }
    if (!d.gpu.empty()) gpus.push_back(d.gpu);
  }
  if (n > 1) metrics->UseDeviceLabels(gpus);
  for (size_t i = 0; i < n; ++i) {
    Device& d = r->devices_[i];
    auto spill = SpillStorage::Open(*d.config);
    if (!spill.ok()) {
      return n == 1 ? spill.status()
                    : absl::Status(spill.status().code(),
                                   absl::StrCat("device ", d.name, ": ", spill.status().message()));
    }
    d.spill = *std::move(spill);
    EngineOptions eo;
    eo.clock = options.clock;
    eo.background_thread = options.background_thread;
    eo.spill_tier = d.spill ? d.spill->tier() : nullptr;
    eo.device_name = d.name;
    eo.device_pci_bus_id = d.pci_bus_id;
    eo.device_index = n > 1 ? static_cast<int>(i) : -1;
    eo.metrics_gpu = d.gpu;
    auto engine = Engine::Create(d.backend.get(), d.config.get(), metrics, std::move(eo));
    if (!engine.ok()) {
      return n == 1 ? engine.status()
                    : absl::Status(engine.status().code(),
                                   absl::StrCat("device ", d.name, ": ", engine.status().message()));
    }
    d.engine = *std::move(engine);
  }
  r->RestoreTensorParallel();
  return r;
}

std::string DeviceRouter::DeviceNames() const {
  std::vector<std::string> names;
  for (const Device& d : devices_) names.push_back(d.name);
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<int> DeviceRouter::Resolve(std::string_view device) const {
  if (device.empty()) return 0;
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i].name == device) return static_cast<int>(i);
  }
  // "cuda:0" / "cpu:0" for a daemon's lone "cuda" / "cpu" (or "auto") device.
  if (absl::StatusOr<kernels::BackendName> b = kernels::ParseBackendName(device); b.ok()) {
    for (size_t i = 0; i < devices_.size(); ++i) {
      const Device& d = devices_[i];
      if (d.name.find(':') == std::string::npos && d.kind == b->kind && d.ordinal == b->device) {
        return static_cast<int>(i);
      }
    }
  } else if (LooksLikePciBusId(device)) {
    const std::string want = kernels::NormalizePciBusId(device);
    for (size_t i = 0; i < devices_.size(); ++i) {
      if (!devices_[i].pci_bus_id.empty() &&
          kernels::NormalizePciBusId(devices_[i].pci_bus_id) == want) {
        return static_cast<int>(i);
      }
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "device '", BoundedId(absl::string_view(device.data(), device.size())), "' is not one of this daemon's devices (", DeviceNames(),
      "; or a CUDA device's PCI bus id)"));
}

int DeviceRouter::DeviceOf(std::string_view id) const {
  if (devices_.size() == 1) return 0;
  const int d = SessionManager::DeviceOfId(id);
  return d >= 0 && static_cast<size_t>(d) < devices_.size() ? d : 0;
}

template <typename Ids>
absl::StatusOr<int> DeviceRouter::BatchDevice(const Ids& ids) const {
  if (ids.empty()) return 0;
  const int first = DeviceOf(ids[0]);
  for (size_t i = 1; i < ids.size(); ++i) {
    if (const int d = DeviceOf(ids[i]); d != first) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query ", i, "'s attachment is on device ", devices_[d].name, " and query 0's on ",
          devices_[first].name, ": one call serves the attachments of one device"));
    }
  }
  return first;
}

absl::StatusOr<v1::CreateSessionResponse> DeviceRouter::CreateSession(
    const Tenant& t, const v1::CreateSessionRequest& r) {
  if (r.has_tensor_parallel()) return CreateTensorParallel(t, r);
  KVSHADE_ASSIGN_OR_RETURN(const int d, Resolve(r.device()));
  return devices_[d].engine->CreateSession(t, r);
}

absl::StatusOr<v1::ForkSessionResponse> DeviceRouter::ForkSession(const Tenant& t,
                                                                  const v1::ForkSessionRequest& r) {
  if (std::optional<TpGroup> g = FindGroup(t, r.parent_session_id())) return ForkLogical(t, *g, r);
  return EngineFor(r.parent_session_id()).ForkSession(t, r);
}

absl::StatusOr<v1::LookupPrefixResponse> DeviceRouter::LookupPrefix(
    const Tenant& t, const v1::LookupPrefixRequest& r) {
  KVSHADE_ASSIGN_OR_RETURN(const int d, Resolve(r.device()));
  return devices_[d].engine->LookupPrefix(t, r);
}

absl::StatusOr<v1::SessionInfo> DeviceRouter::GetSession(const Tenant& t,
                                                         const v1::GetSessionRequest& r) {
  if (std::optional<TpGroup> g = FindGroup(t, r.session_id())) {
    absl::StatusOr<v1::SessionInfo> info = LogicalInfo(t, *g);
    if (absl::IsNotFound(info.status())) ForgetGoneGroup(g->id);
    return info;
  }
  return EngineFor(r.session_id()).GetSession(t, r);
}

absl::StatusOr<v1::ListSessionsResponse> DeviceRouter::ListSessions(
    const Tenant& t, const v1::ListSessionsRequest& r) {
  v1::ListSessionsResponse out;
  for (const Device& d : devices_) {
    KVSHADE_ASSIGN_OR_RETURN(v1::ListSessionsResponse part, d.engine->ListSessions(t, r));
    for (v1::SessionInfo& s : *part.mutable_sessions()) {
      // A shard is listed within its logical session (below).
      if (!s.has_tensor_parallel()) *out.add_sessions() = std::move(s);
    }
  }
  std::vector<TpGroup> groups;
  {
    base::MutexLock lock(&tp_mu_);
    for (const auto& [id, g] : tp_groups_) {
      if (g->tenant == t.name) groups.push_back(*g);
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const TpGroup& a, const TpGroup& b) { return a.id < b.id; });
  SessionManager::UntouchedScope listing;  // listing keeps no shard from idle expiry
  for (const TpGroup& g : groups) {
    absl::StatusOr<v1::SessionInfo> info = LogicalInfo(t, g);
    if (info.ok()) *out.add_sessions() = *std::move(info);
    if (absl::IsNotFound(info.status())) ForgetGoneGroup(g.id);
  }
  return out;
}

absl::StatusOr<v1::CloseSessionResponse> DeviceRouter::CloseSession(
    const Tenant& t, const v1::CloseSessionRequest& r) {
  if (FindGroup(t, r.session_id())) return CloseLogical(t, r.session_id());
  return EngineFor(r.session_id()).CloseSession(t, r);
}

absl::StatusOr<std::unique_ptr<Engine::IngestStream>> DeviceRouter::BeginIngest(
    const Tenant& t, const v1::IngestRequest& header) {
  KVSHADE_RETURN_IF_ERROR(CheckNotLogical(t, header.header().session_id(), "Ingest"));
  return EngineFor(header.header().session_id()).BeginIngest(t, header);
}

absl::StatusOr<v1::IngestResponse> DeviceRouter::Ingest(const Tenant& t,
                                                        absl::Span<const v1::IngestRequest> stream) {
  const std::string_view id = stream.empty() ? std::string_view() : stream[0].header().session_id();
  KVSHADE_RETURN_IF_ERROR(CheckNotLogical(t, id, "Ingest"));
  return EngineFor(id).Ingest(t, stream);
}

absl::StatusOr<v1::AppendTokensResponse> DeviceRouter::AppendTokens(
    const Tenant& t, const v1::AppendTokensRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotLogical(t, r.session_id(), "AppendTokens"));
  return EngineFor(r.session_id()).AppendTokens(t, r);
}

absl::StatusOr<v1::AttachResponse> DeviceRouter::Attach(const Tenant& t, const v1::AttachRequest& r) {
  KVSHADE_RETURN_IF_ERROR(CheckNotLogical(t, r.session_id(), "Attach"));
  const int d = DeviceOf(r.session_id());
  if (!r.device().empty()) {
    KVSHADE_ASSIGN_OR_RETURN(const int worker, Resolve(r.device()));
    if (worker != d) {
      // Only a session that exists (for this tenant) is named as being elsewhere; an
      // unknown one gets the engine's NOT_FOUND.
      v1::GetSessionRequest g;
      g.set_session_id(r.session_id());
      KVSHADE_RETURN_IF_ERROR(devices_[d].engine->GetSession(t, g).status());
      return absl::FailedPreconditionError(absl::StrCat(
          "session '", BoundedId(r.session_id()), "' is on device ", devices_[d].name,
          ", and the worker is on device ", devices_[worker].name,
          ": attach from a worker on its device, or create the session on the worker's"));
    }
  }
  return devices_[d].engine->Attach(t, r);
}

absl::StatusOr<v1::DetachResponse> DeviceRouter::Detach(const Tenant& t, const v1::DetachRequest& r) {
  return EngineFor(r.attachment_id()).Detach(t, r);
}

absl::StatusOr<v1::GetStaticSetResponse> DeviceRouter::GetStaticSet(
    const Tenant& t, const v1::GetStaticSetRequest& r) {
  return EngineFor(r.attachment_id()).GetStaticSet(t, r);
}

absl::StatusOr<v1::SlotTableResponse> DeviceRouter::SlotTable(const Tenant& t,
                                                              const v1::SlotTableRequest& r) {
  return EngineFor(r.attachment_id()).SlotTable(t, r);
}

absl::StatusOr<v1::CommitStagedResponse> DeviceRouter::CommitStaged(
    const Tenant& t, const v1::CommitStagedRequest& r) {
  return EngineFor(r.attachment_id()).CommitStaged(t, r);
}

absl::Status DeviceRouter::Select(const Tenant& t, const SelectRequestView& r, SelectResult* out) {
  std::vector<std::string_view> ids;
  ids.reserve(r.queries.size());
  for (const SelectQueryView& q : r.queries) ids.push_back(q.attachment_id);
  KVSHADE_ASSIGN_OR_RETURN(const int d, BatchDevice(ids));
  return devices_[d].engine->Select(t, r, out);
}

absl::Status DeviceRouter::Attend(const Tenant& t, const AttendRequestView& r, AttendResult* out) {
  std::vector<std::string_view> ids;
  ids.reserve(r.queries.size());
  for (const AttendQueryView& q : r.queries) ids.push_back(q.attachment_id);
  KVSHADE_ASSIGN_OR_RETURN(const int d, BatchDevice(ids));
  return devices_[d].engine->Attend(t, r, out);
}

absl::StatusOr<v1::SelectAndReconstructResponse> DeviceRouter::SelectAndReconstruct(
    const Tenant& t, const v1::SelectAndReconstructRequest& r) {
  std::vector<std::string_view> ids;
  for (const v1::SelectQuery& q : r.queries()) ids.push_back(q.attachment_id());
  KVSHADE_ASSIGN_OR_RETURN(const int d, BatchDevice(ids));
  return devices_[d].engine->SelectAndReconstruct(t, r);
}

absl::StatusOr<v1::AttendResponse> DeviceRouter::Attend(const Tenant& t, const v1::AttendRequest& r) {
  std::vector<std::string_view> ids;
  for (const v1::AttendQuery& q : r.queries()) ids.push_back(q.attachment_id());
  KVSHADE_ASSIGN_OR_RETURN(const int d, BatchDevice(ids));
  return devices_[d].engine->Attend(t, r);
}

absl::StatusOr<v1::SessionExport> DeviceRouter::ExportSession(const Tenant& t,
                                                              const v1::ExportSessionRequest& r) {
  return EngineFor(r.attachment_id()).ExportSession(t, r);
}

absl::StatusOr<Engine::SlotGeometry> DeviceRouter::AttachmentSlots(const Tenant& t,
                                                                  const std::string& attachment_id) {
  return EngineFor(attachment_id).AttachmentSlots(t, attachment_id);
}

absl::StatusOr<v1::StatsResponse> DeviceRouter::Stats(const Tenant& t, const v1::StatsRequest& r) {
  if (devices_.size() == 1) return devices_[0].engine->Stats(t, r);
  v1::StatsResponse out;
  for (size_t i = 0; i < devices_.size(); ++i) {
    KVSHADE_ASSIGN_OR_RETURN(v1::StatsResponse s, devices_[i].engine->Stats(t, r));
    if (i == 0) {
      out = s;  // backend, version, budgets (each device's)
      out.clear_devices();
    } else {
      out.set_sessions(out.sessions() + s.sessions());
      out.set_attachments(out.attachments() + s.attachments());
      out.set_segments(out.segments() + s.segments());
      out.set_device_bytes_used(out.device_bytes_used() + s.device_bytes_used());
      out.set_device_bytes_held(out.device_bytes_held() + s.device_bytes_held());
      out.set_host_bytes_used(out.host_bytes_used() + s.host_bytes_used());
      out.set_host_bytes_budget(out.host_bytes_budget() + s.host_bytes_budget());
      out.set_spilled_bytes(out.spilled_bytes() + s.spilled_bytes());
      out.set_prefix_lookups(out.prefix_lookups() + s.prefix_lookups());
      out.set_prefix_hits(out.prefix_hits() + s.prefix_hits());
      out.set_chunks_selected(out.chunks_selected() + s.chunks_selected());
      out.set_chunk_hits(out.chunk_hits() + s.chunk_hits());
    }
    for (v1::DeviceStats& d : *s.mutable_devices()) *out.add_devices() = std::move(d);
  }
  return out;
}

absl::Status DeviceRouter::Drain() {
  absl::Status first;
  for (Device& d : devices_) {
    absl::Status s = d.engine->Drain();
    if (!s.ok() && first.ok()) {
      first = devices_.size() == 1
                  ? s
                  : absl::Status(s.code(), absl::StrCat("device ", d.name, ": ", s.message()));
    }
  }
  return first;
}

bool DeviceRouter::draining() const { return devices_[0].engine->draining(); }

uint64_t DeviceRouter::LiveAttachments() {
  uint64_t n = 0;
  for (Device& d : devices_) n += d.engine->LiveAttachments();
  return n;
}

int DeviceRouter::RunMaintenance() {
  int n = 0;
  for (Device& d : devices_) n += d.engine->RunMaintenance();
  return n;
}

absl::Status DeviceRouter::DeviceFault() const {
  for (const Device& d : devices_) {
    absl::Status s = service::DeviceFault(*d.backend);  // with the test failpoint
    if (s.ok()) continue;
    if (devices_.size() == 1) return s;
    return absl::Status(s.code(), absl::StrCat("device ", d.name, ": ", s.message()));
  }
  return absl::OkStatus();
}

void DeviceRouter::ArmFaults() {
  for (Device& d : devices_) {
    if (d.spill) d.spill->ArmFaults();
  }
}

}  // namespace kvshade::service

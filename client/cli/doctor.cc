// `kvshade doctor`: see doctor.h. Every line is a measurement or a query of this host or
// the daemon; a failed step says what failed and what it returned. UCX is queried through
// its public UCT/UCP APIs; CUDA through the driver API found at run time (dlopen), so the
// tool runs the same on hosts with and without a GPU.
#include "doctor.h"

#include <dlfcn.h>
#include <sys/resource.h>
#include <ucp/api/ucp.h>
#include <uct/api/uct.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kvshade/base/stats.h"
#include "kvshade/client/tensor.h"
#include "kvshade/client/ucx_data_plane.h"
#include "kvshade/transport/ucx_core.h"
#include "synthetic.h"
#include "ucx_probe.h"

namespace kvshade::cli {
namespace {

namespace ucx = kvshade::transport::ucx;
using base::Percentile;
using synthetic::FormatBytes;
using Clock = std::chrono::steady_clock;

// One report line: "  ok    what", "  warn  what", "  FAIL  what", "        detail".
struct Report {
  bool failed = false;
  void Ok(const std::string& s) { std::printf("  ok    %s\n", s.c_str()); }
  void Warn(const std::string& s) { std::printf("  warn  %s\n", s.c_str()); }
  void Fail(const std::string& s) {
    failed = true;
    std::printf("  FAIL  %s\n", s.c_str());
  }
  void Info(const std::string& s) { std::printf("        %s\n", s.c_str()); }
  void Section(const char* name) { std::printf("[%s]\n", name); }
};

// --- UCX ------------------------------------------------------------------------------

// tl name -> devices, from every UCT component's memory domains (what `ucx_info -d` lists).
absl::StatusOr<std::map<std::string, std::set<std::string>>> UctTransports() {
  uct_component_h* components = nullptr;
  unsigned n = 0;
  if (ucs_status_t s = uct_query_components(&components, &n); s != UCS_OK) {
    return ucx::FromUcs(s, "uct_query_components");
  }
  std::map<std::string, std::set<std::string>> out;
  for (unsigned c = 0; c < n; ++c) {
    uct_component_attr_t attr{};
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_NAME | UCT_COMPONENT_ATTR_FIELD_MD_RESOURCE_COUNT;
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    std::vector<uct_md_resource_desc_t> mds(attr.md_resource_count);
    attr.field_mask = UCT_COMPONENT_ATTR_FIELD_MD_RESOURCES;
    attr.md_resources = mds.data();
    if (uct_component_query(components[c], &attr) != UCS_OK) continue;
    for (const auto& md_desc : mds) {
      uct_md_config_t* config = nullptr;
      if (uct_md_config_read(components[c], nullptr, nullptr, &config) != UCS_OK) continue;
      uct_md_h md = nullptr;
      const ucs_status_t open = uct_md_open(components[c], md_desc.md_name, config, &md);
      uct_config_release(config);
      if (open != UCS_OK) continue;
      uct_tl_resource_desc_t* tls = nullptr;
      unsigned ntl = 0;
      if (uct_md_query_tl_resources(md, &tls, &ntl) == UCS_OK) {
        for (unsigned t = 0; t < ntl; ++t) out[tls[t].tl_name].insert(tls[t].dev_name);
        uct_release_tl_resource_list(tls);
      }
      uct_md_close(md);
    }
  }
  uct_release_component_list(components);
  return out;
}

void CheckUcx(const client::ClientOptions& co, Report& r) {
  r.Section("ucx");
  r.Ok(absl::StrCat("UCX library ", ucp_get_version_string(), " (built against ", UCP_API_MAJOR, ".",
                    UCP_API_MINOR, ")"));
  auto tls = UctTransports();
  if (!tls.ok()) {
    r.Fail(absl::StrCat("cannot list UCT transports: ", std::string(tls.status().message())));
  } else if (tls->empty()) {
    r.Fail("UCT reports no transports (is libucx installed with its transport modules?)");
  } else {
    std::vector<std::string> parts;
    for (const auto& [tl, devs] : *tls) parts.push_back(absl::StrCat(tl, " (", absl::StrJoin(devs, ", "), ")"));
    r.Ok(absl::StrCat("transports: ", absl::StrJoin(parts, "; ")));
    const bool rdma = tls->count("rc_verbs") || tls->count("rc_mlx5") || tls->count("dc_mlx5") ||
                      tls->count("ud_verbs") || tls->count("ud_mlx5");
    if (!rdma) r.Info("no RDMA transport (rc/ud/dc): one-host transports and tcp only");
  }
  const char* env_tls = std::getenv("UCX_TLS");
  const std::string chosen = !co.ucx_transports.empty() ? co.ucx_transports
                             : (env_tls != nullptr && *env_tls) ? std::string(env_tls) + " (from $UCX_TLS)"
                                                                : std::string("UCX's choice");
  auto ctx = ucx::UcxContext::Create(co.ucx_transports);
  if (!ctx.ok()) {
    r.Fail(absl::StrCat("UCP context with UCX_TLS=", chosen, ": ", std::string(ctx.status().message())));
  } else {
    r.Ok(absl::StrCat("UCP context opens with UCX_TLS=", chosen));
  }
}

// --- CUDA (driver API at run time) ------------------------------------------------------

void CheckCuda(Report& r) {
  r.Section("cuda");
  if (const char* vis = std::getenv("CUDA_VISIBLE_DEVICES"); vis != nullptr) {
    r.Info(absl::StrCat("CUDA_VISIBLE_DEVICES=", vis));
  }
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    r.Ok(absl::StrCat("no driver (libcuda.so.1 not loadable: ", why ? why : "unknown",
                      "): CUDA IPC delivery unavailable on this host"));
    return;
  }
  using InitFn = int (*)(unsigned);
  using IntFn = int (*)(int*);
  using GetFn = int (*)(int*, int);
  using NameFn = int (*)(char*, int, int);
  using MemFn = int (*)(size_t*, int);
  using ErrFn = int (*)(int, const char**);
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "cuInit"));
  auto version = reinterpret_cast<IntFn>(dlsym(lib, "cuDriverGetVersion"));
  auto count = reinterpret_cast<IntFn>(dlsym(lib, "cuDeviceGetCount"));
  auto get = reinterpret_cast<GetFn>(dlsym(lib, "cuDeviceGet"));
  auto name = reinterpret_cast<NameFn>(dlsym(lib, "cuDeviceGetName"));
  auto mem = reinterpret_cast<MemFn>(dlsym(lib, "cuDeviceTotalMem_v2"));
  auto err_name = reinterpret_cast<ErrFn>(dlsym(lib, "cuGetErrorName"));
  auto err = [&](int code) {
    const char* s = nullptr;
    if (err_name != nullptr && err_name(code, &s) == 0 && s != nullptr) return std::string(s);
    return absl::StrCat("CUresult ", code);
  };
  if (init == nullptr || count == nullptr) {
    r.Warn("libcuda.so.1 loaded but lacks cuInit/cuDeviceGetCount");
    dlclose(lib);
    return;
  }
  int drv = 0;
  if (version != nullptr) version(&drv);
  const std::string drv_s = absl::StrCat(drv / 1000, ".", (drv % 1000) / 10);
  if (int rc = init(0); rc != 0) {
    r.Warn(absl::StrCat("driver ", drv_s, " present, cuInit failed: ", err(rc)));
    dlclose(lib);
    return;
  }
  int n = 0;
  if (int rc = count(&n); rc != 0) {
    r.Warn(absl::StrCat("driver ", drv_s, ", cuDeviceGetCount failed: ", err(rc)));
    dlclose(lib);
    return;
  }
  r.Ok(absl::StrCat("driver ", drv_s, ", ", n, " device(s) visible"));
  for (int i = 0; i < n && get != nullptr; ++i) {
    int dev = 0;
    if (get(&dev, i) != 0) continue;
    char buf[256] = {0};
    if (name != nullptr) name(buf, sizeof(buf) - 1, dev);
    size_t bytes = 0;
    if (mem != nullptr) mem(&bytes, dev);
    r.Info(absl::StrCat("device ", i, ": ", buf, ", ", FormatBytes(static_cast<double>(bytes))));
  }
  dlclose(lib);
}

// --- Pinned memory ------------------------------------------------------------------------

void CheckMemlock(Report& r) {
  r.Section("memlock");
  rlimit rl{};
  if (getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
    r.Warn("getrlimit(RLIMIT_MEMLOCK) failed");
    return;
  }
  auto fmt = [](rlim_t v) { return v == RLIM_INFINITY ? std::string("unlimited") : FormatBytes(static_cast<double>(v)); };
  const std::string line = absl::StrCat("RLIMIT_MEMLOCK soft ", fmt(rl.rlim_cur), ", hard ", fmt(rl.rlim_max));
  // Pinned slot buffers and UCX registrations of a real model are GiBs; a small limit
  // makes registration fail (or fall back to slower paths) without CAP_IPC_LOCK.
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < (rlim_t{1} << 30)) {
    r.Warn(absl::StrCat(line, ": pinned/registered host memory is capped there; raise it (ulimit -l, "
                              "LimitMEMLOCK= in the unit, the container's memlock ulimit)"));
  } else {
    r.Ok(line);
  }
}

// --- Daemon ---------------------------------------------------------------------------

std::string Canonical(v1::SelectAndReconstructResponse resp) {
  for (auto& d : *resp.mutable_deltas()) d.clear_attachment_id();
  return resp.SerializeAsString();
}

int CheckDaemon(const client::ClientOptions& co, const DoctorOptions& o, Report& r) {
  r.Section("daemon");
  client::ClientOptions go = co;
  go.use_ucx = false;  // this client is the gRPC reference; UCX is driven directly below
  auto conn = client::Client::Connect(go);
  if (!conn.ok()) {
    r.Fail(absl::StrCat("connect ", co.target, ": ", conn.status().ToString()));
    return 1;
  }
  client::Client& c = **conn;
  if (absl::Status s = c.WaitForServing(absl::Milliseconds(static_cast<int64_t>(o.wait_s * 1000))); !s.ok()) {
    r.Fail(std::string(s.message()));
    return 3;
  }
  auto st = c.Stats();
  if (!st.ok()) {
    r.Fail(absl::StrCat(co.target, " SERVING, but Stats failed: ", st.status().ToString(),
                        st.status().code() == absl::StatusCode::kUnauthenticated ? " (give --token)" : ""));
    return 1;
  }
  r.Ok(absl::StrCat(co.target, " SERVING: kvshade ", st->version(), ", backend ", st->backend()));

  // A throwaway session: random tokens (a fresh prefix, so the ingest really runs), one
  // small layer, shadow profile.
  synthetic::DocSpec spec;
  spec.layers = 1;
  spec.kv_heads = 1;
  spec.q_heads = 2;
  spec.head_dim = 32;
  spec.doc_tokens = 512;
  spec.question_tokens = 8;
  spec.needles = 1;
  spec.needle_span = 16;
  spec.latent_rank = 4;
  spec.seed = std::random_device{}();
  spec.model_id = "kvshade-doctor/probe";
  const synthetic::Document doc(spec);
  v1::Profile profile;
  profile.set_kind(v1::PROFILE_KIND_SHADOW);
  profile.set_rank(16);
  profile.set_chunk_size(8);
  profile.set_sparse_budget(8);
  profile.set_outliers(4);
  profile.set_local_window(32);
  v1::CreateSessionRequest create = synthetic::MakeCreate(doc, profile, -1);
  create.set_label("kvshade doctor (throwaway)");
  auto t0 = Clock::now();
  auto created = c.CreateSession(create);
  if (!created.ok()) {
    r.Fail(absl::StrCat("CreateSession: ", created.status().ToString()));
    return 1;
  }
  const std::string sid = created->session_id();
  std::vector<std::string> attachments;
  std::unique_ptr<client::UcxDataPlane> dp;
  // Everything below cleans up through this on every path.
  auto finish = [&](int rc) {
    dp.reset();  // BYE
    absl::Status cleanup = absl::OkStatus();
    for (const auto& a : attachments) {
      if (absl::Status s = c.Detach(a); !s.ok() && cleanup.ok()) cleanup = s;
    }
    if (absl::Status s = c.CloseSession(sid); !s.ok() && cleanup.ok()) cleanup = s;
    if (!cleanup.ok()) {
      r.Fail(absl::StrCat("cleanup: ", cleanup.ToString()));
      return 1;
    }
    r.Ok("cleanup: attachments detached, test session closed");
    return rc;
  };
  auto ing = synthetic::IngestRange(c, doc, sid, -1, static_cast<int64_t>(created->reused_tokens()),
                                    spec.doc_tokens);
  if (!ing.ok()) {
    r.Fail(absl::StrCat("Ingest: ", ing.status().ToString()));
    return finish(1);
  }
  r.Ok(absl::StrFormat("test session %s: %lld tokens created and ingested over gRPC in %.1f ms", sid,
                       static_cast<long long>(spec.doc_tokens),
                       1e3 * std::chrono::duration<double>(Clock::now() - t0).count()));

  auto attach = [&](const char* worker) -> absl::StatusOr<v1::AttachResponse> {
    v1::AttachRequest ar;
    ar.set_session_id(sid);
    ar.set_worker_id(worker);
    auto a = c.Attach(ar);
    if (a.ok()) attachments.push_back(a->attachment_id());
    return a;
  };
  auto ag = attach("kvshade-doctor-grpc");
  auto au = ag.ok() ? attach("kvshade-doctor-ucx") : ag;
  if (!ag.ok() || !au.ok()) {
    r.Fail(absl::StrCat("Attach: ", (ag.ok() ? au : ag).status().ToString()));
    return finish(1);
  }

  v1::SelectAndReconstructRequest sel;
  sel.set_layer(0);
  auto* q = sel.add_queries();
  q->set_attachment_id(ag->attachment_id());
  *q->mutable_q() = client::MakeBf16Tensor({spec.q_heads, spec.head_dim},
                                           absl::MakeConstSpan(doc.Query(0, 0, 0, spec.doc_tokens)));
  v1::SelectAndReconstructRequest sel_u = sel;
  sel_u.mutable_queries(0)->set_attachment_id(au->attachment_id());

  auto first_g = c.SelectAndReconstruct(sel);
  if (!first_g.ok()) {
    r.Fail(absl::StrCat("select over gRPC: ", first_g.status().ToString()));
    return finish(1);
  }
  std::vector<double> grpc_us;
  for (int i = 0; i < o.repeats; ++i) {
    auto ts = Clock::now();
    auto g = c.SelectAndReconstruct(sel);
    if (!g.ok()) {
      r.Fail(absl::StrCat("select over gRPC: ", g.status().ToString()));
      return finish(1);
    }
    grpc_us.push_back(1e6 * std::chrono::duration<double>(Clock::now() - ts).count());
  }
  const std::string grpc_rtt = absl::StrFormat("p50 %.0f us, p99 %.0f us", Percentile(grpc_us, 0.5),
                                               Percentile(grpc_us, 0.99));

  // UCX: offered? reachable? admitted? identical?
  if (au->data_plane_address().empty()) {
    const std::string msg = "the daemon offers no UCX data plane (ucx.enable: false): clients use gRPC inline";
    if (o.require_ucx) r.Fail(msg); else r.Warn(msg);
    r.Ok(absl::StrCat("select over gRPC: ", first_g->deltas(0).chunk_size(), " chunks delivered; round trip ",
                      grpc_rtt, " (", o.repeats, " calls)"));
    return finish(r.failed ? 1 : 0);
  }
  auto lanes = UcxLanesTo(au->data_plane_address(), co.ucx_transports);
  client::UcxOptions uo;
  uo.transports = co.ucx_transports;
  uo.timeout = std::min(co.timeout, absl::Seconds(20));
  auto tc = Clock::now();
  auto conn_u = client::UcxDataPlane::Connect(au->data_plane_address(), au->data_plane_token(), uo);
  if (!conn_u.ok()) {
    r.Fail(absl::StrCat("UCX connect to the daemon's worker: ", conn_u.status().ToString(),
                        " (clients would fall back to gRPC inline)"));
    if (lanes.ok()) r.Info(absl::StrCat("lanes UCP chose: ", *lanes));
    return finish(1);
  }
  dp = *std::move(conn_u);
  r.Ok(absl::StrFormat("UCX connect + admission in %.1f ms, over %s",
                       1e3 * std::chrono::duration<double>(Clock::now() - tc).count(),
                       lanes.ok() ? *lanes : "(lanes unknown: " + std::string(lanes.status().message()) + ")"));
  auto first_u = dp->SelectAndReconstruct(sel_u);
  if (!first_u.ok()) {
    r.Fail(absl::StrCat("select over UCX: ", first_u.status().ToString()));
    return finish(1);
  }
  if (Canonical(*first_g) != Canonical(*first_u)) {
    r.Fail("select over UCX differs from the same select over gRPC");
    return finish(1);
  }
  std::vector<double> ucx_us;
  for (int i = 0; i < o.repeats; ++i) {
    auto ts = Clock::now();
    auto u = dp->SelectAndReconstruct(sel_u);
    if (!u.ok()) {
      r.Fail(absl::StrCat("select over UCX: ", u.status().ToString()));
      return finish(1);
    }
    ucx_us.push_back(1e6 * std::chrono::duration<double>(Clock::now() - ts).count());
  }
  r.Ok(absl::StrCat("select over UCX equals gRPC bit for bit (", first_u->deltas(0).chunk_size(),
                    " chunks delivered)"));
  r.Ok(absl::StrFormat("select round trip (batch 1, %d calls): UCX p50 %.0f us, p99 %.0f us; gRPC %s",
                       o.repeats, Percentile(ucx_us, 0.5), Percentile(ucx_us, 0.99), grpc_rtt));
  return finish(0);
}

}  // namespace

void AddDoctorOptions(CLI::App* app, DoctorOptions* o) {
  app->add_flag("--local", o->local_only, "Check this host only (no daemon test transfer)");
  app->add_flag("--require-ucx", o->require_ucx, "Fail when the daemon offers no UCX data plane");
  app->add_option("--repeats", o->repeats, "Select round trips timed per transport")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app->add_option("--wait", o->wait_s, "Seconds to wait for the daemon to be SERVING")->capture_default_str();
}

int RunDoctor(const client::ClientOptions& co, const DoctorOptions& o) {
  std::printf("kvshade doctor%s\n", o.local_only ? " (local checks only)" : absl::StrCat(": ", co.target).c_str());
  Report r;
  CheckUcx(co, r);
  CheckCuda(r);
  CheckMemlock(r);
  int rc = 0;
  if (!o.local_only) rc = CheckDaemon(co, o, r);
  if (rc == 0 && r.failed) rc = 1;
  std::printf("%s\n", rc == 0 ? "result: OK" : absl::StrCat("result: FAILED (exit ", rc, ")").c_str());
  return rc;
}

}  // namespace kvshade::cli

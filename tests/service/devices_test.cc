// A daemon with several devices (docs/OPERATIONS.md "Devices"), on independent CPU devices
// ("cpu:0,cpu:1"): the backend list and its checks, placement by CreateSessionRequest.device,
// every call routed to the session's device, forks on their parent's, per-device budgets,
// stats and gauges, the device check of Attach, and durable sessions restored onto their
// devices (and a restart with fewer devices refused).
#include <filesystem>

#include "kvshade/kernels/devices.h"
#include "kvshade/service/device_router.h"
#include "kvshade/service/session_manager.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace devices_test {
namespace {

// The router harness at rank 128 (RouterHarness).
class Devices : public RouterHarness {
 public:
  explicit Devices(std::string backend = "cpu:0,cpu:1", std::string spill_path = "",
                   uint64_t device_budget = 256ull << 20)
      : RouterHarness(std::move(backend), std::move(spill_path), device_budget) {
    config.profile.rank = 128;
    absl::Status s = Start();
    EXPECT_TRUE(s.ok()) << s;
  }

  // Creates a session for `s` on `device`, ingests it and attaches (as `worker_device`
  // when given).
  struct Opened {
    std::string session, attachment, device;
  };
  Opened Open(const Stream& s, const std::string& device, bool durable = false) {
    Opened o;
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = model;
    *cr.mutable_profile() = SmallShadowProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    cr.set_durable(durable);
    cr.set_device(device);
    auto c = router->CreateSession(tenant, cr);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return o;
    o.session = c->session_id();
    o.device = c->device();
    if (c->tokens_to_ingest() > 0) {
      auto ing = router->Ingest(tenant, IngestStreamOf(o.session, s, int(c->reused_tokens()), s.n()));
      EXPECT_TRUE(ing.ok()) << ing.status();
    }
    o.attachment = AttachTo(o.session);
    return o;
  }
  std::string AttachTo(const std::string& session, const std::string& worker_device = "") {
    v1::AttachRequest ar;
    ar.set_session_id(session);
    ar.set_worker_id("w");
    ar.set_device(worker_device);
    auto a = router->Attach(tenant, ar);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : "";
  }
  absl::StatusOr<v1::AttendResponse> AttendMany(const std::vector<std::string>& attachments,
                                                int layer, const std::vector<bf16>& q) {
    v1::AttendRequest r;
    r.set_layer(layer);
    for (const std::string& a : attachments) {
      auto* aq = r.add_queries();
      aq->set_attachment_id(a);
      *aq->mutable_q() = ToTensor(q, {int64_t(model.num_query_heads()), model.head_dim()});
    }
    return router->Attend(tenant, r);
  }
  absl::StatusOr<std::vector<float>> Attend(const std::string& attachment, int layer,
                                            const std::vector<bf16>& q) {
    auto r = AttendMany({attachment}, layer, q);
    if (!r.ok()) return r.status();
    return TensorF32(r->outputs(0));
  }
  absl::StatusOr<v1::SessionInfo> Info(const std::string& session) {
    v1::GetSessionRequest g;
    g.set_session_id(session);
    return router->GetSession(tenant, g);
  }
  std::vector<bf16> Query(uint64_t stream) {
    auto rng = kernels::testing::MakeRng(stream);
    return kernels::testing::RandomBf16(size_t(model.num_query_heads()) * model.head_dim(), rng, 1.0f);
  }
  v1::StatsResponse Stats() {
    auto s = router->Stats(tenant, v1::StatsRequest());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : v1::StatsResponse();
  }

  v1::ModelSpec model = TestModel();
};

// The value of `name`'s series with exactly these labels; -1 when there is none.
double Series(Metrics& m, const std::string& name, const std::map<std::string, std::string>& labels) {
  const auto sample = MetricSample(m, name, labels);
  return sample ? sample->gauge.value : -1;
}

bool Contains(const absl::Status& s, const std::string& text) {
  return std::string(s.message()).find(text) != std::string::npos;
}

TEST(DeviceList, ParsesListsAndRefusesBadOnes) {
  auto two = kernels::ParseDeviceList("cpu:0, cpu:1");
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_EQ(two->size(), 2u);
  EXPECT_EQ((*two)[0].name, "cpu:0");
  EXPECT_EQ((*two)[1].name, "cpu:1");
  EXPECT_EQ((*two)[1].backend.kind, "cpu");
  EXPECT_EQ((*two)[1].backend.device, 1);
  auto gpus = kernels::ParseDeviceList("cuda:2,cuda:0", /*count_devices=*/false);
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  EXPECT_EQ((*gpus)[0].backend.device, 2);
  for (const char* one : {"cpu", "cuda", "auto", "cuda:3", "cpu:5"}) {
    auto d = kernels::ParseDeviceList(one, false);
    ASSERT_TRUE(d.ok()) << one << ": " << d.status();
    EXPECT_EQ(d->size(), 1u) << one;
  }
  EXPECT_TRUE(kernels::ParseDeviceList("cuda:all", false).ok());
  // This build or host has no CUDA device: cuda:all counted now is refused, naming why.
  auto all = kernels::ParseDeviceList("cuda:all");
  if (!all.ok()) {
    EXPECT_EQ(all.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(Contains(all.status(), "no CUDA device")) << all.status();
  }
  for (const char* bad : {"", "cpu:0,cpu:0", "cpu:0,cuda:1", "cpu,cpu:1", "cuda:x", "cpu:",
                          "cuda:all,cuda:1", "cpu:-1", "cuda:0,", "gpu:0", "cuda:0;cuda:1",
                          "cpu:99999999999"}) {
    auto d = kernels::ParseDeviceList(bad, false);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_TRUE(Contains(kernels::ParseDeviceList("cpu:0,cpu:0").status(), "'cpu:0' is listed twice"));
  EXPECT_TRUE(Contains(kernels::ParseDeviceList("cpu:0,cuda:1").status(), "mixes cpu and cuda"));
}

TEST(DeviceList, ValidateConfigChecksTheBackendAndWhatSeveralDevicesCannotShare) {
  ServerConfig c;
  for (const char* ok : {"cpu", "cpu:0,cpu:1", "cuda:0,cuda:1", "cuda:all", "auto"}) {
    c.backend = ok;
    EXPECT_TRUE(ValidateConfig(c).ok()) << ok << ": " << ValidateConfig(c);
  }
  c.backend = "cpu:0,cpu:0";
  absl::Status s = ValidateConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "backend must be")) << s;
  EXPECT_TRUE(Contains(s, "listed twice")) << s;
  c.backend = "cpu:0,cpu:1";
  c.kv_events.endpoint = "tcp://*:5557";
  s = ValidateConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "binds")) << s;
  c.kv_events.endpoint = "tcp://indexer:5557";  // connecting: one per device is fine
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
  c.same_node.descriptor_broker = "@kvshade-broker";
  s = ValidateConfig(c);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(s, "descriptor_broker")) << s;
  c.backend = "cpu";  // one device: its one broker
  EXPECT_TRUE(ValidateConfig(c).ok()) << ValidateConfig(c);
}

TEST(DeviceIds, CarryTheDeviceIndex) {
  for (int d : {0, 1, 7, 200}) {
    const std::string id = SessionManager::NewId(d);
    EXPECT_EQ(id.size(), 32u);
    EXPECT_EQ(SessionManager::DeviceOfId(id), d) << id;
  }
  EXPECT_EQ(SessionManager::DeviceOfId("nothex-nothex-nothex-nothex-1234"), -1);
  EXPECT_EQ(SessionManager::DeviceOfId("01ab"), -1);
  EXPECT_NE(SessionManager::NewId(3), SessionManager::NewId(3));
}

TEST(Devices, SessionsArePlacedOnTheDeviceTheRequestNames) {
  Devices dx;
  ASSERT_TRUE(dx.router);
  ASSERT_EQ(dx.router->size(), 2u);
  Stream s = MakeStream(256, dx.model, 11);
  auto on0 = dx.Open(s, "cpu:0");
  auto on1 = dx.Open(s, "cpu:1");
  auto on1b = dx.Open(MakeStream(256, dx.model, 12, 16, 5000), "cpu:1");
  auto dflt = dx.Open(MakeStream(256, dx.model, 13, 16, 9000), "");
  EXPECT_EQ(on0.device, "cpu:0");
  EXPECT_EQ(on1.device, "cpu:1");
  EXPECT_EQ(dflt.device, "cpu:0");  // unset: the first device
  EXPECT_EQ(SessionManager::DeviceOfId(on0.session), 0);
  EXPECT_EQ(SessionManager::DeviceOfId(on1.session), 1);
  EXPECT_EQ(SessionManager::DeviceOfId(on1.attachment), 1);
  for (const auto& [o, want] : {std::pair{on0, "cpu:0"}, {on1, "cpu:1"}, {on1b, "cpu:1"}}) {
    auto info = dx.Info(o.session);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->device(), want);
    EXPECT_EQ(info->state(), "ready");
  }
  // Prefixes are cached per device: the same prompt on cpu:1 reused nothing of cpu:0's.
  auto i1 = dx.Info(on1.session);
  ASSERT_TRUE(i1.ok());
  EXPECT_EQ(i1->reused_tokens(), 0u);
  v1::LookupPrefixRequest lr;
  *lr.mutable_model() = dx.model;
  *lr.mutable_profile() = SmallShadowProfile();
  lr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
  lr.set_device("cpu:1");
  auto lp = dx.router->LookupPrefix(dx.tenant, lr);
  ASSERT_TRUE(lp.ok()) << lp.status();
  EXPECT_GT(lp->reusable_tokens(), 0u);

  v1::StatsResponse st = dx.Stats();
  ASSERT_EQ(st.devices_size(), 2);
  EXPECT_EQ(st.devices(0).device(), "cpu:0");
  EXPECT_EQ(st.devices(1).device(), "cpu:1");
  EXPECT_EQ(st.devices(0).sessions(), 2u);
  EXPECT_EQ(st.devices(1).sessions(), 2u);
  EXPECT_EQ(st.sessions(), 4u);
  EXPECT_EQ(st.attachments(), 4u);
  EXPECT_GT(st.devices(1).device_bytes_used(), 0u);
  EXPECT_EQ(st.device_bytes_used(), st.devices(0).device_bytes_used() + st.devices(1).device_bytes_used());
  EXPECT_EQ(st.device_bytes_budget(), dx.config.device_budget_bytes);  // each device's
  EXPECT_EQ(st.devices(1).device_bytes_budget(), dx.config.device_budget_bytes);
  EXPECT_EQ(st.devices(1).host_bytes_budget(), dx.config.host_budget_bytes / 2);
  EXPECT_EQ(st.host_bytes_budget(), dx.config.host_budget_bytes);
  // Prefix lookups per device: two creates on cpu:0 (no hit), two creates and the lookup on
  // cpu:1 (the lookup's a hit); the totals are their sums.
  EXPECT_EQ(st.devices(0).prefix_lookups(), 2u);
  EXPECT_EQ(st.devices(0).prefix_hits(), 0u);
  EXPECT_EQ(st.devices(1).prefix_lookups(), 3u);
  EXPECT_EQ(st.devices(1).prefix_hits(), 1u);
  EXPECT_EQ(st.prefix_lookups(), 5u);
  EXPECT_EQ(st.prefix_hits(), 1u);
  auto list = dx.router->ListSessions(dx.tenant, v1::ListSessionsRequest());
  ASSERT_TRUE(list.ok());
  EXPECT_EQ(list->sessions_size(), 4);

  // Gauges per device, labelled gpu; no unlabelled series beside them.
  EXPECT_EQ(Series(dx.metrics, "kvshade_sessions", {{"gpu", "0"}}), 2);
  EXPECT_EQ(Series(dx.metrics, "kvshade_sessions", {{"gpu", "1"}}), 2);
  EXPECT_EQ(Series(dx.metrics, "kvshade_sessions", {}), -1);
  EXPECT_GT(Series(dx.metrics, "kvshade_tier_bytes", {{"tier", "device"}, {"kind", "total"}, {"gpu", "1"}}), 0);
  EXPECT_EQ(Series(dx.metrics, "kvshade_tier_bytes", {{"tier", "device"}, {"kind", "total"}}), -1);
}

TEST(Devices, AnUnknownDeviceIsRefusedNamingTheDaemonsDevices) {
  Devices dx;
  ASSERT_TRUE(dx.router);
  Stream s = MakeStream(256, dx.model, 21);
  for (const char* bad : {"cpu:2", "cuda:0", "gpu0", "0000:3b:00.0", "cpu:0,cpu:1"}) {
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = dx.model;
    *cr.mutable_profile() = SmallShadowProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    cr.set_device(bad);
    auto c = dx.router->CreateSession(dx.tenant, cr);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(Contains(c.status(), "is not one of this daemon's devices (cpu:0, cpu:1")) << c.status();
    v1::LookupPrefixRequest lr;
    lr.set_device(bad);
    EXPECT_EQ(dx.router->LookupPrefix(dx.tenant, lr).status().code(), absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(dx.Stats().sessions(), 0u);  // nothing was created
  // A daemon with one cpu device answers to "cpu" and "cpu:0" alike.
  Devices one("cpu");
  ASSERT_TRUE(one.router);
  EXPECT_EQ(one.Open(s, "cpu:0").device, "cpu");
  EXPECT_EQ(one.Open(MakeStream(256, one.model, 22, 16, 5000), "cpu").device, "cpu");
  v1::CreateSessionRequest cr;
  cr.set_device("cpu:1");
  EXPECT_EQ(one.router->CreateSession(one.tenant, cr).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Devices, EveryCallIsServedByTheSessionsDevice) {
  Devices dx;
  ASSERT_TRUE(dx.router);
  // The same prompt on both devices: every answer must match between them, and each call
  // must reach its own session (a close on one leaves the other).
  const int n = 256, extra = 16;
  Stream s = MakeStream(n + extra, dx.model, 31);
  const Stream prompt = FirstTokens(s, n);
  Devices::Opened o[2] = {dx.Open(prompt, "cpu:0"), dx.Open(prompt, "cpu:1")};
  const std::vector<bf16> q = dx.Query(5);
  std::vector<float> before[2];
  for (int d = 0; d < 2; ++d) {
    auto out = dx.Attend(o[d].attachment, 1, q);
    ASSERT_TRUE(out.ok()) << out.status();
    before[d] = *out;
  }
  EXPECT_EQ(before[0], before[1]);
  // Select, static set, slot table, append, fork, on each device.
  for (int d = 0; d < 2; ++d) {
    const v1::StatsResponse st0 = dx.Stats();
    auto sel = dx.router->SelectAndReconstruct(dx.tenant, OneSelect(o[d].attachment, 0, q, dx.model.head_dim()));
    ASSERT_TRUE(sel.ok()) << sel.status();
    EXPECT_GT(sel->deltas(0).selected(), 0u);
    // Counted on the device that selected, and there alone; the total is their sum.
    const v1::StatsResponse st1 = dx.Stats();
    ASSERT_EQ(st1.devices_size(), 2);
    EXPECT_EQ(st1.devices(d).chunks_selected(), st0.devices(d).chunks_selected() + sel->deltas(0).selected());
    EXPECT_EQ(st1.devices(1 - d).chunks_selected(), st0.devices(1 - d).chunks_selected());
    EXPECT_EQ(st1.devices(d).chunk_hits(), st0.devices(d).chunk_hits() + sel->deltas(0).hits());
    EXPECT_EQ(st1.chunks_selected(), st1.devices(0).chunks_selected() + st1.devices(1).chunks_selected());
    EXPECT_EQ(st1.chunk_hits(), st1.devices(0).chunk_hits() + st1.devices(1).chunk_hits());
    v1::GetStaticSetRequest gs;
    gs.set_attachment_id(o[d].attachment);
    gs.set_layer(1);
    ASSERT_TRUE(dx.router->GetStaticSet(dx.tenant, gs).ok());
    v1::SlotTableRequest tr;
    tr.set_attachment_id(o[d].attachment);
    auto table = dx.router->SlotTable(dx.tenant, tr);
    ASSERT_TRUE(table.ok()) << table.status();
    auto app = dx.router->AppendTokens(dx.tenant, AppendOf(o[d].session, s, n, n + extra));
    ASSERT_TRUE(app.ok()) << app.status();
    EXPECT_EQ(app->tokens(), uint64_t(n + extra));
  }
  std::vector<float> after[2];
  for (int d = 0; d < 2; ++d) {
    auto out = dx.Attend(o[d].attachment, 1, q);
    ASSERT_TRUE(out.ok()) << out.status();
    after[d] = *out;
  }
  EXPECT_EQ(after[0], after[1]);
  EXPECT_NE(after[0], before[0]);  // the appended tokens are attended

  // A fork stays on its parent's device and answers as its parent.
  std::string child[2];
  for (int d = 0; d < 2; ++d) {
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id(o[d].session);
    fr.set_at_token(n + extra);
    auto f = dx.router->ForkSession(dx.tenant, fr);
    ASSERT_TRUE(f.ok()) << f.status();
    child[d] = f->session_id();
    EXPECT_EQ(SessionManager::DeviceOfId(child[d]), d);
    auto info = dx.Info(child[d]);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->device(), d == 0 ? "cpu:0" : "cpu:1");
    auto out = dx.Attend(dx.AttachTo(child[d]), 1, q);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(*out, after[d]);
  }
  // An export names its device.
  v1::ExportSessionRequest er;
  er.set_attachment_id(o[1].attachment);
  auto ex = dx.router->ExportSession(dx.tenant, er);
  ASSERT_TRUE(ex.ok()) << ex.status();
  EXPECT_EQ(ex->device(), "cpu:1");

  // One call serves one device's attachments: a mixed batch is refused, naming both.
  auto mixed = dx.AttendMany({o[0].attachment, o[1].attachment}, 1, q);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(mixed.status(), "on device cpu:1 and query 0's on cpu:0")) << mixed.status();
  auto same = dx.AttendMany({o[1].attachment, dx.AttachTo(child[1])}, 1, q);
  EXPECT_TRUE(same.ok()) << same.status();

  // Detach and close reach their own device: the other device's session is untouched.
  v1::DetachRequest dr;
  dr.set_attachment_id(o[0].attachment);
  ASSERT_TRUE(dx.router->Detach(dx.tenant, dr).ok());
  v1::CloseSessionRequest cr;
  cr.set_session_id(o[0].session);
  ASSERT_TRUE(dx.router->CloseSession(dx.tenant, cr).ok());
  EXPECT_EQ(dx.Info(o[0].session).status().code(), absl::StatusCode::kNotFound);
  auto still = dx.Attend(o[1].attachment, 1, q);
  ASSERT_TRUE(still.ok()) << still.status();
  EXPECT_EQ(*still, after[1]);
  // An id that names a device the daemon does not have is unknown, as any unknown id.
  EXPECT_EQ(dx.Info(SessionManager::NewId(9)).status().code(), absl::StatusCode::kNotFound);
}

TEST(Devices, AttachChecksTheWorkersDevice) {
  Devices dx;
  ASSERT_TRUE(dx.router);
  auto o = dx.Open(MakeStream(256, dx.model, 41), "cpu:1");
  v1::AttachRequest ar;
  ar.set_session_id(o.session);
  ar.set_device("cpu:0");
  auto wrong = dx.router->Attach(dx.tenant, ar);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(wrong.status(), "is on device cpu:1, and the worker is on device cpu:0"))
      << wrong.status();
  ar.set_device("cpu:7");
  EXPECT_EQ(dx.router->Attach(dx.tenant, ar).status().code(), absl::StatusCode::kInvalidArgument);
  ar.set_device("cpu:1");
  EXPECT_TRUE(dx.router->Attach(dx.tenant, ar).ok());
  // Another tenant's session is unknown whatever device the worker names.
  Tenant bob{"bob", TenantSalt("bob", "")};
  ar.set_device("cpu:0");
  EXPECT_EQ(dx.router->Attach(bob, ar).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(dx.Stats().attachments(), 2u);  // the open one and the matching one
}

TEST(Devices, BudgetsAreEachDevicesOwn) {
  // A device tier of 3 MiB per device: a few sessions fill it.
  Devices dx("cpu:0,cpu:1", "", 3ull << 20);
  ASSERT_TRUE(dx.router);
  auto first1 = dx.Open(MakeStream(256, dx.model, 50, 16, 5000), "cpu:1");
  const std::vector<bf16> q = dx.Query(7);
  auto ref = dx.Attend(first1.attachment, 0, q);
  ASSERT_TRUE(ref.ok()) << ref.status();
  // Fill cpu:0 until it refuses (attached sessions are never evicted).
  std::vector<std::string> on0;
  absl::Status full;
  for (int i = 0; i < 64 && full.ok(); ++i) {
    Stream s = MakeStream(256, dx.model, 100 + i, 16, 100000 + 1000 * i);
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = dx.model;
    *cr.mutable_profile() = SmallShadowProfile();
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.end());
    cr.set_device("cpu:0");
    auto c = dx.router->CreateSession(dx.tenant, cr);
    if (!c.ok()) {
      full = c.status();
      break;
    }
    auto ing = dx.router->Ingest(dx.tenant, IngestStreamOf(c->session_id(), s, 0, s.n()));
    if (!ing.ok()) {
      full = ing.status();
      break;
    }
    on0.push_back(dx.AttachTo(c->session_id()));
  }
  ASSERT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  ASSERT_GE(on0.size(), 1u);
  v1::StatsResponse st = dx.Stats();
  ASSERT_EQ(st.devices_size(), 2);
  EXPECT_LE(st.devices(0).device_bytes_used(), dx.config.device_budget_bytes);
  // cpu:1 neither lost its session nor refuses a new one.
  auto again = dx.Attend(first1.attachment, 0, q);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(*again, *ref);
  auto second1 = dx.Open(MakeStream(256, dx.model, 51, 16, 7000), "cpu:1");
  EXPECT_EQ(second1.device, "cpu:1");
  EXPECT_TRUE(dx.Attend(second1.attachment, 0, q).ok());
  EXPECT_EQ(dx.Stats().devices(1).sessions(), 2u);
  // And every session of cpu:0 is still served.
  for (const std::string& a : on0) EXPECT_TRUE(dx.Attend(a, 0, q).ok());
}

TEST(Devices, DurableSessionsAreRestoredOntoTheirDevices) {
  TempDir dir;
  const std::string spill = dir.path() + "/spill";
  std::string session[2];
  std::vector<float> out[2];
  {
    Devices dx("cpu:0,cpu:1", spill);
    ASSERT_TRUE(dx.router);
    for (int d = 0; d < 2; ++d) {
      auto o = dx.Open(MakeStream(256, dx.model, 60 + d), d == 0 ? "cpu:0" : "cpu:1", /*durable=*/true);
      session[d] = o.session;
      auto a = dx.Attend(o.attachment, 1, dx.Query(9));
      ASSERT_TRUE(a.ok()) << a.status();
      out[d] = *a;
    }
    ASSERT_TRUE(dx.router->Drain().ok());
  }
  EXPECT_TRUE(std::filesystem::exists(spill + "/device-0/CURRENT"));
  EXPECT_TRUE(std::filesystem::exists(spill + "/device-1/CURRENT"));
  {
    Devices dx("cpu:0,cpu:1", spill);
    ASSERT_TRUE(dx.router);
    for (int d = 0; d < 2; ++d) {
      auto info = dx.Info(session[d]);
      ASSERT_TRUE(info.ok()) << info.status();
      EXPECT_EQ(info->device(), d == 0 ? "cpu:0" : "cpu:1");
      EXPECT_TRUE(info->durable());
      auto a = dx.Attend(dx.AttachTo(session[d]), 1, dx.Query(9));
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ(*a, out[d]);
    }
    EXPECT_EQ(dx.Stats().devices(1).sessions(), 1u);
  }
  // Fewer devices than hold durable sessions: refused, naming the directory; nothing moved.
  ServerConfig c;
  c.backend = "cpu:0";
  c.spill_path = spill;
  Metrics m;
  auto fewer = DeviceRouter::Open(c, &m);
  EXPECT_EQ(fewer.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(fewer.status(), "device-0, device-1")) << fewer.status();
  c.backend = "cpu";
  EXPECT_EQ(DeviceRouter::Open(c, &m).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(std::filesystem::exists(spill + "/device-1/CURRENT"));
  // A single-device spill tier is not taken by a daemon with several.
  TempDir single;
  {
    Devices one("cpu", single.path());
    ASSERT_TRUE(one.router);
  }
  c.backend = "cpu:0,cpu:1";
  c.spill_path = single.path();
  auto more = DeviceRouter::Open(c, &m);
  EXPECT_EQ(more.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(more.status(), "a daemon with one device")) << more.status();
  // Three devices' tiers, restarted with two: refused, naming the third.
  TempDir three;
  {
    Devices dx("cpu:0,cpu:1,cpu:2", three.path());
    ASSERT_TRUE(dx.router);
    dx.Open(MakeStream(256, dx.model, 70), "cpu:2", /*durable=*/true);
  }
  c.spill_path = three.path();
  auto two = DeviceRouter::Open(c, &m);
  EXPECT_EQ(two.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(two.status(), "of device 2 (device-2)")) << two.status();
}

}  // namespace
}  // namespace devices_test
}  // namespace kvshade::service::testing

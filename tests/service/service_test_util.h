// Helpers for the service core's unit tests: an Engine on the CPU backend with small
// budgets, a fake clock and no background thread; synthetic sessions with realistic key
// structure (low-rank keys plus noise, seeded per run and logged); request builders; and
// the exact-attention reference over the same inputs.
#pragma once

#include <stdlib.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/test_util.h"
#include "kvshade/kernels/reference.h"
#include "kvshade/kernels/rope.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/device_router.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"
#include "kvshade/storage/fault_injection.h"
#include "kvshade/storage/spill_tier.h"

namespace kvshade::service::testing {

using kernels::bf16;

inline v1::ModelSpec TestModel(int L = 2, int h = 2, int g = 2, int d = 64) {
  v1::ModelSpec m;
  m.set_model_id("test/model");
  m.set_num_layers(L);
  m.set_num_kv_heads(h);
  m.set_num_query_heads(h * g);
  m.set_head_dim(d);
  m.set_dtype(v1::DTYPE_BF16);
  return m;
}

inline v1::Tensor ToTensor(const std::vector<bf16>& x, std::vector<int64_t> shape) {
  v1::Tensor t;
  for (int64_t s : shape) t.add_shape(s);
  t.set_dtype(v1::DTYPE_BF16);
  t.set_data(reinterpret_cast<const char*>(x.data()), x.size() * 2);
  return t;
}

inline std::vector<float> TensorF32(const v1::Tensor& t) {
  std::vector<float> out(t.data().size() / 4);
  if (!out.empty()) std::memcpy(out.data(), t.data().data(), out.size() * 4);
  return out;
}

// Fails unless a and b hold the same floats bit for bit, naming the first that differs.
inline void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                           const std::string& what = "") {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0) << what << " [" << i << "]: " << a[i] << " vs " << b[i];
  }
}

inline std::vector<bf16> TensorBf16(const v1::Tensor& t) {
  std::vector<bf16> out(t.data().size() / 2);
  if (!out.empty()) std::memcpy(out.data(), t.data().data(), out.size() * 2);
  return out;
}

// K/V of a token stream for every layer: keys of rank `key_rank` (shared basis across the
// stream) plus small noise, values Gaussian.
struct Stream {
  int L = 0, h = 0, d = 0;
  std::vector<int32_t> tokens;
  std::vector<std::vector<bf16>> k, v;  // [L][n, h, d], k pre-RoPE
  int n() const { return static_cast<int>(tokens.size()); }
};

// Tokens [0, n) of `s`.
inline Stream FirstTokens(const Stream& s, int n) {
  Stream o = s;
  o.tokens.resize(n);
  const size_t tok = size_t(s.h) * s.d;
  for (int l = 0; l < s.L; ++l) {
    o.k[l].resize(n * tok);
    o.v[l].resize(n * tok);
  }
  return o;
}

// One query of `layer` for `attachment`: q holds its heads' rows of d channels.
inline v1::SelectAndReconstructRequest OneSelect(const std::string& attachment, int layer,
                                                 const std::vector<bf16>& q, int d) {
  v1::SelectAndReconstructRequest r;
  r.set_layer(layer);
  auto* sq = r.add_queries();
  sq->set_attachment_id(attachment);
  *sq->mutable_q() = ToTensor(q, {int64_t(q.size() / d), d});
  return r;
}
inline v1::AttendRequest OneAttend(const std::string& attachment, int layer, const std::vector<bf16>& q,
                                   int d) {
  v1::AttendRequest r;
  r.set_layer(layer);
  auto* aq = r.add_queries();
  aq->set_attachment_id(attachment);
  *aq->mutable_q() = ToTensor(q, {int64_t(q.size() / d), d});
  return r;
}

inline Stream MakeStream(int n, const v1::ModelSpec& m, uint64_t seed_stream, int key_rank = 16,
                         int token_base = 1000, float noise = 0.01f) {
  Stream s;
  s.L = m.num_layers();
  s.h = m.num_kv_heads();
  s.d = m.head_dim();
  const int D = s.h * s.d;
  std::mt19937_64 rng = kernels::testing::MakeRng(seed_stream);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int i = 0; i < n; ++i) s.tokens.push_back(token_base + i);
  for (int l = 0; l < s.L; ++l) {
    std::vector<float> basis(size_t(key_rank) * D), coef(size_t(n) * key_rank);
    for (auto& x : basis) x = nd(rng);
    for (auto& x : coef) x = nd(rng) / std::sqrt(float(key_rank));
    std::vector<bf16> k(size_t(n) * D), v(size_t(n) * D);
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < D; ++c) {
        float acc = noise * nd(rng);
        for (int r = 0; r < key_rank; ++r) acc += coef[size_t(t) * key_rank + r] * basis[size_t(r) * D + c];
        k[size_t(t) * D + c] = kernels::FloatToBf16(acc);
        v[size_t(t) * D + c] = kernels::FloatToBf16(nd(rng));
      }
    }
    s.k.push_back(std::move(k));
    s.v.push_back(std::move(v));
  }
  return s;
}

// AppendTokens of tokens [from, to) of `s` (every layer), optionally as `attachment`.
inline v1::AppendTokensRequest AppendOf(const std::string& session, const Stream& s, int from, int to,
                                        const std::string& attachment = "") {
  v1::AppendTokensRequest r;
  r.set_session_id(session);
  r.set_attachment_id(attachment);
  const size_t tok = size_t(s.h) * s.d;
  for (int t = from; t < to; ++t) r.add_token_ids(s.tokens[t]);
  for (int l = 0; l < s.L; ++l) {
    auto* lk = r.add_layers();
    lk->set_layer(l);
    *lk->mutable_k() = ToTensor({s.k[l].begin() + from * tok, s.k[l].begin() + to * tok}, {to - from, s.h, s.d});
    *lk->mutable_v() = ToTensor({s.v[l].begin() + from * tok, s.v[l].begin() + to * tok}, {to - from, s.h, s.d});
  }
  return r;
}

// Layer l's tokens [from + a, from + b) of `s` as one IngestLayer part at token_offset a of
// an ingest of n tokens: its layer's last part when b == n, then with the observation
// queries when given ([w, hq, d] per layer).
inline v1::IngestRequest IngestPartOf(const Stream& s, int l, int from, int a, int b, int n,
                                      const std::vector<std::vector<bf16>>* qobs = nullptr, int w = 0) {
  const size_t tok = size_t(s.h) * s.d;
  v1::IngestRequest r;
  v1::IngestLayer* il = r.mutable_layer();
  il->set_layer(l);
  il->set_token_offset(a);
  std::vector<bf16> k(s.k[l].begin() + (from + a) * tok, s.k[l].begin() + (from + b) * tok);
  std::vector<bf16> v(s.v[l].begin() + (from + a) * tok, s.v[l].begin() + (from + b) * tok);
  *il->mutable_k() = ToTensor(k, {b - a, s.h, s.d});
  *il->mutable_v() = ToTensor(v, {b - a, s.h, s.d});
  il->set_last_part(b == n);
  if (b == n && qobs != nullptr) {
    *il->mutable_observation_queries() = ToTensor((*qobs)[l], {w, int64_t((*qobs)[l].size() / (size_t(w) * s.d)), s.d});
  }
  return r;
}

// The tokens [from, to) of `s` as an ingest stream for `session_id` (each layer in two
// parts when it has at least two tokens), committed. With chunk > 0, in the order a chunked
// prefill sends them instead: for each chunk of `chunk` tokens (the last may be shorter)
// every layer's part for that chunk, layer 0 to L-1, then the next chunk's; so every layer
// is incomplete until the last chunk, whose parts are their layers' last.
inline std::vector<v1::IngestRequest> IngestStreamOf(const std::string& session_id, const Stream& s,
                                                    int from, int to,
                                                    const std::vector<std::vector<bf16>>* qobs = nullptr,
                                                    int w = 0, int chunk = 0) {
  std::vector<v1::IngestRequest> out;
  v1::IngestRequest hdr;
  hdr.mutable_header()->set_session_id(session_id);
  out.push_back(hdr);
  const int n = to - from;
  if (chunk > 0) {
    for (int a = 0; a < n; a += chunk) {
      const int b = std::min(n, a + chunk);
      for (int l = 0; l < s.L; ++l) out.push_back(IngestPartOf(s, l, from, a, b, n, qobs, w));
    }
  } else {
    for (int l = 0; l < s.L; ++l) {
      const int split = n >= 2 ? n / 2 : n;
      for (auto [a, b] : {std::pair{0, split}, std::pair{split, n}}) {
        if (b > a) out.push_back(IngestPartOf(s, l, from, a, b, n, qobs, w));
      }
    }
  }
  v1::IngestRequest c;
  c.mutable_commit();
  out.push_back(c);
  return out;
}

// Post-RoPE keys of s (as float), positions 0..n-1.
inline std::vector<float> PostRope(const Stream& s, int layer, const kernels::RopeSpec& rope = {}) {
  auto table = kernels::MakeRopeTable(rope, s.d);
  EXPECT_TRUE(table.ok());
  std::vector<float> out(s.k[layer].size());
  for (size_t i = 0; i < out.size(); ++i) out[i] = kernels::Bf16ToFloat(s.k[layer][i]);
  for (int t = 0; t < s.n(); ++t) {
    for (int hh = 0; hh < s.h; ++hh) {
      kernels::ApplyRopeReference(*table, rope.pairing, t, out.data() + (size_t(t) * s.h + hh) * s.d, s.d);
    }
  }
  return out;
}

// Exact attention of query q [hq, d] over tokens [0, n) of `s` at `layer`.
inline std::vector<float> ExactAttend(const Stream& s, int layer, int g, const std::vector<bf16>& q, int n = -1) {
  if (n < 0) n = s.n();
  std::vector<float> k = PostRope(s, layer);
  std::vector<float> v(s.v[layer].size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = kernels::Bf16ToFloat(s.v[layer][i]);
  std::vector<float> qf(q.size());
  for (size_t i = 0; i < q.size(); ++i) qf[i] = kernels::Bf16ToFloat(q[i]);
  std::vector<float> out(q.size());
  kernels::LayerShape shape{s.h, g, s.d};
  kernels::reference::ExactAttention(shape, qf.data(), k.data(), v.data(), n, 1.0f / std::sqrt(float(s.d)),
                                     out.data());
  return out;
}

inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += double(a[i] - b[i]) * (a[i] - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// Attention of query q [h*g, d] over exactly the rows a GetStaticSet response holds (each
// head's first lengths[h] static rows, then every tail row), in double: the reference for
// what Attend computes over a layer with no selectable chunks (mini, exact). With `delta`,
// also over the rows of its misses for each head (between the static rows and the tail).
inline std::vector<float> HeldAttend(const v1::GetStaticSetResponse& st, int g, int d,
                                     const std::vector<bf16>& q,
                                     const v1::SlotDelta* delta = nullptr) {
  const std::vector<bf16> sk = TensorBf16(st.k()), sv = TensorBf16(st.v());
  const std::vector<bf16> tk = TensorBf16(st.tail_k()), tv = TensorBf16(st.tail_v());
  std::vector<bf16> mk, mv;
  int64_t rows = 0;
  if (delta != nullptr) {
    mk = TensorBf16(delta->keys());
    mv = TensorBf16(delta->values());
    rows = delta->keys().shape_size() == 3 ? delta->keys().shape(1) : 0;
  }
  const int h = st.lengths_size();
  const int64_t smax = st.k().shape_size() == 3 ? st.k().shape(1) : 0;
  const int64_t t = st.tail_k().shape_size() == 3 ? st.tail_k().shape(0) : 0;
  std::vector<float> out(size_t(h) * g * d);
  for (int hq = 0; hq < h * g; ++hq) {
    const int hh = hq / g;
    std::vector<const bf16*> ks, vs;
    for (uint32_t i = 0; i < st.lengths(hh); ++i) {
      ks.push_back(&sk[(size_t(hh) * smax + i) * d]);
      vs.push_back(&sv[(size_t(hh) * smax + i) * d]);
    }
    for (int m = 0; delta != nullptr && m < delta->head_size(); ++m) {
      if (int(delta->head(m)) != hh) continue;
      for (int64_t r = 0; r < rows; ++r) {
        ks.push_back(&mk[(size_t(m) * rows + r) * d]);
        vs.push_back(&mv[(size_t(m) * rows + r) * d]);
      }
    }
    for (int64_t i = 0; i < t; ++i) {
      ks.push_back(&tk[(size_t(i) * h + hh) * d]);
      vs.push_back(&tv[(size_t(i) * h + hh) * d]);
    }
    std::vector<double> logit(ks.size());
    double mx = -1e300;
    for (size_t i = 0; i < ks.size(); ++i) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += double(kernels::Bf16ToFloat(q[size_t(hq) * d + c])) * kernels::Bf16ToFloat(ks[i][c]);
      logit[i] = dot / std::sqrt(double(d));
      mx = std::max(mx, logit[i]);
    }
    double z = 0;
    std::vector<double> acc(d, 0.0);
    for (size_t i = 0; i < ks.size(); ++i) {
      const double p = std::exp(logit[i] - mx);
      z += p;
      for (int c = 0; c < d; ++c) acc[c] += p * kernels::Bf16ToFloat(vs[i][c]);
    }
    for (int c = 0; c < d; ++c) out[size_t(hq) * d + c] = float(acc[c] / z);
  }
  return out;
}

// How a Harness composes its spill tier (when it has a spill path).
struct SpillSetup {
  // Simulated disk faults under RocksDB's own files (RocksSpillOptions::disk_faults).
  std::shared_ptr<storage::DiskFaults> disk_faults;
  // A FaultInjectingSpillTier in front of the RocksDB tier, its faults off until the test
  // sets them (Harness::faults).
  bool fault_tier = false;
  // Other setup work, after the config defaults and before the engine starts.
  std::function<void(ServerConfig&)> configure;
  // A tier of the test's own in front of the RocksDB tier (instead of fault_tier), made
  // at each start.
  std::function<std::unique_ptr<storage::SpillTier>(storage::SpillTier& base)> front;
};

// An Engine on the CPU backend with small budgets and a fake clock. With a spill path it
// opens the spill tier itself, as the server does, and hands it to the engine; Restart()
// closes and reopens it like a process restart.
class Harness {
 public:
  explicit Harness(std::string spill_path = "", SpillSetup setup = {}) : setup(std::move(setup)) {
    config.device_budget_bytes = 256ull << 20;
    config.host_budget_bytes = 256ull << 20;
    config.spill_path = std::move(spill_path);
    config.profile.outliers = 4;
    config.profile.rank = 128;
    config.profile.min_tokens = 256;
    if (this->setup.configure) this->setup.configure(config);
    backend = kernels::testing::Cpu();
    Start();
  }
  ~Harness() {
    engine.reset();  // before the spill tier it runs on
    front.reset();
    faults.reset();
    spill.reset();
  }
  void Start() {
    EngineOptions o;
    o.clock = [this] { return now_ms.load(); };
    o.background_thread = false;
    if (!config.spill_path.empty()) {
      storage::RocksSpillOptions so;
      so.path = config.spill_path;
      so.disk_faults = setup.disk_faults;
      auto tier = storage::RocksSpillTier::Open(so);
      EXPECT_TRUE(tier.ok()) << tier.status();
      if (!tier.ok()) return;
      spill = std::move(tier).value();
      o.spill_tier = spill.get();
      if (setup.fault_tier) {
        faults = std::make_unique<storage::FaultInjectingSpillTier>(*spill, storage::FaultOptions{});
        o.spill_tier = faults.get();
      } else if (setup.front) {
        front = setup.front(*spill);
        o.spill_tier = front.get();
      }
    }
    auto e = Engine::Create(backend.get(), &config, &metrics, o);
    EXPECT_TRUE(e.ok()) << e.status();
    if (e.ok()) engine = std::move(e).value();
  }
  void Restart() {
    engine.reset();
    front.reset();
    faults.reset();
    spill.reset();
    Start();
  }

  // Creates a session for `s` (tokens [0, n)), ingests what is not reused, attaches.
  struct Opened {
    std::string session, attachment;
    uint64_t reused = 0;
    v1::IngestResponse ingest;
  };
  Opened Open(const Stream& s, v1::Profile profile, int n = -1, bool durable = false,
              const Tenant* t = nullptr) {
    if (n < 0) n = s.n();
    const Tenant& who = t ? *t : tenant;
    Opened o;
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = model;
    *cr.mutable_profile() = profile;
    cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + n);
    cr.set_durable(durable);
    auto c = engine->CreateSession(who, cr);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return o;
    o.session = c->session_id();
    o.reused = c->reused_tokens();
    if (c->tokens_to_ingest() > 0) {
      auto ing = engine->Ingest(who, IngestStreamOf(o.session, s, int(c->reused_tokens()), n));
      EXPECT_TRUE(ing.ok()) << ing.status();
      if (ing.ok()) o.ingest = *ing;
    }
    o.attachment = AttachTo(o.session, false, t);
    return o;
  }
  std::string AttachTo(const std::string& session, bool writer = false, const Tenant* t = nullptr) {
    v1::AttachRequest ar;
    ar.set_session_id(session);
    ar.set_worker_id("w");
    ar.set_writer(writer);
    auto a = engine->Attach(t ? *t : tenant, ar);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->attachment_id() : "";
  }
  absl::StatusOr<std::vector<float>> Attend(const std::string& attachment, int layer,
                                            const std::vector<bf16>& q) {
    auto resp = engine->Attend(tenant, OneAttend(attachment, layer, q, model.head_dim()));
    if (!resp.ok()) return resp.status();
    return TensorF32(resp->outputs(0));
  }
  v1::GetStaticSetResponse StaticSet(const std::string& attachment, int layer) {
    v1::GetStaticSetRequest r;
    r.set_attachment_id(attachment);
    r.set_layer(layer);
    auto st = engine->GetStaticSet(tenant, r);
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : v1::GetStaticSetResponse();
  }
  absl::StatusOr<v1::SlotDelta> Select(const std::string& attachment, int layer,
                                       const std::vector<bf16>& q) {
    auto resp = engine->SelectAndReconstruct(tenant, OneSelect(attachment, layer, q, model.head_dim()));
    if (!resp.ok()) return resp.status();
    return resp->deltas(0);
  }
  std::vector<bf16> Query(uint64_t stream, float scale = 1.0f) {
    auto rng = kernels::testing::MakeRng(stream);
    return kernels::testing::RandomBf16(size_t(model.num_query_heads()) * model.head_dim(), rng, scale);
  }

  SpillSetup setup;
  ServerConfig config;
  Metrics metrics;
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<storage::RocksSpillTier> spill;  // with a spill path
  std::unique_ptr<storage::FaultInjectingSpillTier> faults;  // with setup.fault_tier
  std::unique_ptr<storage::SpillTier> front;  // with setup.front
  std::unique_ptr<Engine> engine;
  std::atomic<int64_t> now_ms{1'700'000'000'000};
  // Salts as the Authenticator derives them (restored prefixes are re-keyed that way).
  Tenant tenant{"alice", TenantSalt("alice", "")};
  Tenant other{"bob", TenantSalt("bob", "")};
  v1::ModelSpec model = TestModel();
};

// The value of a counter or gauge without labels in the harness's metrics; -1 (and a test
// failure) when there is no such series.
inline double MetricValue(Harness& hx, const std::string& name) {
  for (const auto& family : hx.metrics.registry()->Collect()) {
    if (family.name != name || family.metric.empty()) continue;
    return family.type == prometheus::MetricType::Counter ? family.metric[0].counter.value
                                                           : family.metric[0].gauge.value;
  }
  ADD_FAILURE() << "no metric " << name;
  return -1;
}

// The sample of metric `name` whose labels are exactly `labels`, if there is one.
inline std::optional<prometheus::ClientMetric> MetricSample(
    Metrics& metrics, const std::string& name, const std::map<std::string, std::string>& labels) {
  for (const auto& family : metrics.registry()->Collect()) {
    if (family.name != name) continue;
    for (const auto& m : family.metric) {
      std::map<std::string, std::string> have;
      for (const auto& l : m.label) have[l.name] = l.value;
      if (have == labels) return m;
    }
  }
  return std::nullopt;
}

// Server-wide bytes of a tier (kvshade_tier_bytes{tier, kind="total"}), as of the last
// gauge update (every Stats call makes one).
inline double TierTotal(Harness& hx, const std::string& tier) {
  auto st = hx.engine->Stats(hx.tenant, v1::StatsRequest());
  EXPECT_TRUE(st.ok()) << st.status();
  const auto m = MetricSample(hx.metrics, "kvshade_tier_bytes", {{"tier", tier}, {"kind", "total"}});
  if (!m) ADD_FAILURE() << "no kvshade_tier_bytes{tier=" << tier << ", kind=total}";
  return m ? m->gauge.value : -1;
}

inline v1::Profile ProfileOf(v1::ProfileKind kind) {
  v1::Profile p;
  p.set_kind(kind);
  return p;
}

// A temporary directory, removed with its contents (permissions restored first: some tests
// make it unwritable).
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "kvshade-svc-XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A small shadow profile for engine tests: rank 64, 8 chunks per head, 2 outlier chunks.
inline v1::Profile SmallShadowProfile() {
  v1::Profile p = ProfileOf(v1::PROFILE_KIND_SHADOW);
  p.set_rank(64);
  p.set_sparse_budget(8);
  p.set_outliers(2);
  return p;
}

// A spill tier that passes every call through to `base`: tests derive from it and
// override the calls they fault or filter.
class ForwardingSpillTier : public storage::SpillTier {
 public:
  explicit ForwardingSpillTier(storage::SpillTier& base) : base_(base) {}
  absl::Status WriteSegment(const storage::SegmentWrite& s) override { return base_.WriteSegment(s); }
  absl::Status AddFactors(const storage::SegmentId& id,
                          absl::Span<const storage::FactorBlob> f) override {
    return base_.AddFactors(id, f);
  }
  absl::StatusOr<storage::SegmentMeta> ReadMeta(const storage::SegmentId& id) override {
    return base_.ReadMeta(id);
  }
  absl::Status ReadValues(const storage::SegmentId& id, int layer, absl::Span<std::byte> dst) override {
    return base_.ReadValues(id, layer, dst);
  }
  absl::Status ReadFactor(const storage::SegmentId& id, int layer, storage::FactorKind kind,
                          absl::Span<std::byte> dst) override {
    return base_.ReadFactor(id, layer, kind, dst);
  }
  absl::Status DeleteSegment(const storage::SegmentId& id) override { return base_.DeleteSegment(id); }
  absl::Status DeleteSegments(absl::Span<const storage::SegmentId> ids) override {
    return base_.DeleteSegments(ids);
  }
  absl::Status SyncWal() override { return base_.SyncWal(); }
  absl::StatusOr<std::vector<storage::SegmentMeta>> ListSegments() override { return base_.ListSegments(); }
  storage::SpillStats Stats() const override { return base_.Stats(); }
  storage::SpillDamage Damage() const override { return base_.Damage(); }

 protected:
  storage::SpillTier& base_;
};

// A DeviceRouter over `config` with the engine tests' small budgets on two CPU devices, a
// fake clock and no background thread; the caller adjusts `config` and calls Start();
// Restart() reopens it on the same spill path, like a process restart.
struct RouterHarness {
  explicit RouterHarness(std::string backend = "cpu:0,cpu:1", std::string spill_path = "",
                         uint64_t device_budget = 256ull << 20) {
    config.backend = std::move(backend);
    config.device_budget_bytes = device_budget;
    config.host_budget_bytes = 512ull << 20;
    config.spill_path = std::move(spill_path);
    config.profile.outliers = 4;
    config.profile.min_tokens = 256;
  }
  absl::Status Start() {
    if (absl::Status v = ValidateConfig(config); !v.ok()) return v;
    DeviceRouterOptions o;
    o.clock = [this] { return now_ms.load(); };
    o.background_thread = false;
    auto r = DeviceRouter::Open(config, &metrics, o);
    if (!r.ok()) return r.status();
    router = *std::move(r);
    return absl::OkStatus();
  }
  absl::Status Restart() {
    router.reset();
    return Start();
  }

  ServerConfig config;
  Metrics metrics;
  std::atomic<int64_t> now_ms{1'700'000'000'000};
  std::unique_ptr<DeviceRouter> router;
  Tenant tenant{"alice", TenantSalt("alice", "")};
};

}  // namespace kvshade::service::testing

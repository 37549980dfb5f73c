// Fuzz target: the durable records a restart reads back (service/durable.cc: the session
// and segment records in a spill segment's user metadata, and the factor blobs they name).
// The spill tier checks each record's checksum (storage/record_format.cc, fuzzed by
// record_format_fuzzer), so these bytes are whatever an older, newer or buggy writer put
// there: a record that does not describe a consistent session must be skipped, never
// crash the restart, and a session that is restored must then serve every call (or refuse
// it with a status).
//
// Each input is restored into an engine with no sessions (EngineImpl::RestoreRecords, what
// Engine::Create runs on the records RocksDB returns); every restored session is then
// attached and read at every layer (GetStaticSet, SelectAndReconstruct, Attend), and closed.
//
// Input: repeated records { id: u64 hi, u64 lo (little-endian); u16 metadata length;
// metadata; u8 factor count; factors { u8 layer; u8 kind; u32 length; bytes } }.
//
// KVSHADE_FUZZ_WRITE_SEED=<file>: instead of fuzzing, writes real records (two durable
// sessions, one shadow and one exact with appended tokens, written by a real engine into a
// real spill tier) to <file> in this format and exits (fuzz/corpus/durable_fuzzer/).
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine_internals.h"
#include <spdlog/spdlog.h>

#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/types.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"
#include "kvshade/storage/spill_tier.h"

namespace {

using namespace kvshade;
using namespace kvshade::service;
using storage::FactorKind;

constexpr int kLayers = 2, kKvHeads = 2, kGroup = 2, kHeadDim = 64;

ServerConfig Config() {
  ServerConfig c;
  c.device_budget_bytes = 16ull << 20;
  c.host_budget_bytes = 16ull << 20;
  c.profile.rank = 16;
  c.profile.min_tokens = 64;
  c.profile.outliers = 2;
  c.profile.sparse_budget = 4;
  c.profile.local_window = 8;
  c.same_node.export_state = false;
  return c;
}

kernels::Backend& Cpu() {
  static kernels::Backend* b = [] {
    auto backend = kernels::CreateBackend("cpu");
    if (!backend.ok()) std::abort();
    return backend->release();
  }();
  return *b;
}

v1::Tensor RandomTensor(std::mt19937_64& rng, std::vector<int64_t> shape) {
  v1::Tensor t;
  size_t n = 1;
  for (int64_t s : shape) {
    t.add_shape(s);
    n *= size_t(s);
  }
  t.set_dtype(v1::DTYPE_BF16);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::string data(n * 2, '\0');
  for (size_t i = 0; i < n; ++i) {
    const kernels::bf16 b = kernels::FloatToBf16(nd(rng));
    std::memcpy(&data[i * 2], &b, 2);
  }
  t.set_data(std::move(data));
  return t;
}

struct Input {
  std::vector<storage::SegmentMeta> metas;
  std::map<std::tuple<storage::SegmentId, int, int>, std::string> factors;
};

class Bytes {
 public:
  Bytes(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <typename T>
  bool Get(T* v) {
    if (n_ < sizeof(T)) return false;
    uint64_t x = 0;
    for (size_t i = 0; i < sizeof(T); ++i) x |= uint64_t(p_[i]) << (8 * i);
    *v = T(x);
    p_ += sizeof(T);
    n_ -= sizeof(T);
    return true;
  }
  bool Take(size_t len, std::string* out) {
    len = std::min(len, n_);
    out->assign(reinterpret_cast<const char*>(p_), len);
    p_ += len;
    n_ -= len;
    return true;
  }
  size_t left() const { return n_; }

 private:
  const uint8_t* p_;
  size_t n_;
};

Input Parse(const uint8_t* data, size_t size) {
  Input in;
  Bytes b(data, size);
  while (b.left() > 0 && in.metas.size() < 64) {
    storage::SegmentMeta m;
    uint16_t len = 0;
    uint8_t nf = 0;
    if (!b.Get(&m.id.hi) || !b.Get(&m.id.lo) || !b.Get(&len)) break;
    m.durability = storage::Durability::kDurable;
    b.Take(len, &m.user_metadata);
    if (!b.Get(&nf)) nf = 0;
    for (int i = 0; i < nf; ++i) {
      uint8_t layer = 0, kind = 0;
      uint32_t flen = 0;
      if (!b.Get(&layer) || !b.Get(&kind) || !b.Get(&flen)) break;
      std::string bytes;
      b.Take(std::min<uint32_t>(flen, 1 << 20), &bytes);
      storage::SegmentMeta::Factor f;
      f.layer = layer;
      f.kind = static_cast<FactorKind>(kind);
      f.bytes = bytes.size();
      m.factors.push_back(f);
      in.factors[{m.id, int(layer), int(kind)}] = std::move(bytes);
    }
    in.metas.push_back(std::move(m));
  }
  return in;
}

void Exercise(Engine& engine) {
  std::mt19937_64 rng(7);
  for (const auto& s : EngineInternals(engine).AllSessions()) {
    const Tenant t{s->tenant, TenantSalt(s->tenant, "")};
    v1::GetSessionRequest g;
    g.set_session_id(s->id);
    (void)engine.GetSession(t, g);
    v1::AttachRequest ar;
    ar.set_session_id(s->id);
    ar.set_worker_id("fuzz");
    auto a = engine.Attach(t, ar);
    if (a.ok()) {
      const int L = s->model.layers, hq = s->model.shape.h * s->model.shape.g, d = s->model.shape.d;
      for (int l = 0; l < L && l < 8; ++l) {
        v1::GetStaticSetRequest gs;
        gs.set_attachment_id(a->attachment_id());
        gs.set_layer(l);
        (void)engine.GetStaticSet(t, gs);
        v1::SelectAndReconstructRequest sr;
        sr.set_layer(l);
        auto* sq = sr.add_queries();
        sq->set_attachment_id(a->attachment_id());
        *sq->mutable_q() = RandomTensor(rng, {hq, d});
        (void)engine.SelectAndReconstruct(t, sr);
        v1::AttendRequest at;
        at.set_layer(l);
        auto* aq = at.add_queries();
        aq->set_attachment_id(a->attachment_id());
        *aq->mutable_q() = RandomTensor(rng, {hq, d});
        (void)engine.Attend(t, at);
      }
      v1::DetachRequest dr;
      dr.set_attachment_id(a->attachment_id());
      (void)engine.Detach(t, dr);
    }
    v1::CloseSessionRequest c;
    c.set_session_id(s->id);
    (void)engine.CloseSession(t, c);
  }
}

// --- KVSHADE_FUZZ_WRITE_SEED -------------------------------------------------------------

void Put16(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(char((v >> (8 * i)) & 0xff));
}

void WriteSeed(const char* file) {
  char tmpl[] = "/tmp/kvshade-durable-seed-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) std::abort();
  const std::string dir = tmpl;
  ServerConfig config = Config();
  config.spill_path = dir + "/spill";
  Metrics metrics;
  {
    storage::RocksSpillOptions so;
    so.path = config.spill_path;
    auto spill = storage::RocksSpillTier::Open(so);
    if (!spill.ok()) std::abort();
    EngineOptions o;
    o.background_thread = false;
    o.spill_tier = spill->get();
    auto engine = Engine::Create(&Cpu(), &config, &metrics, o);
    if (!engine.ok()) std::abort();
    const Tenant t{"alice", TenantSalt("alice", "")};
    std::mt19937_64 rng(1);
    for (auto [kind, n] : {std::pair{v1::PROFILE_KIND_SHADOW, 64}, {v1::PROFILE_KIND_EXACT, 16}}) {
      v1::CreateSessionRequest cr;
      v1::ModelSpec* m = cr.mutable_model();
      m->set_model_id("fuzz/model");
      m->set_num_layers(kLayers);
      m->set_num_kv_heads(kKvHeads);
      m->set_num_query_heads(kKvHeads * kGroup);
      m->set_head_dim(kHeadDim);
      m->set_dtype(v1::DTYPE_BF16);
      cr.mutable_profile()->set_kind(kind);
      cr.set_durable(true);
      for (int i = 0; i < n; ++i) cr.add_token_ids(100 + i);
      auto c = (*engine)->CreateSession(t, cr);
      if (!c.ok()) std::abort();
      std::vector<v1::IngestRequest> stream(1);
      stream[0].mutable_header()->set_session_id(c->session_id());
      for (int l = 0; l < kLayers; ++l) {
        v1::IngestLayer* il = stream.emplace_back().mutable_layer();
        il->set_layer(l);
        *il->mutable_k() = RandomTensor(rng, {n, kKvHeads, kHeadDim});
        *il->mutable_v() = RandomTensor(rng, {n, kKvHeads, kHeadDim});
        il->set_last_part(true);
      }
      stream.emplace_back().mutable_commit();
      if (!(*engine)->Ingest(t, stream).ok()) std::abort();
      // Three appended tokens: an exact tail in the session record.
      v1::AppendTokensRequest ap;
      ap.set_session_id(c->session_id());
      for (int i = 0; i < 3; ++i) ap.add_token_ids(5000 + i);
      for (int l = 0; l < kLayers; ++l) {
        v1::LayerKV* kv = ap.add_layers();
        kv->set_layer(l);
        *kv->mutable_k() = RandomTensor(rng, {3, kKvHeads, kHeadDim});
        *kv->mutable_v() = RandomTensor(rng, {3, kKvHeads, kHeadDim});
      }
      if (!(*engine)->AppendTokens(t, ap).ok()) std::abort();
    }
  }
  storage::RocksSpillOptions so;
  so.path = config.spill_path;
  auto tier = storage::RocksSpillTier::Open(so);
  if (!tier.ok()) std::abort();
  auto metas = (*tier)->ListSegments();
  if (!metas.ok()) std::abort();
  std::string out;
  for (const auto& m : *metas) {
    if (m.durability != storage::Durability::kDurable) continue;
    Put16(&out, m.id.hi, 8);
    Put16(&out, m.id.lo, 8);
    Put16(&out, m.user_metadata.size(), 2);
    out += m.user_metadata;
    Put16(&out, m.factors.size(), 1);
    for (const auto& f : m.factors) {
      std::string bytes(f.bytes, '\0');
      if (!(*tier)->ReadFactor(m.id, f.layer, f.kind,
                               absl::MakeSpan(reinterpret_cast<std::byte*>(bytes.data()), bytes.size()))
               .ok()) {
        std::abort();
      }
      Put16(&out, f.layer, 1);
      Put16(&out, uint8_t(f.kind), 1);
      Put16(&out, bytes.size(), 4);
      out += bytes;
    }
  }
  tier->reset();
  std::filesystem::remove_all(dir);
  FILE* f = std::fopen(file, "wb");
  if (f == nullptr || std::fwrite(out.data(), 1, out.size(), f) != out.size()) std::abort();
  std::fclose(f);
  std::fprintf(stderr, "durable_fuzzer: wrote %zu records (%zu bytes) to %s\n", metas->size(),
               out.size(), file);
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // the engine logs every session at info
  if (const char* seed = std::getenv("KVSHADE_FUZZ_WRITE_SEED")) WriteSeed(seed);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One engine for every input (Exercise closes every session it restored, so each input
  // starts from no sessions; segments a closed session left cached are evicted under the
  // budget like the daemon's).
  static Engine* engine = [] {
    static const ServerConfig* config = new ServerConfig(Config());
    static Metrics* metrics = new Metrics();
    EngineOptions o;
    o.clock = [] { return int64_t{1'700'000'000'000}; };
    o.background_thread = false;
    auto e = Engine::Create(&Cpu(), config, metrics, o);
    if (!e.ok()) std::abort();
    return e->release();
  }();
  Input in = Parse(data, size);
  auto read = [&](const storage::SegmentId& id, int layer, FactorKind kind,
                  absl::Span<std::byte> dst) -> absl::Status {
    auto it = in.factors.find({id, layer, int(kind)});
    if (it == in.factors.end() || it->second.size() != dst.size()) {
      return absl::DataLossError("fuzz: no such factor");
    }
    if (!dst.empty()) std::memcpy(dst.data(), it->second.data(), dst.size());
    return absl::OkStatus();
  };
  absl::Status st = EngineInternals(*engine).RestoreRecords(in.metas, read);
  if (!st.ok() && st.message().empty()) std::abort();
  Exercise(*engine);
  if (!EngineInternals(*engine).AllSessions().empty()) std::abort();  // all closed
  return 0;
}

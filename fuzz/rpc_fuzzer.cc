// Fuzz target: every RPC's request handling, in-process on the engine the gRPC service
// shell calls (service/engine.cc; grpc_service.cc only adds authentication, metrics and the
// status conversion). An input is a program of calls: each decoded request must be served
// or refused with a status carrying a message, and never crash, hang or corrupt the state
// other calls see.
//
// Program: repeated records { u8 op; u16 len (little-endian); len bytes }. The bytes are the
// serialized request of the call `op % kOps` picks (an unparsable request is skipped, as
// gRPC would refuse it); op & 0x80 makes the call as a second tenant. Ingest is a stream:
// kIngestBegin opens it with the header, kIngestAdd adds a message, kIngestFinish ends it
// cleanly (a program may leave it open: destroyed, it commits nothing).
//
// So that mutations reach real sessions, string fields named *session_id or attachment_id
// holding a placeholder are rewritten before the call:
//   "S"  the program's current session: the last one it created or forked, else a small
//        ready scratch session created on first use;
//   "T"  a ready shadow session built at start-up (read-only calls only: GetSession,
//        ForkSession, Attach; a mutating call keeps "T" and gets NOT_FOUND);
//   "A"  the last attachment the program made, else a reader attachment on "T";
//   "W"  a writer attachment on the current session.
// After each program every session but "T" is closed and every attachment detached, so that
// programs do not pile up state.
//
// KVSHADE_FUZZ_WRITE_SEED=<dir>: writes seed programs (each call used well, a stream with a
// message after its commit, a decode loop on "T", malformed ids) into <dir> and exits
// (fuzz/corpus/rpc_fuzzer/).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>

#include <spdlog/spdlog.h>

#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/types.h"
#include "kvshade/service/auth.h"
#include "kvshade/service/config.h"
#include "kvshade/service/engine.h"
#include "kvshade/service/metrics.h"

namespace {

using namespace kvshade;
using namespace kvshade::service;

enum Op : uint8_t {
  kCreateSession, kForkSession, kLookupPrefix, kGetSession, kListSessions, kCloseSession,
  kIngestBegin, kIngestAdd, kIngestFinish, kAppendTokens, kAttach, kDetach, kGetStaticSet,
  kSelect, kAttend, kExportSession, kStats, kMaintenance, kOps
};

constexpr int kLayers = 2, kKvHeads = 2, kGroup = 2, kHeadDim = 64;
constexpr int kSeedTokens = 128, kScratchTokens = 16;

v1::ModelSpec Model() {
  v1::ModelSpec m;
  m.set_model_id("fuzz/model");
  m.set_num_layers(kLayers);
  m.set_num_kv_heads(kKvHeads);
  m.set_num_query_heads(kKvHeads * kGroup);
  m.set_head_dim(kHeadDim);
  m.set_dtype(v1::DTYPE_BF16);
  return m;
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

class Fuzzer {
 public:
  Fuzzer() {
    config_.device_budget_bytes = 64ull << 20;
    config_.host_budget_bytes = 64ull << 20;
    config_.limits.max_tokens_per_session = 4096;
    config_.limits.max_sessions_per_tenant = 64;
    config_.profile.rank = 16;
    config_.profile.min_tokens = 64;
    config_.profile.outliers = 2;
    config_.profile.sparse_budget = 4;
    config_.profile.local_window = 8;
    auto backend = kernels::CreateBackend("cpu");
    if (!backend.ok()) std::abort();
    backend_ = std::move(backend).value();
    EngineOptions o;
    o.clock = [] { return int64_t{1'700'000'000'000}; };
    o.background_thread = false;
    auto engine = Engine::Create(backend_.get(), &config_, &metrics_, o);
    if (!engine.ok()) std::abort();
    engine_ = std::move(engine).value();
    seed_ = MakeSession(alice_, v1::PROFILE_KIND_SHADOW, kSeedTokens, 1);
    if (seed_.empty()) std::abort();
  }

  void Run(const uint8_t* data, size_t size) {
    current_.clear();
    last_attachment_.clear();
    writer_.clear();
    attachments_.clear();
    stream_.reset();
    while (size >= 3) {
      const uint8_t op = data[0];
      const size_t len = std::min<size_t>(size - 3, data[1] | (size_t(data[2]) << 8));
      Call(op, data + 3, len);
      data += 3 + len;
      size -= 3 + len;
    }
    stream_.reset();
    Cleanup();
  }

 private:
  // A ready session of `n` tokens (the same tokens for the same seed), or "".
  std::string MakeSession(const Tenant& t, v1::ProfileKind kind, int n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = Model();
    cr.mutable_profile()->set_kind(kind);
    for (int i = 0; i < n; ++i) cr.add_token_ids(1000 + int(seed * 7919 % 1000) + i);
    auto c = engine_->CreateSession(t, cr);
    if (!c.ok()) return "";
    std::vector<v1::IngestRequest> stream(1);
    stream[0].mutable_header()->set_session_id(c->session_id());
    const int from = int(c->reused_tokens());
    for (int l = 0; l < kLayers && from < n; ++l) {
      v1::IngestRequest r;
      v1::IngestLayer* il = r.mutable_layer();
      il->set_layer(l);
      il->set_token_offset(0);
      *il->mutable_k() = RandomTensor(rng, {n - from, kKvHeads, kHeadDim});
      *il->mutable_v() = RandomTensor(rng, {n - from, kKvHeads, kHeadDim});
      il->set_last_part(true);
      stream.push_back(std::move(r));
    }
    stream.emplace_back().mutable_commit();
    if (from < n && !engine_->Ingest(t, stream).ok()) return "";
    return c->session_id();
  }

  std::string Current(const Tenant& t) {
    if (current_.empty()) current_ = MakeSession(t, v1::PROFILE_KIND_EXACT, kScratchTokens, 2);
    return current_;
  }

  std::string AttachTo(const Tenant& t, const std::string& session, bool writer) {
    v1::AttachRequest ar;
    ar.set_session_id(session);
    ar.set_worker_id("fuzz");
    ar.set_writer(writer);
    auto a = engine_->Attach(t, ar);
    if (!a.ok()) return "";
    attachments_.push_back({t, a->attachment_id()});
    return a->attachment_id();
  }

  // Rewrites the placeholders of every string field named *session_id or attachment_id.
  void Substitute(google::protobuf::Message* m, const Tenant& t, bool read_only, int depth = 0) {
    if (depth > 8) return;
    const auto* d = m->GetDescriptor();
    const auto* r = m->GetReflection();
    for (int i = 0; i < d->field_count(); ++i) {
      const auto* f = d->field(i);
      if (f->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
        if (f->is_repeated()) {
          for (int j = 0; j < r->FieldSize(*m, f); ++j) {
            Substitute(r->MutableRepeatedMessage(m, f, j), t, read_only, depth + 1);
          }
        } else if (r->HasField(*m, f)) {
          Substitute(r->MutableMessage(m, f), t, read_only, depth + 1);
        }
        continue;
      }
      if (f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_STRING || f->is_repeated()) {
        continue;
      }
      const std::string& name = f->name();
      const bool session = name.size() >= 10 && name.compare(name.size() - 10, 10, "session_id") == 0;
      if (!session && name != "attachment_id") continue;
      const std::string v = r->GetString(*m, f);
      std::string to;
      if (session && v == "S") to = Current(t);
      if (session && v == "T" && read_only) to = seed_;
      if (!session && v == "A") {
        if (last_attachment_.empty()) last_attachment_ = AttachTo(t, seed_, false);
        to = last_attachment_;
      }
      if (!session && v == "W") {
        if (writer_.empty()) writer_ = AttachTo(t, Current(t), true);
        to = writer_;
      }
      if (!to.empty()) r->SetString(m, f, to);
    }
  }

  template <typename Req>
  bool Decode(const uint8_t* p, size_t n, const Tenant& t, bool read_only, Req* req) {
    if (!req->ParseFromArray(p, int(n))) return false;
    Substitute(req, t, read_only);
    return true;
  }

  template <typename T>
  static void Check(const absl::StatusOr<T>& r) {
    // A refusal always says why (the client shows the message).
    if (!r.ok() && r.status().message().empty()) std::abort();
  }
  static void Check(const absl::Status& s) {
    if (!s.ok() && s.message().empty()) std::abort();
  }

  void Call(uint8_t op_byte, const uint8_t* p, size_t n) {
    const Tenant& t = (op_byte & 0x80) ? bob_ : alice_;
    switch (static_cast<Op>((op_byte & 0x7f) % kOps)) {
      case kCreateSession: {
        v1::CreateSessionRequest req;
        if (!Decode(p, n, t, false, &req)) return;
        auto r = engine_->CreateSession(t, req);
        Check(r);
        if (r.ok()) current_ = r->session_id();
        return;
      }
      case kForkSession: {
        v1::ForkSessionRequest req;
        if (!Decode(p, n, t, true, &req)) return;
        auto r = engine_->ForkSession(t, req);
        Check(r);
        if (r.ok()) current_ = r->session_id();
        return;
      }
      case kLookupPrefix: {
        v1::LookupPrefixRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->LookupPrefix(t, req));
        return;
      }
      case kGetSession: {
        v1::GetSessionRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->GetSession(t, req));
        return;
      }
      case kListSessions: {
        v1::ListSessionsRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->ListSessions(t, req));
        return;
      }
      case kCloseSession: {
        v1::CloseSessionRequest req;
        if (!Decode(p, n, t, false, &req)) return;
        auto r = engine_->CloseSession(t, req);
        Check(r);
        if (r.ok() && req.session_id() == current_) current_.clear(), writer_.clear();
        return;
      }
      case kIngestBegin: {
        v1::IngestRequest req;
        if (!Decode(p, n, t, false, &req)) return;
        stream_.reset();
        auto s = engine_->BeginIngest(t, req);
        Check(s);
        if (s.ok()) stream_ = std::move(s).value();
        return;
      }
      case kIngestAdd: {
        v1::IngestRequest req;
        if (stream_ && Decode(p, n, t, false, &req)) Check(stream_->Add(req));
        return;
      }
      case kIngestFinish: {
        if (stream_) Check(stream_->Finish());
        stream_.reset();
        return;
      }
      case kAppendTokens: {
        v1::AppendTokensRequest req;
        if (Decode(p, n, t, false, &req)) Check(engine_->AppendTokens(t, req));
        return;
      }
      case kAttach: {
        v1::AttachRequest req;
        if (!Decode(p, n, t, true, &req)) return;
        auto r = engine_->Attach(t, req);
        Check(r);
        if (r.ok()) {
          attachments_.push_back({t, r->attachment_id()});
          last_attachment_ = r->attachment_id();
          if (r->writer()) writer_ = r->attachment_id();
        }
        return;
      }
      case kDetach: {
        v1::DetachRequest req;
        if (Decode(p, n, t, false, &req)) Check(engine_->Detach(t, req));
        return;
      }
      case kGetStaticSet: {
        v1::GetStaticSetRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->GetStaticSet(t, req));
        return;
      }
      case kSelect: {
        v1::SelectAndReconstructRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->SelectAndReconstruct(t, req));
        return;
      }
      case kAttend: {
        v1::AttendRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->Attend(t, req));
        return;
      }
      case kExportSession: {
        v1::ExportSessionRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->ExportSession(t, req));
        return;
      }
      case kStats: {
        v1::StatsRequest req;
        if (Decode(p, n, t, true, &req)) Check(engine_->Stats(t, req));
        return;
      }
      case kMaintenance:
        engine_->RunMaintenance();
        return;
      case kOps:
        return;
    }
  }

  void Cleanup() {
    for (const auto& [t, id] : attachments_) {
      v1::DetachRequest d;
      d.set_attachment_id(id);
      (void)engine_->Detach(t, d);
    }
    attachments_.clear();
    for (const Tenant* t : {&alice_, &bob_}) {
      auto list = engine_->ListSessions(*t, {});
      if (!list.ok()) std::abort();
      for (const auto& s : list->sessions()) {
        if (s.session_id() == seed_) continue;
        v1::CloseSessionRequest c;
        c.set_session_id(s.session_id());
        if (!engine_->CloseSession(*t, c).ok()) std::abort();  // nothing else holds them
      }
    }
    // The seed is untouched by every program.
    v1::GetSessionRequest g;
    g.set_session_id(seed_);
    auto info = engine_->GetSession(alice_, g);
    if (!info.ok() || info->tokens() != uint64_t(kSeedTokens)) std::abort();
  }

  ServerConfig config_;
  Metrics metrics_;
  std::unique_ptr<kernels::Backend> backend_;
  std::unique_ptr<Engine> engine_;
  Tenant alice_{"alice", TenantSalt("alice", "")};
  Tenant bob_{"bob", TenantSalt("bob", "")};
  std::string seed_;
  std::string current_, last_attachment_, writer_;
  std::vector<std::pair<Tenant, std::string>> attachments_;
  std::unique_ptr<Engine::IngestStream> stream_;
};

// --- KVSHADE_FUZZ_WRITE_SEED -------------------------------------------------------------

class Program {
 public:
  Program& Add(Op op, const google::protobuf::Message& m, bool second_tenant = false) {
    const std::string bytes = m.SerializeAsString();
    out_.push_back(char(op | (second_tenant ? 0x80 : 0)));
    out_.push_back(char(bytes.size() & 0xff));
    out_.push_back(char(bytes.size() >> 8));
    out_ += bytes;
    return *this;
  }
  Program& Add(Op op) {
    out_.append({char(op), 0, 0});
    return *this;
  }
  void Write(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr || std::fwrite(out_.data(), 1, out_.size(), f) != out_.size()) std::abort();
    std::fclose(f);
  }

 private:
  std::string out_;
};

void WriteSeeds(const std::string& dir) {
  std::mt19937_64 rng(3);
  const int n = 16, hq = kKvHeads * kGroup;
  auto layer = [&](int l, int offset, int tokens, bool last) {
    v1::IngestRequest r;
    v1::IngestLayer* il = r.mutable_layer();
    il->set_layer(l);
    il->set_token_offset(offset);
    *il->mutable_k() = RandomTensor(rng, {tokens, kKvHeads, kHeadDim});
    *il->mutable_v() = RandomTensor(rng, {tokens, kKvHeads, kHeadDim});
    il->set_last_part(last);
    return r;
  };
  v1::IngestRequest header, commit;
  header.mutable_header()->set_session_id("S");
  commit.mutable_commit();
  for (v1::ProfileKind kind : {v1::PROFILE_KIND_EXACT, v1::PROFILE_KIND_MINI}) {
    // A session's whole life: create, ingest in parts, attach as writer, append, fork,
    // decode, close.
    v1::CreateSessionRequest cr;
    *cr.mutable_model() = Model();
    cr.mutable_profile()->set_kind(kind);
    for (int i = 0; i < n; ++i) cr.add_token_ids(7 + i);
    v1::AttachRequest ar;
    ar.set_session_id("S");
    ar.set_worker_id("w");
    ar.set_writer(true);
    v1::AppendTokensRequest ap;
    ap.set_session_id("S");
    ap.set_attachment_id("A");
    ap.add_token_ids(99);
    for (int l = 0; l < kLayers; ++l) {
      v1::LayerKV* kv = ap.add_layers();
      kv->set_layer(l);
      *kv->mutable_k() = RandomTensor(rng, {1, kKvHeads, kHeadDim});
      *kv->mutable_v() = RandomTensor(rng, {1, kKvHeads, kHeadDim});
    }
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id("S");
    fr.set_at_token(n);
    v1::GetStaticSetRequest gs;
    gs.set_attachment_id("A");
    gs.set_layer(1);
    v1::SelectAndReconstructRequest sr;
    sr.set_layer(0);
    sr.add_queries()->set_attachment_id("A");
    *sr.mutable_queries(0)->mutable_q() = RandomTensor(rng, {hq, kHeadDim});
    v1::AttendRequest at;
    at.set_layer(1);
    at.add_queries()->set_attachment_id("A");
    *at.mutable_queries(0)->mutable_q() = RandomTensor(rng, {hq, kHeadDim});
    v1::GetSessionRequest gr;
    gr.set_session_id("S");
    v1::CloseSessionRequest cl;
    cl.set_session_id("S");
    v1::DetachRequest dr;
    dr.set_attachment_id("A");
    Program p;
    p.Add(kCreateSession, cr).Add(kIngestBegin, header);
    p.Add(kIngestAdd, layer(0, 0, n / 2, false)).Add(kIngestAdd, layer(0, n / 2, n / 2, true));
    p.Add(kIngestAdd, layer(1, 0, n, true)).Add(kIngestAdd, commit).Add(kIngestFinish);
    p.Add(kAttach, ar).Add(kAppendTokens, ap).Add(kGetStaticSet, gs).Add(kSelect, sr);
    p.Add(kAttend, at).Add(kGetSession, gr).Add(kForkSession, fr).Add(kListSessions, v1::ListSessionsRequest());
    p.Add(kStats, v1::StatsRequest()).Add(kMaintenance).Add(kDetach, dr).Add(kCloseSession, cl);
    p.Write(dir + (kind == v1::PROFILE_KIND_EXACT ? "/life_exact" : "/life_mini"));

    // A message after the commit fails the stream, and so the commit.
    Program q;
    q.Add(kCreateSession, cr).Add(kIngestBegin, header).Add(kIngestAdd, layer(0, 0, n, true));
    q.Add(kIngestAdd, layer(1, 0, n, true)).Add(kIngestAdd, commit).Add(kIngestAdd, layer(0, 0, n, true));
    q.Add(kIngestFinish).Add(kGetSession, gr).Add(kIngestBegin, header);
    q.Write(dir + (kind == v1::PROFILE_KIND_EXACT ? "/after_commit_exact" : "/after_commit_mini"));
  }
  {
    // Decode on the shadow session "T": attach, static set, select, attend with a new token,
    // export, fork at the end, and the second tenant trying the same ids.
    v1::AttachRequest ar;
    ar.set_session_id("T");
    ar.set_worker_id("w");
    v1::GetStaticSetRequest gs;
    gs.set_attachment_id("A");
    v1::SelectAndReconstructRequest sr;
    sr.set_layer(1);
    sr.add_queries()->set_attachment_id("A");
    *sr.mutable_queries(0)->mutable_q() = RandomTensor(rng, {hq, kHeadDim});
    v1::AttendRequest at;
    at.add_queries()->set_attachment_id("A");
    *at.mutable_queries(0)->mutable_q() = RandomTensor(rng, {hq, kHeadDim});
    *at.mutable_queries(0)->mutable_k_new() = RandomTensor(rng, {kKvHeads, kHeadDim});
    *at.mutable_queries(0)->mutable_v_new() = RandomTensor(rng, {kKvHeads, kHeadDim});
    v1::ExportSessionRequest ex;
    ex.set_attachment_id("A");
    v1::ForkSessionRequest fr;
    fr.set_parent_session_id("T");
    fr.set_at_token(kSeedTokens);
    v1::LookupPrefixRequest lp;
    *lp.mutable_model() = Model();
    lp.mutable_profile()->set_kind(v1::PROFILE_KIND_SHADOW);
    for (int i = 0; i < kSeedTokens; ++i) lp.add_token_ids(1000 + int(1 * 7919 % 1000) + i);
    Program p;
    p.Add(kAttach, ar).Add(kGetStaticSet, gs).Add(kSelect, sr).Add(kSelect, sr).Add(kAttend, at);
    p.Add(kExportSession, ex).Add(kForkSession, fr).Add(kLookupPrefix, lp);
    p.Add(kSelect, sr, true).Add(kAttend, at, true).Add(kAttach, ar, true);
    p.Write(dir + "/decode_shadow");
  }
  {
    // Malformed: a long id, an empty request of each kind, an unknown attachment.
    v1::GetSessionRequest gr;
    gr.set_session_id(std::string(2000, 'x'));
    Program p;
    p.Add(kGetSession, gr).Add(kCreateSession, v1::CreateSessionRequest());
    p.Add(kIngestBegin, v1::IngestRequest()).Add(kAppendTokens, v1::AppendTokensRequest());
    p.Add(kAttach, v1::AttachRequest()).Add(kSelect, v1::SelectAndReconstructRequest());
    p.Add(kAttend, v1::AttendRequest()).Add(kExportSession, v1::ExportSessionRequest());
    p.Write(dir + "/malformed");
  }
  std::exit(0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  spdlog::set_level(spdlog::level::off);  // the engine logs every session at info
  if (const char* dir = std::getenv("KVSHADE_FUZZ_WRITE_SEED")) WriteSeeds(dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Fuzzer* fuzzer = new Fuzzer();
  fuzzer->Run(data, size);
  return 0;
}

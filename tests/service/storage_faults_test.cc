// Storage faults under the engine (docs/OPERATIONS.md "Storage faults"). The engine runs on
// the spill tier the test composes, as the server composes it: a FaultInjectingSpillTier
// (injected I/O errors: UNAVAILABLE) in front of a RocksDB tier on a simulated disk
// (DiskFaults under RocksDB's own files: a full disk, RESOURCE_EXHAUSTED). A write fault
// fails the call that needed the write and nothing else; nothing acknowledged is lost; a
// read fault on page-in is an error, never wrong bytes.
#include <atomic>
#include <cstring>
#include <shared_mutex>

#include "absl/strings/match.h"
#include "engine_internals.h"
#include "service_test_util.h"

namespace kvshade::service::testing {
namespace storage_faults_test {
namespace {

#define ASSIGN_OK(lhs, expr)                         \
  auto lhs##_or = (expr);                            \
  ASSERT_TRUE(lhs##_or.ok()) << lhs##_or.status();   \
  auto lhs = *std::move(lhs##_or)

storage::FaultOptions Writes(double p) {
  storage::FaultOptions o;
  o.write_failure_probability = p;
  return o;
}

storage::FaultOptions Reads(double p, bool fail_after_read) {
  storage::FaultOptions o;
  o.read_failure_probability = p;
  o.fail_after_read = fail_after_read;
  return o;
}

// A stream over its own tokens (no prefix shared with another test stream).
Stream StreamOf(const Harness& hx, int n, uint64_t seed) {
  return MakeStream(n, hx.model, seed, 16, 1000 + int(seed) * 10000);
}

// CreateSession + Ingest of the first `n` tokens of `s`; the commit's status (the session's
// id in *id once created).
absl::Status CreateAndIngest(Harness& hx, const Stream& s, int n, bool durable, std::string* id) {
  v1::CreateSessionRequest cr;
  *cr.mutable_model() = hx.model;
  *cr.mutable_profile() = SmallShadowProfile();
  cr.mutable_token_ids()->Add(s.tokens.begin(), s.tokens.begin() + n);
  cr.set_durable(durable);
  auto c = hx.engine->CreateSession(hx.tenant, cr);
  if (!c.ok()) return c.status();
  *id = c->session_id();
  return hx.engine->Ingest(hx.tenant, IngestStreamOf(*id, s, int(c->reused_tokens()), n)).status();
}

absl::StatusOr<v1::SessionInfo> Info(Harness& hx, const std::string& id) {
  v1::GetSessionRequest r;
  r.set_session_id(id);
  return hx.engine->GetSession(hx.tenant, r);
}

bool SameBytes(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Whether none of the session's values are in host memory (all spilled).
bool Spilled(Harness& hx, const std::string& id) {
  auto s = EngineInternals(*hx.engine).FindSession(hx.tenant.name, id);
  if (!s.ok()) return false;
  std::shared_lock lock((*s)->mu);
  for (const auto& seg : (*s)->chain) {
    const Segment& owner = seg->values_owner();
    if (!owner.values_in_store) continue;
    auto u = EngineInternals(*hx.engine).store().Usage(owner.id);
    if (!u.ok() || u->resident_bytes != 0) return false;
  }
  return true;
}

// A refused durable commit (or append) is either absent after a restart, or there whole.
void ExpectAbsentOrComplete(Harness& hx, const std::string& id, uint64_t tokens) {
  auto info = Info(hx, id);
  if (!info.ok()) {
    EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound) << info.status();
    return;
  }
  EXPECT_EQ(info->state(), "ready") << id;
  EXPECT_EQ(info->tokens(), tokens) << id;
}

// Durable commits and logged appends meet an I/O error, then a full disk: each refused
// call answers UNAVAILABLE / RESOURCE_EXHAUSTED, every other session answers bit for bit as
// before, and after a restart (no drain: what a crash leaves) every acknowledged write is
// there and nothing refused is there in part.
TEST(EngineStorageFaults, WriteFaultsFailTheAffectedCallOnlyAndLoseNothingAcknowledged) {
  TempDir dir;
  SpillSetup setup;
  setup.disk_faults = std::make_shared<storage::DiskFaults>();
  setup.fault_tier = true;
  setup.configure = [](ServerConfig& c) { c.append_fsync = "always"; };
  Harness hx(dir.path(), setup);
  ASSERT_NE(hx.faults, nullptr);
  const Stream a = StreamOf(hx, 560, 1), b = StreamOf(hx, 512, 2), c = StreamOf(hx, 512, 3),
               d = StreamOf(hx, 512, 4), e = StreamOf(hx, 512, 5);
  auto oa = hx.Open(a, SmallShadowProfile(), 512, /*durable=*/true);
  auto ob = hx.Open(b, SmallShadowProfile(), -1, /*durable=*/false);
  ASSERT_FALSE(oa.attachment.empty());
  ASSERT_FALSE(ob.attachment.empty());
  const auto q = hx.Query(7);
  ASSIGN_OK(ref_a, hx.Attend(oa.attachment, 1, q));
  ASSIGN_OK(ref_b, hx.Attend(ob.attachment, 1, q));
  auto still_serving = [&](const char* when) {
    auto got_a = hx.Attend(oa.attachment, 1, q);
    auto got_b = hx.Attend(ob.attachment, 1, q);
    ASSERT_TRUE(got_a.ok()) << when << ": " << got_a.status();
    ASSERT_TRUE(got_b.ok()) << when << ": " << got_b.status();
    EXPECT_TRUE(SameBytes(*got_a, ref_a)) << when;
    EXPECT_TRUE(SameBytes(*got_b, ref_b)) << when;
  };

  // 1. An I/O error on every spill tier write.
  hx.faults->SetOptions(Writes(1.0));
  std::string sc;
  absl::Status st = CreateAndIngest(hx, c, c.n(), /*durable=*/true, &sc);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(absl::StrContains(st.message(), "injected")) << st;
  auto ap = hx.engine->AppendTokens(hx.tenant, AppendOf(oa.session, a, 512, 520));
  EXPECT_EQ(ap.status().code(), absl::StatusCode::kUnavailable) << ap.status();
  ASSIGN_OK(ia, Info(hx, oa.session));
  EXPECT_EQ(ia.tokens(), 512u);  // the refused append did not happen
  still_serving("I/O errors");
  std::string sd;
  EXPECT_TRUE(CreateAndIngest(hx, d, d.n(), /*durable=*/false, &sd).ok());
  EXPECT_GE(hx.faults->injected_write_failures(), 2u);
  hx.faults->SetOptions({});

  // 2. A full disk.
  setup.disk_faults->SetFreeBytes(0);
  std::string se;
  st = CreateAndIngest(hx, e, e.n(), /*durable=*/true, &se);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  ap = hx.engine->AppendTokens(hx.tenant, AppendOf(oa.session, a, 512, 520));
  EXPECT_EQ(ap.status().code(), absl::StatusCode::kResourceExhausted) << ap.status();
  still_serving("full disk");

  // 3. Space returns: the same writes are acknowledged now.
  setup.disk_faults->SetUnlimited();
  ap = hx.engine->AppendTokens(hx.tenant, AppendOf(oa.session, a, 512, 520));
  ASSERT_TRUE(ap.ok()) << ap.status();
  ASSIGN_OK(ref_a2, hx.Attend(oa.attachment, 1, q));

  // 4. A restart without a drain.
  hx.Restart();
  ASSIGN_OK(ra, Info(hx, oa.session));
  EXPECT_EQ(ra.state(), "ready");
  EXPECT_EQ(ra.tokens(), 520u);
  ASSIGN_OK(got, hx.Attend(hx.AttachTo(oa.session), 1, q));
  EXPECT_TRUE(SameBytes(got, ref_a2)) << "acknowledged session answers differently after the restart";
  ExpectAbsentOrComplete(hx, sc, 512);
  ExpectAbsentOrComplete(hx, se, 512);
  for (const std::string& gone : {ob.session, sd}) {  // not durable
    EXPECT_EQ(Info(hx, gone).status().code(), absl::StatusCode::kNotFound);
  }
}

// A host budget of two sessions' values: opening a third spills the least recently used
// one. A write fault during that spill fails the call that needed the room (and only it);
// a read fault while paging the spilled one back in fails that call, and whatever the
// failed read left in memory is never served: once reads work the session answers bit for
// bit as before it was spilled.
TEST(EngineStorageFaults, SpillWriteAndPageInReadFaultsAreErrorsNeverWrongBytes) {
  TempDir dir;
  SpillSetup setup;
  setup.fault_tier = true;
  setup.configure = [](ServerConfig& c) { c.host_budget_bytes = 5u << 19; };
  Harness hx(dir.path(), setup);
  ASSERT_NE(hx.faults, nullptr);
  const int n = 2048;  // values: 2 layers x 2 heads x 2048 x 64 bf16 = 1 MiB a session
  const Stream a = StreamOf(hx, n, 11), b = StreamOf(hx, n, 12), c = StreamOf(hx, n, 13);
  auto oa = hx.Open(a, SmallShadowProfile());
  auto ob = hx.Open(b, SmallShadowProfile());
  ASSERT_FALSE(oa.attachment.empty());
  ASSERT_FALSE(ob.attachment.empty());
  const auto q = hx.Query(5);
  ASSIGN_OK(ref_a, hx.Attend(oa.attachment, 1, q));
  ASSIGN_OK(ref_b, hx.Attend(ob.attachment, 1, q));
  v1::DetachRequest detach;
  detach.set_attachment_id(oa.attachment);
  ASSERT_TRUE(hx.engine->Detach(hx.tenant, detach).ok());
  const uint64_t spills_before = EngineInternals(*hx.engine).store().Stats().spills;

  // The spill a third session needs fails: that session's ingest answers the error.
  hx.faults->SetOptions(Writes(1.0));
  std::string sc;
  absl::Status st = CreateAndIngest(hx, c, n, /*durable=*/false, &sc);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_GE(hx.faults->injected_write_failures(), 1u);
  EXPECT_EQ(EngineInternals(*hx.engine).store().Stats().spills, spills_before);
  ASSIGN_OK(got_b, hx.Attend(ob.attachment, 1, q));
  EXPECT_TRUE(SameBytes(got_b, ref_b));
  hx.faults->SetOptions({});

  // Writes work: the third session spills the first one out.
  v1::CloseSessionRequest close;
  close.set_session_id(sc);
  hx.engine->CloseSession(hx.tenant, close).IgnoreError();
  auto oc = hx.Open(c, SmallShadowProfile());
  ASSERT_FALSE(oc.attachment.empty());
  ASSERT_TRUE(Spilled(hx, oa.session));

  // Reads fail before (the page-in's memory holds whatever it held) and after the read
  // (it holds the bytes): either way the page-in is an error, and nothing of it is served.
  uint64_t seed = 20;
  for (bool after : {false, true}) {
    const uint64_t page_ins = EngineInternals(*hx.engine).store().Stats().page_ins;
    hx.faults->SetOptions(Reads(1.0, after));
    v1::AttachRequest ar;
    ar.set_session_id(oa.session);
    ar.set_worker_id("w");
    const uint64_t attachments = EngineInternals(*hx.engine).Counts().attachments;
    auto att = hx.engine->Attach(hx.tenant, ar);
    // Attach pages the values in and fails with the read's error, leaving no attachment.
    EXPECT_EQ(att.status().code(), absl::StatusCode::kUnavailable) << "fail_after_read " << after << ": "
                                                                   << att.status();
    EXPECT_EQ(EngineInternals(*hx.engine).Counts().attachments, attachments);
    EXPECT_EQ(EngineInternals(*hx.engine).store().Stats().page_ins, page_ins);
    hx.faults->SetOptions({});
    const std::string attachment = att.ok() ? att->attachment_id() : hx.AttachTo(oa.session);
    ASSIGN_OK(got, hx.Attend(attachment, 1, q));
    EXPECT_TRUE(SameBytes(got, ref_a)) << "fail_after_read " << after;
    // Out of memory again for the next round.
    v1::DetachRequest dr;
    dr.set_attachment_id(attachment);
    ASSERT_TRUE(hx.engine->Detach(hx.tenant, dr).ok());
    for (int i = 0; i < 4 && !Spilled(hx, oa.session); ++i) {
      ASSERT_FALSE(hx.Open(StreamOf(hx, n, seed++), SmallShadowProfile()).attachment.empty());
    }
    ASSERT_TRUE(Spilled(hx, oa.session));
  }
}


// Closing a durable session deletes its record first: a refused delete fails the close and
// leaves the session open and served; an acknowledged close stays closed after a restart.
TEST(EngineStorageFaults, RefusedDeleteFailsTheCloseAndTheSessionStaysOpen) {
  TempDir dir;
  SpillSetup setup;
  setup.fault_tier = true;
  Harness hx(dir.path(), setup);
  ASSERT_NE(hx.faults, nullptr);
  const Stream a = StreamOf(hx, 512, 31);
  auto oa = hx.Open(a, SmallShadowProfile(), -1, /*durable=*/true);
  ASSERT_FALSE(oa.attachment.empty());
  const auto q = hx.Query(3);
  ASSIGN_OK(ref, hx.Attend(oa.attachment, 1, q));
  v1::CloseSessionRequest close;
  close.set_session_id(oa.session);

  hx.faults->SetOptions(Writes(1.0));
  auto refused = hx.engine->CloseSession(hx.tenant, close);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  hx.faults->SetOptions({});
  ASSIGN_OK(info, Info(hx, oa.session));
  EXPECT_EQ(info.state(), "ready");
  ASSIGN_OK(got, hx.Attend(oa.attachment, 1, q));
  EXPECT_TRUE(SameBytes(got, ref));

  hx.Restart();  // the close was not acknowledged: the session is there
  ASSIGN_OK(back, hx.Attend(hx.AttachTo(oa.session), 1, q));
  EXPECT_TRUE(SameBytes(back, ref));
  ASSERT_TRUE(hx.engine->CloseSession(hx.tenant, close).ok());
  hx.Restart();  // acknowledged: gone for good
  EXPECT_EQ(Info(hx, oa.session).status().code(), absl::StatusCode::kNotFound);
}

// Passes everything through to `base`, except that while `refuse_records` is on it refuses
// the writes of session records, and while `fail_factor_reads` is on the factor reads (of
// every record, or of those `fail_reads_of` names) fail with UNAVAILABLE: storage faults
// that meet exactly those.
class GateTier final : public ForwardingSpillTier {
 public:
  explicit GateTier(storage::SpillTier& base) : ForwardingSpillTier(base) {}
  std::atomic<bool> refuse_records{false};
  std::atomic<bool> fail_factor_reads{false};
  std::string fail_reads_of;  // with fail_factor_reads: only records whose metadata starts so
  std::atomic<int> refused{0};

  absl::Status WriteSegment(const storage::SegmentWrite& w) override {
    if (refuse_records.load() && w.user_metadata.rfind("KVSHSES1", 0) == 0) {
      ++refused;
      return absl::UnavailableError("session record write refused by the test");
    }
    return base_.WriteSegment(w);
  }
  absl::Status ReadFactor(const storage::SegmentId& id, int layer, storage::FactorKind kind,
                          absl::Span<std::byte> dst) override {
    if (fail_factor_reads.load()) {
      auto meta = base_.ReadMeta(id);
      if (fail_reads_of.empty() || (meta.ok() && meta->user_metadata.rfind(fail_reads_of, 0) == 0)) {
        return absl::UnavailableError("factor read failed (test)");
      }
    }
    return base_.ReadFactor(id, layer, kind, dst);
  }
};

// Appends fsynced always, and a GateTier in front of the RocksDB tier (made anew at each
// start; *gate points at the current one).
SpillSetup GatedSetup(GateTier** gate) {
  SpillSetup setup;
  setup.configure = [](ServerConfig& c) { c.append_fsync = "always"; };
  setup.front = [gate](storage::SpillTier& base) {
    auto g = std::make_unique<GateTier>(base);
    *gate = g.get();
    return std::unique_ptr<storage::SpillTier>(std::move(g));
  };
  return setup;
}

// A background refactorization whose session record cannot be written keeps serving the
// refactorized session; the record on disk is still the one before it. Appends logged after
// that must name that record, so that a restart applies them: none is lost.
TEST(EngineStorageFaults, AppendsAfterARefusedRecordWriteSurviveARestart) {
  TempDir dir;
  GateTier* gate = nullptr;
  const SpillSetup setup = GatedSetup(&gate);
  Harness hx(dir.path(), setup);
  ASSERT_NE(gate, nullptr);
  // A document and a turn whose keys lie in another subspace: the turn's suffix drifts and
  // a refactorization is scheduled (durable_refactor_test.cc RefactorTest).
  Stream s = MakeStream(512, hx.model, 70, 16, 100);
  const Stream b = MakeStream(208, hx.model, 71, 16, 100 + 512);
  for (int l = 0; l < s.L; ++l) {
    s.k[l].insert(s.k[l].end(), b.k[l].begin(), b.k[l].end());
    s.v[l].insert(s.v[l].end(), b.v[l].begin(), b.v[l].end());
  }
  s.tokens.insert(s.tokens.end(), b.tokens.begin(), b.tokens.end());
  v1::Profile profile = SmallShadowProfile();
  profile.set_rank(32);
  profile.set_sparse_budget(256);
  auto doc = hx.Open(s, profile, 512, /*durable=*/true);
  auto turn = hx.Open(s, profile, 712, /*durable=*/true);
  ASSERT_EQ(turn.reused, 512u);
  ASSERT_TRUE(turn.ingest.refactorization_scheduled());

  gate->refuse_records = true;
  EXPECT_EQ(hx.engine->RunMaintenance(), 1);  // refactorized; its record write refused
  gate->refuse_records = false;
  EXPECT_GE(gate->refused.load(), 1);
  auto ap = hx.engine->AppendTokens(hx.tenant, AppendOf(turn.session, s, 712, 720));
  ASSERT_TRUE(ap.ok()) << ap.status();
  EXPECT_EQ(ap->tokens(), 720u);

  hx.Restart();  // no drain: what a crash leaves
  ASSIGN_OK(info, Info(hx, turn.session));
  EXPECT_EQ(info.tokens(), 720u) << "an acknowledged append was lost";
  ASSIGN_OK(out, hx.Attend(hx.AttachTo(turn.session), 1, hx.Query(4)));
  EXPECT_FALSE(out.empty());
}

// An I/O error while the restore reads durable records refuses the start instead of
// leaving the session out (and dropping its logged appends); the next start restores all.
TEST(EngineStorageFaults, ReadErrorsAtRestoreRefuseTheStartAndDropNothing) {
  TempDir dir;
  GateTier* gate = nullptr;
  const SpillSetup setup = GatedSetup(&gate);
  Harness hx(dir.path(), setup);
  const Stream a = StreamOf(hx, 528, 41);
  auto oa = hx.Open(a, SmallShadowProfile(), 512, /*durable=*/true);
  ASSERT_FALSE(oa.attachment.empty());
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(oa.session, a, 512, 520)).ok());

  // Starts whose factor reads fail, then a start whose reads work: it has everything.
  auto refused_then_restored = [&](const char* which, uint64_t tokens) {
    hx.engine.reset();
    gate->fail_factor_reads = true;
    gate->fail_reads_of = which;
    EngineOptions o;
    o.background_thread = false;
    o.spill_tier = hx.front.get();
    auto refused = Engine::Create(hx.backend.get(), &hx.config, &hx.metrics, o);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable)
        << "reads of '" << which << "' failing: " << refused.status();
    refused = absl::UnknownError("gone");  // the engine goes before the next one starts
    gate->fail_factor_reads = false;
    hx.Restart();
    auto info = Info(hx, oa.session);
    ASSERT_TRUE(info.ok()) << "after reads of '" << which << "' failed: " << info.status();
    EXPECT_EQ(info->state(), "ready");
    EXPECT_EQ(info->tokens(), tokens) << "after reads of '" << which << "' failed";
  };
  refused_then_restored("", 520);          // every record
  refused_then_restored("KVSHAPP1", 520);  // the logged append alone
  // A drain folds the appends into the session record, with its exact tail.
  ASSERT_TRUE(hx.engine->AppendTokens(hx.tenant, AppendOf(oa.session, a, 520, 528)).ok());
  ASSERT_TRUE(hx.engine->Drain().ok());
  refused_then_restored("KVSHSES1", 528);  // the session record's tail alone
}

}  // namespace
}  // namespace storage_faults_test
}  // namespace kvshade::service::testing

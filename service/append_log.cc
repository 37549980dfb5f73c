// Logged appends: AppendTokens of a durable session under append_fsync everysec or always.
//
// A durable session's record (durable.cc) is written at every commit, fork and drain; the
// tokens appended in between live in memory only unless the session logs them. Each
// logged append is one durable, value-less spill-tier record "KVSHAPP1" written before
// the append is applied (and so before it is acknowledged):
//   user_metadata (durable_codec.h, little-endian): magic, session id, tenant, the version
//            of the session record it follows, its sequence number, the token ids;
//   factors:  per layer, kOther: the pre-RoPE keys then the values, [n, h, d] bf16 each.
// always syncs the write-ahead log before it returns (WriteSync::kSynced); everysec only
// writes it (WriteSync::kLogged: in the kernel, so it survives a crash of the daemon) and a
// thread syncs the log once a second. The next session record folds the appends in, and
// they are deleted then (one batch). At start the records of each restored session whose
// version matches its record are applied in sequence order through the same code as
// AppendTokens (ApplyAppend), so the session is exactly what the acknowledged appends
// built; records of an older version (folded in already) or of no session are deleted.
#include <algorithm>
#include <chrono>
#include <map>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "durable_codec.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {
namespace {

using kernels::bf16;
using storage::FactorKind;

using durable::kAppendMagic;

struct AppendRecord {
  storage::SegmentMeta meta;
  std::string session, tenant;
  uint64_t base_version = 0, seq = 0;
  std::vector<int32_t> tokens;
};

bool ParseAppend(const storage::SegmentMeta& meta, AppendRecord* r) {
  durable::Reader rd(meta.user_metadata);
  if (!rd.Magic(kAppendMagic)) return false;
  rd.Str(&r->session);
  rd.Str(&r->tenant);
  rd.Get(&r->base_version);
  rd.Get(&r->seq);
  rd.Vec(&r->tokens);
  r->meta = meta;
  return rd.ok() && !r->tokens.empty();
}

}  // namespace

v1::AppendFsync EngineImpl::ResolveAppendFsync(bool durable, v1::AppendFsync asked) const {
  if (!durable) return v1::APPEND_FSYNC_NO;
  if (asked != v1::APPEND_FSYNC_UNSPECIFIED) return asked;
  if (config_->append_fsync == "always") return v1::APPEND_FSYNC_ALWAYS;
  if (config_->append_fsync == "everysec") return v1::APPEND_FSYNC_EVERYSEC;
  return v1::APPEND_FSYNC_NO;
}

absl::Status EngineImpl::LogAppend(Session& s, absl::Span<const int32_t> ids,
                                   const std::vector<std::vector<bf16>>& ks,
                                   const std::vector<std::vector<bf16>>& vs) {
  StageTimer timer(metrics_, "spill");
  durable::Writer w;
  w.out().append(kAppendMagic);
  w.Str(s.id);
  w.Str(s.tenant);
  w.Put<uint64_t>(s.durable_record_version);
  w.Put<uint64_t>(s.append_seq);
  w.Vec(std::vector<int32_t>(ids.begin(), ids.end()));
  storage::SegmentWrite rec;
  rec.id = *storage::Id128::FromHex(SessionManager::NewId());
  rec.layout = *storage::SegmentValueLayout::Make(s.model.layers, 1, 0, 1, 1, kernels::ValueCodecSpec{});
  rec.durability = storage::Durability::kDurable;
  rec.sync = s.append_fsync == v1::APPEND_FSYNC_ALWAYS ? storage::WriteSync::kSynced
                                                       : storage::WriteSync::kLogged;
  rec.user_metadata = w.out();
  std::vector<std::vector<std::byte>> blobs(s.model.layers);
  for (int l = 0; l < s.model.layers; ++l) {
    std::vector<std::byte>& b = blobs[l];
    b.resize(Bf16Bytes(ks[l].size() + vs[l].size()));
    std::memcpy(b.data(), ks[l].data(), Bf16Bytes(ks[l].size()));
    std::memcpy(b.data() + Bf16Bytes(ks[l].size()), vs[l].data(), Bf16Bytes(vs[l].size()));
    rec.factors.push_back({l, FactorKind::kOther, b});
  }
  if (absl::Status st = spill_->WriteSegment(rec); !st.ok()) {
    return absl::Status(st.code(), absl::StrCat("AppendTokens: session '", s.id,
                                                "' logs its appends (append_fsync) and the log "
                                                "write failed; nothing was appended: ",
                                                st.message()));
  }
  ++s.append_seq;
  s.append_records.push_back(rec.id);
  if (rec.sync == storage::WriteSync::kLogged) {
    wal_dirty_.store(true);
  }
  return absl::OkStatus();
}

void EngineImpl::DropLastAppendRecord(Session& s) {
  if (s.append_records.empty()) return;
  const storage::Id128 id = s.append_records.back();
  s.append_records.pop_back();
  if (absl::Status st = spill_->DeleteSegment(id); !st.ok()) {
    spdlog::error("session {}: an append failed after it was logged and its log record could "
                  "not be deleted ({}); a restart would apply it",
                  s.id, std::string(st.message()));
  }
}

void EngineImpl::DropAppendRecords(const Session& s, std::vector<storage::Id128>* records) {
  if (records->empty() || !spill_) return;
  if (absl::Status st = spill_->DeleteSegments(*records); !st.ok()) {
    // Harmless: they name an older session record and are deleted at the next start.
    spdlog::warn("session {}: {} folded append records not deleted yet: {}", s.id,
                 records->size(), std::string(st.message()));
  }
  records->clear();
}

void EngineImpl::WalSyncLoop() {
  std::unique_lock<std::mutex> lock(wal_mu_);
  while (!wal_stop_) {
    wal_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return wal_stop_; });
    if (!wal_dirty_.exchange(false)) continue;
    lock.unlock();
    if (absl::Status st = spill_->SyncWal(); !st.ok()) {
      wal_dirty_.store(true);  // tried again in a second
      spdlog::warn("append_fsync everysec: syncing the spill tier's log failed: {}",
                   std::string(st.message()));
    }
    lock.lock();
  }
}

void EngineImpl::StopWalSync() {
  {
    std::lock_guard<std::mutex> lock(wal_mu_);
    wal_stop_ = true;
  }
  wal_cv_.notify_all();
  if (wal_sync_thread_.joinable()) wal_sync_thread_.join();
  if (spill_ && wal_dirty_.exchange(false)) spill_->SyncWal().IgnoreError();
}

absl::Status EngineImpl::ReplayAppendLog() {
  KVSHADE_ASSIGN_OR_RETURN(std::vector<storage::SegmentMeta> metas, spill_->ListSegments());
  std::map<std::pair<std::string, std::string>, std::vector<AppendRecord>> by_session;
  for (const storage::SegmentMeta& m : metas) {
    if (m.user_metadata.rfind(kAppendMagic, 0) != 0) continue;
    AppendRecord r;
    if (!ParseAppend(m, &r)) {
      spdlog::error("restart: a damaged append record {} was dropped", m.id.ToHex());
      spill_->DeleteSegment(m.id).IgnoreError();
      continue;
    }
    by_session[{r.tenant, r.session}].push_back(std::move(r));
  }
  const int64_t t0 = sessions_.Now();
  uint64_t applied = 0;
  for (auto& [key, recs] : by_session) {
    std::vector<storage::Id128> drop;
    auto found = sessions_.FindSession(key.first, key.second);
    if (!found.ok() && spill_->Damage().AnyMetaUnreadable()) {
      // Its session record may be the one in an unreadable range: kept for inspection.
      spdlog::error("restart: {} logged appends of session {} (tenant '{}') are kept but not "
                    "applied: the session was not restored, and its record may lie in a damaged "
                    "table block", recs.size(), key.second, key.first);
      continue;
    }
    if (!found.ok()) {
      for (const AppendRecord& r : recs) drop.push_back(r.meta.id);
      spdlog::warn("restart: {} logged appends of session {} (tenant '{}') dropped: the session "
                   "was not restored",
                   recs.size(), key.second, key.first);
      spill_->DeleteSegments(drop).IgnoreError();
      continue;
    }
    Session& s = **found;
    std::sort(recs.begin(), recs.end(),
              [](const AppendRecord& a, const AppendRecord& b) { return a.seq < b.seq; });
    if (s.damaged.load()) {
      // Not applied to a damaged session (its records could not all be read); kept with
      // it, for inspection, until it is closed.
      std::unique_lock lock(s.mu);
      for (const AppendRecord& r : recs) s.append_records.push_back(r.meta.id);
      continue;
    }
    std::unique_lock lock(s.mu);
    const ModelInfo& m = s.model;
    const size_t tok = size_t(m.shape.h) * m.shape.d;
    bool failed = false;
    size_t folded = 0;
    uint64_t unapplied_tokens = 0;  // acknowledged appends not applied (a damaged record)
    std::string failure;
    for (const AppendRecord& r : recs) {
      if (r.base_version != s.durable_record_version) {
        drop.push_back(r.meta.id);  // folded into the session record already
        ++folded;
        continue;
      }
      if (failed) {
        // Kept, not applied: the session is damaged from the failed append on.
        s.append_records.push_back(r.meta.id);
        unapplied_tokens += r.tokens.size();
        continue;
      }
      const size_t n = r.tokens.size();
      std::vector<std::vector<bf16>> ks(m.layers), vs(m.layers);
      absl::Status st = ValidateTokens(r.tokens, s.tokens, config_->limits, "token_ids");
      for (int l = 0; l < m.layers && st.ok(); ++l) {
        const storage::SegmentMeta::Factor* f = r.meta.FindFactor(l, FactorKind::kOther);
        if (f == nullptr || f->bytes != Bf16Bytes(2 * n * tok)) {
          st = absl::DataLossError(absl::StrCat("layer ", l, " of the record is missing or mis-sized"));
          break;
        }
        std::vector<std::byte> buf(f->bytes);
        st = spill_->ReadFactor(r.meta.id, l, FactorKind::kOther, absl::MakeSpan(buf));
        if (!st.ok() && !absl::IsDataLoss(st)) {
          // An I/O error, not a damaged record: refuse the start rather than drop the
          // acknowledged append (the next start reads it again).
          return absl::Status(st.code(), absl::StrCat("restart: reading logged append ", r.seq,
                                                      " of session ", s.id, " failed, the start "
                                                      "is refused so that it is not dropped: ",
                                                      st.message()));
        }
        if (!st.ok()) break;
        ks[l].resize(n * tok);
        vs[l].resize(n * tok);
        std::memcpy(ks[l].data(), buf.data(), Bf16Bytes(n * tok));
        std::memcpy(vs[l].data(), buf.data() + Bf16Bytes(n * tok), Bf16Bytes(n * tok));
      }
      if (st.ok()) st = ApplyAppend(s, r.tokens, ks, vs);
      if (!st.ok()) {
        spdlog::error("restart: session {} (tenant '{}'): logged append {} could not be applied "
                      "({}); the session is restored up to the append before it, and damaged",
                      s.id, s.tenant, r.seq, std::string(st.message()));
        failed = true;
        failure = absl::StrCat("its logged append ", r.seq, " could not be applied (", st.message(),
                               ")");
        s.append_records.push_back(r.meta.id);
        unapplied_tokens += r.tokens.size();
        continue;
      }
      ++applied;
      s.append_records.push_back(r.meta.id);
      s.append_seq = r.seq + 1;
    }
    lock.unlock();
    if (failed) {
      MarkDamaged(s, "record", absl::StrCat(failure, "; it and the appends after it are not applied"),
                  unapplied_tokens, /*persist=*/false);
      ++damaged_at_start_;
    }
    if (folded > 0) {
      spdlog::info("restart: session {}: {} logged appends of an earlier session record (version "
                   "!= {}) dropped as folded in", s.id, folded, s.durable_record_version);
    }
    if (!drop.empty()) spill_->DeleteSegments(drop).IgnoreError();
  }
  if (applied > 0) {
    spdlog::info("restart: {} logged appends applied in {} ms", applied, sessions_.Now() - t0);
  }
  return absl::OkStatus();
}

}  // namespace kvshade::service

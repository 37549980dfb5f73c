// Damaged sessions (docs/OPERATIONS.md "Damage").
//
// A session is damaged once it is known to have lost acknowledged data, or to hold
// records that fail their checksums or cannot be read. It is never shown as healthy:
// GetSession and ListSessions report it (state "damaged", what was lost, the tokens lost
// where known), and every read of it (attach, select, attend, static set, export, append,
// fork) fails DATA_LOSS naming it; CloseSession removes it (with its records). Every other
// session is served. Where the damage is found:
//   - at start, a record the restore cannot read or check (RestoreRecords: the session is
//     restored as an empty shell, its readable segments kept, cause "record");
//   - at start, a damaged write-ahead log: the spill tier scanned the log before RocksDB's
//     point-in-time recovery dropped the writes after the damage (SpillDamage), and a
//     logged append among them whose session's replay stopped before it is an acknowledged
//     append lost (cause "wal"); when a dropped write could not be read at all, every
//     session that logs its appends may have lost one and is marked too;
//   - while serving, values paged in from the spill tier that fail their checksum (cause
//     "read").
// Damage that a restart would not find again (the WAL is recovered and deleted; a value
// read) is kept in a durable marker record "KVSHDMG1" (user_metadata, little-endian:
// magic, tenant, session id, tokens lost u64, the description), read at every start and
// deleted with the session.
#include <map>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "durable_codec.h"
#include "engine_impl.h"
#include "kvshade/base/status_macros.h"

namespace kvshade::service {
namespace {

using durable::kAppendMagic;
using durable::kDamageMagic;
using durable::kSessionMagic;

// The leading fields of a logged append record (append_log.cc).
struct AppendHead {
  std::string session, tenant;
  uint64_t base_version = 0, seq = 0;
  size_t tokens = 0;
};
bool ParseAppendHead(const std::string& md, AppendHead* a) {
  durable::Reader rd(md);
  if (!rd.Magic(kAppendMagic)) return false;
  std::vector<int32_t> tokens;
  rd.Str(&a->session);
  rd.Str(&a->tenant);
  rd.Get(&a->base_version);
  rd.Get(&a->seq);
  rd.Vec(&tokens);
  a->tokens = tokens.size();
  return rd.ok();
}

// The leading fields of a session record (durable.cc).
struct SessionHead {
  std::string id, tenant;
  uint64_t version = 0, tokens = 0;
};
bool ParseSessionHead(const std::string& md, SessionHead* h) {
  durable::Reader rd(md);
  if (!rd.Magic(kSessionMagic)) return false;
  std::string spec, prof, label;
  std::vector<int32_t> prompt;
  uint64_t reused = 0;
  rd.Str(&h->id);
  rd.Str(&h->tenant);
  rd.Get(&h->version);
  rd.Str(&spec);
  rd.Str(&prof);
  rd.Str(&label);
  rd.Vec(&prompt);
  rd.Get(&reused);
  rd.Get(&h->tokens);
  return rd.ok();
}

struct Marker {
  storage::Id128 record;
  std::string tenant, session, what;
  uint64_t tokens_lost = 0;
};
bool ParseMarker(const storage::SegmentMeta& m, Marker* k) {
  durable::Reader rd(m.user_metadata);
  if (!rd.Magic(kDamageMagic)) return false;
  rd.Str(&k->tenant);
  rd.Str(&k->session);
  rd.Get(&k->tokens_lost);
  rd.Str(&k->what);
  k->record = m.id;
  return rd.ok();
}

}  // namespace

absl::Status EngineImpl::CheckNotDamaged(const Session& s, std::string_view call) {
  if (!s.damaged.load()) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(s.damage_mu);
  return absl::DataLossError(absl::StrCat(
      std::string(call), ": session '", s.id, "' is damaged and not served: ", s.damage,
      s.tokens_lost > 0 ? absl::StrCat(" (", s.tokens_lost, " acknowledged tokens lost)") : "",
      "; GetSession reports it, CloseSession removes it"));
}

void EngineImpl::MarkDamaged(const Session& s, std::string_view cause, const std::string& what,
                             uint64_t tokens_lost, bool persist) {
  std::string text;
  uint64_t lost = 0;
  std::optional<storage::Id128> old_record;
  {
    std::lock_guard<std::mutex> lock(s.damage_mu);
    if (s.damaged.load() && s.damage.find(what) != std::string::npos) return;  // known
    s.damage = s.damage.empty() ? what : absl::StrCat(s.damage, "; ", what);
    s.tokens_lost += tokens_lost;
    s.damaged.store(true);
    text = s.damage;
    lost = s.tokens_lost;
    old_record = s.damage_record;
  }
  if (!cause.empty()) {
    metrics_->SessionDamaged(cause);
    spdlog::error("session {} (tenant '{}') is damaged ({}): {}{}; it is not served until it is "
                  "closed, every other session is", s.id, s.tenant, std::string(cause), what,
                  tokens_lost > 0 ? absl::StrCat(" (", tokens_lost, " acknowledged tokens lost)") : "");
  }
  if (!persist || !s.durable || !spill_) return;
  durable::Writer w;
  w.out().append(kDamageMagic);
  w.Str(s.tenant);
  w.Str(s.id);
  w.Put<uint64_t>(lost);
  w.Str(text);
  storage::SegmentWrite rec;
  rec.id = *storage::Id128::FromHex(SessionManager::NewId());
  rec.layout = *storage::SegmentValueLayout::Make(1, 1, 0, 1, 1, kernels::ValueCodecSpec{});
  rec.durability = storage::Durability::kDurable;
  rec.user_metadata = w.out();
  if (absl::Status st = spill_->WriteSegment(rec); !st.ok()) {
    spdlog::error("session {}: its damage could not be recorded on the spill tier ({}); a "
                  "restart may not report it", s.id, std::string(st.message()));
    return;
  }
  {
    std::lock_guard<std::mutex> lock(s.damage_mu);
    s.damage_record = rec.id;
  }
  if (old_record) spill_->DeleteSegment(*old_record).IgnoreError();
}

absl::Status EngineImpl::NoteReadFailure(const Session& s, const absl::Status& st) {
  if (absl::IsDataLoss(st)) {
    MarkDamaged(s, "read", absl::StrCat("stored values failed their checksum where they were read (",
                                        st.message(), ")"),
                0, /*persist=*/true);
  }
  return st;
}

absl::Status EngineImpl::ApplyStartDamage() {
  if (!spill_) return absl::OkStatus();
  const storage::SpillDamage damage = spill_->Damage();
  // Markers of earlier starts.
  KVSHADE_ASSIGN_OR_RETURN(std::vector<storage::SegmentMeta> metas, spill_->ListSegments());
  std::vector<storage::Id128> stale;
  for (const storage::SegmentMeta& m : metas) {
    Marker k;
    if (m.user_metadata.rfind(kDamageMagic, 0) != 0) continue;
    if (!ParseMarker(m, &k)) {
      stale.push_back(m.id);
      continue;
    }
    auto found = sessions_.FindSession(k.tenant, k.session);
    if (!found.ok()) {
      // Its session is gone (closed), unless its record may lie in an unreadable range.
      if (!damage.AnyMetaUnreadable()) stale.push_back(m.id);
      continue;
    }
    Session& s = **found;
    {
      std::lock_guard<std::mutex> lock(s.damage_mu);
      if (s.damage_record) stale.push_back(*s.damage_record);  // an older marker
      s.damage_record = k.record;
    }
    MarkDamaged(s, "", k.what, k.tokens_lost, /*persist=*/false);
    spdlog::warn("session {} (tenant '{}') is damaged (found at an earlier start): {}", s.id,
                 s.tenant, k.what);
  }
  if (!stale.empty()) spill_->DeleteSegments(stale).IgnoreError();

  uint64_t damaged = damaged_at_start_;
  if (damage.wal_damaged) {
    // The writes point-in-time recovery dropped, where their records could be read.
    struct Loss {
      uint64_t appends = 0, tokens = 0;
      bool commit = false;
    };
    std::map<Session*, Loss> losses;
    std::map<Session*, std::shared_ptr<Session>> keep;
    for (const storage::SegmentMeta& m : damage.wal_dropped) {
      AppendHead a;
      SessionHead h;
      if (ParseAppendHead(m.user_metadata, &a)) {
        auto found = sessions_.FindSession(a.tenant, a.session);
        if (!found.ok()) continue;  // closed after it (the close was flushed: no loss)
        Session& s = **found;
        std::shared_lock lock(s.mu);
        // Not applied by the replay: dropped. (An append of an older session record was
        // folded into the newer one before the damage; one of a newer record than the
        // restored one lost that record too.)
        if ((a.base_version == s.durable_record_version && a.seq >= s.append_seq) ||
            a.base_version > s.durable_record_version) {
          losses[&s].appends += 1;
          losses[&s].tokens += a.tokens;
          keep[&s] = *found;
        }
      } else if (ParseSessionHead(m.user_metadata, &h)) {
        auto found = sessions_.FindSession(h.tenant, h.id);
        if (!found.ok()) {
          spdlog::error("restart: the damaged write-ahead log dropped the first record of session "
                        "{} (tenant '{}', {} tokens); it was acknowledged only if its flush "
                        "failed (unflushed_durable_writes), and it is not restored",
                        h.id, h.tenant, h.tokens);
          continue;
        }
        Session& s = **found;
        std::shared_lock lock(s.mu);
        if (h.version > s.durable_record_version) {
          losses[&s].commit = true;
          losses[&s].tokens += h.tokens > s.tokens ? h.tokens - s.tokens : 0;
          keep[&s] = *found;
        }
      }
    }
    for (auto& [sp, loss] : losses) {
      std::string what = absl::StrCat(
          "the damaged write-ahead log dropped ",
          loss.appends > 0 ? absl::StrCat(loss.appends, " logged append(s) (", loss.tokens,
                                          " tokens; the last may have been in flight, not yet "
                                          "acknowledged, at the crash)")
                           : std::string(),
          loss.appends > 0 && loss.commit ? " and " : "",
          loss.commit ? "its last session record" : "", " (", damage.wal_report, ")");
      MarkDamaged(*sp, "wal", what, loss.tokens, /*persist=*/true);
      ++damaged;
    }
    if (damage.wal_unidentified > 0) {
      // Unreadable dropped writes: any session that logs its appends may have lost one.
      for (const std::shared_ptr<Session>& s : sessions_.AllSessions()) {
        if (!s->durable || s->append_fsync == v1::APPEND_FSYNC_NO || losses.count(s.get()) > 0) {
          continue;
        }
        MarkDamaged(*s, "wal",
                    absl::StrCat("may have lost logged appends: the damaged write-ahead log "
                                 "dropped ", damage.wal_unidentified, " write(s) that could not "
                                 "be read, and this session logs its appends (", damage.wal_report,
                                 ")"),
                    0, /*persist=*/true);
        ++damaged;
      }
    }
  }
  if (damage.AnyMetaUnreadable()) {
    // Logged appends are metadata records too: any of them may have been in the range.
    for (const std::shared_ptr<Session>& s : sessions_.AllSessions()) {
      if (!s->durable || s->append_fsync == v1::APPEND_FSYNC_NO || s->damaged.load()) continue;
      MarkDamaged(*s, "record",
                  "may have lost logged appends: a range of the spill tier's metadata that holds "
                  "records of unknown sessions cannot be read, and this session logs its appends",
                  0, /*persist=*/false);
      ++damaged;
    }
  }
  if (damaged > 0 && config_->spill_on_damage == "refuse") {
    store_link_->keep = true;  // the segments built so far keep their stored values
    return absl::DataLossError(absl::StrCat(
        "restore: ", damaged, " durable session(s) are damaged (the log names each); the start is "
        "refused (spill_on_damage: refuse). Restore the spill directory from a backup, or start "
        "with spill_on_damage serve_rest: the damaged sessions are then reported (GetSession) "
        "and every other session is served"));
  }
  if (damage.any() || damaged > 0) {
    spdlog::error("restart: {} session(s) damaged at this start; every other session is served",
                  damaged);
  }
  return absl::OkStatus();
}

}  // namespace kvshade::service

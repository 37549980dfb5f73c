// Integration: damaged spill files (docs/OPERATIONS.md "Damage"). Four durable sessions with
// appends acknowledged under append_fsync always, kill -9, then one flipped byte at a
// seeded random offset of one file of each kind of the spill directory (WAL *.log, table
// *.sst, MANIFEST, OPTIONS), restart. Whatever the byte hit: the daemon never aborts (it
// starts, or exits with an error naming the damage); it never serves a wrong byte (every
// session that answers answers bit for bit as before the kill); every session it does not
// serve is reported damaged by GetSession (DATA_LOSS on its reads), or, when the byte hit
// a table block holding session records, the restart reports that range as unreadable;
// and an undamaged session is never missing or short of acknowledged tokens.
//
// KVSHADE_DAMAGE_SEEDS (default 3) seeds per file kind; KVSHADE_DAMAGE_SEED the first.
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "gtest/gtest.h"
#include "harness.h"

namespace kvshade::integration {
namespace spill_damage_test {
namespace {

namespace fs = std::filesystem;

struct Snapshot {
  std::vector<int32_t> chunks;
  std::string keys, values;
};

// Attach, one select, detach: the delta's bytes, or the first error.
absl::StatusOr<Snapshot> Read(client::Client& c, const synthetic::Document& doc, const std::string& sid,
                              int64_t pos) {
  v1::AttachRequest ar;
  ar.set_session_id(sid);
  ar.set_worker_id("damage");
  auto a = c.Attach(ar);
  if (!a.ok()) return a.status();
  auto r = c.SelectAndReconstruct(MakeSelect(doc, 1, {a->attachment_id()}, 0, 2, pos));
  c.Detach(a->attachment_id()).IgnoreError();
  if (!r.ok()) return r.status();
  if (r->deltas_size() != 1) return absl::InternalError("no delta");
  const auto& d = r->deltas(0);
  return Snapshot{std::vector<int32_t>(d.chunk().begin(), d.chunk().end()), d.keys().data(),
                  d.values().data()};
}

uint64_t EnvOr(const char* name, uint64_t dflt) {
  const char* v = std::getenv(name);
  uint64_t n = 0;
  return v != nullptr && absl::SimpleAtoi(v, &n) ? n : dflt;
}

void CopyDir(const fs::path& from, const fs::path& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

std::vector<fs::path> FilesOfKind(const fs::path& dir, const std::string& kind) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (!e.is_regular_file() || fs::file_size(e.path()) == 0) continue;
    const std::string name = e.path().filename().string();
    const bool match = kind == "log"   ? e.path().extension() == ".log"
                       : kind == "sst" ? e.path().extension() == ".sst"
                                       : absl::StartsWith(name, kind + "-");
    if (match) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(SpillDamage, AFlippedByteInAnyFileKindNeverServesWrongBytesOrHidesADamagedSession) {
  TempDir dir;
  const fs::path pristine = fs::path(dir.path()) / "pristine";
  const std::vector<std::string> base_args = {"--append-fsync", "always"};
  std::vector<std::unique_ptr<synthetic::Document>> docs;
  std::vector<std::string> ids;
  std::vector<Snapshot> before;
  constexpr int64_t kPrompt = 512, kEnd = 536;
  {
    ServerProcess server;
    std::vector<std::string> args = base_args;
    args.insert(args.end(), {"--spill-path", pristine.string()});
    KV_ASSERT_OK(server.Start(args));
    auto c = server.Connect();
    for (int i = 0; i < 4; ++i) {
      docs.push_back(std::make_unique<synthetic::Document>(SmallDoc(kPrompt, 40 + i)));
      KV_ASSERT_OK_AND_ASSIGN(s, CreateAndIngest(*c, *docs.back(), ShadowProfile(), -1, /*durable=*/true));
      ids.push_back(s.session_id());
    }
    // Acknowledged appends (synced, in the WAL only), interleaved over the sessions.
    for (int64_t at = kPrompt; at < kEnd; at += 8) {
      for (int i = 0; i < 4; ++i) {
        KV_ASSERT_OK(c->AppendTokens(synthetic::MakeAppend(*docs[i], ids[i], 0, at, at + 8)).status());
      }
    }
    for (int i = 0; i < 4; ++i) {
      KV_ASSERT_OK_AND_ASSIGN(snap, Read(*c, *docs[i], ids[i], kEnd));
      ASSERT_FALSE(snap.chunks.empty());
      before.push_back(snap);
    }
    server.Kill9();
  }

  const uint64_t seeds = EnvOr("KVSHADE_DAMAGE_SEEDS", 3), first = EnvOr("KVSHADE_DAMAGE_SEED", 1);
  int started = 0, refused = 0, damaged_seen = 0, unreadable_seen = 0;
  for (const std::string kind : {"log", "sst", "MANIFEST", "OPTIONS"}) {
    for (uint64_t seed = first; seed < first + seeds; ++seed) {
      const fs::path work = fs::path(dir.path()) / "work";
      CopyDir(pristine, work);
      std::mt19937_64 rng(seed * 1000003 + std::hash<std::string>()(kind));
      const std::vector<fs::path> files = FilesOfKind(work, kind);
      ASSERT_FALSE(files.empty()) << "no " << kind << " file in the spill directory";
      const fs::path file = files[rng() % files.size()];
      const uint64_t size = fs::file_size(file), offset = rng() % size;
      const int bit = int(rng() % 8);
      {
        std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
        char b = 0;
        f.seekg(std::streamoff(offset));
        f.get(b);
        f.seekp(std::streamoff(offset));
        f.put(char(b ^ (1 << bit)));
      }
      const std::string what = absl::StrCat(kind, " seed ", seed, ": bit ", bit, " of byte ", offset,
                                            " of ", size, " in ", file.filename().string());
      SCOPED_TRACE(what);
      if (const char* keep = std::getenv("KVSHADE_DAMAGE_KEEP_DIR"); keep != nullptr && *keep != '\0') {
        CopyDir(work, fs::path(keep) / absl::StrCat(kind, "-", seed));  // to replay by hand
      }
      ServerProcess server;
      std::vector<std::string> args = base_args;
      args.insert(args.end(), {"--spill-path", work.string()});
      absl::Status st = server.Start(args);
      if (!st.ok()) {
        // Refused: a clean exit with an error, never a crash or a hang.
        ASSERT_TRUE(absl::IsUnavailable(st)) << st;
        const std::string msg(st.message());
        const size_t at = msg.find("(status ");
        ASSERT_NE(at, std::string::npos) << msg;
        const int status = std::atoi(msg.c_str() + at + 8);
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << "not a clean exit: " << msg;
        EXPECT_TRUE(absl::StrContains(msg, "spill tier")) << msg;
        ++refused;
        continue;
      }
      ++started;
      auto c = server.Connect();
      const std::string log_before = server.log();
      const bool unreadable_meta = absl::StrContains(log_before, "column family 'metadata' cannot be read");
      unreadable_seen += unreadable_meta;
      for (int i = 0; i < 4; ++i) {
        SCOPED_TRACE(absl::StrCat("session ", i, " ", ids[i]));
        auto info = c->GetSession(ids[i]);
        if (!info.ok()) {
          EXPECT_EQ(info.status().code(), absl::StatusCode::kNotFound) << info.status();
          // Only a session whose record lay in an unreadable table range may be missing.
          EXPECT_TRUE(unreadable_meta) << "session missing without a reported damage\n" << log_before;
          continue;
        }
        if (info->damaged()) {
          ++damaged_seen;
          EXPECT_EQ(info->state(), "damaged");
          EXPECT_FALSE(info->damage().empty());
          auto r = Read(*c, *docs[i], ids[i], kEnd);
          EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
          continue;
        }
        EXPECT_EQ(info->state(), "ready");
        EXPECT_EQ(info->tokens(), uint64_t(kEnd)) << "acknowledged tokens lost, session shown healthy\n"
                                                   << log_before;
        auto r = Read(*c, *docs[i], ids[i], kEnd);
        if (!r.ok()) {
          // Values that fail their checksum where they are read: reported from then on.
          EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
          auto after = c->GetSession(ids[i]);
          ASSERT_TRUE(after.ok()) << after.status();
          EXPECT_TRUE(after->damaged()) << "a read failed DATA_LOSS, the session is shown healthy";
          ++damaged_seen;
          continue;
        }
        EXPECT_EQ(r->chunks, before[i].chunks);
        EXPECT_EQ(r->keys, before[i].keys);
        EXPECT_EQ(r->values, before[i].values);
      }
      const int code = server.Stop();
      EXPECT_TRUE(code == 0 || code == 1) << "stop: " << code << "\n" << server.log();
    }
  }
  std::printf("spill damage: %d starts, %d refused, %d damaged sessions reported, %d unreadable "
              "metadata ranges\n", started, refused, damaged_seen, unreadable_seen);
}

}  // namespace
}  // namespace spill_damage_test
}  // namespace kvshade::integration

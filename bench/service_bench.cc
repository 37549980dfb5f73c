// kvshade_service_bench: RPC round-trip latencies and ingest throughput of kvshade-server
// on loopback (a benchmark, not a test). Starts its own kvshade-server (CPU backend by
// default) on a free port unless --target is given, then measures with the C++ client:
//   - ingest throughput (tokens/s and MB/s on the wire) for documents of --tokens sizes;
//   - p50/p99 round trips of CreateSession (new prompt; and fully reused prompt),
//     LookupPrefix, SelectAndReconstruct (batch 1 and 8, steady-state decode with the
//     slot tables warm), Attend (batch 1 and 8), Stats.
// Usage: kvshade_service_bench [--server PATH] [--target HOST:PORT] [--backend cpu]
//          [--tokens 8192,16384,32768] [--reps 200] [--layers 4] [--kv-heads 2]
//          [--q-heads 8] [--head-dim 128] [--rank 64] [--budget 32]
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "kvshade/client/client.h"
#include "kvshade/version.h"
#include "loopback.h"
#include "kvshade/client/tensor.h"
#include "synthetic.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using kvshade::client::Client;
namespace v1 = kvshade::v1;
namespace synthetic = kvshade::synthetic;

struct Options {
  std::string server = KVSHADE_SERVER_PATH;
  std::string target;
  std::string backend = "cpu";
  std::vector<int64_t> tokens = {8192, 16384, 32768};
  int reps = 200;
  int layers = 4, kv_heads = 2, q_heads = 8, head_dim = 128, rank = 64, budget = 32;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Row(const char* name, const std::vector<double>& ms) {
  if (ms.empty()) return;
  std::printf("| %-38s | %9.3f | %9.3f | %6zu |\n", name, kvshade::bench::Percentile(ms, 0.5), kvshade::bench::Percentile(ms, 0.99), ms.size());
}

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "service_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"kvshade-server round trips and ingest throughput on loopback (see this file's header)"};
  app.add_option("--server", o.server, "kvshade-server binary");
  app.add_option("--target", o.target, "HOST:PORT of a running server (no child then)");
  app.add_option("--backend", o.backend);
  // The batch-8 decode rows use eight of the --reps reused sessions.
  app.add_option("--reps", o.reps, "calls per row (>= 8)")->check(CLI::Range(8, 1 << 20));
  app.add_option("--layers", o.layers);
  app.add_option("--kv-heads", o.kv_heads);
  app.add_option("--q-heads", o.q_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--rank", o.rank);
  app.add_option("--budget", o.budget);
  app.add_option("--tokens", o.tokens, "document sizes, comma-separated")->delimiter(',');
  app.set_version_flag("--version", kvshade::VersionLine("kvshade_service_bench"));
  CLI11_PARSE(app, argc, argv);

  // --- Server: our own child on a kernel-chosen port, unless --target.
  std::optional<kvshade::bench::SpawnedServer> server;
  if (o.target.empty()) {
    server = kvshade::bench::SpawnServer(o.server, {"--backend", o.backend}, "service_bench");
    if (!server) return 1;
    o.target = server->target;
  }
  kvshade::client::ClientOptions co;
  co.target = o.target;
  co.timeout = absl::Seconds(600);
  auto cl = Client::Connect(co);
  if (!cl.ok()) Die("connect", cl.status());
  Client& c = **cl;
  if (auto s = c.WaitForServing(absl::Seconds(30)); !s.ok()) Die("health", s);
  auto st0 = c.Stats();
  if (!st0.ok()) Die("Stats", st0.status());

  v1::Profile profile;
  profile.set_kind(v1::PROFILE_KIND_SHADOW);
  profile.set_rank(o.rank);
  profile.set_chunk_size(8);
  profile.set_sparse_budget(o.budget);
  profile.set_outliers(16);
  profile.set_local_window(32);
  auto spec_for = [&](int64_t n, uint64_t seed) {
    synthetic::DocSpec s;
    s.layers = o.layers;
    s.kv_heads = o.kv_heads;
    s.q_heads = o.q_heads;
    s.head_dim = o.head_dim;
    s.doc_tokens = n;
    s.question_tokens = 16;
    s.seed = seed;
    s.latent_rank = 24;
    return s;
  };
  std::printf("# kvshade service benchmark\n\n");
  if (const char* omp = std::getenv("OMP_WAIT_POLICY")) std::printf("OMP_WAIT_POLICY=%s\n", omp);
  std::printf("server %s, backend %s, version %s; model %d layers, %d KV heads (%d query heads), head dim %d; "
              "shadow rank %d, chunk 8, budget %d\n\n",
              o.target.c_str(), st0->backend().c_str(), st0->version().c_str(), o.layers, o.kv_heads, o.q_heads,
              o.head_dim, o.rank, o.budget);

  // --- Ingest throughput.
  std::printf("## Ingest (CreateSession + streamed Ingest + commit)\n\n");
  std::printf("| tokens | seconds | tokens/s | MB/s (wire) | K+V bf16 MB |\n|---:|---:|---:|---:|---:|\n");
  std::string bench_doc_id;
  std::unique_ptr<synthetic::Document> bench_doc;
  for (int64_t n : o.tokens) {
    auto doc = std::make_unique<synthetic::Document>(spec_for(n, 100 + n));
    // Generate the tensors before timing: the benchmark measures the service, not the
    // synthetic generator. Each layer is sent as soon as the stream is open.
    std::vector<std::vector<uint16_t>> k(o.layers), v(o.layers);
    for (int l = 0; l < o.layers; ++l) doc->KeysValues(l, -1, 0, n, &k[l], &v[l]);
    const auto t0 = Clock::now();
    auto created = c.CreateSession(synthetic::MakeCreate(*doc, profile, -1));
    if (!created.ok()) Die("CreateSession", created.status());
    auto w = c.StartIngest(created->session_id());
    if (!w.ok()) Die("StartIngest", w.status());
    for (int l = 0; l < o.layers; ++l) {
      if (auto s = (*w)->WriteLayer(l, n, o.kv_heads, o.head_dim, k[l], v[l]); !s.ok()) Die("WriteLayer", s);
    }
    auto r = (*w)->Commit();
    if (!r.ok()) Die("Commit", r.status());
    if (created->reused_tokens() != 0 || r->tokens() != static_cast<uint64_t>(n)) {
      std::fprintf(stderr, "service_bench: document of %lld tokens: reused %llu, committed %llu (expected a "
                   "fresh ingest of all tokens; give distinct --tokens sizes)\n",
                   static_cast<long long>(n), static_cast<unsigned long long>(created->reused_tokens()),
                   static_cast<unsigned long long>(r->tokens()));
      return 1;
    }
    const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
    const double mb = (*w)->bytes_sent() / 1e6;
    std::printf("| %lld | %.2f | %.0f | %.1f | %.1f |\n", static_cast<long long>(n), secs, n / secs, mb / secs,
                doc->DenseBytes(n) / 1e6);
    std::fflush(stdout);
    if (bench_doc_id.empty() || n == 8192) {
      bench_doc_id = created->session_id();
      bench_doc = std::move(doc);
    }
  }
  const synthetic::Document& doc = *bench_doc;
  const int64_t n = doc.spec().doc_tokens;
  std::printf("\n## Round trips (loopback, one client thread; decode RPCs on the %lld-token document)\n\n",
              static_cast<long long>(n));
  std::printf("| RPC | p50 ms | p99 ms | calls |\n|---|---:|---:|---:|\n");

  // CreateSession of a new small prompt (no reuse; ingest not timed) and of a fully
  // cached prompt (reuse), LookupPrefix of the cached document.
  std::vector<double> create_new, create_reused, lookup, stats_ms, select1, select8, attend1, attend8;
  for (int i = 0; i < std::min(o.reps, 100); ++i) {
    synthetic::Document small(spec_for(512, 5000 + i));
    auto t0 = Clock::now();
    auto cr = c.CreateSession(synthetic::MakeCreate(small, profile, -1));
    create_new.push_back(Ms(Clock::now() - t0));
    if (!cr.ok()) Die("CreateSession(new)", cr.status());
    (void)c.CloseSession(cr->session_id());
  }
  std::vector<std::string> reused_ids;
  const v1::CreateSessionRequest reuse_req = synthetic::MakeCreate(doc, profile, -1);
  for (int i = 0; i < o.reps; ++i) {
    auto t0 = Clock::now();
    auto cr = c.CreateSession(reuse_req);
    create_reused.push_back(Ms(Clock::now() - t0));
    if (!cr.ok()) Die("CreateSession(reused)", cr.status());
    if (reused_ids.size() < 8) reused_ids.push_back(cr->session_id());
    else (void)c.CloseSession(cr->session_id());
  }
  v1::LookupPrefixRequest lreq;
  *lreq.mutable_model() = doc.Model();
  *lreq.mutable_profile() = profile;
  lreq.mutable_token_ids()->Assign(doc.tokens().begin(), doc.tokens().end());
  for (int i = 0; i < o.reps; ++i) {
    auto t0 = Clock::now();
    auto r = c.LookupPrefix(lreq);
    lookup.push_back(Ms(Clock::now() - t0));
    if (!r.ok()) Die("LookupPrefix", r.status());
  }
  for (int i = 0; i < o.reps; ++i) {
    auto t0 = Clock::now();
    auto r = c.Stats();
    stats_ms.push_back(Ms(Clock::now() - t0));
    if (!r.ok()) Die("Stats", r.status());
  }
  // Eight sessions on the document (reused), one attachment each.
  std::vector<std::string> atts;
  for (const auto& sid : reused_ids) {
    v1::AttachRequest ar;
    ar.set_session_id(sid);
    auto a = c.Attach(ar);
    if (!a.ok()) Die("Attach", a.status());
    atts.push_back(a->attachment_id());
  }
  auto decode = [&](size_t batch, bool attend, std::vector<double>* out) {
    // Warm-up step per layer fills the slot tables; then steady decode steps with
    // slowly drifting queries (mostly hits, a few misses: the normal decode regime).
    const int steps = std::max(2, o.reps / o.layers);
    for (int step = 0; step <= steps; ++step) {
      for (int l = 0; l < o.layers; ++l) {
        v1::SelectAndReconstructRequest sr;
        v1::AttendRequest ar;
        sr.set_layer(l);
        ar.set_layer(l);
        for (size_t j = 0; j < batch; ++j) {
          const auto q = doc.Query(l, static_cast<int>(j), step, n);
          auto tensor = kvshade::client::MakeBf16Tensor({o.q_heads, o.head_dim}, absl::MakeConstSpan(q));
          auto* sq = sr.add_queries();
          sq->set_attachment_id(atts[j]);
          *sq->mutable_q() = tensor;
          auto* aq = ar.add_queries();
          aq->set_attachment_id(atts[j]);
          *aq->mutable_q() = std::move(tensor);
        }
        auto t0 = Clock::now();
        absl::Status s = attend ? c.Attend(ar).status() : c.SelectAndReconstruct(sr).status();
        if (step > 0) out->push_back(Ms(Clock::now() - t0));
        if (!s.ok()) Die(attend ? "Attend" : "SelectAndReconstruct", s);
      }
    }
  };
  decode(1, false, &select1);
  decode(8, false, &select8);
  decode(1, true, &attend1);
  decode(8, true, &attend8);
  Row("CreateSession (new 512-token prompt)", create_new);
  Row("CreateSession (document fully reused)", create_reused);
  Row("LookupPrefix (document cached)", lookup);
  Row("SelectAndReconstruct batch 1", select1);
  Row("SelectAndReconstruct batch 8", select8);
  Row("Attend batch 1", attend1);
  Row("Attend batch 8", attend8);
  Row("Stats", stats_ms);
  auto st = c.Stats();
  if (st.ok()) {
    std::printf("\nchunk hits %llu of %llu selected (%.1f%%) over the run\n",
                static_cast<unsigned long long>(st->chunk_hits()),
                static_cast<unsigned long long>(st->chunks_selected()),
                st->chunks_selected() ? 100.0 * st->chunk_hits() / st->chunks_selected() : 0.0);
  }
  if (server) kvshade::bench::StopServer(*server);
  return 0;
}

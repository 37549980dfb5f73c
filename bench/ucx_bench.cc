// kvshade_ucx_bench: SelectAndReconstruct round trips over the UCX data plane vs gRPC
// inline, on loopback (a benchmark, not a test). Starts its own kvshade-server with the
// data plane enabled (--transports, default tcp,self), ingests one synthetic document,
// attaches 8 workers per transport and runs the same steady-state decode (slot tables
// warm: mostly hits, a few misses) over both, interleaved call by call so that both see
// the same machine load. Prints p50/p99 in microseconds for batch 1 and 8.
// Usage: kvshade_ucx_bench [--server PATH] [--transports tcp,self] [--tokens 8192]
//          [--reps 400] [--layers 4] [--kv-heads 2] [--q-heads 8] [--head-dim 128]
//          [--rank 64] [--budget 32]
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "kvshade/client/client.h"
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
  std::string transports = "tcp,self";
  int64_t tokens = 8192;
  int reps = 400;
  int layers = 4, kv_heads = 2, q_heads = 8, head_dim = 128, rank = 64, budget = 32;
};

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "ucx_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--server") o.server = v;
    else if (k == "--transports") o.transports = v;
    else if (k == "--tokens") o.tokens = std::stoll(v);
    else if (k == "--reps") o.reps = std::stoi(v);
    else if (k == "--layers") o.layers = std::stoi(v);
    else if (k == "--kv-heads") o.kv_heads = std::stoi(v);
    else if (k == "--q-heads") o.q_heads = std::stoi(v);
    else if (k == "--head-dim") o.head_dim = std::stoi(v);
    else if (k == "--rank") o.rank = std::stoi(v);
    else if (k == "--budget") o.budget = std::stoi(v);
    else {
      std::fprintf(stderr, "ucx_bench: unknown flag %s (see the header of ucx_bench.cc)\n", k.c_str());
      return 2;
    }
  }

  // --- Server: our own child with the data plane on.
  const std::string cfg = [&] {
    char tmpl[] = "/tmp/kvshade-ucx-cfg-XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd >= 0) close(fd);
    return std::string(tmpl);
  }();
  std::ofstream(cfg) << "ucx:\n  enable: true\n  transports: \"" << o.transports << "\"\n";
  auto server = kvshade::bench::SpawnServer(o.server, {"-c", cfg, "--backend", "cpu"}, "ucx_bench");
  if (!server) return 1;
  const pid_t pid = server->pid;

  kvshade::client::ClientOptions go;
  go.target = server->target;
  go.timeout = absl::Seconds(600);
  kvshade::client::ClientOptions uo = go;
  uo.use_ucx = true;
  uo.ucx_transports = o.transports;
  auto grpc_or = Client::Connect(go);
  auto ucx_or = Client::Connect(uo);
  if (!grpc_or.ok()) Die("connect", grpc_or.status());
  if (!ucx_or.ok()) Die("connect", ucx_or.status());
  Client& g = **grpc_or;
  Client& u = **ucx_or;
  if (absl::Status s = g.WaitForServing(absl::Seconds(30)); !s.ok()) Die("health", s);

  synthetic::DocSpec spec;
  spec.layers = o.layers;
  spec.kv_heads = o.kv_heads;
  spec.q_heads = o.q_heads;
  spec.head_dim = o.head_dim;
  spec.doc_tokens = o.tokens;
  spec.question_tokens = 16;
  spec.latent_rank = 24;
  const synthetic::Document doc(spec);
  v1::Profile profile;
  profile.set_kind(v1::PROFILE_KIND_SHADOW);
  profile.set_rank(o.rank);
  profile.set_chunk_size(8);
  profile.set_sparse_budget(o.budget);
  profile.set_outliers(16);
  profile.set_local_window(32);
  auto created = g.CreateSession(synthetic::MakeCreate(doc, profile, -1));
  if (!created.ok()) Die("CreateSession", created.status());
  if (auto ing = synthetic::IngestRange(g, doc, created->session_id(), -1, 0, o.tokens); !ing.ok()) {
    Die("Ingest", ing.status());
  }
  std::vector<std::string> ga, ua;
  for (int j = 0; j < 8; ++j) {
    v1::AttachRequest ar;
    ar.set_session_id(created->session_id());
    auto a = g.Attach(ar);
    auto b = u.Attach(ar);
    if (!a.ok()) Die("Attach", a.status());
    if (!b.ok()) Die("Attach", b.status());
    ga.push_back(a->attachment_id());
    ua.push_back(b->attachment_id());
  }
  if (!u.ucx_connected()) {
    std::fprintf(stderr, "ucx_bench: the UCX client did not connect (fallbacks %llu)\n",
                 static_cast<unsigned long long>(u.ucx_fallbacks()));
    kill(pid, SIGKILL);
    return 1;
  }

  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::printf("# kvshade UCX data plane vs gRPC inline: SelectAndReconstruct round trip\n\n");
  std::printf("host %s, %u cores; transports %s; model %d layers, %d KV heads (%d query heads), head dim %d; "
              "%lld-token document, shadow rank %d, chunk 8, budget %d; %d timed calls per row\n\n",
              host, std::thread::hardware_concurrency(), o.transports.c_str(), o.layers, o.kv_heads,
              o.q_heads, o.head_dim, static_cast<long long>(o.tokens), o.rank, o.budget, o.reps);
  std::printf("| call | transport | p50 us | p99 us | calls |\n|---|---|---:|---:|---:|\n");
  for (size_t batch : {size_t{1}, size_t{8}}) {
    std::vector<double> tg, tu;
    const int steps = std::max(2, o.reps / o.layers);
    for (int step = 0; step <= steps; ++step) {
      for (int l = 0; l < o.layers; ++l) {
        v1::SelectAndReconstructRequest rg, ru;
        rg.set_layer(l);
        ru.set_layer(l);
        for (size_t j = 0; j < batch; ++j) {
          const auto q = doc.Query(l, static_cast<int>(j), step, o.tokens);
          auto t = kvshade::client::MakeBf16Tensor({o.q_heads, o.head_dim}, absl::MakeConstSpan(q));
          auto* a = rg.add_queries();
          a->set_attachment_id(ga[j]);
          *a->mutable_q() = t;
          auto* b = ru.add_queries();
          b->set_attachment_id(ua[j]);
          *b->mutable_q() = std::move(t);
        }
        auto t0 = Clock::now();
        auto r1 = g.SelectAndReconstruct(rg);
        auto t1 = Clock::now();
        auto r2 = u.SelectAndReconstruct(ru);
        auto t2 = Clock::now();
        if (!r1.ok()) Die("gRPC SelectAndReconstruct", r1.status());
        if (!r2.ok()) Die("UCX SelectAndReconstruct", r2.status());
        if (step > 0) {  // step 0 fills the slot tables
          tg.push_back(Us(t1 - t0));
          tu.push_back(Us(t2 - t1));
        }
      }
    }
    std::printf("| SelectAndReconstruct batch %zu | gRPC inline | %.1f | %.1f | %zu |\n", batch,
                kvshade::bench::Percentile(tg, 0.5), kvshade::bench::Percentile(tg, 0.99), tg.size());
    std::printf("| SelectAndReconstruct batch %zu | UCX (%s) | %.1f | %.1f | %zu |\n", batch,
                o.transports.c_str(), kvshade::bench::Percentile(tu, 0.5), kvshade::bench::Percentile(tu, 0.99), tu.size());
  }
  // Transport floor: a request the engine rejects at once (unknown attachment), so the
  // round trip is the transport plus request parsing.
  {
    v1::SelectAndReconstructRequest bad;
    bad.set_layer(0);
    const auto q = doc.Query(0, 0, 0, o.tokens);
    auto* sq = bad.add_queries();
    sq->set_attachment_id("no-such-attachment");
    *sq->mutable_q() = kvshade::client::MakeBf16Tensor({o.q_heads, o.head_dim}, absl::MakeConstSpan(q));
    std::vector<double> tg, tu;
    for (int i = 0; i < o.reps; ++i) {
      auto t0 = Clock::now();
      auto r1 = g.SelectAndReconstruct(bad);
      auto t1 = Clock::now();
      auto r2 = u.SelectAndReconstruct(bad);
      auto t2 = Clock::now();
      if (r1.ok() || r2.ok()) Die("floor", absl::InternalError("an unknown attachment was accepted"));
      tg.push_back(Us(t1 - t0));
      tu.push_back(Us(t2 - t1));
    }
    std::printf("| transport floor (NOT_FOUND reply) | gRPC inline | %.1f | %.1f | %zu |\n", kvshade::bench::Percentile(tg, 0.5),
                kvshade::bench::Percentile(tg, 0.99), tg.size());
    std::printf("| transport floor (NOT_FOUND reply) | UCX (%s) | %.1f | %.1f | %zu |\n",
                o.transports.c_str(), kvshade::bench::Percentile(tu, 0.5), kvshade::bench::Percentile(tu, 0.99), tu.size());
  }
  std::printf("\nUCX fallbacks: %llu\n", static_cast<unsigned long long>(u.ucx_fallbacks()));
  kvshade::bench::StopServer(*server);
  std::remove(cfg.c_str());
  return 0;
}

// kvshade_delivery_bench: select-and-reconstruct with CUDA IPC delivery against inline
// delivery, on one GPU (a benchmark, not a test). Starts kvshade-server on the CUDA backend,
// ingests one synthetic session, attaches --batch inline workers and --batch CUDA IPC
// workers (each with its own GPU slot buffers, as separate inference workers would), and
// times SelectAndReconstruct round trips of a whole batch with a fresh query per worker per
// step (so most selected chunks miss). Prints per batch: p50/p99 round trip of each mode,
// the K+V bytes the misses carry, the delivery rate that implies, and the floors: those
// bytes over the device's copy bandwidth (IPC) and the bytes alone (inline pays them on
// the wire and in protobuf).
// Usage: kvshade_delivery_bench [--server PATH] [--tokens 32768] [--layers 1] [--kv-heads 8]
//          [--q-heads 32] [--head-dim 128] [--rank 160] [--budget 256] [--batch 1,8,24]
//          [--reps 30] [--copy-gbps 4230]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvshade/client/client.h"
#include "kvshade/client/tensor.h"
#include "kvshade/version.h"
#include "loopback.h"
#include "synthetic.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = kvshade::v1;
namespace synthetic = kvshade::synthetic;
using kvshade::bench::Percentile;

struct Options {
  std::string server = KVSHADE_SERVER_PATH;
  int64_t tokens = 32768;
  int layers = 1, kv_heads = 8, q_heads = 32, head_dim = 128, rank = 160, budget = 256;
  std::vector<int> batches = {1, 8, 24};
  int reps = 30;
  double copy_gbps = 4230;  // H200 device-to-device, bytes read + written (measured; bench/RESULTS.md)
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

struct Worker {
  std::string attachment;
  void* gpu = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"select-and-reconstruct with CUDA IPC delivery vs inline (see this file's header)"};
  app.add_option("--server", o.server, "kvshade-server binary");
  app.add_option("--tokens", o.tokens, "session tokens");
  app.add_option("--layers", o.layers);
  app.add_option("--kv-heads", o.kv_heads);
  app.add_option("--q-heads", o.q_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--rank", o.rank);
  app.add_option("--budget", o.budget, "chunks per KV head (k)");
  app.add_option("--batch", o.batches, "batch sizes, comma-separated")->delimiter(',');
  app.add_option("--reps", o.reps);
  app.add_option("--copy-gbps", o.copy_gbps, "device copy bandwidth for the floor, GB/s");
  app.set_version_flag("--version", kvshade::VersionLine("kvshade_delivery_bench"));
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "delivery bench: no CUDA device visible\n");
    return 1;
  }
  auto server = kvshade::bench::SpawnServer(o.server, {"--backend", "cuda"}, "delivery bench");
  if (!server) return 1;
  int rc = 1;
  {
    kvshade::client::ClientOptions co;
    co.target = server->target;
    co.timeout = absl::Seconds(600);
    auto client = kvshade::client::Client::Connect(co);
    if (!client.ok() || !(*client)->WaitForServing(absl::Seconds(60)).ok()) {
      std::fprintf(stderr, "delivery bench: cannot reach the server (log %s)\n", server->log.c_str());
      kvshade::bench::StopServer(*server);
      return 1;
    }
    auto& c = **client;
    synthetic::DocSpec spec;
    spec.layers = o.layers;
    spec.kv_heads = o.kv_heads;
    spec.q_heads = o.q_heads;
    spec.head_dim = o.head_dim;
    spec.doc_tokens = o.tokens;
    synthetic::Document doc(spec);
    v1::Profile profile;
    profile.set_kind(v1::PROFILE_KIND_SHADOW);
    profile.set_rank(o.rank);
    profile.set_sparse_budget(o.budget);
    auto created = c.CreateSession(synthetic::MakeCreate(doc, profile, -1));
    if (!created.ok()) {
      std::fprintf(stderr, "CreateSession: %s\n", std::string(created.status().message()).c_str());
      return 1;
    }
    auto ing = synthetic::IngestRange(c, doc, created->session_id(), -1, 0, o.tokens);
    if (!ing.ok()) {
      std::fprintf(stderr, "Ingest: %s\n", std::string(ing.status().message()).c_str());
      return 1;
    }
    int max_batch = 0;
    for (int b : o.batches) max_batch = std::max(max_batch, b);
    std::vector<Worker> inline_w(max_batch), ipc_w(max_batch);
    uint64_t slot_bytes = 0;
    int chunk = 0;  // C, as the daemon's profile has it
    for (int j = 0; j < max_batch; ++j) {
      v1::AttachRequest ar;
      ar.set_session_id(created->session_id());
      ar.set_worker_id("inline-" + std::to_string(j));
      auto a = c.Attach(ar);
      if (!a.ok()) {
        std::fprintf(stderr, "Attach: %s\n", std::string(a.status().message()).c_str());
        return 1;
      }
      inline_w[j].attachment = a->attachment_id();
      slot_bytes = a->slot_buffer_bytes();
      chunk = static_cast<int>(a->chunk_size());
      Worker& w = ipc_w[j];
      if (cudaMalloc(&w.gpu, 2 * slot_bytes) != cudaSuccess) return 1;
      cudaIpcMemHandle_t h;
      if (cudaIpcGetMemHandle(&h, w.gpu) != cudaSuccess) return 1;
      ar.set_worker_id("ipc-" + std::to_string(j));
      ar.set_delivery(v1::DELIVERY_MODE_CUDA_IPC);
      auto* b = ar.mutable_cuda_ipc();
      b->set_k_handle(std::string(reinterpret_cast<const char*>(&h), sizeof(h)));
      b->set_v_handle(b->k_handle());
      b->set_v_offset(slot_bytes);
      b->set_bytes(slot_bytes);
      auto ai = c.Attach(ar);
      if (!ai.ok()) {
        std::fprintf(stderr, "Attach (CUDA IPC): %s\n", std::string(ai.status().message()).c_str());
        return 1;
      }
      w.attachment = ai->attachment_id();
    }
    std::printf("# delivery bench: n=%lld L=%d h=%d hq=%d d=%d r=%d k=%d C=%d, reps=%d, slot "
                "buffers %.1f MiB per worker\n",
                static_cast<long long>(o.tokens), o.layers, o.kv_heads, o.q_heads, o.head_dim,
                o.rank, o.budget, chunk, o.reps, 2.0 * slot_bytes / (1 << 20));
    std::printf("%-6s %-7s %9s %9s %8s %11s %10s %12s\n", "batch", "mode", "p50 ms", "p99 ms",
                "miss %", "MiB/call", "GB/s", "floor ms");
    int step = 0;
    for (int B : o.batches) {
      for (int mode = 0; mode < 2; ++mode) {
        const auto& ws = mode == 0 ? inline_w : ipc_w;
        std::vector<double> ms;
        double bytes_sum = 0, miss = 0, sel = 0;
        for (int rep = -3; rep < o.reps; ++rep) {  // 3 warm-up calls
          v1::SelectAndReconstructRequest req;
          req.set_layer(0);
          for (int j = 0; j < B; ++j) {
            const auto q = doc.Query(0, -1, ++step, o.tokens);
            auto* sq = req.add_queries();
            sq->set_attachment_id(ws[j].attachment);
            *sq->mutable_q() = kvshade::client::MakeBf16Tensor({o.q_heads, o.head_dim},
                                                               absl::MakeConstSpan(q));
          }
          const auto t0 = Clock::now();
          auto r = c.SelectAndReconstruct(req);
          const auto t1 = Clock::now();
          if (!r.ok()) {
            std::fprintf(stderr, "Select: %s\n", std::string(r.status().message()).c_str());
            return 1;
          }
          if (rep < 0) continue;
          ms.push_back(Ms(t1 - t0));
          for (const auto& d : r->deltas()) {
            bytes_sum += 2.0 * d.head_size() * chunk * o.head_dim * 2;  // K and V, bf16
            miss += d.head_size();
            sel += d.selected();
          }
        }
        const double p50 = Percentile(ms, 0.5), bytes = bytes_sum / o.reps;
        std::printf("%-6d %-7s %9.3f %9.3f %8.1f %11.2f %10.2f %12.4f\n", B,
                    mode == 0 ? "inline" : "ipc", p50, Percentile(ms, 0.99),
                    sel > 0 ? 100.0 * miss / sel : 0.0, bytes / (1 << 20), bytes / (p50 * 1e6),
                    2.0 * bytes / (o.copy_gbps * 1e6));
      }
    }
    for (auto& w : ipc_w) {
      c.Detach(w.attachment).IgnoreError();
      cudaFree(w.gpu);
    }
    rc = 0;
  }
  kvshade::bench::StopServer(*server);
  return rc;
}

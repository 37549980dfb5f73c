// kvshade_delivery_bench: select-and-reconstruct with CUDA IPC delivery against inline
// delivery, on one GPU (a benchmark, not a test). Starts kvshade-server on the CUDA backend,
// ingests one synthetic session, attaches --batch inline workers and --batch CUDA IPC
// workers (each with its own GPU slot buffers, as separate inference workers would), and
// times SelectAndReconstruct round trips of a whole batch with a fresh query per worker per
// step (so most selected chunks miss). Each mode runs over gRPC and, with --ucx, over the
// UCX data plane's binary frames too. Prints per batch and mode: p50/p99 round trip, the
// daemon's select + reconstruct time per call (its /metrics stage seconds) and the p50
// minus it (the data path's overhead), the K+V bytes the misses carry, the delivery rate
// that implies, and the floor: those bytes over the device's copy bandwidth (IPC; inline
// pays them on the wire as well).
// Usage: kvshade_delivery_bench [--server PATH] [--tokens 32768] [--layers 1] [--kv-heads 8]
//          [--q-heads 32] [--head-dim 128] [--rank 160] [--budget 256] [--batch 1,8,24]
//          [--reps 30] [--copy-gbps 4230] [--ucx shm,self] [--busy-poll-us 50]
#include <cuda_runtime.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
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
  std::string ucx = "shm,self";  // UCX_TLS of the data plane; "" = gRPC only
  int busy_poll_us = 50;          // ucx.busy_poll_us of the daemon and the client alike
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
  app.add_option("--ucx", o.ucx, "UCX_TLS for the data-plane rows (\"\" = gRPC only)");
  app.add_option("--busy-poll-us", o.busy_poll_us, "UCX busy polling of daemon and client, us");
  app.set_version_flag("--version", kvshade::VersionLine("kvshade_delivery_bench"));
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "delivery bench: no CUDA device visible\n");
    return 1;
  }
  char cfg[] = "/tmp/kvshade-delivery-cfg-XXXXXX";
  if (const int fd = mkstemp(cfg); fd >= 0) close(fd);
  const int metrics_port = kvshade::bench::FreePort();
  {
    std::ofstream f(cfg);
    f << "metrics_port: " << metrics_port << "\nlimits:\n  max_attachments_per_session: 256\n"
      << "  max_lease_ms: 3600000\n  default_lease_ms: 3600000\n";
    if (!o.ucx.empty()) {
      f << "ucx:\n  enable: true\n  transports: \"" << o.ucx << "\"\n  busy_poll_us: " << o.busy_poll_us << "\n";
    }
  }
  auto server = kvshade::bench::SpawnServer(o.server, {"-c", cfg, "--backend", "cuda"}, "delivery bench");
  std::remove(cfg);
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
    std::unique_ptr<kvshade::client::Client> ucx_client;
    if (!o.ucx.empty()) {
      kvshade::client::ClientOptions uo = co;
      uo.use_ucx = true;
      uo.ucx_transports = o.ucx;
      uo.ucx_busy_poll_us = o.busy_poll_us;
      auto u = kvshade::client::Client::Connect(uo);
      if (!u.ok()) {
        std::fprintf(stderr, "delivery bench: UCX client: %s\n", std::string(u.status().message()).c_str());
        return 1;
      }
      ucx_client = *std::move(u);
    }
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
    // [transport][mode]: gRPC and UCX clients each attach their own inline and IPC workers.
    std::vector<Worker> inline_w(max_batch), ipc_w(max_batch), uinline_w(max_batch), uipc_w(max_batch);
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
      if (ucx_client) {
        v1::AttachRequest ur = ar;
        ur.set_worker_id("ucx-ipc-" + std::to_string(j));
        Worker& uw = uipc_w[j];  // its own slot buffers
        cudaIpcMemHandle_t uh;
        if (cudaMalloc(&uw.gpu, 2 * slot_bytes) != cudaSuccess || cudaIpcGetMemHandle(&uh, uw.gpu) != cudaSuccess) {
          return 1;
        }
        ur.mutable_cuda_ipc()->set_k_handle(std::string(reinterpret_cast<const char*>(&uh), sizeof(uh)));
        ur.mutable_cuda_ipc()->set_v_handle(ur.cuda_ipc().k_handle());
        auto ui = ucx_client->Attach(ur);
        ur.set_worker_id("ucx-inline-" + std::to_string(j));
        ur.set_delivery(v1::DELIVERY_MODE_INLINE);
        ur.clear_cuda_ipc();
        auto un = ucx_client->Attach(ur);
        if (!ui.ok() || !un.ok()) {
          std::fprintf(stderr, "Attach (UCX): %s\n",
                       std::string((!ui.ok() ? ui.status() : un.status()).message()).c_str());
          return 1;
        }
        uipc_w[j].attachment = ui->attachment_id();
        uinline_w[j].attachment = un->attachment_id();
      }
    }
    if (ucx_client && !ucx_client->ucx_connected()) {
      std::fprintf(stderr, "delivery bench: the UCX data plane did not connect\n");
      return 1;
    }
    std::printf("# delivery bench: n=%lld L=%d h=%d hq=%d d=%d r=%d k=%d C=%d, reps=%d, slot "
                "buffers %.1f MiB per worker, ucx '%s', busy poll %d us\n",
                static_cast<long long>(o.tokens), o.layers, o.kv_heads, o.q_heads, o.head_dim,
                o.rank, o.budget, chunk, o.reps, 2.0 * slot_bytes / (1 << 20), o.ucx.c_str(),
                o.busy_poll_us);
    std::printf("%-6s %-12s %9s %9s %11s %13s %8s %11s %10s %12s\n", "batch", "mode", "p50 ms",
                "p99 ms", "kernel ms", "p50-kernel ms", "miss %", "MiB/call", "GB/s", "floor ms");
    int step = 0;
    const int modes = ucx_client ? 4 : 2;
    const char* names[4] = {"inline/grpc", "ipc/grpc", "inline/ucx", "ipc/ucx"};
    for (int B : o.batches) {
      for (int mode = 0; mode < modes; ++mode) {
        const auto& ws = mode == 0 ? inline_w : mode == 1 ? ipc_w : mode == 2 ? uinline_w : uipc_w;
        kvshade::client::Client& cl = mode < 2 ? c : *ucx_client;
        std::map<std::string, double> stage0;
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
          if (rep == 0) stage0 = kvshade::bench::StageSeconds(metrics_port, true);
          const auto t0 = Clock::now();
          auto r = cl.SelectAndReconstruct(req);
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
        std::map<std::string, double> stage1 = kvshade::bench::StageSeconds(metrics_port, true);
        const double kernel_ms =
            stage1.empty() ? -1.0
                           : 1e3 * ((stage1["select"] - stage0["select"]) +
                                    (stage1["reconstruct"] - stage0["reconstruct"])) / o.reps;
        const double p50 = Percentile(ms, 0.5), bytes = bytes_sum / o.reps;
        std::printf("%-6d %-12s %9.3f %9.3f %11.3f %13.3f %8.1f %11.2f %10.2f %12.4f\n", B,
                    names[mode], p50, Percentile(ms, 0.99), kernel_ms, p50 - kernel_ms,
                    sel > 0 ? 100.0 * miss / sel : 0.0, bytes / (1 << 20), bytes / (p50 * 1e6),
                    2.0 * bytes / (o.copy_gbps * 1e6));
        // Where the daemon's time went, per call (ms): every stage and the RPC itself.
        std::printf("       %-12s daemon per call:", names[mode]);
        for (const auto& [k, v1s] : stage1) {
          const double d = v1s - stage0[k];
          if (d > 0) std::printf(" %s %.3f", k.c_str(), 1e3 * d / o.reps);
        }
        std::printf("\n");
      }
    }
    for (auto& w : uipc_w) {
      if (ucx_client) ucx_client->Detach(w.attachment).IgnoreError();
      cudaFree(w.gpu);
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

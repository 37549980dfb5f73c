// kvshade_ucx_bench: the UCX data plane against gRPC inline on loopback, each figure
// beside its floor (a benchmark, not a test). Starts its own kvshade-server with the data
// plane on (--transports, default tcp,self) and measures:
//   1. Ingest bandwidth of one session (default 8 layers x 16384 tokens x 8 KV heads x
//      d 128, bf16 K+V = 512 MiB; profile exact, so the engine mostly stores) over UCX
//      (Client::Ingest: pipelined, tensors by rendezvous from the caller's buffers) and
//      over gRPC inline (the same messages), beside memcpy of the same bytes and a raw
//      UCX active-message stream of the same parts between two workers of this process.
//   2. SelectAndReconstruct round trips p50/p99 at batch 1, 8 and 24 with a small budget
//      (steady decode, slot tables warm), over gRPC inline, UCX inline and UCX RMA (misses
//      put into registered slot buffers), calls interleaved so that all three see the
//      same load; beside two floors: the daemon's NOT_FOUND reply (transport + parsing,
//      no selection) and a raw active-message ping-pong between two workers of this
//      process with a request-sized payload. Beside each, the daemon's own select +
//      reconstruct time per call (kvshade_stage_duration_seconds{stage="select" and
//      "reconstruct"} summed over the batch's timed calls, scraped from its /metrics, per
//      call) and the mean round trip minus it: the data path's overhead over the kernels
//      (means on both sides: the stage histogram gives no per-call pairing).
// Usage: kvshade_ucx_bench [--server PATH] [--backend cpu|cuda] [--transports tcp,self] [--reps 400]
//          [--ingest-layers 8] [--ingest-tokens 16384] [--ingest-kv-heads 8]
//          [--head-dim 128] [--ingest-profile exact|shadow] [--part-mib 8] [--window 4] [--warmup 1]
//          [--select-tokens 8192] [--select-layers 4] [--budget 8] [--skip-ingest 1]
//          [--batches 1,8,24]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "kvshade/client/client.h"
#include "kvshade/client/tensor.h"
#include "kvshade/transport/ucx_core.h"
#include "kvshade/version.h"
#include "loopback.h"
#include "synthetic.h"

namespace {

using Clock = std::chrono::steady_clock;
using kvshade::client::Client;
namespace v1 = kvshade::v1;
namespace synthetic = kvshade::synthetic;
namespace ucx = kvshade::transport::ucx;
using kvshade::bench::Percentile;

struct Options {
  std::string server = KVSHADE_SERVER_PATH;
  std::string backend = "cpu";  // the daemon's kernel backend
  std::string transports = "tcp,self";
  int reps = 400;
  int ingest_layers = 8, ingest_kv_heads = 8, head_dim = 128;
  int64_t ingest_tokens = 16384;
  std::string ingest_profile = "exact";
  int part_mib = 8, window = 4, warmup = 1;
  int64_t select_tokens = 8192;
  int select_layers = 4, budget = 8;
  bool skip_ingest = false;
  std::vector<size_t> batches = {1, 8, 24};
};

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
double Secs(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

[[noreturn]] void Die(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "ucx_bench: %s: %s\n", what.c_str(), s.ToString().c_str());
  std::exit(1);
}

// Two UCX workers in this process (the floors): A sends id 1, B answers each with an
// empty id 100. No engine, no protobuf, no daemon.
class RawPair {
 public:
  explicit RawPair(const std::string& transports) {
    std::map<unsigned, ucx::UcxLoop::Handler> hb;
    hb[1] = [this](ucx::AmMessage&& m) { (void)b_->Send(m.reply_ep, 100, "", ""); };
    auto b = ucx::UcxLoop::Start(transports, std::move(hb));
    if (!b.ok()) Die("raw pair", b.status());
    b_ = *std::move(b);
    // Received as the daemon receives: into pre-faulted pool buffers (its defaults).
    auto pool = ucx::ReceivePool::Create(8, size_t{16} << 20);
    if (!pool.ok()) Die("raw pair pool", pool.status());
    (void)b_->CallStatus([&] {
      b_->set_receive_pool(*pool);
      return absl::OkStatus();
    });
    std::map<unsigned, ucx::UcxLoop::Handler> ha;
    ha[100] = [this](ucx::AmMessage&&) {
      std::lock_guard<std::mutex> lock(mu_);
      ++replies_;
      cv_.notify_all();
    };
    auto a = ucx::UcxLoop::Start(transports, std::move(ha));
    if (!a.ok()) Die("raw pair", a.status());
    a_ = *std::move(a);
    const std::string addr = b_->address();
    absl::Status st = a_->CallStatus([&]() -> absl::Status {
      auto ep = ucx::UcxEndpoint::Connect(a_->worker(), addr);
      if (!ep.ok()) return ep.status();
      ep_ = *std::move(ep);
      return absl::OkStatus();
    });
    if (!st.ok()) Die("raw pair connect", st);
  }
  ~RawPair() {
    a_->Stop([this] { ep_.reset(); });
    b_->Stop();
  }

  // Round trip of one `bytes`-byte message from this thread (through A's progress thread,
  // as a client call goes), in microseconds.
  double PingPong(size_t bytes) {
    const uint64_t base = Replies();
    std::string payload(bytes, 'x');
    const auto t0 = Clock::now();
    a_->Post([this, p = std::move(payload)]() mutable { (void)a_->Send(ep_->get(), 1, "", std::move(p)); });
    WaitFor(base + 1);
    return Us(Clock::now() - t0);
  }

  // Streams `parts` (by rendezvous above 64 KiB) with up to `window` unanswered; seconds.
  double Bulk(const std::vector<std::pair<const void*, size_t>>& parts, int window) {
    const uint64_t base = Replies();
    const auto t0 = Clock::now();
    uint64_t sent = 0;
    for (const auto& part : parts) {
      if (sent >= static_cast<uint64_t>(window)) WaitFor(base + sent - window + 1);
      a_->Post([this, part] { (void)a_->SendIov(ep_->get(), 1, "", {part}); });
      ++sent;
    }
    WaitFor(base + sent);
    return Secs(Clock::now() - t0);
  }

 private:
  uint64_t Replies() {
    std::lock_guard<std::mutex> lock(mu_);
    return replies_;
  }
  void WaitFor(uint64_t replies) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return replies_ >= replies; });
  }
  std::unique_ptr<ucx::UcxLoop> a_, b_;
  std::unique_ptr<ucx::UcxEndpoint> ep_;  // A's thread only
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t replies_ = 0;
};

v1::Profile Profile(const std::string& kind, int budget) {
  v1::Profile p;
  p.set_kind(kind == "shadow" ? v1::PROFILE_KIND_SHADOW : v1::PROFILE_KIND_EXACT);
  p.set_rank(64);
  p.set_chunk_size(8);
  p.set_sparse_budget(budget);
  p.set_outliers(16);
  p.set_local_window(32);
  return p;
}

// The whole Ingest stream of `doc` (parts of about `part_bytes` K+V), header session id
// left for the caller.
std::vector<v1::IngestRequest> IngestStream(const synthetic::Document& doc, size_t part_bytes) {
  const auto& s = doc.spec();
  const int64_t n = s.doc_tokens;
  const int64_t row = int64_t{s.kv_heads} * s.head_dim;
  const int64_t per_part = std::max<int64_t>(1, static_cast<int64_t>(part_bytes) / (row * 4));
  std::vector<v1::IngestRequest> msgs(1);
  msgs[0].mutable_header();
  std::vector<uint16_t> k, v;
  for (int l = 0; l < s.layers; ++l) {
    doc.KeysValues(l, -1, 0, n, &k, &v);
    for (int64_t t0 = 0; t0 < n; t0 += per_part) {
      const int64_t m = std::min(per_part, n - t0);
      v1::IngestRequest r;
      auto* part = r.mutable_layer();
      part->set_layer(l);
      part->set_token_offset(t0);
      part->set_last_part(t0 + m == n);
      *part->mutable_k() = kvshade::client::MakeBf16Tensor(
          {m, s.kv_heads, s.head_dim}, absl::MakeConstSpan(k).subspan(t0 * row, m * row));
      *part->mutable_v() = kvshade::client::MakeBf16Tensor(
          {m, s.kv_heads, s.head_dim}, absl::MakeConstSpan(v).subspan(t0 * row, m * row));
      msgs.push_back(std::move(r));
    }
  }
  msgs.emplace_back().mutable_commit();
  return msgs;
}

// Best of three memcpys of every tensor of `msgs` into one destination, in GB/s.
double MemcpyGBps(const std::vector<v1::IngestRequest>& msgs, uint64_t bytes) {
  std::vector<char> dst(bytes);
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const auto t0 = Clock::now();
    size_t off = 0;
    for (const auto& m : msgs) {
      if (!m.has_layer()) continue;
      for (const std::string* d : {&m.layer().k().data(), &m.layer().v().data()}) {
        std::memcpy(dst.data() + off, d->data(), d->size());
        off += d->size();
      }
    }
    best = std::max(best, bytes / Secs(Clock::now() - t0) / 1e9);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"the UCX data plane against gRPC inline on loopback (see this file's header)"};
  app.add_option("--server", o.server, "kvshade-server binary");
  app.add_option("--backend", o.backend, "the daemon's kernel backend");
  app.add_option("--transports", o.transports, "UCX_TLS of both sides");
  app.add_option("--reps", o.reps);
  app.add_option("--ingest-layers", o.ingest_layers);
  app.add_option("--ingest-tokens", o.ingest_tokens);
  app.add_option("--ingest-kv-heads", o.ingest_kv_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--ingest-profile", o.ingest_profile, "exact or shadow");
  app.add_option("--part-mib", o.part_mib);
  app.add_option("--window", o.window, "ingest parts in flight");
  app.add_option("--warmup", o.warmup, "1: one unmeasured ingest first (touches the engine's memory)");
  app.add_option("--select-tokens", o.select_tokens);
  app.add_option("--select-layers", o.select_layers);
  app.add_option("--budget", o.budget);
  app.add_option("--skip-ingest", o.skip_ingest, "1: measure select only");
  app.add_option("--batches", o.batches, "select batch sizes (at most 24)")->delimiter(',');
  app.set_version_flag("--version", kvshade::VersionLine("kvshade_ucx_bench"));
  CLI11_PARSE(app, argc, argv);

  // --- Server: our own child with the data plane on.
  const std::string cfg = [&] {
    char tmpl[] = "/tmp/kvshade-ucx-cfg-XXXXXX";
    const int fd = mkstemp(tmpl);
    if (fd >= 0) close(fd);
    return std::string(tmpl);
  }();
  const int metrics_port = kvshade::bench::FreePort();
  std::ofstream(cfg) << "metrics_port: " << metrics_port << "\n"
                     << "ucx:\n  enable: true\n  transports: \"" << o.transports
                     << "\"\nlimits:\n  max_attachments_per_session: 256\n"
                     // The select attachments idle through the ingest phase.
                     << "  max_lease_ms: 3600000\n  default_lease_ms: 3600000\n";
  auto server = kvshade::bench::SpawnServer(o.server, {"-c", cfg, "--backend", o.backend}, "ucx_bench");
  if (!server) return 1;

  kvshade::client::ClientOptions go;
  go.target = server->target;
  go.timeout = absl::Seconds(600);
  kvshade::client::ClientOptions uo = go;
  uo.use_ucx = true;
  uo.ucx_transports = o.transports;
  uo.ucx_ingest_window = o.window;
  auto grpc_or = Client::Connect(go);
  auto ucx_or = Client::Connect(uo);
  if (!grpc_or.ok()) Die("connect", grpc_or.status());
  if (!ucx_or.ok()) Die("connect", ucx_or.status());
  Client& g = **grpc_or;
  Client& u = **ucx_or;
  if (absl::Status s = g.WaitForServing(absl::Seconds(30)); !s.ok()) Die("health", s);
  RawPair raw(o.transports);

  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) < 0) load[0] = -1;
  std::printf("# kvshade UCX data plane vs gRPC inline on loopback\n\n");
  std::printf("host %s, %u cores, load average %.2f at start; transports %s; %s backend\n\n", host,
              std::thread::hardware_concurrency(), load[0], o.transports.c_str(), o.backend.c_str());

  // --- Select session first (it also connects the UCX client).
  synthetic::DocSpec ss;
  ss.layers = o.select_layers;
  ss.kv_heads = 2;
  ss.q_heads = 8;
  ss.head_dim = o.head_dim;
  ss.doc_tokens = o.select_tokens;
  ss.question_tokens = 16;
  ss.latent_rank = 24;
  const synthetic::Document sdoc(ss);
  const v1::Profile sprof = Profile("shadow", o.budget);
  auto screated = g.CreateSession(synthetic::MakeCreate(sdoc, sprof, -1));
  if (!screated.ok()) Die("CreateSession", screated.status());
  if (auto ing = synthetic::IngestRange(g, sdoc, screated->session_id(), -1, 0, o.select_tokens); !ing.ok()) {
    Die("Ingest", ing.status());
  }
  constexpr int kMaxBatch = 24;
  std::vector<std::string> ga, ua, ra;
  std::vector<std::vector<uint16_t>> buffers;  // RMA slot buffers, K and V per attachment
  for (int j = 0; j < kMaxBatch; ++j) {
    v1::AttachRequest ar;
    ar.set_session_id(screated->session_id());
    auto a = g.Attach(ar);
    auto b = u.Attach(ar);
    ar.set_delivery(v1::DELIVERY_MODE_UCX_RMA);
    auto c = u.Attach(ar);
    if (!a.ok()) Die("Attach", a.status());
    if (!b.ok()) Die("Attach", b.status());
    if (!c.ok()) Die("Attach", c.status());
    ga.push_back(a->attachment_id());
    ua.push_back(b->attachment_id());
    ra.push_back(c->attachment_id());
    buffers.emplace_back(c->slot_buffer_bytes() / 2);
    buffers.emplace_back(c->slot_buffer_bytes() / 2);
    if (absl::Status st = u.RegisterSlotBuffers(c->attachment_id(), buffers[buffers.size() - 2].data(),
                                                buffers.back().data(), c->slot_buffer_bytes());
        !st.ok()) {
      Die("RegisterSlotBuffers", st);
    }
  }
  if (!u.ucx_connected()) {
    std::fprintf(stderr, "ucx_bench: the UCX client did not connect (fallbacks %llu)\n",
                 static_cast<unsigned long long>(u.ucx_fallbacks()));
    return 1;
  }

  // --- 1. Ingest.
  if (!o.skip_ingest) {
    synthetic::DocSpec is;
    is.layers = o.ingest_layers;
    is.kv_heads = o.ingest_kv_heads;
    is.q_heads = o.ingest_kv_heads * 4;
    is.head_dim = o.head_dim;
    is.doc_tokens = o.ingest_tokens;
    is.question_tokens = 16;
    is.latent_rank = 24;
    const size_t part_bytes = size_t{static_cast<size_t>(o.part_mib)} << 20;
    const v1::Profile iprof = Profile(o.ingest_profile, 256);
    std::printf("## Ingest: %d layers x %lld tokens x %d KV heads x d %d, profile %s, parts of %d MiB, "
                "window %d\n\n",
                o.ingest_layers, static_cast<long long>(o.ingest_tokens), o.ingest_kv_heads, o.head_dim,
                o.ingest_profile.c_str(), o.part_mib, o.window);
    std::printf("| path | seconds | GB/s | x memcpy |\n|---|---:|---:|---:|\n");
    double memcpy_gbps = 0;
    std::vector<std::string> stage_lines;  // printed under the table
    // -1: an unmeasured ingest over gRPC, closed again, so that the measured ones land on
    // engine memory a running daemon has touched before (not on first-touch page faults);
    // 0: UCX, 1: gRPC. A different document each, so that none hits the prefix cache.
    for (int pass = o.warmup ? -1 : 0; pass < 2; ++pass) {
      is.seed = 11 + pass;
      const synthetic::Document doc(is);
      std::vector<v1::IngestRequest> msgs = IngestStream(doc, part_bytes);
      const uint64_t bytes = doc.DenseBytes(o.ingest_tokens);
      if (pass == 0) {
        memcpy_gbps = MemcpyGBps(msgs, bytes);
        std::vector<std::pair<const void*, size_t>> parts;
        for (const auto& m : msgs) {
          if (!m.has_layer()) continue;
          // K and V of a part go as one message in the real stream; two here is the same
          // bytes with the same window.
          parts.emplace_back(m.layer().k().data().data(), m.layer().k().data().size());
          parts.emplace_back(m.layer().v().data().data(), m.layer().v().data().size());
        }
        const double raw_s = raw.Bulk(parts, 2 * o.window);
        std::printf("| memcpy of the same bytes (best of 3) | %.3f | %.2f | 1.00 |\n", bytes / memcpy_gbps / 1e9,
                    memcpy_gbps);
        std::printf("| raw UCX active messages, 2 workers in one process, no engine | %.3f | %.2f | %.2f |\n",
                    raw_s, bytes / raw_s / 1e9, bytes / raw_s / 1e9 / memcpy_gbps);
      }
      auto created = g.CreateSession(synthetic::MakeCreate(doc, iprof, -1));
      if (!created.ok()) Die("CreateSession", created.status());
      msgs[0].mutable_header()->set_session_id(created->session_id());
      const std::map<std::string, double> stage0 = kvshade::bench::StageSeconds(metrics_port);
      const auto t0 = Clock::now();
      auto r = pass == 0 ? u.Ingest(msgs) : g.Ingest(msgs);
      const double s = Secs(Clock::now() - t0);
      if (pass >= 0) {
        // The daemon's ingest stages during this stream (its /metrics), in ms. A layer's
        // compression runs while the next layer's parts arrive, so they may sum past the
        // wall time.
        std::string line = absl::StrCat(pass == 0 ? "UCX" : "gRPC", " ingest, daemon stages (ms, summed over layers):");
        for (const auto& [stage, v] : kvshade::bench::StageSeconds(metrics_port)) {
          const auto it = stage0.find(stage);
          const double d = v - (it == stage0.end() ? 0.0 : it->second);
          if (stage.rfind("ingest", 0) == 0 && d > 0) absl::StrAppend(&line, " ", stage, " ", absl::StrFormat("%.1f", 1e3 * d));
        }
        stage_lines.push_back(line);
      }
      if (!r.ok()) Die(pass == 0 ? "UCX Ingest" : "gRPC Ingest", r.status());
      const double gbps = bytes / s / 1e9;
      if (pass < 0) {
        (void)g.CloseSession(created->session_id());
        continue;
      }
      std::printf("| %s | %.3f | %.2f | %.2f |\n",
                  pass == 0 ? "kvshade Ingest over UCX (pipelined, rendezvous from the caller's buffers)"
                            : "kvshade Ingest over gRPC inline (streamed)",
                  s, gbps, gbps / memcpy_gbps);
      (void)g.CloseSession(created->session_id());
    }
    std::printf("\n");
    for (const std::string& line : stage_lines) std::printf("%s\n", line.c_str());
    std::printf("\n");
  }

  // --- 2. Select round trips.
  std::printf("## SelectAndReconstruct round trip: %lld-token session, %d layers, 2 KV heads (8 query "
              "heads), d %d, shadow rank 64, C 8, budget %d; steady decode (step 0 warms the slot "
              "tables); calls interleaved\n\n",
              static_cast<long long>(o.select_tokens), o.select_layers, o.head_dim, o.budget);
  std::printf("| call | transport | p50 us | p99 us | calls | floor p50 / p99 us | mean us | kernels us/call | mean minus kernels us |\n"
              "|---|---|---:|---:|---:|---|---:|---:|---:|\n");
  // Floors: the daemon's NOT_FOUND (transport + parsing) and a raw ping-pong of the
  // request's size.
  struct Floors {
    std::vector<double> grpc, ucx, raw;
    size_t request_bytes = 0;
  };
  auto floor_of = [&](size_t batch) {
    v1::SelectAndReconstructRequest bad;
    bad.set_layer(0);
    const auto q = sdoc.Query(0, 0, 0, o.select_tokens);
    for (size_t j = 0; j < batch; ++j) {
      auto* sq = bad.add_queries();
      sq->set_attachment_id("no-such-attachment");
      *sq->mutable_q() = kvshade::client::MakeBf16Tensor({ss.q_heads, ss.head_dim}, absl::MakeConstSpan(q));
    }
    Floors f;
    f.request_bytes = bad.ByteSizeLong();
    for (int i = 0; i < o.reps; ++i) {
      auto t0 = Clock::now();
      auto r1 = g.SelectAndReconstruct(bad);
      auto t1 = Clock::now();
      auto r2 = u.SelectAndReconstruct(bad);
      auto t2 = Clock::now();
      if (r1.ok() || r2.ok()) Die("floor", absl::InternalError("an unknown attachment was accepted"));
      f.grpc.push_back(Us(t1 - t0));
      f.ucx.push_back(Us(t2 - t1));
      f.raw.push_back(raw.PingPong(f.request_bytes));
    }
    return f;
  };
  for (size_t batch : o.batches) {
    if (batch < 1 || batch > size_t{kMaxBatch}) Die("--batches", absl::InvalidArgumentError("1..24"));
    std::vector<double> t[3];  // gRPC, UCX inline, UCX RMA
    std::map<std::string, double> stage0;  // read when the warm-up step is done
    size_t calls = 0;
    const int steps = std::max(2, o.reps / o.select_layers);
    for (int step = 0; step <= steps; ++step) {
      if (step == 1) stage0 = kvshade::bench::StageSeconds(metrics_port);
      for (int l = 0; l < o.select_layers; ++l) {
        v1::SelectAndReconstructRequest req[3];
        for (auto& r : req) r.set_layer(l);
        for (size_t j = 0; j < batch; ++j) {
          const auto q = sdoc.Query(l, static_cast<int>(j % 4), step, o.select_tokens);
          auto tq = kvshade::client::MakeBf16Tensor({ss.q_heads, ss.head_dim}, absl::MakeConstSpan(q));
          const std::string* ids[3] = {&ga[j], &ua[j], &ra[j]};
          for (int m = 0; m < 3; ++m) {
            auto* sq = req[m].add_queries();
            sq->set_attachment_id(*ids[m]);
            *sq->mutable_q() = tq;
          }
        }
        for (int m = 0; m < 3; ++m) {
          const int mode = (m + step) % 3;  // rotate who goes first
          Client& c = mode == 0 ? g : u;
          const auto t0 = Clock::now();
          auto r = c.SelectAndReconstruct(req[mode]);
          const double us = Us(Clock::now() - t0);
          if (!r.ok()) Die("SelectAndReconstruct", r.status());
          calls += step > 0;
          if (mode == 2 && !r->deltas(0).delivered()) {
            Die("RMA", absl::InternalError("a registered attachment's delta was not delivered"));
          }
          if (step > 0) t[mode].push_back(us);
        }
      }
    }
    // The daemon's kernel time per call: select + reconstruct stage seconds over the timed
    // calls of this batch size (-1 when /metrics could not be read).
    std::map<std::string, double> stage1 = kvshade::bench::StageSeconds(metrics_port);
    const double kernel_us =
        stage1.empty() || calls == 0
            ? -1.0
            : 1e6 * ((stage1["select"] - stage0["select"]) + (stage1["reconstruct"] - stage0["reconstruct"])) /
                  static_cast<double>(calls);
    const Floors fl = floor_of(batch);
    const char* names[3] = {"gRPC inline", "UCX inline", "UCX RMA"};
    for (int m = 0; m < 3; ++m) {
      const auto& f = m == 0 ? fl.grpc : fl.ucx;
      std::printf("| SelectAndReconstruct batch %zu | %s (%s) | %.1f | %.1f | %zu | NOT_FOUND reply %.1f / %.1f | %.1f | %.1f | %.1f |\n",
                  batch, names[m], m == 0 ? "tcp" : o.transports.c_str(), Percentile(t[m], 0.5),
                  Percentile(t[m], 0.99), t[m].size(), Percentile(f, 0.5), Percentile(f, 0.99),
                  Mean(t[m]), kernel_us, Mean(t[m]) - kernel_us);
    }
    std::printf("| raw AM ping-pong, %zu-byte request | UCX (%s), 2 workers in one process | %.1f | %.1f | %zu | - | - | - | - |\n",
                fl.request_bytes, o.transports.c_str(), Percentile(fl.raw, 0.5),
                Percentile(fl.raw, 0.99), fl.raw.size());
  }
  std::printf("\nUCX fallbacks: %llu\n", static_cast<unsigned long long>(u.ucx_fallbacks()));
  kvshade::bench::StopServer(*server);
  std::remove(cfg.c_str());
  return 0;
}

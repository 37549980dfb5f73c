// kvshade_select_bench: what the selection options buy and cost (docs/ALGORITHM.md
// "Selection options"), on planted data, on one backend.
//
// Data: one layer of a session in low-rank form (A [n, r], B [h, r, d], keys = RoPE(A B)):
// Gaussian keys of rank `true_rank` plus noise, with `needles` planted tokens per KV head:
// single tokens whose key is the query's direction at `needle_gain` times a typical key's
// norm, each in a chunk of its own among ordinary tokens (so the chunk mean, the landmark,
// dilutes it C times), as in retrieval over a long context without chunk locality.
// Landmarks are the chunk means of the keys, as ingest computes them.
//
// For each option it reports, averaged over `trials` queries (each a fresh query direction
// with its own needles): recall@k against the oracle (SelectEx's stage 2 over every chunk:
// the group's maximum of each query head's softmax over all reconstructed keys), the
// fraction of needle tokens selected (in a selected chunk, or unit), the chunks kept per
// head (for units: units kept / (C/u)), and the median time of the
// selection call beside Select + Reconstruct of k chunks (the decode step's selection work
// without the options).
//
// The `units of u` options select units of u tokens (docs/ALGORITHM.md "Selection units")
// with the same token budget (k*C/u units), and are costed beside the reconstruction of
// those units; they have no recall@k against the chunk oracle.
//
// The `sig` options run stage 2 from key signatures (docs/ALGORITHM.md "Key signatures"),
// encoded by the backend from the keys and landmarks as ingest does: over 4k, 8k or 16k
// stage-1 candidates, or over every chunk (no stage 1).
//
// The one-stage row runs Backend::Select (what a decode step without options runs); every
// other row Backend::SelectEx.
//
// With --batch B every call carries B sessions (the same layer, each with its own slot
// table and outputs), as a decode step of batch B does; times are per call.
//
//   kvshade_select_bench [--backend cpu|cuda] [--chunks 2048] [--k 32] [--h 8] [--g 4]
//                        [--d 128] [--r 128] [--C 8] [--needles 8] [--trials 8] [--batch 1]
//                        [--only "sig4 x16;sig4 x16, units of 2"]
// --only runs the named options (';'-separated, as printed) beside the one-stage row, e.g.
// to time their kernels apart under a profiler.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kvshade/kernels/backend.h"

using namespace kvshade::kernels;

namespace {

struct Args {
  std::string backend = "cpu";
  int chunks = 2048, k = 32, h = 8, g = 4, d = 128, r = 128, C = 8, needles = 8, trials = 8;
  int batch = 1;
  int true_rank = 32;
  float needle_gain = 1.0f;
  std::string only;  // ';'-separated option names (empty: every option)
};

Args Parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    const std::string v = argv[i + 1];
    if (f == "--backend") a.backend = v;
    else if (f == "--chunks") a.chunks = std::stoi(v);
    else if (f == "--k") a.k = std::stoi(v);
    else if (f == "--h") a.h = std::stoi(v);
    else if (f == "--g") a.g = std::stoi(v);
    else if (f == "--d") a.d = std::stoi(v);
    else if (f == "--r") a.r = std::stoi(v);
    else if (f == "--C") a.C = std::stoi(v);
    else if (f == "--needles") a.needles = std::stoi(v);
    else if (f == "--trials") a.trials = std::stoi(v);
    else if (f == "--batch") a.batch = std::max(1, std::stoi(v));
    else if (f == "--only") a.only = v;
    else if (f == "--true-rank") a.true_rank = std::stoi(v);
    else if (f == "--needle-gain") a.needle_gain = std::stof(v);
    else {
      std::fprintf(stderr, "unknown flag %s\n", f.c_str());
      std::exit(2);
    }
  }
  return a;
}

template <typename T>
Buffer Up(Backend& be, const std::vector<T>& x) {
  Buffer b = be.Allocate(std::max<size_t>(x.size() * sizeof(T), 1)).value();
  if (!x.empty()) (void)be.CopyFromHost(b.data(), x.data(), x.size() * sizeof(T));
  return b;
}

template <typename T>
std::vector<T> Down(Backend& be, const void* p, size_t n) {
  std::vector<T> out(n);
  (void)be.Synchronize();
  (void)be.CopyToHost(out.data(), p, n * sizeof(T));
  return out;
}

struct Layer {
  std::vector<bf16> a, b, landmarks, q;
  std::vector<bf16> kr;  // [n, h, d] post-RoPE keys (bf16), for the key signatures
  std::vector<std::set<int>> needle_chunks;  // per head
  std::vector<std::set<int>> needle_tokens;  // per head
};

// One trial's layer: keys with low-rank structure; needles planted along each query head
// group's direction.
Layer Make(const Args& x, std::mt19937_64& rng) {
  const int n = x.chunks * x.C, h = x.h, d = x.d, r = x.r, g = x.g;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Layer L;
  // Basis: per head an orthonormal-ish random [r, d] (scaled Gaussian); keys' coordinates
  // live in the first true_rank dims of A plus noise in the others.
  L.b.resize(size_t(h) * r * d);
  for (auto& v : L.b) v = FloatToBf16(nd(rng) / std::sqrt(float(d)));
  std::vector<float> a(size_t(n) * r);
  for (int t = 0; t < n; ++t)
    for (int j = 0; j < r; ++j) a[size_t(t) * r + j] = nd(rng) * (j < x.true_rank ? 1.0f : 0.15f);
  // Queries: random; needles: for head hh, pick chunks and one token in each, and set the
  // token's coordinates so its key (pre-RoPE) is the query's direction rotated back (the
  // coordinates are found by least squares through B: a = B_h q_pre, valid for the head
  // whose B it uses; other heads see an ordinary token).
  L.q.resize(size_t(h) * g * d);
  for (auto& v : L.q) v = FloatToBf16(nd(rng));
  L.needle_chunks.resize(h);
  L.needle_tokens.resize(h);
  RopeSpec rope;
  const RopeTable table = MakeRopeTable(rope, d).value();
  std::vector<int> perm(x.chunks - 1);
  for (int i = 0; i < x.chunks - 1; ++i) perm[i] = i + 1;
  std::shuffle(perm.begin(), perm.end(), rng);
  int next = 0;
  for (int hh = 0; hh < h; ++hh) {
    for (int s = 0; s < x.needles; ++s) {
      const int c = perm[next++ % perm.size()];
      const int t = c * x.C + int(rng() % x.C);
      // Mean query direction of the group, rotated back to position t (pre-RoPE).
      std::vector<float> qd(d, 0.0f);
      for (int n2 = 0; n2 < g; ++n2)
        for (int e = 0; e < d; ++e) qd[e] += Bf16ToFloat(L.q[(size_t(hh) * g + n2) * d + e]);
      ApplyRopeReference(table, rope.pairing, -t, qd.data(), d);
      float norm = 0;
      for (float v : qd) norm += v * v;
      norm = std::sqrt(norm);
      // a = (qd / |qd|) B_h^T * gain * the typical key norm (B_h's rows have norm ~1), so
      // that the needle's key points along the group's query at gain times a key's norm.
      const float typical = std::sqrt(float(x.true_rank) + float(r - x.true_rank) * 0.0225f);
      for (int j = 0; j < r; ++j) {
        float dot = 0;
        for (int e = 0; e < d; ++e) dot += Bf16ToFloat(L.b[(size_t(hh) * r + j) * d + e]) * qd[e];
        a[size_t(t) * r + j] = dot / norm * x.needle_gain * typical;
      }
      L.needle_chunks[hh].insert(c);
      L.needle_tokens[hh].insert(t);
    }
  }
  L.a.resize(a.size());
  for (size_t i = 0; i < a.size(); ++i) L.a[i] = FloatToBf16(a[i]);
  // Landmarks: chunk means of the post-RoPE reconstructed keys.
  L.landmarks.assign(size_t(x.chunks) * h * d, bf16{});
  L.kr.assign(size_t(n) * h * d, bf16{});
#pragma omp parallel for schedule(dynamic, 16)
  for (int c = 0; c < x.chunks; ++c) {
    std::vector<float> key(d), mean(d);
    for (int hh = 0; hh < h; ++hh) {
      std::fill(mean.begin(), mean.end(), 0.0f);
      for (int t = c * x.C; t < (c + 1) * x.C; ++t) {
        std::fill(key.begin(), key.end(), 0.0f);
        for (int j = 0; j < r; ++j) {
          const float aj = Bf16ToFloat(L.a[size_t(t) * r + j]);
          for (int e = 0; e < d; ++e) key[e] += aj * Bf16ToFloat(L.b[(size_t(hh) * r + j) * d + e]);
        }
        ApplyRopeReference(table, rope.pairing, t, key.data(), d);
        for (int e = 0; e < d; ++e) mean[e] += key[e];
        for (int e = 0; e < d; ++e) L.kr[(size_t(t) * h + hh) * d + e] = FloatToBf16(key[e]);
      }
      for (int e = 0; e < d; ++e)
        L.landmarks[(size_t(c) * h + hh) * d + e] = FloatToBf16(mean[e] / float(x.C));
    }
  }
  return L;
}

struct Out {
  std::vector<int32_t> selected;
  double ms = 0;
};

// `sig`: the layer's key signatures of `sig_bits` bits in backend memory (or null).
Out RunSelectEx(Backend& be, const Args& x, const Layer& L, int k, const SelectOptions* o,
                int reps, const Buffer* sig = nullptr, int sig_bits = 0) {
  const int h = x.h;
  const size_t hk = size_t(h) * k;
  Buffer a = Up(be, L.a), b = Up(be, L.b), lm = Up(be, L.landmarks), q = Up(be, L.q);
  std::vector<uint8_t> ex(size_t(h) * x.chunks, 0);
  for (int hh = 0; hh < h; ++hh) ex[size_t(hh) * x.chunks] = 1;  // the sink is static
  Buffer exb = Up(be, ex);
  const size_t per = hk * 4 + size_t(h);  // int32 outputs of one item
  Buffer outs = be.Allocate(per * 4 * x.batch).value();
  SelectItem it;
  it.view.n_segments = 1;
  it.view.b = static_cast<const bf16*>(b.data());
  it.view.r = x.r;
  it.view.segments[0].n_chunks = x.chunks;
  it.view.segments[0].landmarks = static_cast<const bf16*>(lm.data());
  it.view.segments[0].excluded = static_cast<const uint8_t*>(exb.data());
  it.view.segments[0].a = static_cast<const bf16*>(a.data());
  if (sig != nullptr) {
    it.view.segments[0].sig = static_cast<const std::byte*>(sig->data());
    it.view.sig_bits = sig_bits;
  }
  it.q = static_cast<const bf16*>(q.data());
  int32_t* base = static_cast<int32_t*>(outs.data());
  it.slots = base;
  it.selected = base + hk;
  it.miss_slot = base + 2 * hk;
  it.miss_chunk = base + 3 * hk;
  it.miss_count = base + 4 * hk;
  std::vector<SelectItem> items(x.batch, it);
  for (int i = 1; i < x.batch; ++i) {
    int32_t* bi = base + i * per;
    items[i].slots = bi;
    items[i].selected = bi + hk;
    items[i].miss_slot = bi + 2 * hk;
    items[i].miss_chunk = bi + 3 * hk;
    items[i].miss_count = bi + 4 * hk;
  }
  SelectOptions opts = o ? *o : SelectOptions{};
  // No option: Backend::Select, what a decode step without options runs (DecodeGeometry::plain).
  const bool plain = opts.candidates == 0 && opts.top_p == 0 && !opts.units();
  const size_t ws_bytes = plain ? be.SelectWorkspaceBytes({h, x.g, x.d}, k, items)
                                : be.SelectExWorkspaceBytes({h, x.g, x.d}, k, opts, items);
  Buffer ws = be.Allocate(std::max<size_t>(ws_bytes, 1)).value();
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    for (const SelectItem& i : items) (void)be.Fill(i.slots, 0xff, hk * 4);
    (void)be.Synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = plain ? be.Select({h, x.g, x.d}, k, items, ws.workspace())
                            : be.SelectEx({h, x.g, x.d}, k, opts, items, ws.workspace());
    (void)be.Synchronize();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (!st.ok()) {
      std::fprintf(stderr, "SelectEx: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  }
  std::sort(times.begin(), times.end());
  Out out;
  out.ms = times[times.size() / 2];
  out.selected = Down<int32_t>(be, it.selected, hk);
  return out;
}

// Median ms of Reconstruct of k chunks per head (bf16 values in host-visible memory), or
// with `unit` = u (0 < u < C) of the same token budget in units of u tokens (k*C/u units).
double ReconstructMs(Backend& be, const Args& x, const Layer& L, int k, int reps, int unit = 0) {
  const int h = x.h;
  const int u = unit > 0 && unit < x.C ? unit : x.C;
  const int total = x.chunks * (x.C / u);  // selectable ids: chunks, or units
  k = k * (x.C / u);
  Buffer a = Up(be, L.a), b = Up(be, L.b);
  Buffer values = be.AllocateHostVisible(size_t(h) * x.chunks * x.C * x.d * 2).value();
  std::memset(values.data(), 0, values.bytes());
  std::vector<int32_t> mc(size_t(h) * k), cnt(h, k);
  for (int hh = 0; hh < h; ++hh)
    for (int j = 0; j < k; ++j) mc[size_t(hh) * k + j] = 1 + int(int64_t(j) * (total - 1) / k);
  Buffer mcb = Up(be, mc), cntb = Up(be, cnt);
  const size_t rows = size_t(h) * k * u * x.d;  // bf16 elements of one item's keys
  Buffer keys = be.Allocate(rows * 2 * x.batch).value();
  Buffer vals = be.Allocate(rows * 2 * x.batch).value();
  ReconstructItem it;
  it.view.n_segments = 1;
  it.view.b = static_cast<const bf16*>(b.data());
  it.view.r = x.r;
  it.view.segments[0].n_chunks = x.chunks;
  it.view.segments[0].a = static_cast<const bf16*>(a.data());
  it.view.segments[0].values = static_cast<const std::byte*>(values.data());
  it.view.segments[0].value_head_stride = int64_t(x.chunks) * x.C * x.d * 2;
  it.view.segments[0].value_chunk_stride = int64_t(x.C) * x.d * 2;
  it.miss_chunk = static_cast<const int32_t*>(mcb.data());
  it.miss_count = static_cast<const int32_t*>(cntb.data());
  it.keys = static_cast<bf16*>(keys.data());
  it.values = static_cast<bf16*>(vals.data());
  it.unit = u < x.C ? u : 0;
  std::vector<ReconstructItem> items(x.batch, it);
  for (int i = 1; i < x.batch; ++i) {
    items[i].keys = static_cast<bf16*>(keys.data()) + i * rows;
    items[i].values = static_cast<bf16*>(vals.data()) + i * rows;
  }
  LayerShape shape{h, x.g, x.d};
  Buffer ws = be.Allocate(std::max<size_t>(be.ReconstructWorkspaceBytes(shape, k, items), 1)).value();
  std::vector<double> times;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status st = be.Reconstruct(shape, x.C, k, RopeSpec{}, ValueCodecSpec{}, items, ws.workspace());
    (void)be.Synchronize();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    if (!st.ok()) {
      std::fprintf(stderr, "Reconstruct: %s\n", std::string(st.message()).c_str());
      std::exit(1);
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const Args x = Parse(argc, argv);
  auto be_or = CreateBackend(x.backend);
  if (!be_or.ok()) {
    std::fprintf(stderr, "backend %s: %s\n", x.backend.c_str(), std::string(be_or.status().message()).c_str());
    return 1;
  }
  Backend& be = **be_or;
  std::printf("backend %s: %d chunks of C=%d (%d tokens), h=%d g=%d d=%d r=%d, k=%d (%.1f%%), "
              "%d needles per head, %d trials, batch %d\n",
              x.backend.c_str(), x.chunks, x.C, x.chunks * x.C, x.h, x.g, x.d, x.r, x.k,
              100.0 * x.k / x.chunks, x.needles, x.trials, x.batch);
  struct Opt {
    const char* name;
    int factor;  // candidates = factor * k; 0: every chunk
    float top_p;
    int min_k;
    int sig_bits = 0;  // stage 2 from key signatures of this many bits
    int unit = 0;      // selection units of this many tokens (0: whole chunks)
  };
  const Opt opts[] = {{"one stage (landmarks)", 1, 0, 0},
                      {"two-stage x2", 2, 0, 0},
                      {"two-stage x4", 4, 0, 0},
                      {"two-stage x8", 8, 0, 0},
                      {"top_p 0.9, floor k/4", 1, 0.9f, -4},
                      {"x4 + top_p 0.9, floor k/4", 4, 0.9f, -4},
                      {"sig2 x4", 4, 0, 0, 2},
                      {"sig2 x16", 16, 0, 0, 2},
                      {"sig2 every chunk", 0, 0, 0, 2},
                      {"sig4 x4", 4, 0, 0, 4},
                      {"sig4 x8", 8, 0, 0, 4},
                      {"sig4 x16", 16, 0, 0, 4},
                      {"sig4 every chunk", 0, 0, 0, 4},
                      {"two-stage x4, units of 1", 4, 0, 0, 0, 1},
                      {"sig4 x4, units of 4", 4, 0, 0, 4, 4},
                      {"sig4 x4, units of 2", 4, 0, 0, 4, 2},
                      {"sig4 x4, units of 1", 4, 0, 0, 4, 1},
                      {"sig4 x8, units of 2", 8, 0, 0, 4, 2},
                      {"sig4 x16, units of 2", 16, 0, 0, 4, 2},
                      {"sig8 x4", 4, 0, 0, 8},
                      {"sig8 x8", 8, 0, 0, 8},
                      {"sig8 x16", 16, 0, 0, 8},
                      {"sig8 every chunk", 0, 0, 0, 8},
                      {"sig8 x8, units of 2", 8, 0, 0, 8, 2},
                      {"sig8 x16, units of 2", 16, 0, 0, 8, 2}};
  const int n_opts = int(sizeof(opts) / sizeof(opts[0]));
  std::vector<bool> run(n_opts, x.only.empty());
  run[0] = true;  // the one-stage baseline of every row's ratio
  for (size_t at = 0; !x.only.empty() && at <= x.only.size();) {
    const size_t end = std::min(x.only.find(';', at), x.only.size());
    const std::string name = x.only.substr(at, end - at);
    bool found = false;
    for (int i = 0; i < n_opts; ++i) {
      if (name == opts[i].name) run[i] = found = true;
    }
    if (!found) {
      std::fprintf(stderr, "--only: no option named '%s'\n", name.c_str());
      return 1;
    }
    at = end + 1;
  }
  std::vector<double> recall(n_opts, 0), needle(n_opts, 0), kept(n_opts, 0), ms(n_opts, 0);
  double rec_ms = 0;
  double rec_unit_ms[8] = {0};  // by unit size (1, 2, 4), same token budget
  std::mt19937_64 rng(20261201);
  for (int trial = 0; trial < x.trials; ++trial) {
    const Layer L = Make(x, rng);
    SelectOptions oracle;
    oracle.candidates = x.chunks;
    oracle.C = x.C;
    const Out orc = RunSelectEx(be, x, L, x.k, &oracle, 1);
    // Key signatures of each width, encoded by the backend as ingest does.
    Buffer sigs[9];
    for (int bits : kSignatureBits) {
      Buffer kr = Up(be, L.kr), lm = Up(be, L.landmarks);
      const size_t bytes = size_t(x.chunks) * x.C * x.h * SignatureRecordBytes(bits, x.d);
      sigs[bits] = be.Allocate(bytes).value();
      const absl::Status st = be.EncodeSignatures(
          absl::MakeConstSpan(static_cast<const bf16*>(kr.data()), L.kr.size()),
          absl::MakeConstSpan(static_cast<const bf16*>(lm.data()), L.landmarks.size()), x.h,
          x.d, x.C, x.chunks, bits, absl::MakeSpan(static_cast<std::byte*>(sigs[bits].data()), bytes));
      (void)be.Synchronize();
      if (!st.ok()) {
        std::fprintf(stderr, "EncodeSignatures: %s\n", std::string(st.message()).c_str());
        return 1;
      }
    }
    for (int i = 0; i < n_opts; ++i) {
      if (!run[i]) continue;
      SelectOptions o;
      if (opts[i].factor != 1) {
        o.candidates = opts[i].factor > 0 ? opts[i].factor * x.k : x.chunks;
        o.C = x.C;
      }
      o.top_p = opts[i].top_p;
      o.min_k = opts[i].min_k < 0 ? x.k / -opts[i].min_k : opts[i].min_k;
      o.signatures = opts[i].sig_bits > 0;
      o.unit = opts[i].unit;
      const int per_chunk = o.unit > 0 ? x.C / o.unit : 1;
      const int k = x.k * per_chunk;  // the same token budget in units
      const Out out = RunSelectEx(be, x, L, k, &o, 3,
                                  o.signatures ? &sigs[opts[i].sig_bits] : nullptr,
                                  opts[i].sig_bits);
      ms[i] += out.ms / x.trials;
      for (int hh = 0; hh < x.h; ++hh) {
        std::set<int> s, os;
        for (int j = 0; j < k; ++j) {
          if (out.selected[size_t(hh) * k + j] >= 0) s.insert(out.selected[size_t(hh) * k + j]);
        }
        for (int j = 0; j < x.k; ++j) {
          if (orc.selected[size_t(hh) * x.k + j] >= 0) os.insert(orc.selected[size_t(hh) * x.k + j]);
        }
        int hit = 0, nh = 0;
        if (o.unit > 0) {
          // No recall against the chunk oracle (units are not chunks): needles only.
          for (int t : L.needle_tokens[hh]) nh += s.count(t / o.unit);
        } else {
          for (int c : os) hit += s.count(c);
          for (int c : L.needle_chunks[hh]) nh += s.count(c);
        }
        recall[i] += double(hit) / std::max<size_t>(os.size(), 1) / (x.trials * x.h);
        needle[i] += double(nh) / std::max<size_t>(L.needle_tokens[hh].size(), 1) / (x.trials * x.h);
        kept[i] += double(s.size()) / per_chunk / (x.trials * x.h);
      }
    }
    rec_ms += ReconstructMs(be, x, L, x.k, 3) / x.trials;
    for (int u : {1, 2, 4}) {
      if (u < x.C && x.C % u == 0) rec_unit_ms[u] += ReconstructMs(be, x, L, x.k, 3, u) / x.trials;
    }
  }
  std::printf("%-28s %10s %10s %10s %12s %14s\n", "option", "recall@k", "needles", "kept/head",
              "select ms", "vs sel+recon");
  const double base = ms[0] + rec_ms;
  for (int i = 0; i < n_opts; ++i) {
    if (!run[i]) continue;
    const double rec = opts[i].unit > 0 ? rec_unit_ms[opts[i].unit] : rec_ms;
    char rc[16] = "         -";
    if (opts[i].unit == 0) std::snprintf(rc, sizeof(rc), "%10.3f", recall[i]);
    std::printf("%-28s %s %10.3f %10.1f %12.3f %13.2fx\n", opts[i].name, rc, needle[i], kept[i],
                ms[i], (ms[i] + rec) / base);
  }
  std::printf("reconstruct of k chunks per head: %.3f ms; of the same tokens in units of 1 / 2 / 4: "
              "%.3f / %.3f / %.3f ms\n", rec_ms, rec_unit_ms[1], rec_unit_ms[2], rec_unit_ms[4]);
  std::printf("device bytes per token and layer: low-rank keys %d (rank %d, bf16), key signatures "
              "%zu (2 bits) / %zu (4 bits) / %zu (8 bits)\n",
              2 * x.r, x.r, size_t(x.h) * SignatureRecordBytes(2, x.d),
              size_t(x.h) * SignatureRecordBytes(4, x.d), size_t(x.h) * SignatureRecordBytes(8, x.d));
  return 0;
}

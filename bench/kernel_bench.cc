// Kernel benchmarks: every kvshade op on one backend at one preset of shapes, each figure
// printed beside its physical floor on the H200 (4.23 TB/s HBM, 55 GB/s PCIe, 790 TFLOP/s
// bf16) and beside the baselines measured in the same run:
//   dense   : decode attention over the full bf16 KV cache resident on the GPU
//   fetch-all: select-and-reconstruct with no temporal cache (every selected chunk missed
//             each step), the Quest-style offload pattern minus its K transfer
//
// Usage: kvshade_kernel_bench [--backend cpu|cuda|auto] [--preset small|full] [--reps N]
//                             [--only SUBSTRING] [--tokens N] [--rank R] [--outliers O]
//                             [--codec bf16|int4]  (overrides of the preset)
//                             [--shared-host auto|file]  (host-visible memory made shareable,
//                             as a daemon that exports its state allocates its value store)
//   full  : n = 131072 tokens, h=8, g=4, d=128, r=160, C=8, k=256, batch 1/8/24 (H200)
//   small : n = 16384, batch 1/4 (CPU, `make demo`)
// Timing: warm-up call, then `reps` timed calls, each followed by Synchronize; the median
// is printed. Host-side launch and validation cost is included (it is part of the API).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvshade/kernels/backend.h"
#include "kvshade/kernels/codec.h"
#include "kvshade/kernels/reference.h"
#include "kvshade/kernels/shadow_layer.h"
#include "kvshade/version.h"

namespace kvshade::kernels {
namespace {

constexpr double kHbmBytesPerS = 4.23e12;
constexpr double kPcieBytesPerS = 55e9;
constexpr double kBf16FlopPerS = 790e12;

struct Options {
  std::string backend = "auto";
  std::string preset = "";
  int reps = 20;
  std::string only;
  // Overrides of the preset, e.g. to put the compress row beside a service run's shapes.
  int tokens = 0, rank = 0, outliers = -1;
  std::string codec = "bf16";  // the compress row's value codec: bf16 or int4
  std::string shared_host;     // "", auto or file: Backend::EnableSharedMemory first
};

struct Cost {
  double hbm_bytes = 0;   // device-memory bytes the op must move at least
  double pcie_bytes = 0;  // host<->device bytes
  double flops = 0;
  double FloorMs() const {
    return 1e3 * std::max({hbm_bytes / kHbmBytesPerS, pcie_bytes / kPcieBytesPerS,
                           flops / kBf16FlopPerS});
  }
};

void Die(const absl::Status& st, const char* what) {
  if (!st.ok()) {
    std::fprintf(stderr, "kernel_bench: %s: %s\n", what, std::string(st.message()).c_str());
    std::exit(1);
  }
}
#define CHECK_OK(expr) Die((expr), #expr)

template <typename T>
T Value(absl::StatusOr<T> v, const char* what) {
  Die(v.status(), what);
  return std::move(v).value();
}

class Bench {
 public:
  Bench(Backend& be, const Options& opt) : be_(be), opt_(opt), rng_(20261129) {}

  Buffer Alloc(size_t bytes) { return Value(be_.Allocate(bytes), "Allocate"); }
  Buffer AllocHost(size_t bytes) {
    return Value(be_.AllocateHostVisible(bytes), "AllocateHostVisible");
  }

  // Uploads n random bf16 values N(0, stddev).
  Buffer RandomBf16(size_t n, float stddev = 1.0f) {
    std::normal_distribution<float> dist(0.0f, stddev);
    std::vector<bf16> host(n);
    for (auto& x : host) x = FloatToBf16(dist(rng_));
    Buffer b = Alloc(n * sizeof(bf16));
    CHECK_OK(be_.CopyFromHost(b.data(), host.data(), n * sizeof(bf16)));
    return b;
  }
  template <typename T>
  Buffer Upload(const std::vector<T>& host) {
    Buffer b = Alloc(std::max<size_t>(1, host.size() * sizeof(T)));
    CHECK_OK(be_.CopyFromHost(b.data(), host.data(), host.size() * sizeof(T)));
    return b;
  }

  bool Wanted(const std::string& name) const {
    return opt_.only.empty() || name.find(opt_.only) != std::string::npos;
  }

  // Times fn (which must enqueue work and return OK) and prints one row.
  void Run(const std::string& name, const std::string& shape, const Cost& cost,
           const std::function<absl::Status()>& fn, const std::string& note = "") {
    if (!Wanted(name)) return;
    CHECK_OK(fn());
    CHECK_OK(be_.Synchronize());
    std::vector<double> ms;
    for (int i = 0; i < opt_.reps; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      absl::Status st = fn();
      Die(st, name.c_str());
      CHECK_OK(be_.Synchronize());
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                       .count());
    }
    std::nth_element(ms.begin(), ms.begin() + ms.size() / 2, ms.end());
    double med = ms[ms.size() / 2];
    double floor = cost.FloorMs();
    std::printf("%-28s %-34s %10.3f %10.1f %10.1f %10.2f %10.3f %8.1fx  %s\n", name.c_str(),
                shape.c_str(), med, cost.hbm_bytes / 1e6, cost.pcie_bytes / 1e6, cost.flops / 1e9,
                floor, floor > 0 ? med / floor : 0.0, note.c_str());
    std::fflush(stdout);
  }

  Backend& be_;
  const Options& opt_;
  std::mt19937_64 rng_;
};

struct Preset {
  int n, h, g, d, r, C, k;
  std::vector<int> batches;
};

void RunAll(Backend& be, const Options& opt, const Preset& p) {
  Bench bench(be, opt);
  const LayerShape shape{p.h, p.g, p.d};
  const int n = p.n, D = shape.D(), C = p.C, k = p.k, r = p.r;
  const int n_chunks = (n - 32) / C;
  char shp[128];

  std::printf("# backend=%s preset n=%d h=%d g=%d d=%d r=%d C=%d k=%d reps=%d%s%s\n",
              std::string(be.name()).c_str(), n, p.h, p.g, p.d, r, C, k, opt.reps,
              opt.shared_host.empty() ? "" : " shared-host=", opt.shared_host.c_str());
  std::printf("# floors are the H200's: max(HBM bytes / 4.23 TB/s, PCIe bytes / 55 GB/s, "
              "FLOPs / 790 TFLOP/s)\n");
  std::printf("%-28s %-34s %10s %10s %10s %10s %10s %9s\n", "op", "shape", "median_ms", "HBM_MB",
              "PCIe_MB", "GFLOP", "floor_ms", "x_floor");

  // --- Ingest: factorization of one layer ---------------------------------------------
  Buffer k_pre = bench.RandomBf16(size_t(n) * D);
  {
    FactorizeOptions fo;
    fo.rank = r;
    Buffer a = bench.Alloc(size_t(n) * r * 2), b = bench.Alloc(size_t(p.h) * r * p.d * 2);
    Buffer ws = bench.Alloc(be.FactorizeWorkspaceBytes(n, shape, fo));
    std::vector<float> eig(D);
    Cost c;
    c.hbm_bytes = 2.0 * n * D * 2 + 2.0 * n * r;  // K read twice (Gram, A), A written
    c.flops = 2.0 * n * D * D + 2.0 * n * D * r;
    std::snprintf(shp, sizeof shp, "n=%d D=%d r=%d", n, D, r);
    bench.Run("factorize", shp, c, [&]() -> absl::Status {
      return be.Factorize(k_pre.span<const bf16>(), n, shape, fo, a.span<bf16>(), b.span<bf16>(),
                          absl::MakeSpan(eig), ws.workspace())
          .status();
    }, "eigensolver time is not in the floor");
    // The service's default: top-r eigenpairs by 4 steps of subspace iteration, on the
    // device and (host_subspace_min_tokens reached) on the host.
    for (int host_from : {0, n}) {
      FactorizeOptions fs = fo;
      fs.subspace_iterations = 4;
      fs.host_subspace_min_tokens = host_from;
      Buffer ws4 = bench.Alloc(be.FactorizeWorkspaceBytes(n, shape, fs));
      bench.Run(host_from == 0 ? "factorize subspace q=4" : "factorize subspace q=4, host", shp, c,
                [&]() -> absl::Status {
                  return be.Factorize(k_pre.span<const bf16>(), n, shape, fs, a.span<bf16>(),
                                      b.span<bf16>(), absl::MakeSpan(eig), ws4.workspace())
                      .status();
                }, "eigensolver time is not in the floor");
    }
    Buffer a2 = bench.Alloc(size_t(n) * r * 2);
    Buffer pws = bench.Alloc(be.ProjectWorkspaceBytes(n, shape, r));
    Cost pc;
    pc.hbm_bytes = 2.0 * n * D + 2.0 * n * r;
    pc.flops = 2.0 * n * D * r;
    bench.Run("project_keys", shp, pc, [&]() -> absl::Status {
      return be.ProjectKeys(k_pre.span<const bf16>(), n, shape, b.span<const bf16>(), r,
                            a2.span<bf16>(), pws.workspace())
          .status();
    });
  }

  // --- Ingest: RoPE, landmarks, outliers ------------------------------------------------
  {
    std::vector<int64_t> pos(n);
    std::iota(pos.begin(), pos.end(), 0);
    Buffer positions = bench.Upload(pos);
    RopeSpec rope;
    rope.theta = 500000.0f;
    Buffer kr = bench.RandomBf16(size_t(n) * D);
    Cost c;
    c.hbm_bytes = 2.0 * n * D * 2;
    std::snprintf(shp, sizeof shp, "n=%d h=%d d=%d", n, p.h, p.d);
    bench.Run("rope", shp, c, [&]() -> absl::Status {
      return be.ApplyRope(rope, positions.span<const int64_t>(), p.h, p.d, kr.span<bf16>());
    });
    Buffer lm = bench.Alloc(size_t(n_chunks) * D * 2);
    Buffer mincos = bench.Alloc(size_t(p.h) * n_chunks * 4);
    Cost lc;
    lc.hbm_bytes = 2.0 * n_chunks * C * D + 2.0 * n_chunks * D + 4.0 * p.h * n_chunks;
    bench.Run("landmarks", shp, lc, [&]() -> absl::Status {
      return be.BuildLandmarks(kr.span<const bf16>(), n, p.h, p.d, C, n_chunks, lm.span<bf16>(),
                               mincos.span<float>());
    });
    const int outliers = 48;
    Buffer out = bench.Alloc(size_t(p.h) * outliers * 4);
    Buffer tws = bench.Alloc(std::max<size_t>(1, be.TopKWorkspaceBytes(p.h, n_chunks, outliers)));
    Cost tc;
    tc.hbm_bytes = 4.0 * p.h * n_chunks;
    std::snprintf(shp, sizeof shp, "rows=%d cols=%d k=%d", p.h, n_chunks, outliers);
    bench.Run("outliers_topk", shp, tc, [&]() -> absl::Status {
      return be.TopK(mincos.span<const float>(), {}, p.h, n_chunks, outliers, false,
                     out.span<int32_t>(), tws.workspace());
    });
  }
  k_pre = Buffer();

  // --- Value codecs ------------------------------------------------------------------------
  const int m_dec = std::max(1, int(0.4 * k)) * p.h;  // 40% misses of one session-layer
  for (ValueCodec codec : {ValueCodec::kBF16, ValueCodec::kFP8, ValueCodec::kINT4,
                           ValueCodec::kINT2}) {
    ValueCodecSpec spec{codec, kDefaultKiviGroup};
    size_t cb = Value(ValueChunkBytes(spec, C, p.d), "ValueChunkBytes");
    Buffer vals = bench.RandomBf16(size_t(m_dec) * C * p.d);
    Buffer enc = bench.Alloc(size_t(m_dec) * cb);
    // Encode m_dec chunks viewed as one head of n = m_dec*C tokens.
    CHECK_OK(be.EncodeValueChunks(vals.span<const bf16>(), m_dec * C, 1, p.d, C, m_dec, spec,
                                  enc.span<std::byte>()));
    Buffer dec = bench.Alloc(size_t(m_dec) * C * p.d * 2);
    Cost c;
    c.hbm_bytes = double(m_dec) * (cb + 2.0 * C * p.d);
    std::snprintf(shp, sizeof shp, "chunks=%d C=%d d=%d", m_dec, C, p.d);
    bench.Run(std::string("decode_values_") + std::string(ValueCodecName(codec)), shp, c,
              [&]() -> absl::Status {
                return be.DecodeValueChunks(enc.span<const std::byte>(), m_dec, C, p.d, spec,
                                            dec.span<bf16>());
              });
  }

  // --- Decode: select, reconstruct, attend, per batch -------------------------------------
  // One session's layer state; every item of a batch gets its own landmarks (so that the
  // bytes really move) but shares A, B and the value store (their traffic is per miss).
  Buffer a = bench.RandomBf16(size_t(n_chunks) * C * r, 0.5f);
  Buffer b = bench.RandomBf16(size_t(p.h) * r * p.d, 0.08f);
  const ValueCodecSpec vspec{ValueCodec::kBF16, kDefaultKiviGroup};
  const size_t vchunk = Value(ValueChunkBytes(vspec, C, p.d), "ValueChunkBytes");
  Buffer values = bench.AllocHost(size_t(p.h) * n_chunks * vchunk);
  {
    std::vector<uint8_t> fill(values.bytes());
    for (size_t i = 0; i < fill.size(); ++i) fill[i] = uint8_t((i * 2654435761u) >> 24) & 0x3f;
    std::memcpy(values.data(), fill.data(), fill.size());
  }
  RopeSpec rope;
  rope.theta = 500000.0f;

  // --- Ingest: one whole layer as the service compresses it ---------------------------
  // CompressShadowLayer at the service's defaults (rank r, subspace q=4, 48 outliers, sink,
  // local 32): factorize, RoPE, landmarks, outliers, static set, tail, and the values
  // encoded into host-visible memory (the value store's block). Floor: K and V read once,
  // A written, values over PCIe.
  {
    const ValueCodecSpec cspec{opt.codec == "int4" ? ValueCodec::kINT4 : ValueCodec::kBF16,
                               kDefaultKiviGroup};
    const size_t cchunk = Value(ValueChunkBytes(cspec, C, p.d), "ValueChunkBytes");
    Buffer k_in = bench.RandomBf16(size_t(n) * D), v_in = bench.RandomBf16(size_t(n) * D);
    Buffer vals_host = bench.AllocHost(size_t(p.h) * ((n - 32) / C) * cchunk);
    ShadowParams sp;
    sp.C = C;
    sp.rank = r;
    sp.subspace_iterations = 4;
    sp.codec = cspec;
    if (opt.outliers >= 0) sp.outliers = opt.outliers;
    Cost c;
    c.hbm_bytes = 2.0 * n * D * 2 + 2.0 * n * r;
    c.pcie_bytes = double(p.h) * ((n - 32) / C) * cchunk;
    c.flops = 2.0 * n * D * D + 2.0 * n * D * r;
    std::snprintf(shp, sizeof shp, "n=%d D=%d r=%d %d outliers %s values", n, D, r, sp.outliers,
                  opt.codec.c_str());
    bench.Run("compress_shadow_layer", shp, c, [&]() -> absl::Status {
      return CompressShadowLayer(be, shape, rope, sp, k_in.span<const bf16>(),
                                 v_in.span<const bf16>(), n, 0, nullptr, {}, nullptr,
                                 vals_host.span<std::byte>())
          .status();
    }, "eigensolver time is not in the floor");
  }

  for (int batch : p.batches) {
    std::vector<Buffer> landmarks, queries, slots, selected, miss_slot, miss_chunk, miss_count;
    std::vector<Buffer> keys_out, vals_out, outs;
    std::vector<SelectItem> sel(batch);
    std::vector<ReconstructItem> rec(batch), rec_all(batch);
    std::vector<Buffer> all_chunks, all_counts;
    for (int i = 0; i < batch; ++i) {
      landmarks.push_back(bench.RandomBf16(size_t(n_chunks) * D));
      queries.push_back(bench.RandomBf16(size_t(shape.query_heads()) * p.d));
      slots.push_back(bench.Upload(std::vector<int32_t>(size_t(p.h) * k, -1)));
      selected.push_back(bench.Alloc(size_t(p.h) * k * 4));
      miss_slot.push_back(bench.Alloc(size_t(p.h) * k * 4));
      miss_chunk.push_back(bench.Alloc(size_t(p.h) * k * 4));
      miss_count.push_back(bench.Alloc(size_t(p.h) * 4));
      keys_out.push_back(bench.Alloc(size_t(p.h) * k * C * p.d * 2));
      vals_out.push_back(bench.Alloc(size_t(p.h) * k * C * p.d * 2));
      SessionLayerView v;
      v.n_segments = 1;
      v.b = b.span<const bf16>().data();
      v.r = r;
      SegmentView& s = v.segments[0];
      s.n_chunks = n_chunks;
      s.first_position = 0;
      s.landmarks = landmarks.back().span<const bf16>().data();
      s.a = a.span<const bf16>().data();
      s.values = static_cast<const std::byte*>(values.data());
      s.value_head_stride = int64_t(n_chunks) * vchunk;
      s.value_chunk_stride = vchunk;
      sel[i] = SelectItem{v,
                          queries.back().span<const bf16>().data(),
                          slots.back().span<int32_t>().data(),
                          selected.back().span<int32_t>().data(),
                          miss_slot.back().span<int32_t>().data(),
                          miss_chunk.back().span<int32_t>().data(),
                          miss_count.back().span<int32_t>().data()};
      // 40% misses per head: distinct random chunks.
      const int misses = int(0.4 * k);
      std::vector<int32_t> mc(size_t(p.h) * k, -1), cnt(p.h, misses), all(size_t(p.h) * k);
      std::vector<int32_t> cnt_all(p.h, k);
      for (int hh = 0; hh < p.h; ++hh) {
        std::vector<int32_t> perm(n_chunks);
        std::iota(perm.begin(), perm.end(), 0);
        for (int j = 0; j < k; ++j) {
          std::swap(perm[j], perm[j + bench.rng_() % (n_chunks - j)]);
          all[size_t(hh) * k + j] = perm[j];
          if (j < misses) mc[size_t(hh) * k + j] = perm[j];
        }
      }
      all_chunks.push_back(bench.Upload(mc));
      all_counts.push_back(bench.Upload(cnt));
      rec[i] = ReconstructItem{v, all_chunks.back().span<const int32_t>().data(),
                               all_counts.back().span<const int32_t>().data(),
                               keys_out.back().span<bf16>().data(),
                               vals_out.back().span<bf16>().data()};
      all_chunks.push_back(bench.Upload(all));
      all_counts.push_back(bench.Upload(cnt_all));
      rec_all[i] = ReconstructItem{v, all_chunks.back().span<const int32_t>().data(),
                                   all_counts.back().span<const int32_t>().data(),
                                   keys_out.back().span<bf16>().data(),
                                   vals_out.back().span<bf16>().data()};
    }
    Buffer sws = bench.Alloc(std::max<size_t>(1, be.SelectWorkspaceBytes(shape, k, sel)));
    Cost sc;
    sc.hbm_bytes = double(batch) * (2.0 * n_chunks * D + 4.0 * 4 * p.h * k);
    std::snprintf(shp, sizeof shp, "batch=%d n=%d k=%d", batch, n, k);
    bench.Run("select_b" + std::to_string(batch), shp, sc, [&]() -> absl::Status {
      return be.Select(shape, k, sel, sws.workspace());
    });

    const double misses = double(batch) * p.h * int(0.4 * k);
    Buffer rws = bench.Alloc(std::max<size_t>(1, be.ReconstructWorkspaceBytes(shape, k, rec)));
    Cost rc;
    rc.hbm_bytes = misses * C * (2.0 * r + 2.0 * 2 * p.d);  // A rows read, K and V written
    rc.pcie_bytes = misses * vchunk;
    rc.flops = misses * C * 2.0 * r * p.d;
    std::snprintf(shp, sizeof shp, "batch=%d misses=40%% of k=%d", batch, k);
    bench.Run("reconstruct_b" + std::to_string(batch), shp, rc, [&]() -> absl::Status {
      return be.Reconstruct(shape, C, k, rope, vspec, rec, rws.workspace());
    }, "bf16 values from host-visible memory");

    Cost sr;
    sr.hbm_bytes = sc.hbm_bytes + rc.hbm_bytes;
    sr.pcie_bytes = rc.pcie_bytes;
    sr.flops = rc.flops;
    bench.Run("select+reconstruct_b" + std::to_string(batch), shp, sr, [&]() -> absl::Status {
      absl::Status st = be.Select(shape, k, sel, sws.workspace());
      if (!st.ok()) return st;
      return be.Reconstruct(shape, C, k, rope, vspec, rec, rws.workspace());
    }, "select then 40% misses (fixed miss lists)");

    Cost fa;
    const double all_misses = double(batch) * p.h * k;
    fa.hbm_bytes = sc.hbm_bytes + all_misses * C * (2.0 * r + 4.0 * p.d);
    fa.pcie_bytes = all_misses * vchunk;
    fa.flops = all_misses * C * 2.0 * r * p.d;
    bench.Run("baseline_fetch_all_b" + std::to_string(batch), shp, fa, [&]() -> absl::Status {
      absl::Status st = be.Select(shape, k, sel, sws.workspace());
      if (!st.ok()) return st;
      return be.Reconstruct(shape, C, k, rope, vspec, rec_all, rws.workspace());
    }, "no temporal cache: every selected chunk moved");

    // Decode attention over [static 49 chunks; k slots; 32-token tail] vs dense over all n.
    const int n_static = 49 * C, n_slots = k * C, n_tail = 32;
    Buffer st_k = bench.RandomBf16(size_t(p.h) * n_static * p.d);
    Buffer st_v = bench.RandomBf16(size_t(p.h) * n_static * p.d);
    Buffer tail_k = bench.RandomBf16(size_t(n_tail) * D);
    Buffer tail_v = bench.RandomBf16(size_t(n_tail) * D);
    Buffer full_k = bench.RandomBf16(size_t(n) * D);
    Buffer full_v = bench.RandomBf16(size_t(n) * D);
    std::vector<AttendItem> sparse(batch), dense(batch);
    for (int i = 0; i < batch; ++i) {
      outs.push_back(bench.Alloc(size_t(shape.query_heads()) * p.d * 4));
      AttendItem& it = sparse[i];
      it.q = queries[i].span<const bf16>().data();
      it.out = outs.back().span<float>().data();
      it.n_blocks = 3;
      it.blocks[0] = KvBlock{st_k.span<const bf16>().data(), st_v.span<const bf16>().data(),
                             n_static, nullptr, int64_t(n_static) * p.d, p.d};
      it.blocks[1] = KvBlock{keys_out[i].span<const bf16>().data(),
                             vals_out[i].span<const bf16>().data(), n_slots, nullptr,
                             int64_t(n_slots) * p.d, p.d};
      it.blocks[2] = KvBlock{tail_k.span<const bf16>().data(), tail_v.span<const bf16>().data(),
                             n_tail, nullptr, p.d, D};
      AttendItem& dn = dense[i];
      dn.q = it.q;
      dn.out = it.out;
      dn.n_blocks = 1;
      dn.blocks[0] = KvBlock{full_k.span<const bf16>().data(), full_v.span<const bf16>().data(),
                             n, nullptr, p.d, D};
    }
    const float scale = 1.0f / std::sqrt(float(p.d));
    Buffer aws = bench.Alloc(std::max<size_t>(1, be.AttendWorkspaceBytes(shape, sparse)));
    Cost ac;
    ac.hbm_bytes = double(batch) * (n_static + n_slots + n_tail) * D * 2 * 2;
    ac.flops = double(batch) * (n_static + n_slots + n_tail) * shape.query_heads() * p.d * 4;
    std::snprintf(shp, sizeof shp, "batch=%d tokens=%d", batch, n_static + n_slots + n_tail);
    bench.Run("attend_sparse_b" + std::to_string(batch), shp, ac, [&]() -> absl::Status {
      return be.Attend(shape, scale, sparse, aws.workspace());
    });
    Buffer dws = bench.Alloc(std::max<size_t>(1, be.AttendWorkspaceBytes(shape, dense)));
    Cost dc;
    dc.hbm_bytes = double(batch) * n * D * 2 * 2;
    dc.flops = double(batch) * n * shape.query_heads() * p.d * 4;
    std::snprintf(shp, sizeof shp, "batch=%d tokens=%d", batch, n);
    bench.Run("baseline_dense_attend_b" + std::to_string(batch), shp, dc, [&]() -> absl::Status {
      return be.Attend(shape, scale, dense, dws.workspace());
    }, "full bf16 KV resident (items share one cache)");
  }

  // Memory: GPU bytes per token per layer (docs/ALGORITHM.md T6) for this shape.
  const double shadow = 2.0 * r + 2.0 * D / C, full = 4.0 * D;
  std::printf("# GPU bytes/token/layer: shadow %.0f (2r + 2D/C, plus the static set) vs full "
              "bf16 K+V %.0f: %.2fx smaller\n", shadow, full, full / shadow);
}

}  // namespace
}  // namespace kvshade::kernels

int main(int argc, char** argv) {
  using namespace kvshade::kernels;
  Options opt;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "missing value after %s\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--version") {
      std::printf("%s\n", kvshade::VersionLine("kvshade_kernel_bench").c_str());
      return 0;
    }
    if (a == "--backend") opt.backend = next();
    else if (a == "--preset") opt.preset = next();
    else if (a == "--reps") opt.reps = std::max(1, std::atoi(next().c_str()));
    else if (a == "--only") opt.only = next();
    else if (a == "--tokens") opt.tokens = std::atoi(next().c_str());
    else if (a == "--rank") opt.rank = std::atoi(next().c_str());
    else if (a == "--outliers") opt.outliers = std::atoi(next().c_str());
    else if (a == "--codec") opt.codec = next();
    else if (a == "--shared-host") opt.shared_host = next();
    else {
      std::fprintf(stderr,
                   "usage: %s [--backend cpu|cuda|auto] [--preset small|full] [--reps N] "
                   "[--only SUBSTRING] [--tokens N] [--rank R] [--outliers O] [--codec bf16|int4] "
                   "[--shared-host auto|file]\n",
                   argv[0]);
      return 2;
    }
  }
  auto be = CreateBackend(opt.backend);
  if (!be.ok()) {
    std::fprintf(stderr, "kernel_bench: %s\n", std::string(be.status().message()).c_str());
    return 1;
  }
  if (opt.shared_host == "auto") (*be)->EnableSharedMemory(SharedHostMemory::kAuto);
  else if (opt.shared_host == "file") (*be)->EnableSharedMemory(SharedHostMemory::kFile);
  else if (!opt.shared_host.empty()) {
    std::fprintf(stderr, "unknown --shared-host %s (auto or file)\n", opt.shared_host.c_str());
    return 2;
  }
  if (opt.preset.empty()) opt.preset = (*be)->space() == MemorySpace::kDevice ? "full" : "small";
  Preset p;
  if (opt.preset == "full") p = Preset{131072, 8, 4, 128, 160, 8, 256, {1, 8, 24}};
  else if (opt.preset == "small") p = Preset{16384, 8, 4, 128, 160, 8, 256, {1, 4}};
  else {
    std::fprintf(stderr, "unknown preset %s\n", opt.preset.c_str());
    return 2;
  }
  if (opt.tokens > 0) p.n = opt.tokens;
  if (opt.rank > 0) p.r = opt.rank;
  if (opt.codec != "bf16" && opt.codec != "int4") {
    std::fprintf(stderr, "unknown codec %s (bf16 or int4)\n", opt.codec.c_str());
    return 2;
  }
  RunAll(**be, opt, p);
  return 0;
}

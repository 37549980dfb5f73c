// CUDA vs CPU parity of the decode-path ops, on fresh random inputs (seed logged):
//   - value codecs (bf16, fp8, int4, int2) and KIVI on both axes: encodings bit-identical
//     (fp8: codes and scale), decodes bit-identical;
//   - Select at h=8, g=4, d=128, 16384 chunks in 2 segments, k=256, batch 1 and 8, with
//     excluded chunks and a slot table holding hits, strangers, -1 and a duplicate:
//     selected ids identical except where two ids' scores tie within fp32 rounding (checked
//     against double-precision reference scores: at each rank the CPU's and the GPU's ids
//     must score within 2e-5 relative), slot tables and miss lists identical for heads with
//     identical selections, and the temporal-cache invariants (T3) on every GPU head;
//     the T3 vector itself and a -1 padding case on the GPU;
//   - Reconstruct at ~40% misses for every codec: keys within 2 bf16 ulps at the value's
//     magnitude (magnitudes floored at 1e-3 of the keys' RMS), values bit-identical, rows
//     past miss_count untouched; the same with slot-addressed output (miss_slot, random
//     distinct slots, C = 8 and a C whose chunks straddle key tiles, d = 128 and 64), rows
//     no miss names untouched, and misses with out-of-range slots skipped on the GPU;
//   - Attend against the CPU (max error relative to the largest output < 1e-3);
//   - CopyRows (slot-buffer delivery): bit-identical to the CPU, rows not listed untouched.
// Each op prints one "[decode parity]" line with its error next to its tolerance.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvshade/kernels/backend.h"
#include "test_util.h"

namespace kvshade::kernels {
namespace decode_gpu_test {
namespace {

using testing::Cpu;
using testing::Download;
using testing::MakeRng;
using testing::RandomBf16;
using testing::Scratch;
using testing::Upload;

uint16_t Bits(bf16 x) { return x.bits; }

// One unit in the last place of bf16 at |x|'s magnitude.
double Bf16Ulp(double x) {
  x = std::fabs(x);
  if (x < 1e-30) x = 1e-30;
  return std::ldexp(1.0, std::ilogb(x) - 7);
}

Buffer HostVisibleCopy(Backend& be, const std::vector<std::byte>& bytes) {
  auto buf = be.AllocateHostVisible(std::max<size_t>(bytes.size(), 1));
  EXPECT_TRUE(buf.ok()) << buf.status();
  if (!bytes.empty()) std::memcpy(buf->data(), bytes.data(), bytes.size());
  return std::move(buf).value();
}

// ---------------------------------------------------------------------------------------
// Codecs

TEST(DecodeGpuTest, ValueCodecsBitIdentical) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(11);
  const int h = 4, d = 128, C = 8, n_chunks = 50, n = n_chunks * C + 13;
  std::vector<bf16> v = RandomBf16(size_t(n) * h * d, rng, 1.5f);
  // Edge cases: a constant KIVI group (scale 0), a group whose minimum is a signed zero
  // pair, and one all-zero chunk (fp8 scale 0).
  for (int c = 0; c < 16; ++c) v[c] = FloatToBf16(0.75f);
  for (int c = 16; c < 32; ++c) v[size_t(1) * h * d + d + c] = bf16{uint16_t(c % 2 ? 0x8000 : 0)};
  for (int t = 0; t < C; ++t) {
    for (int c = 0; c < d; ++c) v[(size_t(3 * C + t) * h + 2) * d + c] = bf16{0};
  }
  Buffer v_gpu = Upload(*gpu, v);

  struct Spec {
    ValueCodec codec;
    int group;
  };
  const Spec specs[] = {{ValueCodec::kBF16, 16}, {ValueCodec::kFP8, 16},  {ValueCodec::kINT4, 16},
                        {ValueCodec::kINT4, 32}, {ValueCodec::kINT2, 16}, {ValueCodec::kINT2, 32}};
  for (const Spec& s : specs) {
    ValueCodecSpec spec{s.codec, s.group};
    const std::string name = absl::StrCat(std::string(ValueCodecName(s.codec)), "/G", s.group);
    auto chunk_bytes = ValueChunkBytes(spec, C, d);
    ASSERT_TRUE(chunk_bytes.ok());
    const size_t bytes = size_t(h) * n_chunks * *chunk_bytes;

    std::vector<std::byte> enc_cpu(bytes);
    ASSERT_TRUE(
        cpu->EncodeValueChunks(v, n, h, d, C, n_chunks, spec, absl::MakeSpan(enc_cpu)).ok());
    Buffer enc_gpu = Scratch<std::byte>(*gpu, bytes);
    ASSERT_TRUE(gpu->EncodeValueChunks(
                       absl::MakeConstSpan(static_cast<const bf16*>(v_gpu.data()), v.size()), n, h,
                       d, C, n_chunks, spec,
                       absl::MakeSpan(static_cast<std::byte*>(enc_gpu.data()), bytes))
                    .ok());
    std::vector<std::byte> enc = Download<std::byte>(*gpu, enc_gpu.data(), bytes);
    size_t byte_diff = 0, scale_diff = 0;
    for (size_t i = 0; i < bytes; ++i) byte_diff += enc[i] != enc_cpu[i];
    if (s.codec == ValueCodec::kFP8) {
      for (size_t ch = 0; ch < size_t(h) * n_chunks; ++ch) {
        scale_diff += std::memcmp(&enc[ch * *chunk_bytes], &enc_cpu[ch * *chunk_bytes], 4) != 0;
      }
    }
    EXPECT_EQ(byte_diff, 0u) << name;
    EXPECT_EQ(scale_diff, 0u) << name;

    // Decode the CPU's encoding on both.
    const int m = h * n_chunks;
    std::vector<bf16> dec_cpu(size_t(m) * C * d);
    ASSERT_TRUE(cpu->DecodeValueChunks(enc_cpu, m, C, d, spec, absl::MakeSpan(dec_cpu)).ok());
    Buffer enc_in = Upload(*gpu, enc_cpu);
    Buffer dec_gpu = Scratch<bf16>(*gpu, dec_cpu.size());
    ASSERT_TRUE(gpu->DecodeValueChunks(
                       absl::MakeConstSpan(static_cast<const std::byte*>(enc_in.data()), bytes), m,
                       C, d, spec,
                       absl::MakeSpan(static_cast<bf16*>(dec_gpu.data()), dec_cpu.size()))
                    .ok());
    std::vector<bf16> dec = Download<bf16>(*gpu, dec_gpu.data(), dec_cpu.size());
    size_t dec_diff = 0;
    for (size_t i = 0; i < dec.size(); ++i) dec_diff += Bits(dec[i]) != Bits(dec_cpu[i]);
    EXPECT_EQ(dec_diff, 0u) << name;
    std::printf(
        "[decode parity] codec %-8s encode: %zu/%zu bytes differ%s, decode: %zu/%zu "
        "elements differ (tolerance: exact)\n",
        name.c_str(), byte_diff, bytes,
        s.codec == ValueCodec::kFP8 ? absl::StrCat(" (", scale_diff, " scales)").c_str() : "",
        dec_diff, dec.size());
  }
}

TEST(DecodeGpuTest, KiviBothAxesBitIdentical) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(12);
  const int rows = 64, cols = 96;
  std::vector<bf16> x = RandomBf16(size_t(rows) * cols, rng, 2.0f);
  for (int c = 0; c < 32; ++c) x[c] = FloatToBf16(-1.25f);                   // constant row run
  for (int r = 0; r < 32; ++r) x[size_t(r) * cols + 5] = FloatToBf16(3.0f);  // constant column run
  Buffer x_gpu = Upload(*gpu, x);
  for (KiviAxis axis : {KiviAxis::kPerToken, KiviAxis::kPerChannel}) {
    for (int bits : {2, 4}) {
      for (int group : {16, 32}) {
        KiviLayout l;
        l.rows = rows;
        l.cols = cols;
        l.bits = bits;
        l.group = group;
        l.axis = axis;
        const std::string name = absl::StrCat(axis == KiviAxis::kPerToken ? "token" : "channel",
                                              "/int", bits, "/G", group);
        std::vector<uint32_t> codes(l.code_words());
        std::vector<fp16> scale(l.n_groups()), mn(l.n_groups());
        ASSERT_TRUE(cpu->KiviQuantize(x, l, absl::MakeSpan(codes), absl::MakeSpan(scale),
                                      absl::MakeSpan(mn))
                        .ok());
        Buffer c_gpu = Scratch<uint32_t>(*gpu, codes.size());
        Buffer s_gpu = Scratch<fp16>(*gpu, scale.size());
        Buffer m_gpu = Scratch<fp16>(*gpu, mn.size());
        ASSERT_TRUE(
            gpu->KiviQuantize(absl::MakeConstSpan(static_cast<const bf16*>(x_gpu.data()), x.size()),
                              l, absl::MakeSpan(static_cast<uint32_t*>(c_gpu.data()), codes.size()),
                              absl::MakeSpan(static_cast<fp16*>(s_gpu.data()), scale.size()),
                              absl::MakeSpan(static_cast<fp16*>(m_gpu.data()), mn.size()))
                .ok());
        auto codes_g = Download<uint32_t>(*gpu, c_gpu.data(), codes.size());
        auto scale_g = Download<fp16>(*gpu, s_gpu.data(), scale.size());
        auto mn_g = Download<fp16>(*gpu, m_gpu.data(), mn.size());
        size_t diff = 0;
        for (size_t i = 0; i < codes.size(); ++i) diff += codes[i] != codes_g[i];
        for (size_t i = 0; i < scale.size(); ++i) {
          diff += scale[i].bits != scale_g[i].bits;
          diff += mn[i].bits != mn_g[i].bits;
        }
        EXPECT_EQ(diff, 0u) << name;

        std::vector<bf16> y(x.size());
        ASSERT_TRUE(cpu->KiviDequantize(codes, scale, mn, l, absl::MakeSpan(y)).ok());
        Buffer ci = Upload(*gpu, codes), si = Upload(*gpu, scale), mi = Upload(*gpu, mn);
        Buffer y_gpu = Scratch<bf16>(*gpu, y.size());
        ASSERT_TRUE(
            gpu->KiviDequantize(
                   absl::MakeConstSpan(static_cast<const uint32_t*>(ci.data()), codes.size()),
                   absl::MakeConstSpan(static_cast<const fp16*>(si.data()), scale.size()),
                   absl::MakeConstSpan(static_cast<const fp16*>(mi.data()), mn.size()), l,
                   absl::MakeSpan(static_cast<bf16*>(y_gpu.data()), y.size()))
                .ok());
        auto y_g = Download<bf16>(*gpu, y_gpu.data(), y.size());
        size_t ydiff = 0;
        for (size_t i = 0; i < y.size(); ++i) ydiff += y[i].bits != y_g[i].bits;
        EXPECT_EQ(ydiff, 0u) << name;
        std::printf(
            "[decode parity] kivi %-18s quantize: %zu differences, dequantize: %zu/%zu "
            "differ (tolerance: exact)\n",
            name.c_str(), diff, ydiff, y.size());
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Select

struct SelectSegment {
  int n_chunks = 0;
  std::vector<bf16> landmarks;    // [n_chunks, h, d]
  std::vector<uint8_t> excluded;  // [h, n_chunks]
};

struct SelectInput {
  std::vector<SelectSegment> segments;
  std::vector<bf16> q;         // [h*g, d]
  std::vector<int32_t> slots;  // [h, k]
  int total() const {
    int t = 0;
    for (const auto& s : segments) t += s.n_chunks;
    return t;
  }
  // Head hh may select chunk c: in range and not excluded.
  bool Selectable(int hh, int c) const {
    if (c < 0) return false;
    for (const auto& s : segments) {
      if (c < s.n_chunks) return s.excluded[size_t(hh) * s.n_chunks + c] == 0;
      c -= s.n_chunks;
    }
    return false;
  }
};

struct SelectResult {
  std::vector<int32_t> slots, selected, miss_slot, miss_chunk, miss_count;
};

// Runs Select for a batch on `be`, with every input copied into its memory.
std::vector<SelectResult> RunSelect(Backend& be, const LayerShape& shape, int k,
                                    const std::vector<SelectInput>& in) {
  const int h = shape.h;
  std::vector<Buffer> keep;
  std::vector<SelectItem> items(in.size());
  std::vector<const void*> outs;
  Buffer basis = Scratch<bf16>(be, 64);
  for (size_t i = 0; i < in.size(); ++i) {
    SelectItem& it = items[i];
    it.view.n_segments = int(in[i].segments.size());
    it.view.b = static_cast<const bf16*>(basis.data());
    it.view.r = 8;
    for (size_t s = 0; s < in[i].segments.size(); ++s) {
      const SelectSegment& seg = in[i].segments[s];
      SegmentView& v = it.view.segments[s];
      v.n_chunks = seg.n_chunks;
      v.first_position = 0;
      keep.push_back(Upload(be, seg.landmarks));
      v.landmarks = static_cast<const bf16*>(keep.back().data());
      keep.push_back(Upload(be, seg.excluded));
      v.excluded = static_cast<const uint8_t*>(keep.back().data());
    }
    keep.push_back(Upload(be, in[i].q));
    it.q = static_cast<const bf16*>(keep.back().data());
    keep.push_back(Upload(be, in[i].slots));
    it.slots = static_cast<int32_t*>(keep.back().data());
    keep.push_back(Scratch<int32_t>(be, size_t(h) * k));
    it.selected = static_cast<int32_t*>(keep.back().data());
    keep.push_back(Scratch<int32_t>(be, size_t(h) * k));
    it.miss_slot = static_cast<int32_t*>(keep.back().data());
    keep.push_back(Scratch<int32_t>(be, size_t(h) * k));
    it.miss_chunk = static_cast<int32_t*>(keep.back().data());
    keep.push_back(Scratch<int32_t>(be, size_t(h)));
    it.miss_count = static_cast<int32_t*>(keep.back().data());
  }
  auto ws = be.Allocate(std::max<size_t>(be.SelectWorkspaceBytes(shape, k, items), 1));
  EXPECT_TRUE(ws.ok()) << ws.status();
  absl::Status st = be.Select(shape, k, items, ws->workspace());
  EXPECT_TRUE(st.ok()) << st;
  std::vector<SelectResult> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    const size_t hk = size_t(h) * k;
    out[i].slots = Download<int32_t>(be, items[i].slots, hk);
    out[i].selected = Download<int32_t>(be, items[i].selected, hk);
    out[i].miss_slot = Download<int32_t>(be, items[i].miss_slot, hk);
    out[i].miss_chunk = Download<int32_t>(be, items[i].miss_chunk, hk);
    out[i].miss_count = Download<int32_t>(be, items[i].miss_count, size_t(h));
  }
  return out;
}

// Double-precision reference scores of one head: NaN for excluded chunks.
std::vector<double> ReferenceScores(const LayerShape& shape, const SelectInput& in, int hh) {
  const int h = shape.h, g = shape.g, d = shape.d, total = in.total();
  std::vector<double> s(total, -INFINITY), x(total);
  std::vector<char> ex(total, 0);
  std::vector<const bf16*> rows(total);
  int base = 0;
  for (const auto& seg : in.segments) {
    for (int j = 0; j < seg.n_chunks; ++j) {
      ex[base + j] = seg.excluded[size_t(hh) * seg.n_chunks + j] != 0;
      rows[base + j] = seg.landmarks.data() + (size_t(j) * h + hh) * d;
    }
    base += seg.n_chunks;
  }
  for (int qi = 0; qi < g; ++qi) {
    const bf16* q = in.q.data() + size_t(hh * g + qi) * d;
    double mx = -INFINITY;
    for (int c = 0; c < total; ++c) {
      if (ex[c]) continue;
      double dot = 0;
      for (int e = 0; e < d; ++e) dot += double(Bf16ToFloat(q[e])) * Bf16ToFloat(rows[c][e]);
      x[c] = dot / std::sqrt(double(d));
      mx = std::max(mx, x[c]);
    }
    double sum = 0;
    for (int c = 0; c < total; ++c) {
      if (!ex[c]) sum += std::exp(x[c] - mx);
    }
    for (int c = 0; c < total; ++c) {
      if (!ex[c]) s[c] = std::max(s[c], std::exp(x[c] - mx) / sum);
    }
  }
  for (int c = 0; c < total; ++c) {
    if (ex[c]) s[c] = NAN;
  }
  return s;
}

// Checks the temporal-cache invariants of one head's step; "" when they hold.
std::string CheckSlotDiff(const int32_t* old_slots, const int32_t* slots, const int32_t* selected,
                          const int32_t* miss_slot, const int32_t* miss_chunk, int miss_count,
                          int k, const std::function<bool(int)>& selectable) {
  std::set<int> sel;
  for (int i = 0; i < k; ++i) {
    if (selected[i] >= 0 && !sel.insert(selected[i]).second) return "duplicate selected id";
  }
  std::set<int> old_set(old_slots, old_slots + k);
  std::vector<int> misses;
  for (int c : sel) {
    if (!old_set.count(c)) misses.push_back(c);  // ascending
  }
  if (miss_count != int(misses.size())) {
    return absl::StrCat("miss_count ", miss_count, " != ", misses.size());
  }
  std::set<int> seen;
  std::vector<int> free_slots;
  for (int s = 0; s < k; ++s) {
    const bool hit = old_slots[s] >= 0 && sel.count(old_slots[s]) && !seen.count(old_slots[s]);
    if (hit) {
      seen.insert(old_slots[s]);
      if (slots[s] != old_slots[s]) return absl::StrCat("hit in slot ", s, " moved");
    } else {
      free_slots.push_back(s);
    }
  }
  for (int j = 0; j < miss_count; ++j) {
    if (miss_chunk[j] != misses[j]) return absl::StrCat("miss_chunk[", j, "] wrong");
    if (miss_slot[j] != free_slots[j]) return absl::StrCat("miss_slot[", j, "] wrong");
    if (slots[miss_slot[j]] != miss_chunk[j]) return absl::StrCat("slot of miss ", j, " wrong");
  }
  // A free slot no miss took keeps a selectable chunk that was not selected; else -1.
  for (size_t j = misses.size(); j < free_slots.size(); ++j) {
    const int was = old_slots[free_slots[j]];
    const int want = selectable(was) && !sel.count(was) ? was : -1;
    if (slots[free_slots[j]] != want) {
      return absl::StrCat("unused free slot ", free_slots[j], " holds ", slots[free_slots[j]],
                          ", want ", want);
    }
  }
  std::multiset<int> now(slots, slots + k);
  for (int c : sel) {
    if (now.count(c) != 1) return absl::StrCat("chunk ", c, " not in exactly one slot");
  }
  return "";
}

std::vector<SelectInput> MakeSelectInputs(const LayerShape& shape, int k, int batch,
                                          std::mt19937_64& rng) {
  const int h = shape.h, d = shape.d;
  const int seg_chunks[2] = {10000, 6384};  // 16384 chunks = 131072 tokens
  std::vector<SelectInput> in(batch);
  std::uniform_real_distribution<float> u01(0.0f, 1.0f);
  for (auto& it : in) {
    for (int n : seg_chunks) {
      SelectSegment seg;
      seg.n_chunks = n;
      seg.landmarks = RandomBf16(size_t(n) * h * d, rng, 1.0f);
      seg.excluded.assign(size_t(h) * n, 0);
      for (auto& e : seg.excluded) e = u01(rng) < 0.03f ? 1 : 0;
      it.segments.push_back(std::move(seg));
    }
    for (int hh = 0; hh < h; ++hh) it.segments[0].excluded[size_t(hh) * seg_chunks[0]] = 1;  // sink
    it.q = RandomBf16(size_t(h) * shape.g * d, rng, 1.0f);
    it.slots.assign(size_t(h) * k, -1);
  }
  return in;
}

void SelectParity(int batch) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(20 + batch);
  LayerShape shape;  // h=8, g=4, d=128
  const int h = shape.h, k = 256;
  std::vector<SelectInput> in = MakeSelectInputs(shape, k, batch, rng);

  // A previous step's table: most of the current top-k (hits) at shuffled positions, some
  // strangers (evicted), some -1, and one duplicated hit.
  {
    std::vector<SelectResult> prev = RunSelect(*cpu, shape, k, in);
    for (int i = 0; i < batch; ++i) {
      const int total = in[i].total();
      for (int hh = 0; hh < h; ++hh) {
        int32_t* row = in[i].slots.data() + size_t(hh) * k;
        const int32_t* sel = prev[i].selected.data() + size_t(hh) * k;
        std::set<int> used(sel, sel + k);
        std::uniform_int_distribution<int> any(0, total - 1);
        for (int s = 0; s < k; ++s) {
          const float u = std::uniform_real_distribution<float>(0, 1)(rng);
          if (u < 0.6f) {
            row[s] = sel[s];
          } else if (u < 0.9f) {
            int c;
            do c = any(rng);
            while (used.count(c));
            used.insert(c);
            row[s] = c;
          } else {
            row[s] = -1;
          }
        }
        row[k - 1] = row[0];  // duplicate: only the first occurrence may hit
        std::shuffle(row, row + k, rng);
      }
    }
  }

  std::vector<SelectResult> rc = RunSelect(*cpu, shape, k, in);
  std::vector<SelectResult> rg = RunSelect(*gpu, shape, k, in);

  int heads_equal = 0, id_diffs = 0, tables_equal = 0, t3_failures = 0;
  double worst_gap = 0;  // relative score gap at a rank where the ids differ
  for (int i = 0; i < batch; ++i) {
    for (int hh = 0; hh < h; ++hh) {
      const size_t o = size_t(hh) * k;
      const int32_t* sc = rc[i].selected.data() + o;
      const int32_t* sg = rg[i].selected.data() + o;
      std::string t3 = CheckSlotDiff(in[i].slots.data() + o, rg[i].slots.data() + o, sg,
                                     rg[i].miss_slot.data() + o, rg[i].miss_chunk.data() + o,
                                     rg[i].miss_count[hh], k,
                                     [&](int c) { return in[i].Selectable(hh, c); });
      EXPECT_EQ(t3, "") << "item " << i << " head " << hh;
      t3_failures += !t3.empty();
      if (std::equal(sc, sc + k, sg)) {
        ++heads_equal;
        auto row_eq = [&](const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
          return std::equal(a.begin() + o, a.begin() + o + k, b.begin() + o);
        };
        const bool same = row_eq(rc[i].slots, rg[i].slots) &&
                          row_eq(rc[i].miss_slot, rg[i].miss_slot) &&
                          row_eq(rc[i].miss_chunk, rg[i].miss_chunk) &&
                          rc[i].miss_count[hh] == rg[i].miss_count[hh];
        EXPECT_TRUE(same) << "item " << i << " head " << hh << ": same selection, different diff";
        tables_equal += same;
        continue;
      }
      // Differences must be ties: at each rank, the two ids' reference scores agree.
      std::vector<double> s = ReferenceScores(shape, in[i], hh);
      for (int r = 0; r < k; ++r) {
        if (sc[r] == sg[r]) continue;
        ++id_diffs;
        ASSERT_TRUE(sc[r] >= 0 && sg[r] >= 0) << "padding differs at rank " << r;
        const double a = s[sc[r]], b = s[sg[r]];
        const double gap = std::fabs(a - b) / std::max(std::fabs(a), 1e-30);
        worst_gap = std::max(worst_gap, gap);
        EXPECT_LE(gap, 2e-5) << "item " << i << " head " << hh << " rank " << r << ": cpu id "
                             << sc[r] << " (" << a << ") vs gpu id " << sg[r] << " (" << b << ")";
      }
    }
  }
  std::printf(
      "[decode parity] select batch %d (h=8 g=4 d=128, 16384 chunks, k=256): %d/%d heads "
      "identical, %d ranks differ (worst tie gap %.2e, tolerance 2e-5), slot diffs "
      "identical %d/%d, T3 invariant failures %d\n",
      batch, heads_equal, batch * h, id_diffs, worst_gap, tables_equal, heads_equal, t3_failures);
}

TEST(DecodeGpuTest, SelectBatch1) { SelectParity(1); }
TEST(DecodeGpuTest, SelectBatch8) { SelectParity(8); }

// docs/ALGORITHM.md T3 on the GPU: slots [10, 20, 30, 40], top-k {40, 5, 20, 7}; then an
// all-hit step; and a head with fewer selectable chunks than k.
TEST(DecodeGpuTest, SelectT3OnGpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  LayerShape shape;
  shape.h = 1;
  shape.g = 1;
  shape.d = 16;
  const int k = 4, n = 64;
  auto rng = MakeRng(30);
  SelectInput in;
  SelectSegment seg;
  seg.n_chunks = n;
  seg.landmarks = RandomBf16(size_t(n) * 16, rng, 0.25f);
  seg.excluded.assign(n, 0);
  const int top[4] = {40, 5, 20, 7};
  for (int i = 0; i < 4; ++i) seg.landmarks[size_t(top[i]) * 16] = FloatToBf16(8.0f - 2.0f * i);
  for (int c = 0; c < n; ++c) {
    bool is_top = std::count(top, top + 4, c) > 0;
    if (!is_top) seg.landmarks[size_t(c) * 16] = FloatToBf16(0.5f);
  }
  in.segments.push_back(seg);
  in.q.assign(16, bf16{0});
  in.q[0] = FloatToBf16(4.0f);
  in.slots = {10, 20, 30, 40};
  std::vector<SelectInput> batch = {in};
  SelectResult r = RunSelect(*gpu, shape, k, batch)[0];
  EXPECT_EQ(r.selected, (std::vector<int32_t>{40, 5, 20, 7}));
  EXPECT_EQ(r.slots, (std::vector<int32_t>{5, 20, 7, 40}));
  EXPECT_EQ(r.miss_count[0], 2);
  EXPECT_EQ(r.miss_slot, (std::vector<int32_t>{0, 2, -1, -1}));
  EXPECT_EQ(r.miss_chunk, (std::vector<int32_t>{5, 7, -1, -1}));
  batch[0].slots = r.slots;  // next step, same query: every chunk hits
  SelectResult r2 = RunSelect(*gpu, shape, k, batch)[0];
  EXPECT_EQ(r2.miss_count[0], 0);
  EXPECT_EQ(r2.slots, r.slots);

  // Two selectable chunks (1 and 5) for k = 4; slot 3 holds chunk 1 (a hit).
  SelectInput few;
  SelectSegment s2;
  s2.n_chunks = 8;
  s2.landmarks = RandomBf16(size_t(8) * 16, rng, 1.0f);
  s2.excluded = {1, 0, 1, 1, 1, 0, 1, 1};
  few.segments.push_back(s2);
  few.q = RandomBf16(16, rng, 1.0f);
  few.slots = {3, -1, 7, 1};
  std::vector<SelectInput> fb = {few};
  SelectResult g3 = RunSelect(*gpu, shape, k, fb)[0];
  SelectResult c3 = RunSelect(*cpu, shape, k, fb)[0];
  EXPECT_EQ(g3.slots, (std::vector<int32_t>{5, -1, -1, 1}));
  EXPECT_EQ(g3.miss_count[0], 1);
  EXPECT_EQ(g3.miss_slot[0], 0);
  EXPECT_EQ(g3.miss_chunk[0], 5);
  EXPECT_EQ(g3.selected[2], -1);
  EXPECT_EQ(g3.selected[3], -1);
  EXPECT_EQ(g3.selected, c3.selected);
  EXPECT_EQ(g3.slots, c3.slots);
  EXPECT_EQ(g3.miss_slot, c3.miss_slot);
  EXPECT_EQ(g3.miss_chunk, c3.miss_chunk);
  std::printf(
      "[decode parity] select T3 on GPU: selected {%d,%d,%d,%d}, slots {%d,%d,%d,%d}, "
      "misses %d then %d (expected {40,5,20,7}, {5,20,7,40}, 2 then 0)\n",
      r.selected[0], r.selected[1], r.selected[2], r.selected[3], r.slots[0], r.slots[1],
      r.slots[2], r.slots[3], r.miss_count[0], r2.miss_count[0]);
}

// ---------------------------------------------------------------------------------------
// Reconstruct

struct ReconSegment {
  int n_chunks = 0;
  int64_t first_position = 0;
  std::vector<bf16> a;            // [n_chunks*C, r]
  std::vector<std::byte> values;  // encoded store with the strides below
  int64_t head_stride = 0, chunk_stride = 0;
};

struct ReconInput {
  std::vector<ReconSegment> segments;
  std::vector<bf16> b;              // [h, r, d]
  std::vector<int32_t> miss_chunk;  // [h, k]
  std::vector<int32_t> miss_count;  // [h]
  std::vector<int32_t> miss_slot;   // [h, k], or empty for compact output
  int total() const {
    int t = 0;
    for (const auto& s : segments) t += s.n_chunks;
    return t;
  }
};

struct ReconOut {
  std::vector<bf16> keys, values;
};

// unit: ReconstructItem::unit of every item (rows of T = unit tokens when 0 < unit < C).
std::vector<ReconOut> RunReconstruct(Backend& be, const LayerShape& shape, int C, int k, int r,
                                     const RopeSpec& rope, const ValueCodecSpec& codec,
                                     const std::vector<ReconInput>& in, int unit = 0) {
  const int tokens = unit > 0 && unit < C ? unit : C;
  const size_t rows = size_t(shape.h) * k * tokens * shape.d;
  std::vector<Buffer> keep;
  std::vector<ReconstructItem> items(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ReconstructItem& it = items[i];
    it.unit = unit;
    it.view.n_segments = int(in[i].segments.size());
    it.view.r = r;
    keep.push_back(Upload(be, in[i].b));
    it.view.b = static_cast<const bf16*>(keep.back().data());
    for (size_t s = 0; s < in[i].segments.size(); ++s) {
      const ReconSegment& seg = in[i].segments[s];
      SegmentView& v = it.view.segments[s];
      v.n_chunks = seg.n_chunks;
      v.first_position = seg.first_position;
      keep.push_back(Upload(be, seg.a));
      v.a = static_cast<const bf16*>(keep.back().data());
      keep.push_back(HostVisibleCopy(be, seg.values));
      v.values = static_cast<const std::byte*>(keep.back().data());
      v.value_head_stride = seg.head_stride;
      v.value_chunk_stride = seg.chunk_stride;
    }
    keep.push_back(Upload(be, in[i].miss_chunk));
    it.miss_chunk = static_cast<const int32_t*>(keep.back().data());
    keep.push_back(Upload(be, in[i].miss_count));
    it.miss_count = static_cast<const int32_t*>(keep.back().data());
    if (!in[i].miss_slot.empty()) {
      keep.push_back(Upload(be, in[i].miss_slot));
      it.miss_slot = static_cast<const int32_t*>(keep.back().data());
    }
    keep.push_back(Scratch<bf16>(be, rows));
    it.keys = static_cast<bf16*>(keep.back().data());
    keep.push_back(Scratch<bf16>(be, rows));
    it.values = static_cast<bf16*>(keep.back().data());
  }
  auto ws = be.Allocate(std::max<size_t>(be.ReconstructWorkspaceBytes(shape, k, items), 1));
  EXPECT_TRUE(ws.ok()) << ws.status();
  absl::Status st = be.Reconstruct(shape, C, k, rope, codec, items, ws->workspace());
  EXPECT_TRUE(st.ok()) << st;
  std::vector<ReconOut> out(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    out[i].keys = Download<bf16>(be, items[i].keys, rows);
    out[i].values = Download<bf16>(be, items[i].values, rows);
  }
  return out;
}

// Encodes random values of one segment with the CPU backend and lays them out with the
// given extra bytes per chunk and per head (so that chunk starts are unaligned).
void FillValues(Backend& cpu, const LayerShape& shape, int C, const ValueCodecSpec& codec,
                int pad_chunk, int pad_head, std::mt19937_64& rng, ReconSegment& seg) {
  const int h = shape.h, d = shape.d, n = seg.n_chunks;
  std::vector<bf16> v = RandomBf16(size_t(n) * C * h * d, rng, 1.0f);
  const size_t cb = *ValueChunkBytes(codec, C, d);
  std::vector<std::byte> dense(size_t(h) * n * cb);
  ASSERT_TRUE(cpu.EncodeValueChunks(v, n * C, h, d, C, n, codec, absl::MakeSpan(dense)).ok());
  seg.chunk_stride = int64_t(cb) + pad_chunk;
  seg.head_stride = seg.chunk_stride * n + pad_head;
  seg.values.assign(size_t(seg.head_stride) * h, std::byte{0x5a});
  for (int hh = 0; hh < h; ++hh) {
    for (int j = 0; j < n; ++j) {
      std::memcpy(&seg.values[size_t(hh) * seg.head_stride + size_t(j) * seg.chunk_stride],
                  &dense[(size_t(hh) * n + j) * cb], cb);
    }
  }
}

TEST(DecodeGpuTest, ReconstructParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(40);
  LayerShape shape;  // h=8, g=4, d=128
  const int h = shape.h, d = shape.d, C = 8, k = 256, r = 160;
  const int seg_chunks[2] = {1500, 700};

  struct Case {
    ValueCodecSpec codec;
    RopeSpec rope;
    std::string name;
  };
  RopeSpec llama3;
  llama3.theta = 500000.0f;
  llama3.scaling = RopeScaling::kLlama3;
  llama3.factor = 8.0f;
  llama3.pairing = RopePairing::kInterleaved;
  const Case cases[] = {
      {{ValueCodec::kBF16, 16}, RopeSpec{}, "bf16"},
      {{ValueCodec::kFP8, 16}, RopeSpec{}, "fp8"},
      {{ValueCodec::kINT4, 32}, RopeSpec{}, "int4"},
      {{ValueCodec::kINT2, 16}, RopeSpec{}, "int2"},
      {{ValueCodec::kBF16, 16}, llama3, "bf16+llama3/interleaved"},
  };
  for (const Case& cs : cases) {
    std::vector<ReconInput> in(2);
    for (size_t i = 0; i < in.size(); ++i) {
      ReconInput& it = in[i];
      int64_t pos = 0;
      for (int s = 0; s < 2; ++s) {
        ReconSegment seg;
        seg.n_chunks = seg_chunks[s];
        seg.first_position = pos;
        pos += int64_t(seg.n_chunks) * C + 40 + 1000 * int64_t(i);  // gaps between segments
        seg.a = RandomBf16(size_t(seg.n_chunks) * C * r, rng, 1.0f);
        FillValues(*cpu, shape, C, cs.codec, s == 1 ? 4 : 0, s == 1 ? 12 : 0, rng, seg);
        it.segments.push_back(std::move(seg));
      }
      it.b = RandomBf16(size_t(h) * r * d, rng, 1.0f / std::sqrt(float(r)));
      it.miss_chunk.assign(size_t(h) * k, -1);
      it.miss_count.assign(h, 0);
      const int total = it.total();
      for (int hh = 0; hh < h; ++hh) {
        // ~40% misses; one head with none and one with all k.
        int count = 90 + int(rng() % 25);
        if (hh == 1) count = 0;
        if (hh == 2) count = k;
        std::set<int> ids;
        while (int(ids.size()) < count) ids.insert(int(rng() % total));
        int j = 0;
        for (int c : ids) it.miss_chunk[size_t(hh) * k + j++] = c;
        it.miss_count[hh] = count;
      }
    }
    std::vector<ReconOut> oc = RunReconstruct(*cpu, shape, C, k, r, cs.rope, cs.codec, in);
    std::vector<ReconOut> og = RunReconstruct(*gpu, shape, C, k, r, cs.rope, cs.codec, in);

    double worst_ulps = 0, num = 0, den = 0;
    size_t key_fail = 0, value_diff = 0, untouched_bad = 0, checked = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      double ss = 0;
      size_t cnt = 0;
      for (int hh = 0; hh < h; ++hh) {
        for (size_t e = 0; e < size_t(in[i].miss_count[hh]) * C * d; ++e) {
          const double x = Bf16ToFloat(oc[i].keys[size_t(hh) * k * C * d + e]);
          ss += x * x;
          ++cnt;
        }
      }
      const double floor_mag = 1e-3 * std::sqrt(ss / std::max<size_t>(cnt, 1));
      for (int hh = 0; hh < h; ++hh) {
        const size_t row0 = size_t(hh) * k * C * d;
        const size_t valid = size_t(in[i].miss_count[hh]) * C * d;
        for (size_t e = 0; e < size_t(k) * C * d; ++e) {
          const bf16 kg = og[i].keys[row0 + e], vg = og[i].values[row0 + e];
          if (e >= valid) {
            untouched_bad += kg.bits != 0xFFFF || vg.bits != 0xFFFF;
            continue;
          }
          const double a = Bf16ToFloat(kg), b = Bf16ToFloat(oc[i].keys[row0 + e]);
          const double ulps =
              std::fabs(a - b) / Bf16Ulp(std::max({std::fabs(a), std::fabs(b), floor_mag}));
          worst_ulps = std::max(worst_ulps, ulps);
          key_fail += ulps > 2.0;
          num += (a - b) * (a - b);
          den += b * b;
          value_diff += vg.bits != oc[i].values[row0 + e].bits;
          ++checked;
        }
      }
    }
    EXPECT_EQ(key_fail, 0u) << cs.name;
    EXPECT_EQ(value_diff, 0u) << cs.name;
    EXPECT_EQ(untouched_bad, 0u) << cs.name;
    std::printf(
        "[decode parity] reconstruct %-24s keys: max %.2f bf16 ulp (tolerance 2), rel "
        "Frobenius %.2e, %zu over; values: %zu/%zu differ (tolerance: exact); rows past "
        "miss_count touched: %zu\n",
        cs.name.c_str(), worst_ulps, den > 0 ? std::sqrt(num / den) : 0.0, key_fail, value_diff,
        checked, untouched_bad);
  }
}

TEST(DecodeGpuTest, ReconstructSlotParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(41);
  const int k = 256, r = 160;
  const int seg_chunks[2] = {900, 400};

  struct Case {
    LayerShape shape;
    int C;
    ValueCodecSpec codec;
    RopeSpec rope;
    std::string name;
  };
  RopeSpec llama3;
  llama3.theta = 500000.0f;
  llama3.scaling = RopeScaling::kLlama3;
  llama3.factor = 8.0f;
  llama3.pairing = RopePairing::kInterleaved;
  const Case cases[] = {
      {LayerShape{8, 4, 128}, 8, {ValueCodec::kBF16, 16}, RopeSpec{}, "bf16/C8"},
      {LayerShape{8, 4, 128}, 8, {ValueCodec::kINT4, 32}, RopeSpec{}, "int4/C8"},
      // 64-token key tiles hold 2 2/3 chunks of 24: tiles start mid-chunk.
      {LayerShape{8, 4, 128}, 24, {ValueCodec::kBF16, 16}, llama3, "bf16/C24+llama3"},
      {LayerShape{4, 4, 64}, 8, {ValueCodec::kFP8, 16}, RopeSpec{}, "fp8/C8/d64"},
  };
  for (const Case& cs : cases) {
    const int h = cs.shape.h, d = cs.shape.d, C = cs.C;
    const size_t row_elems = size_t(C) * d;
    std::vector<ReconInput> in(2);
    for (size_t i = 0; i < in.size(); ++i) {
      ReconInput& it = in[i];
      int64_t pos = 0;
      for (int s = 0; s < 2; ++s) {
        ReconSegment seg;
        seg.n_chunks = seg_chunks[s];
        seg.first_position = pos;
        pos += int64_t(seg.n_chunks) * C + 40 + 1000 * int64_t(i);
        seg.a = RandomBf16(size_t(seg.n_chunks) * C * r, rng, 1.0f);
        FillValues(*cpu, cs.shape, C, cs.codec, s == 1 ? 4 : 0, s == 1 ? 12 : 0, rng, seg);
        it.segments.push_back(std::move(seg));
      }
      it.b = RandomBf16(size_t(h) * r * d, rng, 1.0f / std::sqrt(float(r)));
      it.miss_chunk.assign(size_t(h) * k, -1);
      it.miss_slot.assign(size_t(h) * k, -1);
      it.miss_count.assign(h, 0);
      const int total = it.total();
      for (int hh = 0; hh < h; ++hh) {
        // ~40% misses; one head with none and one with all k; slots a random permutation.
        int count = 90 + int(rng() % 25);
        if (hh == 1) count = 0;
        if (hh == 2) count = k;
        std::set<int> ids;
        while (int(ids.size()) < count) ids.insert(int(rng() % total));
        int j = 0;
        for (int c : ids) it.miss_chunk[size_t(hh) * k + j++] = c;
        it.miss_count[hh] = count;
        std::vector<int32_t> perm(k);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::copy(perm.begin(), perm.begin() + count, it.miss_slot.begin() + size_t(hh) * k);
      }
    }
    std::vector<ReconOut> oc = RunReconstruct(*cpu, cs.shape, C, k, r, cs.rope, cs.codec, in);
    std::vector<ReconOut> og = RunReconstruct(*gpu, cs.shape, C, k, r, cs.rope, cs.codec, in);

    double worst_ulps = 0;
    size_t key_fail = 0, value_diff = 0, untouched_bad = 0, checked = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      double ss = 0;
      size_t cnt = 0;
      for (int hh = 0; hh < h; ++hh) {
        for (int j = 0; j < in[i].miss_count[hh]; ++j) {
          const size_t row = (size_t(hh) * k + in[i].miss_slot[size_t(hh) * k + j]) * row_elems;
          for (size_t e = 0; e < row_elems; ++e) {
            const double x = Bf16ToFloat(oc[i].keys[row + e]);
            ss += x * x;
            ++cnt;
          }
        }
      }
      const double floor_mag = 1e-3 * std::sqrt(ss / std::max<size_t>(cnt, 1));
      for (int hh = 0; hh < h; ++hh) {
        std::vector<bool> named(k, false);
        for (int j = 0; j < in[i].miss_count[hh]; ++j) {
          named[in[i].miss_slot[size_t(hh) * k + j]] = true;
        }
        for (int slot = 0; slot < k; ++slot) {
          const size_t row = (size_t(hh) * k + slot) * row_elems;
          for (size_t e = row; e < row + row_elems; ++e) {
            const bf16 kg = og[i].keys[e], vg = og[i].values[e];
            if (!named[slot]) {
              untouched_bad += kg.bits != 0xFFFF || vg.bits != 0xFFFF ||
                               oc[i].keys[e].bits != 0xFFFF || oc[i].values[e].bits != 0xFFFF;
              continue;
            }
            const double a = Bf16ToFloat(kg), b = Bf16ToFloat(oc[i].keys[e]);
            const double ulps =
                std::fabs(a - b) / Bf16Ulp(std::max({std::fabs(a), std::fabs(b), floor_mag}));
            worst_ulps = std::max(worst_ulps, ulps);
            key_fail += ulps > 2.0;
            value_diff += vg.bits != oc[i].values[e].bits;
            ++checked;
          }
        }
      }
    }
    EXPECT_EQ(key_fail, 0u) << cs.name;
    EXPECT_EQ(value_diff, 0u) << cs.name;
    EXPECT_EQ(untouched_bad, 0u) << cs.name;
    EXPECT_GT(checked, 0u) << cs.name;

    // Out-of-range slots on the GPU: those misses are skipped (their rows stay untouched),
    // every other row is bit-identical to the run above.
    std::vector<ReconInput> bad = std::move(in);
    const int32_t lost0 = bad[0].miss_slot[0], lost1 = bad[0].miss_slot[1];
    bad[0].miss_slot[0] = k;
    bad[0].miss_slot[1] = -1;
    std::vector<ReconOut> ob = RunReconstruct(*gpu, cs.shape, C, k, r, cs.rope, cs.codec, bad);
    size_t skip_bad = 0;
    for (size_t i = 0; i < bad.size(); ++i) {
      for (size_t e = 0; e < og[i].keys.size(); ++e) {
        const size_t row = e / row_elems;
        const bool lost = i == 0 && (row == size_t(lost0) || row == size_t(lost1));
        if (lost) {
          skip_bad += ob[i].keys[e].bits != 0xFFFF || ob[i].values[e].bits != 0xFFFF;
        } else {
          skip_bad += ob[i].keys[e].bits != og[i].keys[e].bits ||
                      ob[i].values[e].bits != og[i].values[e].bits;
        }
      }
    }
    EXPECT_EQ(skip_bad, 0u) << cs.name;
    std::printf(
        "[decode parity] reconstruct slots %-18s keys: max %.2f bf16 ulp (tolerance 2), %zu "
        "over; values: %zu/%zu differ (tolerance: exact); rows no miss names touched: %zu; "
        "out-of-range slots: %zu elements wrong (tolerance 0)\n",
        cs.name.c_str(), worst_ulps, key_fail, value_diff, checked, untouched_bad, skip_bad);
  }
}

// Selection units (ReconstructItem::unit = u < C): rows of u tokens, unit j being tokens
// [(j*u) % C, +u) of chunk (j*u) / C, against the CPU with the whole-chunk tolerances (keys
// within 2 bf16 ulps, values bit-identical) for every codec, compact rows and slot rows,
// units that straddle key tiles (C = 24, u = 3 and 8), rows no miss names untouched, and
// misses with out-of-range ids or slots skipped on the GPU.
TEST(DecodeGpuTest, ReconstructUnitParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(42);
  const int r = 64;
  const int seg_chunks[2] = {70, 45};
  struct Case {
    LayerShape shape;
    int C, u;
    ValueCodecSpec codec;
    RopeSpec rope;
    bool slots;
    std::string name;
  };
  RopeSpec llama3;
  llama3.theta = 500000.0f;
  llama3.scaling = RopeScaling::kLlama3;
  llama3.factor = 8.0f;
  llama3.pairing = RopePairing::kInterleaved;
  const Case cases[] = {
      {LayerShape{4, 4, 128}, 8, 1, {ValueCodec::kBF16, 16}, RopeSpec{}, true, "bf16/C8/u1"},
      {LayerShape{4, 4, 128}, 8, 2, {ValueCodec::kBF16, 16}, RopeSpec{}, false, "bf16/C8/u2"},
      {LayerShape{4, 4, 128}, 8, 4, {ValueCodec::kFP8, 16}, RopeSpec{}, true, "fp8/C8/u4"},
      {LayerShape{4, 4, 128}, 8, 1, {ValueCodec::kFP8, 16}, RopeSpec{}, false, "fp8/C8/u1"},
      {LayerShape{4, 4, 128}, 8, 2, {ValueCodec::kINT4, 32}, RopeSpec{}, true, "int4/C8/u2"},
      {LayerShape{4, 4, 64}, 8, 1, {ValueCodec::kINT4, 16}, RopeSpec{}, false, "int4/C8/u1/d64"},
      {LayerShape{4, 4, 128}, 8, 4, {ValueCodec::kINT2, 32}, RopeSpec{}, true, "int2/C8/u4"},
      {LayerShape{4, 4, 64}, 8, 1, {ValueCodec::kINT2, 16}, RopeSpec{}, true, "int2/C8/u1/d64"},
      {LayerShape{4, 4, 128}, 24, 3, {ValueCodec::kBF16, 16}, llama3, true, "bf16/C24/u3+llama3"},
      {LayerShape{4, 2, 96}, 24, 8, {ValueCodec::kINT4, 16}, llama3, false, "int4/C24/u8/d96"},
  };
  for (const Case& cs : cases) {
    const int h = cs.shape.h, d = cs.shape.d, C = cs.C, u = cs.u, per = C / u;
    const int k = 96;
    const size_t row_elems = size_t(u) * d;
    std::vector<ReconInput> in(2);
    for (size_t i = 0; i < in.size(); ++i) {
      ReconInput& it = in[i];
      int64_t pos = 3;
      for (int s = 0; s < 2; ++s) {
        ReconSegment seg;
        seg.n_chunks = seg_chunks[s];
        seg.first_position = pos;
        pos += int64_t(seg.n_chunks) * C + 40 + 1000 * int64_t(i);
        seg.a = RandomBf16(size_t(seg.n_chunks) * C * r, rng, 1.0f);
        FillValues(*cpu, cs.shape, C, cs.codec, s == 1 ? 4 : 0, s == 1 ? 12 : 0, rng, seg);
        it.segments.push_back(std::move(seg));
      }
      it.b = RandomBf16(size_t(h) * r * d, rng, 1.0f / std::sqrt(float(r)));
      it.miss_chunk.assign(size_t(h) * k, -1);
      it.miss_count.assign(h, 0);
      if (cs.slots) it.miss_slot.assign(size_t(h) * k, -1);
      const int units = it.total() * per;
      for (int hh = 0; hh < h; ++hh) {
        // Random distinct units, the last unit of the view among them on head 0; one head
        // with none and one with all k.
        int count = 40 + int(rng() % 30);
        if (hh == 1) count = 0;
        if (hh == 2) count = k;
        std::set<int> ids;
        if (hh == 0) ids.insert(units - 1);
        while (int(ids.size()) < count) ids.insert(int(rng() % units));
        int j = 0;
        for (int c : ids) it.miss_chunk[size_t(hh) * k + j++] = c;
        it.miss_count[hh] = count;
        if (cs.slots) {
          std::vector<int32_t> perm(k);
          std::iota(perm.begin(), perm.end(), 0);
          std::shuffle(perm.begin(), perm.end(), rng);
          std::copy(perm.begin(), perm.begin() + count, it.miss_slot.begin() + size_t(hh) * k);
        }
      }
    }
    // Both outputs start as 0xFFFF everywhere (Scratch), so untouched rows compare too.
    std::vector<ReconOut> oc = RunReconstruct(*cpu, cs.shape, C, k, r, cs.rope, cs.codec, in, u);
    std::vector<ReconOut> og = RunReconstruct(*gpu, cs.shape, C, k, r, cs.rope, cs.codec, in, u);
    double worst_ulps = 0;
    size_t key_fail = 0, value_diff = 0, untouched_bad = 0, checked = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      double ss = 0;
      for (const bf16 x : oc[i].keys) {
        if (x.bits != 0xFFFF) ss += double(Bf16ToFloat(x)) * Bf16ToFloat(x);
      }
      const double floor_mag = 1e-3 * std::sqrt(ss / double(oc[i].keys.size()));
      for (int hh = 0; hh < h; ++hh) {
        std::vector<bool> named(k, false);
        for (int j = 0; j < in[i].miss_count[hh]; ++j) {
          named[cs.slots ? in[i].miss_slot[size_t(hh) * k + j] : j] = true;
        }
        for (int row = 0; row < k; ++row) {
          const size_t at = (size_t(hh) * k + row) * row_elems;
          for (size_t e = at; e < at + row_elems; ++e) {
            const bf16 kg = og[i].keys[e], vg = og[i].values[e];
            if (!named[row]) {
              untouched_bad += kg.bits != 0xFFFF || vg.bits != 0xFFFF ||
                               oc[i].keys[e].bits != 0xFFFF || oc[i].values[e].bits != 0xFFFF;
              continue;
            }
            const double a = Bf16ToFloat(kg), b = Bf16ToFloat(oc[i].keys[e]);
            const double ulps =
                std::fabs(a - b) / Bf16Ulp(std::max({std::fabs(a), std::fabs(b), floor_mag}));
            worst_ulps = std::max(worst_ulps, ulps);
            key_fail += ulps > 2.0;
            value_diff += vg.bits != oc[i].values[e].bits;
            ++checked;
          }
        }
      }
    }
    EXPECT_EQ(key_fail, 0u) << cs.name;
    EXPECT_EQ(value_diff, 0u) << cs.name;
    EXPECT_EQ(untouched_bad, 0u) << cs.name;
    EXPECT_GT(checked, 0u) << cs.name;

    // Device-resident ids the GPU cannot check from the host: a unit id past the view and a
    // negative one are skipped (their rows stay untouched), the rest is as above.
    std::vector<ReconInput> bad = in;
    const int units0 = bad[0].total() * per;
    bad[0].miss_chunk[0] = units0;
    bad[0].miss_chunk[1] = -1;
    std::vector<ReconOut> ob = RunReconstruct(*gpu, cs.shape, C, k, r, cs.rope, cs.codec, bad, u);
    const size_t lost0 = cs.slots ? size_t(in[0].miss_slot[0]) : 0;
    const size_t lost1 = cs.slots ? size_t(in[0].miss_slot[1]) : 1;
    size_t skip_bad = 0;
    for (size_t i = 0; i < bad.size(); ++i) {
      for (size_t e = 0; e < og[i].keys.size(); ++e) {
        const size_t row = e / row_elems;
        const bool lost = i == 0 && (row == lost0 || row == lost1);
        if (lost) {
          skip_bad += ob[i].keys[e].bits != 0xFFFF || ob[i].values[e].bits != 0xFFFF;
        } else {
          skip_bad += ob[i].keys[e].bits != og[i].keys[e].bits ||
                      ob[i].values[e].bits != og[i].values[e].bits;
        }
      }
    }
    EXPECT_EQ(skip_bad, 0u) << cs.name;
    std::printf(
        "[decode parity] reconstruct units %-20s keys: max %.2f bf16 ulp (tolerance 2), %zu "
        "over; values: %zu/%zu differ (tolerance: exact); rows no miss names touched: %zu; "
        "out-of-range ids: %zu elements wrong (tolerance 0)\n",
        cs.name.c_str(), worst_ulps, key_fail, value_diff, checked, untouched_bad, skip_bad);
  }
}

// ---------------------------------------------------------------------------------------
// Attend

struct AttendBlockData {
  std::vector<bf16> k, v;
  int64_t len = 0, head_stride = 0, token_stride = 0;
  std::vector<int32_t> len_per_head;  // empty = none
};

struct AttendInput {
  std::vector<bf16> q;
  std::vector<AttendBlockData> blocks;
};

std::vector<std::vector<float>> RunAttend(Backend& be, const LayerShape& shape, float scale,
                                          const std::vector<AttendInput>& in) {
  std::vector<Buffer> keep;
  std::vector<AttendItem> items(in.size());
  const size_t out_n = size_t(shape.query_heads()) * shape.d;
  for (size_t i = 0; i < in.size(); ++i) {
    AttendItem& it = items[i];
    keep.push_back(Upload(be, in[i].q));
    it.q = static_cast<const bf16*>(keep.back().data());
    it.n_blocks = int(in[i].blocks.size());
    for (size_t b = 0; b < in[i].blocks.size(); ++b) {
      const AttendBlockData& bd = in[i].blocks[b];
      KvBlock& kb = it.blocks[b];
      keep.push_back(Upload(be, bd.k));
      kb.k = static_cast<const bf16*>(keep.back().data());
      keep.push_back(Upload(be, bd.v));
      kb.v = static_cast<const bf16*>(keep.back().data());
      kb.len = bd.len;
      kb.head_stride = bd.head_stride;
      kb.token_stride = bd.token_stride;
      if (!bd.len_per_head.empty()) {
        keep.push_back(Upload(be, bd.len_per_head));
        kb.len_per_head = static_cast<const int32_t*>(keep.back().data());
      }
    }
    keep.push_back(Scratch<float>(be, out_n + shape.query_heads()));
    it.out = static_cast<float*>(keep.back().data());
    it.lse = it.out + out_n;
  }
  auto ws = be.Allocate(std::max<size_t>(be.AttendWorkspaceBytes(shape, items), 1));
  EXPECT_TRUE(ws.ok()) << ws.status();
  absl::Status st = be.Attend(shape, scale, items, ws->workspace());
  EXPECT_TRUE(st.ok()) << st;
  // Each item's output rows, then its LSE [h*g] appended.
  std::vector<std::vector<float>> out;
  for (const AttendItem& it : items) out.push_back(Download<float>(be, it.out, out_n + shape.query_heads()));
  return out;
}

TEST(DecodeGpuTest, AttendParity) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(50);
  LayerShape shape;  // h=8, g=4, d=128
  const int h = shape.h, d = shape.d;
  std::vector<AttendInput> in(3);
  for (size_t i = 0; i < in.size(); ++i) {
    AttendInput& it = in[i];
    it.q = RandomBf16(size_t(shape.query_heads()) * d, rng, 1.0f);
    // Block 0: [h, cap, d] slots with a per-head length (one head empty).
    AttendBlockData b0;
    const int cap = 2048;
    b0.k = RandomBf16(size_t(h) * cap * d, rng, 1.0f);
    b0.v = RandomBf16(size_t(h) * cap * d, rng, 1.0f);
    b0.len = cap;
    b0.head_stride = int64_t(cap) * d;
    b0.token_stride = d;
    for (int hh = 0; hh < h; ++hh) b0.len_per_head.push_back(hh == 3 ? 0 : int(rng() % (cap + 1)));
    // Block 1: token-major [len, h, d].
    AttendBlockData b1;
    b1.len = 777 + int64_t(i) * 100;
    b1.k = RandomBf16(size_t(b1.len) * h * d, rng, 1.0f);
    b1.v = RandomBf16(size_t(b1.len) * h * d, rng, 1.0f);
    b1.head_stride = d;
    b1.token_stride = int64_t(h) * d;
    // Block 2: an odd token stride (unaligned rows), 37 tokens.
    AttendBlockData b2;
    b2.len = 37;
    b2.token_stride = d + 3;
    b2.head_stride = b2.len * b2.token_stride;
    b2.k = RandomBf16(size_t(h) * b2.head_stride, rng, 1.0f);
    b2.v = RandomBf16(size_t(h) * b2.head_stride, rng, 1.0f);
    it.blocks = {b0, b1, b2};
    if (i == 2) {
      // Block 3: len 0 with per-head lengths (known only on the device for CUDA).
      AttendBlockData b3;
      const int cap3 = 150;
      b3.k = RandomBf16(size_t(h) * cap3 * d, rng, 1.0f);
      b3.v = RandomBf16(size_t(h) * cap3 * d, rng, 1.0f);
      b3.len = 0;
      b3.head_stride = int64_t(cap3) * d;
      b3.token_stride = d;
      for (int hh = 0; hh < h; ++hh) b3.len_per_head.push_back(int(rng() % (cap3 + 1)));
      it.blocks.push_back(b3);
    }
  }
  const float scale = 1.0f / std::sqrt(float(d));
  auto oc = RunAttend(*cpu, shape, scale, in);
  auto og = RunAttend(*gpu, shape, scale, in);
  double worst = 0, num = 0, den = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    double mx = 0, err = 0;
    const size_t out_n = size_t(shape.query_heads()) * d;
    for (size_t e = 0; e < out_n; ++e) {
      mx = std::max(mx, double(std::fabs(oc[i][e])));
      err = std::max(err, double(std::fabs(oc[i][e] - og[i][e])));
      num += double(oc[i][e] - og[i][e]) * (oc[i][e] - og[i][e]);
      den += double(oc[i][e]) * oc[i][e];
    }
    const double rel = err / std::max(mx, 1e-30);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-3) << "item " << i;
    // LSE [h*g] after the rows: fp32 sums in another order, values of order 10: 1e-3.
    for (int qh = 0; qh < shape.query_heads(); ++qh) {
      EXPECT_NEAR(og[i][out_n + qh], oc[i][out_n + qh], 1e-3) << "item " << i << " lse of head " << qh;
    }
    for (int qh = 3 * shape.g; qh < 4 * shape.g && i < 2; ++qh) {
      // head 3 has block 0 empty but still attends blocks 1 and 2: not all zero
      double n2 = 0;
      for (int c = 0; c < d; ++c) n2 += std::fabs(og[i][size_t(qh) * d + c]);
      EXPECT_GT(n2, 0.0);
    }
  }
  std::printf(
      "[decode parity] attend (h=8 g=4 d=128, 3 items, 3-4 blocks incl. per-head lengths "
      "and unaligned rows): max error / max |out| %.2e (tolerance 1e-3), rel Frobenius "
      "%.2e\n",
      worst, den > 0 ? std::sqrt(num / den) : 0.0);
}

// ---------------------------------------------------------------------------------------
// Delivery

TEST(DecodeGpuTest, CopyRowsMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(29);
  const size_t row = size_t(8) * 128;  // bf16 elements: C = 8, d = 128
  const int src_n = 24 * 8 * 64, dst_n = 32 * 8 * 256, n = 3000;
  std::vector<bf16> src = RandomBf16(size_t(src_n) * row, rng, 1.0f);
  std::vector<bf16> dst = RandomBf16(size_t(dst_n) * row, rng, 1.0f);
  std::vector<int64_t> dst_rows(dst_n);
  std::iota(dst_rows.begin(), dst_rows.end(), 0);
  std::shuffle(dst_rows.begin(), dst_rows.end(), rng);
  dst_rows.resize(n);
  std::vector<int64_t> src_rows(n);
  std::uniform_int_distribution<int64_t> pick(0, src_n - 1);
  for (auto& r : src_rows) r = pick(rng);
  std::vector<int64_t> idx(src_rows);
  idx.insert(idx.end(), dst_rows.begin(), dst_rows.end());
  Buffer src_g = Upload(*gpu, src), dst_g = Upload(*gpu, dst), idx_g = Upload(*gpu, idx);
  const auto* idx_d = static_cast<const int64_t*>(idx_g.data());
  ASSERT_TRUE(gpu->CopyRows(src_g.data(), dst_g.data(), row * 2, n, idx_d, idx_d + n).ok());
  ASSERT_TRUE(gpu->Synchronize().ok());
  ASSERT_TRUE(cpu->CopyRows(src.data(), dst.data(), row * 2, n, src_rows.data(), dst_rows.data()).ok());
  std::vector<bf16> got = Download<bf16>(*gpu, dst_g.data(), dst.size());
  size_t diff = 0;
  for (size_t i = 0; i < dst.size(); ++i) diff += got[i].bits != dst[i].bits;
  std::printf("[decode parity] CopyRows n=%d rows of %zu B: %zu differing elements (want 0)\n", n,
              row * 2, diff);
  EXPECT_EQ(diff, 0u);
  EXPECT_EQ(gpu->CopyRows(src_g.data(), dst_g.data(), 24, 1, idx_d, idx_d).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu->OpenPeerBuffer("short").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DecodeGpuTest, Copy2DMatchesCpu) {
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(31);
  // Chunk 37 of head 5 out of [n = 4096, h = 8, d = 128] into row 2 of a [h, 4 rows * C, d] set.
  const int n = 4096, h = 8, d = 128, C = 8;
  std::vector<bf16> src = RandomBf16(size_t(n) * h * d, rng, 1.0f);
  std::vector<bf16> dst = RandomBf16(size_t(h) * 4 * C * d, rng, 1.0f);
  Buffer src_g = Upload(*gpu, src), dst_g = Upload(*gpu, dst);
  const size_t row = size_t(d) * 2, pitch = size_t(h) * d * 2;
  const size_t src_off = (size_t(37) * C * h + 5) * d, dst_off = (size_t(5) * 4 * C + 2 * C) * d;
  ASSERT_TRUE(gpu->Copy2D(static_cast<bf16*>(dst_g.data()) + dst_off, row,
                          static_cast<const bf16*>(src_g.data()) + src_off, pitch, row, C).ok());
  ASSERT_TRUE(gpu->Copy(static_cast<bf16*>(dst_g.data()), static_cast<const bf16*>(src_g.data()) + 999, 4000).ok());
  ASSERT_TRUE(gpu->Synchronize().ok());
  ASSERT_TRUE(cpu->Copy2D(dst.data() + dst_off, row, src.data() + src_off, pitch, row, C).ok());
  ASSERT_TRUE(cpu->Copy(dst.data(), src.data() + 999, 4000).ok());
  std::vector<bf16> got = Download<bf16>(*gpu, dst_g.data(), dst.size());
  size_t diff = 0;
  for (size_t i = 0; i < dst.size(); ++i) diff += got[i].bits != dst[i].bits;
  EXPECT_EQ(diff, 0u);
  EXPECT_EQ(gpu->Copy2D(dst_g.data(), 8, src_g.data(), pitch, 16, 2).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace decode_gpu_test
}  // namespace kvshade::kernels

namespace kvshade::kernels {
namespace decode_gpu_test {
namespace {

TEST(DecodeGpuTest, FirstNonFiniteMatchesCpu) {
  // The device check of uploaded ingest parts: the first NaN or infinity, wherever it is
  // and however many follow, equals the CPU backend's answer.
  KVSHADE_CUDA_OR_SKIP(gpu);
  auto cpu = Cpu();
  auto rng = MakeRng(33);
  const size_t n = (size_t(1) << 22) + 37;  // many blocks of the grid-stride loop, and a tail
  std::vector<bf16> x = RandomBf16(n, rng, 100.0f);
  Buffer xg = Upload(*gpu, x);
  Buffer first = gpu->Allocate(sizeof(int64_t)).value();
  const bf16 nan = FloatToBf16(std::numeric_limits<float>::quiet_NaN());
  const bf16 inf = FloatToBf16(-std::numeric_limits<float>::infinity());
  std::vector<size_t> plants = {n, 0, 1, 255, 256, n / 2, n - 1};
  for (size_t p : plants) {
    std::vector<bf16> y = x;
    if (p < n) {
      y[p] = (p % 2) ? nan : inf;
      for (size_t q = p + 1000; q < n; q += n / 7) y[q] = nan;  // later ones in other blocks
      ASSERT_TRUE(gpu->CopyFromHost(xg.data(), y.data(), n * sizeof(bf16)).ok());
    } else {
      ASSERT_TRUE(gpu->CopyFromHost(xg.data(), x.data(), n * sizeof(bf16)).ok());
    }
    int64_t want = -1;
    ASSERT_TRUE(cpu->FirstNonFinite(y, absl::MakeSpan(&want, 1)).ok());
    ASSERT_TRUE(gpu->FirstNonFinite(absl::Span<const bf16>(static_cast<const bf16*>(xg.data()), n),
                                    absl::Span<int64_t>(static_cast<int64_t*>(first.data()), 1)).ok());
    const int64_t got = Download<int64_t>(*gpu, first.data(), 1)[0];
    EXPECT_EQ(got, want) << "planted at " << p;
    EXPECT_EQ(want, static_cast<int64_t>(p < n ? p : n));
  }
  // An empty array has none.
  ASSERT_TRUE(gpu->FirstNonFinite(absl::Span<const bf16>(), absl::Span<int64_t>(static_cast<int64_t*>(first.data()), 1)).ok());
  EXPECT_EQ(Download<int64_t>(*gpu, first.data(), 1)[0], 0);
}

}  // namespace
}  // namespace decode_gpu_test
}  // namespace kvshade::kernels
